"""The stage worker's environment: what is forwarded from `hylight run`, what each task decides itself,
which tasks hold their resources, and that a reused worker process gets its environment back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline import worker_env
from pipeline.orchestrator import task_reserves_resources
from pipeline.runner import StageTask, execute_stage
from pipeline.spec import ResourcesSpec
from pipeline.worker_env import apply_env_defaults, forwarded_env
from tests import stage_fixtures

REPO = Path(__file__).parent.parent


def test_forwarded_variables_by_prefix_less_the_per_task_ones():
    environ = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "CUDA_HOME": "/cuda", "TORCH_LOGS": "+dynamo",
               "TRITON_CACHE_DIR": "/t", "DS_ACCELERATOR": "cuda", "OMP_PROC_BIND": "close",
               "PYTORCH_CUDA_ALLOC_CONF": "x", "NVSHMEM_DEBUG": "1", "HF_HOME": "/hf", "TRANSFORMERS_VERBOSITY": "i",
               "HYLIGHT_STATE_DIR": "/s",
               "CUDA_VISIBLE_DEVICES": "0,1", "MASTER_ADDR": "a", "MASTER_PORT": "1", "OMP_NUM_THREADS": "8",
               "PATH": "/bin", "RAY_ADDRESS": "x", "LD_LIBRARY_PATH": "/l", "NCCLX": "no"}
    assert sorted(forwarded_env(environ)) == [
        "CUDA_HOME", "DS_ACCELERATOR", "HF_HOME", "HYLIGHT_STATE_DIR", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME",
        "NVSHMEM_DEBUG", "OMP_PROC_BIND", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_LOGS", "TRANSFORMERS_VERBOSITY",
        "TRITON_CACHE_DIR"]


def test_defaults_the_driver_filled_in_stay_on_the_driver(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(worker_env, "_DEFAULTED", set())
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    apply_env_defaults()
    assert os.environ["DS_ACCELERATOR"] in ("cpu", "cuda")
    sent = forwarded_env()
    assert "DS_ACCELERATOR" not in sent and sent["NCCL_DEBUG"] == "WARN"  # each node picks its own


@pytest.mark.parametrize(("launches", "nodes", "gpus", "on_cluster", "reserves"), [
    (False, 1, 8, True, True),    # an ordinary kind always holds what it asked for
    (True, 1, 0, False, True),    # a launcher on one node, no GPUs
    (True, 1, 8, False, True),    # local Ray, one node: the task holds the GPUs and launches on them
    (True, 1, 8, True, False),    # a Ray cluster: Ray Train workers get the GPUs
    (True, 2, 0, False, False),   # several nodes: always the workers
])
def test_which_tasks_hold_their_resources(launches, nodes, gpus, on_cluster, reserves):
    kind = stage_fixtures.WORKERS if launches else stage_fixtures.SOURCE
    st = type("St", (), {"kind": kind, "resources": ResourcesSpec(cpus=1, gpus=gpus, nodes=nodes)})()
    assert task_reserves_resources(st, on_cluster=on_cluster) is reserves


def probe(tmp_path: Path, resources: dict, env: dict[str, str]) -> dict[str, str | None]:
    names = ["CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "NCCL_DEBUG", "OMP_NUM_THREADS"]
    task = StageTask(stage="probe", uses="tests.stage_fixtures:ENV_PROBE", params={"names": names},
                     resources=resources, inputs={}, root=str(tmp_path / "runs"), key=os.urandom(32).hex(),
                     key_material={}, cwd=str(REPO), env=env)
    out = execute_stage(task)
    return json.loads(Path(out.path, "env.json").read_text())


def test_each_task_sees_its_own_gpus_and_accelerator_and_the_worker_gets_its_environment_back(
        tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # as Ray sets it for a task granted GPU 3
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # inherited by the worker from a GPU driver
    before, cwd = dict(os.environ), os.getcwd()

    seen = probe(tmp_path, {"cpus": 2, "gpus": 0}, {"NCCL_DEBUG": "INFO"})
    assert seen == {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "NCCL_DEBUG": "INFO",
                    "OMP_NUM_THREADS": "2"}
    seen = probe(tmp_path, {"cpus": 1, "gpus": 1}, {})
    assert seen["CUDA_VISIBLE_DEVICES"] == "3" and seen["DS_ACCELERATOR"] == "cuda"
    seen = probe(tmp_path, {"cpus": 1, "gpus": 4, "nodes": 2, "reserved_for_task": False}, {})
    assert seen["CUDA_VISIBLE_DEVICES"] == "" and seen["DS_ACCELERATOR"] == "cpu"
    seen = probe(tmp_path, {"cpus": 1, "gpus": 0}, {"DS_ACCELERATOR": "cuda"})  # the user's choice wins
    assert seen["DS_ACCELERATOR"] == "cuda"

    assert dict(os.environ) == before and os.getcwd() == cwd  # Ray reuses the worker for other tasks


@pytest.mark.parametrize("user_accelerator", [None, "cpu"])
def test_workers_a_stage_launches_get_the_forwarded_variables_and_their_own_threads_and_accelerator(
        tmp_path, monkeypatch, user_accelerator):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what the worker process inherited (a CPU head node, say)
    sent = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "ib0", "CUDA_LAUNCH_BLOCKING": "1", "TRITON_CACHE_DIR": "/t",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "HF_HOME": "/hf"}
    if user_accelerator:
        sent["DS_ACCELERATOR"] = user_accelerator
    task = StageTask(stage="train", uses="tests.stage_fixtures:LAUNCH_ENV_PROBE", params={"ranks_per_node": 4},
                     resources={"cpus": 8, "gpus": 4, "nodes": 2, "reserved_for_task": False}, inputs={},
                     root=str(tmp_path / "runs"), key=os.urandom(32).hex(), key_material={}, cwd=str(REPO), env=sent)
    seen = json.loads(Path(execute_stage(task).path, "env.json").read_text())
    # the stage's own process holds no GPU; its 4 GPU workers per node each get one and two CPUs
    assert seen["stage"] == {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": user_accelerator or "cpu"}
    workers = seen["workers"]
    assert {k: workers[k] for k in sent} == sent
    assert [workers[k] for k in worker_env.THREAD_VARS] == ["2"] * 4
    assert workers["DS_ACCELERATOR"] == (user_accelerator or "cuda")  # the user's choice wins
    assert not {"CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT"} & set(workers)  # Ray Train sets those


def test_a_launch_directory_missing_on_the_node_is_explained(tmp_path):
    task = StageTask(stage="s", uses="tests.stage_fixtures:SOURCE", params={}, resources={"cpus": 1},
                     inputs={}, root=str(tmp_path), key="k" * 64, key_material={}, cwd=str(tmp_path / "gone"))
    with pytest.raises(RuntimeError, match=r"stage 's': cannot enter .*gone.* \(the directory `hylight run` "
                                           r"was started from\) on node .*same checkout at the same path"):
        execute_stage(task)


def test_a_summary_value_of_a_stepped_metric_does_not_add_a_point_at_step_zero(tmp_path):
    from pipeline.stage import StageContext

    ctx = StageContext(tmp_path / "out")
    for step, loss in ((2, 5.0), (4, 4.0)):
        ctx.log_metrics({"loss": loss, "lr": 0.1}, step=step)
    ctx.log_summary({"loss": 4.0, "lr": 0.05, "tokens": 128})
    logged = sorted((k, v, -1 if s is None else s) for k, v, s in ctx.sink.metrics)
    # loss 4.0 is already the history's last point; lr 0.05 is another quantity than the per-step lr, and tokens has
    # no history: both are logged without a step
    assert logged == [("loss", 4.0, 4), ("loss", 5.0, 2), ("lr", 0.05, -1), ("lr", 0.1, 2), ("lr", 0.1, 4),
                      ("tokens", 128.0, -1)]
    assert ctx.summary == {"loss": 4.0, "lr": 0.05, "tokens": 128.0}
