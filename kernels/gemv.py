"""``x @ weight.T`` for a few rows (a decode step's projections at batch 1-4): one Triton matrix-vector kernel that
reads the weight once.

At one to four rows cuBLAS runs a GEMM tile shaped for many rows: on an H100 each of a ``gpu-300m`` decode step's
attention projections (2-6 MB of bf16 weights, ~1-2 us of reading) took ~4.3 us. Here each program computes BLOCK_O
output features for every row, streaming its slice of the weight once.

    small_batch_linear            the public entry point (Triton on CUDA, or under TRITON_INTERPRET=1)
    small_batch_linear_reference  ``F.linear`` (tests compare against it)

Shapes: x [..., K] with at most MAX_ROWS rows in all, weight [O, K] (last dim contiguous) -> [..., O] in x's dtype;
math in fp32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

__all__ = ["MAX_ROWS", "small_batch_linear", "small_batch_linear_reference"]

MAX_ROWS = 4
BLOCK_O = 4  # output features per program: 256 programs for O = 1024
BLOCK_K = 256


def small_batch_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype))


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The Triton kernel; see the module docstring."""
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS:
        raise ValueError(f"small_batch_linear: at most {MAX_ROWS} rows, got {rows}; use F.linear")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("small_batch_linear: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set "
                           "before kernels.gemv_triton is imported)")
    from kernels.gemv_triton import small_batch_linear_triton

    out = small_batch_linear_triton(x.reshape(rows, x.shape[-1]).contiguous(), weight)
    return out.reshape(*x.shape[:-1], weight.shape[0])
