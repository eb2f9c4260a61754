"""Stage ``pretrain``: train the hybrid lightning/softmax MoE (``model/``) on the mixture (artifact ``checkpoint``).

Inputs: the ``mixture`` (how many times each document is trained on), the ``scored_documents`` it was planned
from (the texts) and the ``tokenizer``. The stage packs the mixture into rows (``pretrain/packed_data.py``), builds the
engine's config from its params (``pretrain/engine_config.py``; the loop is ``pretrain/trainer.py``), launches the
training processes (``pretrain/launch.py``, ``pretrain/train.py``: one process for a CPU or one GPU, ``pretrain/local_ranks.py`` with one
rank per GPU for several; the stage's ``resources.gpus`` decides) under ``pipeline.launch.run_process_tree`` (nothing
outlives a cancelled stage), or, when the stage spans nodes or was not given the resources itself (``resources.nodes > 1``,
GPUs on a Ray cluster), as Ray Train workers; forwards their metrics to MLflow, and writes the artifact:

    model/            HybridForCausalLM (``import model`` registers it) + tokenizer, token ids, chat template
    minimax/          the same weights as transformers' MiniMaxForCausalLM (no remote code) + tokenizer
    train_log.jsonl   every logged step (loss, aux_loss, lr, batch_size, grad_norm, tokens_per_second, mfu, ...)
    loss_curve.json   step, tokens, loss and lr of those steps: what the compare stage reads (train_log.jsonl,
                      summary.json and plots/ are records: verified, not in the artifact's digest)
    summary.json      eval_loss, unigram_loss, steps, tokens, skipped steps, drop rate
    expert_routed.npy / expert_dropped.npy   token slots per [layer, expert] over the run
    packing.json      what was packed (rows, tokens, held-out documents)
    retrieval.json, copy_curriculum.json   the retrieval rows and the copy curriculum made besides (where asked)
    plots/            loss curve, expert load and drop-rate heat maps

Checkpoints live in the stage's resume directory (kept across a killed attempt, keyed by the cache key): a rerun
of ``hylight run`` continues from the last one. Across nodes every rank reads the packed rows and writes its
checkpoint shards there, and rank 0 writes the exports: the pipeline's artifact_root must be a filesystem all nodes
share.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator
from tokenizers import Tokenizer

from data.documents import SCORED_DOCUMENTS_TYPE
from data.mix import MIXTURE_TYPE
from data.tokenizer import TOKENIZER_TYPE
from pipeline.artifacts import publish_dir, write_json_atomic
from pipeline.stage import InputSpec, StageContext, StageKind
from pretrain.copy_schedule import copy_keep_rows_for, copy_rows_for, curriculum_rows_for
from pretrain.engine_config import EngineConfig, RunShape
from pretrain.launch import RankLayout, Relay, check_layout, launch_ranks, layout_problems
from pretrain.params import TrainingParams

CHECKPOINT_TYPE = "checkpoint"
LOSS_CURVE_FILE = "loss_curve.json"
LOSS_CURVE_FIELDS = ("step", "tokens", "loss", "lr")
# model.configuration.PATTERN_SHORTHANDS and ATTENTION_KINDS (a test pins them equal): checked here, at spec validation,
# where importing model/ (transformers, torch) would cost seconds for every `hylight validate`
ATTENTION_PATTERNS = ("hybrid", "all-lightning", "all-softmax")
ATTENTION_KINDS = ("lightning", "softmax")


class PretrainParams(TrainingParams, RunShape):
    """The run (``RunShape``: size, rows, batches, budget), the engine's knobs and the training stages' shared params
    (``TrainingParams``), and the held-out documents."""

    eval_documents: int = Field(64, ge=1, description=(
        "Held-out documents for eval_loss (documents the mixture never samples first; taken out of training if "
        "there are not enough, and counted)."))
    copy_share: float = Field(0.0, ge=0, le=1, description=(
        "Copy curriculum: share of the rows read in the first copy_until_tokens that are pure copy rows (a span "
        "of token ids drawn from the vocabulary as copy_draw says, a marker, the span again; the loss on the "
        "repeat), each read once; 1: nothing else in that window; 0: none. Our departure from the report (issue "
        "33). On 4 x H200, 1,000 steps of these rows alone (spans of 32-256 ids, 16K tokens a step, head_init "
        "embedding) taught gpu-300m's hybrid to copy: the loss left ln V at steps 550-800 (BENCHMARKS.md, the "
        "fifth lease); with a Xavier head it did not, nor did 700 steps with the EOS a target (two runs)."))
    copy_until_tokens: int = Field(0, ge=0, description=(
        "Training tokens (rows read x seq_len, from the start) over which the copy rows are spread; after them "
        "the run reads only the mixture's rows and the retrieval rows."))
    copy_keep_share: float = Field(0.0, ge=0, lt=1, description=(
        "Share of the rows read after copy_until_tokens, to the run's end, that are still copy rows (made like the "
        "window's, each read once, evenly spread); 0: none, the run reads only the mixture's and the retrieval rows "
        "after the window. So that copying is still trained once text arrives: the hybrid's copy probe fell from "
        "0.95 at the window's end to 0.47 when the text began (the tenth lease); with 0.1 it ended at 0.933, 0.669 "
        "without (the twelfth lease). Needs copy_share."))
    copy_span_tokens: list[int] = Field(default_factory=lambda: [32, 256], min_length=2, max_length=2,
                                        description="Shortest and longest copied span, in tokens.")
    copy_gap_tokens: list[int] = Field(default_factory=lambda: [0, 0], min_length=2, max_length=2, description=(
        "Fewest and most ids drawn between each copy row's span and its marker, so the repeat is copied from that "
        "much farther back (the copy rows' repeats are otherwise at most a span and a marker away). Not yet run on "
        "a GPU."))
    copy_draw: Literal["uniform", "unigram"] = Field("uniform", description=(
        "How the copy rows draw their span ids from the ordinary vocabulary: uniform (each id alike), or unigram "
        "(as often as the training text uses each; ids it never uses are never drawn). On the CPU a toy model "
        "copied Zipf-drawn ids from 4,096 after ~150-400 steps and uniform ones not in 200; but on 4 x H200 "
        "gpu-300m learnt only the unigram guess from Zipf-drawn ids of 32,768 in 800 steps (copy accuracy 0.09) "
        "where it copied uniform ones after 450-600 (spans of one length, BENCHMARKS.md)."))

    @model_validator(mode="after")
    def _attention_pattern(self) -> PretrainParams:
        pattern = self.model_overrides.get("attention_pattern")
        if pattern is None:
            return self
        if isinstance(pattern, str):
            if pattern not in ATTENTION_PATTERNS:
                raise ValueError(f"model_overrides.attention_pattern={pattern!r}: expected one of "
                                 f"{', '.join(ATTENTION_PATTERNS)} or a list of {'/'.join(ATTENTION_KINDS)} per layer")
        elif not isinstance(pattern, list) or not pattern or any(k not in ATTENTION_KINDS for k in pattern):
            raise ValueError(f"model_overrides.attention_pattern={pattern!r}: a per-layer pattern is a non-empty list of "
                             f"{' and '.join(ATTENTION_KINDS)} (one entry per layer)")
        return self

    @model_validator(mode="after")
    def _copy(self) -> PretrainParams:
        if not self.copy_share:
            if self.copy_keep_share:
                raise ValueError(f"copy_keep_share={self.copy_keep_share} keeps copy rows after a copy curriculum's "
                                 "window: set copy_share and copy_until_tokens too")
            return self
        lo, hi = self.copy_span_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"copy_span_tokens={self.copy_span_tokens}: use [min, max] with 1 <= min <= max")
        glo, ghi = self.copy_gap_tokens
        if not 0 <= glo <= ghi:
            raise ValueError(f"copy_gap_tokens={self.copy_gap_tokens}: use [min, max] with 0 <= min <= max")
        if 2 * lo + glo + 16 > self.seq_len:
            raise ValueError(f"copy_span_tokens min {lo}, copy_gap_tokens min {glo}: a sample of two spans and the "
                             f"gap does not fit a {self.seq_len}-token row")
        if self.copy_until_tokens < self.seq_len / self.copy_share:
            raise ValueError(f"copy_share={self.copy_share} needs copy_until_tokens of at least one copy row's "
                             f"worth of rows ({int(self.seq_len / self.copy_share):,} tokens), got "
                             f"{self.copy_until_tokens:,}")
        rows, (kept, _) = self.copy_schedule()
        if self.copy_keep_share and not kept:
            raise ValueError(f"copy_keep_share={self.copy_keep_share} keeps no copy row: of the "
                             f"{self.train_tokens // self.seq_len:,} rows the run reads, the copy window takes the "
                             f"first {curriculum_rows_for(rows, self.copy_share):,}; raise the share or train_tokens")
        return self

    def copy_schedule(self) -> tuple[int, tuple[int, int]]:
        """The copy rows: the window's count, and (kept rows, the slots after the window they spread over)."""
        rows = max(1, copy_rows_for(self.train_tokens, self.seq_len, self.copy_share, self.copy_until_tokens))
        return rows, copy_keep_rows_for(self.train_tokens, self.seq_len, self.copy_keep_share,
                                        curriculum_rows_for(rows, self.copy_share))

    @model_validator(mode="after")
    def _batches(self) -> PretrainParams:
        if self.max_batch_rows < self.batch_rows:
            raise ValueError(f"max_batch_rows={self.max_batch_rows} < batch_rows={self.batch_rows}")
        if self.batch_rows % self.micro_batch_rows:
            raise ValueError(f"batch_rows={self.batch_rows} must be a multiple of micro_batch_rows={self.micro_batch_rows}")
        return self


