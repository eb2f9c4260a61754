"""The tests that share the tiny DAG fixture run on one xdist worker (so the DAG runs once per session).

Runs pytest with two workers over a generated project that uses this repository's conftest hook, and checks on which
worker each test of the group ran.
"""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFTEST = """
import os
import pytest
from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the hook under test)

@pytest.fixture(scope="session")
def shared():
    return os.environ["PYTEST_XDIST_WORKER"]
"""
GROUPED = """
import pytest
pytestmark = [pytest.mark.xdist_group("g")]
def test_a1(shared, record_property): record_property("worker", shared)
def test_a2(shared, record_property): record_property("worker", shared)
def test_a3(shared, record_property): record_property("worker", shared)
"""
MIXED = """
import pytest, time
@pytest.mark.xdist_group("g")
def test_b1(shared, record_property): record_property("worker", shared)
def test_b2(): time.sleep(0.3)
def test_b3(): time.sleep(0.3)
def test_b4(): time.sleep(0.3)
"""


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_mixed.py").write_text(MIXED)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --dist loadgroup\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "--junitxml",
                        str(tmp_path / "j.xml"), "-q", str(tmp_path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import xml.etree.ElementTree as ET
    workers = {case.get("name").split("@")[0]: prop.get("value")
               for case in ET.parse(tmp_path / "j.xml").iter("testcase")
               for prop in case.iter("property") if prop.get("name") == "worker"}
    assert set(workers) == {"test_a1", "test_a2", "test_a3", "test_b1"}, workers
    assert len(set(workers.values())) == 1, f"the group was split over workers: {workers}"
