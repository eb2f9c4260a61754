"""GRPO of §5.4.2: every loss term's value and gradient against numbers worked out by hand (in the comments), then
the TRL trainer for real on a tiny HybridForCausalLM: metrics logged, weights move, each switch changes its term."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.grpo_loss import (
    balanced_advantages,
    cispo_objective,
    group_normalized_advantages,
    grpo_loss,
    k3_kl,
    stop_gradient_kl,
)

D = torch.float64
LN2, LN3 = math.log(2.0), math.log(3.0)


def _leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=D, requires_grad=True)


# --- advantages


def test_group_normalized_advantages_match_hand_values_and_an_all_equal_group_gives_zeros():
    # group 1: rewards 1,0,0,0: mean 0.25, unbiased std sqrt((0.75² + 3·0.25²)/3) = 0.5
    #   -> 0.75/0.5001 = 1.49970..., -0.25/0.5001 = -0.49990...; group 2 all 2: std 0 -> 0/(0+1e-4) = 0
    adv = group_normalized_advantages(torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2], dtype=D), 4)
    torch.testing.assert_close(adv, torch.tensor([0.75 / 0.5001] + [-0.25 / 0.5001] * 3 + [0.0] * 4, dtype=D))
    centred = group_normalized_advantages(torch.tensor([1.0, 0, 0, 0], dtype=D), 4, scale=False)
    torch.testing.assert_close(centred, torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=D))


def test_balanced_advantages_give_both_signs_the_same_token_weighted_total():
    # group 1: A = 1.5, -0.5, -0.5, -0.5 with 2, 4, 6, 2 tokens: S+ = 1.5·2 = 3, S- = 0.5·(4+6+2) = 6, half = 4.5
    #   positives x 4.5/3 = 1.5 -> 2.25; negatives x 4.5/6 = 0.75 -> -0.375 (check: 2.25·2 = 4.5 = 0.375·12)
    # group 2: all zero (every completion scored the same) -> zeros, no NaN
    # group 3: all positive (nothing to balance against) -> unchanged
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0, 1, 2, 0, 3], dtype=D)
    counts = torch.tensor([2, 4, 6, 2, 3, 3, 3, 3, 1, 2, 3, 4])
    out = balanced_advantages(adv, counts, 4)
    torch.testing.assert_close(out, torch.tensor([2.25, -0.375, -0.375, -0.375, 0, 0, 0, 0, 1, 2, 0, 3], dtype=D))
    w = out[:4].abs() * counts[:4]
    assert w[0].item() == pytest.approx(w[1:].sum().item()) == pytest.approx(4.5)


def test_balanced_advantages_per_sequence_leave_group_centred_advantages_unchanged_and_an_all_negative_group():
    # with token counts of 1 a centred group already has S+ = S- (Σ A = 0): 1.5 = 3·0.5
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5, -1.0, -2.0, -1.0, -1.0], dtype=D)
    out = balanced_advantages(adv, torch.ones(8), 4)
    torch.testing.assert_close(out, adv)  # the second group is all negative: unchanged


# --- (a) the clipped IS objective


# Two completions, T = 4, eps = 0.2. Row 0: A = +1, ratios 1.0, 1.5, then padding. Row 1: A = -1, ratios 0.5,
# 3.0, 1.5, then a padding token with ratio 5. Per token loss = -min(r·A, clip(r, 0.8, 1.2)·A), d/dlogp (r = e^(logp-old)):
#   r=1.0 A=+1: min(1, 1) -> loss -1,   grad -r·A = -1
#   r=1.5 A=+1: min(1.5, 1.2) = 1.2 (clipped) -> loss -1.2, grad 0
#   r=0.5 A=-1: min(-0.5, -0.8) = -0.8 (clipped) -> loss 0.8, grad 0
#   r=3.0 A=-1: min(-3, -1.2) = -3 (one-sided clip lets it through) -> loss 3, grad -r·A = 3
#   r=1.5 A=-1: min(-1.5, -1.2) = -1.5 -> loss 1.5, grad 1.5
# 5 real tokens; loss = Σ/5. Off: (-1 - 1.2 + 0.8 + 3 + 1.5)/5 = 0.62, clipped: 2 of 5.
# (a) with c = 2 drops r=3.0 A=-1: (-1 - 1.2 + 0.8 + 1.5)/5 = 0.02, changed 3 of 5.
# (a) with c = 1.2 (default 1 + eps_high) drops both negative tokens above 1.2: (-1 - 1.2 + 0.8)/5 = -0.28, 4 of 5.
RATIOS = [[1.0, 1.5, 1.0, 1.0], [0.5, 3.0, 1.5, 5.0]]
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
ADV = torch.tensor([1.0, -1.0], dtype=D)


def _clip_case(ratio_max_negative):
    old = torch.full((2, 4), math.log(0.1), dtype=D)
    logp = _leaf((old + torch.log(torch.tensor(RATIOS, dtype=D))).tolist())
    out = grpo_loss(logp, old, ADV, MASK, epsilon_low=0.2, epsilon_high=0.2, ratio_max_negative=ratio_max_negative)
    out.loss.backward()
    return out, logp.grad


@pytest.mark.parametrize(("c", "loss", "grad_row1", "clip_fraction"), [
    (None, 0.62, [0.0, 3 / 5, 1.5 / 5, 0.0], 2 / 5),  # standard one-sided clip: r=3, A=-1 drives a 3x gradient
    (2.0, 0.02, [0.0, 0.0, 1.5 / 5, 0.0], 3 / 5),  # (a): the r=3, A=-1 token is abandoned
    (1.2, -0.28, [0.0, 0.0, 0.0, 0.0], 4 / 5),  # (a) at the clip edge: every negative token above 1.2 goes
])  # fmt: skip
def test_clipped_objective_value_gradient_and_clip_fraction(c, loss, grad_row1, clip_fraction):
    out, grad = _clip_case(c)
    assert out.loss.item() == pytest.approx(loss)
    torch.testing.assert_close(grad[0], torch.tensor([-1 / 5, 0.0, 0.0, 0.0], dtype=D))
    torch.testing.assert_close(grad[1], torch.tensor(grad_row1, dtype=D))
    assert out.clip_fraction.item() == pytest.approx(clip_fraction)
    assert out.kl.item() == 0.0 and out.kl_loss.item() == 0.0  # no reference, beta 0


def test_padding_tokens_change_neither_loss_nor_normaliser():
    # the padding slot of row 1 has r = 5, A = -1 (the worst case): moving it to r = 50 changes nothing
    base, _ = _clip_case(None)
    old = torch.full((2, 4), math.log(0.1), dtype=D)
    ratios = torch.tensor(RATIOS, dtype=D)
    ratios[1, 3] = 50.0
    logp = _leaf((old + torch.log(ratios)).tolist())
    out = grpo_loss(logp, old, ADV, MASK, epsilon_low=0.2, epsilon_high=0.2)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(base.loss.item()) == pytest.approx(0.62)  # still Σ over 5 tokens / 5
    assert logp.grad[1, 3].item() == 0.0 and logp.grad[0, 2:].abs().sum().item() == 0.0


# --- CISPO


def test_cispo_value_gradient_keep_a_bounded_gradient_on_clipped_tokens():
    # loss = -sg(min(r, 2))·A·logp per token, 4 tokens, Σ/4; grad = -w·A/4
    #   logp=-1,   r=1 A=+1: w=1 -> loss  1  grad -1
    #   logp=-1,   r=3 A=+1: w=2 -> loss  2  grad -2   (clipped, gradient kept but bounded: PPO's would be 0)
    #   logp=-2,   r=.5 A=-1: w=.5 -> loss -1  grad 0.5
    #   logp=-0.5, r=3 A=-1: w=2 -> loss -1  grad 2    (clipped)
    logp = _leaf([[-1.0, -1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.0, -1.0 - LN3, -2.0 + LN2, -0.5 - LN3]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=D)
    out = grpo_loss(logp, old, adv, torch.ones(1, 4), objective="cispo", cispo_ratio_max=2.0)
    out.loss.backward()
    assert out.loss.item() == pytest.approx((1 + 2 - 1 - 1) / 4)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -2.0, 0.5, 2.0]], dtype=D) / 4)
    assert out.clip_fraction.item() == pytest.approx(2 / 4)
    _, changed = cispo_objective(logp, old, adv, ratio_max=2.0)
    assert changed.tolist() == [[False, True, False, True]]


# --- (b) the KL term


def test_stop_gradient_kl_and_k3_values_and_gradients():
    # token 1: π = 0.5, π_ref = 0.25; token 2: π = 0.2, π_ref = 0.4
    # sg form: (π - π_ref)·log π = 0.25·ln 0.5 = -0.173287, -0.2·ln 0.2 = 0.321888; grad (π - π_ref) = 0.25, -0.2
    # k3: d = ln π_ref - ln π: e^d - d - 1 = 0.5 + ln 2 - 1 = 0.193147, 2 - ln 2 - 1 = 0.306853;
    #     grad 1 - π_ref/π = 0.5, -1 (unbounded as π -> 0; the sg form's is bounded by 1)
    ref = torch.log(torch.tensor([0.25, 0.4], dtype=D))
    logp = _leaf(torch.log(torch.tensor([0.5, 0.2], dtype=D)).tolist())
    sg = stop_gradient_kl(logp, ref)
    torch.testing.assert_close(sg, torch.tensor([0.25 * math.log(0.5), -0.2 * math.log(0.2)], dtype=D))
    sg.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.25, -0.2], dtype=D))
    logp.grad = None
    k3 = k3_kl(logp, ref)
    torch.testing.assert_close(k3, torch.tensor([LN2 - 0.5, 1 - LN2], dtype=D))
    k3.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.5, -1.0], dtype=D))


@pytest.mark.parametrize(("estimator", "loss", "grad"), [
    ("stop_gradient", 0.1 * (0.25 * math.log(0.5) - 0.2 * math.log(0.2)) / 2, [0.1 * 0.25 / 2, 0.1 * -0.2 / 2]),
    ("k3", 0.1 * 0.5 / 2, [0.1 * 0.5 / 2, 0.1 * -1.0 / 2]),
])  # fmt: skip
def test_grpo_loss_adds_beta_times_the_chosen_kl_term_and_logs_k3_kl(estimator, loss, grad):
    # A = 0: the policy term vanishes; loss = β·mean(term), β = 0.1; the `kl` metric is the k3 mean (0.5/2 = 0.25)
    # for either estimator, and a third, masked token (π = 0.01 vs π_ref = 0.9) counts nowhere
    ref = torch.log(torch.tensor([[0.25, 0.4, 0.9]], dtype=D))
    logp = _leaf(torch.log(torch.tensor([[0.5, 0.2, 0.01]], dtype=D)).tolist())
    out = grpo_loss(logp, logp.detach(), torch.zeros(1, dtype=D), torch.tensor([[1, 1, 0]]), ref_logp=ref, beta=0.1,
                    kl_estimator=estimator)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(loss)
    torch.testing.assert_close(logp.grad, torch.tensor([[*grad, 0.0]], dtype=D))
    assert out.kl.item() == pytest.approx(0.25)
    assert out.policy_loss.item() == 0.0


def test_grpo_loss_with_beta_and_no_reference_says_what_is_missing():
    logp = torch.zeros(1, 2, dtype=D)
    with pytest.raises(ValueError, match="beta != 0 needs ref_logp"):
        grpo_loss(logp, logp, torch.ones(1, dtype=D), torch.ones(1, 2), beta=0.1)


# --- the trainer for real: TRL's GRPOTrainer loop on a tiny HybridForCausalLM (fp32, CPU)

PROMPTS = ["the cat", "a dog"]


def _reward_mid_vocab(prompts, completions, completion_ids, **kwargs):
    """Rule-based reward: 1 if the completion holds a token with id in [8, 60) (ids 0-7 are special tokens)."""
    return [1.0 if any(8 <= t < 60 for t in ids) else 0.0 for ids in completion_ids]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    """A byte-level BPE tokenizer (the project's pipeline, vocab 300) and a 2-layer tiny model saved to disk."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from data.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, build_tokenizer
    from model.modeling import HybridForCausalLM
    from model.sizes import config_for

    tok = build_tokenizer()
    tok.train_from_iterator(["the cat sat on the mat. the dog ate the bone. a bird sang a song."] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIAL_TOKENS),
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                        pad_token=PAD_TOKEN)
    torch.manual_seed(0)
    cfg = config_for("tiny", vocab_size=len(tokenizer), num_hidden_layers=2, attention_pattern=["lightning", "softmax"],
                     lightning_block_size=16, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=tokenizer.bos_token_id)
    path = tmp_path_factory.mktemp("grpo") / "init"
    HybridForCausalLM(cfg).save_pretrained(path)
    return tokenizer, path


