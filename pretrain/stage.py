"""Stage ``pretrain``: train the hybrid lightning/softmax MoE (``model/``) on the mixture (artifact ``checkpoint``).

Inputs: the ``mixture`` (how many times each document is trained on), the ``scored_documents`` it was planned
from (the texts) and the ``tokenizer``. The stage packs the mixture into rows (``pretrain/packed_data.py``), launches the
training processes (``pretrain/train.py``: one process for a CPU or one GPU, ``pretrain/local_ranks.py`` with one
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
    plots/            loss curve, expert load and drop-rate heat maps

Checkpoints live in the stage's resume directory (kept across a killed attempt, keyed by the cache key): a rerun
of ``hylight run`` continues from the last one. Across nodes every rank reads the packed rows and writes its
checkpoint shards there, and rank 0 writes the exports: the pipeline's artifact_root must be a filesystem all nodes
share.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from data.documents import SCORED_DOCUMENTS_TYPE
from data.mix import MIXTURE_TYPE
from data.retrieval import KINDS as RETRIEVAL_KINDS
from data.tokenizer import TOKENIZER_TYPE
from pipeline.artifacts import write_json_atomic
from pipeline.stage import InputSpec, Resources, StageContext, StageKind, StageParams
from pipeline.worker_env import launched_worker_env
from pretrain.sequence_parallel_checks import sequence_parallel_problems

CHECKPOINT_TYPE = "checkpoint"
LOSS_CURVE_FILE = "loss_curve.json"
LOSS_CURVE_FIELDS = ("step", "tokens", "loss", "lr")
# model.configuration.PATTERN_SHORTHANDS and ATTENTION_KINDS (a test pins them equal): checked here, at spec validation,
# where importing model/ (transformers, torch) would cost seconds for every `hylight validate`
ATTENTION_PATTERNS = ("hybrid", "all-lightning", "all-softmax")
ATTENTION_KINDS = ("lightning", "softmax")


class PretrainParams(StageParams):
    size: str = Field("tiny", description="Named model size (model/sizes.py): tiny, cpu-small, gpu-300m, gpu-1b.")
    model_overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "HybridConfig fields to override (e.g. num_hidden_layers, or attention_pattern: hybrid (§2: a softmax layer "
        "after every 7 lightning ones), all-lightning, all-softmax or a per-layer list, for the §2.2.2.3 ablation); "
        "vocab_size and the special token ids always come from the tokenizer."))
    seq_len: int = Field(256, ge=16, description="Tokens per packed row.")
    micro_batch_rows: int = Field(4, ge=1, description=(
        "Rows per forward call on each rank (with sequence_parallel: on each group, every rank holding a slice)."))
    batch_rows: int = Field(8, ge=1, description="Initial global batch in rows (gradient accumulation fills it).")
    max_batch_rows: int = Field(64, ge=1, description="Cap of the batch-size schedule.")
    double_batch_at_tokens: list[int] = Field(default_factory=list, description=(
        "Double the batch at these token counts (§4.2 batch-size schedule)."))
    double_batch_below_loss: list[float] = Field(default_factory=list, description=(
        "Double the batch when the smoothed training loss first falls below each value (critical-batch rule)."))
    train_tokens: int = Field(1_000_000, ge=1, description="Tokens to train on (global, counting padding).")
    peak_lr: float = Field(3e-3, gt=0, description="Peak learning rate of the WSD schedule.")
    warmup_frac: float = Field(0.05, ge=0, lt=1, description="Linear warm-up, as a fraction of the run.")
    decay_frac: float = Field(0.2, ge=0, lt=1, description="Final exponential fast decay, as a fraction of the run.")
    final_lr_ratio: float = Field(0.1, gt=0, le=1, description="lr at the end of the decay / peak lr.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay on matrices (report: 0.1).")
    beta1: float = Field(0.9, gt=0, lt=1, description="AdamW beta1 (report: 0.9).")
    beta2: float = Field(0.95, gt=0, lt=1, description="AdamW beta2 (report: 0.95).")
    grad_clip: float = Field(1.0, gt=0, description="Gradient clipping (global norm).")
    zero_stage: Literal[1, 2] = Field(1, description="DeepSpeed ZeRO stage (DeepSpeed refuses its MoE under 3).")
    expert_parallel_size: int = Field(1, ge=1, description="Ranks that split each layer's experts (DeepSpeed-MoE).")
    sequence_parallel: int = Field(1, ge=1, description=(
        "Ranks that split each row (sequence parallelism, §3.2.2 LASP+: lightning layers exchange only their d x d "
        "states, softmax layers all-gather K and V): each group of this many consecutive ranks is one data-parallel "
        "replica and every rank holds a contiguous 1/sequence_parallel of each of its rows, so a row too long for "
        "one GPU trains over several. It must divide the processes per node (default: the GPUs), and each row must "
        "split into equal slices of at least 16 tokens. batch_rows and micro_batch_rows count a group's rows once. "
        "Not with expert_parallel_size > 1 or compile. Token-drop capacity is per rank's slice: train dropless "
        "(token_drop: false) for the exact single-GPU result."))
    global_router: bool = Field(True, description=(
        "§2.1 global router: all-gather per-expert counts over the expert-parallel group; capacity applied globally."))
    token_drop: bool = Field(True, description="Capacity-based token drop in training (False: dropless).")
    capacity_factor: float = Field(1.25, gt=0, description="Expert capacity = ceil(factor x tokens x k / E).")
    min_capacity: int = Field(0, ge=0, description="Lower bound on capacity (DeepSpeed's own default is 4; the paper has none).")
    aux_loss_coef: float = Field(0.001, ge=0, description="alpha_aux of the balance loss (released MiniMax value).")
    checkpoint_every: int = Field(50, ge=1, description="Steps between checkpoints (plus one at the end).")
    log_every: int = Field(10, ge=1, description="Steps between metric logs.")
    eval_documents: int = Field(64, ge=1, description=(
        "Held-out documents for eval_loss (documents the mixture never samples first; taken out of training if "
        "there are not enough, and counted)."))
    eval_max_rows: int = Field(64, ge=1, description="Eval rows used for eval_loss.")
    seed: int = Field(0, ge=0, description="Packing order, loader order and initialisation.")
    spike_factor: float = Field(10.0, gt=1, description="Skip a step whose grad norm exceeds this x the recent median.")
    max_consecutive_skips: int = Field(5, ge=1, description="Stop with an error after this many skipped steps in a row.")
    max_spike_skips: int = Field(2, ge=0, description=(
        "Grad-norm spikes skipped in a row before a norm that stays high is taken (clipped) as the new level."))
    inject_nan_at_steps: list[int] = Field(default_factory=list, description="Fault injection (tests of the divergence guard).")
    lightning_impl: str = Field("auto", description="Lightning kernel: auto (Triton on CUDA, chunked PyTorch on CPU).")
    compile: bool = Field(False, description="torch.compile the model (GPU).")
    processes: int | None = Field(None, ge=1, description=(
        "Training ranks to launch on each node; default one per GPU of the stage's resources (1 on CPU). Several "
        "CPU ranks train with gloo (tests of expert parallelism)."))
    retrieval_share: float = Field(0.0, ge=0, lt=1, description=(
        "Share of the training rows made of retrieval-bearing samples (data/retrieval.py: a far-back span copied "
        "as the answer to a late query), from the run's own held-in text; 0: none. Our departure from the report "
        "(its data is not public): natural text alone teaches a small model no copying in a one-GPU budget."))
    retrieval_kinds: list[str] = Field(default_factory=lambda: list(RETRIEVAL_KINDS), description=(
        "Kinds of retrieval samples (repeat, continue, lookup, multi_lookup), drawn uniformly from this list: a kind "
        "listed twice is drawn twice as often."))
    retrieval_min_tokens: int = Field(256, ge=96, description=(
        "Shortest retrieval sample; lengths are drawn uniformly up to seq_len."))
    retrieval_loss: Literal["all", "answers"] = Field("all", description=(
        "What of a retrieval sample is a training target: 'all' (its natural-text context and its answer) or "
        "'answers' (the answer alone, so the copy targets weigh more in the loss; the plain rows still teach the text)."))
    probe_every: int = Field(0, ge=0, description=(
        "Steps between in-training retrieval probes on held-out text (copy accuracy, NIAH forced choice at seq_len; "
        "pretrain/probe.py), logged as probe_* metrics; 0: none. Not with sequence_parallel > 1."))
    probe_trials: int = Field(8, ge=1, description="NIAH forced-choice prompts and copy probes per in-training probe.")

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
    def _sequence_parallel(self) -> PretrainParams:
        problems = sequence_parallel_problems(self.sequence_parallel, seq_lens={"seq_len": self.seq_len},
                                              expert_parallel_size=self.expert_parallel_size, compile_=self.compile)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _batches(self) -> PretrainParams:
        if self.max_batch_rows < self.batch_rows:
            raise ValueError(f"max_batch_rows={self.max_batch_rows} < batch_rows={self.batch_rows}")
        if self.checkpoint_every % self.log_every:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must be a multiple of log_every={self.log_every} "
                             "(a resumed run then logs the same loss windows as an uninterrupted one)")
        problems = retrieval_problems(self, [self.seq_len])
        if problems:
            raise ValueError("; ".join(problems))
        if self.batch_rows % self.micro_batch_rows:
            raise ValueError(f"batch_rows={self.batch_rows} must be a multiple of micro_batch_rows={self.micro_batch_rows}")
        return self


def retrieval_problems(params: Any, seq_lens: list[int]) -> list[str]:
    """The retrieval rows' and the in-training probe's params against each other (pretrain and long_context)."""
    problems = []
    if params.probe_every % params.log_every:
        problems.append(f"probe_every={params.probe_every} must be a multiple of log_every={params.log_every} (the "
                        "probe's metrics join a logged step)")
    if params.probe_every and params.sequence_parallel > 1:
        problems.append("probe_every needs sequence_parallel 1 (the probe runs whole rows on every rank)")
    if not params.retrieval_kinds or set(params.retrieval_kinds) - set(RETRIEVAL_KINDS):
        problems.append(f"retrieval_kinds={params.retrieval_kinds}: a non-empty list of {', '.join(RETRIEVAL_KINDS)}")
    if params.retrieval_share and params.retrieval_min_tokens > min(seq_lens):
        problems.append(f"retrieval_min_tokens={params.retrieval_min_tokens} is longer than a row "
                        f"({min(seq_lens)} tokens)")
    return problems


def ranks_per_node(processes: int | None, gpus: float) -> int:
    """Training ranks on each node: ``processes``, by default one per GPU (1 on a CPU)."""
    return processes or max(1, int(gpus))


def sequence_parallel_rank_problems(params: Any, resources: Any) -> list[tuple[str, str]]:
    """``sequence_parallel`` against the ranks per node (``StageKind.validate_resources`` of pretrain and
    long_context, and their ``run``): a group of consecutive ranks stays on one node."""
    sp, per_node = params.sequence_parallel, ranks_per_node(params.processes, resources.gpus)
    if per_node % sp == 0:
        return []
    how = f"processes={params.processes}" if params.processes else f"one per GPU, resources.gpus={resources.gpus:g}"
    return [("params.sequence_parallel", f"sequence_parallel={sp} must divide the {per_node} training processes per "
             f"node ({how}): each group of {sp} consecutive ranks, on one node, splits one row")]


def check_rank_layout(params: Any, resources: Any, stage: str) -> None:
    """:func:`sequence_parallel_rank_problems` as an error, for a stage run without spec validation."""
    problems = sequence_parallel_rank_problems(params, resources)
    if problems:
        raise ValueError(f"{stage}: " + "; ".join(msg for _, msg in problems))


def _train_command(config_path: Path, world: int) -> list[str]:
    if world == 1:
        return [sys.executable, "-m", "pretrain.train", "--config", str(config_path)]
    return [sys.executable, "-m", "pretrain.local_ranks", str(world), "-m", "pretrain.train", "--config",
            str(config_path)]


class _Relay:
    """Turns the ranks' ``@@hylight`` lines into MLflow metrics / progress; other lines are shown as they come."""

    def __init__(self, ctx: StageContext):
        self.ctx, self.summary = ctx, {}

    def __call__(self, line: str) -> None:
        from pretrain.train import METRIC_PREFIX  # heavy: torch

        if not line.startswith(METRIC_PREFIX):
            if line.strip():
                self.ctx.progress(line)
            return
        msg = json.loads(line[len(METRIC_PREFIX):])
        if msg["kind"] == "metrics":
            self.ctx.log_metrics(msg["metrics"], step=msg["step"])
        elif msg["kind"] == "progress":
            self.ctx.progress(msg["message"])
        elif msg["kind"] == "summary":
            self.summary = msg["summary"]


