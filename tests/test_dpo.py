"""posttrain.dpo: best/worst pair selection and its skips, the held-out split, the implicit-reward accuracy by hand,
sequence log-probs that do not depend on the batch under the dropless policy (and do under token drop), and the stage
end to end on the tiny fixture (§5.4.1, Table 7 stages III/IV)."""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from pipeline.stage import Artifact, StageContext
from posttrain.dpo import (
    SKIP_REASONS,
    DPOParams,
    completion_logps,
    encode_pair_side,
    is_heldout,
    preference_accuracy,
    sample_by_length,
    select_pair,
)
from posttrain.policy import load_policy
from posttrain.rewards import RewardComponents
from tests.posttrain_fixtures import PosttrainInputs, build_posttrain_inputs


def _rc(total: float) -> RewardComponents:
    return RewardComponents(None, None, None, None, total=total)


# --- pair selection -----------------------------------------------------------------------------------------------
def test_pair_is_best_total_vs_worst_total_first_on_ties() -> None:
    texts = ["a", "b", "c", "d", "e"]
    choice = select_pair(texts, [_rc(t) for t in (1.0, 3.0, -2.0, 3.0, -2.0)], min_margin=0.0)
    assert (choice.chosen, choice.rejected, choice.skip) == (1, 2, None)  # first of the tied best / tied worst
    choice = select_pair(["x", "y"], [_rc(0.2), _rc(0.7)], min_margin=0.0)
    assert (choice.chosen, choice.rejected) == (1, 0)


def test_pairs_within_min_margin_are_skipped_and_equal_totals_always() -> None:
    rewards = [_rc(1.0), _rc(1.4), _rc(1.2)]  # best - worst = 0.4
    assert select_pair(["a", "b", "c"], rewards, min_margin=0.5).skip == "margin_below_min"
    assert select_pair(["a", "b", "c"], rewards, min_margin=0.39).chosen == 1
    assert select_pair(["a", "b"], [_rc(2.0), _rc(2.0)], min_margin=0.0).skip == "margin_below_min"


def test_identical_responses_make_no_pair() -> None:
    assert select_pair(["same"] * 4, [_rc(1.0)] * 4, min_margin=0.0).skip == "identical_responses"
    with pytest.raises(ValueError, match="2 responses and 1 rewards"):
        select_pair(["a", "b"], [_rc(1.0)], 0.0)
    assert set(SKIP_REASONS) >= {"identical_responses", "margin_below_min", "over_max_prompts"}


def test_length_filter_comes_before_the_max_prompts_sample() -> None:
    """Stage IV keeps long prompts only: max_prompts counts the prompts that pass the filter, so a pool where one
    prompt in five is long still yields max_prompts candidates (sampling first gave dpo_long one held-out pair)."""
    lengths = {f"p{i}": (300 if i % 5 == 0 else 40) for i in range(200)}
    lengths["p5"] = 5000  # too long for max_length
    records = [{"id": k} for k in lengths]
    seen: list[str] = []

    def tokens(rec: dict) -> int:
        seen.append(rec["id"])
        return lengths[rec["id"]]

    candidates, skipped = sample_by_length(records, tokens, max_prompts=20, min_tokens=256, max_length=4096)
    assert [r["id"] for r in candidates] == [f"p{i}" for i in range(0, 105, 5) if i != 5]  # the first 20 long ones
    reasons = Counter(s["reason"] for s in skipped)
    assert reasons == {"prompt_too_short": 80, "prompt_too_long": 1, "over_max_prompts": 99}
    assert sorted(r["id"] for r in candidates + skipped) == sorted(lengths)  # every prompt once
    assert seen[-1] == "p100"  # nothing past the 20th candidate is tokenized
    few, _ = sample_by_length(records, tokens, max_prompts=500, min_tokens=0, max_length=4096)
    assert len(few) == 199  # the pool is smaller than max_prompts: every prompt that fits


