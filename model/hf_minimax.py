"""State-dict adapter between our ``HybridForCausalLM`` and transformers' own ``MiniMaxForCausalLM``.

The one place that knows transformers' MiniMax layout (torchtitan's ``state_dict_adapter`` pattern). An export
loads with ``AutoModelForCausalLM.from_pretrained(path)`` and no ``trust_remote_code``, and gives our logits
(fp32, eval, dropless); an import turns such a checkpoint into our model.

What needs more than renaming:

* RoPE. We rotate the first R = ``rotary_dim`` dims of a head in the GPT-NeoX layout: pairs (j, j + R/2) at
  frequency base^(-2j/R), dims R..D-1 untouched. transformers' MiniMax only has full-head layouts: pairs
  (i, i + D/2). Its "proportional" RoPE gives pair i the frequency theta'^(-2i/D) for i < R/2 and 0 (identity)
  for the rest. With theta' = base^(D/R) the frequencies agree, and permuting the head dims of q and k the
  same way (q.k is invariant under a common permutation) moves our pairs onto its pairs: HF dim i holds our
  dim ``rope_permutation(D, R)[i]``. With R == D this is the identity and plain "default" RoPE.
* transformers' lightning decay buffers (slope_rate, query/key/diagonal_decay) are recomputed by its own
  module from the config; we never store ours (kernels.lightning.lightning_decay_rates is the source).
  transformers counts the rotated pairs as ``int(partial_rotary_factor * D // 2)`` through a float, so the
  exported factor is the smallest float >= R / D that gives exactly R / 2 pairs (30 / 44 would give 14).
* Things transformers' MiniMax has no notion of: expert capacity and token drop (it is dropless; parity holds
  in eval), DeepNorm's init gain, our kernel choice. Their values are kept at defaults on import.
* ``output_router_logits`` is exported off: on, transformers computes its load-balancing loss inside
  ``forward`` with the attention mask, and ``generate`` on a left-padded batch fails there with a shape
  mismatch. An import takes our default (on, for training) unless overridden.

Known transformers issue (5.x) and its workaround: its ``MiniMaxCache`` does not tell the mask builder which
layers are lightning ones, so with a lightning layer first (ours: 7 lightning : 1 softmax, layer 0 lightning)
the softmax layers' decode masks are sized from layer 0's empty key cache and attend to the left padding of
a batch: left-padded batched ``generate`` gives other tokens than the same prompts one at a time.
Unpadded prompts and a softmax layer first are unaffected. Pass ``past_key_values=MiniMaxGenerationCache(
model.config)`` to ``generate`` (it reports the lightning layers as linear-attention layers), or generate
with our model (``import_from_minimax``), whose masks are right.
"""

from __future__ import annotations

import math
import os
import re

import torch
from transformers import MiniMaxConfig, MiniMaxForCausalLM
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from model.configuration import LIGHTNING, SOFTMAX, HybridConfig
from model.modeling import HybridForCausalLM

_HF_KIND = {LIGHTNING: "linear_attention", SOFTMAX: "full_attention"}
_OUR_KIND = {v: k for k, v in _HF_KIND.items()}

