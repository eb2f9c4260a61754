"""posttrain.grpo (stage ``grpo``, §5.4.2): the TRL reward function is the §5.2 hierarchy's total with the components'
means logged; prompt selection keeps moderate pass rates and either fails with the counts or keeps unsolved prompts
when told to; the stage end to end on the tiny fixture (with a reward model from the reward_model stage) logs every
interface metric at its steps, accounts for every prompt and writes a checkpoint that loads as a policy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posttrain.grpo import GRPOParams, HierarchyReward, resolve_selection
from posttrain.rewards import RewardHierarchy, RewardWeights
from posttrain.verifiable import ANSWER_INSTRUCTION

RECORD = {"id": "r1", "prompt": f"Compute 40 + 2. {ANSWER_INSTRUCTION}", "checker": "exact_number",
          "reference": {"answer": "42"}}


class FixedScores:
    """A reward-model stand-in with known scores (the hierarchy's ``scorer`` interface), for hand values."""

    def __init__(self, scores: list[float]) -> None:
        self.scores = scores

    def score(self, prompts, responses):  # noqa: ANN001, ANN201
        return self.scores[:len(responses)]


def test_hierarchy_reward_returns_the_totals_and_logs_component_means_by_hand() -> None:
    logged: dict[str, float] = {}
    reward = HierarchyReward([RECORD], RewardHierarchy(RewardWeights()))
    completions = ["Answer: 42", "Answer: 41", "41"]
    totals = reward(prompts=[RECORD["prompt"]] * 3, completions=completions, completion_ids=None,
                    log_metric=logged.__setitem__)
    # correct: 8 * (1 + 1)/2 + 1 * (4 rules... here 3 apply: length, format, script; all pass) = 9
    # wrong number, right format: 8 * 0 + 1 = 1
    # "41": no Answer line (format fails), no letters (script rule does not apply): rules {length, format} = 1/2
    assert totals == pytest.approx([9.0, 1.0, 0.5])
    assert logged == pytest.approx({"reward_correctness": 1 / 3, "reward_constraints": (1 + 1 + 0.5) / 3})
    # TRL's conversational form (prompt and completion as message lists) gives the same totals
    chat_totals = reward(prompts=[[{"role": "user", "content": RECORD["prompt"]}]] * 3,
                         completions=[[{"role": "assistant", "content": c}] for c in completions])
    assert chat_totals == pytest.approx(totals)


def test_hierarchy_reward_adds_the_squashed_reward_model_score_and_logs_its_mean() -> None:
    logged: dict[str, float] = {}
    reward = HierarchyReward([RECORD], RewardHierarchy(RewardWeights(), scorer=FixedScores([2.0, -1.0])))
    totals = reward(prompts=[RECORD["prompt"]] * 2, completions=["Answer: 42", "Answer: 41"],
                    log_metric=logged.__setitem__)
    assert totals == pytest.approx([9.0 + math.tanh(2.0), 1.0 + math.tanh(-1.0)])
    assert logged["reward_rm"] == pytest.approx(0.5)  # the raw scores' mean: (2 - 1) / 2


def test_hierarchy_reward_refuses_an_unknown_prompt_and_duplicate_records() -> None:
    reward = HierarchyReward([RECORD], RewardHierarchy())
    with pytest.raises(KeyError, match="no record"):
        reward(prompts=["What is 1 + 1?"], completions=["2"])
    with pytest.raises(ValueError, match="share one prompt text"):
        HierarchyReward([RECORD, dict(RECORD, id="r2")], RewardHierarchy())


RECS = [{"id": f"p{i}"} for i in range(4)]


def test_selection_keeps_moderate_pass_rates_and_counts_the_rest() -> None:
    kept, counts = resolve_selection(RECS, [0.0, 0.5, 1.0, 0.25], 0.1, 0.9, min_prompts=2, keep_unsolved=False)
    assert [r["id"] for r in kept] == ["p1", "p3"]
    assert counts == {"selected": 2, "too_easy": 1, "too_hard": 1, "kept_unsolved": 0}


def test_selection_below_min_prompts_fails_with_the_counts_unless_keep_unsolved() -> None:
    with pytest.raises(ValueError, match=r"1 of 4 prompts .*too easy: 1, too hard: 2.*keep_unsolved"):
        resolve_selection(RECS, [0.0, 0.5, 1.0, 0.0], 0.1, 0.9, min_prompts=2, keep_unsolved=False)
    kept, counts = resolve_selection(RECS, [0.0, 0.5, 1.0, 0.0], 0.1, 0.9, min_prompts=2, keep_unsolved=True)
    assert [r["id"] for r in kept] == ["p1", "p0"]  # selected first, then unsolved ones up to min_prompts only
    assert counts == {"selected": 1, "too_easy": 1, "too_hard": 1, "kept_unsolved": 1}
    kept, counts = resolve_selection(RECS, [0.0, 0.5, 1.0, 0.0], 0.1, 0.9, min_prompts=3, keep_unsolved=True)
    assert [r["id"] for r in kept] == ["p1", "p0", "p3"]
    assert counts == {"selected": 1, "too_easy": 1, "too_hard": 0, "kept_unsolved": 2}
    # enough selected: no unsolved prompt is added, keep_unsolved or not
    kept, counts = resolve_selection(RECS, [0.0, 0.5, 1.0, 0.25], 0.1, 0.9, min_prompts=2, keep_unsolved=True)
    assert [r["id"] for r in kept] == ["p1", "p3"] and counts["kept_unsolved"] == 0
    # the too-easy ones are never added back: still too few -> the error
    with pytest.raises(ValueError, match="fewer than min_prompts=4"):
        resolve_selection(RECS, [0.0, 0.5, 1.0, 0.0], 0.1, 0.9, min_prompts=4, keep_unsolved=True)


def test_params_refuse_an_inverted_band_and_a_cispo_cap_below_one() -> None:
    with pytest.raises(ValueError, match="pass_rate_lo"):
        GRPOParams(pass_rate_lo=0.8, pass_rate_hi=0.2)
    with pytest.raises(ValueError, match="absolute cap"):
        GRPOParams(loss_type="cispo", epsilon_high=0.3)


# --- the stage end to end ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    from pipeline.stage import Artifact, StageContext
    from posttrain.grpo import run
    from posttrain.reward_model import RewardModelParams
    from posttrain.reward_model import run as run_rm
    from tests.posttrain_fixtures import build_posttrain_inputs

    root = tmp_path_factory.mktemp("rl")
    tiny = build_posttrain_inputs(root, documents=40)
    rm_ctx = StageContext(root / "rm", {"checkpoint": tiny.checkpoint_artifact(), "prompts": tiny.prompts_artifact()},
                          stage_name="reward_model")
    run_rm(RewardModelParams(max_steps=2, batch_pairs=4, max_length=192, eval_every=2), rm_ctx)
    ctx = StageContext(root / "grpo", {"checkpoint": tiny.checkpoint_artifact(), "prompts": tiny.prompts_artifact(),
                                       "reward_model": Artifact(rm_ctx.out_dir, {"type": "reward_model",
                                                                                 "digest": "rm"})},
                       stage_name="grpo")
    params = GRPOParams(max_prompts=8, eval_prompts=8, keep_unsolved=True, min_prompts=8, max_steps=4,
                        num_iterations=2, learning_rate=1e-3)
    run(params, ctx)
    return tiny, ctx, params


def _steps(ctx, name: str) -> dict[int, float]:
    return {s: v for k, v, s in ctx.sink.metrics if k == name and s is not None}


@pytest.mark.slow
def test_stage_logs_each_interface_metric_at_its_steps_with_finite_values(trained) -> None:
    _, ctx, params = trained
    every_step = list(range(1, params.max_steps + 1))
    rollout_steps = list(range(1, params.max_steps + 1, params.num_iterations))  # a rollout per num_iterations
    for name in ("loss", "kl", "clip_fraction"):
        assert sorted(_steps(ctx, name)) == every_step, name
    for name in ("reward_mean", "response_length", "generation_tokens_per_second", "reward_correctness",
                 "reward_constraints", "reward_rm"):
        assert sorted(_steps(ctx, name)) == rollout_steps, name
    assert sorted(_steps(ctx, "eval_pass_rate")) == [0, params.max_steps]
    assert all(math.isfinite(v) for k, v, _ in ctx.sink.metrics)
    assert all(v > 0 for v in _steps(ctx, "generation_tokens_per_second").values())
    assert all(1 <= v <= params.max_completion_length for v in _steps(ctx, "response_length").values())
    # the first step is on the reference policy (kl 0); the reused rollout's step has moved (lr 1e-3, RM rewards)
    assert _steps(ctx, "kl")[1] == 0.0 and _steps(ctx, "kl")[2] > 0.0
    assert 0.0 <= min(_steps(ctx, "eval_pass_rate").values()) <= 1.0


@pytest.mark.slow
def test_stage_accounts_for_every_prompt_and_writes_a_loadable_policy(trained, tmp_path: Path) -> None:
    import torch

    from posttrain.policy import load_policy

    tiny, ctx, params = trained
    report = json.loads((ctx.out_dir / "rl_report.json").read_text())
    pool = sum(1 for _ in open(tiny.prompts / "pools" / "rl.jsonl"))
    sel, dropped = report["prompts"]["selection"], report["prompts"]["dropped_before_selection"]
    assert sum(sel.values()) == params.max_prompts and sum(sel.values()) + sum(dropped.values()) == pool
    assert dropped["over_max_prompts"] == pool - params.max_prompts
    assert len(report["prompts"]["trained_on"]) == sel["selected"] + sel["kept_unsolved"]
    assert report["steps"] == params.max_steps
    assert (ctx.out_dir / "plots" / "rl_curves.png").stat().st_size > 0
    trained_model, tok = load_policy(ctx.out_dir)
    base, _ = load_policy(tiny.checkpoint)
    moved = sum(not torch.equal(a, b) for a, b in zip(trained_model.parameters(), base.parameters(), strict=True))
    assert moved > 0
    assert (ctx.out_dir / "minimax" / "config.json").is_file()