def _config(tokenizer, out, **kw):
    from posttrain.grpo_trainer import HylightGRPOConfig

    # an EOS bias at sampling time (a transformers generation option) gives completions of different lengths,
    # which the balanced advantages (c) weigh
    base = dict(output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=3,
                logging_steps=1, learning_rate=1e-2, num_iterations=2, seed=0,
                generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 4.0]]})
    return HylightGRPOConfig(**{**base, **kw})


@pytest.mark.slow
def test_train_grpo_logs_the_interface_metrics_and_moves_the_weights(tiny_policy, tmp_path):
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from posttrain.grpo_trainer import INTERFACE_METRICS, train_grpo

    tokenizer, path = tiny_policy
    seen = []

    class Record(TrainerCallback):  # what an MLflow callback would receive
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs or {}))

    from model.modeling import HybridForCausalLM

    result = train_grpo(HybridForCausalLM.from_pretrained(path), tokenizer, PROMPTS, [_reward_mid_vocab],
                        _config(tokenizer, tmp_path / "out"), tmp_path, callbacks=[Record()])
    assert result["steps"] == 3
    for name in INTERFACE_METRICS:
        assert any(name in logs for logs in seen), name
        assert all(math.isfinite(v) for v in result["history"][name]), (name, result["history"][name])
    h = result["history"]
    assert len(h["reward_mean"]) == 2 and len(h["clip_fraction"]) == 3  # rollouts at steps 1, 3; a loss every step
    assert all(0.0 <= v <= 1.0 for v in h["reward_mean"] + h["clip_fraction"])
    assert all(1.0 <= v <= 8.0 for v in h["response_length"])
    assert h["kl"][0] == 0.0 and h["kl"][1] > 0.0  # the policy starts as the reference, then leaves it
    assert h["clip_fraction"][0] == 0.0 and h["clip_fraction"][1] > 0.0  # step 2 reuses step 1's rollout: r != 1
    before = load_file(tmp_path / "initial_policy" / "model.safetensors")
    after = load_file(tmp_path / "policy" / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2, changed


@pytest.mark.slow
def test_each_switch_changes_its_term_on_one_real_batch(tiny_policy, tmp_path):
    from trl import GRPOTrainer

    from posttrain.grpo_trainer import HylightGRPOTrainer

    tokenizer, path = tiny_policy
    from datasets import Dataset

    tr = HylightGRPOTrainer(model=str(path), reward_funcs=[_reward_mid_vocab], args=_config(tokenizer, tmp_path),
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which this test steps around
    batch = [{"prompt": p} for p in PROMPTS for _ in range(4)]

    # (c): the same rollout (same seed) scored by TRL alone and by the subclass
    torch.manual_seed(1)
    plain = GRPOTrainer._generate_and_score_completions(tr, batch)
    rewards = torch.tensor(list(tr._logs["rewards"]["_reward_mid_vocab"])[-8:])
    torch.manual_seed(1)
    bal = tr._generate_and_score_completions(batch)
    assert torch.equal(plain["completion_ids"], bal["completion_ids"])
    lengths = bal["completion_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1 and 0 < rewards.sum() < 8, (lengths, rewards)
    torch.testing.assert_close(plain["advantages"], group_normalized_advantages(rewards, 4))  # TRL = GRPO reference
    torch.testing.assert_close(bal["advantages"], balanced_advantages(plain["advantages"], lengths, 4))
    assert not torch.allclose(bal["advantages"], plain["advantages"])
    # on policy (r = 1) the policy loss is -Σ A_i·n_i / N: not zero for TRL's advantages, zero once balanced
    tr._compute_loss(tr.model, plain)
    tr._compute_loss(tr.model, bal)
    pl_plain, pl_bal = tr._metrics["train"]["policy_loss"][-2:]
    expected = -(plain["advantages"] * lengths).sum().item() / lengths.sum().item()
    assert pl_plain == pytest.approx(expected, abs=1e-5) and abs(expected) > 0.05
    assert pl_bal == pytest.approx(0.0, abs=1e-5)

    # A stale policy, as a later minibatch of one rollout sees it: one Adam step on another rollout
    opt = torch.optim.Adam(tr.model.parameters(), lr=1e-2)
    torch.manual_seed(2)
    other = tr._generate_and_score_completions([{"prompt": p} for p in ("the bird", "a song") for _ in range(4)])
    tr._compute_loss(tr.model, other).backward()
    opt.step()
    with torch.no_grad():
        ids = torch.cat([bal["prompt_ids"], bal["completion_ids"]], 1)
        mask = bal["completion_mask"]
        logp = tr._get_per_token_logps_and_entropies(
            tr.model, ids, torch.cat([bal["prompt_mask"], mask], 1), mask.size(1))[0]
    old, ref, adv = bal["old_per_token_logps"], bal["ref_per_token_logps"], bal["advantages"]
    ratio = torch.exp(logp - old)
    assert (((adv[:, None] < 0) & (ratio > 1.2)) * mask).sum() > 0  # tokens (a) is about

    def loss(**switches):  # the trainer's loss on `bal` with some switches changed, and its logged metrics
        saved = {k: getattr(tr.args, k) for k in switches}
        for k, v in switches.items():
            setattr(tr.args, k, v)
        with torch.no_grad():
            value = tr._compute_loss(tr.model, bal).item()
        for k, v in saved.items():
            setattr(tr.args, k, v)
        return value, {k: v[-1] for k, v in tr._metrics["train"].items()}

    def reference(**kw):  # grpo_loss on the same tensors (aux loss left out: it cancels in differences)
        args = dict(epsilon_low=0.2, epsilon_high=0.2, ratio_max_negative=1.2, ref_logp=ref, beta=0.04,
                    normalizer=mask.sum())
        return grpo_loss(logp, old, adv, mask, **{**args, **kw})

    on, m_on = loss()
    off, m_off = loss(clip_large_ratio_negative_advantage=False)
    assert on - off == pytest.approx((reference().loss - reference(ratio_max_negative=None).loss).item(), abs=1e-5)
    assert on != pytest.approx(off, abs=1e-4) and m_on["clip_fraction"] > m_off["clip_fraction"]
    k3, m_k3 = loss(kl_estimator="k3")
    assert on - k3 == pytest.approx((reference().loss - reference(kl_estimator="k3").loss).item(), abs=1e-5)
    assert on != pytest.approx(k3, abs=1e-4) and m_on["kl"] == m_k3["kl"] > 0.0  # `kl` is k3 either way
    tr.loss_type, tr.epsilon_high = "cispo", 5.0  # what loss_type="cispo", epsilon_high=5 set at construction
    cispo, _ = loss()
    expected = (reference(objective="cispo", cispo_ratio_max=5.0, ratio_max_negative=6.0).loss
                - reference().loss).item()
    assert cispo - on == pytest.approx(expected, abs=1e-5) and abs(expected) > 1e-3


@pytest.mark.slow
def test_select_prompts_by_pass_rate_keeps_moderate_prompts_and_counts_the_dropped(tiny_policy):
    from model.modeling import HybridForCausalLM
    from posttrain.grpo_trainer import select_prompts_by_pass_rate

    tokenizer, path = tiny_policy
    model = HybridForCausalLM.from_pretrained(path)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    calls = []

    def reward(prompts, completions, completion_ids, **kwargs):
        # "the cat" always passes, "a dog" never does, "the bird" passes on a mid-vocab token (the tiny model's luck)
        assert len(prompts) == len(completions) == len(completion_ids)
        for ids in completion_ids:  # cut after the first EOS, no padding
            assert pad not in ids and (eos not in ids or ids.index(eos) == len(ids) - 1)
        mid = _reward_mid_vocab(prompts, completions, completion_ids)
        values = [{"the cat": 1.0, "a dog": 0.0}.get(p, m) for p, m in zip(prompts, mid, strict=True)]
        calls.append(list(zip(prompts, values, strict=True)))
        return values

    prompts = ["the cat", "a dog", "the bird", "a song"]
    sel = select_prompts_by_pass_rate(model, tokenizer, prompts, [reward], k=8, lo=0.1, hi=0.9, max_new_tokens=8,
                                      batch_size=3)  # two batches: 3 + 1 prompts
    # one reward call a batch, each prompt's k samples together and in prompt order
    assert [[p for p, _ in call] for call in calls] == [[p for p in prompts[:3] for _ in range(8)], [prompts[3]] * 8]
    by_prompt: dict[str, list[float]] = {}
    for p, v in (pv for call in calls for pv in call):
        by_prompt.setdefault(p, []).append(v)
    assert sel.pass_rates == [sum(by_prompt[p]) / 8 for p in prompts]
    assert sel.pass_rates[:2] == [1.0, 0.0] and sel.dropped_too_easy >= 1 and sel.dropped_too_hard >= 1
    assert sel.kept == [p for p, r in zip(prompts, sel.pass_rates, strict=True) if 0.1 <= r <= 0.9]
    assert sel.dropped_too_easy + sel.dropped_too_hard + len(sel.kept) == 4
    assert sel.generate_seconds > 0 and sel.reward_seconds > 0  # where the selection's time went
    assert 0.1 <= sel.pass_rates[2] <= 0.9, sel.pass_rates  # the tiny model passes "the bird" now and then
    with pytest.raises(ValueError, match="lo <= hi"):
        select_prompts_by_pass_rate(model, tokenizer, prompts, [reward], lo=0.8, hi=0.2)


@pytest.mark.parametrize("advantage", [-1.0, 0.0, 1.0])
@pytest.mark.parametrize("options", [{}, {"ratio_max_negative": 3.0}, {"objective": "cispo"},
                                     {"beta": 0.1, "kl_estimator": "k3"}])
def test_a_log_ratio_past_float32_exp_range_gives_a_finite_loss_and_gradient(advantage, options):
    """log π_θ - log π_old of 100 (kept) and 198 (masked): exp overflows float32 past ~88; neither the loss nor the
    gradient may become inf or NaN, and the masked token adds nothing."""
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-100.0, -1.5, -200.0]])
    mask = torch.tensor([[1, 1, 0]])
    ref = torch.tensor([[-0.5, -1.0, -2.0]]) if options.get("beta") else None
    out = grpo_loss(logp, old, torch.tensor([advantage]), mask, ref_logp=ref, **options)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert grad[0, 2] == 0  # the masked token
    # the in-range token's value is what it was without the cap
    plain = grpo_loss(logp[:, 1:2], old[:, 1:2], torch.tensor([advantage]), mask[:, 1:2],
                      ref_logp=None if ref is None else ref[:, 1:2], **options)
    assert torch.isfinite(plain.loss)


def test_trls_importance_weighted_kl_is_off_and_refused_rather_than_ignored(tmp_path):
    """TRL 1.x turns use_bias_correction_kl on by default; this loss does not weight its KL term by the IS ratio,
    so the config defaults it off and refuses it on (with a KL term), instead of ignoring it silently."""
    from posttrain.grpo_trainer import HylightGRPOConfig

    assert HylightGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none").use_bias_correction_kl is False
    for estimator in ("k3", "stop_gradient"):
        with pytest.raises(ValueError, match="use_bias_correction_kl=True"):
            HylightGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", beta=0.04,
                              kl_estimator=estimator, use_bias_correction_kl=True)
    HylightGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", beta=0.0, use_bias_correction_kl=True)
