"""MoE spec: eq. 1 routing, aux loss against a hand computation, capacity token drop and its accounting,
padding kept out of routing, dropless eval, the model-level drop counters; the experts' dense and grouped paths
against the per-expert loop, and which path a call takes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model import moe as moe_module
from model.modeling import HybridForCausalLM
from model.moe import MoEFeedForward, SwiGLUExperts, capacity_keep_mask, expert_capacity, grouped_mm_supported
from model.sizes import config_for


def _moe(num_experts=4, hidden=4, top_k=2, capacity_factor=1.0, seed=0) -> MoEFeedForward:
    torch.manual_seed(seed)
    moe = MoEFeedForward(
        hidden, 6, num_experts, top_k, capacity_factor=capacity_factor, token_drop=True
    ).double()
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(num_experts, hidden, dtype=torch.float64))  # logits = x[:, :E]
        moe.experts.gate_up_proj.normal_(0, 0.5)
        moe.experts.down_proj.normal_(0, 0.5)
    return moe


def _ffn(moe: MoEFeedForward, e: int, x: torch.Tensor) -> torch.Tensor:
    w = moe.experts.gate_up_proj[e]
    gate, up = x @ w[:6].T, x @ w[6:].T
    return (F.silu(gate) * up) @ moe.experts.down_proj[e].T


def test_router_weights_are_the_softmax_over_the_selected_logits_eq1():
    moe = _moe()
    x = torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.5, -2.0, 1.5, 1.0]], dtype=torch.float64)
    logits, probs, top_w, top_i = moe.router(x)
    assert top_i.tolist() == [[0, 1], [2, 3]]
    for t in range(2):
        selected = logits[t, top_i[t]]
        torch.testing.assert_close(top_w[t], torch.softmax(selected, dim=0).to(top_w.dtype))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, dtype=probs.dtype))


def test_aux_loss_matches_a_hand_computation():
    moe = _moe().eval()
    rows = [[3.0, 2.0, 0.0, -1.0], [0.5, -2.0, 1.5, 1.0], [0.0, 1.0, 2.0, 0.5], [9.0, 9.0, 9.0, 9.0]]
    x = torch.tensor(rows, dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])  # the last token is padding
    out = moe(x[None], mask[None])

    # by hand: softmax per real token, top-2 by probability, f = share of the 6 routed slots, m = mean prob
    E, real = 4, rows[:3]
    probs = [[math.exp(v) / sum(math.exp(u) for u in r) for v in r] for r in real]
    slots = [0] * E
    for p in probs:
        for e in sorted(range(E), key=lambda e: -p[e])[:2]:
            slots[e] += 1
    f = [s / (3 * 2) for s in slots]
    m = [sum(p[e] for p in probs) / 3 for e in range(E)]
    expected = sum(fi * mi for fi, mi in zip(f, m, strict=True)) / E
    assert out.aux_loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.routed.tolist() == slots  # padding is not routed
    assert out.dropped.tolist() == [0, 0, 0, 0]  # eval is dropless


def test_capacity_drops_second_choices_before_first_choices_and_counts_them():
    # capacity = ceil(1.0 * 2 tokens * 2 / 4 experts) = 1 slot per expert.
    # token A prefers (0, 1); token B prefers (1, 2). Expert 1 gets A's 2nd and B's 1st choice: B's first
    # choice is admitted first (GShard rank order), A's second choice is dropped although A comes first.
    moe = _moe(capacity_factor=1.0).train()
    a, b = [3.0, 2.0, 0.0, -1.0], [-1.0, 3.0, 2.0, 0.0]
    x = torch.tensor([a, b], dtype=torch.float64)
    assert expert_capacity(2, 2, 4, 1.0) == 1
    out = moe(x[None])
    assert out.routed.tolist() == [1, 2, 1, 0]
    assert out.dropped.tolist() == [0, 1, 0, 0]
    assert (out.routed - out.dropped).sum().item() == 3  # routed = kept + dropped

    def weights(row, pair):
        z = [math.exp(row[e]) for e in pair]
        return [v / sum(z) for v in z]

    wa, wb = weights(a, (0, 1)), weights(b, (1, 2))
    expected_a = wa[0] * _ffn(moe, 0, x[0])  # A's slot for expert 1 was dropped: no renormalisation
    expected_b = wb[0] * _ffn(moe, 1, x[1]) + wb[1] * _ffn(moe, 2, x[1])
    torch.testing.assert_close(out.hidden[0, 0], expected_a)
    torch.testing.assert_close(out.hidden[0, 1], expected_b)

    moe.eval()  # dropless: A gets both experts
    out = moe(x[None])
    assert out.dropped.tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(out.hidden[0, 0], wa[0] * _ffn(moe, 0, x[0]) + wa[1] * _ffn(moe, 1, x[0]))


def test_overloaded_expert_keeps_the_earliest_tokens_up_to_capacity():
    moe = _moe(capacity_factor=1.0).train()
    x = torch.tensor([[4.0, 2.0, 0.0, -1.0]] * 6, dtype=torch.float64)  # all 6 tokens choose (0, 1)
    out = moe(x[None])
    cap = expert_capacity(6, 2, 4, 1.0)
    assert cap == 3
    assert out.routed.tolist() == [6, 6, 0, 0]
    assert out.dropped.tolist() == [3, 3, 0, 0]
    assert torch.all(out.hidden[0, 3:] == 0)  # tokens past capacity got nothing from any expert
    assert torch.all(out.hidden[0, :3].abs().sum(-1) > 0)


def test_padding_neither_consumes_capacity_nor_counts():
    top_i = torch.tensor([[0, 1], [0, 1], [0, 1]])
    valid = torch.tensor([[False, False], [True, True], [True, True]])  # token 0 is padding
    keep = capacity_keep_mask(top_i, valid, num_experts=4, capacity=2)
    assert keep.tolist() == [[False, False], [True, True], [True, True]]
    keep = capacity_keep_mask(top_i, torch.ones_like(valid), num_experts=4, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [False, False]]


@pytest.mark.parametrize("seed", range(6))
def test_capacity_admission_is_rank_major_first_come_against_a_reference(seed):
    """The sort-based admission keeps exactly the slots GShard's order keeps: all first choices before any second,
    token order within a choice rank, padding competing for nothing (reference: a Python loop)."""
    g = torch.Generator().manual_seed(seed)
    n, k, e = 37, 2, 5
    top_i = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    valid = (torch.rand(n, generator=g) > 0.2)[:, None].expand(n, k)
    capacity = int(torch.randint(1, 12, (1,), generator=g))
    used, want = [0] * e, torch.zeros(n, k, dtype=torch.bool)
    for rank in range(k):
        for t in range(n):
            if valid[t, rank] and used[int(top_i[t, rank])] < capacity:
                used[int(top_i[t, rank])] += 1
                want[t, rank] = True
    assert torch.equal(capacity_keep_mask(top_i, valid, e, capacity), want)


def _eq1_reference(moe: MoEFeedForward, x: torch.Tensor, mask: torch.Tensor, drop: bool) -> torch.Tensor:
    """Eq. 1 from scratch, token by token (Python loops): softmax over all logits, top-k renormalised, GShard
    admission under ceil(cf * real tokens * k / E) when ``drop``, each kept slot's SwiGLU expert weighted."""
    w_g, gate_up, down = moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj
    f = down.shape[-1]
    n, k, e = x.shape[0], moe.top_k, moe.num_experts
    probs = torch.softmax(x @ w_g.t(), dim=-1)
    top_w, top_i = probs.topk(k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    capacity = math.ceil(moe.capacity_factor * int(mask.sum()) * k / e) if drop else n * k
    used, out = [0] * e, torch.zeros_like(x)
    for rank in range(k):
        for t in range(n):
            ex = int(top_i[t, rank])
            if not mask[t] or used[ex] >= capacity:
                continue
            used[ex] += 1
            h = gate_up[ex] @ x[t]
            out[t] += top_w[t, rank] * (down[ex] @ (torch.nn.functional.silu(h[:f]) * h[f:]))
    return out


@pytest.mark.parametrize("drop", [True, False], ids=["token-drop", "dropless"])
def test_the_layer_equals_eq1_computed_token_by_token_in_float64(drop):
    """The whole layer (admission, sorted dispatch, the experts, combine) against a from-scratch reference: float64,
    padding in the middle of the batch, a capacity that drops slots."""
    torch.manual_seed(3)
    moe = MoEFeedForward(16, 24, 5, 2, capacity_factor=0.7, token_drop=drop).double().train()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[0, 7:12] = False
    out = moe(x, mask)
    assert (int(out.dropped.sum()) > 5) == drop
    want = _eq1_reference(moe, x.reshape(-1, 16), mask.reshape(-1), drop)
    torch.testing.assert_close(out.hidden.reshape(-1, 16), want, rtol=1e-12, atol=1e-12)


def test_model_reports_drops_per_layer_in_training_and_none_in_eval():
    torch.manual_seed(0)
    cfg = config_for(
        "tiny", num_hidden_layers=2, attention_pattern=["lightning", "softmax"], capacity_factor=0.5
    )
    model = HybridForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :4] = 0  # left padding: 4 tokens never routed
    out = model(ids, attention_mask=mask, labels=ids)
    real_slots = (48 - 4) * cfg.num_experts_per_tok
    assert out.moe_routed.shape == (2, cfg.num_experts)
    assert out.moe_routed.sum(-1).tolist() == [real_slots, real_slots]
    cap = expert_capacity(44, 2, cfg.num_experts, 0.5)
    assert torch.all(out.moe_routed - out.moe_dropped <= cap)
    assert out.moe_dropped.sum().item() >= 2 * (real_slots - cfg.num_experts * cap)  # at least the overflow
    out.loss.backward()
    assert model.model.layers[0].moe.router.weight.grad.abs().sum() > 0

    model.eval()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=False)
    assert out.moe_dropped.sum().item() == 0


