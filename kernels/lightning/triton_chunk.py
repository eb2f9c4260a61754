"""Lightning attention in Triton (MiniMax-01 §2.2.1): forward and backward kernels, varlen, autograd.

Math, per head with λ = exp(−s) and no 1/√d scale (naive.py): S_t = λ S_{t−1} + k_tᵀ v_t, o_t = q_t S_t.

One kernel does all the work. A program walks its tokens chunk by chunk (C = 64) keeping a d_k × BV
slice of the state in fp32 registers (Algorithm 1): intra-chunk left product [(Q Kᵀ) ⊙ M] V with
M_ij = λ^(i−j), inter-chunk right product λ^(i+1) Q S_in, then S ← λ^L S + Σ_j kᵀ_j (λ^(L−1−j) v_j).
No per-chunk state goes to memory. The backward pass is three more runs of the same kernel:
    dq = lightning(q'=dO, k'=v, v'=k) from S0ᵀ, in time order:
         dq_t = Σ_{j≤t} λ^(t−j) (dO_t·v_j) k_j + λ^(t+1) dO_t S0ᵀ
    dv = lightning(q'=k, k'=q, v'=dO) against time order (REVERSE): with R_j = Σ_{t≥j} λ^(t−j) q_tᵀ dO_t
         (+ λ^(T−1−j) dS_final), dv_j = k_j R_j; the pass carries λR, so dS_final seeds it and
         dS0 = λ R_0 is its final carry
    dk = lightning(q'=v, k'=dO, v'=q) against time order from dS_finalᵀ: dk_j = v_j R_jᵀ.
Each run reads three tensors and writes one; no pass reads what the forward wrote, except (with
split sequences, below) the forward's segment start states.

Work items. A program owns one (work item, head, value tile): a token range [a, e) of one sequence
(a batch row, or a packed sequence of ``cu_seqlens``: chunks start at each sequence's start, loads
are masked, nothing is padded in memory). When (sequence, head, tile) programs cannot fill one wave
of the GPU (B·H small at long N), long sequences are cut into segments: a state pass computes every
segment's local end state, a scan over segments gives each its start state, and the main pass starts
from there. The dk/dv passes get their reverse start states the same way. A state pass reads only the
tokens within its head's decay horizon (weight λ^n ≥ 2^-40, ``horizon_tokens``): most MiniMax heads
forget long before a segment ends, so a split costs them almost nothing; heads that barely decay
(the last layers) pay a full extra read of two tensors per split sequence.

Entry point: ``lightning_attn_triton_chunk`` (signature of ``chunk.lightning_attn_chunk``), which
``kernels.lightning`` dispatches to on CUDA. It also runs on CPU tensors under TRITON_INTERPRET=1
(set before importing this module), which is how CI checks it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
import weakref

import torch
import triton
import triton.language as tl

from kernels.lightning.chunk import check_lightning_inputs, lightning_attn_chunk

__all__ = ["KernelConfig", "DEFAULT_CONFIG", "lightning_attn_triton", "lightning_attn_triton_chunk"]

MAX_HEAD_DIM = 128  # a program holds d_k × BV of state plus [C, d_k] tiles; larger heads use PyTorch
ITEM_COLS = 6  # work-item table: batch row, sequence, start, end, flags (1 first, 2 last), slot (-1: none)
FIRST, LAST = 1, 2


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes, launch shapes and the segmentation policy (tuned in bench/NOTES-lightning-triton.md)."""

    chunk: int = 64  # C: tokens per intra-chunk block (a power of two, 16..128)
    block_v: int = 64  # value tile of every pass: d_v/BV programs per (item, head) share q, k in L2
    warps: int = 4
    stages: int = 2
    state_block_v: int = 64  # segment local-state pass
    state_warps: int = 4
    state_stages: int = 2
    state_direct_weights: bool = True  # state pass: each token's own λ power, no per-chunk rescale
    state_horizon_bits: int | None = 40  # state passes skip tokens weighing < 2^-bits; None: read all
    state_split: int | None = None  # programs per segment in the state pass; None: _state_parts
    state_min_part_chunks: int = 16  # a state-pass program takes at least this many chunks of a segment
    fuse_dq_state: bool = False  # the dq pass also sums the reverse segment states (one read less)
    dq_block_v: int | None = None  # value (= d_k) tile of a fused dq pass; None: block_v
    mask_in_loop: bool = False  # recompute the [C, C] decay mask every chunk instead of holding it
    programs_per_sm: float = 2.0  # programs resident per SM: one wave = SMs × this
    min_segment_chunks: int = 8  # never cut a sequence into segments shorter than this many chunks
    segment_chunks: int | None = None  # force this segment length (tests, benchmarks); None: policy

    def chunk_for(self, block_size: int) -> int:
        """The chunk length used for a caller's ``block_size``: its power of two, clamped to [16, chunk]."""
        return max(16, min(self.chunk, 1 << (max(block_size, 1).bit_length() - 1)))


DEFAULT_CONFIG = KernelConfig()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ================================================================================================
# kernels
# ================================================================================================


@triton.jit
def _load_rows(base, rows, row_mask, stride_t, cols, COL_MASK: tl.constexpr, N_COLS: tl.constexpr):
    """[len(rows), len(cols)] tile of a row-major [T, D] slice (unit stride along D); zeros outside."""
    ptrs = base + rows[:, None].to(tl.int64) * stride_t + cols[None, :]
    if COL_MASK:
        return tl.load(ptrs, mask=row_mask[:, None] & (cols[None, :] < N_COLS), other=0.0)
    else:
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)


