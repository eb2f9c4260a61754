"""Layer-level spec of the hybrid model: lightning layer vs. the token recurrence (float64, outputs and
gradients, lengths not divisible by the block size, several decay settings), decode vs. full, partial RoPE,
GQA softmax attention vs. an explicit softmax, naive vs. chunked kernels at model level."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.lightning import lightning_decay_rates
from model.cache import HybridCache
from model.modeling import (
    HybridForCausalLM,
    LightningAttention,
    RotaryEmbedding,
    SequenceLayout,
    SoftmaxAttention,
    apply_partial_rotary,
)
from model.sizes import config_for


def reference_lightning_layer(layer: LightningAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer written as the report describes it, token by token: S_t = λ S_{t-1} + k_tᵀ v_t, o_t = q_t S_t."""
    B, T, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    qkv = F.silu(x @ layer.qkv_proj.weight.T).view(B, T, H, 3, D)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]  # [B, T, H, D]
    s = lightning_decay_rates(H, layer.layer_idx, layer.num_layers, dtype=x.dtype)
    lam = torch.exp(-s)[None, :, None, None]
    state = x.new_zeros(B, H, D, D)
    outs = []
    for t in range(T):
        state = lam * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, t], state))
    o = torch.stack(outs, dim=1).reshape(B, T, H * D)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.norm.weight  # RMSNorm over all heads
    o = torch.sigmoid(x @ layer.output_gate.weight.T) * o
    return o @ layer.out_proj.weight.T


def _layout(x: torch.Tensor) -> SequenceLayout:
    return SequenceLayout.build(x.shape[0], x.shape[1], 0, x.device, None, None, None)


@pytest.mark.parametrize("length", [1, 15, 37, 64])
@pytest.mark.parametrize("layer_idx,num_layers", [(0, 4), (2, 4), (3, 4), (5, 8)])
def test_lightning_layer_matches_token_recurrence_in_float64(length, layer_idx, num_layers):
    torch.manual_seed(layer_idx * 100 + length)
    cfg = config_for(
        "tiny", num_hidden_layers=num_layers, attention_pattern="all-lightning", lightning_block_size=16
    )
    layer = LightningAttention(cfg, layer_idx).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.2)
    x = torch.randn(2, length, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    ours = layer(x, _layout(x))
    ref = reference_lightning_layer(layer, x)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)

    g = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * g).sum(), [x, layer.qkv_proj.weight, layer.output_gate.weight])
    ref_grads = torch.autograd.grad((ref * g).sum(), [x, layer.qkv_proj.weight, layer.output_gate.weight])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_decay_rates_come_from_the_kernel_and_span_depth():
    cfg = config_for("tiny", num_hidden_layers=8)
    first, last = LightningAttention(cfg, 0), LightningAttention(cfg, 6)
    torch.testing.assert_close(first.decay_rates, lightning_decay_rates(4, 0, 8))
    # s_h = 2^(-8(h+1)/H) at layer 0; deeper layers forget less (factor 1 - l/(L-1))
    torch.testing.assert_close(first.decay_rates, torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]))
    assert torch.all(last.decay_rates < first.decay_rates)


@pytest.mark.parametrize("prefix", [1, 16, 23])
def test_lightning_layer_decode_steps_equal_the_full_sequence(prefix):
    torch.manual_seed(prefix)
    cfg = config_for("tiny", num_hidden_layers=4, attention_pattern="all-lightning", lightning_block_size=16)
    layer = LightningAttention(cfg, 1).double()
    x = torch.randn(2, 40, cfg.hidden_size, dtype=torch.float64)
    full = layer(x, _layout(x))
    cache = HybridCache()
    outs = [layer(x[:, :prefix], _layout(x[:, :prefix]), cache)]
    for t in range(prefix, 40):
        outs.append(layer(x[:, t : t + 1], _layout(x[:, t : t + 1]), cache))
        assert cache.lightning_states[1].shape == (2, cfg.num_attention_heads, cfg.head_dim, cfg.head_dim)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-11)


