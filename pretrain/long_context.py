"""Stage ``long_context``: the §4.2 long-context extension of a pretrained checkpoint (artifact ``checkpoint``).

Inputs: the pretraining ``checkpoint`` and what it was trained from (``mixture``, ``scored_documents``,
``tokenizer``). The stage is a driver around the pretraining loop (``pretrain/train.py``), not a second one:

1. **Long data** (``pretrain/long_data.py``, once): the documents the pretraining run trained on are tokenized
   and assembled, domain by domain, into long documents; its held-out documents are assembled to each phase length
   for the eval rows.
2. **Phases**, in order (Table 6's recipe, scaled by the params). Each phase packs its own rows
   (``pretrain/long_mix.py``: short/medium/long sources whose weights move linearly from the previous phase's over
   the phase's first ``transition_frac``, ``qa_share`` long QA made for it in its last ``qa_last_frac``, rows in a
   fixed order), then launches the training ranks exactly as ``pretrain`` does, starting from the previous phase's
   weights (the first from the checkpoint's), with the phase's sequence length, RoPE base and token budget, a fresh
   optimizer and a short warm-up. Softmax layers see every row as packed segments (``cu_seqlens``), so their
   attention runs on ``kernels/softmax_varlen.py``, whose memory is linear in the tokens at every length.
3. A killed run resumes in the phase it was in (each phase has its own resume directory with DeepSpeed's
   checkpoints); finished phases are not redone, and their logged curves are logged again to the new MLflow run.

Artifact (a ``checkpoint`` like ``pretrain``'s, so ``eval`` and later stages take it the same way)::

    model/, minimax/      the last phase's weights, configs with its rope_theta and max_position_embeddings (= its
                          sequence length), tokenizer
    phases/<i>/           every phase's own model/ and minimax/, summary.json, train_log.jsonl, packing.json,
                          phase_data.json (source weights asked and realised by tenth of the phase), long_qa.*
    long_data/            long_documents.* (token samples + index naming each member document), long_data.json
    summary.json          the last phase's eval_loss/unigram_loss, totals, and every phase's summary
    train_log.jsonl       every logged step of every phase, with the stage-wide step and tokens
    packing.json          the last phase's rows; plots/  loss over the phases, the source schedules

MLflow: the pretraining metrics (``loss``, ``aux_loss``, ``lr``, ``grad_norm``, ...) at a step that continues from
phase to phase, ``eval_loss``/``unigram_loss``/``seq_len``/``rope_theta`` at the end of each phase, the long-data
counts, and the realised token share of each source per phase (``phase<i>.share.<source>``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, model_validator
from tokenizers import Tokenizer

from data.documents import SCORED_DOCUMENTS_TYPE
from data.mix import MIXTURE_TYPE, iter_mixture
from data.tokenizer import TOKENIZER_TYPE, special_token_ids
from pipeline.artifacts import publish_dir, write_text_atomic
from pipeline.stage import InputSpec, StageContext, StageKind, StageParams
from pretrain import events
from pretrain.engine_config import EngineConfig, RunShape
from pretrain.launch import RankLayout, Relay, launch_ranks, layout_problems, ranks_per_node
from pretrain.params import TrainingParams
from pretrain.stage import CHECKPOINT_TYPE, write_loss_curve

LONG_DATA_DIR = "long_data"
PHASES_DIR = "phases"
QA_SAMPLES = "long_qa"


class LongContextPhase(StageParams):
    seq_len: int = Field(..., ge=64, description="Training length in tokens (Table 6: 128K, 512K, 1M).")
    rope_theta: float = Field(..., gt=0, description="RoPE base frequency (Table 6: 5M, 10M, 10M; pretraining 10K).")
    tokens: int = Field(..., ge=1, description="Token budget (Table 6: 300B, 32B, 26B); rounded up to whole batches.")
    short: float = Field(..., ge=0, description="Weight of short data (< short_max_tokens; Table 6: 30, 35, 30).")
    medium: float = Field(..., ge=0, description="Weight of medium data (Table 6: 70, 35, 30).")
    long: float = Field(..., ge=0, description="Weight of long data (> medium_max_tokens; Table 6: 0, 30, 40).")

    @model_validator(mode="after")
    def _some_weight(self) -> LongContextPhase:
        if self.short + self.medium + self.long <= 0:
            raise ValueError("a phase needs a positive short, medium or long weight")
        return self

    @property
    def weights(self) -> np.ndarray:
        w = np.asarray([self.short, self.medium, self.long], float)
        return w / w.sum()


# Table 6 shaped (a first phase with no long data, then longer phases with more of it, RoPE base raised), scaled to
# the tiny model on a CPU: pretraining at 256 tokens with base 10K; the paper's base is about 40 x the length at
# 128K, which gives ~20K at 512 and ~40K at 1024.
TINY_PHASES = (
    dict(seq_len=512, rope_theta=20_000.0, tokens=32_768, short=30, medium=70, long=0),
    dict(seq_len=1024, rope_theta=40_000.0, tokens=32_768, short=35, medium=35, long=30),
)


class LongContextPlan(BaseModel):
    """What long_context trains: its phases, the sources and QA they mix, their batches. (Its own fields, first in
    its params and in ``hylight stages --markdown``.)"""

    phases: list[LongContextPhase] = Field(
        default_factory=lambda: [dict(p) for p in TINY_PHASES], min_length=1, description=(
            "The phases, in order. Default: two CPU-sized phases for the tiny model (512 then 1024 tokens, RoPE base "
            "20K then 40K, 32K tokens each, 30/70/0 then 35/35/30 short/medium/long). Table 6 for MiniMax-Text-01 "
            "(pretrained at 8K): 131072/5e6/300e9/30/70/0, 524288/1e7/32e9/35/35/30, 1048576/1e7/26e9/30/30/40; for "
            "gpu-300m pretrained at 2K scale lengths and budgets down, e.g. 16384/1e6, 32768/2e6, 65536/2e6."))
    short_max_tokens: int | None = Field(None, ge=2, description=(
        "Samples shorter than this are 'short'; default the first phase's length / 4 (Table 6: 32K for 128K)."))
    medium_max_tokens: int | None = Field(None, ge=2, description=(
        "Samples up to this are 'medium', longer ones 'long'; default the first phase's length (Table 6: 128K)."))
    long_document_lengths: list[int] | None = Field(None, description=(
        "Lengths of the long documents assembled from the corpus; default half the first phase's length, then "
        "every phase's length."))
    transition_frac: float = Field(0.2, ge=0, le=1, description=(
        "Share of each phase over which the source weights move linearly from the previous phase's (for the first: "
        "the corpus's own shares) to its own."))
    qa_share: float = Field(0.1, ge=0, lt=1, description=(
        "Share of long-QA tokens in the last qa_last_frac (§4.2: 10%)."))
    qa_last_frac: float = Field(0.2, ge=0, le=1, description="Final share of each phase that mixes in QA (§4.2: 20%).")
    batch_tokens: int = Field(4096, ge=64, description="Tokens per optimizer step; a multiple of every phase length.")
    micro_batch_tokens: int = Field(2048, ge=64, description=(
        "Tokens per forward call on each rank (with sequence_parallel: on each group, every rank holding "
        "1/sequence_parallel of them); a multiple of every phase length, dividing batch_tokens."))
    eval_rows: int = Field(16, ge=1, description="Held-out long documents (rows of the phase length) for eval_loss.")


class LongContextParams(TrainingParams, LongContextPlan):
    """The phases (``LongContextPlan``); the engine's knobs and the training stages' shared params
    (``TrainingParams``), with long_context's own defaults for some."""

    peak_lr: float = Field(1e-3, gt=0, description="Peak learning rate of each phase's WSD schedule.")
    warmup_frac: float = Field(0.1, ge=0, lt=1, description="Linear warm-up of each phase (fresh optimizer).")
    seed: int = Field(0, ge=0, description="Row order of every phase, QA facts and loader.")
    compile: bool = Field(False, description=(
        "torch.compile the RMSNorms and MoE feed-forwards (CUDA graphs on GPUs without expert parallelism). "
        "Compiled phases failed at their first backward until issue 34 (gradient accumulation and CUDA graphs); "
        "pretrain's benchmark step at a long_context-like shape, 4 micro-batches of 8192 x 2, now trains compiled "
        "on an H200 (bench_pretrain_gpu.py --sections accum, BENCHMARKS.md), but no long_context stage run has "
        "been measured compiled yet."))
    retrieval_share: float = Field(0.0, ge=0, lt=1, description=(
        "Share of each phase's training rows made of retrieval-bearing samples of up to the phase length "
        "(pretrain/retrieval_rows.py), spread evenly through the phase; the phase's token budget stays the same."))

    @model_validator(mode="after")
    def _consistent(self) -> LongContextParams:
        for i, p in enumerate(self.phases):
            if self.batch_tokens % p.seq_len or self.micro_batch_tokens % p.seq_len:
                raise ValueError(f"phases.{i}.seq_len={p.seq_len} must divide batch_tokens={self.batch_tokens} and "
                                 f"micro_batch_tokens={self.micro_batch_tokens} (whole rows per batch)")
        if self.batch_tokens % self.micro_batch_tokens:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} must divide "
                             f"batch_tokens={self.batch_tokens}")
        if self.short_bound >= self.medium_bound:
            raise ValueError(f"short_max_tokens={self.short_bound} must be below medium_max_tokens={self.medium_bound}")
        if min(self.document_lengths) < 3:
            raise ValueError(f"long_document_lengths={self.document_lengths}: lengths of 3 tokens or more")
        for i, p in enumerate(self.phases):
            plain = self.phase_rows(i) - self.retrieval_rows(i)
            if self.retrieval_rows(i) and plain < 2:  # a sample's context is plain rows' text, up to a row's length
                raise ValueError(f"phases.{i}: retrieval_share={self.retrieval_share} leaves {plain} of its "
                                 f"{self.phase_rows(i)} rows plain, and its retrieval samples (up to {p.seq_len} "
                                 "tokens) take their text from the plain rows: at least 2 are needed; raise the "
                                 "phase's tokens or lower retrieval_share")
        return self

    def row_lengths(self) -> dict[str, int]:
        return {f"phases.{i}.seq_len": p.seq_len for i, p in enumerate(self.phases)}

    def phase_run(self, i: int) -> RunShape:
        """Phase ``i`` as a training run: its row length, RoPE base and budget, a fixed batch."""
        p = self.phases[i]
        rows = self.batch_tokens // p.seq_len
        return RunShape(seq_len=p.seq_len, model_overrides={"rope_theta": p.rope_theta, "max_position_embeddings": p.seq_len},
                        micro_batch_rows=self.micro_batch_tokens // p.seq_len, batch_rows=rows, max_batch_rows=rows,
                        train_tokens=self.phase_rows(i) * p.seq_len, eval_max_rows=self.eval_rows)

    @property
    def short_bound(self) -> int:
        return self.short_max_tokens or self.phases[0].seq_len // 4

    @property
    def medium_bound(self) -> int:
        return self.medium_max_tokens or self.phases[0].seq_len

    @property
    def document_lengths(self) -> list[int]:
        if self.long_document_lengths:
            return sorted(set(self.long_document_lengths))
        return sorted({self.phases[0].seq_len // 2, *(p.seq_len for p in self.phases)})

    def phase_rows(self, i: int) -> int:
        """Training rows of phase ``i``: its budget in whole batches."""
        p = self.phases[i]
        return math.ceil(p.tokens / self.batch_tokens) * (self.batch_tokens // p.seq_len)

    def previous_weights(self, i: int, corpus: np.ndarray) -> np.ndarray:
        return corpus if i == 0 else self.phases[i - 1].weights

    def retrieval_rows(self, i: int) -> int:
        """Of phase ``i``'s rows, those made of retrieval samples (the rest are the mixture's)."""
        return int(round(self.phase_rows(i) * self.retrieval_share))

    def weights_of_row(self, i: int, corpus: np.ndarray) -> Any:
        """Row ``j`` of the mixture's rows -> token shares [short, medium, long, qa] of phase ``i`` at the row's
        middle."""
        from pretrain.long_mix import phase_weights  # heavy: torch

        rows = self.phase_rows(i) - self.retrieval_rows(i)
        prev, goal = self.previous_weights(i, corpus), self.phases[i].weights
        return lambda j: phase_weights((j + 0.5) / rows, prev, goal, transition_frac=self.transition_frac,
                                       qa_share=self.qa_share, qa_last_frac=self.qa_last_frac)


class _PhaseRelay(Relay):
    """The ranks' lines of one phase: metrics at the stage-wide step (the phases' curves continue one another),
    ``tokens`` counted over the whole stage, progress prefixed with the phase."""

    def __init__(self, ctx: StageContext, phase: int, seq_len: int, step0: int, tokens0: int) -> None:
        super().__init__(ctx)
        self.phase, self.seq_len, self.step0, self.tokens0 = phase, seq_len, step0, tokens0

    def __call__(self, line: str) -> None:
        msg = events.parse(line)
        if msg is not None:
            if msg["kind"] == "metrics":
                self.ctx.log_metrics(self.shift(msg["metrics"]), step=self.step0 + msg["step"])
                return
            if msg["kind"] == "progress":
                self.ctx.progress(f"phase {self.phase} ({self.seq_len} tokens): {msg['message']}")
                return
        super().__call__(line)

    def shift(self, metrics: dict[str, float]) -> dict[str, float]:
        return {**metrics, "tokens": self.tokens0 + metrics["tokens"], "phase": self.phase}


def _checkpoint_packing(checkpoint: Path, mixture: Path) -> dict[str, Any]:
    """The pretraining run's packing.json, checked against the mixture given: the held-out documents are its."""
    for name in ("packing.json", "model/config.json"):
        if not (checkpoint / name).exists():
            raise FileNotFoundError(f"long_context: the checkpoint {checkpoint} has no {name}; give it the artifact of "
                                    "a pretrain stage")
    packing = json.loads((checkpoint / "packing.json").read_text())
    docs = tokens = 0
    for row in iter_mixture(mixture):
        docs += 1
        tokens += row["tokens"] * row["sample_count"]
    if (docs, tokens) != (packing["mixture_documents"], packing["mixture_tokens"]):
        raise ValueError(f"long_context: the checkpoint {checkpoint} was trained on a mixture of "
                         f"{packing['mixture_documents']} documents / {packing['mixture_tokens']} tokens, the mixture "
                         f"given has {docs} / {tokens}: bind the mixture the pretrain stage used "
                         "(needs: {mixture: ...})")
    return packing


def _link_tree(src: Path, dst: Path) -> None:
    """Copy a directory as hard links (a checkpoint's weights are not duplicated on disk); copies across devices."""
    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    if src.is_dir():
        shutil.copytree(src, dst, copy_function=link, dirs_exist_ok=True)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        link(str(src), str(dst))


def _history(export: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (export / "train_log.jsonl").read_text().splitlines() if line]


def run(params: LongContextParams, ctx: StageContext) -> None:
    problems = long_context_resource_problems(params, ctx.resources)  # also without spec validation
    if problems:
        raise ValueError("long_context: " + "; ".join(msg for _, msg in problems))
    checkpoint = ctx.input("checkpoint")
    base = _checkpoint_packing(checkpoint.path, ctx.input("mixture").path)
    layout = RankLayout.of(params.processes, ctx.resources)
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    data = _long_data(params, ctx, base)
    step0 = tokens0 = 0
    init = checkpoint.path / "model"
    phases: list[dict[str, Any]] = []
    for i, phase in enumerate(params.phases):
        summary = _run_phase(params, i, ctx, data, base, layout, init=init, step0=step0, tokens0=tokens0)
        step0 += summary["steps"]
        tokens0 += summary["tokens"]
        phases.append({"phase": i, "seq_len": phase.seq_len, "rope_theta": phase.rope_theta, "end_step": step0,
                       "end_tokens": tokens0, **summary})
        init = ctx.resume_dir / f"phase{i}" / "export" / "model"
    _write_artifact(params, ctx, phases)


def _long_data(params: LongContextParams, ctx: StageContext, base: dict[str, Any]) -> Any:
    """The long documents made from the corpus (once: kept in the resume directory); their counts logged."""
    from pretrain.long_data import LongData, build_long_data  # heavy: torch
    from pretrain.packed_data import heldout_seed  # heavy: torch

    long_dir = ctx.resume_dir / LONG_DATA_DIR
    if not (long_dir / "long_data.json").exists():
        ctx.progress(f"making long documents of {params.document_lengths} tokens from the corpus")
        tmp = ctx.resume_dir / f"{LONG_DATA_DIR}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        build_long_data(ctx.input("mixture").path, ctx.input("documents").path, ctx.input("tokenizer").path, tmp,
                        held_out_seed=heldout_seed(base),
                        held_out_documents=int(base["held_out_from_training"]) + int(base["eval_from_unsampled"]),
                        lengths=params.document_lengths, eval_lengths=[p.seq_len for p in params.phases],
                        progress=ctx.progress)
        publish_dir(tmp, long_dir)
    data = LongData(long_dir)
    _log_long_data(ctx, data.stats)
    return data


def _run_phase(params: LongContextParams, i: int, ctx: StageContext, data: Any, base: dict[str, Any],
               layout: RankLayout, *, init: Path, step0: int, tokens0: int) -> dict[str, Any]:
    """Phase ``i``: its rows packed, its ranks trained from ``init`` (or, finished in an earlier attempt, its logged
    curve again), its metrics logged at the stage-wide step. Returns the phase's summary."""
    from pretrain.long_mix import SOURCES  # heavy: torch
    from pretrain.retrieval_rows import read_retrieval, retrieval_metrics  # heavy: torch

    phase, pdir = params.phases[i], ctx.resume_dir / f"phase{i}"
    export, data_dir = pdir / "export", pdir / "data"
    relay = _PhaseRelay(ctx, i, phase.seq_len, step0, tokens0)
    if (export / "summary.json").exists():  # finished in an earlier attempt: its curve again, no training
        ctx.progress(f"phase {i} ({phase.seq_len} tokens) finished in an earlier attempt")
        for h in _history(export):
            ctx.log_metrics(relay.shift({k: v for k, v in h.items() if k != "step"}), step=step0 + h["step"])
    else:
        if not (data_dir / "packing.json").exists():
            _pack_phase(params, i, ctx, data, base, data_dir)
        cfg = EngineConfig.for_run(params, params.phase_run(i), seed=params.seed + i, data_dir=str(data_dir),
                                   tokenizer_dir=str(ctx.input("tokenizer").path), resume_dir=str(pdir),
                                   export_dir=str(export), init_from=str(init), ordered_rows=True)
        ctx.progress(f"phase {i}: training {phase.seq_len}-token rows, RoPE base {phase.rope_theta:g}, "
                     f"{cfg.train_tokens:,} tokens, from {init}")
        launch_ranks(cfg, layout, relay, ctx, name="long_context", config_name=f"train_config_phase{i}.json")
    shutil.rmtree(pdir / "deepspeed", ignore_errors=True)  # the export is what the next phase starts from
    summary = json.loads((export / "summary.json").read_text())
    phase_data = json.loads((data_dir / "phase_data.json").read_text())
    end_step = step0 + summary["steps"]
    ctx.log_metrics({"eval_loss": summary["eval_loss"], "unigram_loss": summary["unigram_loss"],
                     "seq_len": phase.seq_len, "rope_theta": phase.rope_theta}, step=end_step)
    total = sum(phase_data["tokens_by_source"].values())
    ctx.log_metrics({f"phase{i}.share.{s}": phase_data["tokens_by_source"][s] / total for s in SOURCES}
                    | {f"phase{i}.qa_samples": phase_data["qa_samples"]}
                    | retrieval_metrics(read_retrieval(data_dir), prefix=f"phase{i}.retrieval"))
    return summary


def _pack_phase(params: LongContextParams, i: int, ctx: StageContext, data: Any, base: dict[str, Any],
                data_dir: Path) -> None:
    """Phase ``i``'s rows: the mixture's sources on the phase's schedule, its long QA, its retrieval rows."""
    from pretrain.long_data import TokenSampleWriter  # heavy: torch
    from pretrain.long_mix import corpus_shares, phase_sources, write_phase_rows  # heavy: torch
    from pretrain.packed_data import heldout_seed  # heavy: torch
    from pretrain.retrieval_rows import add_retrieval_rows  # heavy: torch

    phase, pdir = params.phases[i], ctx.resume_dir / f"phase{i}"
    tokenizer = ctx.input("tokenizer").path
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    special = {k: int(v) for k, v in data.stats["special_ids"].items()}
    corpus = corpus_shares(data, params.short_bound, params.medium_bound)
    inherited = {k: base[k] for k in ("mixture_documents", "mixture_tokens", "unused_documents", "eval_from_unsampled",
                                      "held_out_from_training", "held_out_training_tokens")}
    inherited["heldout_seed"] = heldout_seed(base)  # pretrain's, not this stage's `seed` (its rows' own)
    ctx.progress(f"phase {i}: packing {params.phase_rows(i):,} rows of {phase.seq_len} tokens")
    tmp = pdir / "data.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with TokenSampleWriter(tmp, QA_SAMPLES) as qa:
        sources = phase_sources(
            data, phase=i, seq_len=phase.seq_len, short_max=params.short_bound, medium_max=params.medium_bound,
            previous=params.previous_weights(i, corpus), target=phase.weights, qa_share=params.qa_share,
            eval_rows=params.eval_rows, seed=params.seed, tokenizer=tok, qa_writer=qa, special_ids=special)
        write_phase_rows(tmp, sources, seq_len=phase.seq_len, rows=params.phase_rows(i) - params.retrieval_rows(i),
                         seed=params.seed, weights_of_row=params.weights_of_row(i, corpus),
                         vocab_size=special_token_ids(tokenizer)["vocab_size"], special_ids=special,
                         inherited=inherited, describe={"phase": i, "rope_theta": phase.rope_theta})
    if params.retrieval_rows(i):
        add_retrieval_rows(tmp, tok, added_rows=params.retrieval_rows(i), seed=params.seed + i,
                           kinds=params.retrieval_kinds, min_tokens=params.retrieval_min_tokens,
                           loss_on=params.retrieval_loss, answer_eos=params.retrieval_answer_eos,
                           progress=ctx.progress)
    publish_dir(tmp, data_dir)


def _log_long_data(ctx: StageContext, stats: dict[str, Any]) -> None:
    docs = stats["long_documents"]
    ctx.log_metrics({"long_documents": docs["long_documents"], "long_document_tokens": docs["long_document_tokens"],
                     "long_data.documents_in": docs["documents_in"], "long_data.tokens_used": docs["tokens_used"],
                     "long_data.tokens_left": docs["tokens_left"], "long_data.groups": docs["groups"],
                     **{f"long_documents.{n}": c for n, c in docs["per_length"].items()},
                     **{f"eval_long_documents.{n}": s["long_documents"]
                        for n, s in stats["eval_long_documents"].items()}})


def _write_artifact(params: LongContextParams, ctx: StageContext, phases: list[dict[str, Any]]) -> None:
    from pretrain.retrieval_rows import RETRIEVAL_FILE  # heavy: torch

    out, last = ctx.out_dir, len(phases) - 1
    history: list[dict[str, Any]] = []
    routed = dropped = None
    for ph in phases:
        i = ph["phase"]
        pdir, dst = ctx.resume_dir / f"phase{i}", out / PHASES_DIR / str(i)
        for name in ("model", "minimax", "summary.json", "train_log.jsonl", "expert_routed.npy", "expert_dropped.npy"):
            _link_tree(pdir / "export" / name, dst / name)
        for name in ("packing.json", "phase_data.json", "row_sources.npy", f"{QA_SAMPLES}.bin",
                     f"{QA_SAMPLES}.jsonl.gz", RETRIEVAL_FILE):
            if name != RETRIEVAL_FILE or (pdir / "data" / name).exists():
                _link_tree(pdir / "data" / name, dst / name)
        step0, tokens0 = ph["end_step"] - ph["steps"], ph["end_tokens"] - ph["tokens"]
        for h in _history(pdir / "export"):
            history.append({**h, "phase": i, "seq_len": ph["seq_len"], "phase_step": h["step"],
                            "step": step0 + h["step"], "phase_tokens": h["tokens"], "tokens": tokens0 + h["tokens"]})
        r, d = np.load(pdir / "export" / "expert_routed.npy"), np.load(pdir / "export" / "expert_dropped.npy")
        routed, dropped = (r, d) if routed is None else (routed + r, dropped + d)
    final = ctx.resume_dir / f"phase{last}"
    for name in ("model", "minimax"):
        _link_tree(final / "export" / name, out / name)
    _link_tree(final / "data" / "packing.json", out / "packing.json")
    for name in ("long_documents.bin", "long_documents.jsonl.gz", "long_data.json"):
        _link_tree(ctx.resume_dir / LONG_DATA_DIR / name, out / LONG_DATA_DIR / name)
    np.save(out / "expert_routed.npy", routed)
    np.save(out / "expert_dropped.npy", dropped)
    write_text_atomic(out / "train_log.jsonl", "".join(json.dumps(h) + "\n" for h in history))
    write_loss_curve(out, history)  # the payload a compare stage reads (train_log.jsonl is a record)
    f = phases[last]
    summary = {"eval_loss": f["eval_loss"], "unigram_loss": f["unigram_loss"], "seq_len": f["seq_len"],
               "rope_theta": f["rope_theta"], "steps": f["end_step"], "tokens": f["end_tokens"],
               "skipped_steps": sum(p["skipped_steps"] for p in phases),
               "drop_rate": float(dropped.sum() / max(routed.sum(), 1.0)), "phases": phases}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    _plots(params, ctx, history, phases)
    ctx.log_artifact(out / LONG_DATA_DIR / "long_data.json", LONG_DATA_DIR)
    ctx.log_artifact(out / "summary.json")
    # stepped metrics (eval_loss, ...) went out per phase; the summary only records them for `hylight status`
    ctx.summary.update({"eval_loss": f["eval_loss"], "unigram_loss": f["unigram_loss"]})
    from pretrain.probe import PROBE_METRICS, probe_history  # heavy: torch

    probes = probe_history(history)
    ctx.log_summary({"loss": history[-1]["loss"] if history else float("nan"), "tokens": f["end_tokens"],
                     "steps": f["end_step"], "skipped_steps": summary["skipped_steps"],
                     "final_seq_len": f["seq_len"], **{k: probes[-1][k] for k in PROBE_METRICS if probes}})
    ctx.set_rows("tokens", f["end_tokens"])
    ctx.set_rows("steps", f["end_step"])
    ctx.set_rows("phases", len(phases))


def _plots(params: LongContextParams, ctx: StageContext, history: list[dict[str, Any]],
           phases: list[dict[str, Any]]) -> None:
    import matplotlib  # heavy: matplotlib (the report only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    from pretrain.long_mix import SOURCES, row_sources  # heavy: torch

    if history:
        fig, ax = plt.subplots(figsize=(8, 3.8))
        ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train loss")
        for p in phases:
            ax.axvline(p["end_step"], color="gray", ls=":", lw=0.8)
            ax.plot([p["end_step"]], [p["eval_loss"]], "o", color="C1")
            ax.annotate(f"{p['seq_len']} tok\neval {p['eval_loss']:.3f}", (p["end_step"], p["eval_loss"]),
                        textcoords="offset points", xytext=(-60, 8), fontsize=8)
        ax.set_xlabel("step (all phases)")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title("long-context extension: loss by phase")
        ax.legend()
        ctx.log_figure(fig, "loss_curve.png")
    from pretrain.probe import probe_figure  # heavy: torch

    fig = probe_figure(history, boundaries=[(p["end_step"], f"{p['seq_len']} tok") for p in phases])
    if fig is not None:
        ctx.log_figure(fig, "retrieval_probe.png")
    fig, axes = plt.subplots(1, len(phases), figsize=(5 * len(phases), 3.5), squeeze=False)
    for ax, p in zip(axes[0], phases, strict=True):
        realised = row_sources(ctx.resume_dir / f"phase{p['phase']}" / "data").astype(float)
        share = realised / realised.sum(1, keepdims=True)
        ax.stackplot(np.arange(len(share)), share.T, labels=SOURCES)
        ax.set_title(f"phase {p['phase']}: {p['seq_len']} tokens, RoPE {p['rope_theta']:g}")
        ax.set_xlabel("row (training order)")
        ax.set_ylabel("token share")
        ax.set_ylim(0, 1)
    axes[0][0].legend(loc="lower left", fontsize=8)
    ctx.log_figure(fig, "source_schedule.png")


def long_context_resource_problems(params: LongContextParams, resources: Any) -> list[tuple[str, str]]:
    """Spec-time checks of the params against the stage's resources: the rank layout (:func:`layout_problems`),
    every phase's batch in whole micro-batches of every data-parallel replica. (``compile: true`` on GPUs was
    refused here until issue 34 found why a compiled phase failed: its gradient accumulation, whose graph-written
    gradients the trainer now moves out of the CUDA graphs' memory between micro-batches.)"""
    problems = layout_problems(params, resources)
    world = ranks_per_node(params.processes, resources.gpus) * resources.nodes
    replicas = world // params.sequence_parallel  # a sequence-parallel group reads one set of rows
    for i, p in enumerate(params.phases):
        rows, micro = params.batch_tokens // p.seq_len, params.micro_batch_tokens // p.seq_len
        if world % params.sequence_parallel == 0 and rows % (micro * replicas):
            problems.append(("params.batch_tokens", f"phase {i} has {rows} rows per batch, not a multiple of {micro} "
                             f"rows per forward call x {replicas} data-parallel replicas ({world} ranks / "
                             f"sequence_parallel={params.sequence_parallel}); raise batch_tokens"))
    return problems


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("summary.json", "train_log.jsonl", "phases/*/summary.json", "phases/*/train_log.jsonl", "plots/*"),
    name="long_context",
    params=LongContextParams,
    run=run,
    produces=CHECKPOINT_TYPE,
    inputs={
        "checkpoint": InputSpec(CHECKPOINT_TYPE, doc="the pretraining checkpoint to extend"),
        "mixture": InputSpec(MIXTURE_TYPE, doc="the mixture it was pretrained on (its held-out documents)"),
        "documents": InputSpec(SCORED_DOCUMENTS_TYPE, doc="the scored documents the mixture was planned from"),
        "tokenizer": InputSpec(TOKENIZER_TYPE, doc="the trained tokenizer"),
    },
    doc="§4.2 long-context extension (Table 6): phases of growing training length and RoPE base, each from the "
        "previous phase's weights on the pretraining loop (DeepSpeed, same launch as pretrain), with short/medium/"
        "long sources interpolated across each transition and ~10% long QA in each phase's last 20%. The long "
        "documents (same-domain corpus documents concatenated) and the long QA (a fact planted in a long document, "
        "asked for at its end) are made here and kept in the artifact. Every phase's checkpoint is kept; a killed "
        "run resumes in the phase it was in.",
    launches_workers=True,
    validate_resources=long_context_resource_problems,
)
