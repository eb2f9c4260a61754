"""The stage contract: what a stage kind declares and what its entry point receives.

A stage kind is a small module (in ``data/``, ``pretrain/``, ``posttrain/``) exposing one ``STAGE``
object. Its entry point ``run(params, ctx)`` reads its input artifacts from ``ctx.inputs`` (paths,
never Python objects from other stages), writes its output artifact into ``ctx.out_dir`` and reports
what it measured through ``ctx``. Nothing here knows about Ray, the cache or MLflow: the orchestrator
supplies a context whose sink forwards to MLflow; tests and notebooks use the default in-memory one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

MANIFEST_NAME = "manifest.json"


class StageParams(BaseModel):
    """Base of every stage's params model: unknown fields are errors, types are strict-ish."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


P = TypeVar("P", bound=StageParams)


@dataclass(frozen=True)
class InputSpec:
    """One input role of a stage kind: which artifact type fills it, and how many."""

    type: str | tuple[str, ...]  # the artifact type(s) accepted
    required: bool = True
    many: bool = False
    doc: str = ""

    def accepts(self, artifact_type: str) -> bool:
        return artifact_type in ((self.type,) if isinstance(self.type, str) else self.type)

    @property
    def type_name(self) -> str:
        return self.type if isinstance(self.type, str) else " or ".join(self.type)


@dataclass(frozen=True)
class StageKind(Generic[P]):
    """A registered kind of stage (the ``uses:`` of a spec)."""

    name: str
    params: type[P]
    run: Callable[[P, StageContext], None]
    produces: str  # artifact type of the output, matched against consumers' InputSpec.type
    inputs: dict[str, InputSpec] = field(default_factory=dict)
    version: str = "1"  # bump when the output format or semantics change without a source change
    schema_version: int = 1  # version of the output artifact's layout
    doc: str = ""
    # Inputs a stage reads besides its input artifacts (e.g. files named in params): returns a
    # JSON-able description of their current content, mixed into the cache key so editing an
    # external input file reruns the stage.
    fingerprint: Callable[[P], Any] | None = None
    # Checks, at validation time (before anything is created), what the params name outside the spec:
    # input files that must exist, and the like. Returns problems as (field, message) pairs, the field
    # dotted within params ("paths.1"; "" for the params as a whole) so the error points at its line.
    validate_external: Callable[[P], list[tuple[str, str]]] | None = None
    # Checks, at validation time, the params against the stage's resources (e.g. ranks that must divide the GPUs
    # of a node). Returns problems as (field, message) pairs, the field dotted from the stage ("params.x",
    # "resources.gpus").
    validate_resources: Callable[[P, Any], list[tuple[str, str]]] | None = None
    # The stage starts its own distributed workers (Ray Train, or a launcher on each node). Only such a
    # kind may ask for resources.nodes > 1; when it spans nodes or asks for GPUs on a Ray cluster its
    # own task reserves (almost) nothing, so the workers it starts can be given the resources.
    launches_workers: bool = False
    # The stage splits its work into shards and runs them as `resources.tasks` Ray tasks through
    # StageContext.map_shards; its output must not depend on the number of tasks (that is not in the cache key).
    splits_work: bool = False
    # Files that record how the run went rather than what it produced (reports, training logs, plots): fnmatch
    # patterns of paths relative to the artifact. They are listed in the manifest with their sha256 (``hylight
    # verify`` checks them) but left out of the artifact's digest, its identity: wall-clock times and measured
    # throughput differ on every run, so a rerun that reproduces the payload bitwise keeps its digest and the
    # stages that read it stay cache hits.
    records: tuple[str, ...] = ()


@dataclass(frozen=True)
class Artifact:
    """An accepted artifact on disk: a directory with a manifest that is its identity."""

    path: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> Artifact:
        path = Path(path)
        with open(path / MANIFEST_NAME, encoding="utf-8") as f:
            return cls(path=path, manifest=json.load(f))

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def type(self) -> str:
        return self.manifest["type"]

    @property
    def rows(self) -> dict[str, int]:
        return self.manifest.get("rows", {})

    def file(self, name: str) -> Path:
        p = self.path / name
        if not p.exists():
            raise FileNotFoundError(f"artifact {self.path} (type {self.type}) has no file {name!r}")
        return p


def metric_key(part: str) -> str:
    """A name part made safe for MLflow metric names (letters, digits, _ - . / and space)."""
    return re.sub(r"[^A-Za-z0-9_.\- /]", "_", part)


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# The checkout (or installed tree) this code runs from: files inside it are named relative to it in cache keys.
CHECKOUT_ROOT = Path(__file__).resolve().parent.parent


def portable_name(path: str | Path) -> dict[str, str]:
    """How a file is named in a cache key, whatever directory the checkout lives in: its path relative to the
    checkout when inside it (``{"path": "data/quality_refs/helpfulness.txt"}``), else its base name only
    (``{"name": "corpus.jsonl"}``; an outside file is identified by its content, its directory is the user's)."""
    resolved = Path(path).resolve()
    if resolved.is_relative_to(CHECKOUT_ROOT):
        return {"path": resolved.relative_to(CHECKOUT_ROOT).as_posix()}
    return {"name": resolved.name}


