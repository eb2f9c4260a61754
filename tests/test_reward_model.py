"""The reward model (report §5.2): the sequence-scoring head, the preference pairs, and the ``reward_model`` stage end
to end on a tiny checkpoint (a randomly initialised tiny HybridForCausalLM saved with a tokenizer trained by the
project's BPE pipeline — the layout pretrain's export writes — and a real prompts stage run)."""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest
import torch

import model  # noqa: F401  (registers the Auto classes)
from model import HybridForCausalLM, HybridForSequenceClassification, config_for
from pipeline.stage import Artifact, StageContext
from posttrain.preference_pairs import (
    NO_ANSWER_REPLY,
    build_pairs,
    code_mutations,
    continuations,
    degrade,
    pair_file_problems,
    reference_response,
    user_pairs,
)
from posttrain.verifiable import CODE_TEMPLATES, check, generate_verifiable
from tests.posttrain_fixtures import PosttrainInputs, build_posttrain_inputs


# --- the head -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[HybridForCausalLM, Path]:
    torch.manual_seed(0)
    lm = HybridForCausalLM(config_for("tiny", pad_token_id=0)).eval()
    path = tmp_path_factory.mktemp("lm")
    lm.save_pretrained(path)
    return lm, path


def test_score_head_loads_from_a_causal_lm_keeping_the_backbone(saved_lm) -> None:
    from transformers import AutoModelForSequenceClassification

    lm, path = saved_lm
    rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    assert isinstance(rm, HybridForSequenceClassification)
    lm_state, rm_state = lm.state_dict(), rm.state_dict()
    backbone = [k for k in rm_state if k.startswith("model.")]
    assert len(backbone) == len([k for k in lm_state if k.startswith("model.")])
    assert all(torch.equal(rm_state[k], lm_state[k]) for k in backbone)
    assert set(rm_state) - set(backbone) == {"score.weight"} and rm.score.weight.shape == (1, 64)
    # the new head is initialised (not zeros, not left empty): xavier-normal std sqrt(2 / (64 + 1)) ~ 0.175
    assert 0.05 < float(rm.score.weight.detach().std()) < 0.5


def test_left_and_right_padding_score_like_the_unpadded_sequence(saved_lm) -> None:
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(saved_lm[1], num_labels=1).eval()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(5, 500, (9,), generator=g), torch.randint(5, 500, (5,), generator=g)
    with torch.no_grad():
        alone = [float(rm(x[None]).logits) for x in (a, b)]
        right = torch.zeros(2, 9, dtype=torch.long)
        right[0], right[1, :5] = a, b
        right_mask = (torch.arange(9) < torch.tensor([[9], [5]])).long()
        left = torch.zeros(2, 9, dtype=torch.long)
        left[0], left[1, 4:] = a, b
        left_mask = (torch.arange(9) >= torch.tensor([[0], [4]])).long()
        by_right = rm(input_ids=right, attention_mask=right_mask).logits[:, 0].tolist()
        by_left = rm(input_ids=left, attention_mask=left_mask).logits[:, 0].tolist()
        by_pad_id = rm(input_ids=right).logits[:, 0].tolist()  # no mask: the last token that is not pad id 0
    assert by_right == pytest.approx(alone, abs=1e-5)
    assert by_left == pytest.approx(alone, abs=1e-5)
    assert by_pad_id == pytest.approx(alone, abs=1e-5)
    assert abs(alone[0] - alone[1]) > 1e-4  # different sequences, different scores: the test can fail


# --- pairs --------------------------------------------------------------------------------------------------------
def test_verifiable_pairs_are_judged_by_the_checkers_and_deterministic() -> None:
    recs = generate_verifiable(3, {"arithmetic": 12, "string": 12, "code": 4})
    one = build_pairs(recs, seed=5, heldout_fraction=0.3)
    two = build_pairs(recs, seed=5, heldout_fraction=0.3)
    assert one.pairs == two.pairs and len(one.pairs) == len(recs) and not one.skipped
    by_id = {r["id"]: r for r in recs}
    for p in one.pairs:
        rec = by_id[p.id.removeprefix("pair/")]
        assert check(rec, p.chosen).correct and not check(rec, p.rejected).correct
        assert p.chosen == reference_response(rec)
        if rec["checker"] == "python_tests":
            assert p.kind == "failing_code" and p.rejected.startswith("```python\n")
        else:
            assert p.kind in ("wrong_answer", "no_answer")
            assert p.rejected == NO_ANSWER_REPLY or p.rejected.startswith("Answer: ")
    assert {p.kind for p in one.pairs} == {"wrong_answer", "no_answer", "failing_code"}


