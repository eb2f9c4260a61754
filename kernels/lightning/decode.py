"""One generation step of lightning attention: O(d_k·d_v) per head, whatever the context length.

S = λ S + kᵀ v, then o = q S (transformers' MiniMax single-token path). To feed several new tokens
at once, call ``lightning_attention(..., initial_state=state, output_final_state=True)`` instead.
"""

from __future__ import annotations

import torch

from kernels.lightning.chunk import check_lightning_inputs, compute_dtype


def lightning_attn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    state: torch.Tensor,
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B,H,1,d_k], v [B,H,1,d_v], state [B,H,d_k,d_v] -> (o [B,H,1,d_v] in q's dtype, new state).

    Math runs in float32 at least (float64 if q or the state is float64); the new state keeps the
    dtype of ``state``, so a float32 cache stays float32 under bf16 activations. With ``out_state`` (may be
    ``state`` itself) the new state is written there and returned, for a preallocated cache.
    """
    check_lightning_inputs(q, k, v, decay_rates, state, caller="lightning_attn_decode")
    if q.shape[2] != 1:
        raise ValueError(
            f"lightning_attn_decode: expects exactly one new token (T=1), got T={q.shape[2]}; for several tokens "
            "use lightning_attention(..., initial_state=state, output_final_state=True)"
        )
    cdtype = torch.promote_types(compute_dtype(q.dtype), state.dtype)
    lam = torch.exp(-decay_rates.to(device=q.device, dtype=cdtype)).view(1, -1, 1, 1)
    k_t, v_t = k.to(cdtype), v.to(cdtype)
    new_state = lam * state.to(cdtype) + k_t.transpose(-1, -2) @ v_t
    o = q.to(cdtype) @ new_state
    if out_state is not None:
        return o.to(q.dtype), out_state.copy_(new_state)
    return o.to(q.dtype), new_state.to(state.dtype)
