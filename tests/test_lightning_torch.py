"""Lightning attention in PyTorch: chunk vs the naive references, varlen, decode, dtypes, and parity
with transformers' MiniMax implementation (the released architecture)."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention

import kernels.lightning as kl
from kernels.lightning import (
    lightning_attention,
    lightning_attention_decode,
    lightning_attn_chunk,
    lightning_attn_decode,
    lightning_attn_parallel,
    lightning_attn_recurrent,
    lightning_decay_rates,
)

F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-10}

# name -> decay rates [H] (float64)
DECAYS = {
    "layer0_of_8": lambda: lightning_decay_rates(4, 0, 8, dtype=F64),
    "last_layer_of_8": lambda: lightning_decay_rates(4, 7, 8, dtype=F64),
    "single_head": lambda: lightning_decay_rates(1, 2, 8, dtype=F64),
    "H8_layer3": lambda: lightning_decay_rates(8, 3, 8, dtype=F64),
    "tiny_rates": lambda: torch.tensor([1e-9, 1e-6], dtype=F64),
    "huge_rates": lambda: torch.tensor([5.0, 40.0, 1e3], dtype=F64),
}


def activated(*shape: int, dtype: torch.dtype = F64, seed: int = 0) -> torch.Tensor:
    """SiLU'd gaussian activations, the distribution q, k, v have inside the layer."""
    g = torch.Generator().manual_seed(seed)
    return F.silu(torch.randn(*shape, generator=g, dtype=F64)).to(dtype)


def make_qkv(batch: int, heads: int, length: int, d_k: int = 8, d_v: int = 8, seed: int = 0, dtype=F64):
    q = activated(batch, heads, length, d_k, seed=seed, dtype=dtype)
    k = activated(batch, heads, length, d_k, seed=seed + 1, dtype=dtype)
    v = activated(batch, heads, length, d_v, seed=seed + 2, dtype=dtype)
    return q, k, v


def outputs_and_grads(fn, q, k, v, s0, seed: int = 7):
    """Run fn -> (o, final); return o, final and d(<o,go> + <final,gf>)/d(q, k, v, s0)."""
    inputs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    if s0 is not None:
        inputs.append(s0.detach().clone().requires_grad_(True))
    o, final = fn(*inputs[:3], inputs[3] if s0 is not None else None)
    g = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=g, dtype=final.dtype)).sum()
    grads = torch.autograd.grad(loss, inputs)
    return o.detach(), final.detach(), grads


# ---- decay rates ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads,layer,layers", [(1, 0, 2), (4, 0, 8), (8, 7, 8), (8, 3, 8), (64, 40, 80), (6, 0, 1)]
)
def test_decay_rates_equal_transformers_get_slope_rate(heads, layer, layers):
    hf_self = types.SimpleNamespace(num_attention_heads=heads, layer_idx=layer, num_hidden_layers=layers)
    hf = MiniMaxLightningAttention.get_slope_rate(hf_self)  # [H, 1, 1] float32
    ours = lightning_decay_rates(heads, layer, layers)
    assert ours.shape == (heads,) and ours.dtype == torch.float32
    assert torch.equal(ours, hf.view(-1))
    assert torch.equal(lightning_decay_rates(heads, layer, layers, dtype=F64), hf.view(-1).double())


def test_decay_rates_are_positive_and_shrink_with_depth_and_head_index():
    first, last = lightning_decay_rates(8, 0, 8), lightning_decay_rates(8, 7, 8)
    assert (first > 0).all() and (last > 0).all()
    assert (first[1:] < first[:-1]).all()
    assert (last < first).all() and last.max() < 1e-4  # last layer: almost no decay
    assert first[0].item() == pytest.approx(0.5 * (1 + 1e-5), rel=1e-6)  # 2^(-8/8), layer factor 1 + 1e-5


@pytest.mark.parametrize(
    "bad", [dict(num_heads=0, layer_idx=0, num_layers=4), dict(num_heads=4, layer_idx=4, num_layers=4)]
)
def test_decay_rates_reject_bad_arguments(bad):
    with pytest.raises(ValueError, match="lightning_decay_rates"):
        lightning_decay_rates(**bad)


