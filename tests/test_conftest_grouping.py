"""The test scheduling of tests/conftest.py for two xdist workers (pyproject: --dist loadgroup).

Runs pytest with two workers over a generated project that uses this repository's conftest hook, and checks that:
a ``xdist_group`` stays on one worker (pytest 9.2 had broken that, so the tiny DAG ran once per worker), a module
fixture is built once, the tiny DAG's group is the first work a worker gets, and the other worker starts with the
longest unit (a ``slow`` test collected last), not with the next unit in collection order.
"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFTEST = """
import os
import pytest
from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the hook under test)

@pytest.fixture(scope="session")
def shared():
    return os.environ["PYTEST_XDIST_WORKER"]

@pytest.fixture(autouse=True)
def stamp(record_property):
    import time
    record_property("stamp", f"{os.environ['PYTEST_XDIST_WORKER']} {time.monotonic()}")
"""
GROUPED = """
import pytest, time
pytestmark = [pytest.mark.xdist_group("tiny_dag")]
def test_a1(shared, record_property): record_property("worker", shared)
def test_a2(shared, record_property): record_property("worker", shared)
def test_a3(shared, record_property): record_property("worker", shared)
"""
MIXED = """
import os, pytest, time

@pytest.fixture(scope="module")
def built():
    with open(os.environ["BUILD_LOG"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    time.sleep(0.3)

def test_m1(built): time.sleep(0.3)
def test_m2(built): time.sleep(0.3)
def test_m3(built): time.sleep(0.3)
def test_m4(built): time.sleep(0.3)
def test_s1(): time.sleep(0.3)
def test_s2(): time.sleep(0.3)
def test_s3(): time.sleep(0.3)

@pytest.mark.xdist_group("tiny_dag")
def test_b1(shared, record_property): record_property("worker", shared)

@pytest.mark.slow
def test_z_slow(): time.sleep(0.3)
"""


def test_groups_stay_on_one_worker_module_fixtures_build_once_and_the_tiny_dag_goes_first(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(CONFTEST)
    (tmp_path / "tests" / "test_zgrouped.py").write_text(GROUPED)  # collected last, scheduled first
    (tmp_path / "tests" / "test_mixed.py").write_text(MIXED)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --dist loadgroup --no-loadscope-reorder\nmarkers = slow\n")
    log = tmp_path / "builds.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "BUILD_LOG": str(log)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "--junitxml",
                        str(tmp_path / "j.xml"), "-q", "tests"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cases = list(ET.parse(tmp_path / "j.xml").iter("testcase"))
    assert len(cases) == 12
    workers = {case.get("name").split("@")[0]: prop.get("value")
               for case in cases for prop in case.iter("property") if prop.get("name") == "worker"}
    assert set(workers) == {"test_a1", "test_a2", "test_a3", "test_b1"}, workers
    assert len(set(workers.values())) == 1, f"the group was split over workers: {workers}"
    assert log.read_text().count("\n") == 1, f"the module fixture was built more than once: {log.read_text()}"
    # junit lists the tests in the order the controller got their reports: the group (instant tests, collected
    # last) is the first unit of work one worker gets, while the other worker's first test takes 0.3 s or more
    first = [c.get("name").split("@")[0] for c in cases[:3]]
    assert {"test_a1", "test_a2", "test_a3", "test_b1"} & set(first), first
    # units longest first (a slow test estimated longest, collected last): the worker that does not hold the tiny
    # DAG's group starts with it; in collection order it would start with test_m1 and run test_z_slow last
    stamps = {case.get("name").split("@")[0]: prop.get("value").split()
              for case in cases for prop in case.iter("property") if prop.get("name") == "stamp"}
    other = {w for name, (w, _) in stamps.items() if name not in workers}
    other.discard(next(iter(workers.values())))
    assert len(other) == 1, stamps
    on_other = sorted((float(t), name) for name, (w, t) in stamps.items() if w in other)
    assert on_other[0][1] == "test_z_slow", on_other
