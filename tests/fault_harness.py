"""Kill a real `hylight run` at a chosen point, check that nothing of it survives, and compare artifacts.

Used by tests/test_faults.py. The run is a subprocess in a session of its own (as a terminal job would be);
``kill_run`` SIGKILLs its whole process group (the driver and the local Ray it started: gcs_server, raylet,
agents, stage workers) and then waits until no process of the run is alive (the watchdog of
``pipeline.launch.start_watchdog`` takes whatever left the group).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.launch import descendants, pid_alive, process_start_ticks

REPO = Path(__file__).resolve().parent.parent

# Fields of JSON/JSONL files in artifacts that hold wall-clock measurements: different on every run, killed or not.
TIMING_KEYS = frozenset({"tokens_per_second", "mfu", "seconds", "train_seconds", "elapsed_s", "stage_seconds",
                         "generation_tokens_per_second", "samples_per_second", "steps_per_second",
                         "train_runtime", "train_samples_per_second", "train_steps_per_second", "wall_s",
                         "created_at", "sandbox_seconds", "docs_per_second", "eval_tokens_per_second",
                         "generation_tokens_per_second_mean", "selection_seconds",
                         "memory_gb"})  # measured peak memory (pretrain's train_log.jsonl): not the same twice

# Absolute paths of input artifacts recorded in an artifact (mix's mixture_stats.json "inputs"): they differ between
# artifact roots (the walk's and the reference's), never between two runs in one root.
# Likewise the reward model's path in grpo's rl_report.json.
LOCATION_KEYS = frozenset({"path", "reward_model"})
# A .gz file whose decompressed bytes are equal: only the gzip header (its mtime) differs.
GZIP_HEADER = "<gzip header>"


@dataclass
class RunningPipeline:
    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_run(args: list[str], env: dict[str, str], log: Path) -> RunningPipeline:
    """`python -m pipeline.cli ARGS` in its own session, stdout+stderr to ``log``."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return RunningPipeline(proc, log)


def wait_until(run: RunningPipeline, ready: Callable[[], bool], timeout_s: float, what: str) -> bool:
    """Poll ``ready`` until it holds (True) or the run exits first (False). Fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if run.proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            kill_run(run)
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; log tail:\n"
                                 + run.text()[-3000:])
        time.sleep(0.2)
    return True


def started(run: RunningPipeline, stage: str) -> bool:
    return f"▶ {stage} started" in run.text()


def stage_working(root: Path, kind: str) -> bool:
    """The stage's body has begun: its private output directory exists (ArtifactStore.begin)."""
    tmp = root / ".tmp"
    return tmp.is_dir() and any(p.name.startswith(f"{kind}__") for p in tmp.iterdir())


_STEP = re.compile(r"step(\d+)")


def checkpoint_step(root: Path, kind: str) -> int:
    """The highest training step checkpointed by a stage of ``kind`` still in its resume dir (-1: none)."""
    best = -1
    for latest in (root / "resume" / kind).glob("**/deepspeed/latest"):
        try:
            m = _STEP.search(latest.read_text())
        except OSError:
            continue
        if m:
            best = max(best, int(m.group(1)) + (100_000 * _phase(latest)))
    return best


def _phase(latest: Path) -> int:
    m = re.search(r"/phase(\d+)/", str(latest))
    return int(m.group(1)) if m else 0


def run_processes(pid: int) -> dict[int, int | None]:
    """pid -> start ticks of ``pid`` and every process below it."""
    return {p: process_start_ticks(p) for p in [pid, *descendants(pid)]}


def kill_run(run: RunningPipeline, settle_s: float = 30.0) -> tuple[list[str], float]:
    """SIGKILL the run's process group. Returns (processes of the run still alive after ``settle_s``, seconds
    until none was). The run's processes are read from /proc just before the kill."""
    procs = run_processes(run.proc.pid)
    names = {p: _cmdline(p) for p in procs}
    try:
        os.killpg(run.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    run.proc.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < settle_s:
        alive = [p for p, t in procs.items() if pid_alive(p, t)]
        if not alive:
            return [], time.monotonic() - t0
        time.sleep(0.1)
    alive = [p for p, t in procs.items() if pid_alive(p, t)]
    for p in alive:  # never leave them behind on a failed assertion
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [f"{p} {names[p]}" for p in alive], time.monotonic() - t0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:100]
    except OSError:
        return "?"


def finish(run: RunningPipeline, timeout_s: float) -> int:
    try:
        return run.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_run(run)
        raise AssertionError(f"run did not finish in {timeout_s:.0f}s; log tail:\n{run.text()[-3000:]}") from None


@dataclass
class ArtifactDiff:
    """How two artifacts of the same stage differ: files only in one, and files whose bytes differ, with the JSON
    keys that differ in them (None when not JSON, or when they differ beyond keys)."""

    only_ref: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)
    differing: dict[str, list[str] | None] = field(default_factory=dict)

    @property
    def bitwise(self) -> bool:
        return not (self.only_ref or self.only_new or self.differing)

    @property
    def equal_but_timings(self) -> bool:
        """Equal once the wall-clock fields (TIMING_KEYS) and absolute input paths (LOCATION_KEYS) are left out."""
        return not (self.only_ref or self.only_new) and all(
            keys is not None and set(keys) <= TIMING_KEYS | LOCATION_KEYS | {GZIP_HEADER}
            for keys in self.differing.values())


def compare_artifacts(ref: Path, new: Path) -> ArtifactDiff:
    files = {}
    for side in (ref, new):
        m = json.loads((side / "manifest.json").read_text())
        files[side] = {f["path"]: f["sha256"] for f in m["files"]}
    a, b = files[ref], files[new]
    diff = ArtifactDiff(only_ref=sorted(set(a) - set(b)), only_new=sorted(set(b) - set(a)))
    for path in sorted(set(a) & set(b)):
        if a[path] != b[path]:
            diff.differing[path] = _json_key_diff(ref / path, new / path)
    return diff


def _json_key_diff(x: Path, y: Path) -> list[str] | None:
    """Keys whose values differ between two JSON (or JSONL) files of the same shape; [GZIP_HEADER] for .gz files
    equal once decompressed; None if not comparable."""
    if x.suffix == ".gz":
        import gzip

        return [GZIP_HEADER] if gzip.decompress(x.read_bytes()) == gzip.decompress(y.read_bytes()) else None
    try:
        tx, ty = x.read_text(), y.read_text()
        if x.suffix == ".jsonl":
            dx, dy = [json.loads(line) for line in tx.splitlines()], [json.loads(line) for line in ty.splitlines()]
        else:
            dx, dy = json.loads(tx), json.loads(ty)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    keys: set[str] = set()
    if not _walk(dx, dy, "", keys):
        return None
    return sorted(keys)


def _walk(a: object, b: object, key: str, keys: set[str]) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return False
        return all(_walk(a[k], b[k], k, keys) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_walk(u, v, key, keys) for u, v in zip(a, b, strict=True))
    if a != b:
        keys.add(key)
    return True
