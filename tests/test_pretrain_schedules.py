"""Schedules of the pretrain stage (report §4.2, Figure 13): WSD learning rate, batch-size doubling,
the loss / critical-batch-size power law."""

import io
import json
import math

import numpy as np
import pytest
import torch

from pretrain.schedules import (
    BatchSizeSchedule,
    PowerLawFit,
    WSDSchedule,
    doubling_loss_thresholds,
    fit_critical_batch_power_law,
    plot_power_law,
)

# --------------------------------------------------------------------------------------------------
# WSDSchedule
# --------------------------------------------------------------------------------------------------


def test_warmup_is_linear_from_zero_and_hits_peak_exactly_at_warmup_steps() -> None:
    s = WSDSchedule(peak_lr=2e-4, warmup_steps=500, constant_steps=100, decay_steps=50)
    assert s.lr(0) == 0.0
    assert s.lr(500) == 2e-4  # exact, not approximately
    for k in range(0, 501, 7):
        assert s.lr(k) == pytest.approx(2e-4 * k / 500, rel=1e-14, abs=0)
    steps = np.diff([s.lr(k) for k in range(501)])
    np.testing.assert_allclose(steps, 2e-4 / 500, rtol=1e-9)  # equal increments: linear


def test_constant_phase_holds_the_peak() -> None:
    s = WSDSchedule(peak_lr=3e-4, warmup_steps=10, constant_steps=40, decay_steps=20)
    assert {s.lr(k) for k in range(10, 51)} == {3e-4}
    assert s.lr(51) < 3e-4  # decay starts right after


def test_exponential_decay_is_geometric_monotone_and_ends_exactly_at_final_lr() -> None:
    # The report's tail: peak 1.3e-4 decayed exponentially to 3e-5 (§4.2).
    peak, final = 1.3e-4, 3e-5
    s = WSDSchedule(peak_lr=peak, warmup_steps=5, constant_steps=10, decay_steps=64, final_lr_ratio=final / peak)
    start, end = 15, 15 + 64
    lrs = np.array([s.lr(k) for k in range(start, end + 1)])
    np.testing.assert_allclose(lrs[1:] / lrs[:-1], (final / peak) ** (1 / 64), rtol=1e-12)
    assert s.lr(end) == peak * (final / peak) == s.final_lr
    assert all(s.lr(k) == s.final_lr for k in range(end, end + 100))  # stays at the final lr
    whole = np.array([s.lr(k) for k in range(end + 10)])
    assert np.all(np.diff(whole[:5 + 1]) > 0) and np.all(np.diff(whole[5:]) <= 0)


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_linear_and_cosine_decay_reach_final_lr_through_the_midpoint(decay: str) -> None:
    s = WSDSchedule(peak_lr=1.0, warmup_steps=0, constant_steps=4, decay_steps=10, final_lr_ratio=0.2,
                    decay=decay)  # type: ignore[arg-type]
    assert s.lr(0) == 1.0  # no warm-up: the peak from the first step
    assert s.lr(4 + 5) == pytest.approx(0.6, rel=1e-12)  # both pass (peak + final) / 2 halfway
    assert s.lr(14) == 0.2 and s.lr(1000) == 0.2
    lrs = np.array([s.lr(k) for k in range(4, 15)])
    assert np.all(np.diff(lrs) < 0)
    if decay == "linear":
        np.testing.assert_allclose(np.diff(lrs), -0.08, rtol=1e-9)
    else:  # cosine is flat at both ends, steepest in the middle
        d = -np.diff(lrs)
        assert d[0] < d[4] and d[-1] < d[5]


def test_from_total_splits_the_phases_by_fraction() -> None:
    s = WSDSchedule.from_total(2e-4, 1000, warmup_frac=0.01, decay_frac=0.1, final_lr_ratio=0.15)
    assert (s.warmup_steps, s.constant_steps, s.decay_steps) == (10, 890, 100)
    assert s.total_steps == 1000 and s.lr(10) == 2e-4 and s.lr(1000) == pytest.approx(3e-5, rel=1e-12)
    # fractions summing to 1 with both rounding up never overshoot the total
    t = WSDSchedule.from_total(1.0, 7, warmup_frac=0.5, decay_frac=0.5)  # 3.5 + 3.5 both round to 4
    assert (t.warmup_steps, t.constant_steps, t.decay_steps) == (3, 0, 4)


