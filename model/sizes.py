"""Named model sizes, from a CPU debug model to a ~1B-activated GPU model (torchtitan's ``debug_model`` ..
flagship ladder). Every size keeps the MiniMax-Text-01 shape rules: 7 lightning : 1 softmax layers, RoPE on
half the head dims, top-2 routing, DeepNorm factors from the depth. Parameter counts come from
``model.accounting.parameter_counts`` (run ``python -m model.sizes`` for the table).

    name        layers  d     heads x dim  kv  experts  expert FFN  vocab   use
    tiny        8       64    4 x 16       2   4        128         512     unit tests, the tiny DAG
    cpu-small   8       256   4 x 64       2   4        512         8192    CPU runs (= the HF CPU anchor's shape)
    gpu-300m    16      1024  8 x 128      2   8        1536        32768   one GPU, ~0.3B activated
    gpu-1b      16      2048  16 x 128     2   16       3072        32768   ~1.05B activated / ~5.3B total
"""

from __future__ import annotations

from model.configuration import HybridConfig

SIZES: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, head_dim=16,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        lightning_block_size=64, max_position_embeddings=4096,
    ),
    "cpu-small": dict(
        vocab_size=8192, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, head_dim=64,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=512,
        lightning_block_size=256, max_position_embeddings=8192,
    ),
    "gpu-300m": dict(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=16, num_attention_heads=8, head_dim=128,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1536,
        lightning_block_size=256, max_position_embeddings=8192,
    ),
    "gpu-1b": dict(
        vocab_size=32768, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, head_dim=128,
        num_key_value_heads=2, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=3072,
        lightning_block_size=256, max_position_embeddings=8192,
    ),
}  # fmt: skip


def config_for(name: str, **overrides) -> HybridConfig:
    """The ``HybridConfig`` of a named size, with field overrides (e.g. ``vocab_size`` from the tokenizer)."""
    if name not in SIZES:
        raise ValueError(f"unknown model size {name!r}; known sizes: {', '.join(SIZES)}")
    return HybridConfig(**{**SIZES[name], **overrides})


def size_table() -> str:
    from model.accounting import flops_per_token, parameter_counts  # heavy: transformers, torch

    lines = [
        "| size | layers | d | total params | activated params | train GFLOPs/token @4096 |",
        "|---|---|---|---|---|---|",
    ]
    for name in SIZES:
        cfg = config_for(name)
        p = parameter_counts(cfg)
        f = flops_per_token(cfg, 4096).total
        lines.append(
            f"| {name} | {cfg.num_hidden_layers} | {cfg.hidden_size} | {p.total / 1e6:,.1f}M | "
            f"{p.activated / 1e6:,.1f}M | {f / 1e9:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(size_table())
