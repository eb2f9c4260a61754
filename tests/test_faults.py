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
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.launch import pid_alive
from pipeline.spec import load_spec
from tests.fault_harness import (
    REPO,
    checkpoint_step,
    compare_artifacts,
    finish,
    kill_run,
    run_processes,
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
    has something to resume from), any other once its body started and a tenth of its reference time went by
    (0.3-20 s; prompts takes 2-9 s here, depending on the load)."""
    if kind in TRAINING_KINDS:
        return lambda: checkpoint_step(root, kind) > 0
    t: list[float] = []

    def ready() -> bool:
        if not stage_working(root, kind):
            return False
        t.append(time.monotonic()) if not t else None
        return time.monotonic() - t[0] >= min(max(0.1 * ref_seconds, 0.3), 20.0)

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
    kill_walk(tiny, tmp_path)


def kill_walk(tiny: dict, tmp_path: Path, remaining: list[str] | None = None, finished: set[str] | None = None,
              attempt: int = 0) -> None:
    """The walk; ``remaining``/``finished``/``attempt`` continue one cut short in ``tmp_path`` (by hand)."""
    ref = tiny["first"]["stages"]
    kinds = _kinds(REPO / "dags/tiny.yaml")
    root = tmp_path / "walk"
    env = {**tiny["env"], "HYLIGHT_STATE_DIR": str(tmp_path / "state")}
    base = ["run", "dags/tiny.yaml", "--set", f"artifact_root={root}"]
    first_of = {k: next(n for n, kk in kinds.items() if kk == k) for k in dict.fromkeys(kinds.values())}
    remaining = list(first_of) if remaining is None else remaining  # each kind once, in DAG order
    finished = set() if finished is None else finished
    records: list[dict] = []
    out = Path(os.environ.get("HYLIGHT_FAULTS_REPORT", tmp_path / "faults_report.json"))
    pending: list[str] = []  # stages of the last killed kind that were working at the kill

    def redone(text: str) -> None:
        """A stage caught working by the kill runs again in the next attempt: the kill interrupted it (had it
        committed just before the kill, the next attempt would take it from the cache)."""
        if pending:
            assert any(f"▶ {s} started" in text for s in pending), \
                f"attempt {attempt}: none of {pending} ran again: the kill came after they committed"
            records[-1]["interrupted"] = [s for s in pending if f"▶ {s} started" in text]
            pending.clear()

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
        redone(text)
        for earlier in finished:  # what finished before is never redone
            if re.search(rf"▶ {earlier} started", text) and not (forced and earlier == name):
                pytest.fail(f"attempt {attempt}: {earlier} ran again although it had finished:\n{text[-3000:]}")
        survivors, settle = kill_run(run)
        assert survivors == [], f"processes of the killed run still alive after 30 s: {survivors}"
        records.append({"attempt": attempt, "stage": name, "kind": kind, "forced": forced,
                        "killed_after_s": round(time.monotonic() - t_start[0], 1), "in_middle": in_middle,
                        "checkpoint_step": checkpoint_step(root, kind) if kind in TRAINING_KINDS else None,
                        "settle_s": round(settle, 2)})
        out.write_text(json.dumps({"kills": records}, indent=2))  # kept if a later step fails
        assert in_middle, f"{name} finished before it could be killed: {records[-1]}"
        finished |= _done(text) - {name}
        pending[:] = [s for s in re.findall(r"▶ (\S+) started", text) if kinds[s] == kind and s not in _done(text)]
        assert pending, f"attempt {attempt}: no {kind} stage was working at the kill"
        remaining.remove(kind)
        if forced:  # the forced stage's rerun: it must complete and match the reference
            attempt += 1
            rerun = start_run(args, env, tmp_path / f"attempt{attempt}.log")
            assert finish(rerun, 1800) == 0, rerun.text()[-3000:]
            redone(rerun.text())
    attempt += 1
    final = start_run(base + ["--json", str(tmp_path / "final.json")], env, tmp_path / f"attempt{attempt}.log")
    assert finish(final, 3600) == 0, final.text()[-3000:]
    redone(final.text())
    got = json.loads((tmp_path / "final.json").read_text())["stages"]
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("attempt*.log")))
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", logs)]
    table = {}
    for name, r in ref.items():
        d = compare_artifacts(Path(r["artifact"]), Path(got[name]["artifact"]))
        table[name] = {"bitwise": d.bitwise, "equal_but_timings": d.equal_but_timings,
                       "differing": d.differing, "only_ref": d.only_ref, "only_new": d.only_new}
    out.write_text(json.dumps({"kills": records, "resumed_from_steps": resumed, "artifacts": table}, indent=2))
    assert all(t["equal_but_timings"] for t in table.values()), json.dumps(
        {n: t for n, t in table.items() if not t["equal_but_timings"]}, indent=1)
    assert len(resumed) >= 2 and min(resumed) > 0, resumed  # pretrain and long_context continued, not restarted
    shutil.rmtree(root, ignore_errors=True)


def _link_copy(src: Path, dst: Path) -> None:
    """The fixture's artifact root, hard-linked (a commit renames directories into place, never writes into an
    accepted artifact), except the sqlite tracking store, which is written in place."""
    def link(a: str, b: str) -> None:
        if Path(a).name.startswith("mlflow.db"):
            shutil.copy2(a, b)
        else:
            os.link(a, b)

    shutil.copytree(src, dst, symlinks=True, copy_function=link)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.xdist_group("tiny_dag")
def test_a_run_killed_during_a_data_and_a_post_training_stage_resumes_to_the_same_artifacts(tiny, tmp_path):
    """The CI subset of the kill-walk, on a copy of the finished tiny DAG without dedup's and sft_short's artifacts:
    `hylight run --stage sft_short` is killed (process group, SIGKILL) during dedup, rerun and killed during
    sft_short, rerun to the end. Nothing of a killed run survives, what finished is never redone, and both artifacts
    come back equal to the uninterrupted run's (dedup bitwise; sft_short but for timing fields). pretrain's and
    long_context's resume from a checkpoint mid-training is tested at the stage level (tests/test_pretrain.py,
    tests/test_long_context.py) and through the CLI by the kill-walk."""
    ref = tiny["first"]["stages"]
    root = tmp_path / "runs"
    _link_copy(tiny["root"], root)
    for name in ("dedup", "sft_short"):
        shutil.rmtree(ref[name]["artifact"].replace(str(tiny["root"]), str(root)))
    env = {**tiny["env"], "HYLIGHT_STATE_DIR": str(tmp_path / "state")}
    args = ["run", "dags/tiny.yaml", "--set", f"artifact_root={root}", "--stage", "sft_short"]
    for attempt, (name, kind) in enumerate((("dedup", "dedup"), ("sft_short", "sft"))):
        run = start_run(args, env, tmp_path / f"killed{attempt}.log")
        ready = _kill_point(root, kind, min(ref[name]["seconds"], 10.0))
        assert wait_until(run, ready, 600, f"the middle of {name}"), f"ended first:\n{run.text()[-3000:]}"
        survivors, _ = kill_run(run)
        assert survivors == [], f"processes of the killed run still alive after 30 s: {survivors}"
        text = run.text()
        assert f"✓ {name} done" not in text, text[-3000:]
        if name == "sft_short":  # dedup finished in this attempt: never redone
            assert "✓ dedup done" in text and "✓ tokenizer cache hit" in text, text[-3000:]
    rerun = start_run([*args, "--json", str(tmp_path / "rerun.json")], env, tmp_path / "rerun.log")
    assert finish(rerun, 900) == 0, rerun.text()[-3000:]
    got = json.loads((tmp_path / "rerun.json").read_text())["stages"]
    assert {n for n, r in got.items() if r["state"] != "cached"} == {"sft_short"}, got
    assert got["dedup"]["digest"] == ref["dedup"]["digest"]
    assert compare_artifacts(Path(ref["dedup"]["artifact"]), Path(got["dedup"]["artifact"])).bitwise
    sft = compare_artifacts(Path(ref["sft_short"]["artifact"]), Path(got["sft_short"]["artifact"]))
    assert sft.equal_but_timings, sft
    assert not [p for p in sft.differing if p.startswith("model/") or p.endswith(".safetensors")], sft


# --- a Ray worker killed mid-task; MLflow down at start and mid-run ----------------------------------------------

HOLD_SPEC = """\
name: {name}
artifact_root: {root}
stages:
  hold:
    uses: tests.stage_fixtures:{kind}
    params: {{marker: {marker}, pid_file: {pid_file}}}
