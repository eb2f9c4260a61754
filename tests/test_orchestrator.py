"""Cache, force/downstream/from semantics, failure and kill recovery, MLflow run structure.

Real Ray (one local instance for the module) and a real MLflow sqlite store; stages are the tiny
plugin kinds in tests/stage_fixtures.py.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline import cli, tracking
from pipeline.artifacts import ArtifactStore
from pipeline.orchestrator import RunOptions, run_pipeline, summary_table
from pipeline.spec import load_spec

pytestmark = pytest.mark.slow

SPEC = """\
name: cachetest
artifact_root: {root}
stages:
  a:
    uses: tests.stage_fixtures:SOURCE
    params: {{text: "A"}}
  b:
    uses: tests.stage_fixtures:SOURCE
    params: {{text: "B"}}
  ab:
    uses: tests.stage_fixtures:CONCAT
    needs: [a, b]
    params: {{fail_marker: {fail}, kill_marker: {kill}}}
  n:
    uses: tests.stage_fixtures:COUNT
    needs: [ab]
  other:
    uses: tests.stage_fixtures:SOURCE
    params: {{text: "X"}}
"""


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def env(tmp_path, monkeypatch, ray_local):
    log = tmp_path / "ran.log"
    monkeypatch.setenv("HYLIGHT_TEST_LOG", str(log))
    monkeypatch.setenv("HYLIGHT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(Path(__file__).parent.parent)  # plugin stages import as tests.stage_fixtures
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(textwrap.dedent(SPEC).format(root=tmp_path / "runs", fail=tmp_path / "FAIL",
                                                      kill=tmp_path / "KILL"))

    class Env:
        root = tmp_path / "runs"
        spec = spec_path
        console = ""  # what the last run printed

        def run(self, overrides=(), **opts):
            if log.exists():
                log.unlink()
            spec = load_spec(spec_path, overrides=list(overrides))
            out = io.StringIO()
            report = run_pipeline(spec, RunOptions(**opts), out=out)
            self.console = out.getvalue()
            ran = log.read_text().split() if log.exists() else []
            return report, ran

        def marker(self, name):
            (tmp_path / name).write_text("x")

    return Env()


def states(report):
    return {k: v.state for k, v in report.stages.items()}


def test_first_run_then_all_cached(env):
    report, ran = env.run()
    assert report.ok and sorted(ran) == ["a", "ab", "b", "n", "other"]
    assert Path(report.stages["ab"].artifact, "text.txt").read_text() == "A|B"
    assert Path(report.stages["n"].artifact, "count.txt").read_text() == "3"
    report2, ran2 = env.run()
    assert ran2 == [] and set(states(report2).values()) == {"cached"}
    assert report2.stages["n"].digest == report.stages["n"].digest


def test_two_stages_with_one_cache_key_run_once_and_the_second_reads_the_firsts_artifact(env, tmp_path):
    """Two stages of the same kind, params and inputs that could run at once (2 CPUs) share one cache key, and so
    one resume directory: run together, they wrote into each other's files (two long_context stages of
    dags/lasp-gpu.yaml's CPU rehearsal, whose overrides made them equal, mixed their training logs). The second
    waits for the first and is then a cache hit."""
    spec_path = tmp_path / "twins.yaml"
    spec_path.write_text(textwrap.dedent(f"""\
        name: twins
        artifact_root: {tmp_path / "twins"}
        stages:
          first:
            uses: tests.stage_fixtures:SOURCE
            params: {{text: "same", sleep_s: 1.0}}
          second:
            uses: tests.stage_fixtures:SOURCE
            params: {{text: "same", sleep_s: 1.0}}
        """))
    log = Path(os.environ["HYLIGHT_TEST_LOG"])
    out = io.StringIO()
    report = run_pipeline(load_spec(spec_path), RunOptions(), out=out)
    assert report.ok and len(log.read_text().split()) == 1, out.getvalue()  # one of the two ran
    assert sorted(states(report).values()) == ["cached", "done"]
    assert report.stages["first"].digest == report.stages["second"].digest
    assert "waits for" in out.getvalue()


def test_param_change_reruns_stage_and_dependents_only(env):
    env.run()
    report, ran = env.run(overrides=["a.text=ZZ"])
    assert sorted(ran) == ["a", "ab", "n"]
    assert states(report) == {"a": "done", "b": "cached", "ab": "done", "n": "done", "other": "cached"}
    assert Path(report.stages["n"].artifact, "count.txt").read_text() == "4"
    # going back to the old value is a cache hit everywhere: artifacts are content-addressed
    _, ran = env.run()
    assert ran == []


def test_identical_output_does_not_invalidate_dependents(env):
    env.run()
    # same text produced a different way: a's key changes, its output digest does not
    report, ran = env.run(overrides=["a.text=''", "a.repeat=0"])
    report, ran = env.run(overrides=["a.text=A", "a.repeat=1", "a.sleep_s=0.01"])
    assert ran == ["a"] and report.stages["ab"].state == "cached"


def test_force_one_stage_and_downstream_and_from(env):
    env.run()
    report, ran = env.run(stages=["ab"])
    assert ran == ["ab"] and set(report.stages) == {"a", "b", "ab"}
    report, ran = env.run(stages=["ab"], downstream=True)
    assert sorted(ran) == ["ab", "n"] and set(report.stages) == {"a", "b", "ab", "n"}
    report, ran = env.run(from_stage="ab")
    assert sorted(ran) == ["ab", "n"] and states(report)["other"] == "cached"


def test_failure_keeps_upstream_and_rerun_resumes_at_failed_stage(env):
    env.marker("FAIL")
    report, ran = env.run()
    assert not report.ok
    assert states(report) == {"a": "done", "b": "done", "ab": "failed", "n": "skipped", "other": "done"}
    assert "told to fail" in report.stages["ab"].error
    assert not ArtifactStore(env.root).lookup("test_concat", report.stages["ab"].cache_key)
    (env.root.parent / "FAIL").unlink()
    report, ran = env.run()
    assert report.ok and sorted(ran) == ["ab", "n"]


def test_a_failed_stage_starts_again_up_to_its_retries_each_attempt_its_own_mlflow_run(env, tmp_path):
    attempts = tmp_path / "attempts.txt"
    report, ran = env.run([f"ab.attempts_file={attempts}", "ab.fail_first=1", "ab.retries=1"])
    assert states(report) == {"a": "done", "b": "done", "ab": "done", "n": "done", "other": "done"}
    ab = report.stages["ab"]
    assert ab.attempts == 2 and ran.count("ab") == 2 and len(attempts.read_text().splitlines()) == 2
    assert len(ab.attempt_errors) == 1 and "this is attempt 1" in ab.attempt_errors[0] and ab.error is None
    assert "↻ ab starts again: retry 1 of 1" in env.console and "▶ ab started (retry 1 of 1;" in env.console
    assert (env.root / "artifacts").exists() and "(attempt 2)" in summary_table(report)
    c = tracking.client(report.tracking_uri)
    runs = c.search_runs([c.get_run(report.run_id).info.experiment_id],
                         filter_string="tags.`hylight.stage` = 'ab'", order_by=["attributes.start_time ASC"])
    assert [(r.data.tags["hylight.attempt"], r.info.status) for r in runs] == [("1", "FAILED"), ("2", "FINISHED")]
    assert runs[1].info.run_id == ab.run_id == ab.produced_by

    # retries spent: the stage fails with its last error and what needs it is skipped; the spec-wide default
    # (top-level `retries`) applies where the stage sets none, and a stage's own 0 wins over it
    attempts.unlink()
    report, ran = env.run([f"ab.attempts_file={attempts}", "ab.fail_first=3", "retries=1", "ab.sep=+"])
    assert report.stages["ab"].state == "failed" and report.stages["n"].state == "skipped"
    assert report.stages["ab"].attempts == 2 and "this is attempt 2" in report.stages["ab"].error
    attempts.unlink()
    report, ran = env.run([f"ab.attempts_file={attempts}", "ab.fail_first=1", "retries=3", "ab.retries=0",
                           "ab.sep=/"])
    assert report.stages["ab"].state == "failed" and report.stages["ab"].attempts == 1 and ran.count("ab") == 1


def test_stage_killed_mid_write_leaves_no_accepted_artifact(env):
    env.marker("KILL")
    report, ran = env.run()
    assert report.stages["ab"].state == "failed" and report.stages["n"].state == "skipped"
    key = report.stages["ab"].cache_key
    store = ArtifactStore(env.root)
    assert store.lookup("test_concat", key) is None
    partial = [p for p in store.tmp.iterdir() if p.name.startswith("test_concat__")]
    assert partial and (partial[0] / "text.txt").read_text() == "A"  # the half-written file
    report, ran = env.run()
    assert report.ok and sorted(ran) == ["ab", "n"]
    assert store.lookup("test_concat", key) is not None
    assert not [p for p in store.tmp.iterdir() if p.name.startswith("test_concat__")]  # swept


def test_corrupt_cached_artifact_is_found_by_verify_then_reported_quarantined_and_rebuilt(env, capsys):
    first, _ = env.run()
    assert cli.main(["verify", str(env.spec)]) == 0
    b = Path(first.stages["b"].artifact)
    (b / "text.txt").write_text("C")  # was "B": same size, different content
    capsys.readouterr()
    assert cli.main(["verify", str(env.spec)]) == 1
    lines = {line.split()[1]: line.split(None, 1)[0] for line in capsys.readouterr().out.splitlines()[3:-1]}
    # b changed; its dependents' keys are still known (from b's manifest) and their artifacts are intact
    assert lines == {"a": "ok", "b": "CHANGED", "ab": "ok", "n": "ok", "other": "ok"}

    report, ran = env.run()
    assert ran == ["b"]  # rebuilt; its output is the same as before, so ab and n stay cached
    assert states(report) == {"a": "cached", "b": "done", "ab": "cached", "n": "cached", "other": "cached"}
    [moved] = (env.root / "corrupt" / "test_source").iterdir()
    assert (moved / "text.txt").read_text() == "C"  # kept, not deleted
    assert f"! b: cached artifact {b} failed verification (changed: text.txt); moved to {moved}; " in env.console
    assert "▶ b started (cached artifact failed verification;" in env.console
    c = tracking.client(report.tracking_uri)
    rejected = c.get_run(report.stages["b"].run_id).data.tags["hylight.cache_rejected"]
    assert "changed: text.txt" in rejected
    assert cli.main(["verify", str(env.spec)]) == 0
    assert not env.run()[1]


def test_dry_run_runs_nothing(env):
    env.run()
    report, ran = env.run(dry_run=True, overrides=["b.text=Q"])
    assert ran == [] and report.run_id is None
    assert states(report) == {"a": "cached", "b": "planned", "ab": "planned", "n": "planned", "other": "cached"}


def test_mlflow_parent_nested_params_metrics_lineage(env):
    first, _ = env.run()
    second, _ = env.run()
    c = tracking.client(first.tracking_uri)
    parent = c.get_run(first.run_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics["stages_done"] == 5
    kids = c.search_runs([parent.info.experiment_id],
                         filter_string=f"tags.`mlflow.parentRunId` = '{first.run_id}'")
    by_stage = {r.data.tags[tracking.TAG_STAGE]: r for r in kids}
    assert set(by_stage) == {"a", "b", "ab", "n", "other"}
    a = by_stage["a"]
    assert a.data.params["params.text"] == "A" and a.data.tags[tracking.TAG_CACHE_HIT] == "false"
    assert a.data.metrics["chars"] == 1
    hist = c.get_metric_history(a.info.run_id, "progress")
    assert [(m.step, m.value) for m in hist] == [(1, 0.5), (2, 1.0)]
    # lineage: ab's inputs are a's and b's artifacts, by digest, with their producing runs
    ab = by_stage["ab"]
    digests = {d.dataset.digest for d in ab.inputs.dataset_inputs}
    assert digests == {first.stages["a"].digest[:32], first.stages["b"].digest[:32]}
    assert "manifest.json" in [f.path for f in c.list_artifacts(ab.info.run_id)]
    assert ab.data.tags[tracking.TAG_ARTIFACT_DIGEST] == first.stages["ab"].digest
    # a cache hit is recorded as such and points at the run that produced the artifact
    kids2 = c.search_runs([parent.info.experiment_id],
                          filter_string=f"tags.`mlflow.parentRunId` = '{second.run_id}'")
    hit = {r.data.tags[tracking.TAG_STAGE]: r for r in kids2}["ab"]
    assert hit.data.tags[tracking.TAG_CACHE_HIT] == "true"
    assert hit.data.tags[tracking.TAG_PRODUCER] == ab.info.run_id
    assert hit.data.metrics["parts"] == 2
    # made whole at once (tracking.log_record): the same record as a run that trained, finished
    assert hit.info.status == "FINISHED" and hit.data.tags[tracking.TAG_STATE] == "cached"
    assert hit.data.params == ab.data.params and hit.data.tags[tracking.TAG_ARTIFACT_DIGEST] == first.stages["ab"].digest
    assert {d.dataset.digest for d in hit.inputs.dataset_inputs} == digests
    assert "manifest.json" in [f.path for f in c.list_artifacts(hit.info.run_id)]


def test_log_record_fits_any_number_of_params_tags_and_metrics_in_mlflow_batches(tmp_path):
    """MLflow refuses a log_batch of more than 100 params, 100 tags or 1000 entities: log_record splits, and
    everything arrives (nested params flattened)."""
    c = tracking.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = c.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    rid = c.create_run(exp).info.run_id
    params = {"p": {f"k{i}": i for i in range(150)}}
    tags = {f"t{i}": str(i) for i in range(120)}
    metrics = {f"m{i}": float(i) for i in range(1100)}
    tracking.log_record(c, rid, params=params, tags=tags, metrics=metrics, step=3)
    data = c.get_run(rid).data
    assert {k: v for k, v in data.params.items()} == {f"p.k{i}": str(i) for i in range(150)}
    assert {k: data.tags[k] for k in tags} == tags
    assert data.metrics == metrics
    assert [m.step for m in c.get_metric_history(rid, "m1099")] == [3]
    tracking.log_record(c, rid)  # nothing to log is not an error


def test_failed_stage_recorded_in_mlflow(env):
    env.marker("FAIL")
    report, _ = env.run()
    c = tracking.client(report.tracking_uri)
    assert c.get_run(report.run_id).info.status == "FAILED"
    failed = c.get_run(report.stages["ab"].run_id)
    assert failed.info.status == "FAILED" and "told to fail" in failed.data.tags["hylight.error"]
    assert any(f.path.startswith("error-") for f in c.list_artifacts(failed.info.run_id))


def test_editing_an_external_input_file_reruns_the_stage(env, tmp_path):
    src = tmp_path / "input.txt"
    src.write_text("one")
    spec_path = tmp_path / "ext.yaml"
    spec_path.write_text(f"name: ext\nartifact_root: {env.root}\nstages:\n  f:\n"
                         f"    uses: tests.stage_fixtures:FILE_SOURCE\n    params: {{path: {src}}}\n"
                         "  n:\n    uses: tests.stage_fixtures:COUNT\n    needs: [f]\n")

    def run():
        return run_pipeline(load_spec(spec_path), RunOptions(), out=io.StringIO())

    assert states(run()) == {"f": "done", "n": "done"}
    assert states(run()) == {"f": "cached", "n": "cached"}
    src.write_text("three")
    report = run()
    assert states(report) == {"f": "done", "n": "done"}
    assert Path(report.stages["n"].artifact, "count.txt").read_text() == "5"
    src.unlink()
    report = run()
    assert report.stages["f"].state == "failed" and "No such file" in report.stages["f"].error


def _run_spec(tmp_path, text, **opts):
    spec_path = tmp_path / "extra.yaml"
    spec_path.write_text(textwrap.dedent(text))
    return run_pipeline(load_spec(spec_path), RunOptions(**opts), out=io.StringIO())


def test_stage_workers_get_the_launch_environment_but_not_per_task_variables(env, tmp_path, monkeypatch):
    # set after the workers started: only forwarding can bring these to them
    sent = {"NCCL_DEBUG": "INFO", "CUDA_LAUNCH_BLOCKING": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TRITON_CACHE_DIR": str(tmp_path / "triton"), "DS_SKIP_CUDA_CHECK": "1", "OMP_PROC_BIND": "close",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NVSHMEM_DEBUG": "WARN", "HF_HOME": "/x/hf",
            "CUDA_VISIBLE_DEVICES": "7", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29999",
            "OMP_NUM_THREADS": "9", "UNRELATED_VAR": "no"}
    for k, v in sent.items():
        monkeypatch.setenv(k, v)
    report = _run_spec(tmp_path, f"""\
        name: envtest
        artifact_root: {env.root}
        stages:
          probe:
            uses: tests.stage_fixtures:ENV_PROBE
            params: {{names: {sorted(sent)}}}
    """)
    assert report.ok, report.stages["probe"].error
    seen = json.loads(Path(report.stages["probe"].artifact, "env.json").read_text())
    forwarded = {k for k in sent if seen[k] == sent[k]}
    assert forwarded == {"NCCL_DEBUG", "CUDA_LAUNCH_BLOCKING", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                         "TRITON_CACHE_DIR", "DS_SKIP_CUDA_CHECK", "OMP_PROC_BIND", "PYTORCH_CUDA_ALLOC_CONF",
                         "NVSHMEM_DEBUG", "HF_HOME"}
    assert seen["OMP_NUM_THREADS"] == "1"  # from the stage's resources.cpus, not the driver's 9
    assert seen["CUDA_VISIBLE_DEVICES"] == ""  # a GPU-less task sees no GPU, and never the driver's choice
    assert seen["MASTER_ADDR"] is None and seen["MASTER_PORT"] is None and seen["UNRELATED_VAR"] is None


def test_a_multi_node_stage_leaves_its_resources_to_the_workers_it_launches(env, tmp_path):
    # 2 "nodes" x 1 CPU on a 2-CPU Ray: had the stage's own task kept a CPU, its workers could never start
    report = _run_spec(tmp_path, f"""\
        name: workers
        artifact_root: {env.root}
        stages:
          w:
            uses: tests.stage_fixtures:WORKERS
            params: {{timeout_s: 60}}
            resources: {{cpus: 1, nodes: 2}}
    """)
    assert report.ok, report.stages["w"].error
    out = json.loads(Path(report.stages["w"].artifact, "workers.json").read_text())
    assert [w["i"] for w in out["done"]] == [0, 1]
    assert out["resources"] == {"cpus": 1, "gpus": 0, "memory_gb": None, "nodes": 2, "reserved_for_task": False,
                                "tasks": 1}
    assert out["cuda_visible_devices"] == ""


def test_cancelling_a_stage_kills_the_process_tree_it_launched(env, tmp_path):
    """The orchestrator's cancel path (ray.cancel(force=True), as on Ctrl-C) SIGKILLs the stage's worker;
    the job it started with run_process_tree, ranks in their own session included, must die with it."""
    import ray

    from pipeline.launch import pid_alive
    from pipeline.runner import StageTask, execute_stage

    pid_file = tmp_path / "pids"
    task = StageTask(stage="tree", uses="tests.stage_fixtures:TREE", params={"pid_file": str(pid_file)},
                     resources={"cpus": 1, "gpus": 0}, inputs={}, root=str(env.root), key="k" * 64,
                     key_material={}, cwd=str(Path(__file__).parent.parent))
    ref = ray.remote(execute_stage).options(num_cpus=1, max_retries=0).remote(task)
    deadline = time.monotonic() + 60
    while len(pid_file.read_text().split() if pid_file.exists() else []) < 3:
        assert time.monotonic() < deadline, "the process tree did not start"
        time.sleep(0.1)
    pids = [int(p) for p in pid_file.read_text().split()]
    ray.cancel(ref, force=True)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(ref, timeout=60)
    deadline = time.monotonic() + 20
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if pid_alive(p)]
    for p in left:  # never leave sleepers behind on a failed assertion
        os.kill(p, signal.SIGKILL)
    assert left == []


def test_runs_left_running_by_a_killed_driver_are_marked_killed_on_the_next_run(env, tmp_path):
    """kill -9 of a real `hylight run` while a stage runs; the next run resumes and closes the orphans."""
    marker, pid_file = tmp_path / "HOLD", tmp_path / "worker.pid"
    marker.write_text("x")
    spec_path = tmp_path / "killed.yaml"
    spec_path.write_text(textwrap.dedent(f"""\
        name: killtest
        artifact_root: {env.root}
        stages:
          hold:
            uses: tests.stage_fixtures:WAIT
            params: {{marker: {marker}, pid_file: {pid_file}}}
    """))
    repo = Path(__file__).parent.parent
    driver = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(spec_path)], cwd=repo,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            assert driver.poll() is None and time.monotonic() < deadline, "the stage never started"
            time.sleep(0.2)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    worker = int(pid_file.read_text())
    from pipeline.launch import pid_alive

    deadline = time.monotonic() + 60  # the driver's local Ray shares its fate: the worker goes too
    while pid_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(worker)

    c = tracking.client(tracking.default_tracking_uri(env.root))
    exp = c.get_experiment_by_name("killtest").experiment_id
    before = {r.info.run_id: r for r in c.search_runs([exp])}
    assert {r.info.status for r in before.values()} == {"RUNNING"}  # the parent and `hold`, left open
    assert sorted(str(r.data.tags.get(tracking.TAG_STAGE)) for r in before.values()) == ["None", "hold"]

    marker.unlink()
    report = run_pipeline(load_spec(spec_path), RunOptions(), out=io.StringIO())
    assert report.ok and report.stages["hold"].state == "done"
    after = {r.info.run_id: r for r in c.search_runs([exp])}
    for rid, old in before.items():
        run = after[rid]
        assert run.info.status == "KILLED", (old.data.tags.get(tracking.TAG_STAGE), run.info.status)
        assert run.data.tags[tracking.TAG_STATE] == "orphaned"
    new = [r for rid, r in after.items() if rid not in before]
    assert {r.info.status for r in new} == {"FINISHED"} and len(new) == 2  # the new parent and `hold`
    # no run is left RUNNING
    assert not c.search_runs([exp], filter_string="attributes.status = 'RUNNING'")