def test_loss_adds_the_scaled_aux_loss():
    torch.manual_seed(0)
    cfg = config_for(
        "tiny", num_hidden_layers=2, attention_pattern=["lightning", "softmax"], router_aux_loss_coef=0.5
    )
    model = HybridForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        out = model(ids, labels=ids)
        plain = model(ids, labels=ids, output_router_logits=False)
    ce = F.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    torch.testing.assert_close(plain.loss, ce)
    torch.testing.assert_close(out.loss, ce + 0.5 * out.aux_loss)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (16, cfg.num_experts)


# --- the experts' paths (dense, grouped) against the per-expert loop ----------------------------------------


def _fp32_moe(hidden=64, inter=32, num_experts=8, top_k=2, seed=0) -> MoEFeedForward:
    """fp32, 16-byte-multiple row strides (d=64, F=32), so torch._grouped_mm runs on CPU."""
    torch.manual_seed(seed)
    moe = MoEFeedForward(hidden, inter, num_experts, top_k, capacity_factor=0.75, token_drop=True)
    with torch.no_grad():
        moe.router.weight.normal_(0, 1.0)
        moe.experts.gate_up_proj.normal_(0, hidden**-0.5)
        moe.experts.down_proj.normal_(0, inter**-0.5)
    return moe


def _run(moe: MoEFeedForward, path: str, x: torch.Tensor, mask: torch.Tensor, probe: torch.Tensor):
    """Output and gradients (x, gate_up, down, router) with the experts forced onto ``path``."""
    moe.zero_grad()
    moe.experts.path_for = lambda _x, _k=2: path  # instance attribute: shadows the method for this module only
    try:
        xx = x.clone().requires_grad_(True)
        out = moe(xx, mask)
        (out.hidden * probe).sum().backward()
    finally:
        del moe.experts.path_for
    grads = [xx.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad, moe.router.weight.grad]
    return out, [g.clone() for g in grads]