def test_heldout_split_is_deterministic_and_keeps_a_group_on_one_side() -> None:
    records = [{"id": f"p{i}", "task_type": "arithmetic"} for i in range(400)]
    # eight retrieval prompts over two passages: each passage's prompts share a side
    records += [{"id": f"r{i}", "task_type": "retrieval", "passage_source": {"id": f"doc{i % 2}"}} for i in range(8)]
    side = [is_heldout(r, seed=0, fraction=0.25) for r in records]
    assert side == [is_heldout(r, seed=0, fraction=0.25) for r in records]  # deterministic
    assert 0.18 < sum(side[:400]) / 400 < 0.32  # about the fraction
    assert len({side[400 + i] for i in range(0, 8, 2)}) == 1 and len({side[401 + i] for i in range(0, 8, 2)}) == 1
    assert side[:400] != [is_heldout(r, seed=1, fraction=0.25) for r in records[:400]]  # the seed matters


# --- the held-out accuracy by hand --------------------------------------------------------------------------------
def test_preference_accuracy_ranks_by_implicit_reward_with_ties_half() -> None:
    beta = 0.1
    # pair 1: chosen is LESS likely than rejected under π, but gained more over π_ref: implicit reward 0.2 vs 0 -> 1
    # pair 2: both unchanged from π_ref: rewards 0 and 0 -> tie, 1/2
    # pair 3: chosen lost 1 nat, rejected gained 0.5: -0.1 vs 0.05 -> 0
    # pair 4: both gained 1 nat: 0.1 vs 0.1 -> tie, 1/2
    chosen, rejected = [-12.0, -5.0, -4.0, -2.0], [-8.0, -6.0, -6.5, -3.0]
    ref_chosen, ref_rejected = [-14.0, -5.0, -3.0, -3.0], [-8.0, -6.0, -7.0, -4.0]
    assert preference_accuracy(beta, chosen, rejected, ref_chosen, ref_rejected) == pytest.approx(2 / 4)
    assert preference_accuracy(beta, chosen[:1], rejected[:1], ref_chosen[:1], ref_rejected[:1]) == 1.0
    # π = π_ref: every implicit reward is 0 -> exactly 0.5
    assert preference_accuracy(beta, chosen, rejected, chosen, rejected) == 0.5
    assert math.isnan(preference_accuracy(beta, [], [], [], []))


# --- log-probs under the dropless policy --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> PosttrainInputs:
    return build_posttrain_inputs(tmp_path_factory.mktemp("dpo"), documents=40)


@pytest.fixture(scope="module")
def policy(tiny: PosttrainInputs):
    return load_policy(tiny.checkpoint)


def _sides(tok) -> list[tuple[list[int], list[int]]]:
    return [encode_pair_side(tok, "Compute 12 + 30.", "The answer is 42."),
            encode_pair_side(tok, "Write one sentence about rivers and the sea, please, with detail.",
                             "Rivers carry water from the mountains down into the wide sea, slowly and surely."),
            encode_pair_side(tok, "Reverse 'cat'.", "tac"),
            encode_pair_side(tok, "Name three colours of the rainbow in order.", "Red, orange, yellow.")]


def test_completion_logps_is_the_sum_of_the_response_token_log_probs(policy) -> None:
    model, tok = policy
    prompt, completion = encode_pair_side(tok, "Compute 12 + 30.", "The answer is 42.")
    # the response, its end-of-turn and the template's newline after it (TRL's split: after the common prefix)
    assert tok.decode(completion) == "The answer is 42.<|end|>\n"
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    by_hand = sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion))
    assert completion_logps(model, [(prompt, completion)], tok.pad_token_id)[0] == pytest.approx(by_hand, abs=1e-4)
    cut = completion_logps(model, [(prompt, completion)], tok.pad_token_id, max_length=len(prompt) + 2)[0]
    assert cut == pytest.approx(sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion[:2])),
                                abs=1e-4)


