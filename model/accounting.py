"""Parameter and FLOP accounting of the hybrid model, for scaling-law bookkeeping and MFU reporting.

FLOPs follow the report's Table 1 (Kaplan et al. counting, training = forward + backward = 3x forward, 2
FLOPs per multiply-add). Per layer and token, Table 1 is the sum of

* 72 d^2 = 6 * (12 d^2 parameters)  -- every weight matmul;
* softmax attention: 72 d^2 * n/(6d) = 12 n d   -- Q K^T and A V over all n keys (Table 1 does not halve
  for causality; neither do we);
* lightning attention: 72 d^2 * 1/(2h) = 36 d^2 / h  -- the d/h x d/h state products of each head;
* 72 d^2 * 5/(18d) = 20 d  -- the sub-leading element-wise term Table 1 keeps.

``table1_flops`` writes the three Table 1 rows literally; ``flops_per_token`` applies the same terms to an
actual (MoE, GQA, H*D != d possible) config: 6 x activated weight-matmul parameters (the experts a token
really visits, the LM head included) + the attention terms with d -> H*D. Tests pin that the terms reproduce
Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.configuration import LIGHTNING, HybridConfig

TABLE1_ARCHS = ("softmax", "lightning", "hybrid")


# --- parameters ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCounts:
    total: int
    activated: int  # what one token uses: top-k experts of each MoE layer, everything else
    embedding: int  # input embedding + LM head (counted once when tied)
    expert: int  # all expert weights (total)
    activated_expert: int

    @property
    def non_embedding_total(self) -> int:
        return self.total - self.embedding

    @property
    def non_embedding_activated(self) -> int:
        return self.activated - self.embedding


def _attention_params(config: HybridConfig, kind: str) -> int:
    d, inner = config.hidden_size, config.num_attention_heads * config.head_dim
    if kind == LIGHTNING:  # qkv (3 inner) + output gate (inner) + out_proj, and the H*D-wide RMSNorm
        return 5 * d * inner + inner
    kv = config.num_key_value_heads * config.head_dim
    return 2 * d * inner + 2 * d * kv  # q, o and GQA k, v


def parameter_counts(config: HybridConfig) -> ParamCounts:
    d, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    E, k, F = config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
    embedding = V * d * (1 if config.tie_word_embeddings else 2)
    expert = 3 * d * F  # SwiGLU: gate, up, down
    layers = sum(_attention_params(config, kind) for kind in config.attention_pattern)
    layers += L * (2 * d + E * d)  # two RMSNorms and the router per layer
    total = embedding + layers + L * E * expert + d  # + final norm
    return ParamCounts(
        total=total,
        activated=total - L * (E - k) * expert,
        embedding=embedding,
        expert=L * E * expert,
        activated_expert=L * k * expert,
    )


# --- FLOPs: Table 1 -----------------------------------------------------------------------------------------


def table1_params(arch: str, l: int, d: int, h: int) -> float:  # noqa: E741 (the paper's symbols)
    """Table 1 parameter counts (embeddings and sub-leading terms excluded)."""
    rows = {
        "softmax": 12 * l * d**2,
        "lightning": 12 * l * d**2 + 2 * l * d**2 / h,
        "hybrid": 12 * l * d**2 + 7 * l * d**2 / (4 * h),
    }
    return rows[_arch(arch)]


def table1_flops(arch: str, l: int, d: int, h: int, n: int, b: int = 1) -> float:  # noqa: E741
    """Table 1 training FLOPs for b sequences of n tokens (l layers, width d, h heads)."""
    rows = {
        "softmax": 72 * b * n * l * d**2 * (1 + n / (6 * d) + 5 / (18 * d)),
        "lightning": 72 * b * n * l * d**2 * (1 + 1 / (2 * h) + 5 / (18 * d)),
        "hybrid": 72 * b * n * l * d**2 * (1 + n / (48 * d) + 7 / (16 * h) + 5 / (18 * d)),
    }
    return rows[_arch(arch)]


def _arch(arch: str) -> str:
    if arch not in TABLE1_ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; Table 1 has {TABLE1_ARCHS}")
    return arch


def softmax_attention_flops(n: int, width: int) -> float:
    """Training FLOPs per token of one softmax layer's score and value products (Table 1: 12 n d)."""
    return 12.0 * n * width


def lightning_attention_flops(width: int, heads: int) -> float:
    """Training FLOPs per token of one lightning layer's state products (Table 1: 36 d^2 / h)."""
    return 36.0 * width**2 / heads


def elementwise_flops(d: int) -> float:
    """Table 1's sub-leading per-layer term 72 d^2 * 5/(18 d) = 20 d."""
    return 20.0 * d


# --- FLOPs: this model --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsPerToken:
    """Training (forward + backward) FLOPs per token at sequence length ``seq_len``."""

    matmul: float  # 6 x activated weight-matmul parameters (LM head included, embedding lookup not)
    softmax_attention: float
    lightning_attention: float
    elementwise: float

    @property
    def total(self) -> float:
        return self.matmul + self.softmax_attention + self.lightning_attention + self.elementwise

    @property
    def forward(self) -> float:
        return self.total / 3.0


def flops_per_token(config: HybridConfig, seq_len: int) -> FlopsPerToken:
    params = parameter_counts(config)
    d, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    width = config.num_attention_heads * config.head_dim
    norms = (2 * d) * L + d + width * len(config.lightning_layers)  # RMSNorm weights are not matmuls
    matmul_params = params.activated - V * d - norms  # embedding lookup is not a matmul; the LM head is
    if config.tie_word_embeddings:
        matmul_params += V * d  # the tied matrix is still used once as the LM head
    return FlopsPerToken(
        matmul=6.0 * matmul_params,
        softmax_attention=len(config.softmax_layers) * softmax_attention_flops(seq_len, width),
        lightning_attention=len(config.lightning_layers)
        * lightning_attention_flops(width, config.num_attention_heads),
        elementwise=L * elementwise_flops(d),
    )


def packed_flops(config: HybridConfig, doc_lengths) -> float:
    """Training FLOPs of a packed batch whose documents attend only within themselves: every term of
    ``flops_per_token`` per token, except the softmax one, which a document of n tokens has at length n (so the
    batch's softmax FLOPs are 12 d sum(n_i^2) per softmax layer, not 12 d T per token at the row length T)."""
    lengths = [int(n) for n in doc_lengths]
    tokens = sum(lengths)
    width = config.num_attention_heads * config.head_dim
    per_token = flops_per_token(config, 0).total  # all but the softmax term
    return per_token * tokens + len(config.softmax_layers) * softmax_attention_flops(1, width) * sum(
        n * n for n in lengths
    )


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops_per_second: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the hardware peak."""
    return tokens_per_second * flops_per_token / peak_flops_per_second


__all__ = [
    "TABLE1_ARCHS",
    "FlopsPerToken",
    "ParamCounts",
    "elementwise_flops",
    "flops_per_token",
    "lightning_attention_flops",
    "mfu",
    "packed_flops",
    "parameter_counts",
    "softmax_attention_flops",
    "table1_flops",
    "table1_params",
]
