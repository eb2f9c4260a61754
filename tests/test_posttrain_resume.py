"""A TRL post-training stage killed after its final-step checkpoint and before its commit (issue 23, item 8): the
rerun loads that checkpoint, trains no step past max_steps, and ends with the uninterrupted run's weights.

The kill is the latest one the runner can see: the stage body returned but the artifact was never committed, so the
resume directory keeps every checkpoint (the runner deletes it only on commit). At the stage level that is one
uninterrupted run; the rerun gets the same resume_dir and a fresh output directory, as `hylight run` gives it
(tests/test_pretrain.py's and tests/test_long_context.py's reruns do the same). Each stage's max_steps ends inside an
epoch (one pair, example or prompt group per step), so transformers' fast-forward lands in an unfinished epoch: the
case that trained one step too many.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.stage import Artifact, StageContext
from tests.fault_harness import TIMING_KEYS
from tests.posttrain_fixtures import PosttrainInputs, build_posttrain_inputs
from tests.test_dpo import _random_head_reward_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[PosttrainInputs, Artifact]:
    root = tmp_path_factory.mktemp("resume_inputs")
    inputs = build_posttrain_inputs(root, documents=40)
    (inputs.checkpoint / "packing.json").write_text('{"seq_len": 256}')
    return inputs, _random_head_reward_model(inputs, root / "rm")


@dataclass
class Rerun:
    first: StageContext
    again: StageContext
    log: str  # the rerun's progress lines


def _run_then_rerun(run: Any, params: Any, tiny: tuple[PosttrainInputs, Artifact], root: Path, stage: str,
                    capfd: pytest.CaptureFixture[str]) -> Rerun:
    inputs, rm = tiny
    arts = {"checkpoint": inputs.checkpoint_artifact(), "prompts": inputs.prompts_artifact(), "reward_model": rm}
    first = StageContext(root / "out", arts, stage_name=stage, resume_dir=root / "resume")
    run(params, first)
    assert (root / "resume" / "trainer" / f"checkpoint-{params.max_steps}" / "trainer_state.json").is_file()
    capfd.readouterr()
    again = StageContext(root / "out2", arts, stage_name=stage, resume_dir=root / "resume")
    run(params, again)
    return Rerun(first, again, capfd.readouterr().err)


def _summary_steps(ctx: StageContext) -> int:
    return int(ctx.summary["steps"])


def _assert_resumed_at_the_end(rerun: Rerun, max_steps: int, weights: str = "model/model.safetensors",
                               steps: Callable[[StageContext], int] = _summary_steps) -> None:
    assert f"resuming training from checkpoint-{max_steps} (step {max_steps})" in rerun.log, rerun.log[-3000:]
    trained = [int(s) for s in re.findall(r"\] step (\d+)/\d+:", rerun.log)]
    assert trained == [], f"the rerun trained steps {trained} of {max_steps}"
    assert [s for k, _, s in rerun.again.sink.metrics if k == "loss" and s is not None] == []  # None: the summary
    assert steps(rerun.again) == max_steps
    # the summary (final loss, held-out metrics) is the uninterrupted run's, wall-clock fields aside
    differing = {k for k in rerun.first.summary if rerun.first.summary[k] != rerun.again.summary.get(k)
                 and k not in TIMING_KEYS and not k.endswith(("_seconds", "_per_second"))}
    assert differing == set(), {k: (rerun.first.summary[k], rerun.again.summary.get(k)) for k in differing}
    ours, ref = load_file(rerun.again.out_dir / weights), load_file(rerun.first.out_dir / weights)
    assert sorted(ours) == sorted(ref)
    assert [k for k in ref if not torch.equal(ours[k], ref[k])] == []


@pytest.mark.slow
def test_dpo_killed_after_its_final_checkpoint_loads_it_and_trains_no_further_step(tiny, tmp_path, capfd) -> None:
    from posttrain.dpo import DPOParams, run

    params = DPOParams(max_prompts=16, max_new_tokens=16, max_steps=4, checkpoint_every=2, eval_every=2,
                       batch_pairs=1, learning_rate=1e-4, eval_prompts=8, eval_max_new_tokens=12)
    _assert_resumed_at_the_end(_run_then_rerun(run, params, tiny, tmp_path, "dpo_long", capfd), params.max_steps)


@pytest.mark.slow
def test_grpo_killed_after_its_final_checkpoint_loads_it_and_trains_no_further_step(tiny, tmp_path, capfd) -> None:
    from posttrain.grpo import GRPOParams, run

    params = GRPOParams(max_prompts=8, eval_prompts=8, keep_unsolved=True, min_prompts=8, max_steps=4,
                        checkpoint_every=2, num_iterations=2, learning_rate=1e-3)
    _assert_resumed_at_the_end(_run_then_rerun(run, params, tiny, tmp_path, "grpo", capfd), params.max_steps)


@pytest.mark.slow
def test_sft_killed_after_its_final_checkpoint_loads_it_and_trains_no_further_step(tiny, tmp_path, capfd) -> None:
    from posttrain.sft import SFTParams, run

    params = SFTParams(temperatures=[0.7], samples_per_temperature=2, max_new_tokens=16, max_prompts=14,
                       require_finished=False, reference_fallback=True, max_steps=2, checkpoint_every=2, batch_size=1,
                       learning_rate=1e-3, eval_prompts=6, eval_max_new_tokens=12, max_length=128)
    _assert_resumed_at_the_end(_run_then_rerun(run, params, tiny, tmp_path, "sft_short", capfd), params.max_steps)


@pytest.mark.slow
def test_reward_model_killed_after_its_final_checkpoint_loads_it_and_trains_no_further_step(tiny, tmp_path,
                                                                                           capfd) -> None:
    from data.reward_scoring import REWARD_MODEL_DIR
    from posttrain.reward_model import REPORT_FILE, RewardModelParams, run

    params = RewardModelParams(max_steps=2, checkpoint_every=1, batch_pairs=1, max_length=192, eval_every=2)
    rerun = _run_then_rerun(run, params, tiny, tmp_path, "reward_model", capfd)
    _assert_resumed_at_the_end(rerun, params.max_steps, f"{REWARD_MODEL_DIR}/model.safetensors",
                               lambda ctx: json.loads((ctx.out_dir / REPORT_FILE).read_text())["steps"])
