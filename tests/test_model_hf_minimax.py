"""Interop with transformers' own MiniMaxForCausalLM: our export loads through AutoModelForCausalLM without
remote code and gives our logits within 1e-4 relative error (fp32, eval, dropless); MiniMax checkpoints import
into our model the same way; the conversion is exact both ways."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, MiniMaxConfig, MiniMaxForCausalLM

from model.hf_minimax import (
    MiniMaxGenerationCache,
    from_minimax_config,
    from_minimax_state_dict,
    import_from_minimax,
    max_relative_error,
    partial_rotary_factor,
    rope_permutation,
    rotated_pairs,
    save_as_minimax,
    to_minimax_config,
    to_minimax_state_dict,
)
from model.modeling import HybridForCausalLM
from model.sizes import config_for

PARITY = 1e-4


def _ours(seed=0, **kw) -> HybridForCausalLM:
    torch.manual_seed(seed)
    base = dict(num_hidden_layers=4, attention_pattern=["lightning", "softmax", "lightning", "softmax"],
                lightning_block_size=16)  # fmt: skip
    return HybridForCausalLM(config_for("tiny", **{**base, **kw})).eval()


@pytest.mark.parametrize("rotary", ["half", "full"])
def test_export_loads_as_transformers_minimax_and_gives_our_logits(tmp_path, rotary):
    model = _ours(rotary_dim=None if rotary == "half" else 16)
    save_as_minimax(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "minimax"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)  # no trust_remote_code
    assert type(hf) is MiniMaxForCausalLM
    hf.eval()
    ids = torch.randint(0, 512, (2, 45))  # three lightning blocks, the last one partial
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf(ids).logits
    assert max_relative_error(ours, theirs) < PARITY

    mask = torch.ones(2, 45, dtype=torch.long)
    mask[1, :9] = 0  # left padding: compare the real tokens
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
    assert max_relative_error(ours[0], theirs[0]) < PARITY
    assert max_relative_error(ours[1, 9:], theirs[1, 9:]) < PARITY


def test_export_parity_needs_the_rope_permutation():
    """Guard on the test itself: an export without the head-dim permutation must miss parity."""
    model = _ours()
    hf = MiniMaxForCausalLM(to_minimax_config(model.config)).eval()
    state = to_minimax_state_dict(model.state_dict(), model.config)
    for key in state:  # undo the permutation
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            state[key] = model.state_dict()[key.replace("self_attn", "attn")]
    hf.load_state_dict(state, strict=False)
    ids = torch.randint(0, 512, (1, 40))
    with torch.no_grad():
        assert max_relative_error(model(ids).logits, hf(ids).logits) > 1e-3


def test_greedy_generation_matches_transformers_minimax(tmp_path):
    model = _ours(seed=3)
    save_as_minimax(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.randint(0, 512, (2, 21))
    ours = model.generate(prompt, max_new_tokens=15, do_sample=False)
    theirs = hf.generate(prompt, max_new_tokens=15, do_sample=False)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("rope", ["default", "proportional"])
def test_import_of_a_transformers_minimax_checkpoint_gives_its_logits(tmp_path, rope):
    torch.manual_seed(1)
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    if rope == "proportional":
        rope_parameters = {"rope_type": "proportional", "rope_theta": 1e8, "partial_rotary_factor": 0.5}
    hf_cfg = MiniMaxConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"], rope_parameters=rope_parameters,
        linear_attn_alpha_factor=1.7, full_attn_alpha_factor=1.3, mlp_alpha_factor=1.5, mlp_beta_factor=0.9,
    )  # fmt: skip
    MiniMaxForCausalLM(hf_cfg).save_pretrained(tmp_path)
    hf = MiniMaxForCausalLM.from_pretrained(tmp_path).eval()
    ours = import_from_minimax(tmp_path)
    assert ours.config.rotary_dim == (16 if rope == "default" else 8)
    assert ours.config.rope_theta == pytest.approx(10000.0)
    assert ours.config.mlp_beta == 0.9 and ours.config.lightning_attn_alpha == 1.7
    ids = torch.randint(0, 300, (2, 37))
    with torch.no_grad():
        assert max_relative_error(ours(ids).logits, hf(ids).logits) < PARITY


def test_state_dict_conversion_is_exact_both_ways():
    model = _ours(num_key_value_heads=1)
    ours = model.state_dict()
    there = to_minimax_state_dict(ours, model.config)
    assert any(k.endswith("mlp.gate.weight") for k in there) and not any(".attn." in k for k in there)
    back = from_minimax_state_dict(there, model.config)
    assert back.keys() == ours.keys()
    for key in ours:
        assert torch.equal(back[key], ours[key]), key


def test_rope_permutation_pairs_our_dims_onto_transformers_half_split():
    perm = rope_permutation(16, 8)
    assert sorted(perm.tolist()) == list(range(16))
    # transformers pairs (i, i + 8); ours pairs (j, j + 4) for j < 4
    for j in range(4):
        assert (perm[j].item(), perm[j + 8].item()) == (j, j + 4)
    assert torch.equal(rope_permutation(16, 16), torch.arange(16))


def test_import_refuses_what_it_cannot_reproduce():
    cfg = MiniMaxConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})  # fmt: skip
    with pytest.raises(ValueError, match="rope_parameters"):
        from_minimax_config(cfg)
    cfg = MiniMaxConfig(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], sliding_window=64
    )
    with pytest.raises(ValueError, match="sliding_window"):
        from_minimax_config(cfg)


# --- export details (issue 10) ----------------------------------------------------------------------------
def test_partial_rotary_factor_gives_transformers_exactly_the_rotated_pairs():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for d in range(2, 258, 2):
        for r in range(2, d, 2):
            assert rotated_pairs(partial_rotary_factor(d, r), d) == r // 2, (d, r)
    assert rotated_pairs(30 / 44, 44) == 14  # the float trap the exported factor avoids
    # transformers' own RoPE init on the exported config: 15 rotated (non-zero) frequencies, 7 pass-through
    cfg = to_minimax_config(config_for("tiny", hidden_size=88, num_attention_heads=2, head_dim=44, rotary_dim=30))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu")
    assert inv_freq.shape == (22,) and int((inv_freq != 0).sum()) == 15


def test_export_with_an_odd_rotated_pair_count_keeps_parity_and_reimports_the_same_rotary_dim(tmp_path):
    # head_dim 44, rotary_dim 30: 15 pairs; a small rope_theta makes the last pair's rotation visible
    model = _ours(seed=4, hidden_size=88, num_attention_heads=2, head_dim=44, rotary_dim=30, rope_theta=100.0,
                  num_hidden_layers=2, attention_pattern=["softmax", "lightning"])
    save_as_minimax(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        assert max_relative_error(model(ids).logits, hf(ids).logits) < PARITY  # 5.5e-3 with 14 pairs
    assert import_from_minimax(tmp_path).config.rotary_dim == 30


def _left_padded(hf: MiniMaxForCausalLM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(1, 512, (1, 12), generator=g), torch.randint(1, 512, (1, 8), generator=g)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask, a, b


def test_export_turns_router_logits_off_so_generate_runs_on_a_left_padded_batch(tmp_path):
    model = _ours(seed=3)
    assert model.config.output_router_logits  # ours: on, for training
    save_as_minimax(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["output_router_logits"] is False
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask, _, _ = _left_padded(hf)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 16)
    assert import_from_minimax(tmp_path).config.output_router_logits  # an import takes our default


def test_left_padded_batched_generation_with_lightning_layer_0_needs_the_generation_cache(tmp_path):
    """transformers' MiniMaxCache mis-masks the softmax layers' decode steps when layer 0 is a lightning
    layer; MiniMaxGenerationCache (documented in model/hf_minimax.py) gives each row what it gives alone."""
    model = _ours(seed=3)
    assert model.config.attention_pattern[0] == "lightning"
    save_as_minimax(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask, a, b = _left_padded(hf)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    alone_a, alone_b = hf.generate(a, **kw)[0, 12:], hf.generate(b, **kw)[0, 8:]
    fixed = hf.generate(ids, attention_mask=mask, past_key_values=MiniMaxGenerationCache(hf.config), **kw)
    assert torch.equal(fixed[0, 12:], alone_a) and torch.equal(fixed[1, 12:], alone_b)
    ours = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(ours[1, 12:], alone_b)
    stock = hf.generate(ids, attention_mask=mask, **kw)
    assert not torch.equal(stock[1, 12:], alone_b), (
        "transformers now masks this case right: drop MiniMaxGenerationCache and its note in model/hf_minimax.py")
