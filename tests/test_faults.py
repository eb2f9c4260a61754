"""Faults survived (issue 13): a `hylight run` SIGKILLed during a stage resumes and ends with the artifacts of an
uninterrupted run; a killed Ray worker is a clear stage failure; an MLflow server that is down is a clear error.

The reference is the uninterrupted tiny DAG of tests/test_tiny_dag.py (the session fixture `tiny`, same xdist
group). `test_kill_walk_over_every_stage_kind` kills the DAG once during each stage kind (~20 min on 2 cores) and
is deselected by default: `pytest -m faults tests/test_faults.py` (results: docs/notes/faults.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from pipeline.spec import load_spec
from tests.fault_harness import (
    REPO,
    checkpoint_step,
    compare_artifacts,
    finish,
    kill_run,
    stage_working,
    start_run,
    started,
    wait_until,
)

TRAINING_KINDS = ("pretrain", "long_context")  # checkpointed: a rerun continues from the last checkpoint


def _kinds(spec_path: Path) -> dict[str, str]:
    spec = load_spec(spec_path, check_external=False)
    return {name: st.kind.name for name, st in spec.stages.items()}


def _kill_point(root: Path, kind: str, ref_seconds: float):
    """When a stage counts as 'in the middle': a training stage once it checkpointed a step after 0 (so the rerun
    has something to resume from), any other once its body started and 40% of its reference time went by."""
    if kind in TRAINING_KINDS:
        return lambda: checkpoint_step(root, kind) > 0
    t: list[float] = []

    def ready() -> bool:
        if not stage_working(root, kind):
            return False
        t.append(time.monotonic()) if not t else None
        return time.monotonic() - t[0] >= min(0.4 * ref_seconds, 20.0)

    return ready


def _done(text: str) -> set[str]:
    return set(re.findall(r"✓ (\S+) (?:done|cache hit)", text))


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.timeout(5400)
@pytest.mark.xdist_group("tiny_dag")
def test_kill_walk_over_every_stage_kind(tiny, tmp_path):
    """Kill `hylight run dags/tiny.yaml` during a stage of each kind in turn (a forced `--stage NAME` run for a
    kind whose stage already finished), rerun, and at the end compare every artifact with the uninterrupted run."""
    ref = tiny["first"]["stages"]
    kinds = _kinds(REPO / "dags/tiny.yaml")
    root = tmp_path / "walk"
    env = {**tiny["env"], "HYLIGHT_STATE_DIR": str(tmp_path / "state")}
    base = ["run", "dags/tiny.yaml", "--set", f"artifact_root={root}"]
    remaining = list(dict.fromkeys(kinds.values()))  # each kind once, in DAG order
    first_of = {k: next(n for n, kk in kinds.items() if kk == k) for k in remaining}
    finished: set[str] = set()
    records = []
    attempt = 0
    while remaining:
        todo = [k for k in remaining if first_of[k] not in finished]
        kind = todo[0] if todo else remaining[0]
        name = first_of[kind]
        forced = not todo
        args = base + (["--stage", name] if forced else [])
        attempt += 1
        run = start_run(args, env, tmp_path / f"attempt{attempt}.log")
        t_start = [0.0]
        hit = wait_until(run, lambda n=name, r=run: started(r, n), 1800, f"{name} to start")
        assert hit, f"run ended before {name} started:\n{run.text()[-3000:]}"
        t_start[0] = time.monotonic()
        in_middle = wait_until(run, _kill_point(root, kind, ref[name]["seconds"]), 1800, f"the middle of {name}")
        text = run.text()
        for earlier in finished:  # what finished before is never redone
            if re.search(rf"▶ {earlier} started", text) and not (forced and earlier == name):
                pytest.fail(f"attempt {attempt}: {earlier} ran again although it had finished:\n{text[-3000:]}")
        survivors, settle = kill_run(run)
        assert survivors == [], f"processes of the killed run still alive after 30 s: {survivors}"
        records.append({"attempt": attempt, "stage": name, "kind": kind, "forced": forced,
                        "killed_after_s": round(time.monotonic() - t_start[0], 1), "in_middle": in_middle,
                        "checkpoint_step": checkpoint_step(root, kind) if kind in TRAINING_KINDS else None,
                        "settle_s": round(settle, 2)})
        assert in_middle, f"{name} finished before it could be killed: {records[-1]}"
        finished |= _done(text) - {name}
        remaining.remove(kind)
        if forced:  # the forced stage's rerun: it must complete and match the reference
            attempt += 1
            rerun = start_run(args, env, tmp_path / f"attempt{attempt}.log")
            assert finish(rerun, 1800) == 0, rerun.text()[-3000:]
    attempt += 1
    final = start_run(base + ["--json", str(tmp_path / "final.json")], env, tmp_path / f"attempt{attempt}.log")
    assert finish(final, 3600) == 0, final.text()[-3000:]
    got = json.loads((tmp_path / "final.json").read_text())["stages"]
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("attempt*.log")))
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", logs)]
    table = {}
    for name, r in ref.items():
        d = compare_artifacts(Path(r["artifact"]), Path(got[name]["artifact"]))
        table[name] = {"bitwise": d.bitwise, "equal_but_timings": d.equal_but_timings,
                       "differing": d.differing, "only_ref": d.only_ref, "only_new": d.only_new}
    out = Path(os.environ.get("HYLIGHT_FAULTS_REPORT", tmp_path / "faults_report.json"))
    out.write_text(json.dumps({"kills": records, "resumed_from_steps": resumed, "artifacts": table}, indent=2))
    assert all(t["equal_but_timings"] for t in table.values()), json.dumps(
        {n: t for n, t in table.items() if not t["equal_but_timings"]}, indent=1)
    assert len(resumed) >= 2 and min(resumed) > 0, resumed  # pretrain and long_context continued, not restarted
    shutil.rmtree(root, ignore_errors=True)
