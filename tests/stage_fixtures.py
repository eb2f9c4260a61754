"""Tiny plugin stage kinds for orchestrator tests (``uses: tests.stage_fixtures:NAME``).

They do real file work through the real stage contract, so cache, Ray and MLflow behaviour is tested
without the cost of data stages. Each appends a line to ``$HYLIGHT_TEST_LOG`` when it actually runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

from pipeline.stage import InputSpec, StageContext, StageKind, StageParams, file_fingerprint


def _record(name: str) -> None:
    log = os.environ.get("HYLIGHT_TEST_LOG")
    if log:
        with open(log, "a") as f:
            f.write(name + "\n")


class SourceParams(StageParams):
    text: str = "hello"
    repeat: int = 1
    sleep_s: float = 0.0


def run_source(params: SourceParams, ctx: StageContext) -> None:
    _record(ctx.stage_name)
    time.sleep(params.sleep_s)
    (ctx.out_dir / "text.txt").write_text(params.text * params.repeat)
    ctx.set_rows("chars", len(params.text) * params.repeat)
    ctx.log_summary({"chars": len(params.text) * params.repeat})
    ctx.log_metrics({"progress": 0.5}, step=1)
    ctx.log_metrics({"progress": 1.0}, step=2)


SOURCE = StageKind(name="test_source", params=SourceParams, run=run_source, produces="text")


class ConcatParams(StageParams):
    sep: str = "|"
    fail_marker: str | None = None  # raise while this file exists
    kill_marker: str | None = None  # SIGKILL this worker mid-write while this file exists
    fail_first: int = 0  # raise in the first this many attempts, counted as lines of attempts_file
    attempts_file: str | None = None


def run_concat(params: ConcatParams, ctx: StageContext) -> None:
    _record(ctx.stage_name)
    parts = [(a.path / "text.txt").read_text() for a in ctx.input_list("texts")]
    out = ctx.out_dir / "text.txt"
    with open(out, "w") as f:
        f.write(parts[0] if parts else "")
        f.flush()
        if params.kill_marker and Path(params.kill_marker).exists():
            Path(params.kill_marker).unlink()
            os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write: half a file sits in the temp dir
        for p in parts[1:]:
            f.write(params.sep + p)
    if params.fail_marker and Path(params.fail_marker).exists():
        raise RuntimeError("concat was told to fail")
    if params.attempts_file:
        with open(params.attempts_file, "a") as f:
            f.write("attempt\n")
        attempt = len(Path(params.attempts_file).read_text().splitlines())
        if attempt <= params.fail_first:
            raise RuntimeError(f"concat fails its first {params.fail_first} attempt(s); this is attempt {attempt}")
    ctx.log_summary({"parts": len(parts)})


CONCAT = StageKind(name="test_concat", params=ConcatParams, run=run_concat, produces="text",
                   inputs={"texts": InputSpec("text", many=True)})


class CountParams(StageParams):
    pass


def run_count(params: CountParams, ctx: StageContext) -> None:
    _record(ctx.stage_name)
    n = len(ctx.input("text").file("text.txt").read_text())
    (ctx.out_dir / "count.txt").write_text(str(n))
    ctx.log_summary({"length": n})


COUNT = StageKind(name="test_count", params=CountParams, run=run_count, produces="count",
                  inputs={"text": InputSpec("text")})


class FileSourceParams(StageParams):
    path: str


def run_file_source(params: FileSourceParams, ctx: StageContext) -> None:
    _record(ctx.stage_name)
    (ctx.out_dir / "text.txt").write_text(Path(params.path).read_text())


FILE_SOURCE = StageKind(name="test_file_source", params=FileSourceParams, run=run_file_source,
                        produces="text", fingerprint=lambda p: [file_fingerprint(p.path)])


def _file_exists(params: FileSourceParams) -> list[tuple[str, str]]:
    return [] if Path(params.path).is_file() else [("path", f"input file {params.path!r} does not exist")]


# FILE_SOURCE with the validation hook: a missing input is a spec error (exit 2, nothing created)
CHECKED_FILE_SOURCE = dataclasses.replace(FILE_SOURCE, validate_external=_file_exists)


class EnvProbeParams(StageParams):
    names: list[str] = []


def run_env_probe(params: EnvProbeParams, ctx: StageContext) -> None:
    """Writes the values the worker sees of ``names`` (null when unset)."""
    _record(ctx.stage_name)
    seen = {n: os.environ.get(n) for n in params.names}
    (ctx.out_dir / "env.json").write_text(json.dumps(seen, sort_keys=True))


ENV_PROBE = StageKind(name="test_env_probe", params=EnvProbeParams, run=run_env_probe, produces="env")


class LaunchEnvProbeParams(StageParams):
    ranks_per_node: int = 1


def run_launch_env_probe(params: LaunchEnvProbeParams, ctx: StageContext) -> None:
    """Writes the environment Ray Train workers of this stage would get (one per rank, each with its share of a
    node's resources), beside what the stage's own process sees."""
    from pipeline.worker_env import launched_worker_env

    r = ctx.resources
    workers = launched_worker_env(r.cpus / params.ranks_per_node, r.gpus / params.ranks_per_node)
    stage = {n: os.environ.get(n) for n in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR")}
    (ctx.out_dir / "env.json").write_text(json.dumps({"stage": stage, "workers": workers}, sort_keys=True))


LAUNCH_ENV_PROBE = StageKind(name="test_launch_env_probe", params=LaunchEnvProbeParams, run=run_launch_env_probe,
                             produces="env", launches_workers=True)


class WaitParams(StageParams):
    marker: str  # block while this file exists (at most timeout_s)
    pid_file: str  # where the worker writes its pid
    timeout_s: float = 120.0


def run_wait(params: WaitParams, ctx: StageContext) -> None:
    _record(ctx.stage_name)
    Path(params.pid_file).write_text(str(os.getpid()))
    deadline = time.monotonic() + params.timeout_s
    while Path(params.marker).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    (ctx.out_dir / "text.txt").write_text("waited")


WAIT = StageKind(name="test_wait", params=WaitParams, run=run_wait, produces="text")


class WorkersParams(StageParams):
    timeout_s: float = 60.0
    strategy: str = "SPREAD"  # STRICT_SPREAD: one worker per node, as a multi-node trainer needs


def _worker(i: int) -> dict:
    import ray

    return {"i": i, "node": ray.get_runtime_context().get_node_id(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def run_workers(params: WorkersParams, ctx: StageContext) -> None:
    """Reserves one bundle of the stage's per-node cpus/gpus per node at once, as Ray Train does, and
    runs a worker in each; never placed (timeout_s) if the stage's own task held part of them."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _record(ctx.stage_name)
    r = ctx.resources
    pg = placement_group([{"CPU": r.cpus, "GPU": r.gpus} if r.gpus else {"CPU": r.cpus}] * r.nodes,
                         strategy=params.strategy)
    try:
        ray.get(pg.ready(), timeout=params.timeout_s)
        done = ray.get([ray.remote(_worker).options(
            num_cpus=r.cpus, num_gpus=r.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(i) for i in range(r.nodes)], timeout=params.timeout_s)
    finally:
        remove_placement_group(pg)
    (ctx.out_dir / "workers.json").write_text(json.dumps(
        {"done": done, "resources": dataclasses.asdict(r),
         "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}, sort_keys=True))


WORKERS = StageKind(name="test_workers", params=WorkersParams, run=run_workers, produces="workers",
                    launches_workers=True)


class TreeParams(StageParams):
    pid_file: str  # every process of the tree appends its pid


TREE_SCRIPT = Path(__file__).with_name("process_tree.py")


def run_tree(params: TreeParams, ctx: StageContext) -> None:
    """A launcher-like job: three levels of sleeping processes, the second in a session of its own
    (like torchrun's ranks), through pipeline.launch.run_process_tree."""
    import sys

    from pipeline.launch import run_process_tree

    _record(ctx.stage_name)
    run_process_tree([sys.executable, str(TREE_SCRIPT), "1", "3", params.pid_file], log=ctx.progress,
                     name=ctx.stage_name)


TREE = StageKind(name="test_tree", params=TreeParams, run=run_tree, produces="text")


def shard_probe(shard: int, progress) -> dict:
    """A shard task's body for tests/test_shards.py: where it ran and with how many threads."""
    progress(f"probe {shard}")
    time.sleep(0.5)  # long enough that two shards overlap when both can run
    return {"shard": shard, "pid": os.getpid(), "omp": os.environ.get("OMP_NUM_THREADS"),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cwd": os.getcwd(), "t": time.time()}


def shard_fail(shard: int, progress) -> int:
    if shard == 1:
        raise ValueError(f"shard {shard} was told to fail")
    return shard


class ShardsParams(StageParams):
    shards: int = 2
    fail: bool = False


def run_shards(params: ShardsParams, ctx: StageContext) -> None:
    """Runs ``shards`` probe shards through ctx.map_shards and writes what each saw (stage pid included)."""
    fn = shard_fail if params.fail else shard_probe
    seen = ctx.map_shards(fn, list(range(params.shards)), what="probe")
    (ctx.out_dir / "shards.json").write_text(json.dumps({"stage_pid": os.getpid(), "shards": seen}))


SHARDS = StageKind(name="test_shards", params=ShardsParams, run=run_shards, produces="text", splits_work=True)


class WriterParams(StageParams):
    file: str = "big.bin"
    size_bytes: int = 1 << 20
    fill_disk: bool = False  # after its output, fill the rest of the disk (in the work dir) so the commit hits it


def run_writer(params: WriterParams, ctx: StageContext) -> None:
    """Writes ``size_bytes`` into ``file`` of its artifact, 64 KiB at a time (for full-disk tests)."""
    _record(ctx.stage_name)
    chunk = b"\x5a" * (64 << 10)
    with open(ctx.out_dir / params.file, "wb") as f:
        for start in range(0, params.size_bytes, len(chunk)):
            f.write(chunk[: params.size_bytes - start])
    if params.fill_disk:
        ctx.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(ctx.work_dir / "hog.bin", "wb", buffering=0) as f:
                while True:
                    f.write(chunk)
        except OSError:
            pass  # the disk is full now


WRITER = StageKind(name="test_writer", params=WriterParams, run=run_writer, produces="blob")


class StepsParams(StageParams):
    steps_before: int = 20  # metric `x` = step for steps 1..steps_before, flushed to the tracking store
    steps_after: int = 20  # then, once `marker` is gone, the remaining steps
    marker: str  # block while this file exists (at most timeout_s)
    pid_file: str  # written once the first steps are flushed
    timeout_s: float = 120.0


def run_steps(params: StepsParams, ctx: StageContext) -> None:
    """Logs one metric per step in two parts with a pause between (a tracking server can be stopped there), then a
    tag and a small artifact file."""
    _record(ctx.stage_name)
    for step in range(1, params.steps_before + 1):
        ctx.log_metrics({"x": float(step)}, step=step)
    ctx.sink.flush()
    Path(params.pid_file).write_text(str(os.getpid()))
    deadline = time.monotonic() + params.timeout_s
    while Path(params.marker).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    total = params.steps_before + params.steps_after
    for step in range(params.steps_before + 1, total + 1):
        ctx.log_metrics({"x": float(step)}, step=step)
    ctx.set_tags({"fixture.done": "yes"})
    (ctx.out_dir / "steps.txt").write_text(str(total))
    ctx.log_artifact(ctx.out_dir / "steps.txt", "fixture")
    ctx.log_summary({"steps": total})


STEPS = StageKind(name="test_steps", params=StepsParams, run=run_steps, produces="text")


class RendezvousParams(StageParams):
    dir: str  # each stage writes <dir>/<stage>.started, then waits for `expect` such files
    expect: int = 2
    timeout_s: float = 60.0
    label: str = ""  # stages that differ only by name need a param that differs: else they share one cache key


def run_rendezvous(params: RendezvousParams, ctx: StageContext) -> None:
    """Proves stages ran at the same time: it returns only once ``expect`` stages have started, else fails."""
    d = Path(params.dir)
    (d / f"{ctx.stage_name}.started").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    deadline = time.monotonic() + params.timeout_s
    while len(list(d.glob("*.started"))) < params.expect:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ctx.stage_name}: only {len(list(d.glob('*.started')))} of {params.expect} "
                               "stages started within the timeout: they did not run at once")
        time.sleep(0.05)
    time.sleep(0.5)  # met: hold the GPU a little longer, so the overlap shows in the start and end times too
    (ctx.out_dir / "text.txt").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", ""))


RENDEZVOUS = StageKind(name="test_rendezvous", params=RendezvousParams, run=run_rendezvous, produces="text")
