"""Triton lightning attention (kernels/lightning/triton_*.py) against the float64 references.

On a CPU machine (CI) the kernels run under TRITON_INTERPRET=1 at tiny sizes in float32 / float16
(bfloat16 arithmetic is wrong in the interpreter, ENV-NOTES) against the float64 token recurrence:
outputs, final states and gradients of q, k, v and the initial state, odd lengths, packed sequences
with length-1 and empty ones, sequences split into segments, decoding. On a CUDA machine the same
file checks realistic sizes in bfloat16 against the float64 PyTorch chunk form.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the import of the kernel modules
pytest.importorskip(
    "triton", reason="triton is not installed: the Triton lightning kernels cannot be checked"
)

import kernels.lightning as kl  # noqa: E402
import kernels.lightning.triton_chunk as triton_chunk  # noqa: E402
from kernels.lightning import (  # noqa: E402
    lightning_attention,
    lightning_attention_decode,
    lightning_attn_chunk,
    lightning_attn_decode,
    lightning_attn_recurrent,
    lightning_decay_rates,
)
from kernels.lightning.triton_chunk import (  # noqa: E402
    KernelConfig,
    _plan_tables,
    _segment_chunks,
    lightning_attn_triton,
    lightning_attn_triton_chunk,
)
from kernels.lightning.triton_decode import lightning_attn_triton_decode  # noqa: E402

if not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is off: nothing can run the kernels", allow_module_level=True)

DEV = "cuda" if ON_GPU else "cpu"
F64 = torch.float64
# ‖out − ref‖ / ‖ref‖ bounds: fp32 math (GPU: tf32x3 dots), fp16/bf16 operands with fp32 accumulation
REL_TOL = {torch.float32: 5e-5 if ON_GPU else 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
LOW = torch.bfloat16 if ON_GPU else torch.float16  # the reduced precision each machine computes right
MAIN = torch.bfloat16 if ON_GPU else torch.float32  # the GPU checks the training dtype


def activated(*shape: int, seed: int) -> torch.Tensor:
    """SiLU'd gaussians, the distribution q, k, v have inside the layer (float64, on DEV)."""
    g = torch.Generator().manual_seed(seed)
    return F.silu(torch.randn(*shape, generator=g, dtype=F64)).to(DEV)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def reference(q, k, v, s, s0, cu):
    """float64 reference: the token recurrence on CPU; the chunk form (checked against it) on the GPU."""
    if ON_GPU:
        return lightning_attn_chunk(q, k, v, s, 256, s0, True, cu_seqlens=cu)
    return lightning_attn_recurrent(q, k, v, s, s0, True, cu_seqlens=cu)


def errors_vs_reference(fn, q, k, v, s, s0, cu, dtype, seed=7, want_final=True):
    """Relative errors of (o, final, dq, dk, dv, ds0) of fn in `dtype` against the float64 reference."""
    ins = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    s0_in = s0.float().requires_grad_(True) if s0 is not None else None
    o, final = fn(*ins, s0_in)
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(o.shape, generator=g, dtype=F64).to(DEV)
    loss = (o.double() * go).sum()
    if want_final:
        gf = torch.randn(final.shape, generator=g, dtype=F64).to(DEV)
        loss = loss + (final.double() * gf).sum()
    loss.backward()

    refs = [x.detach().to(dtype).double().requires_grad_(True) for x in (q, k, v)]
    r0 = s0.clone().float().double().requires_grad_(True) if s0 is not None else None
    ro, rf = reference(*refs, s, r0, cu)
    ref_loss = (ro * go).sum() + ((rf * gf).sum() if want_final else 0.0)
    ref_loss.backward()
    out = {"o": rel(o, ro), "dq": rel(ins[0].grad, refs[0].grad)}
    out |= {"dk": rel(ins[1].grad, refs[1].grad), "dv": rel(ins[2].grad, refs[2].grad)}
    if want_final:
        out["final"] = rel(final, rf)
        assert final.dtype == torch.float32
    if s0 is not None:
        out["ds0"] = rel(s0_in.grad, r0.grad)
    assert o.dtype == dtype and o.shape == ro.shape
    assert all(torch.isfinite(x).all() for x in (o, *(t.grad for t in ins)))
    return out