def _ray_train_rank(config: dict[str, str]) -> None:
    """What each Ray Train worker runs: the entry point of a CLI rank (``python -m pretrain.train``)."""
    from pretrain.train import run_rank  # heavy: torch

    run_rank(config["config"], events_path=config["events"])


class _EventsTail(threading.Thread):
    """Follows the file rank 0 of a Ray Train job writes its stdout to, passing each complete line to the relay.
    A relay error stops the relaying (the job runs on to its end; the stage raises it then)."""

    def __init__(self, path: Path, relay: _Relay):
        super().__init__(name="pretrain-events", daemon=True)
        self.path, self.relay = path, relay
        self.done, self.error = threading.Event(), None

    def run(self) -> None:
        with open(self.path, encoding="utf-8", errors="replace") as f:
            partial = ""
            while True:
                ended = self.done.is_set()  # read once more after the job ended: its last lines
                partial += f.read()
                *lines, partial = partial.split("\n")
                for line in lines:
                    if self.error is None:
                        try:
                            self.relay(line)
                        except Exception as e:  # noqa: BLE001 (the stage raises it after the run)
                            self.error = e
                if ended:
                    return
                time.sleep(0.2)

    def stop(self) -> None:
        """Relay what is left and return."""
        self.done.set()
        self.join()


