"""The orchestrator's own cost per stage: a DAG of N trivial stages, run cold and then warm.

Usage: python bench/bench_orchestrator.py [--stages 200] [--shape chain|fan|both] [--root DIR]

Each stage is ``bench.bench_orchestrator:NOOP`` (a bench-only plugin kind, not in the registry): it writes
one small file, so what a run costs is the orchestrator's work. Runs go through the real orchestrator
(``pipeline.orchestrator.run_pipeline``: local Ray, the embedded sqlite MLflow store, the artifact cache):

- cold: every stage runs as a Ray task (a ``chain`` runs them one after another, a ``fan`` runs one root and
  N-1 leaves that need it, as many at once as Ray's CPUs allow);
- warm: the same spec again, every stage a cache hit (no Ray at all).

Where the driver's time goes is measured by timing the real functions (wrapped for the run, then restored):
every MLflow client call (they all go through ``tracking.retry``, grouped by call), the cache-key work
(``code_digest``, ``cache_key``, ``ArtifactStore.lookup``), Ray start and task submission. In the workers,
each NOOP writes when it started, which splits a task's round trip into launch (submit → stage code starts)
and finish (stage code starts → the driver has the result: the stage's MLflow sink, the artifact commit, the
result's way back). Prints a markdown table per shape.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.metadata as md
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/bench_orchestrator.py` puts bench/, not the repo, on the path
    sys.path.insert(0, str(REPO))

from pipeline.stage import InputSpec, StageContext, StageKind, StageParams  # noqa: E402


class NoopParams(StageParams):
    index: int = 0


def run_noop(params: NoopParams, ctx: StageContext) -> None:
    started = time.time()
    (ctx.out_dir / "noop.json").write_text(json.dumps({"index": params.index, "started": started}))
    ctx.log_summary({"index": params.index})


# a bench-only kind (named by import path in the spec, never registered)
NOOP = StageKind(name="bench_noop", params=NoopParams, run=run_noop, produces="bench_noop",
                 inputs={"upstream": InputSpec("bench_noop", many=True, required=False)})


def write_spec(path: Path, n: int, shape: str) -> None:
    import yaml

    stages: dict[str, Any] = {}
    for i in range(n):
        st: dict[str, Any] = {"uses": "bench.bench_orchestrator:NOOP", "params": {"index": i}}
        if i and shape == "chain":
            st["needs"] = [f"s{i - 1:03d}"]
        elif i and shape == "fan":
            st["needs"] = ["s000"]
        stages[f"s{i:03d}"] = st
    path.write_text(yaml.safe_dump({"name": f"bench-{shape}", "stages": stages}, sort_keys=False))


class Timers:
    """Wall time and calls of real functions, attributed by label, while installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, label: str | None = None, by_first_arg: bool = False) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            name = label or attr
            if by_first_arg:  # tracking.retry(fn, ...): the MLflow call it makes
                name = f"{name}:{getattr(args[0], '__name__', '?')}"
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        self._undo.append((owner, attr, original))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def timed_run(spec_path: Path, root: Path) -> tuple[float, Any, Timers, dict[str, float]]:
    import ray

    from pipeline import orchestrator, tracking
    from pipeline.artifacts import ArtifactStore
    from pipeline.orchestrator import RunOptions, local_capacity, run_pipeline
    from pipeline.spec import load_spec

    spec = load_spec(spec_path, overrides=[f"artifact_root={root}"], capacity=local_capacity())
    timers = Timers()
    timers.wrap(tracking, "retry", "mlflow", by_first_arg=True)
    timers.wrap(tracking, "client", "mlflow:client")
    timers.wrap(orchestrator, "code_digest")
    timers.wrap(orchestrator, "cache_key")
    timers.wrap(ArtifactStore, "lookup", "cache lookup")
    timers.wrap(orchestrator.Orchestrator, "_ensure_ray", "ray start")
    timers.wrap(orchestrator.Orchestrator, "_submit", "ray submit")
    timers.wrap(ray, "wait", "ray wait")
    timers.wrap(ray, "get", "ray get")
    submitted: dict[str, float] = {}
    collected: dict[str, float] = {}
    submit = orchestrator.Orchestrator._submit

    def stamp_submit(self: Any, task: Any, st: Any) -> Any:
        submitted[task.stage] = time.time()
        return submit(self, task, st)

    collect = orchestrator.Orchestrator._collect

    def stamp_collect(self: Any, ref: Any, name: str, *args: Any) -> Any:
        collected[name] = time.time()
        return collect(self, ref, name, *args)

    orchestrator.Orchestrator._submit, orchestrator.Orchestrator._collect = stamp_submit, stamp_collect
    try:
        with open(os.devnull, "w") as quiet:
            t0 = time.perf_counter()
            report = run_pipeline(spec, RunOptions(heartbeat_s=1e9), out=quiet)
            wall = time.perf_counter() - t0
    finally:
        orchestrator.Orchestrator._submit, orchestrator.Orchestrator._collect = submit, collect
        timers.restore()
    if not report.ok:
        sys.exit(f"{spec_path}: run failed: {[(r.name, r.state, r.error) for r in report.stages.values()]}")
    launch, finish = [], []
    for name, t_submit in submitted.items():
        started = json.loads((Path(report.stages[name].artifact) / "noop.json").read_text())["started"]
        launch.append(started - t_submit)
        finish.append(collected[name] - started)
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
    worker = {"launch": sum(launch), "finish": sum(finish), "tasks": len(launch),
              "launch_median": med(launch), "finish_median": med(finish), "first_launch": launch[0] if launch else 0.0}
    return wall, report, timers, worker


