"""Which Ray worker a stage runs in (pipeline/orchestrator.py stage_remote), with a real local Ray."""

from __future__ import annotations

import os

import pytest

from pipeline.orchestrator import stage_remote


def _pid() -> int:
    return os.getpid()


@pytest.fixture(scope="module")
def ray_with_a_gpu():
    import ray

    # one logical GPU: Ray schedules by the declared resource, so the worker rule is tested without a device
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    yield ray
    ray.shutdown()


def test_each_gpu_stage_gets_a_fresh_worker_and_cpu_stages_reuse_one(ray_with_a_gpu):
    ray = ray_with_a_gpu
    gpu = {"num_cpus": 1, "num_gpus": 1, "max_retries": 0}
    pids = [ray.get(stage_remote(_pid, f"g{i}", gpu).remote()) for i in range(3)]
    assert len(set(pids)) == 3  # what one GPU stage leaves on the device dies with its worker
    cpu = {"num_cpus": 1, "num_gpus": 0, "max_retries": 0}
    pids = [ray.get(stage_remote(_pid, f"c{i}", cpu).remote()) for i in range(3)]
    assert len(set(pids)) == 1