def run(params: PretrainParams, ctx: StageContext) -> None:
    check_layout(params, ctx.resources, "pretrain")  # also without spec validation, before any work
    data_dir = _packed_rows(params, ctx)
    packing = json.loads((data_dir / "packing.json").read_text())
    layout = RankLayout.of(params.processes, ctx.resources)
    cfg = EngineConfig.for_run(params, params, data_dir=str(data_dir), tokenizer_dir=str(ctx.input("tokenizer").path),
                               resume_dir=str(ctx.resume_dir), export_dir=str(ctx.out_dir))
    where = f" on {ctx.resources.nodes} node(s) through Ray Train" if layout.ray_train else ""
    sp = params.sequence_parallel
    split = f" ({layout.world // sp} data-parallel x {sp} sequence-parallel)" if sp > 1 else ""
    ctx.progress(f"training {params.size} on {packing['train']['rows']:,} rows x {params.seq_len} tokens, "
                 f"{layout.world} process(es){split}{where}, target {params.train_tokens:,} tokens")
    launch_ranks(cfg, layout, Relay(ctx), ctx, name="pretrain")
    _report(params, ctx, layout)


def _packed_rows(params: PretrainParams, ctx: StageContext) -> Path:
    """The mixture packed into rows (once: kept in the resume directory), plus the retrieval rows asked for; logs
    their counts and copies packing.json into the artifact."""
    from pretrain.packed_data import COPY_FILE, build_packed_dataset  # heavy: torch
    from pretrain.retrieval_rows import (  # heavy: torch
        RETRIEVAL_FILE,
        add_copy_rows,
        add_retrieval_rows,
        copy_metrics,
        read_copy,
        read_retrieval,
        retrieval_metrics,
        retrieval_rows_for,
    )

    mixture, documents, tokenizer = ctx.input("mixture"), ctx.input("documents"), ctx.input("tokenizer")
    data_dir = ctx.resume_dir / "data"
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    if not (data_dir / "packing.json").exists():
        ctx.progress(f"packing the mixture into rows of {params.seq_len} tokens")
        tmp = ctx.resume_dir / "data.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        info = build_packed_dataset(mixture.path, documents.path, tokenizer.path, tmp, seq_len=params.seq_len,
                                    seed=params.seed, eval_documents=params.eval_documents, progress=ctx.progress,
                                    scratch_dir=ctx.work_dir)
        if params.retrieval_share:
            add_retrieval_rows(tmp, Tokenizer.from_file(str(tokenizer.path / "tokenizer.json")),
                               added_rows=retrieval_rows_for(info.train.rows, params.retrieval_share),
                               seed=params.seed, kinds=params.retrieval_kinds,
                               min_tokens=params.retrieval_min_tokens, loss_on=params.retrieval_loss,
                               answer_eos=params.retrieval_answer_eos, progress=ctx.progress)
        if params.copy_share:
            rows, (keep_rows, keep_slots) = params.copy_schedule()
            add_copy_rows(tmp, Tokenizer.from_file(str(tokenizer.path / "tokenizer.json")), rows=rows,
                          share=params.copy_share, seed=params.seed, span_tokens=params.copy_span_tokens,
                          draw=params.copy_draw, gap_tokens=params.copy_gap_tokens, keep_rows=keep_rows,
                          keep_slots=keep_slots, progress=ctx.progress)
        publish_dir(tmp, data_dir)
    ctx.log_metrics(retrieval_metrics(read_retrieval(data_dir)) | copy_metrics(read_copy(data_dir)))
    shutil.copy2(data_dir / "packing.json", ctx.out_dir / "packing.json")
    for record in (RETRIEVAL_FILE, COPY_FILE):  # what was made besides the mixture's rows (records)
        if (data_dir / record).is_file():
            shutil.copy2(data_dir / record, ctx.out_dir / record)
    return data_dir


