"""Runs a validated spec: cache lookups, Ray tasks, MLflow runs, live progress.

Cache rules (README.md "Cache rules"; stage authors: docs/pipeline.md):
- a stage's key is hash(kind + code version, validated params, digests of its input artifacts);
- an accepted artifact with that key is a cache hit and the stage does not run;
- ``force`` stages run even on a hit; their dependents rerun only if the new output differs
  (the input digests change) or they are forced too.
Ray is started only when some stage has to run, so an all-cached rerun costs no cluster start.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from pipeline import tracking
from pipeline.artifacts import ArtifactStore, cache_key, write_json_atomic
from pipeline.launch import pid_alive, process_start_ticks, start_watchdog
from pipeline.registry import code_digest
from pipeline.runner import StageOutcome, StageTask, execute_stage
from pipeline.spec import ClusterCapacity, NodeCapacity, PipelineSpec, ResolvedStage
from pipeline.stage import Artifact
from pipeline.worker_env import forwarded_env

# Ray listens on every interface by default; this makes all its listeners bind to 127.0.0.1
# (measured: ENV-NOTES, "Keep Ray on loopback").
_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0"}

# Which process owns an MLflow run it left RUNNING: "host:pid:start ticks" of the `hylight run` driver.
TAG_OWNER = "hylight.owner"
TAG_ROOT = "hylight.artifact_root"
TAG_CACHE_REJECTED = "hylight.cache_rejected"  # why the cached artifact of this stage's key was not reused


def stage_cache_key(st: ResolvedStage, upstream: dict[str, Artifact]) -> tuple[str, dict[str, Any]]:
    """A stage's cache key and its material, from the artifacts of the stages it needs (by name). Raises what
    the kind's ``fingerprint`` raises (e.g. an external input file that does not exist)."""
    in_digests: dict[str, Any] = {role: [upstream[n].digest for n in names] for role, names in st.inputs.items()}
    if st.kind.fingerprint is not None:
        in_digests["external"] = st.kind.fingerprint(st.params)
    return cache_key(st.kind.name, code_digest(st.kind), st.params.model_dump(mode="json"), in_digests)


def task_reserves_resources(st: ResolvedStage, on_cluster: bool) -> bool:
    """Whether a stage's own Ray task is given its resources. Not for a kind that launches its own
    workers when it spans nodes or asks for GPUs on a Ray cluster: a task holding the GPUs would make the
    nested Ray Train job that asks for them again wait forever, so the task holds nothing and the job
    gets them (docs/pipeline.md, 'Stages that need GPUs or several processes')."""
    r = st.resources
    return not (st.kind.launches_workers and (r.nodes > 1 or (r.gpus > 0 and on_cluster)))


@dataclass
class RunOptions:
    stages: list[str] = field(default_factory=list)  # --stage: run these (forced) and what they need
    downstream: bool = False  # --downstream: also force everything that depends on --stage
    from_stage: str | None = None  # --from: force this stage and everything after it
    dry_run: bool = False
    tracking_uri: str | None = None
    ray_address: str | None = None
    heartbeat_s: float = 15.0
    command: str = ""


@dataclass
class StageResult:
    name: str
    state: str  # pending | running | cached | done | failed | skipped | planned
    cache_key: str | None = None
    artifact: str | None = None
    digest: str | None = None
    run_id: str | None = None
    produced_by: str | None = None
    seconds: float | None = None
    summary: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    error: str | None = None
    attempts: int = 0  # times started in this run; more than 1 after a retry (the spec's `retries`)
    attempt_errors: list[str] = field(default_factory=list)  # each failed attempt's error, in order


@dataclass
class RunReport:
    spec: str
    run_id: str | None
    tracking_uri: str
    stages: dict[str, StageResult]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.state in ("cached", "done", "planned") for r in self.stages.values())


def state_dir() -> Path:
    return Path(os.environ.get("HYLIGHT_STATE_DIR", Path.home() / ".cache" / "hylight"))


def remember_last_run(info: dict[str, Any]) -> None:
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(d / "last_run.json", info)