@pytest.mark.parametrize("kwargs, match", [
    ({"peak_lr": 0.0}, "peak_lr must be a finite number > 0"),
    ({"peak_lr": math.nan}, "peak_lr"),
    ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
    ({"decay_steps": 10.0}, "decay_steps must be an int"),
    ({"final_lr_ratio": 1.5}, r"final_lr_ratio must be in \[0, 1\]"),
    ({"final_lr_ratio": 0.0}, "exponential decay cannot reach 0"),
    ({"decay": "step"}, "decay must be one of"),
])
def test_wsd_rejects_bad_arguments_with_the_field_named(kwargs: dict, match: str) -> None:
    base = {"peak_lr": 1e-3, "warmup_steps": 10, "constant_steps": 10, "decay_steps": 10}
    with pytest.raises((ValueError, TypeError), match=match):
        WSDSchedule(**{**base, **kwargs})


def test_from_total_and_lr_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="warmup_frac \\+ decay_frac = 1.2 > 1"):
        WSDSchedule.from_total(1e-3, 100, warmup_frac=0.3, decay_frac=0.9)
    with pytest.raises(ValueError, match="decay_frac must be in"):
        WSDSchedule.from_total(1e-3, 100, decay_frac=-0.1)
    with pytest.raises(ValueError, match="step must be >= 0"):
        WSDSchedule(1e-3, 1, 1, 1).lr(-1)


def _sgd_run(schedule: WSDSchedule, steps: int, resume_at: int | None = None) -> list[tuple[float, float]]:
    """(lr in the optimizer, actual parameter change) per step of a real SGD run stepped by LambdaLR."""
    def build() -> tuple[torch.nn.Parameter, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = torch.optim.SGD([p], lr=schedule.peak_lr)
        return p, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule.lambda_for())

    p, opt, sched = build()
    out = []
    for k in range(steps):
        if k == resume_at:  # checkpoint, then continue in fresh objects
            saved = (p.detach().clone(), opt.state_dict(), sched.state_dict())
            p, opt, sched = build()
            with torch.no_grad():
                p.copy_(saved[0])
            opt.load_state_dict(saved[1])
            sched.load_state_dict(saved[2])
        before = p.item()
        opt.zero_grad()
        p.sum().backward()  # gradient 1: the update is exactly -lr
        opt.step()
        out.append((opt.param_groups[0]["lr"], before - p.item()))
        sched.step()
    return out


def test_lambda_lr_drives_a_real_optimizer_at_exactly_lr_of_step() -> None:
    s = WSDSchedule(peak_lr=0.5, warmup_steps=8, constant_steps=5, decay_steps=12, final_lr_ratio=0.05)
    run = _sgd_run(s, s.total_steps + 5)
    for k, (lr_in_opt, moved) in enumerate(run):
        assert lr_in_opt == s.lr(k)  # base_lr * factor == peak * factor, bit for bit
        assert moved == pytest.approx(s.lr(k), rel=1e-12, abs=1e-15)


def test_lambda_lr_resumes_from_its_own_state_dict() -> None:
    s = WSDSchedule(peak_lr=0.5, warmup_steps=8, constant_steps=5, decay_steps=12, final_lr_ratio=0.05)
    straight = _sgd_run(s, 30)
    for resume_at in (3, 13, 20):
        assert _sgd_run(s, 30, resume_at=resume_at) == straight


# --------------------------------------------------------------------------------------------------
# BatchSizeSchedule
# --------------------------------------------------------------------------------------------------


def test_batch_doubles_at_each_token_count() -> None:
    b = BatchSizeSchedule(initial=4, maximum=64, double_at_tokens=[250, 100])
    sizes = [b.update(tokens_seen=40 * k, loss=3.0) for k in range(1, 11)]
    # 120 tokens (step 3) passes 100, 280 tokens (step 7) passes 250
    assert sizes == [4, 4, 8, 8, 8, 8, 16, 16, 16, 16]
    assert [(e.step, e.tokens_seen, e.old, e.new) for e in b.events] == [(3, 120, 4, 8), (7, 280, 8, 16)]
    assert b.events[0].reason == "tokens_seen 120 >= 100"


