"""Sequence parallelism in the training stages (param ``sequence_parallel``; pretrain/train.py over
pretrain/sequence_parallel.py): the spec refuses what cannot work, the rank grid and batch bookkeeping, and real
CPU runs over gloo with DeepSpeed, where splitting every row over 2 ranks trains exactly like one rank holding it.

Why the tolerances are what they are (fp32 on CPU, 4 steps of the tiny model, dropless MoE): the sequence-parallel
run does the same arithmetic in another order (cross-entropy summed per slice, attention states summed across
ranks), so losses agree to fp32 rounding, ~1e-7 relative (measured: at most 2e-8); 1e-6 is asserted. The global
gradient norm likewise (measured equal to all printed digits); 1e-5 is asserted. Weights: AdamW's first steps move
each weight by about lr x g / (|g| + eps), so an entry whose gradient is near eps (1e-8) moves by a visibly
different amount on fp32 noise alone; measured, the median |Δw| is 2e-9, 99.99% are below 8e-7 and the largest is
4e-5 (about 1% of one lr = 3e-3 step). So: at most 0.1% of the entries may differ by more than 1e-6, none by more
than 2e-4. Leaving out the SP x share scaling (the loss DeepSpeed backpropagates) halves the gradient norm and
moves 92% of the expert weights by more than 1e-6, up to 2e-3 (checked by hand: these tests then fail).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

# 4 optimizer steps of 8 rows x 128 tokens, 4 rows per forward call, dropless routing, every step logged
RUN = dict(seq_len=128, micro_batch_rows=4, batch_rows=8, max_batch_rows=8, train_tokens=4096, token_drop=False,
           log_every=1, checkpoint_every=100, eval_documents=12, eval_max_rows=8)
# processes=2 (data-parallel, sequence_parallel 1) measured with the code before sequence parallelism existed
# (commit 1817832, torch 2.13.0+cpu, deepspeed, this CPU): per-step loss and grad norm
TWO_RANK_BEFORE = {"loss": [6.377180576324463, 6.303481101989746, 6.219259262084961, 6.0568695068359375],
                   "grad_norm": [0.5156957507133484, 0.5084900856018066, 0.5342167615890503, 0.5794677138328552]}


# --- 1. what the spec refuses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, match", [
    (dict(seq_len=100, sequence_parallel=3), r"seq_len=100 is not divisible by sequence_parallel=3"),
    (dict(seq_len=48, sequence_parallel=4), r"seq_len=48 over sequence_parallel=4 leaves 12 tokens per rank"),
    (dict(sequence_parallel=2, expert_parallel_size=2), r"expert_parallel_size=2: the two are not supported"),
    (dict(sequence_parallel=2, compile=True), r"compile: true with sequence_parallel=2 is not supported"),
    (dict(sequence_parallel=0), r"greater than or equal to 1"),
])
def test_pretrain_params_refuse_a_sequence_split_that_cannot_work(bad: dict, match: str) -> None:
    from pydantic import ValidationError

    from pretrain.stage import PretrainParams

    with pytest.raises(ValidationError, match=match):
        PretrainParams(**bad)


def test_long_context_params_name_the_phase_whose_length_does_not_split() -> None:
    from pydantic import ValidationError

    from pretrain.long_context import LongContextParams

    phases = [dict(seq_len=512, rope_theta=2e4, tokens=4096, short=1, medium=1, long=0),
              dict(seq_len=1000, rope_theta=4e4, tokens=4096, short=1, medium=1, long=1)]
    with pytest.raises(ValidationError, match=r"phases\.1\.seq_len=1000 is not divisible by sequence_parallel=16"):
        LongContextParams(phases=phases, batch_tokens=8000 * 512, micro_batch_tokens=8000 * 64, sequence_parallel=16)
    assert LongContextParams(sequence_parallel=8).sequence_parallel == 8  # 512 and 1024 split into 64 and 128


SPEC = """\
name: t
artifact_root: {root}
stages:
  train:
    uses: {kind}
    params:
      sequence_parallel: {sp}{processes}
    resources:
      gpus: {gpus}