# ---- references agree -----------------------------------------------------------------------------


@pytest.mark.parametrize("decay", list(DECAYS))
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrence_and_parallel_form_agree(decay, with_state):
    s = DECAYS[decay]()
    heads = s.shape[0]
    q, k, v = make_qkv(2, heads, 45, d_k=6, d_v=5)
    s0 = torch.randn(2, heads, 6, 5, dtype=F64) if with_state else None
    o_r, f_r, g_r = outputs_and_grads(lambda *a: lightning_attn_recurrent(*a[:3], s, a[3], True), q, k, v, s0)
    o_p, f_p, g_p = outputs_and_grads(lambda *a: lightning_attn_parallel(*a[:3], s, a[3], True), q, k, v, s0)
    torch.testing.assert_close(o_p, o_r, **TIGHT)
    torch.testing.assert_close(f_p, f_r, **TIGHT)
    for a, b in zip(g_p, g_r, strict=True):
        torch.testing.assert_close(a, b, **TIGHT)


def test_recurrence_matches_hand_computed_two_tokens():
    # One head, d = 1: S0 = 2, λ = e^-s. o_0 = q0(λ·2 + k0v0); o_1 = q1(λ(λ·2 + k0v0) + k1v1).
    s = torch.tensor([0.3], dtype=F64)
    lam = torch.exp(-s).item()
    q = torch.tensor([1.5, -0.5], dtype=F64).view(1, 1, 2, 1)
    k = torch.tensor([2.0, 3.0], dtype=F64).view(1, 1, 2, 1)
    v = torch.tensor([0.25, 4.0], dtype=F64).view(1, 1, 2, 1)
    s0 = torch.full((1, 1, 1, 1), 2.0, dtype=F64)
    s_0 = lam * 2 + 2.0 * 0.25
    s_1 = lam * s_0 + 3.0 * 4.0
    expected = torch.tensor([1.5 * s_0, -0.5 * s_1], dtype=F64).view(1, 1, 2, 1)
    for fn in (lightning_attn_recurrent, lightning_attn_parallel):
        o, final = fn(q, k, v, s, s0, True)
        torch.testing.assert_close(o, expected, **TIGHT)
        assert final.item() == pytest.approx(s_1, rel=1e-12)
    o, final = lightning_attn_chunk(q, k, v, s, 1, s0, True)
    torch.testing.assert_close(o, expected, **TIGHT)


# ---- chunk vs references --------------------------------------------------------------------------

CHUNK_CASES = list(
    itertools.product([1, 7, 64, 65, 130], [16, 32, 64], ["layer0_of_8", "H8_layer3", "huge_rates"])
)
CHUNK_CASES += [(130, 16, d) for d in ("last_layer_of_8", "single_head", "tiny_rates")]
CHUNK_CASES += [(65, 64, d) for d in ("last_layer_of_8", "single_head", "tiny_rates")]


