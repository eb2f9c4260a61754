"""Accounting spec: parameter counts equal the instantiated model, activated = what one token touches, the
FLOP terms reproduce the report's Table 1 rows, and the named sizes land where their names say."""

from __future__ import annotations

import pytest

from model.accounting import (
    elementwise_flops,
    flops_per_token,
    lightning_attention_flops,
    mfu,
    parameter_counts,
    softmax_attention_flops,
    table1_flops,
    table1_params,
)
from model.modeling import HybridForCausalLM
from model.sizes import SIZES, config_for


@pytest.mark.parametrize(
    "overrides",
    [
        dict(attention_pattern="hybrid"),
        dict(attention_pattern="all-softmax", num_key_value_heads=1),
        dict(attention_pattern="all-lightning", head_dim=24),  # H*D != d
        dict(tie_word_embeddings=True),
    ],
)
def test_parameter_counts_match_the_instantiated_model(overrides):
    cfg = config_for("tiny", **overrides)
    model = HybridForCausalLM(cfg)
    counts = parameter_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    # activated: everything but the experts, plus k of E experts in every layer
    k_over_e = cfg.num_experts_per_tok / cfg.num_experts
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts.expert == experts
    assert counts.activated == counts.total - experts + experts * k_over_e
    assert counts.embedding == cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)


@pytest.mark.parametrize("layers,d,h,n", [(8, 512, 8, 2048), (80, 6144, 64, 8192), (24, 2048, 16, 4096)])
def test_flop_terms_reproduce_table1(layers, d, h, n):
    per_layer = {
        "softmax": softmax_attention_flops(n, d),
        "lightning": lightning_attention_flops(d, h),
        "hybrid": softmax_attention_flops(n, d) / 8 + 7 * lightning_attention_flops(d, h) / 8,
    }
    for arch, attention in per_layer.items():
        by_terms = 3 * n * layers * (72 * d**2 + attention + elementwise_flops(d))
        assert table1_flops(arch, layers, d, h, n, b=3) == pytest.approx(by_terms, rel=1e-12)
    assert table1_params("hybrid", layers, d, h) == pytest.approx(
        table1_params("softmax", layers, d, h) / 8 + 7 * table1_params("lightning", layers, d, h) / 8
    )
    with pytest.raises(ValueError, match="Table 1"):
        table1_flops("mamba", layers, d, h, n)


def test_flops_per_token_of_a_config_by_hand():
    cfg = config_for("tiny", tie_word_embeddings=False)  # 8 layers: 7 lightning + 1 softmax, d=64, H*D=64
    n, d, V, F, L = 1024, 64, 512, 128, 8
    attn_lightning = 5 * d * 64  # qkv + gate + out
    attn_softmax = 2 * d * 64 + 2 * d * 32  # q, o + GQA k, v (2 kv heads x 16)
    matmul = 7 * attn_lightning + attn_softmax + L * (4 * d + 2 * 3 * d * F) + V * d  # router, top-2, head
    f = flops_per_token(cfg, n)
    assert f.matmul == 6 * matmul
    assert f.softmax_attention == 12 * n * 64
    assert f.lightning_attention == 7 * 36 * 64**2 / 4
    assert f.elementwise == L * 20 * d
    assert f.total == pytest.approx(3 * f.forward)
    assert mfu(1000.0, f.total, 1e12) == pytest.approx(1000.0 * f.total / 1e12)


def test_named_sizes_span_cpu_to_one_billion_activated():
    activated = {name: parameter_counts(config_for(name)).activated for name in SIZES}
    assert activated["tiny"] < 1e6 < activated["cpu-small"] < 20e6
    assert 0.9e9 < activated["gpu-1b"] < 1.2e9
    assert list(activated.values()) == sorted(activated.values())
    for name in SIZES:
        cfg = config_for(name)
        assert cfg.rotary_dim == cfg.head_dim // 2 and "softmax" in cfg.attention_pattern
    with pytest.raises(ValueError, match="known sizes"):
        config_for("huge")


def test_packed_flops_counts_softmax_attention_within_documents():
    from model.accounting import packed_flops

    cfg = config_for("tiny")
    width = cfg.num_attention_heads * cfg.head_dim
    ns = len(cfg.softmax_layers)
    # one document of the whole row: the same as flops_per_token at the row length
    assert packed_flops(cfg, [256]) == pytest.approx(256 * flops_per_token(cfg, 256).total)
    # four documents of 64: softmax work is 12 d n^2 per document and layer, a quarter of one 256-token document's
    whole, split = packed_flops(cfg, [256]), packed_flops(cfg, [64] * 4)
    assert whole - split == pytest.approx(ns * 12 * width * (256**2 - 4 * 64**2))
    assert split > 256 * flops_per_token(cfg, 0).total