"""


def _spec(tmp_path: Path, name: str, kind: str) -> tuple[Path, Path, Path, Path]:
    marker, pid_file, root = tmp_path / "HOLD", tmp_path / "worker.pid", tmp_path / "root"
    marker.write_text("x")
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(HOLD_SPEC.format(name=name, root=root, kind=kind, marker=marker, pid_file=pid_file))
    return spec, marker, pid_file, root


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HYLIGHT_STATE_DIR": str(tmp_path / "state"), **extra}


def test_mlflow_server_unreachable_at_start_is_a_clear_error_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec, _, _, root = _spec(tmp_path, "nomlflow", "WAIT")
    t0 = time.monotonic()
    run = start_run(["run", str(spec), "--tracking-uri", f"http://127.0.0.1:{port}"], _env(tmp_path),
                    tmp_path / "run.log")
    rc = finish(run, 120)
    took = time.monotonic() - t0
    assert rc == 2, run.text()
    assert f"cannot reach the MLflow tracking server at http://127.0.0.1:{port}" in run.text()
    assert "Nothing was run" in run.text() and "▶" not in run.text()
    assert not root.exists()  # nothing written: no artifact root, no Ray
    assert took < 30, took  # no MLflow retry loop (its default would wait minutes)


@pytest.mark.slow
def test_a_ray_worker_killed_mid_task_fails_its_stage_clearly_without_a_hang(tmp_path):
    """SIGKILL of the stage's worker process (not the driver): the run ends promptly, the stage is failed with a
    message naming it and the worker's death (no retry: stages run with max_retries=0), nothing is left running."""
    spec, _, pid_file, root = _spec(tmp_path, "workerkill", "WAIT")
    run = start_run(["run", str(spec)], _env(tmp_path), tmp_path / "run.log")
    assert wait_until(run, pid_file.exists, 300, "the stage's worker to start"), run.text()
    procs = run_processes(run.proc.pid)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    t0 = time.monotonic()
    rc = finish(run, 120)
    assert rc == 1, run.text()
    assert time.monotonic() - t0 < 60, "the run took over a minute to notice its dead worker"
    text = run.text()
    failed = re.search(r"✗ hold failed after [\d.]+s: (.*)", text)
    assert failed, text
    assert "died" in failed.group(1) or "Crashed" in failed.group(1), failed.group(1)
    deadline = time.monotonic() + 30
    while any(pid_alive(p, t) for p, t in procs.items()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p, t in procs.items() if pid_alive(p, t)] == []
    assert not list((root / "artifacts").glob("*/*"))  # no artifact accepted from the dead worker


