"""MoE spec: eq. 1 routing, aux loss against a hand computation, capacity token drop and its accounting,
padding kept out of routing, dropless eval, the model-level drop counters."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.modeling import HybridForCausalLM
from model.moe import MoEFeedForward, capacity_keep_mask, expert_capacity
from model.sizes import config_for


def _moe(num_experts=4, hidden=4, top_k=2, capacity_factor=1.0, seed=0) -> MoEFeedForward:
    torch.manual_seed(seed)
    moe = MoEFeedForward(
        hidden, 6, num_experts, top_k, capacity_factor=capacity_factor, token_drop=True
    ).double()
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(num_experts, hidden, dtype=torch.float64))  # logits = x[:, :E]
        moe.experts.gate_up_proj.normal_(0, 0.5)
        moe.experts.down_proj.normal_(0, 0.5)
    return moe


def _ffn(moe: MoEFeedForward, e: int, x: torch.Tensor) -> torch.Tensor:
    w = moe.experts.gate_up_proj[e]
    gate, up = x @ w[:6].T, x @ w[6:].T
    return (F.silu(gate) * up) @ moe.experts.down_proj[e].T


def test_router_weights_are_the_softmax_over_the_selected_logits_eq1():
    moe = _moe()
    x = torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.5, -2.0, 1.5, 1.0]], dtype=torch.float64)
    logits, probs, top_w, top_i = moe.router(x)
    assert top_i.tolist() == [[0, 1], [2, 3]]
    for t in range(2):
        selected = logits[t, top_i[t]]
        torch.testing.assert_close(top_w[t], torch.softmax(selected, dim=0).to(top_w.dtype))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, dtype=probs.dtype))


def test_aux_loss_matches_a_hand_computation():
    moe = _moe().eval()
    rows = [[3.0, 2.0, 0.0, -1.0], [0.5, -2.0, 1.5, 1.0], [0.0, 1.0, 2.0, 0.5], [9.0, 9.0, 9.0, 9.0]]
    x = torch.tensor(rows, dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])  # the last token is padding
    out = moe(x[None], mask[None])

    # by hand: softmax per real token, top-2 by probability, f = share of the 6 routed slots, m = mean prob
    E, real = 4, rows[:3]
    probs = [[math.exp(v) / sum(math.exp(u) for u in r) for v in r] for r in real]
    slots = [0] * E
    for p in probs:
        for e in sorted(range(E), key=lambda e: -p[e])[:2]:
            slots[e] += 1
    f = [s / (3 * 2) for s in slots]
    m = [sum(p[e] for p in probs) / 3 for e in range(E)]
    expected = sum(fi * mi for fi, mi in zip(f, m, strict=True)) / E
    assert out.aux_loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.routed.tolist() == slots  # padding is not routed
    assert out.dropped.tolist() == [0, 0, 0, 0]  # eval is dropless


def test_capacity_drops_second_choices_before_first_choices_and_counts_them():
    # capacity = ceil(1.0 * 2 tokens * 2 / 4 experts) = 1 slot per expert.
    # token A prefers (0, 1); token B prefers (1, 2). Expert 1 gets A's 2nd and B's 1st choice: B's first
    # choice is admitted first (GShard rank order), A's second choice is dropped although A comes first.
    moe = _moe(capacity_factor=1.0).train()
    a, b = [3.0, 2.0, 0.0, -1.0], [-1.0, 3.0, 2.0, 0.0]
    x = torch.tensor([a, b], dtype=torch.float64)
    assert expert_capacity(2, 2, 4, 1.0) == 1
    out = moe(x[None])
    assert out.routed.tolist() == [1, 2, 1, 0]
    assert out.dropped.tolist() == [0, 1, 0, 0]
    assert (out.routed - out.dropped).sum().item() == 3  # routed = kept + dropped

    def weights(row, pair):
        z = [math.exp(row[e]) for e in pair]
        return [v / sum(z) for v in z]

    wa, wb = weights(a, (0, 1)), weights(b, (1, 2))
    expected_a = wa[0] * _ffn(moe, 0, x[0])  # A's slot for expert 1 was dropped: no renormalisation
    expected_b = wb[0] * _ffn(moe, 1, x[1]) + wb[1] * _ffn(moe, 2, x[1])
    torch.testing.assert_close(out.hidden[0, 0], expected_a)
    torch.testing.assert_close(out.hidden[0, 1], expected_b)

    moe.eval()  # dropless: A gets both experts
    out = moe(x[None])
    assert out.dropped.tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(out.hidden[0, 0], wa[0] * _ffn(moe, 0, x[0]) + wa[1] * _ffn(moe, 1, x[0]))


def test_overloaded_expert_keeps_the_earliest_tokens_up_to_capacity():
    moe = _moe(capacity_factor=1.0).train()
    x = torch.tensor([[4.0, 2.0, 0.0, -1.0]] * 6, dtype=torch.float64)  # all 6 tokens choose (0, 1)
    out = moe(x[None])
    cap = expert_capacity(6, 2, 4, 1.0)
    assert cap == 3
    assert out.routed.tolist() == [6, 6, 0, 0]
    assert out.dropped.tolist() == [3, 3, 0, 0]
    assert torch.all(out.hidden[0, 3:] == 0)  # tokens past capacity got nothing from any expert
    assert torch.all(out.hidden[0, :3].abs().sum(-1) > 0)


def test_padding_neither_consumes_capacity_nor_counts():
    top_i = torch.tensor([[0, 1], [0, 1], [0, 1]])
    valid = torch.tensor([[False, False], [True, True], [True, True]])  # token 0 is padding
    keep = capacity_keep_mask(top_i, valid, num_experts=4, capacity=2)
    assert keep.tolist() == [[False, False], [True, True], [True, True]]
    keep = capacity_keep_mask(top_i, torch.ones_like(valid), num_experts=4, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [False, False]]


def test_model_reports_drops_per_layer_in_training_and_none_in_eval():
    torch.manual_seed(0)
    cfg = config_for(
        "tiny", num_hidden_layers=2, attention_pattern=["lightning", "softmax"], capacity_factor=0.5
    )
    model = HybridForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :4] = 0  # left padding: 4 tokens never routed
    out = model(ids, attention_mask=mask, labels=ids)
    real_slots = (48 - 4) * cfg.num_experts_per_tok
    assert out.moe_routed.shape == (2, cfg.num_experts)
    assert out.moe_routed.sum(-1).tolist() == [real_slots, real_slots]
    cap = expert_capacity(44, 2, cfg.num_experts, 0.5)
    assert torch.all(out.moe_routed - out.moe_dropped <= cap)
    assert out.moe_dropped.sum().item() >= 2 * (real_slots - cfg.num_experts * cap)  # at least the overflow
    out.loss.backward()
    assert model.model.layers[0].moe.router.weight.grad.abs().sum() > 0

    model.eval()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=False)
    assert out.moe_dropped.sum().item() == 0


def test_loss_adds_the_scaled_aux_loss():
    torch.manual_seed(0)
    cfg = config_for(
        "tiny", num_hidden_layers=2, attention_pattern=["lightning", "softmax"], router_aux_loss_coef=0.5
    )
    model = HybridForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        out = model(ids, labels=ids)
        plain = model(ids, labels=ids, output_router_logits=False)
    ce = F.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    torch.testing.assert_close(plain.loss, ce)
    torch.testing.assert_close(out.loss, ce + 0.5 * out.aux_loss)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (16, cfg.num_experts)