def assert_close_rel(errs: dict, dtype: torch.dtype, what: str) -> None:
    bad = {k: f"{e:.2e}" for k, e in errs.items() if not e <= REL_TOL[dtype]}
    assert not bad, f"{what}: relative errors above {REL_TOL[dtype]:g} for {dtype}: {bad} (all: {errs})"


def triton_fn(s, block, cu=None, config=None, want_final=True):
    cfg = config or KernelConfig()
    return lambda q, k, v, s0: lightning_attn_triton(q, k, v, s, block, s0, want_final, cu, config=cfg)


# ---- sizes: tiny under the interpreter, realistic on a GPU -----------------------------------------

if ON_GPU:
    BLOCK = 64
    # (B, H, T, d_k, d_v, layer of 8): odd lengths, both head dims, one length under a chunk
    DENSE_CASES = [
        (2, 4, 4099, 128, 128, 1),
        (1, 8, 2047, 64, 64, 0),
        (3, 2, 37, 128, 128, 7),
        (2, 16, 1, 128, 128, 3),
    ]
    SEGMENTED_CASES = [(1, 4, 8191, 128, 128, 2), (2, 2, 3000, 64, 64, 6)]
    VARLEN_LENGTHS = [1, 700, 1, 0, 2049, 64, 1, 313]
else:
    BLOCK = 16
    DENSE_CASES = [(2, 2, 37, 16, 16, 1), (1, 2, 130, 32, 32, 0), (2, 1, 1, 16, 16, 3), (1, 2, 48, 16, 32, 7)]
    SEGMENTED_CASES = [(1, 2, 130, 16, 16, 2), (2, 1, 67, 32, 16, 5)]
    VARLEN_LENGTHS = [1, 17, 1, 0, 40, 16, 1, 9]


def make_inputs(batch, heads, length, d_k, d_v, layer, with_state, rows=None, seed=0):
    q = activated(batch, heads, length, d_k, seed=seed)
    k = activated(batch, heads, length, d_k, seed=seed + 1)
    v = activated(batch, heads, length, d_v, seed=seed + 2)
    s = lightning_decay_rates(heads, layer, 8, dtype=F64).to(DEV)
    s0 = activated(rows or batch, heads, d_k, d_v, seed=seed + 3) if with_state else None
    return q, k, v, s, s0