def _batch_gap(model, tok) -> float:
    """Largest change of a sequence's log-prob between scoring it alone and in a right-padded batch of four."""
    sides = _sides(tok)
    alone = [completion_logps(model, [s], tok.pad_token_id)[0] for s in sides]
    batched = completion_logps(model, sides, tok.pad_token_id, batch_size=4)
    return max(abs(a - b) for a, b in zip(alone, batched, strict=True))


def test_log_probs_do_not_depend_on_the_batch_under_the_dropless_policy_but_do_with_token_drop(policy) -> None:
    model, tok = policy
    model.train()  # the mode TRL trains in: the MoE would drop tokens here if it could
    try:
        assert _batch_gap(model, tok) < 1e-4
        dropping = copy.deepcopy(model)
        for m in dropping.modules():
            if hasattr(m, "token_drop"):
                m.token_drop, m.capacity_factor = True, 0.5
        # capacity is computed over the batch's tokens: other sequences take slots this one's tokens needed
        assert _batch_gap(dropping, tok) > 1e-2
        dropping.eval()  # eval is dropless whatever the flag
        assert _batch_gap(dropping, tok) < 1e-4
    finally:
        model.eval()


# --- the stage end to end -----------------------------------------------------------------------------------------
def _random_head_reward_model(tiny: PosttrainInputs, root: Path) -> Artifact:
    """A reward_model artifact as the reward_model stage lays it out, with the checkpoint's backbone and an untrained
    score head: continuous scores, so the random policy's samples are ranked (the hierarchy's rules alone tie)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import model  # noqa: F401  (registers hylight_hybrid)

    torch.manual_seed(1)
    tok = AutoTokenizer.from_pretrained(tiny.checkpoint / "model")
    rm = AutoModelForSequenceClassification.from_pretrained(tiny.checkpoint / "model", num_labels=1)
    rm.config.pad_token_id = tok.pad_token_id
    rm.save_pretrained(root / "reward_model")
    tok.save_pretrained(root / "reward_model")
    return Artifact(root, {"type": "reward_model", "digest": "test-rm"})


@pytest.fixture(scope="module")
def trained(tiny: PosttrainInputs, tmp_path_factory: pytest.TempPathFactory) -> tuple[StageContext, DPOParams]:
    from posttrain.dpo import run

    (tiny.checkpoint / "packing.json").write_text(json.dumps({"seq_len": 256}))
    root = tmp_path_factory.mktemp("dpo_stage")
    ctx = StageContext(root / "out", {"checkpoint": tiny.checkpoint_artifact(), "prompts": tiny.prompts_artifact(),
                                      "reward_model": _random_head_reward_model(tiny, root / "rm")},
                       stage_name="dpo_short")
    params = DPOParams(max_prompts=16, max_new_tokens=16, max_steps=6, eval_every=3, batch_pairs=4,
                       learning_rate=1e-4, eval_prompts=8, eval_max_new_tokens=12)
    run(params, ctx)
    return ctx, params


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_stage_logs_the_interface_metrics_at_the_configured_steps(trained) -> None:
    ctx, params = trained
    by_name: dict[str, dict[int | None, float]] = {}
    for name, value, step in ctx.sink.metrics:
        by_name.setdefault(name, {})[step] = value
    assert sorted(s for s in by_name["loss"]) == list(range(1, params.max_steps + 1))
    assert sorted(by_name["train_preference_accuracy"]) == list(range(1, params.max_steps + 1))
    assert sorted(by_name["reward_margin"]) == list(range(1, params.max_steps + 1))
    # step 1 is scored before any update: π = π_ref exactly (both dropless), so TRL's margin is 0 and its
    # accuracy (ties count 0) is 0; the loss is log 2 plus the router aux loss
    assert by_name["reward_margin"][1] == 0.0 and by_name["train_preference_accuracy"][1] == 0.0
    assert by_name["loss"][1] == pytest.approx(math.log(2), abs=0.01)
    assert sorted(by_name["eval_preference_accuracy"]) == [0, 3, params.max_steps]
    assert by_name["eval_preference_accuracy"][0] == 0.5  # every implicit reward is 0, ties count 1/2
    assert sorted(by_name["eval_pass_rate"]) == [0, params.max_steps]
    assert 0 <= by_name["eval_pass_rate"][params.max_steps] <= 1
    assert by_name["generation_tokens_per_second"][None] > 0
    assert ctx.summary["steps"] == params.max_steps
    assert ctx.summary["eval_preference_accuracy"] == by_name["eval_preference_accuracy"][params.max_steps]
    assert (ctx.out_dir / "plots" / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_stage_accounts_for_every_dpo_prompt_and_splits_pairs_by_prompt(trained, tiny) -> None:
    ctx, params = trained
    pool = _jsonl(tiny.prompts / "pools" / "dpo.jsonl")
    train, held = _jsonl(ctx.out_dir / "pairs" / "train.jsonl"), _jsonl(ctx.out_dir / "pairs" / "heldout.jsonl")
    skipped = _jsonl(ctx.out_dir / "pairs" / "skipped.jsonl")
    ids = [r["id"] for r in train + held + skipped]
    assert sorted(ids) == sorted(r["id"] for r in pool)  # each prompt once: a pair or a counted skip
    # max_prompts prompts that pass the length filters were sampled: each made a pair or was skipped after sampling
    sampled = [s for s in skipped if s["reason"] in ("identical_responses", "margin_below_min")]
    assert len(train) + len(held) + len(sampled) == params.max_prompts
    assert ctx.sink.last("dpo_pairs") == len(train) + len(held) > 0
    for reason in SKIP_REASONS:
        assert ctx.sink.last(f"skipped.{reason}") == sum(s["reason"] == reason for s in skipped)
    by_id = {r["id"]: r for r in pool}
    assert all(not is_heldout(by_id[p["id"]], params.seed, params.heldout_fraction) for p in train)
    assert all(is_heldout(by_id[p["id"]], params.seed, params.heldout_fraction) for p in held)
    for p in train + held:
        assert p["chosen_reward"]["total"] - p["rejected_reward"]["total"] == pytest.approx(p["margin"])
        assert p["margin"] > params.min_margin and p["chosen"] != p["rejected"]
        assert p["chosen_temperature"] in params.temperatures and p["rejected_temperature"] in params.temperatures
    assert ctx.rows == {"train_pairs": len(train), "heldout_pairs": len(held)}


@pytest.mark.slow
def test_saved_policy_loads_moved_and_reproduces_the_reported_heldout_accuracy(trained, tiny, policy) -> None:
    ctx, params = trained
    model, tok = load_policy(ctx.out_dir)
    assert json.loads((ctx.out_dir / "packing.json").read_text()) == {"seq_len": 256}
    assert (ctx.out_dir / "minimax" / "config.json").is_file()
    base = policy[0].state_dict()
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, base[k])]
    assert len(moved) > 10  # the weights changed
    held = _jsonl(ctx.out_dir / "pairs" / "heldout.jsonl")
    sides_c = [encode_pair_side(tok, p["prompt"], p["chosen"]) for p in held]
    sides_r = [encode_pair_side(tok, p["prompt"], p["rejected"]) for p in held]
    lp = completion_logps(model, sides_c + sides_r, tok.pad_token_id, max_length=params.max_length)
    ref = completion_logps(policy[0], sides_c + sides_r, tok.pad_token_id, max_length=params.max_length)
    n = len(held)
    acc = preference_accuracy(params.beta, lp[:n], lp[n:], ref[:n], ref[n:])
    assert acc == pytest.approx(ctx.summary["eval_preference_accuracy"])
    report = json.loads((ctx.out_dir / "dpo_report.json").read_text())
    assert report["eval_preference_accuracy"] == {"before": 0.5, "after": pytest.approx(acc)}
    assert report["pairs"] == {"train": len(_jsonl(ctx.out_dir / "pairs" / "train.jsonl")), "heldout": n}