def _assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    """max |actual - expected| <= rel * max |expected| (elementwise rtol breaks on values near 0)."""
    assert torch.isfinite(actual).all()
    err = (actual - expected).abs().max().item()
    assert err <= rel * expected.abs().max().item(), (
        f"max error {err:.3g} vs scale {expected.abs().max():.3g}"
    )


@pytest.mark.parametrize("path", ["dense", "grouped"])
def test_expert_path_matches_the_loop_with_drops_and_padding(path):
    moe = _fp32_moe().train()  # capacity_factor 0.75: some slots are dropped (keep false)
    torch.manual_seed(1)
    x = torch.randn(3, 20, 64)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    mask[2, 15:] = False  # right padding
    probe = torch.randn(3, 20, 64)
    ref, ref_grads = _run(moe, "loop", x, mask, probe)
    assert ref.dropped.sum() > 0  # the test covers dropped slots
    out, grads = _run(moe, path, x, mask, probe)
    assert out.dropped.tolist() == ref.dropped.tolist()
    _assert_rel_close(out.hidden, ref.hidden)
    assert torch.all(out.hidden[~mask] == 0)  # padding gets nothing from the experts
    for g, r in zip(grads, ref_grads, strict=True):
        _assert_rel_close(g, r)


@pytest.mark.parametrize("path", ["dense", "grouped"])
def test_expert_path_matches_the_loop_in_dropless_eval(path):
    moe = _fp32_moe(top_k=3, seed=2).eval()
    x = torch.randn(2, 40, 64)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :7] = False
    probe = torch.randn(2, 40, 64)
    ref, ref_grads = _run(moe, "loop", x, mask, probe)
    out, grads = _run(moe, path, x, mask, probe)
    _assert_rel_close(out.hidden, ref.hidden)
    for g, r in zip(grads, ref_grads, strict=True):
        _assert_rel_close(g, r)


