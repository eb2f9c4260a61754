"""Executes one stage: the body of the Ray task, also callable in-process.

It receives only paths and plain data (a :class:`StageTask`), runs the stage's entry point in a private
temp directory, and commits the artifact atomically. Anything that fails leaves no accepted artifact.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import worker_env
from pipeline.artifacts import ArtifactStore, explain_write_failure
from pipeline.registry import resolve
from pipeline.shards import RayShardRunner
from pipeline.stage import Artifact, MetricSink, Resources, StageContext
from pipeline.tracking import JOURNAL_DIR, MLflowSink
from pipeline.worker_env import THREAD_VARS, apply_env_defaults


@dataclass
class StageTask:
    stage: str
    uses: str
    params: dict[str, Any]
    resources: dict[str, Any]
    inputs: dict[str, list[str]]  # role -> artifact paths
    root: str
    key: str
    key_material: dict[str, Any]
    cwd: str
    tracking_uri: str | None = None
    run_id: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class StageOutcome:
    path: str
    digest: str
    seconds: float
    summary: dict[str, float]
    rows: dict[str, int]


def _limit_threads(cpus: float) -> None:
    n = str(max(1, int(cpus)))
    for var in THREAD_VARS:
        os.environ[var] = n
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(n))


def _enter(task: StageTask) -> None:
    """Working directory and environment of the stage, as on the machine `hylight run` started on."""
    try:
        os.chdir(task.cwd)
    except OSError as e:
        raise RuntimeError(
            f"stage {task.stage!r}: cannot enter {task.cwd!r} (the directory `hylight run` was started "
            f"from) on node {socket.gethostname()}: {e}. On a Ray cluster every node needs the same "
            "checkout at the same path (docs/pipeline.md, 'Running on a Ray cluster').") from None
    if task.cwd not in sys.path:  # plugin stages (`uses: module:ATTR`) import relative to the launch dir
        sys.path.insert(0, task.cwd)
    os.environ.update(task.env)
    r = task.resources
    held_gpus = (r.get("gpus") or 0) if r.get("reserved_for_task", True) else 0
    if not held_gpus:
        # a stage sees the GPUs it was granted and no others (Ray leaves a GPU-less task's
        # CUDA_VISIBLE_DEVICES alone, so it would otherwise see, and could grab, every GPU of the node)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    apply_env_defaults(gpus=held_gpus, user_set=task.env)
    _limit_threads(r.get("cpus", 1))


def _restore_env(saved: dict[str, str]) -> None:
    """Undo a stage's environment changes: Ray reuses worker processes for later tasks."""
    for k in [k for k in os.environ if k not in saved]:
        del os.environ[k]
    for k, v in saved.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


def _ray_connected() -> bool:
    """Whether this process runs under Ray (a stage task is always connected; an in-process call may not be)."""
    if "ray" not in sys.modules:
        return False
    return bool(sys.modules["ray"].is_initialized())


def execute_stage(task: StageTask) -> StageOutcome:
    saved_env, saved_cwd, saved_defaulted = dict(os.environ), os.getcwd(), set(worker_env._DEFAULTED)
    torch = sys.modules.get("torch")
    saved_threads = torch.get_num_threads() if torch is not None else None
    try:
        return _execute(task)
    finally:
        _restore_env(saved_env)
        worker_env._DEFAULTED.intersection_update(saved_defaulted)
        os.chdir(saved_cwd)
        if saved_threads is not None:
            torch.set_num_threads(saved_threads)


def _execute(task: StageTask) -> StageOutcome:
    _enter(task)
    kind = resolve(task.uses)
    params = kind.params.model_validate(task.params)
    store = ArtifactStore(task.root)
    inputs: dict[str, Artifact | list[Artifact]] = {}
    for role, paths in task.inputs.items():
        arts = [Artifact.load(p) for p in paths]
        spec = kind.inputs[role]
        if spec.many:
            inputs[role] = arts
        elif arts:
            inputs[role] = arts[0]

    tmp = store.begin(kind.name, task.key)
    sink: MetricSink
    if task.run_id and task.tracking_uri:
        # out_dir: artifacts it could not send yet are found again in the committed artifact
        sink = MLflowSink(task.tracking_uri, task.run_id, journal_dir=Path(task.root) / JOURNAL_DIR, out_dir=tmp)
    else:
        sink = MetricSink()
    ctx = StageContext(tmp, inputs, stage_name=task.stage, sink=sink,
                       resources=Resources(**{k: v for k, v in task.resources.items() if v is not None}),
                       work_dir=tmp.with_name(tmp.name + ".work"), resume_dir=store.resume_dir(kind.name, task.key))
    if kind.splits_work and ctx.resources.tasks > 1 and _ray_connected():
        ctx.shard_runner = RayShardRunner(ctx.resources.tasks)
    start, started_unix = time.monotonic(), time.time()
    # when the body ran and on which GPUs (MLflow's run start is when the stage was submitted, which on a busy
    # machine can be long before it got its GPU): what shows which stages ran at once
    placement = {"hylight.started_unix": f"{started_unix:.1f}",
                 "hylight.gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "") if ctx.resources.gpus else ""}
    sink.set_tags(placement)
    try:
        kind.run(params, ctx)
        seconds = time.monotonic() - start
        sink.log_metrics({"stage_seconds": seconds}, None)
        sink.set_tags({"hylight.ended_unix": f"{started_unix + seconds:.1f}"})
        sink.flush()
        art = store.commit(
            tmp, type_=kind.produces, schema_version=kind.schema_version, kind=kind.name, key=task.key,
            records=kind.records,
            meta={
                "stage": task.stage,
                "uses": task.uses,
                "key_material": task.key_material,
                "rows": ctx.rows,
                "summary": ctx.summary,
                "seconds": round(seconds, 3),
                "started_unix": round(started_unix, 3),
                "gpus": placement["hylight.gpus"],
                "producer": {"run_id": task.run_id, "tracking_uri": task.tracking_uri,
                             "host": socket.gethostname()},
            },
        )
    except BaseException as e:
        full = explain_write_failure(e, task.stage, [tmp, ctx.work_dir, ctx.resume_dir], store.root)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from e
        raise
    finally:
        try:
            sink.flush()  # metrics logged just before a failure still reach the run
        finally:
            ctx.cleanup()
    shutil.rmtree(ctx.resume_dir, ignore_errors=True)  # committed: checkpoints of this attempt are done with
    return StageOutcome(path=str(art.path), digest=art.digest, seconds=seconds, summary=ctx.summary,
                        rows=ctx.rows)
