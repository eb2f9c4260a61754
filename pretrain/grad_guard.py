"""The divergence guard: which optimizer steps to skip, and the hook that makes DeepSpeed skip them.

A non-finite loss or gradient makes DeepSpeed's ZeRO optimizer skip the step (its overflow path: no update,
gradients cleared); a finite gradient norm above ``spike_factor`` x the median of the last 64 accepted steps is
turned into the same skip, at most ``max_spike_skips`` times in a row (a norm that stays high is then taken,
clipped: :class:`GradGuard`). Every rank takes the same decision (the largest rank norm is judged). Skips are
counted (``skipped_steps``); ``max_consecutive_skips`` in a row stop training with :class:`DivergenceError`
(``pretrain/callbacks.py``'s ``DivergenceGuardCallback``), leaving the last periodic checkpoint as the valid one.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class DivergenceError(RuntimeError):
    """Too many optimizer steps in a row were skipped: training stops (``python -m pretrain.train`` exits 3)."""


def install_spike_guard(optimizer: Any, guard: GradGuard) -> None:
    """Make DeepSpeed's ZeRO optimizer treat a gradient-norm spike like an overflow (skip + clear grads)."""
    original = optimizer.scaled_global_norm

    def guarded_norm(*args: Any, **kwargs: Any) -> Any:
        norm = original(*args, **kwargs)
        value = float(norm)
        if not math.isfinite(value) or value < 0:  # DeepSpeed reports a NaN/inf norm as -1
            value = math.inf
        value = _max_over_ranks(value, norm.device if torch.is_tensor(norm) else None)
        invalid = not math.isfinite(value)
        guard.last_norm = float("nan") if invalid else value
        if invalid or guard.skip_spike(value):
            guard.spiked = not invalid
            # the step's skip path (gradients cleared, no update): DeepSpeed reads this flag right after the norm,
            # and with bf16 and check_grad_overflow off it would not set it for an invalid norm itself
            optimizer.overflow = True
        return norm

    optimizer.scaled_global_norm = guarded_norm


def _max_over_ranks(value: float, device: torch.device | None) -> float:
    """The largest of every rank's value. The guard's skip decision must be the same on every rank: DeepSpeed's
    norm of the expert parameters is local to a rank under expert parallelism (averaged over the expert-data-
    parallel group, of size 1 when the experts span all ranks), so ranks see different norms, and a rank that
    skips a step while another takes it leaves ZeRO's all-gather of the updated partitions unmatched: the next
    collective pairs with the wrong call and reads garbage (NaN losses right after a one-rank spike skip, seen
    on two GPUs). One scalar all-reduce per step; the guard then judges the largest rank norm."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    if device is None or (dist.get_backend() == "nccl" and device.type != "cuda"):
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


@dataclass
class GradGuard:
    """Which optimizer steps to skip. A non-finite gradient norm is always skipped. A finite norm above
    ``spike_factor`` x the median of the recent accepted norms is skipped as a one-batch outlier at most
    ``max_spike_skips`` steps in a row: a skip leaves the weights where they are, so when the norm stays high the
    next batches spike too and skipping them would only run into ``max_consecutive`` (seen on two GPUs, where
    a run at lr 1e-3 after a 3-step warm-up stopped at norms of 18-21 that one GPU had clipped and trained
    through). The next such step is taken (gradient clipping bounds it), counted in ``accepted_spikes``, and
    its norm joins the history."""

    spike_factor: float
    max_consecutive: int
    max_spike_skips: int = 2
    history: deque = field(default_factory=lambda: deque(maxlen=64))
    skipped: int = 0
    consecutive: int = 0
    spike_run: int = 0  # steps skipped for a spike since the last accepted step
    accepted_spikes: int = 0
    last_norm: float = float("nan")
    spiked: bool = False
    accepting: bool = False

    def is_spike(self, norm: float) -> bool:
        return len(self.history) >= 8 and norm > self.spike_factor * statistics.median(self.history)

    def skip_spike(self, norm: float) -> bool:
        """Whether this finite norm is a spike to skip (False for a spike that has lasted: it is taken)."""
        self.accepting = False
        if not self.is_spike(norm):
            return False
        if self.spike_run < self.max_spike_skips:
            return True
        self.accepting = True
        return False

    def after_step(self, overflow: bool) -> bool:
        """Record one optimizer step; True if it was skipped."""
        skipped = overflow or self.spiked
        if self.spiked:
            self.spike_run += 1
        self.spiked = False
        if skipped:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.consecutive = self.spike_run = 0
            self.accepted_spikes += self.accepting
            if math.isfinite(self.last_norm):
                self.history.append(self.last_norm)
        self.accepting = False
        return skipped

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "skipped": self.skipped, "consecutive": self.consecutive,
                "spike_run": self.spike_run, "accepted_spikes": self.accepted_spikes}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.history = deque(s["history"], maxlen=64)
        self.skipped, self.consecutive = s["skipped"], s["consecutive"]
        self.spike_run, self.accepted_spikes = s.get("spike_run", 0), s.get("accepted_spikes", 0)
