import os

# torch threads thrash on small CPU boxes (ENV-NOTES); every test process and Ray worker uses one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Triton kernels run in the interpreter on CPU-only machines. The variable must be set before any
# module defining @triton.jit kernels is imported — and the lightning dispatch imports them lazily
# from whichever test gets there first — so it is set here, once, for the whole session.
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


# --- the uninterrupted tiny DAG, shared by tests/test_tiny_dag.py and tests/test_faults.py ------------------------
# Session scope, and both modules' tests carry xdist_group("tiny_dag") (pyproject: --dist loadgroup), so one worker
# runs the DAG once for both (see the hook below: pytest 9.2 broke xdist_group).

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def hylight(*args: str, env: dict[str, str], timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


TINY_GROUP = "tiny_dag"


def _uses_shared_fixture(item) -> bool:
    """Whether ``item`` uses a module- or session-scoped fixture this repository defines."""
    info = getattr(item, "_fixtureinfo", None)
    return any(defs[-1].scope in ("module", "package", "session") and defs[-1].baseid.startswith("tests")
               for defs in (info.name2fixturedefs.values() if info else ()))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Schedule for two xdist workers: every expensive shared fixture is built once, the tiny DAG first.

    - pytest-xdist (3.8) groups tests by appending ``@group`` to ``item._nodeid`` on each worker; pytest 9.2 reads
      the node id from ``item._id`` instead, so the suffix was lost, ``--dist loadgroup`` spread a group over every
      worker, and each worker ran the ~12-minute tiny DAG fixture again. This hook (after xdist's) writes the suffix
      where this pytest reads it.
    - A test that uses a module- or session-scoped fixture of this repository (a trained model, a built corpus)
      joins its module's group ``<module>.shared``, so one worker builds each such fixture once instead of each
      worker building its own (the eval module's trained inputs took 47 s per build).
    - The tiny DAG's group is scheduled first (pyproject: --no-loadscope-reorder keeps this order): it is the
      longest unit of work, so the other worker takes everything else beside it; the other units follow longest
      first (_longest_first), so that neither worker ends the run alone on a long unit.
    tests/test_conftest_grouping.py runs two workers over a generated project to check the grouping.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if not names:
            if not _uses_shared_fixture(item):
                continue
            names = [f"{item.path.stem}.shared"]
        group = "_".join(names)
        if item.nodeid.endswith("@" + group):
            continue
        grouped = f"{item.nodeid.split('@')[0]}@{group}"
        if hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id
            item._id = coerce_node_id(grouped)
        else:  # pragma: no cover - older pytest, where xdist's own hook writes _nodeid
            item._nodeid = grouped
    _longest_first(items)


# Seconds each of the longest units of work took (2-core box, both workers busy, 2026-11-26; group names or node
# ids). Only their order matters: a stale or missing entry falls back to _estimate and costs balance, not tests.
UNIT_SECONDS = {
    "test_pretrain.shared": 264, "test_sequence_parallel_stage.shared": 238, "test_long_context.shared": 145,
    "test_quality.shared": 117, "test_orchestrator.shared": 101, "test_reward_model.shared": 71,
    "test_eval.shared": 59, "test_shards.shared": 46, "test_cluster.shared": 36, "test_sequence_parallel.shared": 31,
    "test_dedup.shared": 21, "test_pretrain_data.shared": 17, "test_grpo_stage.shared": 14, "test_mix.shared": 14,
    "test_dpo.shared": 13, "test_posttrain_resume.shared": 60, "test_posttrain_moe_loss.shared": 30,
    "tests/test_loopback.py::test_a_local_training_process_group_listens_on_loopback_only[2]": 25,
    "tests/test_lightning_triton.py::test_segmented_fast_decays_match_reference_with_and_without_the_state_horizon": 21,
    "tests/test_mix.py::test_sample_corpus_mixture_end_to_end": 36,
    "tests/test_faults.py::test_a_ray_worker_killed_mid_task_fails_its_stage_clearly_without_a_hang": 26,
    "tests/test_shards.py::test_quality_writes_the_same_artifact_for_1_and_2_tasks": 26,
    "tests/test_dedup.py::test_sample_corpus_dedup_and_decontamination": 18,
    "tests/test_pretrain.py::test_divergence_guard_takes_the_same_decision_on_every_rank": 18,
    "tests/test_pretrain.py::test_foreach_gradient_norm_equals_deepspeeds_per_gradient_norm": 15,
}
SLOW_TEST_S, TEST_S = 8.0, 0.3  # the estimate of a unit not listed: per test marked slow, per other test


def _unit(item) -> str:
    """The unit of work xdist's loadgroup scheduler sends to one worker: the group after '@', else the test."""
    nodeid = item.nodeid  # as xdist's LoadGroupScheduling._split_scope (an '@' inside [...] is a parameter)
    return nodeid.split("@")[-1] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def _estimate(unit: str, members: list) -> float:
    if unit in UNIT_SECONDS:
        return UNIT_SECONDS[unit]
    return sum(SLOW_TEST_S if it.get_closest_marker("slow") else TEST_S for it in members)


def _longest_first(items: list) -> None:
    """Order the units: the tiny DAG's group, then the others by estimated seconds, longest first (stable).

    With --no-loadscope-reorder xdist hands out units in this order, each worker taking the next one when it is
    nearly out of work. In collection order the 4-minute sequence-parallel group came last and one worker ran it
    alone for ~95 s while the other sat idle; longest first, the end of the run is short units on both workers.
    """
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_unit(item), []).append(item)
    order = sorted(units, key=lambda u: (u != TINY_GROUP, -_estimate(u, units[u])))
    items[:] = [item for unit in order for item in units[unit]]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    env = {**os.environ, "HYLIGHT_STATE_DIR": str(tmp / "state")}
    root = tmp / "runs"
    first = hylight("run", "dags/tiny.yaml", "--set", f"artifact_root={root}", "--json", str(tmp / "1.json"),
                    env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    second = hylight("run", "dags/tiny.yaml", "--set", f"artifact_root={root}", "--json",
                     str(tmp / "2.json"), env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    return {"env": env, "root": root, "first": json.loads((tmp / "1.json").read_text()),
            "second": json.loads((tmp / "2.json").read_text()), "stderr": first.stderr}
