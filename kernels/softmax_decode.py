"""One decode step of softmax attention against a preallocated KV cache whose rows hold different lengths.

Generation keeps each softmax layer's keys/values in a static [B, H_kv, capacity, D] buffer (model/generation.py),
so a step's shapes never change and the step can be captured in a CUDA graph; row b holds ``lengths[b]`` valid
keys (the newest token's included), the rest of the row is stale or unwritten and must not be read.

    softmax_decode_attention            the public entry point: Triton split-K ("flash-decoding") on CUDA,
                                        the masked SDPA reference elsewhere
    softmax_decode_attention_reference  SDPA over the whole capacity with a [B, 1, 1, capacity] length mask

Why split-K: with one query per row, SDPA's kernels parallelise over queries, so batch 1 x 2 KV heads keeps a
handful of programs busy while they walk 1M keys. Here each program takes one (row, KV head, chunk of keys),
computes the scores of every query head of its GQA group against that chunk with one load of the keys (the
group's heads share them), and writes a partial (max-shifted sum, log-sum-exp); a second kernel merges the
chunks. Chunks past a row's length exit at once, so the work follows the row's length, not the capacity, while
the launch grid (fixed by the capacity) stays the same from step to step.

Shapes: q [B, H, 1, D]; k_cache, v_cache [B, H_kv, S, D] (H a multiple of H_kv); lengths [B] integer on q's
device, 1 <= lengths[b] <= S (not checked: reading it would wait on the GPU). Scale 1/sqrt(D), as SDPA's default.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

__all__ = ["softmax_decode_attention", "softmax_decode_attention_reference"]


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor) -> None:
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"softmax_decode_attention: q must be [B, H, 1, D] (one new token per row), got "
                         f"{tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"softmax_decode_attention: k_cache and v_cache must be the same [B, H_kv, S, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    b, h, _, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or h % k_cache.shape[1]:
        raise ValueError(f"softmax_decode_attention: q {tuple(q.shape)} does not fit the cache "
                         f"{tuple(k_cache.shape)} (same B and D, H a multiple of H_kv)")
    if lengths.shape != (b,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"softmax_decode_attention: lengths must be an integer [B]=[{b}] tensor, got "
                         f"{lengths.dtype} {tuple(lengths.shape)}")


def softmax_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """The masked SDPA form: every row attends to its first ``lengths[b]`` keys. Any dtype (fp64 works)."""
    _check(q, k_cache, v_cache, lengths)
    positions = torch.arange(k_cache.shape[2], device=q.device)
    mask = (positions[None, :] < lengths[:, None].to(q.device))[:, None, None, :]  # [B, 1, 1, S]
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                          enable_gqa=k_cache.shape[1] != q.shape[1])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def softmax_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, *, impl: str = "auto"
) -> torch.Tensor:
    """o [B, H, 1, D] in q's dtype. ``impl``: "auto" (Triton on CUDA, else the reference), "triton", "sdpa"."""
    if impl not in ("auto", "triton", "sdpa"):
        raise ValueError(f"softmax_decode_attention: impl must be 'auto', 'triton' or 'sdpa', got {impl!r}")
    use_triton = impl == "triton" or (impl == "auto" and q.is_cuda)
    if use_triton and q.dtype != torch.float64 and q.shape[-1] <= 256:
        from kernels.softmax_decode_triton import split_k_decode_attention  # heavy and optional: triton

        _check(q, k_cache, v_cache, lengths)
        return split_k_decode_attention(q, k_cache, v_cache, lengths)
    return softmax_decode_attention_reference(q, k_cache, v_cache, lengths)

