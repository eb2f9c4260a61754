"""The ``pretrain`` stage across nodes (issue 9 item 7): validation lets it span nodes, and ``hylight run
--ray-address`` on a real two-node Ray cluster (``ray.cluster_utils``, both nodes on 127.0.0.1, one CPU each)
trains it through Ray Train with the loss curve of a two-process ``torchrun`` run of the same config."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.spec import ClusterCapacity, NodeCapacity, SpecError, load_spec
from tests.pretrain_fixtures import PretrainInputs

REPO = Path(__file__).resolve().parent.parent

# 4 steps of 8 rows x 128 tokens over 2 ranks (4 rows each), experts split over the ranks (expert_parallel_size 2):
# every step's all-to-all crosses the two nodes
PARAMS = dict(seq_len=128, micro_batch_rows=4, batch_rows=8, max_batch_rows=8, train_tokens=4096, log_every=1,
              checkpoint_every=100, eval_documents=12, eval_max_rows=16, expert_parallel_size=2)

SPEC = """\
name: raytrain
artifact_root: {root}
stages:
  documents:
    uses: tests.pretrain_fixtures:PREBUILT_DOCUMENTS
    params: {{path: {inputs}/documents}}
  tokenizer:
    uses: tests.pretrain_fixtures:PREBUILT_TOKENIZER
    params: {{path: {inputs}/tokenizer}}
    resources: {{nodes: {tokenizer_nodes}}}
  mixture:
    uses: tests.pretrain_fixtures:PREBUILT_MIXTURE
    params: {{path: {inputs}/mixture}}
  pretrain:
    uses: pretrain
    needs: [mixture, documents, tokenizer]
    params: {params}
    resources: {{cpus: 1, nodes: 2}}