def test_batch_doubles_when_the_smoothed_loss_falls_below_a_threshold_not_on_one_noisy_step() -> None:
    beta, thr = 0.9, 2.5
    b = BatchSizeSchedule(initial=16, maximum=1024, double_below_loss=[thr], ema_decay=beta)
    for k in range(1, 21):
        assert b.update(k * 100, 3.0) == 16
    assert b.update(2100, 1.0) == 16  # one step far below the threshold: EMA 0.9*3 + 0.1*1 = 2.8
    assert b.smoothed_loss == pytest.approx(2.8, rel=1e-12)
    # Then a sustained 2.0: the EMA is 2.0 + 0.8 * 0.9**n after n steps; first below 2.5 at n = 5.
    expected_n = next(n for n in range(1, 100) if 2.0 + 0.8 * beta**n < thr)
    assert expected_n == 5
    sizes = [b.update(2100 + 100 * n, 2.0) for n in range(1, 10)]
    assert sizes == [16] * (expected_n - 1) + [32] * (10 - expected_n)
    (event,) = b.events
    assert (event.step, event.old, event.new) == (21 + expected_n, 16, 32)
    assert event.reason.startswith("smoothed loss 2.4") and event.reason.endswith("< 2.5")


def test_batch_never_exceeds_the_maximum() -> None:
    b = BatchSizeSchedule(initial=8, maximum=20, double_at_tokens=[10, 20, 30], double_below_loss=[1.0],
                          ema_decay=0.0)
    assert [b.update(t, 2.0) for t in (10, 20, 30)] == [16, 20, 20]
    assert b.update(40, 0.1) == 20 and b.update(50, 0.1) == 20
    assert [(e.old, e.new) for e in b.events] == [(8, 16), (16, 20), (20, 20), (20, 20)]
    assert "already at maximum 20" in b.events[-1].reason


def _noisy_run(seed: int = 0, steps: int = 400) -> list[tuple[int, float]]:
    rng = np.random.default_rng(seed)
    losses = 4.0 * np.exp(-np.arange(steps) / 150) + 1.5 + rng.normal(0, 0.15, steps)
    return [(int(512 * (k + 1)), float(x)) for k, x in enumerate(losses)]


def test_resumed_batch_schedule_doubles_at_exactly_the_same_steps() -> None:
    cfg = {"initial": 2, "maximum": 64, "double_at_tokens": [150_000], "double_below_loss": [4.0, 3.0, 2.5],
           "ema_decay": 0.95}
    data = _noisy_run()
    straight = BatchSizeSchedule(**cfg)
    sizes = [straight.update(t, x) for t, x in data]
    assert len(straight.events) == 4 and sizes[-1] == 32
    # resume just before each doubling (the hardest place) and at an arbitrary step
    for cut in [e.step - 1 for e in straight.events] + [123]:
        first = BatchSizeSchedule(**cfg)
        resumed_sizes = [first.update(t, x) for t, x in data[:cut]]
        state = json.loads(json.dumps(first.state_dict()))  # plain values survive a JSON checkpoint
        second = BatchSizeSchedule(**cfg)
        second.load_state_dict(state)
        resumed_sizes += [second.update(t, x) for t, x in data[cut:]]
        assert resumed_sizes == sizes
        assert second.events == straight.events
        assert second.state_dict() == straight.state_dict()


def test_load_state_dict_refuses_a_schedule_with_another_config() -> None:
    state = BatchSizeSchedule(2, 64, double_below_loss=[3.0]).state_dict()
    with pytest.raises(ValueError, match=r"different config .*double_below_loss.*\[3.0\], \[2.0\]"):
        BatchSizeSchedule(2, 64, double_below_loss=[2.0]).load_state_dict(state)


def test_batch_schedule_rejects_bad_arguments_and_inputs() -> None:
    with pytest.raises(ValueError, match=r"maximum \(4\) must be >= initial \(8\)"):
        BatchSizeSchedule(8, 4)
    with pytest.raises(ValueError, match="initial must be >= 1"):
        BatchSizeSchedule(0, 4)
    with pytest.raises(ValueError, match="ema_decay must be in"):
        BatchSizeSchedule(1, 4, ema_decay=1.0)
    with pytest.raises(ValueError, match="double_below_loss entries must be finite"):
        BatchSizeSchedule(1, 4, double_below_loss=[math.inf])
    b = BatchSizeSchedule(1, 4, double_below_loss=[1.0])
    b.update(100, 2.0)
    with pytest.raises(ValueError, match="tokens_seen went backwards"):
        b.update(50, 2.0)
    with pytest.raises(ValueError, match="loss at step 2 is nan"):
        b.update(200, math.nan)
    assert b.smoothed_loss == 2.0  # a refused update changes nothing


# --------------------------------------------------------------------------------------------------
# Critical batch size power law (Figure 13)
# --------------------------------------------------------------------------------------------------

# Kaplan et al. (2020) eq. 1.4: B_crit = B_* / L**(1/alpha_B), B_* ~ 2e8 tokens, alpha_B ~ 0.21.
B_STAR, ALPHA_B = 2e8, 0.21