@pytest.mark.parametrize("length,block,decay", CHUNK_CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrence_outputs_grads_and_final_state(length, block, decay, with_state):
    s = DECAYS[decay]()
    heads = s.shape[0]
    q, k, v = make_qkv(2, heads, length, d_k=8, d_v=6, seed=length)
    s0 = activated(2, heads, 8, 6, seed=99) if with_state else None
    o_c, f_c, g_c = outputs_and_grads(
        lambda *a: lightning_attn_chunk(*a[:3], s, block, a[3], True), q, k, v, s0
    )
    o_r, f_r, g_r = outputs_and_grads(lambda *a: lightning_attn_recurrent(*a[:3], s, a[3], True), q, k, v, s0)
    torch.testing.assert_close(o_c, o_r, **TIGHT)
    torch.testing.assert_close(f_c, f_r, **TIGHT)
    for name, a, b in zip(("q", "k", "v", "initial_state"), g_c, g_r, strict=False):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_chunk_without_final_state_returns_none_and_same_output():
    s = DECAYS["H8_layer3"]()
    q, k, v = make_qkv(1, 8, 50)
    o1, f1 = lightning_attn_chunk(q, k, v, s, 16)
    o2, f2 = lightning_attn_chunk(q, k, v, s, 16, output_final_state=True)
    assert f1 is None and f2 is not None
    torch.testing.assert_close(o1, o2, **TIGHT)


def test_chunk_supports_different_key_and_value_dims():
    s = DECAYS["layer0_of_8"]()
    q, k, v = make_qkv(2, 4, 33, d_k=4, d_v=12)
    s0 = torch.randn(2, 4, 4, 12, dtype=F64)
    o_c, f_c = lightning_attn_chunk(q, k, v, s, 8, s0, True)
    o_r, f_r = lightning_attn_recurrent(q, k, v, s, s0, True)
    assert o_c.shape == (2, 4, 33, 12) and f_c.shape == (2, 4, 4, 12)
    torch.testing.assert_close(o_c, o_r, **TIGHT)
    torch.testing.assert_close(f_c, f_r, **TIGHT)


def test_chunk_of_empty_sequence_returns_initial_state():
    s = DECAYS["layer0_of_8"]()
    q, k, v = make_qkv(2, 4, 0)
    s0 = torch.randn(2, 4, 8, 8, dtype=F64)
    o, final = lightning_attn_chunk(q, k, v, s, 16, s0, True)
    assert o.shape == (2, 4, 0, 8)
    torch.testing.assert_close(final, s0)


# ---- varlen ---------------------------------------------------------------------------------------

VARLEN_CASES = {
    # lengths (packed in this order); block 16 puts boundaries inside blocks, at block edges,
    # sequences spanning several blocks, length-1 and empty sequences.
    "mixed": [1, 17, 1, 40, 0, 23],
    "block_aligned": [16, 32, 16],
    "all_length_one": [1, 1, 1, 1, 1],
    "single": [37],
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_varlen_packed_equals_sequences_run_separately(case, with_state, index_dtype):
    lengths = VARLEN_CASES[case]
    s = DECAYS["H8_layer3"]()
    total = sum(lengths)
    q, k, v = make_qkv(1, 8, total, d_k=8, d_v=6, seed=3)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=index_dtype)
    s0 = activated(len(lengths), 8, 8, 6, seed=5) if with_state else None

    o_packed, f_packed, g_packed = outputs_and_grads(
        lambda *a: lightning_attn_chunk(*a[:3], s, 16, a[3], True, cu_seqlens=cu), q, k, v, s0
    )
    assert f_packed.shape == (len(lengths), 8, 8, 6)
    for m, (a, e) in enumerate(itertools.pairwise(cu.tolist())):
        init = s0[m : m + 1] if s0 is not None else None
        o_sep, f_sep = lightning_attn_recurrent(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], s, init, True)
        torch.testing.assert_close(o_packed[:, :, a:e], o_sep, **TIGHT)
        torch.testing.assert_close(f_packed[m : m + 1], f_sep, **TIGHT)
    # gradients of the packed chunk path equal those of the packed reference
    _, _, g_ref = outputs_and_grads(
        lambda *a: lightning_attn_recurrent(*a[:3], s, a[3], True, cu_seqlens=cu), q, k, v, s0
    )
    for a, b in zip(g_packed, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TIGHT)


def test_varlen_does_not_leak_state_across_boundaries():
    # Changing sequence 0 must leave sequence 1's output untouched.
    s = DECAYS["last_layer_of_8"]()  # slowest decay: leakage would be visible
    q, k, v = make_qkv(1, 4, 40)
    cu = torch.tensor([0, 21, 40])
    o1, _ = lightning_attn_chunk(q, k, v, s, 16, cu_seqlens=cu)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :21] += 5.0
    v2[:, :, :21] -= 3.0
    o2, _ = lightning_attn_chunk(q, k2, v2, s, 16, cu_seqlens=cu)
    torch.testing.assert_close(o1[:, :, 21:], o2[:, :, 21:], rtol=0, atol=0)
    assert (o1[:, :, :21] - o2[:, :, :21]).abs().max() > 1.0