# ---- dense ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: "B{}H{}T{}dk{}dv{}L{}".format(*c))
@pytest.mark.parametrize("with_state", [False, True])
def test_outputs_final_state_and_gradients_match_reference(case, with_state):
    q, k, v, s, s0 = make_inputs(*case, with_state, seed=case[2])
    errs = errors_vs_reference(triton_fn(s, BLOCK), q, k, v, s, s0, None, MAIN)
    assert_close_rel(errs, MAIN, f"{MAIN} {case}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] if ON_GPU else [torch.float16])
def test_reduced_precision_inputs_stay_close(dtype):
    case = DENSE_CASES[0]
    q, k, v, s, s0 = make_inputs(*case, True, seed=11)
    errs = errors_vs_reference(triton_fn(s, BLOCK), q, k, v, s, s0, None, dtype)
    assert_close_rel(errs, dtype, f"{dtype} {case}")


def test_extreme_decays_stay_finite_and_exact():
    # λ ≈ 1 (rate 1e-9: a plain prefix sum) and λ = e^-40, e^-1000 (only the current token counts)
    q, k, v, _, s0 = make_inputs(1, 3, 45 if not ON_GPU else 1001, 16, 16, 0, True, seed=3)
    s = torch.tensor([1e-9, 40.0, 1e3], dtype=F64, device=DEV)
    errs = errors_vs_reference(triton_fn(s, BLOCK), q, k, v, s, s0, None, torch.float32)
    assert_close_rel(errs, torch.float32, "extreme decays")


def test_time_major_inputs_give_the_same_result_in_their_own_layout():
    # [B, T, H, d] memory seen as [B, H, T, d] (how the model and fla hold it) vs contiguous inputs:
    # same numbers, and o and the gradients come back time-major (no transposing copies)
    q, k, v, s, s0 = make_inputs(2, 2, 37, 16, 16, 2, True, seed=5)
    leaves = [x.float().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v)]  # [B, T, H, d]
    views = [x.transpose(1, 2) for x in leaves]
    assert not views[0].is_contiguous()
    o_a, f_a = lightning_attn_triton(*views, s, BLOCK, s0.float(), True)
    flat = [x.float().contiguous().requires_grad_(True) for x in (q, k, v)]
    o_b, f_b = lightning_attn_triton(*flat, s, BLOCK, s0.float(), True)
    assert o_a.transpose(1, 2).is_contiguous() and o_b.is_contiguous()
    torch.testing.assert_close(o_a, o_b, rtol=0, atol=0)
    torch.testing.assert_close(f_a, f_b, rtol=0, atol=0)
    go = torch.randn(o_b.shape, generator=torch.Generator().manual_seed(3)).to(DEV)
    (o_a * go).sum().backward()
    (o_b * go).sum().backward()
    for leaf, ref in zip(leaves, flat, strict=True):
        assert leaf.grad.is_contiguous()  # [B, T, H, d] like its leaf
        torch.testing.assert_close(leaf.grad.transpose(1, 2), ref.grad, rtol=0, atol=0)


@pytest.mark.parametrize("which", ["output_only", "final_only"])
def test_gradient_through_one_output_only(which):
    q, k, v, s, s0 = make_inputs(1, 2, 33, 16, 16, 4, True, seed=9)
    ins = [x.float().requires_grad_(True) for x in (q, k, v)]
    refs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    o, final = lightning_attn_triton(*ins, s, BLOCK, s0.float(), True)
    ro, rf = lightning_attn_recurrent(*(r.double() for r in refs), s, s0, True)
    (o.sum() if which == "output_only" else final.sum()).backward()
    (ro.sum() if which == "output_only" else rf.sum()).backward()
    for name, a, b in zip("qkv", ins, refs, strict=True):
        if b.grad is None:  # the final state does not depend on q
            assert name == "q" and which == "final_only" and not a.grad.any()
            continue
        assert rel(a.grad, b.grad) < 1e-5, f"grad of {name} ({which})"


# ---- sequences split into segments (long sequences, few heads) -----------------------------------


@pytest.mark.parametrize("case", SEGMENTED_CASES, ids=lambda c: "B{}H{}T{}dk{}dv{}L{}".format(*c))
@pytest.mark.parametrize(
    "segment_chunks,extra",
    [
        (1, {}),
        (3, {"fuse_dq_state": True, "state_direct_weights": False}),
        (2, {"fuse_dq_state": True, "dq_block_v": 32, "mask_in_loop": True}),
        (5, {"state_split": 3}),
    ],
    ids=[
        "seg1",
        "seg3_fused_dq_state_recurrent_state_pass",
        "seg2_fused_dq32_mask_in_loop",
        "seg5_state_split3",
    ],
)
def test_segmented_sequences_match_reference(case, segment_chunks, extra):
    q, k, v, s, s0 = make_inputs(*case, True, seed=21)
    cfg = KernelConfig(segment_chunks=segment_chunks * (8 if ON_GPU else 1), **extra)
    errs = errors_vs_reference(triton_fn(s, BLOCK, config=cfg), q, k, v, s, s0, None, LOW)
    assert_close_rel(errs, LOW, f"segmented {case}")


