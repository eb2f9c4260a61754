"""`hylight run --ray-address` against a real two-node Ray cluster on loopback (ray.cluster_utils), each
node with 1 CPU and 1 logical GPU, so the GPU and multi-node paths run without GPUs: validation against
the cluster's nodes, a GPU stage holding its GPU, and a multi-node stage whose own task holds nothing
while the workers it starts take a CPU and a GPU on each node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).parent.parent

SPEC = """\
name: clustertest
artifact_root: {root}
stages:
  gpu:
    uses: tests.stage_fixtures:ENV_PROBE
    params: {{names: [CUDA_VISIBLE_DEVICES, NCCL_DEBUG]}}
    resources: {{cpus: 1, gpus: 1}}
  train:
    uses: tests.stage_fixtures:WORKERS
    params: {{timeout_s: 90, strategy: STRICT_SPREAD}}
    resources: {{cpus: 1, gpus: 1, nodes: {nodes}}}
"""


@pytest.fixture(scope="module")
def cluster():
    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1, num_gpus=1)
    c.wait_for_nodes()
    yield c.address
    c.shutdown()


def hylight(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYLIGHT_STATE_DIR": str(tmp_path / "state"), "NCCL_DEBUG": "INFO"}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_validation_checks_the_cluster_nodes(cluster, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(SPEC).format(root=tmp_path / "runs", nodes=3))
    out = hylight(tmp_path, "validate", str(spec), "--ray-address", cluster)
    assert out.returncode == 2, out.stderr
    assert (f"spec.yaml:11: stage 'train', field resources.nodes: asks for 3 node(s) with cpus=1 gpus=1 each "
            f"but only 2 of the 2 live node(s) of the Ray cluster at {cluster} have that much") in out.stderr


def test_gpu_and_multi_node_stages_run_on_the_cluster(cluster, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(SPEC).format(root=tmp_path / "runs", nodes=2))
    report_path = tmp_path / "report.json"
    out = hylight(tmp_path, "run", str(spec), "--ray-address", cluster, "--json", str(report_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sqlite locking over NFS is unreliable" in out.stderr  # the embedded store on a cluster
    stages = json.loads(report_path.read_text())["stages"]

    seen = json.loads(Path(stages["gpu"]["artifact"], "env.json").read_text())
    assert seen == {"CUDA_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "INFO"}  # its own GPU; the driver's NCCL_DEBUG

    train = json.loads(Path(stages["train"]["artifact"], "workers.json").read_text())
    assert train["resources"] == {"cpus": 1, "gpus": 1, "memory_gb": None, "nodes": 2,
                                  "reserved_for_task": False, "tasks": 1}
    assert train["cuda_visible_devices"] == ""  # the stage's own process holds no GPU
    workers = train["done"]
    assert len({w["node"] for w in workers}) == 2  # one worker per node, each with that node's GPU
    assert [w["cuda_visible_devices"] for w in workers] == ["0", "0"]
