"""bench/step_speed_gpu.sh (issue 34) plans eight bench runs over four GPUs in two rounds and returns their logs as
one archive: run here in its dry-run mode (no GPU), so that a lent machine never finds a broken script."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "step_speed_gpu.sh"


def _old_tree(path: Path) -> None:
    """A stand-in for the old tree's archive: one file, xz-compressed as the header makes it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        data = b"# the old tree\n"
        info = tarfile.TarInfo("bench/README")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())


def _run(tmp_path: Path, **env_extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "site").mkdir(exist_ok=True)
    _old_tree(tmp_path / "old.tar.xz")
    env = {**os.environ, "DRY_RUN": "1", "SITE": str(tmp_path / "site"), "OLD_TREE": str(tmp_path / "old.tar.xz"),
           "OLD_DIR": str(tmp_path / "old"), "OUT": str(tmp_path / "out"), **env_extra}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_step_speed_script_swaps_the_trees_between_rounds_and_archives_every_run(tmp_path: Path) -> None:
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    planned = [line.split(": ", 1)[1] for line in r.stdout.splitlines() if " on GPU " in line]
    runs = {p.split(" on GPU ")[0]: p.split(" on GPU ")[1].split(" ")[0] for p in planned}
    assert runs == {"new-2048x8-r1": "0", "old-2048x8-r1": "1", "new-8192x2": "2", "new-32768x1": "3",
                    "old-2048x8-r2": "0", "new-2048x8-r2": "1", "new-profile": "2", "old-profile": "3"}
    assert "--shapes 32768x1" in next(p for p in planned if p.startswith("new-32768x1"))
    with tarfile.open(tmp_path / "out" / "step-speed.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {f"{name}.log" for name in runs} <= names
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step-speed.tar.gz"]


def test_the_step_speed_script_skips_round_two_past_its_deadline_and_refuses_a_missing_old_tree(
        tmp_path: Path) -> None:
    r = _run(tmp_path, DEADLINE_S="100")  # round 2 needs DEADLINE_S - 200 s left: none
    assert r.returncode == 0, r.stderr
    assert "new-2048x8-r1 on GPU 0" in r.stdout and "-r2 on GPU" not in r.stdout
    assert (tmp_path / "old" / "bench" / "README").read_text() == "# the old tree\n"  # unpacked where OLD_DIR says
    r = _run(tmp_path, OLD_TREE=str(tmp_path / "missing.tar.xz"), OLD_DIR=str(tmp_path / "fresh"))
    assert r.returncode == 2 and "no " + str(tmp_path / "missing.tar.xz") in r.stderr