def test_partial_rope_rotates_half_the_dims_and_is_relative():
    rope = RotaryEmbedding(rotary_dim=8, base=10000.0)
    pos = torch.arange(12)[None]
    cos, sin = rope(pos, torch.float64)
    q = torch.randn(1, 1, 12, 16, dtype=torch.float64)
    k = torch.randn(1, 1, 12, 16, dtype=torch.float64)
    q_same = q[:, :, :1].expand_as(q)  # the same vector at every position
    rq = apply_partial_rotary(q_same, cos, sin)
    torch.testing.assert_close(rq[..., 8:], q_same[..., 8:])  # dims R..D-1 pass through
    torch.testing.assert_close(rq.norm(dim=-1), q_same.norm(dim=-1))  # a rotation
    assert not torch.allclose(rq[..., :8], q_same[..., :8])
    # pair (0, 4) turns at frequency 1 (base^0): position 3 rotates it by 3 radians
    c, s = (
        torch.cos(torch.tensor(3.0, dtype=torch.float64)),
        torch.sin(torch.tensor(3.0, dtype=torch.float64)),
    )
    x0, x4 = q_same[0, 0, 3, 0], q_same[0, 0, 3, 4]
    torch.testing.assert_close(rq[0, 0, 3, 0], x0 * c - x4 * s)
    torch.testing.assert_close(rq[0, 0, 3, 4], x4 * c + x0 * s)
    # scores depend on the offset only: shifting both positions by 5 leaves q.k unchanged (the angles are
    # computed in float32, as in transformers, hence the tolerance)
    cos5, sin5 = rope(pos + 5, torch.float64)
    a = apply_partial_rotary(q, cos, sin) @ apply_partial_rotary(k, cos, sin).transpose(-1, -2)
    b = apply_partial_rotary(q, cos5, sin5) @ apply_partial_rotary(k, cos5, sin5).transpose(-1, -2)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    shifted_k = apply_partial_rotary(k, cos5, sin5)  # a different offset must change the scores
    assert not torch.allclose(a, apply_partial_rotary(q, cos, sin) @ shifted_k.transpose(-1, -2), atol=1e-3)


def test_softmax_attention_is_causal_gqa_softmax_in_float64():
    torch.manual_seed(0)
    cfg = config_for("tiny", num_hidden_layers=2, attention_pattern="all-softmax")
    layer = SoftmaxAttention(cfg, 0).double()
    x = torch.randn(2, 19, cfg.hidden_size, dtype=torch.float64)
    layout = _layout(x)
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)(layout.position_ids, torch.float64)
    ours = layer(x, layout, rope)

    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = apply_partial_rotary((x @ layer.q_proj.weight.T).view(2, 19, H, D).transpose(1, 2), *rope)
    k = apply_partial_rotary((x @ layer.k_proj.weight.T).view(2, 19, Hkv, D).transpose(1, 2), *rope)
    v = (x @ layer.v_proj.weight.T).view(2, 19, Hkv, D).transpose(1, 2)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)  # head h reads kv h//g
    scores = q @ k.transpose(-1, -2) / D**0.5
    scores = scores.masked_fill(torch.ones(19, 19, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 19, H * D) @ layer.o_proj.weight.T
    torch.testing.assert_close(ours, ref)


def test_chunked_kernel_equals_naive_recurrence_through_the_whole_model():
    torch.manual_seed(1)
    kw = dict(num_hidden_layers=4, attention_pattern=["lightning", "softmax", "lightning", "lightning"],
              lightning_block_size=16)  # fmt: skip
    chunked = HybridForCausalLM(config_for("tiny", lightning_impl="chunk", **kw)).double().eval()
    naive = HybridForCausalLM(config_for("tiny", lightning_impl="naive", **kw)).double().eval()
    naive.load_state_dict(chunked.state_dict())
    ids = torch.randint(0, 512, (2, 45))
    a, b = chunked(ids), naive(ids)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-10, atol=1e-10)
    (a.logits.square().mean()).backward()
    (b.logits.square().mean()).backward()
    for (name, p), q in zip(chunked.named_parameters(), naive.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-8, atol=1e-12, msg=name)