def test_dense_path_keeps_an_unselected_experts_nan_out_of_the_output():
    moe = _fp32_moe(num_experts=4)
    experts = moe.experts
    x = torch.randn(6, 64)
    top_i = torch.tensor([[0, 1]] * 3 + [[1, 2]] * 3)  # nobody selects expert 3
    top_w = torch.full((6, 2), 0.5)
    keep = torch.ones(6, 2, dtype=torch.bool)
    keep[4, 1] = False  # token 4's slot for expert 2 is dropped
    expected = experts.forward_reference(x, top_i, top_w, keep)
    with torch.no_grad():
        experts.down_proj[3] = float("nan")  # unselected: its outputs are NaN for every token
        experts.gate_up_proj[2] = float("inf")  # selected only where kept: tokens 3 and 5
    out = experts.forward_dense(x, top_i, top_w, keep)
    assert torch.isfinite(out[:3]).all() and torch.isfinite(out[4]).all()
    _assert_rel_close(out[:3], expected[:3])
    _assert_rel_close(out[4], expected[4])


def test_small_calls_take_the_dense_path_and_larger_ones_the_grouped_gemm_where_it_runs(monkeypatch):
    experts = _fp32_moe().experts
    small, large = (
        torch.randn(moe_module.DENSE_MAX_TOKENS, 64),
        torch.randn(moe_module.DENSE_MAX_TOKENS + 1, 64),
    )
    assert experts.path_for(small) == "loop"  # gradients taken (training): never dense, see path_for
    with torch.no_grad():
        assert experts.path_for(small) == "dense"
        assert experts.path_for(large) == "loop"  # CPU default: the loop has no sync to save
        monkeypatch.setattr(moe_module, "GROUPED_MM_DEVICES", frozenset({"cpu"}))
        assert experts.path_for(large) == "grouped"
        assert experts.double().path_for(large.double()) == "loop"  # float64: no grouped GEMM
        assert SwiGLUExperts(4, 4, 6).path_for(torch.randn(100, 4)) == "loop"  # 16-byte strides unmet
        # on CPU the dense path stops where its compute outgrows the loop's per-expert overhead
        wide = SwiGLUExperts(4, 256, 512)
        assert wide.path_for(torch.randn(10, 256)) == "dense" and wide.path_for(torch.randn(11, 256)) == "grouped"
    assert experts.path_for(small) == "grouped"  # with gradients: the grouped GEMM where it runs