"""


def write_spec(tmp_path: Path, inputs: Path, tokenizer_nodes: int = 1) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(SPEC).format(root=tmp_path / "runs", inputs=inputs, params=json.dumps(PARAMS),
                                                 tokenizer_nodes=tokenizer_nodes))
    return spec


def test_validation_lets_pretrain_span_nodes_but_not_a_single_process_kind(tmp_path: Path) -> None:
    two_nodes = ClusterCapacity(cpus=1, gpus=0, memory_gb=8, where="the test cluster",
                                nodes=[NodeCapacity(cpus=1, gpus=0, memory_gb=8)] * 2)
    spec = load_spec(write_spec(tmp_path, tmp_path / "inputs"), capacity=two_nodes)
    assert spec.stages["pretrain"].resources.nodes == 2 and spec.stages["pretrain"].kind.launches_workers
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(tmp_path, tmp_path / "inputs", tokenizer_nodes=2), capacity=two_nodes)
    assert e.value.problems == [
        f"{tmp_path / 'spec.yaml'}:10: stage 'tokenizer', field resources.nodes: asks for 2 nodes but kind "
        "'test_prebuilt_tokenizer' runs in one process on one node; only a kind that launches its own workers "
        "(StageKind(launches_workers=True)) can span nodes"]


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """Two Ray nodes of one CPU each on 127.0.0.1; their address."""
    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield c.address
    finally:
        c.shutdown()


@pytest.mark.slow
@pytest.mark.extended
def test_pretrain_on_a_two_node_ray_cluster_trains_like_torchrun_and_reports_to_mlflow(cluster: str,
                                                                                        tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from pipeline import tracking
    from pipeline.stage import Resources, StageContext
    from pretrain.stage import PretrainParams, run
    from tests.pretrain_fixtures import build_inputs

    inputs: PretrainInputs = build_inputs(tmp_path / "inputs")
    # the reference: the same config and seed as two torchrun ranks on this machine, one thread each like the Ray
    # workers; run meanwhile (the Ray side spends most of its time starting processes)
    reference = StageContext(tmp_path / "torchrun" / "out", inputs.as_inputs(), stage_name="pretrain",
                             resources=Resources(cpus=2), resume_dir=tmp_path / "torchrun" / "resume")
    failed: list[BaseException] = []

    def run_reference() -> None:
        try:
            run(PretrainParams(**PARAMS, processes=2), reference)
        except BaseException as e:  # noqa: BLE001 (asserted below)
            failed.append(e)

    torchrun = threading.Thread(target=run_reference, daemon=True)
    torchrun.start()
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(write_spec(tmp_path, tmp_path / "inputs")),
         "--ray-address", cluster, "--json", str(report_path)],
        cwd=REPO, env={**os.environ, "HYLIGHT_STATE_DIR": str(tmp_path / "state")}, capture_output=True, text=True,
        timeout=420)
    torchrun.join(300)
    assert done.returncode == 0, done.stderr[-5000:]
    assert "2 process(es) on 2 node(s) through Ray Train" in done.stderr
    assert not torchrun.is_alive() and not failed, failed
    stage = json.loads(report_path.read_text())["stages"]["pretrain"]
    artifact = Path(stage["artifact"])

    # measured: every loss, aux loss, grad norm and the eval loss are bitwise equal; 1e-5 leaves room for a
    # reduction order that differs
    ours, theirs = _history(artifact), _history(reference.out_dir)
    assert [h["step"] for h in ours] == [h["step"] for h in theirs] == [1, 2, 3, 4]
    for a, b in zip(ours, theirs, strict=True):
        assert a["tokens"] == b["tokens"] and a["batch_size"] == b["batch_size"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert abs(a["aux_loss"] - b["aux_loss"]) <= 1e-5, a["step"]
        assert a["drop_rate"] == b["drop_rate"], a["step"]  # the same slots dropped
    summary = json.loads((artifact / "summary.json").read_text())
    assert abs(summary["eval_loss"] - reference.summary["eval_loss"]) <= 1e-5
    assert summary["steps"] == 4 and summary["tokens"] == 4096
    trained, expected = load_file(artifact / "model" / "model.safetensors"), load_file(reference.out_dir / "model" /
                                                                                        "model.safetensors")
    assert sorted(trained) == sorted(expected)
    assert max(float((trained[k] - expected[k]).abs().max()) for k in expected) <= 1e-5

    # rank 0's metrics reached the stage's MLflow run through the stage's relay; the artifact is the checkpoint
    c = tracking.client(tracking.default_tracking_uri(tmp_path / "runs"))
    logged = sorted((m.step, m.value) for m in c.get_metric_history(stage["run_id"], "loss") if m.step)
    assert logged == [(h["step"], pytest.approx(h["loss"], rel=1e-12)) for h in ours]
    assert json.loads((artifact / "manifest.json").read_text())["type"] == "checkpoint"
    for path in ("model/model.safetensors", "model/config.json", "minimax/model.safetensors", "expert_routed.npy"):
        assert (artifact / path).is_file(), path


def _launch_without_shared_storage(tmp: str) -> str:
    """The stage's Ray Train launch, as in a Ray task of a multi-node stage, with a config file the workers cannot
    read; the error the stage raises."""
    from pipeline.stage import Resources, StageContext
    from pretrain.launch import Relay, launch_ray_train

    ctx = StageContext(Path(tmp) / "out", stage_name="pretrain", resources=Resources(cpus=1, nodes=2,
                                                                                    reserved_for_task=False))
    ctx.work_dir.mkdir(parents=True)
    try:
        launch_ray_train(Path(tmp) / "not-shared" / "train_config.json", ctx.resources, 1, Relay(ctx), ctx)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.extended
def test_a_failed_ray_train_worker_fails_the_stage_with_the_workers_error(cluster: str, tmp_path: Path) -> None:
    import ray

    ray.init(address=cluster, log_to_driver=False)
    try:
        launch = ray.remote(_launch_without_shared_storage).options(
            num_cpus=0, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        message = ray.get(launch.remote(str(tmp_path)), timeout=240)
    finally:
        ray.shutdown()
    first = message.splitlines()[0]
    # both ranks fail; Ray Train reports the ranks whose failure it saw before stopping the group (one or both)
    assert re.match(r"pretrain: training failed on Ray Train workers \(rank [01]: FileNotFoundError: pretrain rank on ",
                    first), message
    assert f"the stage's config {tmp_path / 'not-shared' / 'train_config.json'} is not visible here" in first
    assert "a filesystem all nodes share" in message