def test_segmented_fast_decays_match_reference_with_and_without_the_state_horizon():
    # heads that forget within a few tokens (the horizon skips most of each segment), one that
    # forgets within about a segment, and a plain prefix sum (nothing may be skipped)
    length = 1000 if ON_GPU else 150
    q, k, v, _, s0 = make_inputs(1, 4, length, 16, 32, 0, True, seed=23)  # batch 1: the rows are independent
    s = torch.tensor([3.0, 0.4, 0.02, 1e-9], dtype=F64, device=DEV)
    seg = 4 if not ON_GPU else 3
    for bits, split in itertools.product((40, None), (None, 3)):
        # split 3 with 1-chunk parts: heads whose horizon has fewer chunks leave parts unwritten
        extra = {"state_split": split, "state_min_part_chunks": 1} if split else {}
        cfg = KernelConfig(segment_chunks=seg, state_horizon_bits=bits, **extra)
        errs = errors_vs_reference(triton_fn(s, BLOCK, config=cfg), q, k, v, s, s0, None, torch.float32)
        assert_close_rel(errs, torch.float32, f"fast decays, horizon bits {bits}")


@pytest.mark.parametrize("split", [None, 3], ids=["one_part", "three_parts"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward_k_v", "reverse_q_dO"])
def test_state_horizon_never_reads_tokens_beyond_reach(reverse, split):
    # Plant NaN in each segment's token farthest from its weighted edge (its first token for the
    # forward state, whose weights λ^(e−1−t) grow towards the end; its last for the reverse one). Head 0
    # forgets within ~9 tokens, so with the horizon that token is never loaded and the states stay
    # finite and equal to the float64 sums over the clean segment; without it, 0·NaN poisons them.
    chunk, seg, length, d = 16, 4, 16 * 4 * 4, 16
    extra = {"state_split": split, "state_min_part_chunks": 1} if split else {}
    x = activated(1, 2, length, d, seed=31).float()
    y = activated(1, 2, length, d, seed=32).float()
    rates = torch.tensor([3.0, 1e-9], device=DEV)
    cfg = KernelConfig(segment_chunks=seg)
    plan = triton_chunk.make_plan(1, length, None, 2, d, chunk, torch.device(DEV), cfg)
    items = plan.items.cpu().tolist()
    poisoned = x.clone()
    for _, _, a, e, _, _ in items:
        poisoned[0, 0, e - 1 if reverse else a] = float("nan")
    for bits, finite in ((40, True), (None, False)):
        cfg_b = KernelConfig(segment_chunks=seg, state_horizon_bits=bits, **extra)
        local, parts, _ = triton_chunk.segment_local_states(poisoned, y, rates, plan, chunk, cfg_b, reverse)
        assert parts == (split or 1)
        for _, _, a, e, flags, slot in items:
            if flags & (triton_chunk.FIRST if reverse else triton_chunk.LAST):
                continue  # this segment's state is never computed (the main pass makes it)
            # the segment's sum (its parts added up by the last to finish) sits at [slot·parts]
            got = local[slot * parts]
            assert bool(torch.isfinite(got[0]).all()) is finite, f"bits={bits} segment [{a}, {e})"
            t = torch.arange(a, e, device=DEV, dtype=F64)
            for head, (rate, src) in enumerate(((3.0, x), (1e-9, poisoned))):  # head 1 is clean: all parts
                if head == 0 and not finite:
                    continue
                w = torch.exp(-rate * ((t - a + 1) if reverse else (e - 1 - t)))
                want = src[0, head, a:e].double().T @ (y[0, head, a:e].double() * w[:, None])
                assert rel(got[head], want) < 1e-6, f"bits={bits} head {head} segment [{a}, {e})"


def test_state_split_follows_each_heads_horizon(monkeypatch):
    # B·N = 128K, H=16, d=128 on an H100's 132 SMs at N=128K: 8 segments of 256 chunks, 7 need a state
    monkeypatch.setattr(triton_chunk, "_sm_count", lambda device: 132)
    cfg = KernelConfig()
    plan = triton_chunk.make_plan(1, 131072, None, 16, 128, 64, torch.device(DEV), cfg)
    assert plan.n_items == 8

    def parts(layer):
        host = triton_chunk._host_rates(lightning_decay_rates(16, layer, 32))
        return triton_chunk._state_parts(plan, 16, 2, 256, DEV, cfg, host, 64)

    # the last layer forgets nothing: every head reads its whole segment, 224 programs fill the wave
    assert parts(31) == 1
    assert triton_chunk._state_parts(plan, 16, 2, 256, DEV, cfg) == 1  # rates unknown: same as no horizon
    # layer 0: head 15 reads 112 chunks, head 0 two: split so that head 15 is not a long tail,
    # in parts of at least state_min_part_chunks (16): 7
    p0 = parts(0)
    assert p0 == -(-112 // cfg.state_min_part_chunks) == 7
    nats = triton_chunk._horizon_nats(cfg)
    assert triton_chunk._span_chunks(2**-0.5, 256, 64, nats) == 2  # head 0 reads 2 of 256 chunks
    assert triton_chunk._span_chunks(2**-8, 256, 64, nats) == 112  # head 15: 7 parts of 16


def test_host_rates_are_read_once_per_tensor_and_follow_in_place_changes():
    rates = torch.tensor([0.5, 0.25])
    assert triton_chunk._host_rates(rates) == (0.5, 0.25)
    assert id(rates) in triton_chunk._HOST_RATES
    rates.mul_(2)  # bumps the version: read again
    assert triton_chunk._host_rates(rates) == (1.0, 0.5)
    key = id(rates)
    del rates
    assert key not in triton_chunk._HOST_RATES  # forgotten with its tensor: a new one at that id is read anew


def test_host_rates_of_an_inference_tensor():
    # rates made under inference_mode (generation) have no version counter: on an H200 the long-context bench
    # failed with "Inference tensors do not track version counter"
    with torch.inference_mode():
        rates = torch.tensor([0.5, 0.25])
        assert triton_chunk._host_rates(rates) == (0.5, 0.25)
        assert triton_chunk._host_rates(rates) == (0.5, 0.25)
    assert triton_chunk._host_rates(rates) == (0.5, 0.25)


def test_horizon_tokens_bound_the_dropped_weight():
    for rate in (3.0, 0.7, 0.0039, 1e-7):
        n = triton_chunk.horizon_tokens(rate)
        assert math.exp(-rate * n) == pytest.approx(2.0**-40, rel=1e-9)
    assert triton_chunk.horizon_tokens(0.0) == math.inf
    assert triton_chunk.horizon_tokens(0.5, None) == math.inf


def test_segment_policy_splits_only_to_fill_one_wave():
    cfg = KernelConfig(programs_per_sm=2.0, min_segment_chunks=8)
    # B·N = 128K tokens, chunk 64, H=16, 2 value tiles, 132 SMs: a wave is 264 programs
    assert _segment_chunks((32,) * 64, 16, 2, 132, cfg) is None  # N=2K: many waves of whole rows
    assert _segment_chunks((256,) * 8, 16, 2, 132, cfg) is None  # N=16K: 256 programs, one wave
    for rows in ((512,) * 4, (2048,)):  # N=32K and 128K: cut into 8 items, 256 programs
        seg = _segment_chunks(rows, 16, 2, 132, cfg)
        items, _, _ = _plan_tables(tuple((b, 0, n * 64) for b, n in enumerate(rows)), 64, seg)
        assert len(items) == 8
    # one long packed document among short ones is cut; the short ones are not
    items, multi, slots = _plan_tables(((0, 0, 5000), (0, 5000, 5003), (0, 5003, 5100)), 64, 20)
    assert [m for m, _, _ in multi] == [0] and slots == len([it for it in items if it[1] == 0])
    assert all(it[5] == -1 for it in items if it[1] != 0)
    assert _segment_chunks((1, 1, 2048), 16, 2, 132, KernelConfig(programs_per_sm=0)) is None


@pytest.mark.parametrize("seg", [None, 1, 2, 5])
def test_work_items_cover_every_token_once_from_each_sequence_start(seg):
    bounds = [(0, 1), (1, 18), (18, 18), (18, 59), (59, 60), (60, 100)]
    items, multi, slots = _plan_tables(tuple((0, a, e) for a, e in bounds), 16, seg)
    covered = []
    for b, m, a, e, flags, _slot in items:
        start, end = bounds[m]
        assert (
            b == 0 and start <= a <= e <= end and (a - start) % 16 == 0
        )  # chunks start at the sequence start
        assert bool(flags & 1) == (a == start) and bool(flags & 2) == (e == end)
        covered += range(a, e)
    assert covered == list(range(100))  # every token once, no padding between sequences
    assert slots == sum(n for _, _, n in multi)


# ---- varlen --------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("segment_chunks", [None, 2])
def test_varlen_with_length_one_and_empty_sequences_matches_reference(with_state, segment_chunks):
    lengths = VARLEN_LENGTHS
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)
    q, k, v, s, s0 = make_inputs(1, 2, sum(lengths), 16, 32, 3, with_state, rows=len(lengths), seed=31)
    cfg = KernelConfig(segment_chunks=segment_chunks)
    errs = errors_vs_reference(triton_fn(s, BLOCK, cu, cfg), q, k, v, s, s0, cu, MAIN)
    assert_close_rel(errs, MAIN, f"varlen {lengths}")


def test_varlen_does_not_leak_state_across_sequences():
    q, k, v, s, _ = make_inputs(1, 2, 40, 16, 16, 7, False, seed=41)  # last layer: slowest decay
    cu = torch.tensor([0, 21, 40], device=DEV)
    o1, _ = lightning_attn_triton(q.float(), k.float(), v.float(), s, BLOCK, cu_seqlens=cu)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :21] += 5.0
    v2[:, :, :21] -= 3.0
    o2, _ = lightning_attn_triton(q.float(), k2.float(), v2.float(), s, BLOCK, cu_seqlens=cu)
    torch.testing.assert_close(o1[:, :, 21:], o2[:, :, 21:], rtol=0, atol=0)
    assert (o1[:, :, :21] - o2[:, :, :21]).abs().max() > 1.0


# ---- decode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (LOW, torch.float32)])
def test_decode_matches_pytorch_step(dtype, state_dtype):
    q, k, v, s, state = make_inputs(5, 3, 1, 16 if not ON_GPU else 128, 24 if not ON_GPU else 128, 2, True)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    state = state.to(state_dtype)
    o, new = lightning_attn_triton_decode(q, k, v, s, state)
    ro, rn = lightning_attn_decode(q.double(), k.double(), v.double(), s, state.double())
    assert o.dtype == dtype and new.dtype == state_dtype
    assert rel(new, rn) < 1e-6
    assert rel(o, ro) < (1e-6 if dtype == torch.float32 else REL_TOL[dtype])


def test_triton_prefill_then_triton_decode_equals_full_sequence():
    q, k, v, s, _ = make_inputs(2, 2, 29, 16, 16, 3, False, seed=51)
    q, k, v = (x.float() for x in (q, k, v))
    o_full, f_full = lightning_attn_recurrent(q.double(), k.double(), v.double(), s, None, True)
    o_pre, state = lightning_attn_triton(q[:, :, :20], k[:, :, :20], v[:, :, :20], s, BLOCK, None, True)
    outs = [o_pre]
    for t in range(20, 29):
        o_t, state = lightning_attn_triton_decode(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], s, state
        )
        outs.append(o_t)
    assert rel(torch.cat(outs, dim=2), o_full) < 1e-5
    assert rel(state, f_full) < 1e-5


