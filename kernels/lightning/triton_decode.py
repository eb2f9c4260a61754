"""One generation step of lightning attention as one fused Triton kernel (MiniMax-01 §3.3.1).

S ← λ S + kᵀ v, o = q S for every (batch row, head) at once: each program loads one d_k × BV tile of
the cached state, updates it in fp32 registers, writes it back and writes its slice of o. The step
reads and writes the state once (2·B·H·d_k·d_v·4 bytes for a float32 cache) whatever the context
length. Same contract as ``decode.lightning_attn_decode``; the new state is a new tensor, the
input state is left as it was.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lightning.chunk import check_lightning_inputs
from kernels.lightning.decode import lightning_attn_decode
from kernels.lightning.triton_chunk import MAX_HEAD_DIM, _interpreting

__all__ = ["lightning_attn_triton_decode"]

DECODE_BLOCK_V = 32  # value tile: B·H·d_v/32 programs keep a few hundred in flight even at B=1


@triton.jit
def _decode_kernel(
    q,
    k,
    v,
    state,
    new_state,
    o,
    rates,
    s_qb,
    s_qh,
    s_kb,
    s_kh,
    s_vb,
    s_vh,
    s_ob,
    s_oh,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    bh = tl.program_id(0)
    i_v = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    lam = tl.exp(-tl.load(rates + h).to(tl.float32))
    b_q = tl.load(q + b * s_qb + h * s_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + b * s_kb + h * s_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + b * s_vb + h * s_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    offs = bh.to(tl.int64) * (K * V) + offs_k[:, None] * V + offs_v[None, :]
    tile_mask = mask_k[:, None] & mask_v[None, :]
    s = tl.load(state + offs, mask=tile_mask, other=0.0).to(tl.float32)
    s = lam * s + b_k[:, None] * b_v[None, :]  # S <- λ S + kᵀ v
    tl.store(new_state + offs, s.to(new_state.dtype.element_ty), mask=tile_mask)
    b_o = tl.sum(b_q[:, None] * s, axis=0)  # o = q S
    tl.store(o + b * s_ob + h * s_oh + offs_v, b_o.to(o.dtype.element_ty), mask=mask_v)


def lightning_attn_triton_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    state: torch.Tensor,
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B,H,1,d_k], v [B,H,1,d_v], state [B,H,d_k,d_v] -> (o [B,H,1,d_v] in q's dtype, new state).

    Math in float32; the new state keeps ``state``'s dtype. ``out_state`` (contiguous, like ``state``; may be
    ``state`` itself: each program reads its tile before it writes it) receives the new state instead of a new
    tensor, which keeps a preallocated cache's address fixed for CUDA graphs. float64 (q or state) and head dims
    above 128 go to the PyTorch step, which computes in float64 / any size.
    """
    check_lightning_inputs(q, k, v, decay_rates, state, caller="lightning_attn_triton_decode")
    if q.shape[2] != 1:
        raise ValueError(
            f"lightning_attn_triton_decode: expects exactly one new token (T=1), got T={q.shape[2]}; for several "
            "tokens use lightning_attention(..., initial_state=state, output_final_state=True)"
        )
    if not q.is_cuda and not _interpreting():
        raise RuntimeError(
            "lightning_attn_triton_decode: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"kernels.lightning.triton_decode is imported); got tensors on {q.device}"
        )
    d_k, d_v = q.shape[-1], v.shape[-1]
    if torch.float64 in (q.dtype, state.dtype) or max(d_k, d_v) > MAX_HEAD_DIM:
        return lightning_attn_decode(q, k, v, decay_rates, state, out_state)
    rates = decay_rates.detach().to(device=q.device, dtype=torch.float32).contiguous()
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if out_state is not None:
        if out_state.shape != state.shape or not (out_state.is_contiguous() and state.is_contiguous()):
            raise ValueError("lightning_attn_triton_decode: out_state must be contiguous and shaped like state")
        if out_state is state:  # in place: one opaque op, so torch.compile sees what it mutates
            return lightning_decode_inplace(q, k, v, rates, state), state
        return _launch(q, k, v, rates, state, out_state), out_state
    state = state.contiguous()
    new_state = torch.empty_like(state)
    return _launch(q, k, v, rates, state, new_state), new_state


@torch.library.custom_op("hylight::lightning_decode_inplace", mutates_args=("state",))
def lightning_decode_inplace(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rates: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The decode step with the state updated in place (rates: fp32 [H]); returns o [B, H, 1, d_v]."""
    return _launch(q, k, v, rates, state, state)


@lightning_decode_inplace.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rates: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], 1, v.shape[-1])


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rates: torch.Tensor, state: torch.Tensor,
            new_state: torch.Tensor) -> torch.Tensor:
    batch, heads = q.shape[:2]
    d_k, d_v = q.shape[-1], v.shape[-1]
    o = torch.empty(batch, heads, 1, d_v, device=q.device, dtype=q.dtype)
    bk = max(16, triton.next_power_of_2(d_k))
    bv = min(DECODE_BLOCK_V, max(16, triton.next_power_of_2(d_v)))
    _decode_kernel[(batch * heads, triton.cdiv(d_v, bv))](
        q,
        k,
        v,
        state,
        new_state,
        o,
        rates,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        heads,
        K=d_k,
        V=d_v,
        BK=bk,
        BV=bv,
        num_warps=4,
    )
    return o