def _launch_ray_train(config_path: Path, resources: Resources, ranks_per_node: int, relay: _Relay,
                      ctx: StageContext, export_dir: Path | None = None) -> None:
    """``nodes`` x ``ranks_per_node`` ranks as Ray Train workers (``TorchTrainer``), each with its share of a node's
    ``cpus``/``gpus``; Ray Train sets up their process group (gloo, or NCCL with GPUs) before they call
    :func:`pretrain.train.run_rank`. Rank 0's metric lines come back through a file in the stage's work dir; it
    writes its summary to ``export_dir`` (default the stage's output directory)."""
    export_dir = ctx.out_dir if export_dir is None else export_dir
    import ray
    from ray.train import RunConfig, ScalingConfig, TrainingFailedError, WorkerGroupError
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        raise RuntimeError(
            f"{ctx.stage_name}: with resources.nodes={resources.nodes}, or resources its own task was not given, the "
            "stage runs its ranks as Ray Train workers, which needs Ray: run it with `hylight run` (--ray-address "
            "for a cluster)")
    cpus, gpus = resources.cpus / ranks_per_node, resources.gpus / ranks_per_node
    events = ctx.work_dir / "rank0_stdout.log"
    events.write_text("")
    env = {**launched_worker_env(cpus, gpus), "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath(),
           "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}  # else Ray Train copies every print to its log: each line twice
    trainer = TorchTrainer(
        _ray_train_rank,
        train_loop_config={"config": str(config_path), "events": str(events)},
        scaling_config=ScalingConfig(num_workers=ranks_per_node * resources.nodes, use_gpu=gpus > 0,
                                     resources_per_worker={"CPU": cpus, **({"GPU": gpus} if gpus else {})}),
        # Ray Train keeps its run state (no checkpoints: DeepSpeed writes those to the resume dir) in storage_path
        run_config=RunConfig(name=f"{ctx.work_dir.name}-{config_path.stem}",  # a run per config (long_context phases)
                             storage_path=str(ctx.work_dir / "ray_train"),
                             worker_runtime_env={"env_vars": env}),
    )
    tail = _EventsTail(events, relay)
    tail.start()
    main_thread = threading.current_thread() is threading.main_thread()
    sigint = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        trainer.fit()  # a failed or killed worker ends the run; Ray Train stops the others
    except WorkerGroupError as e:
        failed = ", ".join(f"rank {rank}: {type(err).__name__}: {err}".splitlines()[0]
                           for rank, err in sorted(e.worker_failures.items()))
        raise RuntimeError(f"{ctx.stage_name}: training failed on Ray Train workers ({failed})\n{e}") from None
    except TrainingFailedError as e:
        raise RuntimeError(f"{ctx.stage_name}: Ray Train failed: {e}") from None
    finally:
        if main_thread:  # fit() installs a SIGINT handler in the (reused) Ray worker process: put the old one back
            signal.signal(signal.SIGINT, sigint)
        tail.stop()
    if tail.error is not None:
        raise tail.error
    if not (export_dir / "summary.json").exists():
        import socket

        raise RuntimeError(
            f"{ctx.stage_name}: the Ray Train workers finished, but what rank 0 wrote to {export_dir} is not visible "
            f"to the stage's process on {socket.gethostname()}: the pipeline's artifact_root must be a filesystem "
            "every node shares, at the same path (README, 'Multi-node training')")


@dataclass(frozen=True)
class RankLayout:
    """Where a training stage's ranks run: ``per_node`` ranks on each of the stage's nodes, ``world`` in all, as Ray
    Train workers when they span nodes or the stage's own task holds nothing (GPUs on a Ray cluster): a process
    started here could not use resources Ray never gave this task (pipeline/orchestrator.py)."""

    per_node: int
    world: int
    ray_train: bool

    @classmethod
    def of(cls, processes: int | None, r: Resources, stage: str) -> RankLayout:
        per_node = ranks_per_node(processes, r.gpus)
        if r.gpus and per_node > int(r.gpus):
            raise ValueError(f"{stage}: processes={per_node} but the stage has {r.gpus:g} GPUs per node "
                             "(one rank each)")
        return cls(per_node, per_node * r.nodes, r.nodes > 1 or not r.reserved_for_task)


def launch_ranks(cfg: Any, layout: RankLayout, relay: _Relay, ctx: StageContext, *, name: str,
                 config_name: str = "train_config.json") -> None:
    """Run :func:`pretrain.train.run_rank` on every rank of ``layout`` with ``cfg`` (a ``TrainConfig``, written to
    the work dir): one process or ``pretrain.local_ranks`` under ``run_process_tree``, or Ray Train workers. Returns
    when they are done; a failed rank raises."""
    from dataclasses import asdict

    from pipeline.launch import run_process_tree  # looked up per call: tests replace it

    config_path = ctx.work_dir / config_name
    config_path.write_text(json.dumps(asdict(cfg), indent=2))
    if layout.ray_train:
        _launch_ray_train(config_path, ctx.resources, layout.per_node, relay, ctx, Path(cfg.export_dir))
    else:
        threads = max(1, int(ctx.resources.cpus) // layout.world)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()}
        run_process_tree(_train_command(config_path, layout.world), env=env, cwd=os.getcwd(), log=relay, name=name)


def _pythonpath() -> str:
    """This checkout first: the ranks import ``pretrain`` from the same code as the stage."""
    return os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])