def _report(params: PretrainParams, ctx: StageContext, layout: RankLayout) -> None:
    """What the ranks wrote, to the stage's summary, the loss curve and the plots."""
    from pretrain.probe import PROBE_METRICS, probe_history  # heavy: torch

    summary = json.loads((ctx.out_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (ctx.out_dir / "train_log.jsonl").read_text().splitlines() if line]
    write_loss_curve(ctx.out_dir, history)
    _plots(ctx, history)
    last = history[-1] if history else {}
    probes = probe_history(history)
    ctx.log_summary({
        "eval_loss": summary["eval_loss"], "unigram_loss": summary["unigram_loss"],
        "loss": last.get("loss", float("nan")), "tokens": summary["tokens"], "steps": summary["steps"],
        "skipped_steps": summary["skipped_steps"], "drop_rate": summary["drop_rate"],
        "tokens_per_second": last.get("tokens_per_second", float("nan")), "mfu": last.get("mfu", float("nan")),
        **{k: probes[-1][k] for k in PROBE_METRICS if probes},
    })
    ctx.set_rows("tokens", summary["tokens"])
    ctx.set_rows("steps", summary["steps"])
    ctx.set_tags({"hylight.model_size": params.size, "hylight.world_size": layout.world,
                  "hylight.sequence_parallel": params.sequence_parallel})
    if summary["eval_loss"] >= summary["unigram_loss"]:
        ctx.progress(f"WARNING: eval_loss {summary['eval_loss']:.3f} is not below the unigram baseline "
                     f"{summary['unigram_loss']:.3f}: the model learned no more than token frequencies")


def write_loss_curve(out_dir: Path, history: list[dict[str, Any]]) -> None:
    """``loss_curve.json``: step, tokens, loss and lr of every logged step. It is the part of ``train_log.jsonl``
    that the same inputs reproduce (no throughput or memory figures), so it is payload and the compare stage reads
    it; train_log.jsonl is a record (StageKind.records), left out of the artifact's digest."""
    rows = [{k: h[k] for k in LOSS_CURVE_FIELDS if k in h} for h in history]
    write_json_atomic(out_dir / LOSS_CURVE_FILE, {"fields": list(LOSS_CURVE_FIELDS), "rows": rows})


def _plots(ctx: StageContext, history: list[dict[str, Any]]) -> None:
    import matplotlib  # heavy: matplotlib (the report only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    summary = json.loads((ctx.out_dir / "summary.json").read_text())
    if history:
        fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
        tokens = [h["tokens"] for h in history]
        ax[0].plot(tokens, [h["loss"] for h in history], label="train loss")
        ax[0].axhline(summary["eval_loss"], color="C1", ls="--", label=f"eval_loss {summary['eval_loss']:.3f}")
        ax[0].axhline(summary["unigram_loss"], color="C2", ls=":", label=f"unigram {summary['unigram_loss']:.3f}")
        ax[0].set_xlabel("tokens")
        ax[0].set_ylabel("loss (nats/token)")
        ax[0].legend()
        ax[0].set_title("loss")
        ax[1].plot(tokens, [h["lr"] for h in history], color="C3")
        ax[1].set_xlabel("tokens")
        ax[1].set_ylabel("learning rate")
        ax[1].set_title("WSD schedule")
        ctx.log_figure(fig, "loss_curve.png")
    from pretrain.probe import probe_figure  # heavy: torch

    fig = probe_figure(history)
    if fig is not None:
        ctx.log_figure(fig, "retrieval_probe.png")
    routed = np.load(ctx.out_dir / "expert_routed.npy")
    dropped = np.load(ctx.out_dir / "expert_dropped.npy")
    share = routed / np.maximum(routed.sum(1, keepdims=True), 1)
    drop = dropped / np.maximum(routed, 1)
    fig, ax = plt.subplots(1, 2, figsize=(11, 0.35 * routed.shape[0] + 1.8))
    for a, data, title in ((ax[0], share, "expert load (share of token slots)"), (ax[1], drop, "token-drop rate")):
        im = a.imshow(data, aspect="auto", cmap="viridis")
        a.set_xlabel("expert")
        a.set_ylabel("layer")
        a.set_title(title)
        fig.colorbar(im, ax=a)
    ctx.log_figure(fig, "expert_load.png")


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("summary.json", "train_log.jsonl", "plots/*", "retrieval.json", "copy_curriculum.json"),
    name="pretrain",
    params=PretrainParams,
    run=run,
    produces=CHECKPOINT_TYPE,
    inputs={
        "mixture": InputSpec(MIXTURE_TYPE, doc="sample count of every document"),
        "documents": InputSpec(SCORED_DOCUMENTS_TYPE, doc="the scored documents the mixture was planned from"),
        "tokenizer": InputSpec(TOKENIZER_TYPE, doc="the trained tokenizer"),
    },
    doc="Pretraining on DeepSpeed (ZeRO-1/2, DeepSpeed-MoE experts with the §2.1 global router and token drop, "
        "Triton lightning kernels on CUDA): packed rows honouring the mixture's sample counts, WSD learning rate "
        "and batch-size doubling (§4.2), checkpoints a rerun resumes from, divergence guard; exports model/ and "
        "transformers MiniMax checkpoints with the tokenizer. One process, local ranks on one node, or Ray Train "
        "workers across nodes (resources.nodes).",
    launches_workers=True,
    validate_resources=layout_problems,
)
