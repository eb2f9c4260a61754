"""bench/copy_probe_gpu.sh is the next lease's first call (issue 33): run on the CPU here with two steps, so that
a GPU call never finds a broken script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "copy_probe_gpu.sh"


def _run(tmp_path: Path, variants: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SITE_READY": "1", "DEVICE": "cpu", "PYTHON": sys.executable, "OUT": str(tmp_path),
           "VARIANTS": variants, "MORE_ARGS": "--steps 2 --rows 2", "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_copy_probe_runs_its_variants_and_writes_the_summary(tmp_path: Path) -> None:
    r = _run(tmp_path, "toy-v256")
    assert r.returncode == 0, r.stderr
    summary = (tmp_path / "summary.md").read_text().splitlines()
    row = next(line for line in summary if line.startswith("| toy-v256 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2" and cells[2] == "none" and cells[5] == "5.53"  # 2 steps; ln(256 - 4 reserved ids)


def test_the_copy_probe_refuses_an_unknown_variant_before_running_anything(tmp_path: Path) -> None:
    r = _run(tmp_path, "toy-v256 no-such-variant")
    assert r.returncode == 2 and "unknown variant no-such-variant" in r.stderr
    assert not (tmp_path / "toy-v256.log").exists()