def _mlflow_server(tmp_path: Path, port: int) -> subprocess.Popen:
    import sys
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{tmp_path / 'server.db'}", "--default-artifact-root",
                             (tmp_path / "server-artifacts").as_uri(), "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    _stop(proc)
    pytest.fail("mlflow server did not come up in 120 s")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the server and its worker
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.mark.slow
@pytest.mark.extended
def test_an_mlflow_server_gone_mid_run_loses_no_metrics(tmp_path):
    """The server is killed while a stage logs: the stage finishes anyway (what it could not send goes to its
    journal); the driver waits HYLIGHT_TRACKING_WAIT_S for the server, then stops with a message naming what is not
    logged; with the server back, the next run sends it: every step of the metric is in MLflow exactly once."""
    import socket

    from pipeline import tracking

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    spec, marker, pid_file, root = _spec(tmp_path, "outage", "STEPS")
    env = _env(tmp_path, HYLIGHT_TRACKING_WAIT_S="3")
    server = _mlflow_server(tmp_path, port)
    try:
        run = start_run(["run", str(spec), "--tracking-uri", uri], env, tmp_path / "run1.log")
        assert wait_until(run, pid_file.exists, 300, "the first steps to be logged"), run.text()
        _stop(server)  # gone mid-stage
        marker.unlink()
        assert finish(run, 300) == 1, run.text()
        text = run.text()
        assert "✓ hold done" in text, text  # the stage itself did not fail
        assert "Not logged to MLflow yet" in text and re.search(r"\d+ metric value\(s\) \(.*\bx\)", text), text
        assert tracking.JOURNAL_DIR in text
        journals = list((root / tracking.JOURNAL_DIR).glob("*.jsonl"))
        assert len(journals) == 1
        server = _mlflow_server(tmp_path, port)  # back, same store
        rerun = start_run(["run", str(spec), "--tracking-uri", uri], env, tmp_path / "run2.log")
        assert finish(rerun, 300) == 0, rerun.text()
        assert "journaled MLflow record(s)" in rerun.text() and "✓ hold cache hit" in rerun.text()
        assert not list((root / tracking.JOURNAL_DIR).glob("*.jsonl"))
        c = tracking.client(uri)
        stage_run = c.get_run(journals[0].stem)
        history = c.get_metric_history(stage_run.info.run_id, "x")
        assert sorted((m.step, m.value) for m in history) == [(i, float(i)) for i in range(1, 41)]
        assert stage_run.data.tags["fixture.done"] == "yes"
        assert "stage_seconds" in stage_run.data.metrics and stage_run.data.metrics["steps"] == 40
        assert [f.path for f in c.list_artifacts(stage_run.info.run_id, "fixture")] == ["fixture/steps.txt"]
    finally:
        _stop(server)