"""


@pytest.mark.parametrize("kind", ["pretrain", "long_context"])
@pytest.mark.parametrize("processes, gpus, sp, expect", [
    (3, 0, 2, "must divide the 3 training processes per node (processes=3)"),
    (None, 6, 4, "must divide the 6 training processes per node (one per GPU, resources.gpus=6)"),
    (None, 4, 4, None),
    (2, 0, 2, None),
])
def test_spec_checks_sequence_parallel_against_the_ranks_per_node_at_its_line(
        tmp_path: Path, kind: str, processes: int | None, gpus: int, sp: int, expect: str | None) -> None:
    from pipeline.spec import SpecError, load_spec

    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.format(root=tmp_path / "runs", kind=kind, sp=sp, gpus=gpus,
                                processes="" if processes is None else f"\n      processes: {processes}"))
    with pytest.raises(SpecError) as e:  # the inputs are not bound: the spec is invalid in any case
        load_spec(path)
    ours = [p for p in e.value.problems if "sequence_parallel" in p]
    if expect is None:
        assert ours == [], ours
    else:
        assert len(ours) == 1 and expect in ours[0], e.value.problems
        assert ours[0].startswith(f"{path}:7: stage 'train', field params.sequence_parallel:"), ours[0]


def test_stage_run_refuses_a_group_that_does_not_divide_its_processes(tmp_path: Path) -> None:
    """Params built in code skip the spec; the stage checks before packing or launching anything."""
    from pipeline.stage import Resources, StageContext
    from pretrain.stage import PretrainParams, run

    ctx = StageContext(tmp_path / "out", {}, stage_name="pretrain", resources=Resources(cpus=1),
                       resume_dir=tmp_path / "resume")
    with pytest.raises(ValueError, match=r"pretrain: sequence_parallel=2 must divide the 3 training processes"):
        run(PretrainParams(processes=3, sequence_parallel=2), ctx)
    assert not (tmp_path / "resume").exists()


# --- 2. ranks and batches ----------------------------------------------------------------------------------------


def test_rank_grid_puts_consecutive_ranks_in_one_sequence_group() -> None:
    from pretrain.train import RankGrid

    grid = [RankGrid(r, 8, 2) for r in range(8)]
    assert [g.data_rank for g in grid] == [0, 0, 1, 1, 2, 2, 3, 3]  # the loader's rank: same rows in a group
    assert [g.sequence_rank for g in grid] == [0, 1] * 4  # the slice of each row
    assert {g.data_parallel for g in grid} == {4}
    assert RankGrid(3, 4).data_rank == 3 and RankGrid(3, 4).data_parallel == 4  # sp 1: every rank a replica
    with pytest.raises(ValueError, match="sequence_parallel=4 must divide the 6 training ranks"):
        RankGrid(0, 6, 4)


def test_batch_rows_are_shared_over_replicas_not_ranks() -> None:
    """8 rows a step, 4 per forward call: 2 ranks splitting rows need 2 micro-batches, like one rank; DeepSpeed's
    train_batch_size counts every rank (it averages over all of them)."""
    from pretrain.train import TrainConfig, deepspeed_config

    def ds(world: int, sp: int) -> tuple[int, int]:
        cfg = TrainConfig(data_dir="", tokenizer_dir="", resume_dir="", export_dir="", micro_batch_rows=4,
                          batch_rows=8, sequence_parallel=sp)
        c = deepspeed_config(cfg, world, torch.device("cpu"))
        return c["gradient_accumulation_steps"], c["train_batch_size"]

    assert ds(1, 1) == (2, 8)
    assert ds(2, 1) == (1, 8)
    assert ds(2, 2) == (2, 16)
    assert ds(4, 2) == (1, 16)


# --- 3. real runs: the pretrain stage on 1, 2 and 4 gloo processes ------------------------------------------------


@dataclass
class Run:
    history: list[dict]
    summary: dict
    weights: dict[str, torch.Tensor]
    routed: np.ndarray
    logged: list[int]  # the steps whose loss reached the sink (MLflow in a pipeline run)
    resume: Path


# the (2, 2) run checkpoints every 2 steps: the resume test rewinds a copy of its checkpoints instead of training the
# same run again (writing a checkpoint leaves the training as it was: the comparisons with (1, 1) hold either way)
CHECKPOINT_EVERY = {(2, 2): 2}


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from tests.pretrain_fixtures import build_inputs

    return build_inputs(tmp_path_factory.mktemp("sp_inputs"))


@pytest.fixture(scope="module")
def runs(stage_inputs, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    """Trained runs by (processes, sequence_parallel), each made once, when a test first asks for it."""
    from safetensors.torch import load_file

    from pipeline.stage import Resources, StageContext
    from pretrain.stage import PretrainParams, run

    made: dict[tuple[int, int], Run] = {}

    def get(processes: int, sp: int) -> Run:
        if (processes, sp) not in made:
            root = tmp_path_factory.mktemp(f"sp_run_{processes}x{sp}")
            ctx = StageContext(root / "out", stage_inputs.as_inputs(), stage_name="pretrain",
                               resources=Resources(cpus=1), resume_dir=root / "resume")
            params = dict(RUN, checkpoint_every=CHECKPOINT_EVERY.get((processes, sp), RUN["checkpoint_every"]))
            run(PretrainParams(**params, processes=processes, sequence_parallel=sp), ctx)
            out = root / "out"
            made[processes, sp] = Run(
                [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line],
                json.loads((out / "summary.json").read_text()), load_file(out / "model" / "model.safetensors"),
                np.load(out / "expert_routed.npy"),
                [step for k, _, step in ctx.sink.metrics if k == "loss" and step is not None], root / "resume")
        return made[processes, sp]

    return get


def _assert_trains_alike(got: Run, ref: Run) -> None:
    assert got.summary["steps"] == ref.summary["steps"] == 4
    assert got.summary["tokens"] == ref.summary["tokens"] == 4096  # rows of a group counted once
    assert [h["tokens"] for h in got.history] == [h["tokens"] for h in ref.history] == [1024, 2048, 3072, 4096]
    assert [h["batch_size"] for h in got.history] == [8] * 4
    for key, rel in (("loss", 1e-6), ("aux_loss", 1e-6), ("grad_norm", 1e-5)):
        assert [h[key] for h in got.history] == pytest.approx([h[key] for h in ref.history], rel=rel), key
    assert got.summary["eval_loss"] == pytest.approx(ref.summary["eval_loss"], rel=1e-6)
    assert got.summary["drop_rate"] == ref.summary["drop_rate"] == 0.0
    # every token routed to its experts once, over all ranks: the whole-run expert load is the same
    assert got.routed.sum() == ref.routed.sum() and np.abs(got.routed - ref.routed).sum() <= 4
    delta = torch.cat([(got.weights[k] - ref.weights[k]).abs().flatten() for k in ref.weights])
    assert got.weights.keys() == ref.weights.keys()
    assert float(delta.max()) < 2e-4, float(delta.max())
    assert float((delta > 1e-6).float().mean()) < 1e-3, float((delta > 1e-6).float().mean())


@pytest.mark.slow
def test_two_ranks_splitting_every_row_train_like_one_rank_holding_it(runs) -> None:  # noqa: ANN001
    """processes 2, sequence_parallel 2 (one replica, each rank half of every row) vs processes 1."""
    _assert_trains_alike(runs(2, 2), runs(1, 1))


@pytest.mark.slow
def test_two_data_parallel_ranks_train_as_before_sequence_parallelism(runs) -> None:  # noqa: ANN001
    """processes 2, sequence_parallel 1 is the old data-parallel run: the grad norms measured before the change (the
    logged loss was then rank 0's half of the batch; it is now the whole batch's, next test)."""
    got = runs(2, 1)
    assert [h["grad_norm"] for h in got.history] == pytest.approx(TWO_RANK_BEFORE["grad_norm"], rel=1e-5)
    assert got.summary["tokens"] == 4096 and got.summary["steps"] == 4


@pytest.mark.slow
def test_two_data_parallel_ranks_log_the_whole_batch_loss_like_one_rank(runs) -> None:  # noqa: ANN001
    """Every rank gets the mean over the replicas of the step's loss (what the batch schedule's loss triggers read,
    so all ranks double the batch at the same step): 2 ranks log what 1 rank holding all 8 rows logs. Before, each
    rank had its own half's loss: the values pinned in TWO_RANK_BEFORE, 0.04-0.7% off."""
    one, two = runs(1, 1), runs(2, 1)
    assert two.history[0]["loss"] == pytest.approx(one.history[0]["loss"], rel=1e-6)  # step 1: the same weights
    # later steps: the weights differ in the last bits (gradients reduced in another order), 2e-5 measured
    assert [h["loss"] for h in two.history] == pytest.approx([h["loss"] for h in one.history], rel=1e-4)
    assert [h["loss"] for h in two.history] != pytest.approx(TWO_RANK_BEFORE["loss"], rel=1e-4)