def run(params: PretrainParams, ctx: StageContext) -> None:
    from pretrain.packed_data import build_packed_dataset  # heavy: torch
    from pretrain.train import TrainConfig  # heavy: torch

    check_rank_layout(params, ctx.resources, "pretrain")
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
            from tokenizers import Tokenizer

            from pretrain.retrieval_rows import add_retrieval_rows, retrieval_rows_for  # heavy: torch

            add_retrieval_rows(tmp, Tokenizer.from_file(str(tokenizer.path / "tokenizer.json")),
                               added_rows=retrieval_rows_for(info.train.rows, params.retrieval_share),
                               seed=params.seed, kinds=params.retrieval_kinds,
                               min_tokens=params.retrieval_min_tokens, loss_on=params.retrieval_loss,
                               progress=ctx.progress)
        os.replace(tmp, data_dir)
    from pretrain.retrieval_rows import read_retrieval, retrieval_metrics  # heavy: torch

    ctx.log_metrics(retrieval_metrics(read_retrieval(data_dir)))
    shutil.copy2(data_dir / "packing.json", ctx.out_dir / "packing.json")
    packing = json.loads((data_dir / "packing.json").read_text())

    r = ctx.resources
    layout = RankLayout.of(params.processes, r, "pretrain")
    world = layout.world
    fields = {k: v for k, v in params.model_dump().items()
              if k not in ("double_batch_at_tokens", "double_batch_below_loss", "eval_documents", "processes",
                           "retrieval_share", "retrieval_kinds", "retrieval_min_tokens", "retrieval_loss")}
    cfg = TrainConfig(data_dir=str(data_dir), tokenizer_dir=str(tokenizer.path), resume_dir=str(ctx.resume_dir),
                      export_dir=str(ctx.out_dir), double_at_tokens=params.double_batch_at_tokens,
                      double_below_loss=params.double_batch_below_loss, **fields)
    relay = _Relay(ctx)
    where = f" on {r.nodes} node(s) through Ray Train" if layout.ray_train else ""
    split = (f" ({world // params.sequence_parallel} data-parallel x {params.sequence_parallel} sequence-parallel)"
             if params.sequence_parallel > 1 else "")
    ctx.progress(f"training {params.size} on {packing['train']['rows']:,} rows x {params.seq_len} tokens, "
                 f"{world} process(es){split}{where}, target {params.train_tokens:,} tokens")
    launch_ranks(cfg, layout, relay, ctx, name="pretrain")

    summary = json.loads((ctx.out_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (ctx.out_dir / "train_log.jsonl").read_text().splitlines() if line]
    write_loss_curve(ctx.out_dir, history)
    _plots(ctx, history)
    last = history[-1] if history else {}
    from pretrain.probe import PROBE_METRICS, probe_history  # heavy: torch

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
    ctx.set_tags({"hylight.model_size": params.size, "hylight.world_size": world,
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

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
    records=("summary.json", "train_log.jsonl", "plots/*"),
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
    validate_resources=sequence_parallel_rank_problems,
)