def test_a_traced_or_captured_fp32_step_takes_no_path_that_syncs(monkeypatch):
    """On an H100, post-training's fp32 policy failed to capture its decode step: fp32 grouped_mm copies its
    offsets to the host, and the loop waits on the host per expert. Under capture or compile fp32 takes dense."""
    experts = _fp32_moe().experts
    large = torch.randn(moe_module.DENSE_MAX_TOKENS + 37, 64)
    monkeypatch.setattr(moe_module, "GROUPED_MM_DEVICES", frozenset({"cpu"}))
    bf16 = _fp32_moe().experts.bfloat16()
    with torch.no_grad():
        assert experts.path_for(large) == "grouped"  # eager: the grouped GEMM, its sync harmless
        assert bf16.path_for(large.bfloat16()) == "grouped"
        monkeypatch.setattr(moe_module, "_capturing", lambda device: True)
        assert experts.path_for(large) == "dense"
        assert bf16.path_for(large.bfloat16()) == "grouped"  # bf16's grouped GEMM is sync-free
        monkeypatch.setattr(moe_module, "_capturing", lambda device: False)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert experts.path_for(large) == "dense"


def test_grouped_mm_support_is_decided_by_dtype_and_strides():
    cpu = torch.device("cpu")
    assert grouped_mm_supported(cpu, torch.float32, 64, 32)
    assert not grouped_mm_supported(cpu, torch.float32, 4, 6)  # 16- and 24-byte rows
    assert not grouped_mm_supported(cpu, torch.float64, 64, 32)
    with torch.inference_mode():  # a first call from generate() must not cache "unsupported"
        assert grouped_mm_supported(cpu, torch.float32, 64, 64)


def test_forward_dispatches_to_the_chosen_path(monkeypatch):
    moe = _fp32_moe().eval()

    def refuse(*_args):
        raise AssertionError("took the per-expert loop")

    monkeypatch.setattr(SwiGLUExperts, "forward_loop", refuse)
    with torch.no_grad():  # dense only without gradients (decode)
        moe(torch.randn(4, 8, 64))  # 32 tokens: dense
    monkeypatch.setattr(moe_module, "GROUPED_MM_DEVICES", frozenset({"cpu"}))
    moe(torch.randn(4, 80, 64))  # 320 tokens: grouped
    monkeypatch.setattr(moe_module, "GROUPED_MM_DEVICES", frozenset())
    with pytest.raises(AssertionError, match="per-expert loop"):
        moe(torch.randn(4, 80, 64))


def test_decode_steps_take_the_dense_path_and_generate_the_loops_tokens(monkeypatch):
    torch.manual_seed(0)
    model = HybridForCausalLM(
        config_for("tiny", num_hidden_layers=2, attention_pattern=["lightning", "softmax"])
    )
    model.eval()
    ids = torch.randint(8, model.config.vocab_size, (4, 20))
    args = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    paths: list[tuple[int, str]] = []
    choose = SwiGLUExperts.path_for

    def record(self, x, top_k=2):
        paths.append((x.shape[0], choose(self, x, top_k)))
        return paths[-1][1]

    monkeypatch.setattr(SwiGLUExperts, "path_for", record)
    fast = model.generate(ids, **args)
    assert paths[0] == (80, "loop")  # the prompt: 4 x 20 tokens (CPU, above DENSE_MAX_TOKENS)
    assert set(paths[2:]) == {(4, "dense")}  # every decode step, every layer
    monkeypatch.setattr(SwiGLUExperts, "path_for", lambda self, x, top_k=2: "loop")
    assert torch.equal(model.generate(ids, **args), fast)


