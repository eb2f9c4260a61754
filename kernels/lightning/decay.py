"""The per-head decay rates of MiniMax lightning attention: the one place they are defined.

Head h of lightning layer l (of L layers) forgets at rate s_h, i.e. its state is multiplied by
λ_h = exp(-s_h) per token (MiniMax-01 §2.2, TransNormerLLM's ALiBi-style slopes scaled by depth):

    s_h = 2^(-8(h+1)/H) · (1 − l/(L − 1 + 1e−5) + 1e−5)

Early layers forget fast, the last layer barely at all.
"""

from __future__ import annotations

import torch


def lightning_decay_rates(
    num_heads: int,
    layer_idx: int,
    num_layers: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decay rates s_h > 0, shape [num_heads], for layer ``layer_idx`` of ``num_layers``.

    The values are the float32 numbers transformers' ``MiniMaxLightningAttention.get_slope_rate``
    computes (same operations, same order, always on CPU), so a model built here uses bit-identical
    rates to the released checkpoints; other dtypes are those float32 values converted.
    ``layer_idx`` counts all layers of the model (softmax ones too), as in transformers.
    """
    if num_heads < 1:
        raise ValueError(f"lightning_decay_rates: num_heads must be >= 1, got {num_heads}")
    if num_layers < 1:
        raise ValueError(f"lightning_decay_rates: num_layers must be >= 1, got {num_layers}")
    if not 0 <= layer_idx < num_layers:
        raise ValueError(
            f"lightning_decay_rates: layer_idx must be in [0, {num_layers - 1}] for num_layers={num_layers}, "
            f"got {layer_idx}"
        )
    base = 1 / (2 ** (8 / num_heads))
    exponent = torch.arange(1, num_heads + 1, dtype=torch.float32)
    depth_factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    rates = base**exponent
    rates = rates * depth_factor
    return rates.to(device=device, dtype=dtype)
