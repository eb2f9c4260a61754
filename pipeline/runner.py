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
from typing import Any

from pipeline.artifacts import ArtifactStore
from pipeline.registry import resolve
from pipeline.stage import Artifact, MetricSink, Resources, StageContext


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
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ[var] = n
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(n))


def execute_stage(task: StageTask) -> StageOutcome:
    os.chdir(task.cwd)
    if task.cwd not in sys.path:  # plugin stages (`uses: module:ATTR`) import relative to the launch dir
        sys.path.insert(0, task.cwd)
    os.environ.update(task.env)
    _limit_threads(task.resources.get("cpus", 1))
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

    sink: MetricSink
    if task.run_id and task.tracking_uri:
        from pipeline.tracking import MLflowSink

        sink = MLflowSink(task.tracking_uri, task.run_id)
    else:
        sink = MetricSink()
    tmp = store.begin(kind.name, task.key)
    ctx = StageContext(tmp, inputs, stage_name=task.stage, sink=sink,
                       resources=Resources(**{k: v for k, v in task.resources.items() if v is not None}),
                       work_dir=tmp.with_name(tmp.name + ".work"), resume_dir=store.resume_dir(kind.name, task.key))
    start = time.monotonic()
    try:
        kind.run(params, ctx)
        seconds = time.monotonic() - start
        sink.log_metrics({"stage_seconds": seconds}, None)
        sink.flush()
        art = store.commit(
            tmp, type_=kind.produces, schema_version=kind.schema_version, kind=kind.name, key=task.key,
            meta={
                "stage": task.stage,
                "uses": task.uses,
                "key_material": task.key_material,
                "rows": ctx.rows,
                "summary": ctx.summary,
                "seconds": round(seconds, 3),
                "producer": {"run_id": task.run_id, "tracking_uri": task.tracking_uri,
                             "host": socket.gethostname()},
            },
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        try:
            sink.flush()  # metrics logged just before a failure still reach the run
        finally:
            ctx.cleanup()
    shutil.rmtree(ctx.resume_dir, ignore_errors=True)  # committed: checkpoints of this attempt are done with
    return StageOutcome(path=str(art.path), digest=art.digest, seconds=seconds, summary=ctx.summary,
                        rows=ctx.rows)
