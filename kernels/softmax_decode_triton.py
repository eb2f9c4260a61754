"""Triton split-K decode attention (see kernels/softmax_decode.py for the contract and why).

Kernel 1, grid (B x H_kv, splits): one program scores the G = H / H_kv query heads of a GQA group against one
chunk of a row's keys with an online softmax, and writes the chunk's normalised output and log-sum-exp.
Kernel 2, grid (B x H): merges a head's chunks, weighting each by exp(lse_chunk - lse_total).
Math in fp32; the keys are read once per group, not once per query head.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per inner iteration
MIN_PROGRAMS = 256  # split the keys until B x H_kv x splits reaches about this many programs (2 per H100 SM;
# measured at batch 1, 128K and 512K keys: 256 and 512 read at 0.7 and 2.1 TB/s, 1024 and more slower)


def split_count(batch: int, kv_heads: int, capacity: int) -> int:
    """Chunks of the key axis per (row, KV head): enough programs to fill the GPU, each at least BLOCK_N keys."""
    most = max(1, -(-capacity // BLOCK_N))
    want = max(1, -(-MIN_PROGRAMS // (batch * kv_heads)))
    return min(most, want)


@triton.jit
def _partial_kernel(
    q, k, v, lengths, part_o, part_lse,
    s_qb, s_qh, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    scale, chunk,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BG: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    bkv = tl.program_id(0)
    split = tl.program_id(1)
    b = bkv // HKV
    hk = bkv % HKV
    length = tl.load(lengths + b).to(tl.int32)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    offs_g = tl.arange(0, BG)
    offs_d = tl.arange(0, BD)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = hk * G + offs_g
    b_q = tl.load(q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                  mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    k_base = k + b * s_kb + hk * s_kh
    v_base = v + b * s_vb + hk * s_vh
    for n0 in range(start, end, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_n = offs_n < end
        b_k = tl.load(k_base + offs_n[:, None] * s_kn + offs_d[None, :],
                      mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        b_v = tl.load(v_base + offs_n[:, None] * s_vn + offs_d[None, :],
                      mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        s = (tl.dot(b_q, tl.trans(b_k)) * scale).to(tl.float32)  # [BG, BN]; scale may come in as fp64
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, b_v)
        m_i = m_new
    # an empty chunk (start >= length) leaves l_i = 0: lse = -inf, output 0, weight 0 in the merge
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row = (bkv * SPLITS + split) * G
    tl.store(part_o + (row + offs_g[:, None]) * D + offs_d[None, :], out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(part_lse + row + offs_g, lse, mask=mask_g)


@triton.jit
def _merge_kernel(
    part_o, part_lse, o, s_ob, s_oh,
    H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BD: tl.constexpr, SPLITS: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    hk = h // G
    g = h % G
    offs_s = tl.arange(0, BS)
    offs_d = tl.arange(0, BD)
    mask_s = offs_s < SPLITS
    mask_d = offs_d < D
    rows = ((b * HKV + hk) * SPLITS + offs_s) * G + g  # [BS]
    lse = tl.load(part_lse + rows, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - m)  # chunks past the row's length: exp(-inf) = 0
    w = tl.where(mask_s, w, 0.0)
    parts = tl.load(part_o + rows[:, None] * D + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(o + b * s_ob + h * s_oh + offs_d, out.to(o.dtype.element_ty), mask=mask_d)


@torch.library.custom_op("hylight::softmax_decode_split_k", mutates_args=())
def split_k_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """q [B, H, 1, D], caches [B, H_kv, S, D] (last dim contiguous), lengths [B] -> o [B, H, 1, D].
    A custom op: torch.compile calls it as it is instead of tracing into the launches."""
    batch, heads, _, d = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("softmax_decode_attention: the caches' last dimension must be contiguous")
    splits = split_count(batch, kv_heads, capacity)
    chunk = -(-capacity // splits)
    chunk = -(-chunk // BLOCK_N) * BLOCK_N
    part_o = torch.empty(batch * kv_heads * splits * group, d, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(batch * kv_heads * splits * group, device=q.device, dtype=torch.float32)
    o = torch.empty(batch, heads, 1, d, device=q.device, dtype=q.dtype)
    bd = max(16, triton.next_power_of_2(d))
    _partial_kernel[(batch * kv_heads, splits)](
        q, k_cache, v_cache, lengths, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        1.0 / math.sqrt(d), chunk,
        HKV=kv_heads, G=group, D=d, BG=max(16, triton.next_power_of_2(group)), BD=bd, BN=BLOCK_N, SPLITS=splits,
        num_warps=4,
    )  # fmt: skip
    _merge_kernel[(batch * heads,)](
        part_o, part_lse, o, o.stride(0), o.stride(1),
        H=heads, HKV=kv_heads, G=group, D=d, BD=bd, SPLITS=splits, BS=max(2, triton.next_power_of_2(splits)),
        num_warps=4,
    )  # fmt: skip
    return o


@split_k_decode_attention.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
