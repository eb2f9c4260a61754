"""Reference lightning attention, written for clarity, not speed. Tests check every fast path here.

Per head with rate s (λ = exp(-s)), no 1/sqrt(d) scale (q, k, v arrive SiLU-activated):

    S_t = λ S_{t-1} + k_tᵀ v_t        (d_k × d_v state, S_{-1} = initial_state or 0)
    o_t = q_t S_t

which unrolls to o_t = Σ_{j≤t} λ^(t-j) (q_t·k_j) v_j + λ^(t+1) q_t S_{-1}: the decayed form of
MiniMax-01 eqs. 4–5. This is the semantics of transformers' MiniMaxLightningAttention: its block loop
for prefill and its token loop for decoding from a cached state.

Both references run in the input dtype (tests use float64).
"""

from __future__ import annotations

import torch

from kernels.lightning.chunk import check_lightning_inputs


def lightning_attn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence. q, k [B,H,T,d_k], v [B,H,T,d_v]; returns (o, final state or None).

    ``cu_seqlens`` (B == 1): the packed sequences are run one after another, each from its own
    ``initial_state[m]`` (or zeros), which is the definition of varlen.
    """
    sequences = check_lightning_inputs(
        q, k, v, decay_rates, initial_state, cu_seqlens, caller="lightning_attn_recurrent"
    )
    if sequences is not None:
        outs, finals = [], []
        for m, (a, e) in enumerate(sequences):
            s0 = initial_state[m : m + 1] if initial_state is not None else None
            o, final = lightning_attn_recurrent(
                q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], decay_rates, s0, True
            )
            outs.append(o)
            finals.append(final)
        return torch.cat(outs, dim=2), (torch.cat(finals, dim=0) if output_final_state else None)

    batch, heads, length, d_k = q.shape
    lam = torch.exp(-decay_rates.to(q.dtype)).view(1, heads, 1, 1)
    state = (
        initial_state.to(q.dtype)
        if initial_state is not None
        else q.new_zeros(batch, heads, d_k, v.shape[-1])
    )
    outs = []
    # unbind (not q[:, :, t]) so backward stacks T slices once instead of scattering into T full-size zeros
    for q_t, k_t, v_t in zip(q.unbind(2), k.unbind(2), v.unbind(2), strict=True):
        state = lam * state + k_t[..., :, None] * v_t[..., None, :]  # outer product k_tᵀ v_t
        outs.append(q_t[..., None, :] @ state)
    o = torch.cat(outs, dim=2) if outs else q.new_zeros(batch, heads, 0, v.shape[-1])
    return o, (state if output_final_state else None)


def lightning_attn_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The O(T²) left-product form [(Q Kᵀ) ⊙ M] V with M_tj = λ^(t-j) for j ≤ t (eq. 4 with decay)."""
    check_lightning_inputs(q, k, v, decay_rates, initial_state, caller="lightning_attn_parallel")
    heads, length = q.shape[1], q.shape[2]
    s = decay_rates.to(q.dtype).view(heads, 1, 1)
    t = torch.arange(length, device=q.device, dtype=q.dtype)
    gap = t[:, None] - t[None, :]  # t - j
    mask = torch.where(
        gap >= 0, torch.exp(-s * gap.clamp(min=0)), torch.zeros((), dtype=q.dtype)
    )  # [H, T, T]
    o = ((q @ k.transpose(-1, -2)) * mask) @ v
    final = (k * torch.exp(-s * (length - 1 - t)[:, None])).transpose(-1, -2) @ v
    if initial_state is not None:
        s0 = initial_state.to(q.dtype)
        o = o + (q * torch.exp(-s * (t + 1)[:, None])) @ s0
        final = final + torch.exp(-s * length) * s0
    return o, (final if output_final_state else None)