def content_fingerprint(path: str | Path, hash_below_bytes: int = 256 << 20) -> dict[str, Any]:
    """A file's content identity: its sha256 when at most ``hash_below_bytes``, else size + mtime (hashing a
    large corpus on every run would cost seconds per GB)."""
    st = Path(path).stat()
    if st.st_size <= hash_below_bytes:
        return {"sha256": sha256_file(path)}
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_fingerprint(path: str | Path, hash_below_bytes: int = 256 << 20) -> dict[str, Any]:
    """Identity of an external input file for a stage's cache key: :func:`portable_name` + content. The key
    is the same wherever the checkout lives and changes when the content (or the in-checkout path) does."""
    return {**portable_name(path), **content_fingerprint(path, hash_below_bytes)}


def track(items: Iterable[Any], progress: Callable[[str], None], total: int | None = None, what: str = "items",
          every_s: float = 5.0) -> Iterator[Any]:
    """Yield from ``items``, calling ``progress`` with the count and rate every ``every_s`` seconds."""
    start = last = time.monotonic()
    for n, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            of = f"/{total}" if total else ""
            progress(f"{n}{of} {what} ({n / (now - start):,.0f}/s)")


class MetricSink:
    """Where a stage's measurements go. The default keeps them in memory (tests, notebooks)."""

    def __init__(self) -> None:
        self.metrics: list[tuple[str, float, int | None]] = []
        self.stepped: dict[str, tuple[int, float]] = {}  # name -> (step, value) last logged with a step
        self.artifacts: list[tuple[Path, str | None]] = []
        self.tags: dict[str, str] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None) -> None:
        self.metrics.extend((k, float(v), step) for k, v in metrics.items())
        if step is not None:
            self.stepped.update((k, (step, float(v))) for k, v in metrics.items())

    def log_artifact(self, path: Path, artifact_path: str | None) -> None:
        self.artifacts.append((path, artifact_path))

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def flush(self) -> None:
        pass

    def last(self, name: str) -> float:
        """Last logged value of ``name`` (test helper)."""
        for k, v, _ in reversed(self.metrics):
            if k == name:
                return v
        raise KeyError(name)


@dataclass
class Resources:
    """What the spec asked for, per node (``resources:``), and whether the stage's own task holds it."""

    cpus: float = 1
    gpus: float = 0
    memory_gb: float | None = None
    nodes: int = 1
    tasks: int = 1  # shards of work run as this many Ray tasks (StageContext.map_shards)
    # True: this process was granted the resources (Ray set CUDA_VISIBLE_DEVICES to its GPUs; run on them,
    # e.g. with a launcher on this node). False: nothing is reserved for this process and it sees no GPU;
    # start workers that ask for `nodes` x (cpus, gpus) themselves (Ray Train's ScalingConfig).
    reserved_for_task: bool = True


R = TypeVar("R")


@dataclass(frozen=True)
class ShardStats:
    """What one shard's task measured: wall seconds and the peak resident memory of its process."""

    index: int
    seconds: float
    peak_rss_mib: float
    host: str = ""
    pid: int = 0


@dataclass(frozen=True)
class ShardResult(Generic[R]):
    value: R
    stats: ShardStats


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (ru_maxrss: KiB on Linux)."""
    import resource  # Unix only: the module imports on any platform

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ShardRunner:
    """Runs a stage's shards (StageContext.map_shards)."""

    def map(self, fn: Callable[[Any, Callable[[str], None]], R], shards: list[Any], ctx: StageContext,
            what: str) -> list[ShardResult[R]]:
        raise NotImplementedError


class InProcessShardRunner(ShardRunner):
    """Shards one after the other in the stage's own process (no Ray: tests, notebooks, tasks=1). Peak memory
    is the process's, which includes the stage's own."""

    def map(self, fn: Callable[[Any, Callable[[str], None]], R], shards: list[Any], ctx: StageContext,
            what: str) -> list[ShardResult[R]]:
        out: list[ShardResult[R]] = []
        for i, shard in enumerate(shards):
            start = time.monotonic()
            tag = f"{what} {i + 1}/{len(shards)}: " if len(shards) > 1 else ""
            value = fn(shard, lambda msg, tag=tag: ctx.progress(tag + msg))
            out.append(ShardResult(value, ShardStats(i, time.monotonic() - start, peak_rss_mib(),
                                                     socket.gethostname(), os.getpid())))
        ctx.record_shards([r.stats for r in out], what)
        return out


