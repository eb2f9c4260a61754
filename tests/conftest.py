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
      longest unit of work, so the other worker takes everything else beside it.
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
    items.sort(key=lambda it: not it.nodeid.endswith("@" + TINY_GROUP))


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
