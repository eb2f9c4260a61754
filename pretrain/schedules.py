"""Learning-rate and batch-size schedules of the ``pretrain`` stage (MiniMax-01 report §4.2, Figure 13).

Three pieces, each usable on its own:

- :class:`WSDSchedule` — warm-up / stable / decay learning rate: a linear warm-up to the peak, a long
  constant phase, then a fast decay (exponential in the report: "we train 1T tokens and exponentially
  decrease the learning rate", §4.2). :meth:`WSDSchedule.lambda_for` gives the factor function for
  ``torch.optim.lr_scheduler.LambdaLR`` so a DeepSpeed engine (or a plain loop) can step it.
- :class:`BatchSizeSchedule` — the batch size doubles at configured token counts and/or when the
  smoothed training loss first falls below configured thresholds: the report's critical-batch-size
  rule, "the batch size is doubled when the corresponding loss is reached" (§4.2).
- :func:`fit_critical_batch_power_law` — the power law between training loss and critical batch size
  that those thresholds come from (Figure 13), and :func:`doubling_loss_thresholds`, which turns a fit
  into the loss thresholds for :class:`BatchSizeSchedule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DecayKind = Literal["exponential", "linear", "cosine"]
_DECAY_KINDS: tuple[str, ...] = ("exponential", "linear", "cosine")


def _check_count(name: str, value: Any, where: str) -> int:
    # bool is an int subclass and float steps are almost always a units mistake (tokens vs steps).
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{where}: {name} must be >= 0, got {value}")
    return int(value)


# --------------------------------------------------------------------------------------------------
# Learning rate: warm-up, constant, fast decay (§4.2)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WSDSchedule:
    """Warm-up / stable / decay learning rate, as a pure function of the optimizer step.

    - steps ``[0, warmup_steps]``: linear from 0 to ``peak_lr`` (``lr(warmup_steps) == peak_lr``);
    - the next ``constant_steps`` steps: ``peak_lr``;
    - the next ``decay_steps`` steps: from ``peak_lr`` down to ``peak_lr * final_lr_ratio``
      (``exponential``: geometric, a constant ratio per step, as in §4.2; ``linear``; ``cosine``);
    - after that: the final lr forever.

    The report's run: 500 warm-up iterations to 2e-4, constant, then exponential decay to 3e-5 (§4.2).
    Step ``k`` is the lr used by the ``k``-th optimizer step (0-based), which is what ``LambdaLR``
    gives when stepped once after every optimizer step.
    """

    peak_lr: float
    warmup_steps: int
    constant_steps: int
    decay_steps: int
    final_lr_ratio: float = 0.1
    decay: DecayKind = "exponential"

    def __post_init__(self) -> None:
        where = "WSDSchedule"
        if not isinstance(self.peak_lr, int | float) or not math.isfinite(self.peak_lr) or self.peak_lr <= 0:
            raise ValueError(f"{where}: peak_lr must be a finite number > 0, got {self.peak_lr!r}")
        for name in ("warmup_steps", "constant_steps", "decay_steps"):
            _check_count(name, getattr(self, name), where)
        if self.decay not in _DECAY_KINDS:
            raise ValueError(f"{where}: decay must be one of {_DECAY_KINDS}, got {self.decay!r}")
        ratio = self.final_lr_ratio
        if not isinstance(ratio, int | float) or not math.isfinite(ratio) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{where}: final_lr_ratio must be in [0, 1], got {ratio!r}")
        if self.decay == "exponential" and ratio == 0.0:
            raise ValueError(f"{where}: exponential decay cannot reach 0 (final_lr_ratio=0); "
                             "use a small positive ratio or decay='linear'/'cosine'")

    @classmethod
    def from_total(cls, peak_lr: float, total_steps: int, warmup_frac: float = 0.01, decay_frac: float = 0.1,
                   final_lr_ratio: float = 0.1, decay: DecayKind = "exponential") -> WSDSchedule:
        """A schedule of ``total_steps`` steps with the warm-up and decay phases given as fractions.

        The constant phase takes what is left. The report's decay phase is 1T of ~11.4T tokens (§4.2),
        about 9%, hence ``decay_frac=0.1`` by default.
        """
        where = "WSDSchedule.from_total"
        total = _check_count("total_steps", total_steps, where)
        for name, frac in (("warmup_frac", warmup_frac), ("decay_frac", decay_frac)):
            if not isinstance(frac, int | float) or not math.isfinite(frac) or not 0.0 <= frac <= 1.0:
                raise ValueError(f"{where}: {name} must be in [0, 1], got {frac!r}")
        if warmup_frac + decay_frac > 1.0:
            raise ValueError(f"{where}: warmup_frac + decay_frac = {warmup_frac + decay_frac:g} > 1; "
                             "the two phases cannot take more than all the steps")
        decay_steps = round(total * decay_frac)
        warmup_steps = min(round(total * warmup_frac), total - decay_steps)  # rounding never overshoots
        return cls(peak_lr=peak_lr, warmup_steps=warmup_steps,
                   constant_steps=total - warmup_steps - decay_steps, decay_steps=decay_steps,
                   final_lr_ratio=final_lr_ratio, decay=decay)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.constant_steps + self.decay_steps

    @property
    def final_lr(self) -> float:
        return self.peak_lr * self.final_lr_ratio

    def factor(self, step: int) -> float:
        """``lr(step) / peak_lr``; the one formula both :meth:`lr` and :meth:`lambda_for` use."""
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            raise TypeError(f"WSDSchedule: step must be an int, got {type(step).__name__} {step!r}")
        if step < 0:
            raise ValueError(f"WSDSchedule: step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return step / self.warmup_steps
        into_decay = step - self.warmup_steps - self.constant_steps
        if into_decay <= 0:
            return 1.0
        if into_decay >= self.decay_steps:
            return float(self.final_lr_ratio)  # exact, not a rounded power
        frac = into_decay / self.decay_steps
        if self.decay == "exponential":
            # Geometric: lr(t+1)/lr(t) = ratio**(1/decay_steps) for every decay step (§4.2).
            return self.final_lr_ratio ** frac
        if self.decay == "linear":
            return 1.0 + (self.final_lr_ratio - 1.0) * frac
        return self.final_lr_ratio + (1.0 - self.final_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        return self.peak_lr * self.factor(step)

    def lambda_for(self) -> Callable[[int], float]:
        """The factor function for ``torch.optim.lr_scheduler.LambdaLR`` (factor = lr / peak_lr).

        Build the optimizer with ``lr=peak_lr`` (LambdaLR multiplies each group's initial lr by the
        factor, so ``base_lr * factor(k) == lr(k)`` exactly). The returned object is a plain function,
        so LambdaLR's ``state_dict`` holds only its step count: resume by rebuilding the schedule from
        the same params and loading LambdaLR's state.
        """
        factor = self.factor

        def wsd_factor(step: int) -> float:
            return factor(step)

        return wsd_factor


# --------------------------------------------------------------------------------------------------
# Batch size: doubling at token counts and at loss thresholds (§4.2, critical batch size)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchSizeEvent:
    """One doubling trigger that fired: after update ``step`` (1-based), having seen ``tokens_seen``."""

    step: int
    tokens_seen: int
    old: int
    new: int  # == old when the batch was already at the maximum
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Trigger:
    kind: Literal["tokens", "loss"]
    threshold: float
    fired: bool = field(default=False)


class BatchSizeSchedule:
    """Batch size (in rows) that doubles at token counts and/or when the smoothed loss falls below
    thresholds — the report grows 16M → 32M → 64M → 128M tokens "when the corresponding loss is
    reached" (§4.2) — never above ``maximum``.

    Every entry of ``double_at_tokens`` and ``double_below_loss`` is one doubling, fired once. The loss
    is smoothed by an EMA (``ema_decay``; the first loss seeds it), so a single noisy step moves the
    smoothed value by only ``1 - ema_decay`` of its deviation and does not trigger a doubling.
    Call :meth:`update` once after every optimizer step; it returns the batch size for the next step.
    """

    def __init__(self, initial: int, maximum: int, double_at_tokens: Sequence[int] = (),
                 double_below_loss: Sequence[float] = (), ema_decay: float = 0.95) -> None:
        where = "BatchSizeSchedule"
        self.initial = _check_count("initial", initial, where)
        self.maximum = _check_count("maximum", maximum, where)
        if self.initial < 1:
            raise ValueError(f"{where}: initial must be >= 1 row, got {initial}")
        if self.maximum < self.initial:
            raise ValueError(f"{where}: maximum ({maximum}) must be >= initial ({initial})")
        tokens = [_check_count("double_at_tokens entry", t, where) for t in double_at_tokens]
        if any(t == 0 for t in tokens):
            raise ValueError(f"{where}: double_at_tokens entries must be > 0 (got {tokens}); "
                             "start with a larger `initial` instead of doubling at 0 tokens")
        losses = [float(x) for x in double_below_loss]
        if not all(math.isfinite(x) for x in losses):
            raise ValueError(f"{where}: double_below_loss entries must be finite, got {losses}")
        if not isinstance(ema_decay, int | float) or not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"{where}: ema_decay must be in [0, 1) (0 = no smoothing), got {ema_decay!r}")
        self.double_at_tokens = sorted(tokens)
        self.double_below_loss = sorted(losses, reverse=True)  # higher thresholds are reached first
        self.ema_decay = float(ema_decay)
        self._triggers = ([_Trigger("tokens", t) for t in self.double_at_tokens]
                          + [_Trigger("loss", x) for x in self.double_below_loss])
        self._batch_size = self.initial
        self._updates = 0
        self._tokens_seen = 0
        self._loss_ema: float | None = None
        self._events: list[BatchSizeEvent] = []

    @property
    def batch_size(self) -> int:
        """The batch size for the next step."""
        return self._batch_size

    @property
    def smoothed_loss(self) -> float | None:
        """The EMA of the losses seen so far (None before the first update)."""
        return self._loss_ema

    @property
    def events(self) -> list[BatchSizeEvent]:
        """Every trigger that fired, in order (``as_dict()`` each for logging)."""
        return list(self._events)

    def update(self, tokens_seen: int, loss: float) -> int:
        """Record a finished step (``tokens_seen``: cumulative tokens so far; ``loss``: its training loss)
        and return the batch size for the next step."""
        where = "BatchSizeSchedule.update"
        tokens_seen = _check_count("tokens_seen", tokens_seen, where)
        if tokens_seen < self._tokens_seen:
            raise ValueError(f"{where}: tokens_seen went backwards ({self._tokens_seen} -> {tokens_seen}); "
                             "pass the cumulative token count")
        loss = float(loss)
        if not math.isfinite(loss):
            raise ValueError(f"{where}: loss at step {self._updates + 1} is {loss}; the smoothed loss would "
                             "stay non-finite for the rest of the run, so it is refused (training diverged?)")
        self._updates += 1
        self._tokens_seen = tokens_seen
        beta = self.ema_decay
        self._loss_ema = loss if self._loss_ema is None else beta * self._loss_ema + (1.0 - beta) * loss
        for trig in self._triggers:
            if trig.fired:
                continue
            if trig.kind == "tokens" and tokens_seen >= trig.threshold:
                reason = f"tokens_seen {tokens_seen} >= {int(trig.threshold)}"
            elif trig.kind == "loss" and self._loss_ema < trig.threshold:
                reason = f"smoothed loss {self._loss_ema:.6g} < {trig.threshold:g}"
            else:
                continue
            trig.fired = True
            old, new = self._batch_size, min(2 * self._batch_size, self.maximum)
            if new == old:
                reason += f" (already at maximum {self.maximum})"
            self._batch_size = new
            self._events.append(BatchSizeEvent(self._updates, tokens_seen, old, new, reason))
        return self._batch_size

    def _config(self) -> dict[str, Any]:
        return {"initial": self.initial, "maximum": self.maximum, "double_at_tokens": self.double_at_tokens,
                "double_below_loss": self.double_below_loss, "ema_decay": self.ema_decay}

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (JSON-serialisable), so the state can sit in any checkpoint."""
        return {"config": self._config(), "batch_size": self._batch_size, "updates": self._updates,
                "tokens_seen": self._tokens_seen, "loss_ema": self._loss_ema,
                "fired": [t.fired for t in self._triggers], "events": [e.as_dict() for e in self._events]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the schedule must have been built with the same config."""
        saved = state.get("config")
        if saved != self._config():
            diff = {k: (saved.get(k) if isinstance(saved, dict) else None, v)
                    for k, v in self._config().items() if not isinstance(saved, dict) or saved.get(k) != v}
            raise ValueError("BatchSizeSchedule.load_state_dict: the checkpoint was written by a schedule "
                             f"with a different config ({{field: (saved, now)}} = {diff}); build the "
                             "schedule with the checkpoint's params to resume it")
        fired = list(state["fired"])
        if len(fired) != len(self._triggers):
            raise ValueError(f"BatchSizeSchedule.load_state_dict: {len(fired)} fired flags for "
                             f"{len(self._triggers)} triggers; the state is corrupt")
        for trig, flag in zip(self._triggers, fired, strict=True):
            trig.fired = bool(flag)
        self._batch_size = int(state["batch_size"])
        self._updates = int(state["updates"])
        self._tokens_seen = int(state["tokens_seen"])
        self._loss_ema = None if state["loss_ema"] is None else float(state["loss_ema"])
        self._events = [BatchSizeEvent(**e) for e in state["events"]]


# --------------------------------------------------------------------------------------------------
# Critical batch size vs loss: the power law of Figure 13
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PowerLawFit:
    """``B_crit(L) = b_star * L ** (-exponent)``, fitted in log space.

    The report fits "a power-law relationship between the loss and the critical batch size" (§4.2,
    Figure 13) without printing the formula; this is the form of the law it builds on, Kaplan et al.
    (2020) eq. 1.4, ``B_crit(L) = B_* / L**(1/alpha_B)`` — so ``exponent = 1/alpha_B`` (Kaplan:
    ``B_* ~ 2e8`` tokens, ``alpha_B ~ 0.21``). ``r2`` is the coefficient of determination of the
    straight-line fit ``log B = log b_star - exponent * log L`` (the space it was fitted in).
    Batch sizes are in whatever unit they were given in (the report uses tokens).
    """

    b_star: float
    exponent: float
    r2: float
    n_points: int

    @property
    def alpha_b(self) -> float:
        """Kaplan's ``alpha_B = 1 / exponent``."""
        return math.inf if self.exponent == 0 else 1.0 / self.exponent

    @overload
    def predict(self, loss: float) -> float: ...
    @overload
    def predict(self, loss: np.ndarray | Sequence[float]) -> np.ndarray: ...

    def predict(self, loss: float | np.ndarray | Sequence[float]) -> float | np.ndarray:
        """The critical batch size at training loss ``loss`` (> 0)."""
        x = np.asarray(loss, dtype=np.float64)
        if not np.all(np.isfinite(x) & (x > 0)):
            raise ValueError(f"PowerLawFit.predict: loss must be finite and > 0, got {loss!r}")
        out = self.b_star * x ** (-self.exponent)
        return float(out) if out.ndim == 0 else out

    def loss_at(self, batch_size: float) -> float:
        """The loss at which the critical batch size reaches ``batch_size`` (the inverse of predict)."""
        if not math.isfinite(batch_size) or batch_size <= 0:
            raise ValueError(f"PowerLawFit.loss_at: batch_size must be finite and > 0, got {batch_size!r}")
        if self.exponent == 0:
            raise ValueError("PowerLawFit.loss_at: the fitted exponent is 0 (the critical batch size does "
                             "not depend on the loss), so no loss corresponds to a batch size")
        return (self.b_star / batch_size) ** (1.0 / self.exponent)

    def formula(self) -> str:
        return f"B_crit = {self.b_star:.3g} · L^(-{self.exponent:.3g})"


def _positive_1d(where: str, name: str, values: Sequence[float]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{where}: {name} must be a 1-D sequence, got shape {arr.shape}")
    bad = ~(np.isfinite(arr) & (arr > 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{where}: every {name} value must be finite and > 0 (a power "
                         f"law is fitted on logs); {name}[{i}] = {float(arr[i])!r}")
    return arr


def fit_critical_batch_power_law(losses: Sequence[float], batch_sizes: Sequence[float]) -> PowerLawFit:
    """Least-squares fit of ``B_crit = b_star * L**(-exponent)`` in log-log space (§4.2, Figure 13).

    ``losses[i]`` is the training loss at which ``batch_sizes[i]`` was measured to be the critical
    batch size (e.g. from small models, as the report does with 50M-600M activated parameters).
    """
    if len(losses) != len(batch_sizes):
        raise ValueError(f"fit_critical_batch_power_law: {len(losses)} losses but {len(batch_sizes)} batch "
                         "sizes; give one batch size per loss")
    if len(losses) < 2:
        raise ValueError(f"fit_critical_batch_power_law: need at least 2 (loss, batch size) points to fit a "
                         f"power law, got {len(losses)}")
    where = "fit_critical_batch_power_law"
    x = np.log(_positive_1d(where, "losses", losses))
    y = np.log(_positive_1d(where, "batch_sizes", batch_sizes))
    dx = x - x.mean()
    sxx = float(dx @ dx)
    if sxx == 0.0:
        raise ValueError("fit_critical_batch_power_law: all losses are equal, so the exponent is undetermined; "
                         "measure the critical batch size at several different losses")
    slope = float(dx @ (y - y.mean())) / sxx
    intercept = float(y.mean() - slope * x.mean())
    resid = y - (intercept + slope * x)
    ss_res = float(resid @ resid)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0  # all batch sizes equal: the flat line is exact
    return PowerLawFit(b_star=math.exp(intercept), exponent=-slope, r2=r2, n_points=len(x))


def doubling_loss_thresholds(fit: PowerLawFit, initial: float, maximum: float) -> list[float]:
    """Losses at which the fitted critical batch size reaches each doubling of ``initial``.

    "The batch size is doubled when the corresponding loss is reached" (§4.2): the k-th threshold is
    ``fit.loss_at(min(initial * 2**k, maximum))``, up to ``maximum``, in falling order — the
    ``double_below_loss`` of :class:`BatchSizeSchedule`. ``initial``/``maximum`` are in the fit's unit
    (tokens if the fit was on tokens: pass ``rows * seq_len``).
    """
    if not (math.isfinite(initial) and initial > 0 and math.isfinite(maximum) and maximum >= initial):
        raise ValueError(f"doubling_loss_thresholds: need 0 < initial <= maximum, got initial={initial!r}, "
                         f"maximum={maximum!r}")
    if fit.exponent <= 0:
        raise ValueError(f"doubling_loss_thresholds: the fit ({fit.formula()}) has a critical batch size "
                         "that does not grow as the loss falls, so no loss thresholds follow from it")
    thresholds: list[float] = []
    size = float(initial)
    while size < maximum:
        size = min(2.0 * size, float(maximum))
        thresholds.append(fit.loss_at(size))
    return thresholds


def plot_power_law(fit: PowerLawFit, losses: Sequence[float], batch_sizes: Sequence[float],
                   doubling_losses: Sequence[float] = (), batch_unit: str = "tokens") -> Figure:
    """Log-log scatter of the measured points and the fitted line (like Figure 13); optional dashed gray
    vertical lines where the batch size is doubled. Rendered with the Agg backend, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global backend state in a worker

    where = "plot_power_law"
    x = _positive_1d(where, "losses", losses)
    y = _positive_1d(where, "batch_sizes", batch_sizes)
    fig = Figure(figsize=(5.5, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.scatter(x, y, s=18, color="tab:blue", label="measured", zorder=3)
    marks = _positive_1d(where, "doubling_losses", doubling_losses) if len(doubling_losses) else np.empty(0)
    span = np.concatenate([x, marks])
    lo, hi = float(span.min()), float(span.max())
    grid = np.geomspace(lo / 1.05, hi * 1.05, 200)
    ax.plot(grid, fit.predict(grid), color="tab:red", label=f"fit, R² = {fit.r2:.4f}")
    for i, loss in enumerate(marks):
        ax.axvline(loss, color="gray", linestyle="--", linewidth=0.9, label="batch doubled" if i == 0 else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training loss L")
    ax.set_ylabel(f"critical batch size ({batch_unit})")
    ax.set_title(f"Critical batch size vs loss: {fit.formula()}", fontsize=10)
    ax.legend(fontsize=8)
    return fig
