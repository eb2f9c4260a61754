"""A stage's work split into shards and run as Ray tasks (``resources.tasks``; StageContext.map_shards).

How it runs (``RayShardRunner``): the stage, itself a Ray task holding its ``cpus``, submits one Ray task per
shard, each asking for one CPU, at most ``resources.tasks`` in flight, and waits for them with ``ray.wait``.

- **No deadlock on the CPUs the stage holds.** Ray releases a task's CPUs while it is blocked in
  ``ray.get``/``ray.wait`` and takes them back when it returns (Ray docs, "Nested Remote Functions: Yielding
  Resources While Blocked"; GPUs are kept, and these tasks ask for none). So a stage holding every CPU of a
  2-CPU node still gets its two 1-CPU shard tasks run (tests/test_shards.py checks that case with a timeout).
  The shard tasks are ordinary 1-CPU tasks: Ray places them on any node with a free CPU, and accounts for them.
- **One fresh process per shard** (``max_calls=1``): its thread variables (OMP_NUM_THREADS=1 and friends) are
  set before the stage module is imported, so numpy/torch/tokenizers start with one thread; its peak RSS
  (``ru_maxrss``) is that shard's alone; nothing it loads (a language model, an encoder) stays in a reused
  worker. Costs a worker start (~1-3 s here, more with torch) per shard.
- **Same environment as the stage**: its working directory (relative paths in params) and the variables
  ``hylight run`` forwards (pipeline.worker_env.launched_worker_env), no GPU.
- **Failures**: a shard that raises fails the stage with the shard's number and the error; the other shards are
  cancelled. A cancelled stage (Ctrl-C: ``ray.cancel(force=True)``, recursive by default) takes its shards with it.

Why the number of tasks can stay out of the cache key: each kind that splits its work computes every document's
result independently of which shard it is in (shard boundaries are aligned where batching matters) and merges in
input order; anything global (dedup's exact groups and LSH buckets) is decided after the shards, over all of them.
The tests compare the artifact digests for tasks = 1, 2, 3.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.stage import ShardResult, ShardRunner, ShardStats, StageContext, peak_rss_mib
from pipeline.worker_env import apply_env_defaults, launched_worker_env

R = TypeVar("R")


def split_ranges(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``parts`` contiguous, non-empty ranges of nearly equal size whose inner
    boundaries are multiples of ``align`` (so a batch of ``align`` items is never split between shards)."""
    if n < 0 or parts < 1 or align < 1:
        raise ValueError(f"split_ranges(n={n}, parts={parts}, align={align}): need n >= 0, parts >= 1, align >= 1")
    blocks = -(-n // align)
    parts = max(1, min(parts, blocks))
    bounds = [min(n, (blocks * k // parts) * align) for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a] or [(0, n)]


def _function_ref(fn: Callable[..., Any]) -> str:
    module, name = fn.__module__, fn.__qualname__
    if module == "__main__" or "<" in name:
        raise ValueError(f"map_shards needs a module-level function of an importable module, got {module}.{name}: "
                         "shard tasks import it by name in another process")
    return f"{module}:{name}"


def run_shard(ref: str, shard: Any, index: int, count: int, label: str, cwd: str,
              env: dict[str, str]) -> ShardResult[Any]:
    """Body of one shard's Ray task: the stage's directory and environment, one thread, then ``fn(shard)``."""
    os.environ.update(env)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.chdir(cwd)
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    apply_env_defaults(gpus=0, user_set=env)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    module, name = ref.split(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)

    def progress(msg: str) -> None:
        print(f"[{label} {index + 1}/{count}] {msg}", file=sys.stderr, flush=True)

    start = time.monotonic()
    value = fn(shard, progress)
    return ShardResult(value, ShardStats(index, time.monotonic() - start, peak_rss_mib(), socket.gethostname(),
                                         os.getpid()))


class RayShardRunner(ShardRunner):
    """Shards as 1-CPU Ray tasks, at most ``tasks`` at a time (the module docstring says why this cannot
    deadlock and what each task gets)."""

    def __init__(self, tasks: int) -> None:
        self.tasks = max(1, int(tasks))

    def map(self, fn: Callable[[Any, Callable[[str], None]], R], shards: list[Any], ctx: StageContext,
            what: str) -> list[ShardResult[R]]:
        import ray  # heavy: ray, only where shards run as Ray tasks

        ref, env, cwd = _function_ref(fn), launched_worker_env(1, 0), os.getcwd()
        label = f"{ctx.stage_name} {what}"
        remote = ray.remote(max_calls=1)(run_shard).options(num_cpus=1, num_gpus=0, max_retries=0,
                                                            name=f"shard:{ctx.stage_name}:{what}")
        results: dict[int, ShardResult[R]] = {}
        running: dict[Any, int] = {}
        waiting = list(range(len(shards)))
        start = time.monotonic()
        ctx.progress(f"{len(shards)} {what} shard(s) as Ray tasks, {min(self.tasks, len(shards))} at a time")
        try:
            while waiting or running:
                while waiting and len(running) < self.tasks:
                    i = waiting.pop(0)
                    running[remote.remote(ref, shards[i], i, len(shards), label, cwd, env)] = i
                done, _ = ray.wait(list(running), num_returns=1)
                for obj in done:
                    i = running.pop(obj)
                    try:
                        results[i] = ray.get(obj)
                    except ray.exceptions.RayError as e:
                        cause = getattr(e, "cause", None) or e
                        raise RuntimeError(f"stage {ctx.stage_name!r}: {what} shard {i + 1}/{len(shards)} failed: "
                                           f"{type(cause).__name__}: {cause}") from e
                    s = results[i].stats
                    ctx.progress(f"{what} shard {i + 1}/{len(shards)} done in {s.seconds:.1f}s on {s.host} "
                                 f"(peak RSS {s.peak_rss_mib:.0f} MiB); {len(results)}/{len(shards)} after "
                                 f"{time.monotonic() - start:.1f}s")
        finally:
            for obj in running:
                ray.cancel(obj, force=True)
        out = [results[i] for i in range(len(shards))]
        ctx.record_shards([r.stats for r in out], what)
        return out