@triton.jit
def _store_rows(base, rows, row_mask, stride_t, cols, x, COL_MASK: tl.constexpr, N_COLS: tl.constexpr):
    ptrs = base + rows[:, None].to(tl.int64) * stride_t + cols[None, :]
    if COL_MASK:
        tl.store(ptrs, x, mask=row_mask[:, None] & (cols[None, :] < N_COLS))
    else:
        tl.store(ptrs, x, mask=row_mask[:, None])


@triton.jit
def _state_ptrs(base, row, h, H, K: tl.constexpr, V: tl.constexpr, offs_k, offs_v, s_k, s_v):
    """Pointers into a [rows, H, K, V]-sized fp32 state buffer (element strides s_k, s_v inside a state)."""
    return base + (row.to(tl.int64) * H + h) * (K * V) + offs_k[:, None] * s_k + offs_v[None, :] * s_v


@triton.jit
def _chunk_rows(c, start, end, n_chunks, offs_c, FROM_END: tl.constexpr, C: tl.constexpr):
    """(rows, row mask, valid rows) of chunk c of the token range [start, end), counting chunks from
    its start or (FROM_END) from its end; the last chunk of the range may be short."""
    if FROM_END:
        t0 = start + (n_chunks - 1 - c) * C
    else:
        t0 = start + c * C
    rows = t0 + offs_c
    return rows, rows < end, tl.minimum(end - t0, C)


@triton.jit
def _decay(n, neg_log2_rate):
    """λ^n = exp2(n · (−s·log2 e)) for float n ≥ 0."""
    return tl.exp2(n * neg_log2_rate)


@triton.jit
def _masked_decay(n, neg_log2_rate):
    """λ^n where n ≥ 0, else 0 (no overflow for negative n)."""
    return tl.where(n >= 0, _decay(tl.maximum(n, 0.0), neg_log2_rate), 0.0)


