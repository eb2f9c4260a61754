"""Triton kernels of kernels/moe_decode.py: two matrix-vector passes over the chosen experts' rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_F = 8  # intermediate rows per program: 2 x 1536 / 8 = 384 programs at batch 1 for gpu-300m
BLOCK_O = 4  # output features per program in the down projection: 256 programs per token for d = 1024
BLOCK_K = 512  # reduction chunk


@triton.jit
def _swiglu_slots_kernel(x, w13, top_i, h, s_we, s_wf, D: tl.constexpr, FF: tl.constexpr, K: tl.constexpr,
                         BF: tl.constexpr, BK: tl.constexpr):
    s = tl.program_id(0)  # slot = token * K + choice
    f0 = tl.program_id(1) * BF
    t = s // K
    e = tl.load(top_i + s).to(tl.int64)
    offs_f = f0 + tl.arange(0, BF)
    mask_f = offs_f < FF
    acc_g = tl.zeros([BF], tl.float32)
    acc_u = tl.zeros([BF], tl.float32)
    base = w13 + e * s_we
    for d0 in range(0, D, BK):
        offs_d = d0 + tl.arange(0, BK)
        mask_d = offs_d < D
        xv = tl.load(x + t * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        m = mask_f[:, None] & mask_d[None, :]
        wg = tl.load(base + offs_f[:, None] * s_wf + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(base + (offs_f[:, None] + FF) * s_wf + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    out = acc_g * tl.sigmoid(acc_g) * acc_u  # SiLU(gate) * up
    tl.store(h + s * FF + offs_f, out, mask=mask_f)


@triton.jit
def _down_combine_kernel(h, w2, top_i, top_w, y, s_we, s_wo, D: tl.constexpr, FF: tl.constexpr, K: tl.constexpr,
                         BO: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0)
    o0 = tl.program_id(1) * BO
    offs_o = o0 + tl.arange(0, BO)
    mask_o = offs_o < D
    acc = tl.zeros([BO], tl.float32)
    for j in range(K):
        e = tl.load(top_i + t * K + j).to(tl.int64)
        w = tl.load(top_w + t * K + j)
        part = tl.zeros([BO], tl.float32)
        for f0 in range(0, FF, BK):
            offs_f = f0 + tl.arange(0, BK)
            mask_f = offs_f < FF
            hv = tl.load(h + (t * K + j) * FF + offs_f, mask=mask_f, other=0.0)
            wd = tl.load(w2 + e * s_we + offs_o[:, None] * s_wo + offs_f[None, :],
                         mask=mask_o[:, None] & mask_f[None, :], other=0.0).to(tl.float32)
            part += tl.sum(wd * hv[None, :], axis=1)
        acc += w * part
    tl.store(y + t * D + offs_o, acc.to(y.dtype.element_ty), mask=mask_o)


@torch.library.custom_op("hylight::moe_decode_ffn", mutates_args=())
def moe_decode_ffn_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_i: torch.Tensor,
                          top_w: torch.Tensor) -> torch.Tensor:
    """x [N, d], gate_up [E, 2F, d], down [E, d, F] (last dims contiguous), top_i [N, k], top_w fp32 [N, k]."""
    n, d = x.shape
    k = top_i.shape[1]
    ff = down.shape[2]
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("moe_decode_ffn: expert weights need a contiguous last dimension")
    h = torch.empty(n * k, ff, device=x.device, dtype=torch.float32)
    y = torch.empty_like(x)
    bk = min(BLOCK_K, triton.next_power_of_2(d))
    _swiglu_slots_kernel[(n * k, triton.cdiv(ff, BLOCK_F))](
        x, gate_up, top_i, h, gate_up.stride(0), gate_up.stride(1), D=d, FF=ff, K=k, BF=BLOCK_F, BK=bk,
        num_warps=4)  # fmt: skip
    bk = min(BLOCK_K, triton.next_power_of_2(ff))
    _down_combine_kernel[(n, triton.cdiv(d, BLOCK_O))](
        h, down, top_i, top_w, y, down.stride(0), down.stride(1), D=d, FF=ff, K=k, BO=BLOCK_O, BK=bk,
        num_warps=4)  # fmt: skip
    return y


@moe_decode_ffn_triton.register_fake
def _(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_i: torch.Tensor,
      top_w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
