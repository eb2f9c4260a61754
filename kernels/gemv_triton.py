"""The Triton kernel of kernels/gemv.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv import BLOCK_K, BLOCK_O


@triton.jit
def _gemv_kernel(x, w, y, O, s_wo, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BO: tl.constexpr,
                 BK: tl.constexpr):
    offs_o = tl.program_id(0) * BO + tl.arange(0, BO)
    offs_n = tl.arange(0, BN)
    mask_o = offs_o < O
    mask_n = offs_n < N
    acc = tl.zeros([BN, BO], tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < K
        wt = tl.load(w + offs_o[:, None] * s_wo + offs_k[None, :], mask=mask_o[:, None] & mask_k[None, :],
                     other=0.0).to(tl.float32)  # [BO, BK]
        xt = tl.load(x + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                     other=0.0).to(tl.float32)  # [BN, BK]
        acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)
    tl.store(y + offs_n[:, None] * O + offs_o[None, :], acc.to(y.dtype.element_ty),
             mask=mask_n[:, None] & mask_o[None, :])


@torch.library.custom_op("hylight::small_batch_linear", mutates_args=())
def small_batch_linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, K] contiguous (N <= 4), weight [O, K] with a contiguous last dim -> [N, O] in x's dtype."""
    n, k = x.shape
    o = weight.shape[0]
    if weight.stride(1) != 1:
        raise ValueError("small_batch_linear: the weight's last dimension must be contiguous")
    y = torch.empty(n, o, device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(o, BLOCK_O),)](
        x, weight, y, o, weight.stride(0), N=n, K=k, BN=max(2, triton.next_power_of_2(n)), BO=BLOCK_O,
        BK=min(BLOCK_K, triton.next_power_of_2(k)), num_warps=4)  # fmt: skip
    return y


@small_batch_linear_triton.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
