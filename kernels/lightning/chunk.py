"""Chunked lightning attention in plain PyTorch (MiniMax-01 §2.2.1, Algorithm 1).

The sequence is cut into blocks of C tokens. Inside a block the output is the left product
[(Q Kᵀ) ⊙ M] V with the decay mask M_ij = λ^(i−j) (j ≤ i); across blocks it is the right product
Q·KV with the d_k × d_v state carried from block to block (eqs. 7–9, with decay). Cost O(T·C·d + T·d²)
instead of O(T²·d). All of it is ordinary torch ops, so autograd gives the backward pass.

Shapes follow transformers' MiniMax: q, k [B, H, T, d_k], v [B, H, T, d_v], decay_rates [H],
states [B, H, d_k, d_v]. Semantics (what ``naive.lightning_attn_recurrent`` spells out):
S_t = λ S_{t−1} + k_tᵀ v_t, o_t = q_t S_t, with S_{−1} = initial_state (zeros when None).

This module also holds ``check_lightning_inputs``, the input contract every implementation
(naive, chunk, decode, Triton) validates against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.host_values import host_ints


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half/bfloat16 inputs, else the input dtype (float64 stays)."""
    return torch.promote_types(dtype, torch.float32)


def check_lightning_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    caller: str = "lightning_attention",
) -> list[tuple[int, int]] | None:
    """Validate shapes/dtypes; return the packed sequences as [(start, end), ...] when varlen, else None."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{caller}: {name} must be [B, H, T, D] (4-D), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{caller}: {name} must be a floating tensor, got {x.dtype}")
    if q.shape != k.shape:
        raise ValueError(
            f"{caller}: q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{caller}: v must share [B, H, T] with q, got v {tuple(v.shape)} and q {tuple(q.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{caller}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{caller}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    batch, heads, length, d_k = q.shape
    d_v = v.shape[-1]
    if decay_rates.dim() != 1 or decay_rates.shape[0] != heads:
        raise ValueError(
            f"{caller}: decay_rates must have shape [H]=[{heads}] (one rate per head, see "
            f"lightning_decay_rates), got {tuple(decay_rates.shape)}"
        )

    sequences = None
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(
                f"{caller}: with cu_seqlens the sequences are packed along T, so B must be 1, got B={batch}"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"{caller}: cu_seqlens must be a 1-D integer tensor [N+1] of cumulative lengths starting at 0, "
                f"got dtype {cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}"
            )
        bounds = host_ints(cu_seqlens)  # read from the device once per tensor, not once per layer
        if bounds[0] != 0 or bounds[-1] != length:
            raise ValueError(
                f"{caller}: cu_seqlens must start at 0 and end at T={length}, got {bounds[0]} ... {bounds[-1]}"
            )
        if any(b < a for a, b in zip(bounds[:-1], bounds[1:], strict=True)):
            raise ValueError(f"{caller}: cu_seqlens must be non-decreasing, got {bounds}")
        sequences = list(zip(bounds[:-1], bounds[1:], strict=True))

    if initial_state is not None:
        rows = len(sequences) if sequences is not None else batch
        expected = (rows, heads, d_k, d_v)
        if tuple(initial_state.shape) != expected:
            what = "N (one per packed sequence)" if sequences is not None else "B"
            raise ValueError(
                f"{caller}: initial_state must be [{what}, H, d_k, d_v] = {expected}, "
                f"got {tuple(initial_state.shape)}"
            )
    return sequences


def _decay(rates: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """λ^n = exp(-s·n), exponent clamped at 0 so masked-out (negative) entries never overflow to inf."""
    return torch.exp(-rates * exponent.clamp(min=0).to(rates.dtype))


def _blocks(x: torch.Tensor, num_blocks: int, block: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, H, NB, C, D], zero-padding the tail of the last block."""
    pad = num_blocks * block - x.shape[2]
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(x.shape[0], x.shape[1], num_blocks, block, x.shape[-1])