# ---- dispatch and contract -----------------------------------------------------------------------


def test_dispatch_impl_triton_runs_these_kernels_and_agrees_with_chunk(monkeypatch):
    monkeypatch.setattr(kl, "_TRITON_IMPL", None)
    monkeypatch.setattr(kl, "_TRITON_DECODE_IMPL", None)
    monkeypatch.setattr(kl, "_triton_unavailable", {})
    q, k, v, s, s0 = make_inputs(1, 2, 23, 16, 16, 1, True, seed=61)
    q, k, v = (x.float() for x in (q, k, v))
    cu = torch.tensor([0, 1, 23], device=DEV)
    s0 = torch.cat([s0, s0]).float()
    a = lightning_attention(
        q, k, v, s, block_size=16, initial_state=s0, output_final_state=True, cu_seqlens=cu, impl="triton"
    )
    assert kl._TRITON_IMPL is lightning_attn_triton_chunk
    b = lightning_attention(
        q, k, v, s, block_size=16, initial_state=s0, output_final_state=True, cu_seqlens=cu, impl="chunk"
    )
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)
    o, new = lightning_attention_decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], s, a[1][:1], impl="triton")
    assert kl._TRITON_DECODE_IMPL is lightning_attn_triton_decode
    ro, rn = lightning_attn_decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], s, a[1][:1])
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new, rn, rtol=1e-5, atol=1e-5)
    if ON_GPU:  # auto picks Triton on CUDA
        c = lightning_attention(
            q, k, v, s, block_size=16, initial_state=s0, output_final_state=True, cu_seqlens=cu
        )
        torch.testing.assert_close(c[0], a[0], rtol=0, atol=0)