def local_capacity() -> ClusterCapacity:
    """This machine's CPUs, GPUs (nvidia-smi, without importing torch) and memory."""
    cpus = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    gpus = 0.0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
            gpus = float(sum(1 for line in out.splitlines() if line.startswith("GPU ")))
        except (OSError, subprocess.SubprocessError):
            gpus = 0.0
    if visible is not None:
        gpus = min(gpus, float(len([v for v in visible.split(",") if v.strip()])))
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return ClusterCapacity(cpus=cpus, gpus=gpus, memory_gb=round(mem, 1), where="this machine")


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail fast on a host:port nobody listens on (ray.init would retry for minutes)."""
    hostport = address.split("://", 1)[-1]
    if address in ("auto", "local") or ":" not in hostport:
        return
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: {e}") from None


def ray_capacity(address: str) -> ClusterCapacity:
    """The live nodes of an existing Ray cluster (attaches to it)."""
    import ray  # heavy: ray (~1 s), only where a run starts or attaches to it

    os.environ.update({k: v for k, v in _RAY_ENV.items() if k not in os.environ})
    _check_reachable(address)
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False)
    try:
        nodes = [NodeCapacity(cpus=r.get("CPU", 0), gpus=r.get("GPU", 0), memory_gb=r.get("memory", 0) / 2**30)
                 for r in (n.get("Resources", {}) for n in ray.nodes() if n.get("Alive"))]
        return ClusterCapacity(cpus=max((n.cpus for n in nodes), default=0),
                               gpus=max((n.gpus for n in nodes), default=0),
                               memory_gb=max((n.memory_gb for n in nodes), default=0),
                               where=f"the Ray cluster at {address}", nodes=nodes)
    finally:
        if started:
            ray.shutdown()


class Console:
    """Terminal progress: one line per event, a heartbeat while stages run."""

    def __init__(self, out: TextIO, t0: float):
        self.out, self.t0 = out, t0

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", file=self.out, flush=True)


def _fmt_summary(summary: dict[str, float], n: int = 3) -> str:
    parts = []
    for k, v in list(summary.items())[:n]:
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) and not v.is_integer() else f"{k}={int(v)}")
    return " ".join(parts)


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Plain-text table: the first row is the header, underlined."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_table(report: RunReport) -> str:
    rows = [("stage", "state", "time", "key metrics")]
    for r in report.stages.values():
        t = f"{r.seconds:.1f}s" if r.seconds is not None else "-"
        state = r.state + (f" ({r.reason})" if r.reason and r.state in ("skipped", "planned") else "")
        state += f" (attempt {r.attempts})" if r.attempts > 1 else ""
        rows.append((r.name, state, t, _fmt_summary(r.summary) if r.state != "failed" else (r.error or "")[:80]))
    return format_table(rows)


_watchdog: int | None = None


def _watch_this_process() -> None:
    """Once per process: a watchdog that kills the local Ray this process starts if it dies without stopping
    it (SIGKILL: Ray's agents would otherwise outlive it by minutes; pipeline.launch.start_watchdog)."""
    global _watchdog
    if _watchdog is None or not pid_alive(_watchdog):
        _watchdog = start_watchdog()


def stage_remote(fn: Any, name: str, opts: dict[str, Any]) -> Any:
    """``fn`` as a Ray task named ``stage:<name>`` with ``opts``. A stage that takes GPUs runs in a fresh worker
    (``max_calls=1``): on an H100, SFT hit CUDA out-of-memory in the worker that had run long_context and the reward
    model before it. What one stage leaves on the device (an engine, a captured graph pool, the caching allocator's
    blocks) must not starve the next. CPU stages keep reusing workers (no process start per stage)."""
    import ray  # heavy: ray (~1 s), only where a run starts or attaches to it

    remote = ray.remote(max_calls=1)(fn) if opts.get("num_gpus") else ray.remote(fn)
    return remote.options(name=f"stage:{name}", **opts)


class Orchestrator:
    def __init__(self, spec: PipelineSpec, opts: RunOptions, out: TextIO = sys.stderr):
        self.spec = spec
        self.opts = opts
        self.store = ArtifactStore(spec.artifact_root)
        self.tracking_uri = (opts.tracking_uri or spec.tracking_uri
                             or tracking.default_tracking_uri(spec.artifact_root))
        self.ray_address = opts.ray_address or spec.ray_address
        self.console = Console(out, time.monotonic())
        self._ray_started = False
        self._ray_ready = False
        self._depth = spec.depth_below()  # GPUs go to the waiting stage with the most of the run below it
        self._keys: dict[str, tuple[str, dict[str, Any]]] = {}  # a stage's cache key, once its inputs are in
        self._gpu_waiting: set[str] = set()  # stages told they wait for a GPU

    # --- selection ---------------------------------------------------------------------------
    def plan(self) -> tuple[list[str], set[str]]:
        """(stages to consider, in order; stages forced to run)."""
        spec, o = self.spec, self.opts
        for name in [*o.stages, *([o.from_stage] if o.from_stage else [])]:
            if name not in spec.stages:
                raise KeyError(f"no stage named {name!r} in {spec.path} (stages: {', '.join(spec.stages)})")
        selected = set(spec.stages)
        forced: set[str] = set()
        if o.stages:
            selected = set()
            for s in o.stages:
                selected.update(spec.upstream_of(s))
                forced.add(s)
                if o.downstream:
                    down = spec.downstream_of(s)
                    selected.update(n for d in down for n in spec.upstream_of(d))
                    forced.update(down)
        if o.from_stage:
            forced.update(spec.downstream_of(o.from_stage))
        return [s for s in spec.stages if s in selected], forced

    # --- ray ---------------------------------------------------------------------------------
    def _ensure_ray(self) -> None:
        if self._ray_ready:
            return
        import ray  # heavy: ray (~1 s), only where a run starts or attaches to it

        for k, v in _RAY_ENV.items():
            os.environ.setdefault(k, v)
        if not ray.is_initialized():
            if self.ray_address:
                self.console.say(f"attaching to Ray at {self.ray_address}")
                if self.tracking_uri.startswith("sqlite:"):
                    self.console.say("warning: stages on other nodes write to the sqlite tracking store "
                                     f"{self.tracking_uri} through the shared filesystem; sqlite locking over "
                                     "NFS is unreliable: prefer an MLflow server (--tracking-uri http://...)")
                _check_reachable(self.ray_address)
                ray.init(address=self.ray_address, log_to_driver=True)
            else:
                cap = local_capacity()
                self.console.say(f"starting local Ray on 127.0.0.1 ({cap.cpus:g} CPUs, {cap.gpus:g} GPUs)")
                _watch_this_process()
                ray.init(address="local", num_cpus=int(cap.cpus), num_gpus=int(cap.gpus),
                         include_dashboard=False, log_to_driver=True, _memory=int(cap.memory_gb * 2**30),
                         logging_level="WARNING")
            self._ray_started = True
        self._ray_ready = True

    def _submit(self, task: StageTask, st: ResolvedStage) -> Any:

        self._ensure_ray()
        r = st.resources
        if task.resources["reserved_for_task"]:
            opts: dict[str, Any] = {"num_cpus": r.cpus, "num_gpus": r.gpus, "max_retries": 0}
            if r.memory_gb:
                opts["memory"] = int(r.memory_gb * 2**30)
        else:  # zero, not "a little": any share of a node's CPUs could keep a full-node worker from fitting
            opts = {"num_cpus": 0, "num_gpus": 0, "max_retries": 0}
        return stage_remote(execute_stage, st.name, opts).remote(task)

    # --- mlflow ------------------------------------------------------------------------------
    def _owner_tags(self) -> dict[str, str]:
        pid = os.getpid()
        return {TAG_OWNER: f"{socket.gethostname()}:{pid}:{process_start_ticks(pid) or ''}",
                TAG_ROOT: str(self.spec.artifact_root)}

    def close_orphaned_runs(self, c: Any, exp: str) -> int:
        """Mark KILLED the runs of this artifact root left RUNNING by a `hylight run` whose process is
        gone (killed with -9, machine crash). Runs of other hosts are left alone: their liveness cannot
        be checked from here."""
        host, root, closed = socket.gethostname(), str(self.spec.artifact_root), 0
        token = None
        while True:
            page = tracking.retry(c.search_runs, [exp], filter_string="attributes.status = 'RUNNING'",
                                  max_results=500, page_token=token)
            for r in page:
                tags = r.data.tags
                owner = tags.get(TAG_OWNER, "").split(":")
                if tags.get(TAG_ROOT) != root or len(owner) != 3 or owner[0] != host or not owner[1].isdigit():
                    continue
                if pid_alive(int(owner[1]), int(owner[2]) if owner[2].isdigit() else None):
                    continue
                note = {tracking.TAG_STATE: "orphaned",
                        "hylight.orphaned": f"`hylight run` process {owner[1]} on {host} died while this run "
                                            "was open; closed by the next run"}
                kind, key = tags.get(tracking.TAG_KIND), tags.get(tracking.TAG_CACHE_KEY)
                art = self.store.lookup(kind, key) if kind and key else None
                if art is not None and (art.manifest.get("producer") or {}).get("run_id") == r.info.run_id:
                    note |= {tracking.TAG_ARTIFACT_URI: art.path.as_uri(),
                             tracking.TAG_ARTIFACT_DIGEST: art.digest, "hylight.artifact_committed": "true"}
                tracking.set_tags(c, r.info.run_id, note)
                tracking.end_run(c, r.info.run_id, "KILLED")
                closed += 1
            token = page.token
            if not token:
                return closed

    def _replay_left_journals(self, c: Any) -> None:
        """Send what earlier runs' stages could not log while the tracking server was down."""
        for path in sorted((self.spec.artifact_root / tracking.JOURNAL_DIR).glob("*.jsonl")):
            try:
                run = tracking.retry(c.get_run, path.stem)
            except tracking.TrackingUnavailable:
                raise
            except Exception as e:  # noqa: BLE001 (e.g. a journal written for another tracking store)
                self.console.say(f"warning: {path} is for a run this tracking store does not have "
                                 f"({str(e).splitlines()[0][:200]}); left in place")
                continue
            if run.info.status == "RUNNING":  # a stage of a live run still writes it
                continue
            uri = run.data.tags.get(tracking.TAG_ARTIFACT_URI, "")
            out_dir = Path(uri[len("file://"):]) if uri.startswith("file://") else None
            n = tracking.replay_journal(c, path, out_dir)
            self.console.say(f"logged {n} journaled MLflow record(s) of run {path.stem} (the server was down then)")

    def _replay_journal(self, c: Any, run_id: str, out_dir: Path | None) -> None:
        path = tracking.journal_path(self.spec.artifact_root, run_id)
        if c is not None and path.exists():
            n = tracking.replay_journal(c, path, out_dir)
            self.console.say(f"logged {n} MLflow record(s) journaled while the tracking server was down")

    def _stage_run(self, c: Any, exp: str, parent: str, st: ResolvedStage, key: str,
                   inputs: dict[str, list[dict[str, Any]]], tags: dict[str, Any]) -> str:
        run_id = tracking.start_run(c, exp, st.name, parent_run_id=parent, tags={
            tracking.TAG_STAGE: st.name, tracking.TAG_KIND: st.kind.name, tracking.TAG_CACHE_KEY: key,
            **self._owner_tags(), **tags})
        tracking.log_params(c, run_id, {"params": st.params.model_dump(mode="json"),
                                        "resources": st.resources.model_dump()})
        tracking.log_lineage(c, run_id, inputs)
        return run_id

    @staticmethod
    def _artifact_tags(art: Artifact, state: str) -> dict[str, str]:
        m = art.manifest
        return {
            tracking.TAG_STATE: state,
            tracking.TAG_ARTIFACT_URI: art.path.as_uri(), tracking.TAG_ARTIFACT_DIGEST: art.digest,
            tracking.TAG_PRODUCER: (m.get("producer") or {}).get("run_id") or "",
            "hylight.rows": json.dumps(m.get("rows", {})),
            "hylight.summary_keys": json.dumps(list(m.get("summary", {}))),
        }

    def _finish_stage_run(self, c: Any, run_id: str, art: Artifact) -> None:
        tracking.set_tags(c, run_id, self._artifact_tags(art, "done"))
        tracking.retry(c.log_artifact, run_id, str(art.path / "manifest.json"))
        tracking.end_run(c, run_id, "FINISHED")

    def _cached_stage_run(self, c: Any, exp: str, parent: str, st: ResolvedStage, key: str,
                          inputs: dict[str, list[dict[str, Any]]], art: Artifact) -> str:
        """A cache hit's run, made whole at once: created with every tag, then one batch of its params and the
        artifact's summary metrics, its lineage, the manifest, terminated: four database transactions on a
        sqlite store, where separate tag, param and metric writes took six (the warm 200-stage DAG, BENCHMARKS.md)."""
        run_id = tracking.start_run(c, exp, st.name, parent_run_id=parent, tags={
            tracking.TAG_STAGE: st.name, tracking.TAG_KIND: st.kind.name, tracking.TAG_CACHE_KEY: key,
            **self._owner_tags(), tracking.TAG_CACHE_HIT: "true", **self._artifact_tags(art, "cached")})
        tracking.log_record(c, run_id, params={"params": st.params.model_dump(mode="json"),
                                               "resources": st.resources.model_dump()},
                            metrics=art.manifest.get("summary") or {})
        tracking.log_lineage(c, run_id, inputs)
        tracking.retry(c.log_artifact, run_id, str(art.path / "manifest.json"))
        tracking.end_run(c, run_id, "FINISHED")
        return run_id

    # --- main loop ---------------------------------------------------------------------------
    def run(self) -> RunReport:
        spec, o, say = self.spec, self.opts, self.console.say
        t0 = time.monotonic()
        order, forced = self.plan()
        results = {n: StageResult(name=n, state="pending") for n in order}
        if not o.dry_run:
            tracking.check_reachable(self.tracking_uri)  # before anything is started or written
        swept = self.store.sweep()
        if swept:
            say(f"removed {swept} partial output(s) left by killed stages")

        c = exp = parent = None
        if not o.dry_run:
            c = tracking.client(self.tracking_uri)
            exp = tracking.ensure_experiment(c, spec.name, spec.artifact_root, self.tracking_uri)
            orphans = self.close_orphaned_runs(c, exp)
            if orphans:
                say(f"marked {orphans} MLflow run(s) KILLED: left RUNNING by a `hylight run` that was killed")
            self._replay_left_journals(c)
            parent = tracking.start_run(c, exp, f"{spec.name} {time.strftime('%Y-%m-%d %H:%M:%S')}", tags={
                tracking.TAG_SPEC: str(spec.path), "hylight.command": o.command,
                "hylight.overrides": " ".join(spec.overrides), "hylight.host": socket.gethostname(),
                **self._owner_tags()})
            self._log_spec(c, parent)
            remember_last_run({"tracking_uri": self.tracking_uri, "run_id": parent, "experiment": spec.name,
                               "spec": str(spec.path), "artifact_root": str(spec.artifact_root)})
            say(f"run {parent} · tracking {self.tracking_uri} · artifacts {spec.artifact_root}")

        artifacts: dict[str, Artifact] = {}
        running: dict[Any, tuple[str, str, float]] = {}  # ref -> (stage, run_id, start)
        interrupted = False
        last_beat = time.monotonic()
        try:
            while True:
                progressed = self._schedule(order, forced, results, artifacts, running, c, exp, parent)
                if not running:
                    if not progressed:
                        break
                    continue
                import ray  # heavy: ray (~1 s), only where a run starts or attaches to it

                done, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
                for ref in done:
                    name, run_id, start = running.pop(ref)
                    self._collect(ref, name, run_id, start, results, artifacts, c)
                if time.monotonic() - last_beat >= o.heartbeat_s and running:
                    last_beat = time.monotonic()
                    say("running: " + ", ".join(f"{n} ({time.monotonic() - s:.0f}s)"
                                                for n, _, s in running.values()))
        except KeyboardInterrupt:
            interrupted = True
            say("interrupted: cancelling running stages")
            self._abandon(running, results, c, "interrupted", "KILLED")
        except BaseException:  # a driver error must not leave MLflow runs RUNNING forever
            self._abandon(running, results, c, "driver error", "FAILED")
            if c is not None and parent is not None:
                try:
                    tracking.end_run(c, parent, "FAILED")
                except tracking.TrackingUnavailable:
                    pass
            raise
        finally:
            if self._ray_started:
                import ray  # heavy: ray (~1 s), only where a run starts or attaches to it

                ray.shutdown()

        report = RunReport(spec=str(spec.path), run_id=parent, tracking_uri=self.tracking_uri,
                           stages=results, seconds=time.monotonic() - t0)
        if c is not None and parent is not None:
            counts: dict[str, int] = {}
            for r in results.values():
                counts[r.state] = counts.get(r.state, 0) + 1
            tracking.log_metrics_now(c, parent, {"seconds": report.seconds,
                                                 **{f"stages_{k}": v for k, v in counts.items()}})
            status = "KILLED" if interrupted else ("FINISHED" if report.ok else "FAILED")
            tracking.end_run(c, parent, status)
        if interrupted:
            raise KeyboardInterrupt
        return report

    def _abandon(self, running: dict[Any, tuple[str, str, float]], results: dict[str, StageResult], c: Any,
                 why: str, status: str) -> None:
        """Cancel the stages still running and close their runs."""
        import ray  # heavy: ray (~1 s), only where a run starts or attaches to it

        for ref, (name, run_id, _) in running.items():
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 (best effort while shutting down)
                pass
            results[name].state, results[name].error = "failed", why
            if c:
                try:
                    tracking.set_tags(c, run_id, {tracking.TAG_STATE: why})
                    tracking.end_run(c, run_id, status)
                except tracking.TrackingUnavailable:  # the next run closes it (close_orphaned_runs)
                    pass

    def _log_spec(self, c: Any, parent: str) -> None:
        resolved = self.spec.resolved()
        tmp = self.spec.artifact_root / ".tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        path = tmp / f"resolved-spec-{parent}.yaml"
        path.write_text(yaml.safe_dump(resolved, sort_keys=False))
        tracking.retry(c.log_artifact, parent, str(path))
        path.unlink()

    def _schedule(self, order: list[str], forced: set[str], results: dict[str, StageResult],
                  artifacts: dict[str, Artifact], running: dict[Any, tuple[str, str, float]],
                  c: Any, exp: Any, parent: Any) -> bool:
        """Start every stage whose inputs are ready. Returns True if any state changed."""
        spec, say = self.spec, self.console.say
        progressed = False
        # deepest first (a topological order too: a stage is deeper than what needs it), ties in spec order
        for name in sorted(order, key=lambda n: -self._depth[n]):
            res = results[name]
            if res.state != "pending":
                continue
            st = spec.stages[name]
            ups = [results[n] for n in st.needs]
            bad = [u for u in ups if u.state in ("failed", "skipped")]
            if bad:
                res.state, res.reason = "skipped", f"{bad[0].name} {bad[0].state}"
                say(f"· {name} skipped: upstream {bad[0].name} {bad[0].state}")
                self._ended_stage_run(c, exp, parent, st, "skipped", {"hylight.reason": res.reason}, "KILLED")
                progressed = True
                continue
            if any(u.state == "planned" for u in ups):
                res.state, res.reason = "planned", "after upstream"
                progressed = True
                continue
            if not all(n in artifacts for n in st.needs):
                continue
            if res.reason.removeprefix("waits for ") in {n for n, _, _ in running.values()}:
                continue  # a stage of its cache key still runs (below): no need to hash the inputs again
            try:
                key, material = self._keys.get(name) or stage_cache_key(st, artifacts)
                self._keys[name] = (key, material)
            except Exception as e:  # noqa: BLE001 (a fingerprint failed, e.g. an input file that does not exist)
                res.state, res.error = "failed", f"{type(e).__name__}: {e}"
                say(f"✗ {name} cannot start: {res.error}")
                res.run_id = self._ended_stage_run(c, exp, parent, st, "failed", {"hylight.error": res.error[:500]},
                                                   "FAILED")
                progressed = True
                continue
            twin = next((n for n, _, _ in running.values() if results[n].cache_key == key), None)
            if twin is not None:  # the same kind, params and inputs is running: its artifact will serve this one
                res.reason = f"waits for {twin}"
                say(f"· {name} waits for {twin}: the same kind, params and inputs (one cache key), so one resume "
                    "directory; then it reads that stage's artifact, or runs itself if that stage failed")
                continue
            res.cache_key, res.reason = key, ""
            lineage = {role: [{"stage": n, "type": artifacts[n].type, "digest": artifacts[n].digest,
                               "path": str(artifacts[n].path),
                               "run_id": (artifacts[n].manifest.get("producer") or {}).get("run_id")}
                              for n in names] for role, names in st.inputs.items()}
            rejected: list[str] = []  # a forced stage reruns anyway: its old artifact is not read (nor hashed)
            hit = None if name in forced else self.store.lookup(st.kind.name, key, on_reject=rejected.append,
                                                                 quarantine=not self.opts.dry_run)
            for msg in rejected:
                say(f"! {name}: {msg}")
            progressed = True
            if hit is not None:
                artifacts[name] = hit
                res.state, res.artifact, res.digest = "cached", str(hit.path), hit.digest
                res.produced_by = (hit.manifest.get("producer") or {}).get("run_id")
                res.summary = hit.manifest.get("summary", {})
                res.seconds = 0.0
                say(f"✓ {name} cache hit ({hit.path.relative_to(spec.artifact_root)})")
                if c:
                    res.run_id = self._cached_stage_run(c, exp, parent, st, key, lineage, hit)
                continue
            why = (f"retry {res.attempts} of {st.retries}" if res.attempts else "forced" if name in forced
                   else "cached artifact failed verification" if rejected else "no cached artifact for its key")
            if self.opts.dry_run:
                res.state, res.reason = "planned", why
                continue
            if self._gpus_taken(st, running):  # it waits here, not in Ray's queue, so the deepest goes first
                if name not in self._gpu_waiting:
                    self._gpu_waiting.add(name)
                    say(f"· {name} waits for a GPU: every one is held by this run's stages")
                continue
            rid = self._stage_run(c, exp, parent, st, key, lineage,
                                  {tracking.TAG_CACHE_HIT: "false", tracking.TAG_STATE: "running",
                                   "hylight.attempt": str(res.attempts + 1),
                                   **({TAG_CACHE_REJECTED: rejected[0][:500]} if rejected else {})})
            res.run_id = rid
            reserved = task_reserves_resources(st, on_cluster=bool(self.ray_address))
            task = StageTask(
                stage=name, uses=st.uses, params=st.params.model_dump(mode="json"),
                resources={**st.resources.model_dump(), "reserved_for_task": reserved},
                root=str(spec.artifact_root), key=key,
                key_material=material, cwd=os.getcwd(), tracking_uri=self.tracking_uri, run_id=rid,
                inputs={role: [str(artifacts[n].path) for n in names] for role, names in st.inputs.items()},
                env=forwarded_env(),
            )
            res.state, res.attempts = "running", res.attempts + 1
            self._gpu_waiting.discard(name)  # a retry that waits again says so again
            r = st.resources
            asked = f"cpus={r.cpus:g} gpus={r.gpus:g}" + (f" x {r.nodes} nodes" if r.nodes > 1 else "")
            asked += f", {r.tasks} shard tasks" if r.tasks > 1 else ""
            say(f"▶ {name} started ({why}; {asked}{'' if reserved else ', for the workers it launches'})")
            ref = self._submit(task, st)
            running[ref] = (name, rid, time.monotonic())
        return progressed

    def _ended_stage_run(self, c: Any, exp: Any, parent: Any, st: ResolvedStage, state: str, tags: dict[str, str],
                         status: str) -> str | None:
        """The MLflow run of a stage that ends before it starts (skipped, or its key failed); None without MLflow."""
        if not c:
            return None
        rid = tracking.start_run(c, exp, st.name, parent_run_id=parent, tags={
            tracking.TAG_STAGE: st.name, tracking.TAG_KIND: st.kind.name, tracking.TAG_STATE: state, **tags})
        tracking.end_run(c, rid, status)
        return rid

    def _gpus_taken(self, st: ResolvedStage, running: dict[Any, tuple[str, str, float]]) -> bool:
        """True while the stages this run started hold the GPUs ``st`` asks for. Submitted anyway, it would wait
        in Ray's queue, and Ray starts whichever queued task it likes when a GPU frees: an eval could take it from
        the next stage of a long chain. A stage asking for more GPUs than the cluster has is left to Ray (and to
        ``hylight validate``); GPUs used outside this run are not counted."""
        asked = st.resources.gpus * st.resources.nodes
        if asked <= 0 or not running:
            return False
        self._ensure_ray()
        import ray  # heavy: ray (~1 s), only where a run starts or attaches to it

        total = float(ray.cluster_resources().get("GPU", 0.0))
        held = sum(self.spec.stages[n].resources.gpus * self.spec.stages[n].resources.nodes
                   for n, _, _ in running.values())
        return asked <= total and held + asked > total + 1e-9

    def _collect(self, ref: Any, name: str, run_id: str, start: float, results: dict[str, StageResult],
                 artifacts: dict[str, Artifact], c: Any) -> None:
        import ray  # heavy: ray (~1 s), only where a run starts or attaches to it

        res = results[name]
        try:
            outcome: StageOutcome = ray.get(ref)
        except Exception as e:  # RayTaskError wraps the stage's exception; crashes are RayError too
            res.state, res.seconds = "failed", time.monotonic() - start
            cause = getattr(e, "cause", None) or e
            res.error = f"{type(cause).__name__}: {cause}".splitlines()[0][:500]
            self.console.say(f"✗ {name} failed after {res.seconds:.1f}s: {res.error}")
            detail = str(e) if str(e) else traceback.format_exc()
            tmp = self.spec.artifact_root / ".tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            err_path = tmp / f"error-{run_id}.txt"
            err_path.write_text(detail)
            if c:
                tracking.retry(c.log_artifact, run_id, str(err_path))
                tracking.set_tags(c, run_id, {tracking.TAG_STATE: "failed", "hylight.error": res.error})
                self._replay_journal(c, run_id, None)
                tracking.end_run(c, run_id, "FAILED")
            err_path.unlink(missing_ok=True)
            res.attempt_errors.append(res.error)
            retries = self.spec.stages[name].retries
            if res.attempts <= retries:  # started again by the next _schedule pass, in a new MLflow run
                res.state = "pending"
                self.console.say(f"↻ {name} starts again: retry {res.attempts} of {retries} (the spec's retries)")
            return
        art = Artifact.load(outcome.path)
        artifacts[name] = art
        res.state, res.artifact, res.digest, res.error = "done", outcome.path, outcome.digest, None
        res.seconds, res.summary, res.produced_by = outcome.seconds, outcome.summary, run_id
        self.console.say(f"✓ {name} done in {outcome.seconds:.1f}s  {_fmt_summary(outcome.summary)}")
        if c:
            self._replay_journal(c, run_id, art.path)
            self._finish_stage_run(c, run_id, art)


def run_pipeline(spec: PipelineSpec, opts: RunOptions | None = None, out: TextIO = sys.stderr) -> RunReport:
    return Orchestrator(spec, opts or RunOptions(), out).run()


def report_json(report: RunReport) -> str:
    return json.dumps({"run_id": report.run_id, "ok": report.ok, "seconds": report.seconds,
                       "stages": {k: asdict(v) for k, v in report.stages.items()}}, indent=2)