def _chunk_from_zero_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rates: torch.Tensor,
    block: int,
    sequences: Sequence[tuple[int, int]] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 with a zero initial state. Returns (o [B,H,T,d_v], state after the last block).

    With ``sequences`` (varlen, B == 1) two masks keep packed sequences apart without padding each one:
    the intra-block decay mask is zero between tokens of different sequences, and the carried state
    only feeds tokens whose sequence began before the block (and only the block's last sequence feeds
    the next carry). The returned carry is then meaningless; the caller computes per-sequence states.
    """
    batch, heads, length, _ = q.shape
    num_blocks = math.ceil(length / block)
    device = q.device
    qb, kb, vb = (_blocks(x, num_blocks, block) for x in (q, k, v))

    pos = torch.arange(block, device=device)
    block_len = torch.full((num_blocks,), block, device=device)
    block_len[-1] = length - (num_blocks - 1) * block
    s = rates.view(heads, 1, 1)  # broadcasts against [NB, C] or [C, C]

    diff = pos[:, None] - pos[None, :]
    intra = torch.where(diff >= 0, _decay(s, diff), 0.0)  # [H, C, C]: λ^(i-j), j <= i
    intra = intra.unsqueeze(1)  # [H, 1, C, C]
    # [H, NB, C]: λ^(i+1) on the carried state (query side), λ^(len-1-j) into the next carry (key side)
    q_decay = _decay(s, (pos + 1).expand(num_blocks, block))
    k_decay = _decay(s, (block_len - 1)[:, None] - pos[None, :])
    carry_decay = _decay(rates.view(heads, 1), block_len[None, :])  # [H, NB]: λ^len

    if sequences is not None:
        lengths = torch.tensor([e - a for a, e in sequences], device=device)
        starts = torch.tensor([a for a, _ in sequences], device=device)
        pad = num_blocks * block - length
        seq_id = F.pad(
            torch.repeat_interleave(torch.arange(len(sequences), device=device), lengths), (0, pad), value=-1
        )
        seq_start = F.pad(torch.repeat_interleave(starts, lengths), (0, pad), value=num_blocks * block)
        seq_id = seq_id.view(num_blocks, block)
        seq_start = seq_start.view(num_blocks, block)
        block_start = (torch.arange(num_blocks, device=device) * block)[:, None]
        continues = seq_start < block_start  # [NB, C]: sequence began in an earlier block -> uses the carry
        last = block_len - 1
        last_id = seq_id.gather(1, last[:, None])  # [NB, 1]
        intra = intra * (seq_id[:, :, None] == seq_id[:, None, :])  # [H, NB, C, C]
        q_decay = q_decay * continues
        k_decay = k_decay * (seq_id == last_id)
        carry_decay = carry_decay * continues.gather(1, last[:, None]).squeeze(1)

    scores = qb @ kb.transpose(-1, -2)  # [B, H, NB, C, C]
    out = (scores * intra) @ vb  # intra-block left product
    block_kv = (kb * k_decay.unsqueeze(-1)).transpose(-1, -2) @ vb  # [B, H, NB, d_k, d_v]

    # Inter-block recurrence over block states (eq. 9): NB small d×d updates.
    state = q.new_zeros(batch, heads, q.shape[-1], v.shape[-1])
    # unbind, not [:, :, n]: the backward of NB selects would scatter into NB full-size zero tensors
    states_in = []
    for decay_n, kv_n in zip(carry_decay.unbind(1), block_kv.unbind(2), strict=True):
        states_in.append(state)
        state = decay_n.view(1, heads, 1, 1) * state + kv_n
    if num_blocks > 1:
        out = out + (qb * q_decay.unsqueeze(-1)) @ torch.stack(states_in, dim=2)  # inter-block right product
    out = out.reshape(batch, heads, num_blocks * block, -1)[:, :, :length]
    return out, state


def lightning_attn_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    block_size: int = 256,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked lightning attention; returns (o [B,H,T,d_v] in q's dtype, final state or None).

    Any T works (the last block may be short). fp16/bf16 inputs are computed in float32; the final
    state is returned in that accumulation dtype (float32, or float64 for float64 inputs) so decoding
    can continue from it without rounding. With ``cu_seqlens`` ([N+1], B must be 1) the T axis holds
    N packed sequences: the state resets at every boundary, ``initial_state`` is [N, H, d_k, d_v] and
    the final state holds one state per sequence.
    """
    sequences = check_lightning_inputs(
        q, k, v, decay_rates, initial_state, cu_seqlens, caller="lightning_attn_chunk"
    )
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"lightning_attn_chunk: block_size must be a positive int, got {block_size!r}")
    batch, heads, length, d_k = q.shape
    d_v = v.shape[-1]
    in_dtype = q.dtype
    cdtype = compute_dtype(in_dtype)
    q, k, v = (x.to(cdtype) for x in (q, k, v))
    rates = decay_rates.to(device=q.device, dtype=cdtype)
    s0 = initial_state.to(device=q.device, dtype=cdtype) if initial_state is not None else None

    if length == 0:
        out = q.new_zeros(batch, heads, 0, d_v)
        rows = len(sequences) if sequences is not None else batch
        final = s0 if s0 is not None else q.new_zeros(rows, heads, d_k, d_v)
    else:
        out, final = _chunk_from_zero_state(q, k, v, rates, min(block_size, length), sequences)
        if sequences is not None:
            out, final = _add_varlen_initial_and_final_states(
                q, k, v, rates, out, s0, sequences, output_final_state
            )
        elif s0 is not None:
            # The map is linear in the initial state, so its part is added on its own: it reaches
            # token t decayed by λ^(t+1) and the final state decayed by λ^T.
            t = torch.arange(length, device=q.device)
            out = out + (q * _decay(rates.view(heads, 1), t + 1).unsqueeze(-1)) @ s0
            final = (
                final + _decay(rates, torch.tensor(float(length), device=q.device)).view(1, heads, 1, 1) * s0
            )

    return out.to(in_dtype), (final if output_final_state else None)


