"""Launching a training stage's ranks: where they run, what layouts work, and how their events reach MLflow.

- :func:`layout_problems`: every rule on the rank layout (rows split over sequence-parallel groups, groups within a
  node, one rank per GPU). Both training stages' params validation, their ``validate_resources`` and their ``run``
  call it, so a DAG and a stage built in code are refused with the same words.
- :class:`RankLayout`: ranks per node and in all, and whether they run as Ray Train workers.
- :func:`launch_ranks`: :func:`pretrain.train.run_rank` on every rank, as one process or ``pretrain.local_ranks``
  under ``pipeline.launch.run_process_tree`` (nothing outlives a cancelled stage), or as Ray Train workers.
- :class:`Relay` / :class:`EventsTail`: rank 0's ``@@hylight`` lines (``pretrain/events.py``) to MLflow, from its
  stdout or, under Ray Train, from the file it writes them to.

No torch here: the params' validation imports this module.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pipeline.launch
from pipeline.stage import Resources, StageContext
from pipeline.worker_env import launched_worker_env
from pretrain import events
from pretrain.engine_config import EngineConfig

MIN_TOKENS_PER_SEQUENCE_RANK = 16  # the smallest chunk of the Triton lightning kernel


# --- the layout ------------------------------------------------------------------------------------------------


def ranks_per_node(processes: int | None, gpus: float) -> int:
    """Training ranks on each node: ``processes``, by default one per GPU (1 on a CPU)."""
    return processes or max(1, int(gpus))


def layout_problems(params: Any, resources: Resources | None = None) -> list[tuple[str, str]]:
    """What makes the rank layout of a training stage's ``params`` impossible, as (field, message) pairs (none: []).

    ``params``: a training stage's params (``pretrain/params.py``; their ``row_lengths()`` name the row length
    fields). Without ``resources`` (the params' own validation) the rules on the params alone; with them
    (``StageKind.validate_resources`` and the stage's ``run``) also those on the ranks per node."""
    problems: list[tuple[str, str]] = []
    sp, ep = params.sequence_parallel, params.expert_parallel_size
    field = "params.sequence_parallel"
    if sp > 1:
        for name, n in params.row_lengths().items():
            if n % sp:
                problems.append((field, f"{name}={n} is not divisible by sequence_parallel={sp}: each rank of a group "
                                 f"holds an equal slice of every row; make it a multiple of {sp}"))
            elif n // sp < MIN_TOKENS_PER_SEQUENCE_RANK:
                problems.append((field, f"{name}={n} over sequence_parallel={sp} leaves {n // sp} tokens per rank, "
                                 f"fewer than {MIN_TOKENS_PER_SEQUENCE_RANK} (one chunk of the lightning kernel); "
                                 "sequence parallelism is for rows too long for one GPU: lower sequence_parallel"))
        if ep > 1:
            problems.append((field, f"sequence_parallel={sp} with expert_parallel_size={ep}: the two are not "
                             "supported together (the expert all-to-all groups would cut across the "
                             "sequence-parallel groups, untested); use one of them"))
        if params.compile:
            problems.append((field, f"compile: true with sequence_parallel={sp} is not supported: the "
                             "sequence-parallel attention and MoE wrappers run collectives that the compiled layers "
                             "have not been tested to trace; set compile: false"))
    if resources is None:
        return problems
    per_node = ranks_per_node(params.processes, resources.gpus)
    if per_node % sp:
        how = (f"processes={params.processes}" if params.processes
               else f"one per GPU, resources.gpus={resources.gpus:g}")
        problems.append((field, f"sequence_parallel={sp} must divide the {per_node} training processes per node "
                         f"({how}): each group of {sp} consecutive ranks, on one node, splits one row"))
    if resources.gpus and per_node > int(resources.gpus):
        problems.append(("params.processes", f"processes={per_node} but the stage has {resources.gpus:g} GPUs per "
                         "node (one rank each)"))
    return problems


def check_layout(params: Any, resources: Resources, stage: str) -> None:
    """:func:`layout_problems` as an error, for a stage run without spec validation."""
    problems = layout_problems(params, resources)
    if problems:
        raise ValueError(f"{stage}: " + "; ".join(msg for _, msg in problems))


@dataclass(frozen=True)
class RankLayout:
    """Where a training stage's ranks run: ``per_node`` ranks on each of the stage's nodes, ``world`` in all, as Ray
    Train workers when they span nodes or the stage's own task holds nothing (GPUs on a Ray cluster): a process
    started here could not use resources Ray never gave this task (pipeline/orchestrator.py)."""

    per_node: int
    world: int
    ray_train: bool

    @classmethod
    def of(cls, processes: int | None, r: Resources) -> RankLayout:
        per_node = ranks_per_node(processes, r.gpus)
        return cls(per_node, per_node * r.nodes, r.nodes > 1 or not r.reserved_for_task)


# --- the ranks' events -----------------------------------------------------------------------------------------


class Relay:
    """Turns the ranks' ``@@hylight`` lines into MLflow metrics / progress; other lines are shown as they come."""

    def __init__(self, ctx: StageContext):
        self.ctx, self.summary = ctx, {}

    def __call__(self, line: str) -> None:
        msg = events.parse(line)
        if msg is None:
            if line.strip():
                self.ctx.progress(line)
            return
        if msg["kind"] == "metrics":
            self.ctx.log_metrics(msg["metrics"], step=msg["step"])
        elif msg["kind"] == "progress":
            self.ctx.progress(msg["message"])
        elif msg["kind"] == "summary":
            self.summary = msg["summary"]


class EventsTail(threading.Thread):
    """Follows the file rank 0 of a Ray Train job writes its stdout to, passing each complete line to the relay.
    A relay error stops the relaying (the job runs on to its end; the stage raises it then)."""

    def __init__(self, path: Path, relay: Relay):
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


# --- launching -------------------------------------------------------------------------------------------------


def launch_ranks(cfg: EngineConfig, layout: RankLayout, relay: Relay, ctx: StageContext, *, name: str,
                 config_name: str = "train_config.json") -> None:
    """Run :func:`pretrain.train.run_rank` on every rank of ``layout`` with ``cfg`` (written to the work dir): one
    process or ``pretrain.local_ranks`` under ``run_process_tree``, or Ray Train workers. Returns when they are
    done; a failed rank raises."""
    config_path = ctx.work_dir / config_name
    cfg.write(config_path)
    if layout.ray_train:
        launch_ray_train(config_path, ctx.resources, layout.per_node, relay, ctx, Path(cfg.export_dir))
    else:
        threads = max(1, int(ctx.resources.cpus) // layout.world)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()}
        # looked up per call (pipeline.launch.run_process_tree): tests replace it
        pipeline.launch.run_process_tree(_train_command(config_path, layout.world), env=env, cwd=os.getcwd(),
                                         log=relay, name=name)


def _train_command(config_path: Path, world: int) -> list[str]:
    if world == 1:
        return [sys.executable, "-m", "pretrain.train", "--config", str(config_path)]
    return [sys.executable, "-m", "pretrain.local_ranks", str(world), "-m", "pretrain.train", "--config",
            str(config_path)]


def _pythonpath() -> str:
    """This checkout first: the ranks import ``pretrain`` from the same code as the stage."""
    return os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])


def _ray_train_rank(config: dict[str, str]) -> None:
    """What each Ray Train worker runs: the entry point of a CLI rank (``python -m pretrain.train``)."""
    from pretrain.train import run_rank  # heavy: torch, deepspeed (a Ray Train worker's own process)

    run_rank(config["config"], events_path=config["events"])


def launch_ray_train(config_path: Path, resources: Resources, ranks_per_node: int, relay: Relay,
                     ctx: StageContext, export_dir: Path | None = None) -> None:
    """``nodes`` x ``ranks_per_node`` ranks as Ray Train workers (``TorchTrainer``), each with its share of a node's
    ``cpus``/``gpus``; Ray Train sets up their process group (gloo, or NCCL with GPUs) before they call
    :func:`pretrain.train.run_rank`. Rank 0's metric lines come back through a file in the stage's work dir; it
    writes its summary to ``export_dir`` (default the stage's output directory)."""
    export_dir = ctx.out_dir if export_dir is None else export_dir
    import ray  # heavy: ray (only multi-node and Ray-cluster stages)
    from ray.train import RunConfig, ScalingConfig, TrainingFailedError, WorkerGroupError
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        raise RuntimeError(
            f"{ctx.stage_name}: with resources.nodes={resources.nodes}, or resources its own task was not given, the "
            "stage runs its ranks as Ray Train workers, which needs Ray: run it with `hylight run` (--ray-address "
            "for a cluster)")
    cpus, gpus = resources.cpus / ranks_per_node, resources.gpus / ranks_per_node
    events_file = ctx.work_dir / "rank0_stdout.log"
    events_file.write_text("")
    env = {**launched_worker_env(cpus, gpus), "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath(),
           "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}  # else Ray Train copies every print to its log: each line twice
    trainer = TorchTrainer(
        _ray_train_rank,
        train_loop_config={"config": str(config_path), "events": str(events_file)},
        scaling_config=ScalingConfig(num_workers=ranks_per_node * resources.nodes, use_gpu=gpus > 0,
                                     resources_per_worker={"CPU": cpus, **({"GPU": gpus} if gpus else {})}),
        # Ray Train keeps its run state (no checkpoints: DeepSpeed writes those to the resume dir) in storage_path
        run_config=RunConfig(name=f"{ctx.work_dir.name}-{config_path.stem}",  # a run per config (long_context phases)
                             storage_path=str(ctx.work_dir / "ray_train"),
                             worker_runtime_env={"env_vars": env}),
    )
    tail = EventsTail(events_file, relay)
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
        raise RuntimeError(
            f"{ctx.stage_name}: the Ray Train workers finished, but what rank 0 wrote to {export_dir} is not visible "
            f"to the stage's process on {socket.gethostname()}: the pipeline's artifact_root must be a filesystem "
            "every node shares, at the same path (README, 'Multi-node training')")
