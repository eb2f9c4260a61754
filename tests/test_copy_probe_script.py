"""bench/copy_probe_gpu.sh is the next lease's first call (issue 33): run on the CPU here with two steps, so that
a GPU call never finds a broken script."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "copy_probe_gpu.sh"


def _run(tmp_path: Path, variants: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SITE_READY": "1", "DEVICE": "cpu", "PYTHON": sys.executable, "OUT": str(tmp_path),
           "VARIANTS": variants, "MORE_ARGS": "--steps 2 --rows 2", "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_copy_probe_runs_its_variants_and_writes_the_summary(tmp_path: Path) -> None:
    r = _run(tmp_path, "toy-v256")
    assert r.returncode == 0, r.stderr
    summary = (tmp_path / "summary.md").read_text().splitlines()
    row = next(line for line in summary if line.startswith("| toy-v256 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2" and cells[2] == "none" and cells[5] == "5.53"  # 2 steps; ln(256 - 4 reserved ids)
    with tarfile.open(tmp_path / "copy-probe-logs.tar.gz") as tar:  # the logs come back as one file
        names = {Path(n).name for n in tar.getnames()}
    assert {"toy-v256.log", "toy-v256.err"} <= names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy-probe-logs.tar.gz", "summary.md"]


def test_the_copy_probe_queue_runs_every_variant_once_and_skips_past_the_deadline(tmp_path: Path) -> None:
    # a tied variant at the tiny size and the toy on one CPU device, one after another from the queue
    # (and a varying-span variant: its --span-min 32 with this --span 32 and --packed)
    r = _run(tmp_path, "300m-v32k-tied var-v32k toy-v256",
             MORE_ARGS="--steps 2 --rows 2 --size tiny --seq-len 65 --span 32")
    assert r.returncode == 0, r.stderr
    for v in ("300m-v32k-tied", "var-v32k", "toy-v256"):
        assert r.stdout.count(f"{v} on device 0") == 1
        assert f"{v} ended (rc 0)" in r.stdout
    r = _run(tmp_path / "late", "toy-v256", DEADLINE_S="10")  # under 30 s left at the start: skipped, said so
    assert r.returncode == 0 and "toy-v256 skipped: the 10 s deadline" in r.stdout
    assert "| toy-v256 | skipped: copy_probe_gpu: toy-v256 skipped" in (tmp_path / "late" / "summary.md").read_text()


def test_the_copy_probe_refuses_an_unknown_variant_before_running_anything(tmp_path: Path) -> None:
    r = _run(tmp_path, "toy-v256 no-such-variant")
    assert r.returncode == 2 and "unknown variant no-such-variant" in r.stderr
    assert not (tmp_path / "logs" / "toy-v256.log").exists()


def test_the_stage_layout_variants_run_bench_copy_rows(tmp_path: Path) -> None:
    r = _run(tmp_path, "stage-rows-short stage-rows-xavier", MORE_ARGS="--steps 2 --rows 1 --size tiny --L 160 --vocab 512")
    assert r.returncode == 0, r.stderr
    assert "stage-rows-short on device 0 (" in r.stdout and "copy_rows.py --size gpu-300m" in r.stdout
    assert "stage-rows-short ended (rc 0)" in r.stdout and "stage-rows-xavier ended (rc 0)" in r.stdout
    row = next(line for line in (tmp_path / "summary.md").read_text().splitlines()
               if line.startswith("| stage-rows-short |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2" and cells[5] == "6.22"  # 2 steps; ln(512 - 8 reserved ids)
