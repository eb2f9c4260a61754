"""``HybridConfig``: every knob of the hybrid lightning/softmax MoE model (MiniMax-Text-01, report §2).

A transformers ``PreTrainedConfig`` (a dataclass in transformers 5), so it saves as ``config.json``, loads
with ``AutoConfig`` once :mod:`model` is imported, and carries the attributes TRL reads for MoE models
(``num_experts``, ``num_experts_per_tok``, ``router_aux_loss_coef``, ``output_router_logits``).

Defaults that the report or the released checkpoint fix:

* attention pattern: a softmax layer after every 7 lightning layers (§2: "a transformer block with softmax
  attention is positioned after every 7 transnormer blocks"), i.e. layer ``i`` is softmax iff
  ``(i + 1) % 8 == 0``; any per-layer list works (all-softmax / all-lightning ablations);
* RoPE on half of the head dims, base 10,000 (§2);
* DeepNorm (§4.1 "Initial Pre-training"): residual factor ``alpha = (2N)^0.25`` on every sublayer and
  Xavier init scaled by ``beta = (8N)^-0.25``, ``N`` = number of layers. The released checkpoint stores
  alpha as the residual multiplier and 1.0 as the sublayer-output multiplier, so the per-sublayer
  ``*_beta`` factors here are output multipliers (default 1.0) and ``init_beta`` is DeepNorm's beta.

Field names avoid ``layer_types`` and ``sliding_window``: transformers' generic cache and mask code
reacts to those (ENV-NOTES); this model brings its own cache.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from transformers import PreTrainedConfig

LIGHTNING = "lightning"
SOFTMAX = "softmax"
ATTENTION_KINDS = (LIGHTNING, SOFTMAX)

# Shorthands accepted for ``attention_pattern``; resolved to a per-layer list in ``__post_init__``.
PATTERN_SHORTHANDS = ("hybrid", "all-lightning", "all-softmax")
SOFTMAX_EVERY = 8  # §2: one softmax block after every 7 lightning blocks


def hybrid_attention_pattern(num_layers: int, softmax_every: int = SOFTMAX_EVERY) -> list[str]:
    """Layer ``i`` is softmax iff ``(i + 1) % softmax_every == 0`` (7 lightning : 1 softmax for 8)."""
    return [SOFTMAX if (i + 1) % softmax_every == 0 else LIGHTNING for i in range(num_layers)]


def deepnorm_alpha(num_layers: int) -> float:
    """DeepNorm residual factor alpha = (2N)^(1/4) (report §4.1; Wang et al. 2024a)."""
    return (2.0 * num_layers) ** 0.25


def deepnorm_beta(num_layers: int) -> float:
    """DeepNorm init gain beta = (8N)^(-1/4) (report §4.1)."""
    return (8.0 * num_layers) ** -0.25


class HybridConfig(PreTrainedConfig):
    r"""Configuration of :class:`model.modeling.HybridForCausalLM`.

    Shapes: ``hidden_size`` d, ``num_attention_heads`` H of ``head_dim`` D (lightning and softmax layers share
    them; ``H * D`` need not equal d), ``num_key_value_heads`` for GQA in softmax layers. ``attention_pattern``
    is a list of ``"lightning"``/``"softmax"`` per layer, or one of ``"hybrid"`` (every 8th layer softmax),
    ``"all-lightning"``, ``"all-softmax"``. MoE: ``num_experts`` experts, each a SwiGLU FFN of width
    ``moe_intermediate_size``, top-``num_experts_per_tok`` routing; in training with ``moe_token_drop`` each
    expert takes at most ``ceil(capacity_factor * tokens * k / E)`` token slots and drops the rest (counted);
    eval and generation are always dropless.
    """

    model_type: ClassVar[str] = "hylight_hybrid"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]
    # TRL's reference-model path reads config.auto_map; a locally registered model has none (ENV-NOTES).
    auto_map: ClassVar[dict] = {}

    vocab_size: int = 512
    hidden_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    num_key_value_heads: int | None = None  # GQA in softmax layers; default = num_attention_heads
    attention_pattern: str | list[str] = "hybrid"
    rotary_dim: int | None = None  # default head_dim // 2 (§2: RoPE on half of the head dims)
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    # MoE (§2.1)
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256
    capacity_factor: float = 1.25
    moe_token_drop: bool = True  # training only; False trains dropless
    router_aux_loss_coef: float = 0.001  # alpha_aux (released MiniMax-Text-01 value)
    output_router_logits: bool = True  # return router logits and add coef * aux_loss to the loss
    # DeepNorm factors; None = (2N)^0.25 for alphas, 1.0 for betas, (8N)^-0.25 for init_beta
    lightning_attn_alpha: float | None = None
    lightning_attn_beta: float | None = None
    softmax_attn_alpha: float | None = None
    softmax_attn_beta: float | None = None
    mlp_alpha: float | None = None
    mlp_beta: float | None = None
    init_beta: float | None = None
    # lightning attention kernel
    lightning_block_size: int = 256
    lightning_impl: Literal["auto", "naive", "chunk", "triton"] | str = "auto"
    # tokens and generation
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        errors: list[str] = []
        L = self.num_hidden_layers
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                errors.append(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly"
                )
            else:
                self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            errors.append(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (GQA groups)"
            )
        self.attention_pattern = _resolve_pattern(self.attention_pattern, L, errors)
        if self.head_dim is not None:
            if self.rotary_dim is None:
                self.rotary_dim = self.head_dim // 2
            if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
                errors.append(
                    f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"
                )
            if self.head_dim % 2:
                errors.append(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of dims)")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            errors.append(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )
        if self.capacity_factor <= 0:
            errors.append(f"capacity_factor={self.capacity_factor} must be > 0")
        if self.lightning_block_size < 1:
            errors.append(f"lightning_block_size={self.lightning_block_size} must be >= 1")
        if errors:
            raise ValueError("invalid HybridConfig:\n  - " + "\n  - ".join(errors))
        alpha = deepnorm_alpha(L)
        for name in ("lightning_attn_alpha", "softmax_attn_alpha", "mlp_alpha"):
            if getattr(self, name) is None:
                setattr(self, name, alpha)
        for name in ("lightning_attn_beta", "softmax_attn_beta", "mlp_beta"):
            if getattr(self, name) is None:
                setattr(self, name, 1.0)
        if self.init_beta is None:
            self.init_beta = deepnorm_beta(L)
        super().__post_init__(**kwargs)

    # --- derived, read-only views -------------------------------------------------------------------
    @property
    def softmax_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.attention_pattern) if kind == SOFTMAX]

    @property
    def lightning_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.attention_pattern) if kind == LIGHTNING]


def _resolve_pattern(pattern: str | list[str], num_layers: int, errors: list[str]) -> list[str]:
    if isinstance(pattern, str):
        if pattern == "hybrid":
            return hybrid_attention_pattern(num_layers)
        if pattern == "all-lightning":
            return [LIGHTNING] * num_layers
        if pattern == "all-softmax":
            return [SOFTMAX] * num_layers
        errors.append(
            f"attention_pattern={pattern!r}: expected one of {PATTERN_SHORTHANDS} or a list of "
            f"{ATTENTION_KINDS} per layer"
        )
        return []
    pattern = list(pattern)
    if len(pattern) != num_layers:
        errors.append(f"attention_pattern has {len(pattern)} entries but num_hidden_layers={num_layers}")
    bad = sorted({kind for kind in pattern if kind not in ATTENTION_KINDS})
    if bad:
        errors.append(f"attention_pattern has unknown kinds {bad}; use {ATTENTION_KINDS}")
    return pattern
