"""Interop with transformers' own MiniMaxForCausalLM: our export loads through AutoModelForCausalLM without
remote code and gives our logits within 1e-4 relative error (fp32, eval, dropless); MiniMax checkpoints import
into our model the same way; the conversion is exact both ways."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, MiniMaxConfig, MiniMaxForCausalLM

from model.hf_minimax import (
    from_minimax_config,
    from_minimax_state_dict,
    import_from_minimax,
    max_relative_error,
    rope_permutation,
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