def test_every_code_template_has_a_mutation_that_fails_its_tests() -> None:
    assert all(code_mutations(t.solution) for t in CODE_TEMPLATES)
    recs = generate_verifiable(0, {"code": 8})
    failing = [any(not check(r, f"```python\n{m}\n```").correct for _, m in code_mutations(r["reference"]["solution"]))
               for r in recs]
    assert all(failing)


def test_degradations_by_hand() -> None:
    text = "One is first. Two comes next. Three is here. Four ends it."
    rng = random.Random(0)
    shuffled = degrade(text, "shuffled", rng)
    assert sorted(shuffled.split()) == sorted(text.split()) and shuffled != text
    repeated = degrade(text, "repeated", rng)
    assert len(repeated.split()) == len(text.split()) and repeated.split()[0] == "One"
    loop = repeated.split()
    period = next(k for k in range(1, len(loop)) if loop[k] == "One")
    assert all(loop[i] == loop[i % period] for i in range(len(loop)))
    truncated = degrade(text, "truncated", rng)
    assert 3 <= len(truncated.split()) <= 7 and text.startswith(truncated)
    with pytest.raises(ValueError, match="unknown degradation"):
        degrade(text, "reversed", rng)


def test_user_pair_files_are_checked_with_file_and_line(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "Hi?", "chosen": "Hello! How can I help?", "rejected": "no"}) + "\n\n" +
                    json.dumps({"id": "x", "prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    pairs = user_pairs(good)
    assert [(p.id, p.source, p.kind) for p in pairs] == [("user/good.jsonl/1", "user", "user"), ("x", "user", "user")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" +
                   json.dumps({"prompt": "a", "chosen": "b"}) + "\n{oops\n" +
                   json.dumps({"prompt": "a", "chosen": "b", "rejected": "b"}) + "\n")
    problems = pair_file_problems([str(good), str(bad), str(tmp_path / "missing.jsonl")])
    assert problems == [
        ("user_pair_files.1", f"{bad}:2: needs a non-empty string field 'rejected'"),
        ("user_pair_files.1", f"{bad}:3: not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
        ("user_pair_files.1", f"{bad}:4: 'chosen' and 'rejected' are the same text: a pair needs two different "
                              "responses"),
        ("user_pair_files.2", f"pair file {str(tmp_path / 'missing.jsonl')!r} does not exist (resolved against {os.getcwd()})"),
    ]
    with pytest.raises(ValueError, match=f"{bad}:2: needs a non-empty string field 'rejected'"):
        user_pairs(bad)


def test_heldout_split_never_puts_one_group_on_both_sides() -> None:
    recs = generate_verifiable(1, {"arithmetic": 30, "code": 12})
    ps = build_pairs(recs, seed=2, heldout_fraction=0.4)
    sides: dict[str, set[str]] = {}
    for p in ps.pairs:
        sides.setdefault(p.group, set()).add(p.split)
    assert all(len(s) == 1 for s in sides.values())
    assert 0 < len(ps.split("heldout")) < len(ps.pairs)
    code_groups = {p.group for p in ps.pairs if p.kind == "failing_code"}
    assert len(code_groups) < 12  # code prompts of one template share a group


# --- the stage ----------------------------------------------------------------------------------------------------
Tiny = PosttrainInputs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return build_posttrain_inputs(tmp_path_factory.mktemp("reward"))


def test_continuations_are_the_document_text_right_after_the_excerpt(tiny: Tiny) -> None:
    recs = [json.loads(x) for x in (tiny.prompts / "pools" / "sft.jsonl").read_text().splitlines()]
    found = continuations(recs, tiny.inputs.documents.path, 25)
    assert found  # the fixture has continuation prompts whose documents go on
    from data.documents import iter_documents

    docs = {d["id"]: d["text"] for d in iter_documents(tiny.inputs.documents.path)}
    for rec in recs:
        if rec["id"] in found:
            excerpt = rec["prompt"].split("\n\n", 1)[1]
            assert " ".join(docs[rec["origin"]].split()).find(excerpt + " " + found[rec["id"]]) >= 0
            assert len(found[rec["id"]].split()) == 25


def _stage_params(user: Path) -> dict:
    return dict(max_steps=24, batch_pairs=8, max_length=256, eval_every=12, heldout_fraction=0.25,
                user_pair_files=[str(user)], continuation_words=30, checkpoint_every=10)


def _stage_inputs(tiny: Tiny) -> dict:
    return {"checkpoint": Artifact(tiny.checkpoint, {"type": "checkpoint", "digest": "t"}),
            "prompts": Artifact(tiny.prompts, {"type": "prompts", "digest": "t"}), "documents": tiny.inputs.documents}


@pytest.fixture(scope="module")
def trained(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> StageContext:
    from posttrain.reward_model import RewardModelParams, run

    root = tmp_path_factory.mktemp("rm")
    user = root / "pairs.jsonl"
    user.write_text("".join(json.dumps({"prompt": f"Say hello to {n}.", "chosen": f"Hello, {n}!",
                                        "rejected": "Goodbye."}) + "\n" for n in ("Ann", "Bo", "Cy", "Di")))
    ctx = StageContext(root / "out", _stage_inputs(tiny), stage_name="reward_model")
    run(RewardModelParams(**_stage_params(user)), ctx)
    return ctx


KILLED_ATTEMPT = """
import json, sys
from pathlib import Path
from pipeline.stage import Artifact, StageContext
from posttrain.reward_model import RewardModelParams, run
cfg = json.loads(sys.argv[1])
inputs = {k: Artifact(Path(v["path"]), v["manifest"]) for k, v in cfg["inputs"].items()}
ctx = StageContext(cfg["out"], inputs, stage_name="reward_model", resume_dir=cfg["resume"])
run(RewardModelParams(**cfg["params"]), ctx)
"""


@pytest.mark.slow
def test_a_killed_stage_resumes_from_its_trainer_checkpoint_and_ends_like_an_uninterrupted_run(
        tiny: Tiny, trained: StageContext, tmp_path: Path) -> None:
    """SIGKILL a reward_model attempt once its step-10 checkpoint is complete, rerun with the same resume dir (as
    `hylight run` does): the rerun trains only the steps after the checkpoint and ends with the same weights."""
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    from posttrain.reward_model import RewardModelParams, run

    user = Path(trained.out_dir).parent / "pairs.jsonl"  # the uninterrupted run's pair file and params
    params = _stage_params(user)
    resume = tmp_path / "resume"
    cfg = {"out": str(tmp_path / "out1"), "resume": str(resume), "params": params,
           "inputs": {k: {"path": str(a.path), "manifest": a.manifest} for k, a in _stage_inputs(tiny).items()}}
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", KILLED_ATTEMPT, json.dumps(cfg)], cwd=repo,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = resume / "trainer" / "checkpoint-10" / "trainer_state.json"
    deadline = time.monotonic() + 300
    try:
        while not first.exists():
            assert proc.poll() is None, f"the attempt ended before its step-10 checkpoint: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no step-10 checkpoint after 300 s"
            time.sleep(0.02)
        time.sleep(0.2)  # a partial later checkpoint is fine: the resume skips it
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    saved = sorted(int(d.name.split("-")[1]) for d in (resume / "trainer").glob("checkpoint-*")
                   if (d / "trainer_state.json").exists())
    assert saved and saved[-1] in (10, 20), saved

    ctx = StageContext(tmp_path / "out2", _stage_inputs(tiny), stage_name="reward_model", resume_dir=resume)
    run(RewardModelParams(**params), ctx)
    losses = [(s, v) for k, v, s in ctx.sink.metrics if k == "loss"]
    assert [s for s, _ in losses] == list(range(saved[-1] + 1, 25))  # only the steps after the checkpoint
    ref = {s: v for k, v, s in trained.sink.metrics if k == "loss"}
    for step, loss in losses:
        assert loss == pytest.approx(ref[step], rel=1e-6, abs=1e-7), step
    assert ctx.summary["eval_preference_accuracy"] == pytest.approx(trained.summary["eval_preference_accuracy"])
    ours = load_file(ctx.out_dir / "reward_model" / "model.safetensors")
    theirs = load_file(trained.out_dir / "reward_model" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert max(float((ours[k].double() - theirs[k].double()).abs().max()) for k in theirs) < 1e-6


@pytest.mark.slow
def test_stage_logs_loss_every_step_and_heldout_accuracy_before_during_and_after(trained: StageContext) -> None:
    steps = {name: [s for k, _, s in trained.sink.metrics if k == name] for name in ("loss", "eval_preference_accuracy")}
    assert steps["loss"] == list(range(1, 25))
    assert steps["eval_preference_accuracy"] == [0, 12, 24]
    accs = [v for k, v, _ in trained.sink.metrics if k == "eval_preference_accuracy"]
    assert all(0.0 <= a <= 1.0 for a in accs)
    assert trained.summary["eval_preference_accuracy"] == accs[-1]
    losses = [v for k, v, _ in trained.sink.metrics if k == "loss"]
    assert all(v == v and v > 0 for v in losses)  # finite Bradley-Terry losses
    # it trains: the last steps' loss is below the first steps' and below log 2 (a constant score's loss)
    assert sum(losses[-6:]) / 6 < min(sum(losses[:6]) / 6, 0.6931)


@pytest.mark.slow
def test_stage_report_counts_pairs_by_source_and_kind_and_matches_the_pair_files(trained: StageContext) -> None:
    out = trained.out_dir
    report = json.loads((out / "reward_report.json").read_text())
    for split in ("train", "heldout"):
        rows = [json.loads(x) for x in (out / "pairs" / f"{split}.jsonl").read_text().splitlines()]
        assert report["pairs"][split]["total"] == len(rows) == trained.rows[f"{split}_pairs"]
        assert all(r["split"] == split for r in rows)
        for source in ("verifiable", "corpus", "user"):
            assert report["pairs"][split].get(f"source.{source}", 0) == sum(r["source"] == source for r in rows)
    assert report["pairs"]["train"]["source.corpus"] > 0 and report["pairs"]["train"]["kind.failing_code"] > 0
    assert report["pairs"]["train"].get("source.user", 0) + report["pairs"]["heldout"].get("source.user", 0) == 4
    assert report["skipped_prompts"]["no_reference_response"] > 0  # open-ended prompts other than continuations
    base = report["accuracy"]["eval_preference_accuracy_longer_wins"]
    assert 0.0 <= base <= 1.0 and trained.summary["eval_preference_accuracy_longer_wins"] == base


@pytest.mark.slow
def test_saved_reward_model_loads_with_auto_and_reproduces_the_reported_accuracy(trained: StageContext) -> None:
    from transformers import AutoModelForSequenceClassification

    from data.reward_scoring import RewardModelScorer
    from posttrain.reward_model import pairwise_accuracy

    rm_dir = trained.out_dir / "reward_model"
    assert isinstance(AutoModelForSequenceClassification.from_pretrained(rm_dir), HybridForSequenceClassification)
    scorer = RewardModelScorer(rm_dir)
    rows = [json.loads(x) for x in (trained.out_dir / "pairs" / "heldout.jsonl").read_text().splitlines()]
    chosen = scorer.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = scorer.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert pairwise_accuracy(chosen, rejected) == pytest.approx(trained.summary["eval_preference_accuracy"])


@pytest.mark.slow
def test_the_reward_model_trains_and_scores_dropless(trained: StageContext) -> None:
    """A capacity drop would make a pair's scores depend on the rest of its batch; pretraining's checkpoint (the
    reward model's backbone) drops tokens by default."""
    from data.reward_scoring import RewardModelScorer

    rm_dir = trained.out_dir / "reward_model"
    assert json.loads((rm_dir / "config.json").read_text())["moe_token_drop"] is False
    config = json.loads((rm_dir / "config.json").read_text())
    (rm_dir / "config.json").write_text(json.dumps({**config, "moe_token_drop": True}))
    try:  # a reward model saved with dropping on still scores dropless
        scorer = RewardModelScorer(rm_dir)
    finally:
        (rm_dir / "config.json").write_text(json.dumps(config))
    flags = [m.token_drop for m in scorer.model.modules() if hasattr(m, "token_drop")]
    assert flags and not any(flags)


@pytest.mark.slow
def test_the_reward_hierarchy_puts_its_reward_model_on_the_device_it_is_given(trained: StageContext) -> None:
    """The post-training stages pass their policy's device (a GPU on a GPU machine): on the CPU, a gpu-300m
    reward model took ~2 minutes of SFT's selection on a 4-GPU lease. "meta" stands in for a device this CPU
    machine lacks; the default stays the CPU (the quality stage's labeler)."""
    from posttrain.rewards import RewardHierarchy

    rm_dir = trained.out_dir / "reward_model"
    assert {p.device.type for p in RewardHierarchy(reward_model_dir=rm_dir).scorer.model.parameters()} == {"cpu"}
    moved = RewardHierarchy(reward_model_dir=rm_dir, device="meta").scorer.model
    assert {p.device.type for p in moved.parameters()} == {"meta"}


@pytest.mark.slow
def test_the_reward_hierarchy_scores_the_end_of_a_long_chat(trained: StageContext) -> None:
    """A long-context prompt (the prompts stage's long_retrieval, ~7K tokens) is scored on its last RM_MAX_TOKENS
    tokens, the response's end included; a short one whole, as before the cap."""
    from posttrain.rewards import RM_MAX_TOKENS, RewardHierarchy

    scorer = RewardHierarchy(reward_model_dir=trained.out_dir / "reward_model").scorer
    short = scorer.encode("What is 6 * 7?", "Answer: 42")
    assert len(short) < RM_MAX_TOKENS and short == list(scorer.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "Answer: 42"}],
        tokenize=True, return_dict=True)["input_ids"])
    long = scorer.encode("word " * 6000 + "What is 6 * 7?", "Answer: 42")
    assert len(long) == RM_MAX_TOKENS and long[-len(short) // 2:] == short[-len(short) // 2:]


def test_the_reward_hierarchy_times_its_reward_model_and_its_checkers() -> None:
    from posttrain.rewards import RewardHierarchy
    from posttrain.verifiable import ANSWER_INSTRUCTION

    class SlowScores:
        """Sleeps 0.3 s on its first call, not at all after."""

        def __init__(self) -> None:
            self.delays = [0.3]

        def score(self, prompts: list[str], responses: list[str]) -> list[float]:
            time.sleep(self.delays.pop() if self.delays else 0.0)
            return [0.0] * len(prompts)

    record = {"id": "a1", "prompt": f"Compute 40 + 2. {ANSWER_INSTRUCTION}", "checker": "exact_number",
              "reference": {"answer": "42"}}
    h = RewardHierarchy(scorer=SlowScores())
    comps = h.score([record, record], ["Answer: 42", "Answer: 41"])
    assert [c.correct for c in comps] == [True, False]
    assert h.last_seconds["reward_model"] >= 0.3 and 0.0 <= h.last_seconds["checkers"] < h.last_seconds["reward_model"]
    assert re.fullmatch(r"reward_model \d+\.\d s, checkers \d+\.\d s", h.timing())
    h.score([record], ["Answer: 42"])  # each call's own seconds: a running total would still hold the 0.3 s
    assert h.last_seconds["reward_model"] < 0.3


def test_every_post_training_trainer_turns_off_trl_activation_checkpointing():
    """TRL's configs turn activation checkpointing on by default; its recomputation failed on an H100 in the reward
    model stage (MoE routing not bit-reproducible in bf16: 62 tensors saved in the forward, 59 in the recompute).
    Every post-training stage builds its TRL config with it off."""
    import inspect

    from trl import DPOConfig, GRPOConfig, RewardConfig, SFTConfig

    import posttrain.dpo
    import posttrain.grpo
    import posttrain.reward_model
    import posttrain.sft
    from posttrain.policy import NO_ACTIVATION_CHECKPOINTING

    assert NO_ACTIVATION_CHECKPOINTING is False
    for config in (DPOConfig, GRPOConfig, RewardConfig, SFTConfig):  # why the stages must say so
        assert config.__dataclass_fields__["gradient_checkpointing"].default is True, config.__name__
    for module in (posttrain.dpo, posttrain.reward_model, posttrain.grpo, posttrain.sft):
        source = inspect.getsource(module)
        assert "gradient_checkpointing=NO_ACTIVATION_CHECKPOINTING" in source, module.__name__
