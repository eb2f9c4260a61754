"""Config, DeepNorm initialisation statistics, the attributes TRL relies on, gradient checkpointing, and the
save/load round trip of our own format (safetensors + Auto classes)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kernels.lightning import lightning_decay_rates
from model.configuration import HybridConfig, hybrid_attention_pattern  # importing model.* registers Auto
from model.modeling import HybridForCausalLM
from model.sizes import config_for


def test_config_defaults_follow_the_report():
    cfg = HybridConfig(num_hidden_layers=16, hidden_size=256, num_attention_heads=4)
    assert cfg.attention_pattern == (["lightning"] * 7 + ["softmax"]) * 2  # softmax after every 7 lightning
    assert cfg.rotary_dim == cfg.head_dim // 2 == 32 and cfg.rope_theta == 10000.0
    assert cfg.mlp_alpha == cfg.lightning_attn_alpha == cfg.softmax_attn_alpha == pytest.approx(32**0.25)
    assert cfg.mlp_beta == cfg.lightning_attn_beta == 1.0
    assert cfg.init_beta == pytest.approx(128**-0.25)
    assert hybrid_attention_pattern(3) == ["lightning"] * 3
    assert HybridConfig(num_hidden_layers=2, attention_pattern="all-softmax").softmax_layers == [0, 1]


def test_config_errors_name_every_bad_field():
    with pytest.raises(ValueError) as err:
        HybridConfig(num_hidden_layers=3, attention_pattern=["lightning", "sofmax"], num_key_value_heads=3,
                     num_experts=4, num_experts_per_tok=5, rotary_dim=7)  # fmt: skip
    msg = str(err.value)
    for field in ("attention_pattern has 2 entries", "'sofmax'", "num_key_value_heads=3", "num_experts_per_tok=5",
                  "rotary_dim=7"):  # fmt: skip
        assert field in msg


def test_config_carries_what_trl_reads():
    cfg = config_for("tiny")
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    assert cfg.router_aux_loss_coef > 0 and cfg.output_router_logits is True
    assert cfg.auto_map == {}
    model = HybridForCausalLM(cfg)
    assert model.base_model_prefix == "model" and model.model is model.base_model
    assert model.get_output_embeddings() is model.lm_head


def test_deepnorm_xavier_initialisation_statistics():
    torch.manual_seed(0)
    cfg = config_for("tiny", hidden_size=128, head_dim=32, moe_intermediate_size=256)  # 8 layers
    model = HybridForCausalLM(cfg)
    beta = (8 * 8) ** -0.25
    d, V, F, inner, kv = 128, 512, 256, 4 * 32, 2 * 32

    def xavier(fan_in, fan_out, gain=1.0):
        return gain * math.sqrt(2.0 / (fan_in + fan_out))

    def check(t, std, name):
        n = t.numel()
        assert abs(t.std().item() / std - 1) < 4 / math.sqrt(2 * n) + 0.01, (name, t.std().item(), std)
        assert abs(t.mean().item()) < 4 * std / math.sqrt(n), name

    check(model.model.embed_tokens.weight, xavier(d, V), "embed")
    check(model.lm_head.weight, xavier(d, V), "lm_head")
    lightning, softmax = model.model.layers[0], model.model.layers[7]
    qkv = lightning.attn.qkv_proj.weight.view(4, 3, 32, d)
    check(qkv[:, 0], xavier(d, inner), "q")
    check(qkv[:, 1], xavier(d, inner), "k")
    check(qkv[:, 2], xavier(d, inner, beta), "v (beta)")
    check(lightning.attn.output_gate.weight, xavier(d, inner), "gate")
    check(lightning.attn.out_proj.weight, xavier(inner, d, beta), "out (beta)")
    check(softmax.attn.q_proj.weight, xavier(d, inner), "softmax q")
    check(softmax.attn.k_proj.weight, xavier(d, kv), "softmax k")
    check(softmax.attn.v_proj.weight, xavier(d, kv, beta), "softmax v (beta)")
    check(softmax.attn.o_proj.weight, xavier(inner, d, beta), "softmax o (beta)")
    for layer in (lightning, softmax):
        check(layer.moe.router.weight, xavier(d, cfg.num_experts), "router")
        check(layer.moe.experts.gate_up_proj, xavier(d, F, beta), "experts gate/up (beta)")
        check(layer.moe.experts.down_proj, xavier(F, d, beta), "experts down (beta)")
        assert torch.all(layer.attn_norm.weight == 1) and torch.all(layer.ffn_norm.weight == 1)
    assert torch.all(lightning.attn.norm.weight == 1) and torch.all(model.model.norm.weight == 1)


def test_save_load_round_trip_through_auto_classes(tmp_path):
    assert isinstance(AutoConfig.for_model("hylight_hybrid"), HybridConfig)  # registered by `import model`
    torch.manual_seed(0)
    model = HybridForCausalLM(config_for("tiny", num_hidden_layers=4, attention_pattern=[
        "lightning", "softmax", "lightning", "softmax"], lightning_block_size=16, capacity_factor=1.1)).eval()  # fmt: skip
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "hylight_hybrid" and saved["capacity_factor"] == 1.1

    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, HybridConfig) and config.attention_pattern == model.config.attention_pattern
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HybridForCausalLM
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # decay rates and RoPE frequencies are derived, never stored, and stay fp32 whatever the weights' dtype
    assert set(model.state_dict()) == set(loaded.state_dict())
    assert not any("decay" in k or "freq" in k for k in loaded.state_dict())
    torch.testing.assert_close(loaded.model.layers[2].attn.decay_rates, lightning_decay_rates(4, 2, 4))
    ids = torch.randint(0, 512, (2, 30))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    loaded.to(torch.bfloat16)
    assert loaded.model.layers[2].attn.decay_rates.dtype == torch.float32
    torch.testing.assert_close(loaded.model.layers[2].attn.decay_rates, lightning_decay_rates(4, 2, 4))


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    cfg = config_for(
        "tiny", num_hidden_layers=2, attention_pattern=["lightning", "softmax"], moe_token_drop=False
    )
    model = HybridForCausalLM(cfg).train()
    ids = torch.randint(0, 512, (2, 20))
    model(ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable()
    model(ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], msg=n)