# ---- decode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefill", [0, 1, 23])
def test_prefill_then_decode_equals_full_sequence(prefill):
    s = DECAYS["H8_layer3"]()
    steps = 9
    q, k, v = make_qkv(3, 8, prefill + steps, seed=11)
    o_full, f_full = lightning_attention(q, k, v, s, block_size=16, output_final_state=True)

    o_pre, state = lightning_attention(
        q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], s, block_size=16, output_final_state=True
    )
    outs = [o_pre]
    for t in range(prefill, prefill + steps):
        o_t, state = lightning_attention_decode(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], s, state
        )
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, dim=2), o_full, **TIGHT)
    torch.testing.assert_close(state, f_full, **TIGHT)


def test_decode_keeps_state_dtype_and_returns_activation_dtype():
    s = lightning_decay_rates(4, 1, 4)
    q, k, v = make_qkv(2, 4, 1, dtype=torch.bfloat16)
    state = torch.randn(2, 4, 8, 8)
    o, new = lightning_attn_decode(q, k, v, s, state)
    assert o.dtype == torch.bfloat16 and new.dtype == torch.float32
    o64, new64 = lightning_attn_decode(q.double(), k.double(), v.double(), s.double(), state.double())
    torch.testing.assert_close(new.double(), new64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o.double(), o64, rtol=2e-2, atol=2e-2)


# ---- parity with transformers' MiniMax --------------------------------------------------------------


def _hf_layer(layer_idx: int = 1, block_size: int = 16) -> MiniMaxLightningAttention:
    config = MiniMaxConfig(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=8,
        num_hidden_layers=4,
        block_size=block_size,
        intermediate_size=64,
        num_local_experts=2,
    )
    torch.manual_seed(0)
    layer = MiniMaxLightningAttention(config, layer_idx).double().eval()
    for p in layer.parameters():  # default init is tiny; make the attention path matter
        torch.nn.init.normal_(p, std=0.3)
    # Its decay buffers were exp'd in float32 at __init__; redo them in float64 from its own rates so
    # the comparison is at float64 precision (the float32 rates themselves are left as they are).
    query_decay, key_decay, diagonal_decay = layer.decay_factors(layer.slope_rate)
    layer.query_decay, layer.key_decay, layer.diagonal_decay = query_decay, key_decay, diagonal_decay
    return layer


def _our_layer(layer: MiniMaxLightningAttention, hidden: torch.Tensor, state=None, decode: bool = False):
    """transformers' layer with its attention core replaced by ours (same weights, same pre/post)."""
    batch, length, _ = hidden.shape
    heads, d = layer.num_attention_heads, layer.head_dim
    qkv = layer.act_fn(layer.qkv_proj(hidden)).view(batch, length, heads, 3 * d)
    q, k, v = (x.transpose(1, 2) for x in torch.split(qkv, d, dim=3))
    rates = lightning_decay_rates(heads, layer.layer_idx, layer.num_hidden_layers, dtype=hidden.dtype)
    if decode:
        o, final = lightning_attention_decode(q, k, v, rates, state)
    else:
        o, final = lightning_attention(
            q, k, v, rates, block_size=7, initial_state=state, output_final_state=True
        )
    o = layer.norm(o.transpose(1, 2).reshape(batch, length, heads * d))
    o = layer.out_proj(torch.sigmoid(layer.output_gate(hidden)) * o)
    return o, final