def _add_varlen_initial_and_final_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rates: torch.Tensor,
    out: torch.Tensor,
    s0: torch.Tensor | None,
    sequences: Sequence[tuple[int, int]],
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sequence initial-state terms and final states for packed sequences.

    One small matmul per sequence (N is the inference batch here; training packs without states and
    skips this). Sequence m, tokens [a, e): o_t += λ^(t-a+1) q_t S0_m and
    S_final_m = λ^(e-a) S0_m + Σ_t λ^(e-1-t) k_tᵀ v_t.
    """
    heads, length = q.shape[1], q.shape[2]
    device = q.device
    lengths = torch.tensor([e - a for a, e in sequences], device=device)
    starts = torch.repeat_interleave(torch.tensor([a for a, _ in sequences], device=device), lengths)
    ends = torch.repeat_interleave(torch.tensor([e for _, e in sequences], device=device), lengths)
    t = torch.arange(length, device=device)
    per_head = rates.view(heads, 1)
    if s0 is not None:
        q_s0 = q * _decay(per_head, t - starts + 1).unsqueeze(-1)
        out = out + torch.cat([q_s0[:, :, a:e] @ s0[m : m + 1] for m, (a, e) in enumerate(sequences)], dim=2)
    final = None
    if output_final_state:
        k_end = k * _decay(per_head, ends - 1 - t).unsqueeze(-1)
        final = torch.cat([k_end[:, :, a:e].transpose(-1, -2) @ v[:, :, a:e] for a, e in sequences], dim=0)
        if s0 is not None:
            final = final + _decay(rates.view(1, heads, 1, 1), lengths.view(-1, 1, 1, 1)) * s0
    return out, final