# fmt: off
@triton.jit
def _chunk_kernel(
    q, k, v, o, rates, seq_init, slot_init, final, items, x, x_local,
    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_oh, s_ot, s_xb, s_xh, s_xt,
    s_sk, s_sv,  # element strides of seq_init / slot_init inside one state (transposed states: dq, dk)
    H,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    MASK_K: tl.constexpr, MASK_V: tl.constexpr, REVERSE: tl.constexpr,
    HAS_SEQ_INIT: tl.constexpr, SEGMENTED: tl.constexpr, STORE_FINAL: tl.constexpr,
    REV_STATE: tl.constexpr, MASK_IN_LOOP: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # fmt: on
    """o = lightning(q, k, v) over one work item, head and value tile, from the item's start state.

    REVERSE walks the chunks right to left with the anti-causal mask (the dv and dk passes): then
    o_j = Σ_{i≥j} λ^(i−j) (q_j·k_i) v_i + λ^(L−1−j) q_j S, S ← λ^L S + Σ_i k_iᵀ (λ^(i+1) v_i), and
    STORE_FINAL writes the carry at a sequence's first item (dS0) instead of its last.
    REV_STATE (the dq pass, q = dO) also sums the segment's reverse local state Σ_t λ^(t−a+1) x_tᵀ dO_t
    into x_local (x = the forward's q), which spares the dk/dv passes a state pass.
    """
    n_tiles: tl.constexpr = (V + BV - 1) // BV
    item = tl.program_id(0) // n_tiles  # value tiles of one item are neighbours: they share q, k in L2
    i_v = tl.program_id(0) % n_tiles
    h = tl.program_id(1)
    b = tl.load(items + item * 6 + 0)
    m = tl.load(items + item * 6 + 1)
    start = tl.load(items + item * 6 + 2)
    end = tl.load(items + item * 6 + 3)
    flags = tl.load(items + item * 6 + 4)
    slot = tl.load(items + item * 6 + 5)
    neg = -tl.load(rates + h).to(tl.float32) * 1.4426950408889634

    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    state_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
    b_off = b.to(tl.int64)
    h_off = h.to(tl.int64)
    q_base = q + b_off * s_qb + h_off * s_qh
    k_base = k + b_off * s_kb + h_off * s_kh
    v_base = v + b_off * s_vb + h_off * s_vh
    o_base = o + b_off * s_ob + h_off * s_oh

    state = tl.zeros([BK, BV], dtype=tl.float32)
    if SEGMENTED:
        if slot >= 0:
            ptrs = _state_ptrs(slot_init, slot, h, H, K, V, offs_k, offs_v, s_sk, s_sv)
            state = tl.load(ptrs, mask=state_mask, other=0.0).to(tl.float32)
        elif HAS_SEQ_INIT:
            ptrs = _state_ptrs(seq_init, m, h, H, K, V, offs_k, offs_v, s_sk, s_sv)
            state = tl.load(ptrs, mask=state_mask, other=0.0).to(tl.float32)
    elif HAS_SEQ_INIT:
        ptrs = _state_ptrs(seq_init, m, h, H, K, V, offs_k, offs_v, s_sk, s_sv)
        state = tl.load(ptrs, mask=state_mask, other=0.0).to(tl.float32)

    if REVERSE:
        gap = (offs_c[None, :] - offs_c[:, None]).to(tl.float32)  # [i, j]: λ^(j−i) for keys j ≥ i
    else:
        gap = (offs_c[:, None] - offs_c[None, :]).to(tl.float32)  # [i, j]: λ^(i−j) for keys j ≤ i
    if not MASK_IN_LOOP:
        mask = _masked_decay(gap, neg)
    if REV_STATE:
        x_base = x + b_off * s_xb + h_off * s_xh
        rev = tl.zeros([BV, BK], dtype=tl.float32)

    n_chunks = tl.cdiv(end - start, C)
    for c in range(0, n_chunks):
        rows, row_mask, n_valid = _chunk_rows(c, start, end, n_chunks, offs_c, REVERSE, C)
        b_q = _load_rows(q_base, rows, row_mask, s_qt, offs_k, MASK_K, K)
        b_k = _load_rows(k_base, rows, row_mask, s_kt, offs_k, MASK_K, K)
        b_v = _load_rows(v_base, rows, row_mask, s_vt, offs_v, MASK_V, V)
        if REVERSE:  # query side λ^(L−1−i) (to the chunk's right edge), key side λ^(j+1)
            q_decay = _masked_decay((n_valid - 1 - offs_c).to(tl.float32), neg)
            k_decay = _decay((offs_c + 1).to(tl.float32), neg)
        else:  # query side λ^(i+1) (from the chunk's left edge), key side λ^(L−1−j)
            q_decay = _decay((offs_c + 1).to(tl.float32), neg)
            k_decay = _masked_decay((n_valid - 1 - offs_c).to(tl.float32), neg)
        if REV_STATE:  # Σ_i λ^(t0−a+i+1) x_iᵀ dO_i (underflow far from the segment start is harmless)
            b_x = _load_rows(x_base, rows, row_mask, s_xt, offs_v, MASK_V, V)
            x_decay = _decay((rows - start + 1).to(tl.float32), neg)
            b_xd = (b_x * x_decay[:, None]).to(b_x.dtype)
            rev = tl.dot(tl.trans(b_xd), b_q, acc=rev, input_precision=DOT_PREC)
        # inter-chunk right product (eq. 7's Q·KV, decayed)
        b_o = tl.dot(b_q, state.to(b_q.dtype), input_precision=DOT_PREC) * q_decay[:, None]
        # intra-chunk left product [(Q Kᵀ) ⊙ M] V
        scores = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        if MASK_IN_LOOP:  # C² exp2 per chunk instead of C²/threads registers held across the loop
            scores = scores * _masked_decay(gap, neg)
        else:
            scores = scores * mask
        b_o = tl.dot(scores.to(b_v.dtype), b_v, acc=b_o, input_precision=DOT_PREC)
        _store_rows(o_base, rows, row_mask, s_ot, offs_v, b_o.to(o.dtype.element_ty), MASK_V, V)
        # carry (eq. 9, decayed); the decay goes on the value tile, the smaller operand
        state = state * _decay(n_valid.to(tl.float32), neg)
        b_vd = (b_v * k_decay[:, None]).to(b_v.dtype)
        state = tl.dot(tl.trans(b_k), b_vd, acc=state, input_precision=DOT_PREC)

    if STORE_FINAL:
        if REVERSE:
            at_edge = (flags & 1) != 0
        else:
            at_edge = (flags & 2) != 0
        if at_edge:
            tl.store(_state_ptrs(final, m, h, H, K, V, offs_k, offs_v, V, 1), state, mask=state_mask)
    if REV_STATE:
        if (slot >= 0) & ((flags & 1) == 0):  # [d_x, d_o] layout: rows over this program's V tile
            rev_ptrs = _state_ptrs(x_local, slot, h, H, V, K, offs_v, offs_k, K, 1)
            tl.store(rev_ptrs, rev, mask=(offs_v[:, None] < V) & (offs_k[None, :] < K))


@triton.jit
def _state_span(rate, n_chunks, P, C: tl.constexpr, MIN_PART: tl.constexpr, HORIZON_NATS: tl.constexpr):
    """(chunks a segment's state pass reads, chunks per part): the chunks within the decay horizon
    (all of them when HORIZON_NATS = 0), shared by up to P programs of at least MIN_PART chunks each."""
    n_use = n_chunks
    if HORIZON_NATS > 0:
        reach = tl.where(rate > 0, HORIZON_NATS / tl.maximum(rate, 1e-30), 3.0e38)
        reach = tl.minimum(reach, (n_chunks * C).to(tl.float32))  # no int overflow for slow heads
        n_use = tl.minimum(n_chunks, tl.cdiv(reach.to(tl.int32), C) + 1)
    per = tl.maximum(tl.cdiv(n_use, P), MIN_PART)
    return n_use, per


# fmt: off
@triton.jit
def _segment_state_kernel(
    x, y, rates, out, items, counters,
    s_xb, s_xh, s_xt, s_yb, s_yh, s_yt,
    H, P,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    MASK_K: tl.constexpr, MASK_V: tl.constexpr, REVERSE: tl.constexpr, DIRECT: tl.constexpr,
    HORIZON_NATS: tl.constexpr, MIN_PART: tl.constexpr, REDUCE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # fmt: on
    """A segment's local state from zero, written to out[slot]:
    forward  E = Σ_t λ^(e−1−t) x_tᵀ y_t   (x = k, y = v; skipped for a sequence's last segment)
    reverse  E = Σ_t λ^(t−a+1) x_tᵀ y_t   (x = q, y = dO; skipped for a sequence's first segment).
    DIRECT weighs every token by its own power of λ (a plain sum: the matrix unit can chain the
    accumulation; weights far from the edge underflow to 0, below any term that counts) instead of
    rescaling the accumulator by λ^L every chunk. With direct weights the segment's chunks can be
    shared by P programs (sub-range p of P, at least MIN_PART chunks each: programs left without
    chunks write nothing): a long segment's state then needs no long sequential walk. Each part
    stores its partial sum at out[slot·P + p] and counts itself in on counters[item, h, tile] (zeroed
    by the caller); the last to arrive adds all of them in part order (the result does not depend on
    who is last) into out[slot·P], the one the scan reads. REDUCE = (P > 1).
    HORIZON_NATS > 0 (direct weights only) reads just the chunks within reach of the weighted edge (the end
    for the forward, the start for the reverse): a token n positions away weighs λ^n, and once
    λ^n < 2^-bits (n ≥ HORIZON_NATS/s, HORIZON_NATS = bits·ln 2; 40 bits by default) it adds less than
    2^-16 of one fp32 ulp of a term at the edge, so fast-forgetting heads skip most of a long segment
    (``horizon_tokens``)."""
    n_tiles: tl.constexpr = (V + BV - 1) // BV
    item = tl.program_id(0) // (n_tiles * P)
    part = (tl.program_id(0) // n_tiles) % P
    i_v = tl.program_id(0) % n_tiles
    h = tl.program_id(1)
    flags = tl.load(items + item * 6 + 4)
    slot = tl.load(items + item * 6 + 5)
    if REVERSE:
        unused = flags & 1  # a first segment's reverse state only makes dS0, which the dv pass writes
    else:
        unused = flags & 2  # a last segment's end state is the final state, which the main pass writes
    start = tl.load(items + item * 6 + 2)
    end = tl.load(items + item * 6 + 3)
    rate = tl.load(rates + h).to(tl.float32)
    n_chunks = tl.cdiv(end - start, C)
    n_use, per = _state_span(rate, n_chunks, P, C, MIN_PART, HORIZON_NATS)
    c_lo = part * per
    if (slot >= 0) & (unused == 0) & (c_lo < n_use):
        b = tl.load(items + item * 6 + 0)
        neg = -rate * 1.4426950408889634
        offs_c = tl.arange(0, C)
        offs_k = tl.arange(0, BK)
        offs_v = i_v * BV + tl.arange(0, BV)
        x_base = x + b.to(tl.int64) * s_xb + h.to(tl.int64) * s_xh
        y_base = y + b.to(tl.int64) * s_yb + h.to(tl.int64) * s_yh
        acc = tl.zeros([BK, BV], dtype=tl.float32)
        c_hi = tl.minimum(c_lo + per, n_use)
        # direct weights: c counts chunks from the weighted edge (the end forward, the start reverse);
        # the recurrence walks from the far edge towards it
        for c in range(c_lo, c_hi):
            rows, row_mask, n_valid = _chunk_rows(c, start, end, n_chunks, offs_c, DIRECT != REVERSE, C)
            b_x = _load_rows(x_base, rows, row_mask, s_xt, offs_k, MASK_K, K)
            b_y = _load_rows(y_base, rows, row_mask, s_yt, offs_v, MASK_V, V)
            if DIRECT:
                if REVERSE:
                    w = _decay((rows - start + 1).to(tl.float32), neg)
                else:
                    w = _masked_decay((end - 1 - rows).to(tl.float32), neg)
            else:
                if REVERSE:
                    w = _decay((offs_c + 1).to(tl.float32), neg)
                else:
                    w = _masked_decay((n_valid - 1 - offs_c).to(tl.float32), neg)
                acc = acc * _decay(n_valid.to(tl.float32), neg)
            acc = tl.dot(tl.trans(b_x), (b_y * w[:, None]).to(b_y.dtype), acc=acc, input_precision=DOT_PREC)
        out_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
        tl.store(_state_ptrs(out, slot * P + part, h, H, K, V, offs_k, offs_v, V, 1), acc, mask=out_mask)
        if REDUCE:
            n_parts = tl.cdiv(n_use, per)
            if n_parts > 1:
                tl.debug_barrier()  # every thread's store precedes the release below
                arrived = tl.atomic_add(counters + (item * H + h) * n_tiles + i_v, 1, sem="acq_rel")
                if arrived == n_parts - 1:
                    total = tl.zeros([BK, BV], dtype=tl.float32)
                    for p in range(0, n_parts):
                        ptrs = _state_ptrs(out, slot * P + p, h, H, K, V, offs_k, offs_v, V, 1)
                        total += tl.load(ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
                    tl.store(_state_ptrs(out, slot * P, h, H, K, V, offs_k, offs_v, V, 1), total, mask=out_mask)


# fmt: off
@triton.jit
def _segment_scan_kernel(
    local, starts, seq_init, items, multi, rates,
    H, P,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    REVERSE: tl.constexpr, HAS_SEQ_INIT: tl.constexpr,
):
    # fmt: on
    """Start states of a split sequence's segments: S = init; for each segment (right to left for the
    dk/dv passes): starts[slot] = S; S = λ^len S + local[slot·P] (the segment's sum: the state pass
    adds its P parts up there)."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    i_v = tl.program_id(2)
    m = tl.load(multi + j * 3 + 0)
    first = tl.load(multi + j * 3 + 1)
    count = tl.load(multi + j * 3 + 2)
    neg = -tl.load(rates + h).to(tl.float32) * 1.4426950408889634
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    state_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_SEQ_INIT:
        ptrs = _state_ptrs(seq_init, m, h, H, K, V, offs_k, offs_v, V, 1)
        state = tl.load(ptrs, mask=state_mask, other=0.0).to(tl.float32)
    for i in range(0, count):
        if REVERSE:
            item = first + count - 1 - i
        else:
            item = first + i
        slot = tl.load(items + item * 6 + 5)
        tl.store(_state_ptrs(starts, slot, h, H, K, V, offs_k, offs_v, V, 1), state, mask=state_mask)
        if i + 1 < count:
            length = tl.load(items + item * 6 + 3) - tl.load(items + item * 6 + 2)
            state = state * _decay(length.to(tl.float32), neg)
            ptrs = _state_ptrs(local, slot * P, h, H, K, V, offs_k, offs_v, V, 1)
            state += tl.load(ptrs, mask=state_mask, other=0.0)


# ================================================================================================
# work items
# ================================================================================================


@dataclasses.dataclass(frozen=True)
class WorkPlan:
    """How the tokens are cut into programs: one row per work item (see ITEM_COLS), plus the split
    sequences (sequence, first item, item count) that need a segment scan."""

    items: torch.Tensor  # int32 [n_items, 6] on the compute device
    multi: torch.Tensor  # int32 [n_multi, 3] on the compute device (may be empty)
    n_items: int
    n_slots: int  # items of split sequences (each has a start-state slot)
    n_rows: int  # sequences: B, or N packed ones

    @property
    def segmented(self) -> bool:
        return self.n_slots > 0


def _segment_chunks(
    chunk_counts: tuple[int, ...], heads: int, tiles: int, sms: int, cfg: KernelConfig
) -> int | None:
    """Longest segment in chunks, or None to keep every sequence whole.

    A wave is SMs × ``programs_per_sm`` programs and every (item, head, value tile) is one. When whole
    sequences fill a wave nothing is split: more programs would not run sooner, and segments cost a
    state pass. Otherwise the work is cut into as many balanced segments as one wave holds (floor:
    a few programs over a wave would double the time), never shorter than ``min_segment_chunks``.
    """
    if cfg.segment_chunks is not None:
        return cfg.segment_chunks
    if cfg.programs_per_sm <= 0 or not chunk_counts:
        return None
    want_items = max(1, int(cfg.programs_per_sm * sms) // (heads * tiles))
    seg = max(cfg.min_segment_chunks, math.ceil(sum(chunk_counts) / want_items))
    return None if max(chunk_counts) <= seg else seg


@functools.lru_cache(maxsize=256)
def _plan_tables(
    rows: tuple[tuple[int, int, int], ...], chunk: int, seg_chunks: int | None
) -> tuple[list[tuple[int, ...]], list[tuple[int, int, int]], int]:
    """(items, split sequences, slot count) for sequences given as (batch row, start, end)."""
    items: list[tuple[int, ...]] = []
    multi: list[tuple[int, int, int]] = []
    slots = 0
    for m, (b, start, end) in enumerate(rows):
        n_chunks = -(-(end - start) // chunk)
        pieces = 1 if seg_chunks is None or n_chunks <= seg_chunks else -(-n_chunks // seg_chunks)
        per = -(-n_chunks // pieces) if n_chunks else 0  # balanced: chunks per piece
        pieces = -(-n_chunks // per) if per else 1
        first = len(items)
        for p in range(pieces):
            a = start + p * per * chunk
            e = min(end, a + per * chunk) if per else end
            flags = (FIRST if p == 0 else 0) | (LAST if p == pieces - 1 else 0)
            items.append((b, m, a, e, flags, slots if pieces > 1 else -1))
            slots += pieces > 1
        if pieces > 1:
            multi.append((m, first, pieces))
    return items, multi, slots


_DEVICE_PLANS: dict[tuple, WorkPlan] = {}


def make_plan(
    batch: int,
    length: int,
    sequences: list[tuple[int, int]] | None,
    heads: int,
    d_v: int,
    chunk: int,
    device: torch.device,
    cfg: KernelConfig,
) -> WorkPlan:
    """Work items for B rows of T tokens, or for the packed ``sequences`` (B == 1). Cached per shape."""
    if sequences is None:
        rows = tuple((b, 0, length) for b in range(batch))
    else:
        rows = tuple((0, a, e) for a, e in sequences)
    tiles = triton.cdiv(d_v, min(_pow2(d_v), cfg.block_v))
    counts = tuple(-(-(e - a) // chunk) for _, a, e in rows)
    seg = _segment_chunks(counts, heads, tiles, _sm_count(device), cfg)
    key = (rows, chunk, seg, str(device))
    plan = _DEVICE_PLANS.get(key)
    if plan is None:
        items, multi, slots = _plan_tables(rows, chunk, seg)
        items_t = torch.tensor(items, dtype=torch.int32).reshape(-1, ITEM_COLS).to(device)
        multi_t = torch.tensor(multi, dtype=torch.int32).reshape(-1, 3).to(device)
        plan = WorkPlan(items_t, multi_t, len(items), slots, len(rows))
        if len(_DEVICE_PLANS) > 256:  # varlen batches differ every step: keep the cache small
            _DEVICE_PLANS.clear()
        _DEVICE_PLANS[key] = plan
    return plan


@functools.lru_cache(maxsize=8)
def _sm_count_cached(device: str) -> int:
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a small pretend GPU so that CPU tests exercise the segment split
    return _sm_count_cached(str(device))


# ================================================================================================
# launchers
# ================================================================================================


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: three tf32 products per dot (about fp32 accuracy; "ieee" compiles for ~40 s).
    # 16-bit inputs ignore this.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _launch(kernel, grid, args: tuple, kwargs: dict, warps: int, stages: int):
    """Launch and return the compiled kernel; a config that asks for more shared memory than the GPU
    has is retried with one pipeline stage."""
    try:
        return kernel[grid](*args, **kwargs, num_warps=warps, num_stages=stages)
    except triton.runtime.errors.OutOfResources:
        if stages == 1:
            raise
        return kernel[grid](*args, **kwargs, num_warps=warps, num_stages=1)


def _rows_strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _alloc_like(x: torch.Tensor, d: int) -> torch.Tensor:
    """[B, H, T, d] in x's memory order: time-major ([B, T, H, d] seen through a transpose, the model's
    and fla's layout) when x is, so that outputs reshape for free and gradients need no transposing copy."""
    batch, heads, length, _ = x.shape
    if x.stride(1) < x.stride(2):
        return torch.empty(batch, length, heads, d, device=x.device, dtype=x.dtype).transpose(1, 2)
    return torch.empty(batch, heads, length, d, device=x.device, dtype=x.dtype)


def chunk_pass(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    rates: torch.Tensor,
    plan: WorkPlan,
    chunk: int,
    cfg: KernelConfig,
    *,
    reverse: bool = False,
    seq_init: torch.Tensor | None = None,
    slot_init: torch.Tensor | None = None,
    transposed_init: bool = False,
    final: torch.Tensor | None = None,
    rev: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """out = lightning(q, k, v) over every work item (one of the four passes; see the module doc).

    Initial states are [rows, H, d_k, d_v] buffers read as [d_q, d_v] of this pass, transposed when
    ``transposed_init`` (the dq and dk passes run on Sᵀ). ``final`` receives the carry at each
    sequence's last item (first when ``reverse``). ``rev`` = (x, x_local): see REV_STATE.
    """
    if plan.segmented and slot_init is None:
        raise ValueError("chunk_pass: a plan with split sequences needs the segments' start states (slot_init)")
    heads, d_q, d_v = q.shape[1], q.shape[-1], v.shape[-1]
    block_v = cfg.dq_block_v if rev is not None and cfg.dq_block_v else cfg.block_v
    bk, bv = _pow2(d_q), min(_pow2(d_v), max(16, block_v))
    x, x_local = rev if rev is not None else (q, rates)  # rates: a never-read stand-in pointer
    return _launch(
        _chunk_kernel,
        (triton.cdiv(d_v, bv) * plan.n_items, heads),
        (
            q, k, v, out, rates,
            seq_init if seq_init is not None else rates,
            slot_init if slot_init is not None else rates,
            final if final is not None else rates,
            plan.items, x, x_local,
            *_rows_strides(q), *_rows_strides(k), *_rows_strides(v), *_rows_strides(out), *_rows_strides(x),
            *((1, d_q) if transposed_init else (d_v, 1)),
            heads,
        ),  # fmt: skip
        dict(
            K=d_q, V=d_v, C=chunk, BK=bk, BV=bv, MASK_K=d_q != bk, MASK_V=d_v % bv != 0, REVERSE=reverse,
            HAS_SEQ_INIT=seq_init is not None, SEGMENTED=plan.segmented, STORE_FINAL=final is not None,
            REV_STATE=rev is not None, MASK_IN_LOOP=cfg.mask_in_loop, DOT_PREC=_dot_precision(q.dtype),
        ),  # fmt: skip
        cfg.warps,
        cfg.stages,
    )


def _horizon_nats(cfg: KernelConfig) -> float:
    if cfg.state_horizon_bits is None or not cfg.state_direct_weights:
        return 0.0
    return cfg.state_horizon_bits * math.log(2)


_HOST_RATES: dict[int, tuple[int, tuple[float, ...]]] = {}  # id(tensor) -> (version, values)


def _host_rates(rates: torch.Tensor | None) -> tuple[float, ...] | None:
    """The caller's decay-rate tensor on the host, read once per tensor object (the model keeps one
    per layer and device) and forgotten with it, so the state-pass split can follow each head's
    horizon. None without rates, and while a CUDA graph is being captured (no device-to-host copy)."""
    if rates is None:
        return None
    # inference tensors (made under torch.inference_mode, as in a generate call) keep no version counter: the
    # model's rates are constants from its config, so such a tensor is read once
    version = -1 if rates.is_inference() else rates._version
    hit = _HOST_RATES.get(id(rates))
    if hit is not None and hit[0] == version:
        return hit[1]
    if rates.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    values = tuple(float(r) for r in rates.detach().float().cpu())
    if hit is None:
        weakref.finalize(rates, _HOST_RATES.pop, id(rates), None)
    _HOST_RATES[id(rates)] = (version, values)
    return values


def _span_chunks(rate: float, n_chunks: int, chunk: int, horizon_nats: float) -> int:
    """Host copy of ``_state_span``'s chunk count (float rounding at a boundary only moves the split)."""
    if horizon_nats <= 0 or rate <= 0:
        return n_chunks
    reach = min(horizon_nats / rate, float(n_chunks * chunk))
    return min(n_chunks, -(-int(reach) // chunk) + 1)


def _state_parts(
    plan: WorkPlan, heads: int, tiles: int, chunk_count: int, device, cfg: KernelConfig, host_rates=None, chunk=64
) -> int:
    """Programs per segment in the state pass (direct weights only), from the work each head has:
    its chunks within the decay horizon (``_span_chunks``; every chunk without rates or horizon).
    x = longest head's chunks × wave / all chunks is how many parts the longest head needs for its
    part to be no longer than an even share of one wave. x ≤ 4/3 (the segments fill ~3/4 of a wave
    or more): 1, no partial sums to write; else 2x (about two waves of parts), at most 16.
    Uniform heads give the rule measured on an H200 (B·N = 128K, H=16): 4 at N=32K and 2 at 64K beat 1
    by 6% and 5% of fwd+bwd; at 128K (224 programs) 2 lost 2%."""
    if not cfg.state_direct_weights:
        return 1
    if cfg.state_split is not None:
        return max(1, cfg.state_split)
    active = max(1, (plan.n_slots - plan.multi.shape[0]) * tiles)  # one segment per sequence is skipped
    nats = _horizon_nats(cfg)
    spans = [_span_chunks(r, chunk_count, chunk, nats) for r in host_rates] if host_rates else [chunk_count] * heads
    longest, total = max(spans), active * sum(spans)
    wave = cfg.programs_per_sm * _sm_count(device)
    x = longest * wave / max(1, total)
    if 3 * x <= 4:
        return 1
    return max(1, min(16, int(2 * x), -(-longest // cfg.state_min_part_chunks)))


def horizon_tokens(rate: float, bits: int | None = DEFAULT_CONFIG.state_horizon_bits) -> float:
    """Distance in tokens past which a state pass ignores a token: λ^n = exp(−s·n) < 2^-bits. This is
    the decay-aware read the segment state passes do (HORIZON_NATS): a fast head (MiniMax layer 0,
    head 0: s ≈ 0.71) reaches 40 tokens, the slowest head of layer 0 (s ≈ 0.0039) 7.1K, and the last
    layers' heads (s → 1e-5 · s₀) the whole segment. ``inf`` when off or s ≤ 0."""
    if bits is None or rate <= 0:
        return math.inf
    return bits * math.log(2) / rate


def segment_local_states(
    x, y, rates, plan: WorkPlan, chunk: int, cfg: KernelConfig, reverse: bool, host_rates=None
):
    """(local state of every segment slot from zero [slots·P, H, d_x, d_y], its sum at [slot·P], P,
    compiled kernel): forward of (k, v), reverse of (q, dO). ``host_rates`` (the rates as floats,
    when known) let the split follow each head's horizon."""
    heads, d_k, d_v = x.shape[1], x.shape[-1], y.shape[-1]
    bk, bv = _pow2(d_k), min(_pow2(d_v), cfg.state_block_v)
    tiles = triton.cdiv(d_v, bv)
    chunks_per_item = -(-x.shape[2] // chunk) * x.shape[0] // max(1, plan.n_items)
    parts = _state_parts(plan, heads, tiles, chunks_per_item, x.device, cfg, host_rates, chunk)
    local = torch.empty(plan.n_slots * parts, heads, d_k, d_v, device=x.device, dtype=torch.float32)
    counters = torch.zeros(plan.n_items * heads * tiles if parts > 1 else 1, device=x.device, dtype=torch.int32)
    compiled = _launch(
        _segment_state_kernel,
        (tiles * plan.n_items * parts, heads),
        (x, y, rates, local, plan.items, counters, *_rows_strides(x), *_rows_strides(y), heads, parts),
        dict(
            K=d_k, V=d_v, C=chunk, BK=bk, BV=bv, MASK_K=d_k != bk, MASK_V=d_v % bv != 0,
            REVERSE=reverse, DIRECT=cfg.state_direct_weights, DOT_PREC=_dot_precision(x.dtype),
            HORIZON_NATS=_horizon_nats(cfg), MIN_PART=cfg.state_min_part_chunks, REDUCE=parts > 1,
        ),  # fmt: skip
        cfg.state_warps,
        cfg.state_stages,
    )
    return local, parts, compiled


def segment_scan(local, rates, seq_init, plan: WorkPlan, reverse: bool, parts: int = 1) -> torch.Tensor:
    """Start state of every segment slot from the local states (each slot's sum at [slot·``parts``]),
    in time order or against it."""
    heads, d_k, d_v = local.shape[1:]
    bk, bv = _pow2(d_k), min(_pow2(d_v), 32)
    starts = torch.empty(plan.n_slots, heads, d_k, d_v, device=local.device, dtype=torch.float32)
    _launch(
        _segment_scan_kernel,
        (plan.multi.shape[0], heads, triton.cdiv(d_v, bv)),
        (local, starts, seq_init if seq_init is not None else rates, plan.items, plan.multi, rates, heads, parts),
        dict(K=d_k, V=d_v, BK=bk, BV=bv, REVERSE=reverse, HAS_SEQ_INIT=seq_init is not None),
        4,
        1,
    )
    return starts


def lightning_forward(
    q, k, v, rates, s0, plan: WorkPlan, chunk: int, cfg: KernelConfig, want_final: bool, host_rates=None
):
    """(o, final or None, segment start states or None); s0 is float32 contiguous or None."""
    heads, d_k, d_v = q.shape[1], q.shape[-1], v.shape[-1]
    out = _alloc_like(q, d_v)
    final = torch.empty(plan.n_rows, heads, d_k, d_v, device=q.device, dtype=torch.float32) if want_final else None
    starts = None
    if plan.segmented:
        local, parts, _ = segment_local_states(k, v, rates, plan, chunk, cfg, False, host_rates)
        starts = segment_scan(local, rates, s0, plan, reverse=False, parts=parts)
    chunk_pass(q, k, v, out, rates, plan, chunk, cfg, seq_init=s0, slot_init=starts, final=final)
    return out, final, starts


def lightning_backward(
    q, k, v, rates, s0, starts, d_out, g_final, want_ds0: bool, plan, chunk, cfg, host_rates=None
):
    """(dq, dk, dv, dS0 float32 or None) from dO and the final-state gradient (float32 or None)."""
    heads, d_k, d_v = q.shape[1], q.shape[-1], v.shape[-1]
    dq, dk, dv = (_alloc_like(x, x.shape[-1]) for x in (q, k, v))
    ds0 = torch.empty(plan.n_rows, heads, d_k, d_v, device=q.device, dtype=torch.float32) if want_ds0 else None
    fuse = plan.segmented and cfg.fuse_dq_state
    local_r = torch.empty(plan.n_slots, heads, d_k, d_v, device=q.device, dtype=torch.float32) if fuse else None
    # dq: time order over (dO, v, k) from Sᵀ (S0, or the forward's segment starts)
    chunk_pass(
        d_out, v, k, dq, rates, plan, chunk, cfg, seq_init=s0, slot_init=starts, transposed_init=True,
        rev=(q, local_r) if fuse else None,
    )  # fmt: skip
    starts_r = None
    if plan.segmented:
        parts = 1
        if not fuse:
            local_r, parts, _ = segment_local_states(q, d_out, rates, plan, chunk, cfg, True, host_rates)
        starts_r = segment_scan(local_r, rates, g_final, plan, reverse=True, parts=parts)
    # dv, dk: against time order from dS_final (the dv pass ends with dS0 = λ R_0)
    chunk_pass(k, q, d_out, dv, rates, plan, chunk, cfg, reverse=True, seq_init=g_final, slot_init=starts_r, final=ds0)
    chunk_pass(
        v, d_out, q, dk, rates, plan, chunk, cfg, reverse=True, seq_init=g_final, slot_init=starts_r,
        transposed_init=True,
    )  # fmt: skip
    return dq, dk, dv, ds0


# ================================================================================================
# autograd
# ================================================================================================


class LightningAttentionTriton(torch.autograd.Function):
    """o, final = lightning(q, k, v; S0). Gradients for q, k, v and the initial state; decay rates
    are fixed buffers (MiniMax-01 never learns them) and get none."""

    @staticmethod
    def forward(
        ctx, q, k, v, rates, initial_state, plan: WorkPlan, chunk: int, cfg: KernelConfig, want_final, host_rates
    ):
        s0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
        out, final, starts = lightning_forward(q, k, v, rates, s0, plan, chunk, cfg, want_final, host_rates)
        ctx.save_for_backward(q, k, v, rates, s0, starts)
        ctx.plan, ctx.chunk, ctx.cfg, ctx.host_rates = plan, chunk, cfg, host_rates
        ctx.state_dtype = initial_state.dtype if initial_state is not None else None
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to read
        return out, final

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, rates, s0, starts = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros(*q.shape[:3], v.shape[-1], device=q.device, dtype=q.dtype)
        d_out = _unit_last(d_out.to(q.dtype))
        g_final = d_final.to(torch.float32).contiguous() if d_final is not None else None
        want_ds0 = s0 is not None and ctx.needs_input_grad[4]
        dq, dk, dv, ds0 = lightning_backward(
            q, k, v, rates, s0, starts, d_out, g_final, want_ds0, ctx.plan, ctx.chunk, ctx.cfg, ctx.host_rates
        )
        ds0_out = ds0.to(ctx.state_dtype) if ds0 is not None else None
        return dq, dk, dv, None, ds0_out, None, None, None, None, None


# ================================================================================================
# entry points
# ================================================================================================

_FALLBACK_WARNED: set[str] = set()


def _unsupported(q: torch.Tensor, v: torch.Tensor) -> str | None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} (the kernels take float16/bfloat16/float32)"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims d_k={q.shape[-1]}, d_v={v.shape[-1]} (the kernels take up to {MAX_HEAD_DIM})"
    if q.shape[2] == 0:
        return "an empty sequence"
    return None


def lightning_attn_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    block_size: int = 256,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    config: KernelConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``lightning_attn_triton_chunk`` with an explicit ``KernelConfig`` (benchmarks, tests)."""
    sequences = check_lightning_inputs(
        q, k, v, decay_rates, initial_state, cu_seqlens, caller="lightning_attn_triton_chunk"
    )
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"lightning_attn_triton_chunk: block_size must be a positive int, got {block_size!r}")
    if not q.is_cuda and not _interpreting():
        raise RuntimeError(
            "lightning_attn_triton_chunk: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"kernels.lightning.triton_chunk is imported, for CPU checks); got tensors on {q.device}"
        )
    if decay_rates.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "lightning_attn_triton_chunk: no gradient for decay_rates (MiniMax-01 keeps them fixed); pass a tensor "
            "that does not require grad, or use impl='chunk'"
        )
    reason = _unsupported(q, v)
    if reason is not None:
        if reason not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add(reason)
            warnings.warn(f"lightning_attn_triton_chunk: {reason}; using the PyTorch chunk path", stacklevel=2)
        return lightning_attn_chunk(q, k, v, decay_rates, block_size, initial_state, output_final_state, cu_seqlens)

    q, k, v = (_unit_last(x) for x in (q, k, v))
    batch, heads, length, _ = q.shape
    chunk = config.chunk_for(block_size)
    plan = make_plan(batch, length, sequences, heads, v.shape[-1], chunk, q.device, config)
    rates = decay_rates.detach().to(device=q.device, dtype=torch.float32).contiguous()
    host_rates = _host_rates(decay_rates) if plan.segmented else None
    return LightningAttentionTriton.apply(
        q, k, v, rates, initial_state, plan, chunk, config, output_final_state, host_rates
    )


def lightning_attn_triton_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    block_size: int = 256,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning attention with the Triton kernels; same contract as ``chunk.lightning_attn_chunk``.

    q, k [B, H, T, d_k], v [B, H, T, d_v] (any strides with a unit last one; [B, T, H, d].transpose(1, 2)
    views need no copy), decay_rates [H]; returns (o [B, H, T, d_v] in q's dtype, final state
    [B or N, H, d_k, d_v] float32 or None). ``block_size`` picks the chunk: its power of two, at
    least 16 and at most the tuned chunk (64), so MiniMax's 256 runs as 64; the result does not
    depend on it beyond rounding. Differentiable in q, k, v and ``initial_state``. float64 inputs,
    head dims above 128 and empty sequences go to the PyTorch chunk path (with a warning).
    """
    return lightning_attn_triton(
        q, k, v, decay_rates, block_size, initial_state, output_final_state, cu_seqlens, config=DEFAULT_CONFIG
    )
