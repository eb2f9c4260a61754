"""Independent GPU stages run at once, each on its own GPU, and a stage that finds every GPU taken waits: the
orchestrator on a real local Ray with logical GPUs (Ray schedules by the declared resource and sets
``CUDA_VISIBLE_DEVICES``, so the placement is tested without a device). ``dags/gpu-recipe.yaml`` relies on it to run
the three pretrains of its ablation side by side on a 4-GPU host."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pipeline.orchestrator import RunOptions, run_pipeline
from pipeline.spec import load_spec


@pytest.fixture(scope="module")
def ray_with_two_gpus():
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    yield ray
    ray.shutdown()


def _spec(tmp_path: Path, stages: str):
    path = tmp_path / "dag.yaml"
    path.write_text(f"name: gpus\nartifact_root: {tmp_path / 'root'}\nstages:\n{stages}")
    return load_spec(path)


def _placement(report, name: str) -> tuple[float, float, str]:
    from pipeline.stage import MANIFEST_NAME

    r = report.stages[name]
    meta = json.loads((Path(r.artifact) / MANIFEST_NAME).read_text())
    return meta["started_unix"], meta["started_unix"] + meta["seconds"], meta["gpus"]


def test_two_gpu_stages_run_at_once_on_different_gpus_and_a_third_waits_for_one(ray_with_two_gpus, tmp_path):
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