def test_block_size_picks_a_power_of_two_chunk_without_changing_results():
    cfg = KernelConfig(chunk=64)
    assert [cfg.chunk_for(b) for b in (1, 7, 16, 17, 32, 100, 256)] == [16, 16, 16, 16, 32, 64, 64]
    q, k, v, s, s0 = make_inputs(1, 1, 70, 16, 16, 2, True, seed=71)
    q, k, v, s0 = (x.float() for x in (q, k, v, s0))
    a = lightning_attn_triton(q, k, v, s, 16, s0, True)
    b = lightning_attn_triton(q, k, v, s, 32, s0, True)
    assert rel(a[0], b[0].double()) < 1e-6 and rel(a[1], b[1].double()) < 1e-6


def test_float64_falls_back_to_pytorch_with_a_warning(monkeypatch):
    monkeypatch.setattr(triton_chunk, "_FALLBACK_WARNED", set())
    q, k, v, s, s0 = make_inputs(1, 2, 9, 16, 16, 2, True)
    with pytest.warns(UserWarning, match="PyTorch chunk path"):
        o, final = lightning_attn_triton_chunk(q, k, v, s, 16, s0, True)
    ro, rf = lightning_attn_recurrent(q, k, v, s, s0, True)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-10)


def test_learned_decay_rates_are_refused():
    q, k, v, s, _ = make_inputs(1, 2, 9, 16, 16, 2, False)
    with pytest.raises(NotImplementedError, match="no gradient for decay_rates"):
        lightning_attn_triton_chunk(q.float(), k.float(), v.float(), s.float().requires_grad_(True))


def test_inputs_are_validated_like_the_pytorch_path():
    q, k, v, s, _ = make_inputs(2, 2, 9, 16, 16, 2, False)
    with pytest.raises(ValueError, match="B must be 1"):
        lightning_attn_triton_chunk(q.float(), k.float(), v.float(), s, cu_seqlens=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="exactly one new token"):
        lightning_attn_triton_decode(
            q.float(), k.float(), v.float(), s, torch.zeros(2, 2, 16, 16, device=DEV)
        )
