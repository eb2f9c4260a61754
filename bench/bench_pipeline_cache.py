"""Time `hylight run dags/tiny.yaml`: a cold run, then N warm reruns that must be all cache hits.

Usage: python bench/bench_pipeline_cache.py [--spec dags/tiny.yaml] [--reruns 5] [--root /tmp/x]
Prints a markdown table (cold wall time; warm min/median/max) with versions. The warm figure is the
issue's "second run is all cache hits and takes under 15 s" criterion, measured, not asserted.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(spec: str, root: Path, report: Path, env: dict[str, str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", spec, "--set", f"artifact_root={root}",
                           "--json", str(report)], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, json.loads(report.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="dags/tiny.yaml")
    ap.add_argument("--reruns", type=int, default=5)
    ap.add_argument("--root", default=None)
    args = ap.parse_args()
    tmp = Path(args.root or tempfile.mkdtemp(prefix="hylight-bench-"))
    env = {**os.environ, "HYLIGHT_STATE_DIR": str(tmp / "state")}
    cold, rep = run(args.spec, tmp / "runs", tmp / "cold.json", env)
    stages = {n: (s["state"], s["seconds"]) for n, s in rep["stages"].items()}
    warm = []
    for i in range(args.reruns):
        w, r = run(args.spec, tmp / "runs", tmp / f"warm{i}.json", env)
        states = {s["state"] for s in r["stages"].values()}
        if states != {"cached"}:
            sys.exit(f"rerun {i} was not all cache hits: {states}")
        warm.append(w)
    vers = " ".join(f"{p} {md.version(p)}" for p in ("torch", "ray", "mlflow", "datatrove", "tokenizers"))
    print(f"`python bench/bench_pipeline_cache.py --spec {args.spec} --reruns {args.reruns}` on "
          f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; {vers}\n")
    print("| run | wall s | stages |")
    print("|---|---|---|")
    print(f"| cold | {cold:.1f} | " + ", ".join(f"{n} {st} {sec:.1f}s" for n, (st, sec) in stages.items()) + " |")
    print(f"| warm (all cache hits), min / median / max of {len(warm)} | "
          f"{min(warm):.1f} / {statistics.median(warm):.1f} / {max(warm):.1f} | all cached |")


if __name__ == "__main__":
    main()