# our key suffix inside model.layers.{i}.  <->  transformers' suffix
_LAYER_KEYS = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn.qkv_proj.weight", "self_attn.qkv_proj.weight"),
    ("attn.output_gate.weight", "self_attn.output_gate.weight"),
    ("attn.out_proj.weight", "self_attn.out_proj.weight"),
    ("attn.norm.weight", "self_attn.norm.weight"),
    ("attn.q_proj.weight", "self_attn.q_proj.weight"),
    ("attn.k_proj.weight", "self_attn.k_proj.weight"),
    ("attn.v_proj.weight", "self_attn.v_proj.weight"),
    ("attn.o_proj.weight", "self_attn.o_proj.weight"),
    ("moe.router.weight", "mlp.gate.weight"),
    ("moe.experts.gate_up_proj", "mlp.experts.gate_up_proj"),
    ("moe.experts.down_proj", "mlp.experts.down_proj"),
]
_TO_HF = dict(_LAYER_KEYS)
_FROM_HF = {hf: ours for ours, hf in _LAYER_KEYS}
_HF_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
_ROTATED = ("attn.q_proj.weight", "attn.k_proj.weight")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def rope_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """perm such that transformers' head dim i holds our head dim perm[i] (see the module docstring)."""
    d, r = head_dim, rotary_dim
    half_pass = (d - r) // 2
    return torch.cat(
        [
            torch.arange(0, r // 2),  # first of each rotated pair
            torch.arange(r, r + half_pass),  # pass-through dims paired with frequency 0
            torch.arange(r // 2, r),  # second of each rotated pair, at i + D/2
            torch.arange(r + half_pass, d),
        ]
    )


def _permute_heads(w: torch.Tensor, head_dim: int, perm: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(rows // head_dim, head_dim, cols)[:, perm].reshape(rows, cols)


# --- configs ------------------------------------------------------------------------------------------------


def rotated_pairs(partial_rotary_factor: float, head_dim: int) -> int:
    """How many dim pairs transformers' "proportional" RoPE rotates (its own float arithmetic)."""
    return int(partial_rotary_factor * head_dim // 2)


def partial_rotary_factor(head_dim: int, rotary_dim: int) -> float:
    """The smallest float >= rotary_dim / head_dim with which transformers rotates exactly rotary_dim / 2 pairs
    (30 / 44 * 44 is 29.999999999999996 in floats: 14 pairs, not 15)."""
    factor = rotary_dim / head_dim
    while rotated_pairs(factor, head_dim) < rotary_dim // 2:
        factor = math.nextafter(factor, math.inf)
    if rotated_pairs(factor, head_dim) != rotary_dim // 2:
        raise ValueError(f"no partial_rotary_factor gives {rotary_dim // 2} rotated pairs of head_dim {head_dim}")
    return factor


def to_minimax_config(config: HybridConfig) -> MiniMaxConfig:
    """The transformers ``MiniMaxConfig`` that computes what ``config`` computes (in eval)."""
    d, r = config.head_dim, config.rotary_dim
    if r == d:
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    else:
        rope = {
            "rope_type": "proportional",
            "rope_theta": config.rope_theta ** (d / r),
            "partial_rotary_factor": partial_rotary_factor(d, r),
        }
    return MiniMaxConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=d,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        use_cache=config.use_cache,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        tie_word_embeddings=config.tie_word_embeddings,
        num_experts_per_tok=config.num_experts_per_tok,
        num_local_experts=config.num_experts,
        output_router_logits=False,  # on, generate crashes on left-padded batches (module docstring)
        # the same number, though transformers' balance loss is k E^2 times ours (model/moe.py): it weighs that much
        # more if the export is trained with output_router_logits on
        router_aux_loss_coef=config.router_aux_loss_coef,
        rope_parameters=rope,
        layer_types=[_HF_KIND[kind] for kind in config.attention_pattern],
        block_size=config.lightning_block_size,
        full_attn_alpha_factor=config.softmax_attn_alpha,
        full_attn_beta_factor=config.softmax_attn_beta,
        linear_attn_alpha_factor=config.lightning_attn_alpha,
        linear_attn_beta_factor=config.lightning_attn_beta,
        mlp_alpha_factor=config.mlp_alpha,
        mlp_beta_factor=config.mlp_beta,
    )


def from_minimax_config(hf: MiniMaxConfig, **overrides) -> HybridConfig:
    """Our config for a transformers MiniMax config; refuses what we cannot reproduce exactly."""
    problems = []
    if getattr(hf, "sliding_window", None) is not None:
        problems.append(f"sliding_window={hf.sliding_window} (softmax layers here are full causal)")
    if hf.hidden_act != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r} (experts here are SwiGLU)")
    unknown = sorted(set(hf.layer_types) - set(_OUR_KIND))
    if unknown:
        problems.append(f"layer_types {unknown} (expected {sorted(_OUR_KIND)})")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope = dict(hf.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    factor = rope.get("partial_rotary_factor", 1.0)
    if rope_type == "default" and factor == 1.0:
        rotary_dim, rope_theta = head_dim, rope["rope_theta"]
    elif rope_type == "proportional" and rope.get("factor", 1.0) == 1.0:
        rotary_dim = rotated_pairs(factor, head_dim) * 2  # what transformers rotates
        rope_theta = rope["rope_theta"] ** (rotary_dim / head_dim)
    else:
        problems.append(f"rope_parameters={rope} (only 'default' and unscaled 'proportional' map to ours)")
    if problems:
        raise ValueError(
            "cannot import this MiniMax config into HybridConfig:\n  - " + "\n  - ".join(problems)
        )
    fields = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        head_dim=head_dim,
        num_key_value_heads=hf.num_key_value_heads,
        attention_pattern=[_OUR_KIND[t] for t in hf.layer_types],
        rotary_dim=rotary_dim,
        rope_theta=rope_theta,
        max_position_embeddings=hf.max_position_embeddings,
        rms_norm_eps=hf.rms_norm_eps,
        num_experts=hf.num_local_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        router_aux_loss_coef=hf.router_aux_loss_coef,  # output_router_logits: ours (exports carry it off)
        lightning_attn_alpha=hf.linear_attn_alpha_factor,
        lightning_attn_beta=hf.linear_attn_beta_factor,
        softmax_attn_alpha=hf.full_attn_alpha_factor,
        softmax_attn_beta=hf.full_attn_beta_factor,
        mlp_alpha=hf.mlp_alpha_factor,
        mlp_beta=hf.mlp_beta_factor,
        lightning_block_size=hf.block_size,
        use_cache=hf.use_cache,
        tie_word_embeddings=hf.tie_word_embeddings,
        pad_token_id=hf.pad_token_id,
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
    )
    fields.update(overrides)
    return HybridConfig(**fields)


# --- state dicts --------------------------------------------------------------------------------------------


def to_minimax_state_dict(
    state_dict: dict[str, torch.Tensor], config: HybridConfig
) -> dict[str, torch.Tensor]:
    perm = rope_permutation(config.head_dim, config.rotary_dim)
    out = {}
    for key, value in state_dict.items():
        m = _LAYER_KEY.match(key)
        if m is None:
            out[key] = value  # embed_tokens, norm, lm_head: same names
            continue
        layer, suffix = m.groups()
        if suffix not in _TO_HF:
            raise KeyError(f"to_minimax_state_dict: no transformers name for {key!r}")
        if suffix in _ROTATED:
            value = _permute_heads(value, config.head_dim, perm)
        out[f"model.layers.{layer}.{_TO_HF[suffix]}"] = value
    return out


def from_minimax_state_dict(
    state_dict: dict[str, torch.Tensor], config: HybridConfig
) -> dict[str, torch.Tensor]:
    inverse = torch.argsort(rope_permutation(config.head_dim, config.rotary_dim))
    out = {}
    for key, value in state_dict.items():
        m = _LAYER_KEY.match(key)
        if m is None:
            out[key] = value
            continue
        layer, suffix = m.groups()
        if suffix.startswith("self_attn.") and suffix.split(".")[-1] in _HF_BUFFERS:
            continue  # recomputed from the config on both sides
        if suffix not in _FROM_HF:
            raise KeyError(f"from_minimax_state_dict: unexpected transformers key {key!r}")
        ours = _FROM_HF[suffix]
        if ours in _ROTATED:
            value = _permute_heads(value, config.head_dim, inverse)
        out[f"model.layers.{layer}.{ours}"] = value
    return out


# --- models -------------------------------------------------------------------------------------------------


def export_to_minimax(model: HybridForCausalLM) -> MiniMaxForCausalLM:
    """A transformers ``MiniMaxForCausalLM`` holding ``model``'s weights (same dtype, CPU)."""
    hf = MiniMaxForCausalLM(to_minimax_config(model.config)).to(dtype=model.dtype)
    state = to_minimax_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()}, model.config)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.rsplit(".", 1)[-1] not in _HF_BUFFERS]
    if missing or unexpected:
        raise RuntimeError(f"export_to_minimax: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def save_as_minimax(model: HybridForCausalLM, path: str | os.PathLike) -> None:
    """Write a checkpoint that ``AutoModelForCausalLM.from_pretrained(path)`` loads as transformers' MiniMax.

    For left-padded batched ``generate`` with transformers, pass ``past_key_values=MiniMaxGenerationCache(
    model.config)`` (module docstring: its own cache mis-masks when layer 0 is a lightning layer)."""
    export_to_minimax(model).save_pretrained(path)


class MiniMaxGenerationCache(MiniMaxCache):
    """transformers' ``MiniMaxCache`` that reports which layers are lightning (linear-attention) layers, so
    its mask builder sizes the softmax layers' decode masks from a softmax layer's key cache. The workaround
    for left-padded batched ``generate`` when layer 0 is a lightning layer (see the module docstring)."""

    def __init__(self, config: MiniMaxConfig) -> None:
        super().__init__()
        self._lightning = [kind == _HF_KIND[LIGHTNING] for kind in config.layer_types]

    @property
    def is_linear(self) -> list[bool]:
        return [i < len(self._lightning) and self._lightning[i] for i in range(len(self.layers))]


def import_from_minimax(
    source: MiniMaxForCausalLM | str | os.PathLike, **config_overrides
) -> HybridForCausalLM:
    """Our model from a transformers MiniMax model or checkpoint directory."""
    hf = source if isinstance(source, MiniMaxForCausalLM) else MiniMaxForCausalLM.from_pretrained(source)
    config = from_minimax_config(hf.config, **config_overrides)
    model = HybridForCausalLM(config).to(dtype=hf.dtype)
    state = from_minimax_state_dict(hf.state_dict(), config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"import_from_minimax: missing {missing}, unexpected {unexpected}")
    return model.eval()


def max_relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |a - b| / max |b|: the parity measure used by tests and the export check."""
    return float(
        (ours.double() - theirs.double()).abs().max() / theirs.double().abs().max().clamp(min=math.ulp(1.0))
    )