@pytest.mark.slow
def test_two_replicas_of_two_sequence_ranks_train_like_two_data_parallel_ranks(runs) -> None:  # noqa: ANN001
    """processes 4 = 2 data-parallel x 2 sequence-parallel vs processes 2 data-parallel: the loader shards rows by
    replica, and DeepSpeed's average over 4 ranks of 2 x each share is the mean over the 2 replicas."""
    _assert_trains_alike(runs(4, 2), runs(2, 1))


# --- 4. long_context: one short phase with sequence_parallel 2 ---------------------------------------------------


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A tiny model pretrained for 4 steps at 128 tokens, and the inputs a long_context stage takes."""
    from pipeline.stage import Artifact, Resources, StageContext
    from pretrain.stage import PretrainParams, run
    from tests.pretrain_fixtures import build_inputs

    root = tmp_path_factory.mktemp("sp_lc_pretrain")
    inputs = build_inputs(root / "inputs", domains=("prose", "code"))
    ctx = StageContext(root / "ckpt", inputs.as_inputs(), stage_name="pretrain", resources=Resources(cpus=1),
                       resume_dir=root / "resume")
    run(PretrainParams(**dict(RUN, log_every=4, eval_documents=16)), ctx)
    (root / "ckpt" / "manifest.json").write_text(json.dumps({"type": "checkpoint", "digest": "test-checkpoint"}))
    return {**inputs.as_inputs(), "checkpoint": Artifact.load(root / "ckpt")}


LONG_PHASE = dict(phases=[dict(seq_len=256, rope_theta=20_000.0, tokens=2048, short=30, medium=70, long=0)],
                  batch_tokens=1024, micro_batch_tokens=512, log_every=1, checkpoint_every=2, eval_rows=4,
                  token_drop=False)


@pytest.mark.slow
@pytest.mark.extended  # multi-minute, run with -m extended: CI holds its 25 minutes (pyproject.toml)
def test_long_context_phase_split_over_two_ranks_trains_like_one_rank(pretrained, tmp_path: Path) -> None:  # noqa: ANN001
    from pipeline.stage import Resources, StageContext
    from pretrain.long_context import LongContextParams, run

    results = {}
    for processes, sp in ((1, 1), (2, 2)):
        root = tmp_path / f"{processes}x{sp}"
        ctx = StageContext(root / "out", pretrained, stage_name="long_context", resources=Resources(cpus=1),
                           resume_dir=root / "resume")
        run(LongContextParams(**LONG_PHASE, processes=processes, sequence_parallel=sp), ctx)
        history = [json.loads(line) for line in (root / "out" / "train_log.jsonl").read_text().splitlines()]
        results[sp] = history, json.loads((root / "out" / "summary.json").read_text())
    (one, one_summary), (two, two_summary) = results[1], results[2]
    assert len(one) == len(two) == 2 and [h["tokens"] for h in two] == [1024, 2048]  # 4 rows of 256 a step
    for key, rel in (("loss", 1e-6), ("grad_norm", 1e-5)):
        assert [h[key] for h in two] == pytest.approx([h[key] for h in one], rel=rel), key
    assert two_summary["eval_loss"] == pytest.approx(one_summary["eval_loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.extended  # multi-minute, run with -m extended: CI holds its 25 minutes (pyproject.toml)
def test_sequence_parallel_run_resumed_from_a_checkpoint_ends_like_the_uninterrupted_one(
        runs, stage_inputs, tmp_path: Path) -> None:  # noqa: ANN001
    """processes 2, sequence_parallel 2, checkpoints every 2 steps (the shared run); a copy of its checkpoints rewound
    to step 2 (as a kill after it would leave it) and rerun: steps 3-4, the eval loss, the expert load and the weights
    are the uninterrupted run's."""
    import shutil

    from safetensors.torch import load_file

    from pipeline.stage import Resources, StageContext
    from pretrain.stage import PretrainParams, run

    params = PretrainParams(**dict(RUN, checkpoint_every=2), processes=2, sequence_parallel=2)
    first = runs(2, 2)
    assert first.logged == [1, 2, 3, 4]
    shutil.copytree(first.resume, tmp_path / "resume")
    ckpt = tmp_path / "resume" / "deepspeed"
    assert (ckpt / "latest").read_text().strip() == "step00000004"
    shutil.rmtree(ckpt / "step00000004")
    (ckpt / "latest").write_text("step00000002")
    ctx = StageContext(tmp_path / "out", stage_inputs.as_inputs(), stage_name="pretrain", resources=Resources(cpus=1),
                       resume_dir=tmp_path / "resume")
    run(params, ctx)
    out = tmp_path / "out"
    again = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line]
    summary2, routed2 = json.loads((out / "summary.json").read_text()), np.load(out / "expert_routed.npy")
    weights2 = load_file(out / "model" / "model.safetensors")
    logged2 = [step for k, _, step in ctx.sink.metrics if k == "loss" and step is not None]
    assert logged2 == [3, 4]  # it resumed after step 2: only steps 3 and 4 were trained (and sent to MLflow)
    assert summary2["steps"] == 4 and summary2["tokens"] == 4096
    for a, b in zip(again, first.history, strict=True):
        assert (a["step"], a["tokens"]) == (b["step"], b["tokens"])
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                  rel=1e-5)
    assert summary2["eval_loss"] == pytest.approx(first.summary["eval_loss"], abs=1e-6)
    assert np.array_equal(routed2, first.routed)  # the checkpoint's whole-run sums over all ranks, plus steps 3-4
    assert max(float((weights2[k] - first.weights[k]).abs().max()) for k in first.weights) < 1e-5
