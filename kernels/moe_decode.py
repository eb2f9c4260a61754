"""The MoE feed-forward for a handful of tokens (a batch-1 decode step): two Triton matrix-vector kernels that read
only the chosen experts' weights, once.

With fewer routed slots than experts (N x top_k < E: batch 1 with top-2 of 8), the dense path reads every expert and
the grouped GEMM pads each slot to a 64-row tile behind a sort and an index_add; a decode step is bound by reading
weights, so here each slot reads its expert's rows once:

    swiglu_slots        h[s] = SiLU(W_gate[e_s] x_t) * (W_up[e_s] x_t)            grid (slots, F / BLOCK_F)
    down_combine        y[t] = sum_j w_tj * W_down[e_tj] h[t*k + j]               grid (tokens, d / BLOCK_O)

    moe_decode_ffn      the public entry point (Triton on CUDA, or under TRITON_INTERPRET=1)
    moe_decode_ffn_reference   the same function in PyTorch (any dtype; tests compare against it)

Shapes: x [N, d]; gate_up [E, 2F, d] (gate rows then up rows, the released layout); down [E, d, F];
top_i, top_w [N, k]. Math in fp32; y in x's dtype. Every slot counts (no capacity: decode is dropless).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

__all__ = ["moe_decode_ffn", "moe_decode_ffn_reference"]


def moe_decode_ffn_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_i: torch.Tensor,
                             top_w: torch.Tensor) -> torch.Tensor:
    """sum_j top_w[t, j] * FFN_{top_i[t, j]}(x[t]), computed in x's dtype (fp32 or wider for a check)."""
    n, k = top_i.shape
    out = torch.zeros_like(x)
    for j in range(k):
        w13 = gate_up[top_i[:, j]].to(x.dtype)  # [N, 2F, d]
        gate, up = torch.einsum("nfd,nd->nf", w13, x).chunk(2, dim=-1)
        h = F.silu(gate) * up
        y = torch.einsum("nof,nf->no", down[top_i[:, j]].to(x.dtype), h)
        out = out + top_w[:, j, None].to(x.dtype) * y
    return out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def moe_decode_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_i: torch.Tensor,
                   top_w: torch.Tensor) -> torch.Tensor:
    """The Triton kernels (CUDA tensors, or TRITON_INTERPRET=1); see the module docstring."""
    if not x.is_cuda and not _interpreting():
        raise RuntimeError("moe_decode_ffn: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
                           "kernels.moe_decode_triton is imported)")
    from kernels.moe_decode_triton import moe_decode_ffn_triton  # heavy and optional: triton

    return moe_decode_ffn_triton(x.contiguous(), gate_up, down, top_i.contiguous(), top_w.float().contiguous())
