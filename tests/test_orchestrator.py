"""Cache, force/downstream/from semantics, failure and kill recovery, MLflow run structure.

Real Ray (one local instance for the module) and a real MLflow sqlite store; stages are the tiny
plugin kinds in tests/stage_fixtures.py.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest

from pipeline import tracking
from pipeline.artifacts import ArtifactStore
from pipeline.orchestrator import RunOptions, run_pipeline
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

        def run(self, overrides=(), **opts):
            if log.exists():
                log.unlink()
            spec = load_spec(spec_path, overrides=list(overrides))
            report = run_pipeline(spec, RunOptions(**opts), out=io.StringIO())
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