def test_power_law_fit_recovers_exact_coefficients() -> None:
    losses = np.geomspace(1.8, 4.5, 12)
    sizes = B_STAR * losses ** (-1 / ALPHA_B)
    fit = fit_critical_batch_power_law(list(losses), list(sizes))
    assert fit.b_star == pytest.approx(B_STAR, rel=1e-9)
    assert fit.exponent == pytest.approx(1 / ALPHA_B, rel=1e-9)
    assert fit.alpha_b == pytest.approx(ALPHA_B, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12) and fit.n_points == 12
    np.testing.assert_allclose(fit.predict(losses), sizes, rtol=1e-9)
    assert fit.loss_at(fit.predict(2.5)) == pytest.approx(2.5, rel=1e-12)
    assert isinstance(fit.predict(2.5), float)


def test_power_law_fit_recovers_coefficients_from_noisy_data_within_5_percent() -> None:
    rng = np.random.default_rng(1234)
    losses = rng.uniform(1.8, 4.5, 200)
    sizes = B_STAR * losses ** (-1 / ALPHA_B) * np.exp(rng.normal(0, 0.05, 200))  # 5% multiplicative noise
    fit = fit_critical_batch_power_law(losses, sizes)
    assert abs(fit.b_star / B_STAR - 1) < 0.05
    assert abs(fit.alpha_b / ALPHA_B - 1) < 0.05
    assert 0.95 < fit.r2 < 1.0  # noise costs a little R²


def test_power_law_fit_rejects_unusable_input() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        fit_critical_batch_power_law([3.0], [1e6])
    with pytest.raises(ValueError, match=r"batch_sizes\[1\] = 0.0"):
        fit_critical_batch_power_law([3.0, 2.0], [1e6, 0.0])
    with pytest.raises(ValueError, match=r"losses\[0\] = -1.0"):
        fit_critical_batch_power_law([-1.0, 2.0], [1e6, 2e6])
    with pytest.raises(ValueError, match="3 losses but 2 batch sizes"):
        fit_critical_batch_power_law([3.0, 2.0, 1.0], [1e6, 2e6])
    with pytest.raises(ValueError, match="all losses are equal"):
        fit_critical_batch_power_law([2.0, 2.0], [1e6, 2e6])


def test_doubling_thresholds_follow_the_fit_and_drive_the_batch_schedule() -> None:
    fit = PowerLawFit(b_star=B_STAR, exponent=1 / ALPHA_B, r2=1.0, n_points=2)
    seq = 8192
    # The report's ladder: 16M -> 32M -> 64M -> 128M tokens per batch (§4.2), in rows of 8192 tokens.
    thresholds = doubling_loss_thresholds(fit, 2048 * seq, 16384 * seq)
    assert len(thresholds) == 3 and thresholds == sorted(thresholds, reverse=True)
    np.testing.assert_allclose(fit.predict(np.array(thresholds)), [4096 * seq, 8192 * seq, 16384 * seq],
                               rtol=1e-12)
    assert doubling_loss_thresholds(fit, 10.0, 25.0) == [fit.loss_at(20.0), fit.loss_at(25.0)]
    b = BatchSizeSchedule(2048, 16384, double_below_loss=thresholds, ema_decay=0.0)
    losses = np.linspace(thresholds[0] + 0.05, thresholds[-1] - 0.05, 50)
    sizes = [b.update(seq * 2048 * (k + 1), x) for k, x in enumerate(losses)]
    assert sizes[-1] == 16384 and [e.new for e in b.events] == [4096, 8192, 16384]
    for e, thr in zip(b.events, thresholds, strict=True):  # each doubling at the first loss below it
        assert losses[e.step - 1] < thr <= losses[e.step - 2]
    with pytest.raises(ValueError, match="does not grow as the loss falls"):
        doubling_loss_thresholds(PowerLawFit(1.0, -0.5, 1.0, 2), 1.0, 4.0)


def test_plot_power_law_renders_a_png_with_the_formula() -> None:
    losses = np.geomspace(1.8, 4.5, 10)
    sizes = B_STAR * losses ** (-1 / ALPHA_B)
    fit = fit_critical_batch_power_law(losses, sizes)
    fig = plot_power_law(fit, losses, sizes, doubling_losses=doubling_loss_thresholds(fit, 1e6, 8e6))
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert fit.formula() in ax.get_title() and "4.76" in fit.formula()
    assert ax.get_xlabel() == "training loss L" and "critical batch size" in ax.get_ylabel()
    assert len(ax.lines) == 1 + 3  # fitted line + three dashed doubling marks
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    png = buf.getvalue()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