class StageContext:
    """What a running stage sees: its inputs, its output directory and where to report."""

    def __init__(
        self,
        out_dir: str | Path,
        inputs: dict[str, Artifact | list[Artifact]] | None = None,
        *,
        stage_name: str = "stage",
        resources: Resources | None = None,
        sink: MetricSink | None = None,
        work_dir: str | Path | None = None,
        resume_dir: str | Path | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.inputs = inputs or {}
        self.stage_name = stage_name
        self.resources = resources or Resources()
        self.sink = sink or MetricSink()
        # scratch space that is not part of the artifact (deleted after the stage)
        self.work_dir = Path(work_dir) if work_dir else self.out_dir.parent / (self.out_dir.name + ".work")
        # scratch that SURVIVES a failed or killed attempt (training checkpoints), keyed by the stage's cache key
        # so a rerun of the same stage finds it; the runner deletes it after the artifact is committed
        self.resume_dir = Path(resume_dir) if resume_dir else self.work_dir / "resume"
        self.rows: dict[str, int] = {}
        self.summary: dict[str, float] = {}
        self.started = time.monotonic()  # progress lines say how far into the stage they are
        self.logger = logging.getLogger(f"hylight.stage.{stage_name}")
        # how map_shards runs shards: one after the other in this process, unless the runner (inside a Ray
        # task) gives a pipeline.shards.RayShardRunner
        self.shard_runner: ShardRunner = InProcessShardRunner()
        self.shard_stats: list[ShardStats] = []  # one per shard of every map_shards call

    # --- inputs -------------------------------------------------------------------------------
    def input(self, role: str) -> Artifact:
        art = self.inputs.get(role)
        if art is None:
            raise KeyError(f"stage {self.stage_name!r} has no input {role!r} (has {sorted(self.inputs)})")
        if isinstance(art, list):
            raise TypeError(f"input {role!r} holds {len(art)} artifacts; use input_list()")
        return art

    def input_list(self, role: str) -> list[Artifact]:
        art = self.inputs.get(role, [])
        return art if isinstance(art, list) else [art]

    # --- work split into shards ----------------------------------------------------------------
    def map_shards(self, fn: Callable[[Any, Callable[[str], None]], R], shards: Sequence[Any],
                   what: str = "shard") -> list[R]:
        """``[fn(shard, progress) for shard in shards]``, run as up to ``resources.tasks`` Ray tasks (one CPU and
        one thread each) when the stage runs under Ray, else one after the other here. ``fn`` must be a
        module-level function and ``shards`` plain data (they travel to other processes and nodes); results
        come back in the order of ``shards``. Anything big goes through files under ``work_dir``, which is
        under the artifact root: on a cluster every node must see it (a shared filesystem)."""
        results = self.shard_runner.map(fn, list(shards), self, what)
        return [r.value for r in results]

    def record_shards(self, stats: list[ShardStats], what: str) -> None:
        """Called by shard runners: keeps per-shard seconds and peak memory and logs their extremes."""
        self.shard_stats += stats
        if stats:
            key = metric_key(what)
            self.log_metrics({f"shards.{key}.count": len(stats),
                              f"shards.{key}.max_seconds": max(s.seconds for s in stats),
                              f"shards.{key}.max_peak_rss_mib": max(s.peak_rss_mib for s in stats)})

    # --- reporting ----------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.sink.log_metrics(metrics, step)

    def log_summary(self, metrics: dict[str, float]) -> None:
        """Final key numbers of the stage: logged as metrics and shown by ``hylight status``."""
        self.summary.update({k: float(v) for k, v in metrics.items()})
        # A summary value equal to the last point of the metric's step history (e.g. the final ``loss``) is not
        # logged again: a second entry at step 0 would be a stray point on the curve in the MLflow UI. A value that
        # differs (e.g. a run-wide rate beside per-window ones) is a different quantity and is logged without a step.
        seen = self.sink.stepped
        fresh = {k: v for k, v in metrics.items() if k not in seen or float(v) != seen[k][1]}
        if fresh:
            self.sink.log_metrics(fresh, None)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Searchable labels of this stage's run (e.g. which labeler produced the labels)."""
        self.sink.set_tags({k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a small file (plot, config, tokenizer file) into the tracking store."""
        self.sink.log_artifact(Path(path), artifact_path)

    def log_figure(self, fig: Any, name: str) -> Path:
        """Save a matplotlib figure into the artifact's ``plots/`` and log it."""
        plots = self.out_dir / "plots"
        plots.mkdir(exist_ok=True)
        path = plots / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt  # heavy: matplotlib, only where a stage plots

        plt.close(fig)
        self.log_artifact(path, "plots")
        return path

    def set_rows(self, name: str, count: int) -> None:
        """Row counts recorded in the manifest (documents, samples, tokens...)."""
        self.rows[name] = int(count)

    def progress(self, message: str) -> None:
        """A line on the console, ``[stage +SECONDS] message``: the seconds since the stage began tell, in a long
        run's log, where its time went."""
        print(f"[{self.stage_name} +{time.monotonic() - self.started:.0f}s] {message}", file=sys.stderr, flush=True)

    def track(self, items: Iterable[Any], total: int | None = None, what: str = "items",
              every_s: float = 5.0) -> Iterator[Any]:
        """Yield from ``items``, printing throughput every ``every_s`` seconds on long work."""
        return track(items, self.progress, total=total, what=what, every_s=every_s)

    def cleanup(self) -> None:
        shutil.rmtree(self.work_dir, ignore_errors=True)
