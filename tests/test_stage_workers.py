"""Where a stage runs, with a real local Ray and logical GPUs (Ray schedules by the declared resource and sets
``CUDA_VISIBLE_DEVICES``, so placement is tested without a device): which worker (pipeline/orchestrator.py
stage_remote), and that independent GPU stages run at once, each on its own GPU, while a stage that finds every GPU
taken waits (``dags/gpu-recipe.yaml`` relies on it to run its ablation's three pretrains side by side)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from pipeline.orchestrator import RunOptions, run_pipeline, stage_remote
from pipeline.spec import load_spec


def _pid() -> int:
    return os.getpid()


@pytest.fixture(scope="module")
def ray_with_gpus():
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    yield ray
    ray.shutdown()


def test_each_gpu_stage_gets_a_fresh_worker_and_cpu_stages_reuse_one(ray_with_gpus):
    ray = ray_with_gpus
    gpu = {"num_cpus": 1, "num_gpus": 1, "max_retries": 0}
    pids = [ray.get(stage_remote(_pid, f"g{i}", gpu).remote()) for i in range(3)]
    assert len(set(pids)) == 3  # what one GPU stage leaves on the device dies with its worker
    cpu = {"num_cpus": 1, "num_gpus": 0, "max_retries": 0}
    pids = [ray.get(stage_remote(_pid, f"c{i}", cpu).remote()) for i in range(3)]
    assert len(set(pids)) == 1


def _spec(tmp_path: Path, stages: str):
    path = tmp_path / "dag.yaml"
    path.write_text(f"name: gpus\nartifact_root: {tmp_path / 'root'}\nstages:\n{stages}")
    return load_spec(path)


def _placement(report, name: str) -> tuple[float, float, str]:
    from pipeline.stage import MANIFEST_NAME

    r = report.stages[name]
    meta = json.loads((Path(r.artifact) / MANIFEST_NAME).read_text())
    return meta["started_unix"], meta["started_unix"] + meta["seconds"], meta["gpus"]


def test_two_gpu_stages_run_at_once_on_different_gpus_and_a_third_waits_for_one(ray_with_gpus, tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    stage = ("  {n}:\n    uses: tests.stage_fixtures:RENDEZVOUS\n    params: {{dir: '{d}', expect: 2, timeout_s: 60, label: {n}}}\n"
             "    resources: {{cpus: 1, gpus: 1}}\n")
    spec = _spec(tmp_path, "".join(stage.format(n=n, d=meet) for n in ("a", "b")) +
                 "  c:\n    uses: tests.stage_fixtures:RENDEZVOUS\n"
                 f"    params: {{dir: '{meet}', expect: 3, timeout_s: 60}}\n"
                 "    resources: {cpus: 1, gpus: 2}\n")
    report = run_pipeline(spec, RunOptions(), out=io.StringIO())
    assert report.ok, {k: v.error for k, v in report.stages.items()}
    (a0, a1, ga), (b0, b1, gb), (c0, _, gc) = (_placement(report, n) for n in "abc")
    assert max(a0, b0) < min(a1, b1)  # a and b overlapped (each waited for the other to start)
    assert ga and gb and ga != gb  # on different GPUs
    assert sorted(gc.split(",")) == sorted([ga, gb])  # c took both GPUs ...
    assert c0 >= max(a1, b1) - 0.5  # ... once a and b had given them back


def test_a_freed_gpu_goes_to_the_waiting_stage_with_more_of_the_run_behind_it(ray_with_gpus, tmp_path):
    # `blocker` holds one GPU for 5 s; `a` the other for ~0.5 s. When `a` ends, `leaf` (nothing needs it) and
    # `chain1` (chain2 needs it) are both ready for the one free GPU. `leaf` comes first in the spec, and Ray would
    # start whichever it queued first; the orchestrator holds `leaf` back and gives the GPU to `chain1`.
    meet, marker = tmp_path / "meet", tmp_path / "hold"
    meet.mkdir()
    marker.write_text("hold")
    gpu = "    resources: {cpus: 1, gpus: 1}\n"
    rdv = "    uses: tests.stage_fixtures:RENDEZVOUS\n    params: {{dir: '{d}', expect: 1, timeout_s: 60, label: {n}}}\n"
    spec = _spec(tmp_path,
                 "  blocker:\n    uses: tests.stage_fixtures:WAIT\n"
                 f"    params: {{marker: '{marker}', pid_file: '{tmp_path / 'pid'}', timeout_s: 5}}\n" + gpu +
                 "  a:\n" + rdv.format(d=meet, n="a") + gpu +
                 "".join(f"  {n}:\n    uses: tests.stage_fixtures:CONCAT\n    needs: [{up}]\n    params: {{sep: {n}}}\n"
                         + gpu for n, up in (("leaf", "a"), ("chain1", "a"), ("chain2", "chain1"))))
    assert spec.depth_below() == {"blocker": 0, "a": 2, "leaf": 0, "chain1": 1, "chain2": 0}
    out = io.StringIO()
    report = run_pipeline(spec, RunOptions(), out=out)
    assert report.ok, {k: v.error for k, v in report.stages.items()}
    (b0, b1, _), (a0, a1, _), (l0, _, _), (c0, c1, _) = (_placement(report, n) for n in ("blocker", "a", "leaf", "chain1"))
    assert a1 < b1 - 1.0  # the scenario held: `a` ended while `blocker` still had its GPU
    assert c0 < l0  # the chain's stage got the freed GPU ...
    assert l0 >= min(c1, b1) - 0.5  # ... and `leaf` started only once a GPU was given back
    assert "· leaf waits for a GPU" in out.getvalue()