@pytest.mark.parametrize("length", [1, 16, 37])
def test_matches_transformers_minimax_prefill_block_loop(length):
    layer = _hf_layer(layer_idx=1, block_size=16)
    assert torch.equal(layer.slope_rate.view(-1), lightning_decay_rates(4, 1, 4, dtype=F64))
    hidden = torch.randn(2, length, 32, dtype=F64, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        hf_out, hf_state = layer(hidden, None, None)
        our_out, our_state = _our_layer(layer, hidden)
    torch.testing.assert_close(our_state, hf_state, **TIGHT)
    torch.testing.assert_close(our_out, hf_out, **TIGHT)
    assert hf_out.abs().max() > 1e-2  # the comparison is not between two near-zero tensors


def test_matches_transformers_minimax_cached_decoding():
    layer = _hf_layer(layer_idx=2)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randn(2, 20, 32, dtype=F64, generator=gen)
    cache = MiniMaxCache()
    with torch.no_grad():
        _, hf_state = layer(prompt, None, None, past_key_values=cache)
        _, state = _our_layer(layer, prompt)
        torch.testing.assert_close(state, cache.get_linear_cache(2), **TIGHT)
        for step in range(4):  # single-token path
            token = torch.randn(2, 1, 32, dtype=F64, generator=gen)
            hf_out, _ = layer(token, None, None, past_key_values=cache)
            our_out, state = _our_layer(layer, token, state, decode=True)
            torch.testing.assert_close(our_out, hf_out, **TIGHT, msg=lambda m, step=step: f"step {step}: {m}")
        # several tokens on top of a cache: HF's token loop vs our chunk path with an initial state
        chunk = torch.randn(2, 11, 32, dtype=F64, generator=gen)
        hf_out, _ = layer(chunk, None, None, past_key_values=cache)
        our_out, state = _our_layer(layer, chunk, state)
        torch.testing.assert_close(our_out, hf_out, **TIGHT)
        torch.testing.assert_close(state, cache.get_linear_cache(2), **TIGHT)


# ---- reduced precision ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("varlen", [False, True])
def test_low_precision_inputs_stay_close_to_float64(dtype, tol, varlen):
    s = lightning_decay_rates(4, 2, 8)
    q, k, v = make_qkv(1, 4, 150, d_k=16, d_v=16, seed=21)
    q_l, k_l, v_l = (x.to(dtype) for x in (q, k, v))
    cu = torch.tensor([0, 1, 70, 150]) if varlen else None
    s0 = activated(3 if varlen else 1, 4, 16, 16, seed=4)
    o_ref, f_ref = lightning_attn_recurrent(
        q_l.double(), k_l.double(), v_l.double(), s.double(), s0, True, cu
    )
    o, final = lightning_attn_chunk(q_l, k_l, v_l, s, 64, s0, True, cu_seqlens=cu)
    assert o.dtype == dtype and final.dtype == torch.float32
    assert torch.isfinite(o).all()
    scale = o_ref.abs().max()
    assert (o.double() - o_ref).abs().max() <= tol * scale
    assert (final.double() - f_ref).abs().max() <= 1e-5 * f_ref.abs().max()  # fp32 accumulation


# ---- dispatch -------------------------------------------------------------------------------------


def test_dispatch_naive_and_chunk_agree_including_varlen():
    s = DECAYS["H8_layer3"]()
    q, k, v = make_qkv(1, 8, 41)
    cu = torch.tensor([0, 5, 41])
    s0 = torch.randn(2, 8, 8, 8, dtype=F64)
    a = lightning_attention(
        q, k, v, s, block_size=8, initial_state=s0, output_final_state=True, cu_seqlens=cu, impl="naive"
    )
    b = lightning_attention(
        q, k, v, s, block_size=8, initial_state=s0, output_final_state=True, cu_seqlens=cu, impl="chunk"
    )
    c = lightning_attention(
        q, k, v, s, block_size=8, initial_state=s0, output_final_state=True, cu_seqlens=cu
    )
    for x, y in ((a, b), (b, c)):
        torch.testing.assert_close(x[0], y[0], **TIGHT)
        torch.testing.assert_close(x[1], y[1], **TIGHT)


def test_triton_hook_is_the_dispatch_point(monkeypatch):
    calls = []

    def fake_triton(q, k, v, decay_rates, *, block_size, initial_state, output_final_state, cu_seqlens):
        calls.append(block_size)
        return lightning_attn_chunk(
            q, k, v, decay_rates, block_size, initial_state, output_final_state, cu_seqlens
        )

    monkeypatch.setattr(kl, "_TRITON_IMPL", fake_triton)
    s = DECAYS["layer0_of_8"]()
    q, k, v = make_qkv(1, 4, 10)
    lightning_attention(q, k, v, s, block_size=32, impl="triton")
    assert calls == [32]
    lightning_attention(q, k, v, s, impl="auto")  # CPU tensors: auto never takes the Triton path
    assert calls == [32]


def test_triton_requested_but_unavailable_raises_clear_error(monkeypatch):
    monkeypatch.setattr(kl, "_TRITON_IMPL", None)
    monkeypatch.setattr(kl, "_TRITON_DECODE_IMPL", None)
    monkeypatch.setattr(
        kl, "_triton_unavailable", {"chunk": "no kernel in this test", "decode": "no kernel in this test"}
    )
    s = DECAYS["layer0_of_8"]()
    q, k, v = make_qkv(1, 4, 3)
    with pytest.raises(RuntimeError, match="impl='triton'.*unavailable.*no kernel in this test"):
        lightning_attention(q, k, v, s, impl="triton")
    with pytest.raises(RuntimeError, match="Triton decode kernel is unavailable"):
        lightning_attention_decode(
            q[:, :, :1], k[:, :, :1], v[:, :, :1], s, torch.zeros(1, 4, 8, 8, dtype=F64), impl="triton"
        )


# ---- errors ---------------------------------------------------------------------------------------


def _qkv_s():
    q, k, v = make_qkv(2, 4, 10)
    return q, k, v, DECAYS["layer0_of_8"]()


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda q, k, v, s: dict(q=q[0]), r"q must be \[B, H, T, D\]"),
        (lambda q, k, v, s: dict(k=k[:, :, :5]), "q and k must have the same shape"),
        (lambda q, k, v, s: dict(v=v[:, :2]), "v must share"),
        (lambda q, k, v, s: dict(decay_rates=s.view(4, 1, 1)), r"decay_rates must have shape \[H\]"),
        (lambda q, k, v, s: dict(decay_rates=s[:3]), r"decay_rates must have shape \[H\]"),
        (lambda q, k, v, s: dict(initial_state=torch.zeros(2, 4, 8, 7, dtype=F64)), "initial_state must be"),
        (lambda q, k, v, s: dict(cu_seqlens=torch.tensor([0, 10])), "B must be 1"),
        (lambda q, k, v, s: dict(block_size=0), "block_size must be a positive int"),
        (lambda q, k, v, s: dict(impl="flash"), "impl must be one of"),
        (lambda q, k, v, s: dict(k=k.float()), "must share a dtype"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, match):
    q, k, v, s = _qkv_s()
    args = dict(q=q, k=k, v=v, decay_rates=s)
    args.update(mutate(q, k, v, s))
    with pytest.raises((ValueError, TypeError), match=match):
        lightning_attention(**args)


@pytest.mark.parametrize(
    "cu,state_rows,match",
    [
        (torch.tensor([0, 4, 9]), None, "end at T=10"),
        (torch.tensor([1, 4, 10]), None, "start at 0"),
        (torch.tensor([0, 6, 4, 10]), None, "non-decreasing"),
        (torch.tensor([0.0, 10.0]), None, "integer"),
        (torch.tensor([[0, 10]]), None, "1-D"),
        (torch.tensor([0, 4, 10]), 1, r"initial_state must be \[N"),
    ],
)
def test_bad_cu_seqlens_raise_clear_errors(cu, state_rows, match):
    q, k, v, s = _qkv_s()
    s0 = torch.zeros(state_rows, 4, 8, 8, dtype=F64) if state_rows else None
    for impl in ("chunk", "naive"):
        with pytest.raises(ValueError, match=match):
            lightning_attention(q[:1], k[:1], v[:1], s, cu_seqlens=cu, initial_state=s0, impl=impl)


def test_decode_rejects_more_than_one_token():
    q, k, v, s = _qkv_s()
    with pytest.raises(ValueError, match="exactly one new token"):
        lightning_attention_decode(q, k, v, s, torch.zeros(2, 4, 8, 8, dtype=F64))