# ops that make a CUDA stream wait for the host (data-dependent output sizes or a scalar read)
_SYNCING_OPS = {"nonzero", "_local_scalar_dense", "bincount", "masked_select", "item", "unique", "_unique2"}


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tokens, grouped_on_cpu", [(32, False), (320, True)])
def test_dropless_moe_runs_no_op_that_waits_for_the_host(monkeypatch, tokens, grouped_on_cpu):
    """On CUDA each of these ops is a device->host sync (the loop has one per expert); a decode step must have none."""
    if grouped_on_cpu:
        monkeypatch.setattr(moe_module, "GROUPED_MM_DEVICES", frozenset({"cpu"}))
    moe = _fp32_moe().eval()
    x, mask = torch.randn(1, tokens, 64), torch.ones(1, tokens, dtype=torch.bool)
    mask[0, :3] = False
    with _RecordOps() as fast, torch.no_grad():  # as in generate
        moe(x, mask)
    assert not fast.ops & _SYNCING_OPS, fast.ops & _SYNCING_OPS
    moe.experts.path_for = lambda _x, _k=2: "loop"
    with _RecordOps() as loop:
        moe(x, mask)
    assert loop.ops & _SYNCING_OPS  # the recorder sees the loop's syncs (it reads each expert's group bounds)


def test_decode_routing_by_argmax_passes_equals_topk():
    """Without gradients the router picks top-k as k argmax passes (fused by torch.compile); same values/order."""
    probs = torch.randn(64, 8).softmax(-1)
    for k in (1, 2, 3):
        w, i = moe_module.top_k_by_argmax(probs, k)
        ref_w, ref_i = torch.topk(probs, k, dim=-1)
        assert torch.equal(i, ref_i) and torch.equal(w, ref_w)


def test_a_training_step_traced_before_any_eager_call_takes_the_grouped_gemm_in_bf16(monkeypatch):
    """On an H100 a compiled training step traced the MoE before the grouped-GEMM probe had ever run (it cannot run
    inside a trace) and fell to the per-expert loop: 8 recompiles, 2.6x slower steps. Traced with nothing known,
    bf16 takes the grouped GEMM on GROUPED_MM_UNPROBED_DEVICES (CUDA); fp32 or other devices the loop."""
    monkeypatch.setattr(moe_module, "_GROUPED_MM_KNOWN", {})
    monkeypatch.setattr(moe_module, "GROUPED_MM_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    experts = _fp32_moe().experts
    x = torch.randn(100, 64)
    assert experts.path_for(x) == "loop"  # fp32: unprobed, no grouped GEMM assumed
    bf16 = _fp32_moe().experts.bfloat16()
    assert bf16.path_for(x.bfloat16()) == "loop"  # CPU is not an unprobed-grouped device
    monkeypatch.setattr(moe_module, "GROUPED_MM_UNPROBED_DEVICES", frozenset({"cpu"}))
    assert bf16.path_for(x.bfloat16()) == "grouped"
    assert moe_module._GROUPED_MM_KNOWN == {}  # nothing probed inside the trace


@pytest.mark.parametrize("num_experts", [4, 8])
def test_balance_loss_is_the_released_loss_over_k_e_squared(num_experts: int) -> None:
    """The report's (1/E) sum f_i m_i against transformers' MiniMax load_balancing_loss_func (E sum (k f_i) P_i) on
    the same router logits: exactly k E^2 apart, balanced or skewed (the aux_loss_coef description's factor)."""
    from transformers.models.minimax.modeling_minimax import load_balancing_loss_func

    from model.moe import balance_loss

    k, gen = 2, torch.Generator().manual_seed(0)
    for skew in (0.0, 4.0):
        logits = torch.randn(2048, num_experts, generator=gen) + skew * torch.linspace(0, 1, num_experts)
        probs = logits.softmax(-1)
        routed = torch.bincount(probs.topk(k, -1).indices.reshape(-1), minlength=num_experts)
        ours = balance_loss(probs, routed, None)
        theirs = load_balancing_loss_func((logits,), num_experts, k)
        assert float(theirs / ours) == pytest.approx(k * num_experts**2, rel=1e-5)