def table(shape: str, n: int, runs: list[tuple[str, float, Any, Timers, dict[str, float]]]) -> str:
    lines = [f"\n### {shape}: {n} stages\n", "| | " + " | ".join(r[0] for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    lines.append("| wall s (per stage ms) | " + " | ".join(f"{w:.1f} ({1000 * w / n:.0f})" for _, w, *_ in runs) + " |")
    states = [collections.Counter(s.state for s in rep.stages.values()) for _, _, rep, _, _ in runs]
    lines.append("| stages | " + " | ".join(", ".join(f"{v} {k}" for k, v in c.items()) for c in states) + " |")
    labels = sorted({k for *_, t, _ in runs for k in t.seconds}, key=lambda k: -max(r[3].seconds.get(k, 0) for r in runs))
    mlflow_total = [sum(v for k, v in t.seconds.items() if k.startswith("mlflow")) for *_, t, _ in runs]
    lines.append("| driver: all MLflow calls, s (per stage ms) | "
                 + " | ".join(f"{s:.1f} ({1000 * s / n:.0f})" for s in mlflow_total) + " |")
    for k in labels:
        cells = []
        for *_, t, _ in runs:
            s, c = t.seconds.get(k, 0.0), t.calls.get(k, 0)
            cells.append(f"{s:.2f} s / {c}" if c else "-")
        lines.append(f"| driver: {k} (s / calls) | " + " | ".join(cells) + " |")
    for part in ("launch", "finish"):
        cells = [f"{w[part]:.1f} s; median {1000 * w[part + '_median']:.0f} ms" if w["tasks"] else "-"
                 for *_, w in runs]
        lines.append(f"| tasks: {part} (sum; median per task) | " + " | ".join(cells) + " |")
    lines.append("| tasks: first launch (worker start) s | "
                 + " | ".join(f"{w['first_launch']:.1f}" if w["tasks"] else "-" for *_, w in runs) + " |")
    lines.append("\n`ray submit` includes `ray start` (the first submit starts Ray); `mlflow:client` is mostly the "
                 "first `import mlflow`.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=200)
    ap.add_argument("--shape", choices=("chain", "fan", "both"), default="both")
    ap.add_argument("--root", default=None)
    args = ap.parse_args()
    os.chdir(REPO)  # stage workers import the plugin kind relative to the launch directory
    tmp = Path(args.root or tempfile.mkdtemp(prefix="hylight-bench-orch-"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["HYLIGHT_STATE_DIR"] = str(tmp / "state")
    from pipeline.worker_env import apply_env_defaults

    apply_env_defaults()
    shapes = ("chain", "fan") if args.shape == "both" else (args.shape,)
    vers = " ".join(f"{p} {md.version(p)}" for p in ("ray", "mlflow", "sqlalchemy"))
    print(f"`python bench/bench_orchestrator.py --stages {args.stages} --shape {args.shape}` on "
          f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; {vers}")
    for shape in shapes:
        spec_path = tmp / f"{shape}.yaml"
        write_spec(spec_path, args.stages, shape)
        root = tmp / shape
        runs = []
        for label in ("cold", "warm"):
            wall, report, timers, worker = timed_run(spec_path, root)
            runs.append((label, wall, report, timers, worker))
        print(table(shape, args.stages, runs), flush=True)


if __name__ == "__main__":
    main()
