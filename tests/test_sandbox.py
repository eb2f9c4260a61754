"""The code sandbox (report §5.2, Correctness: programs are tested in a secured sandbox): it runs correct code,
fails wrong code, and stops infinite loops, fork bombs, memory hogs, network calls and floods of output, leaving no
process behind."""

from __future__ import annotations

import os
import socket
import time

import psutil
import pytest

from posttrain.sandbox import SandboxCase, SandboxLimits, parse_tests, run_python

SQUARE = "def square(x):\n    return x * x\n"
SQUARE_TESTS = ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"]


@pytest.fixture(autouse=True)
def own_temp_root(tmp_path, monkeypatch):
    """Each test's sandbox runs get their work directories (and so their children's command lines) under this
    test's own temp root, so the process scans below see this test's runs only, whatever else runs beside it."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _sandbox_processes(root) -> set[int]:
    """Live processes running the sandbox child for a run under ``root``, for before/after comparisons."""
    return {p.pid for p in psutil.process_iter(["cmdline", "status"])
            if "sandbox_child.py" in " ".join(p.info["cmdline"] or []) and str(root) in " ".join(p.info["cmdline"])
            and p.info["status"] != psutil.STATUS_ZOMBIE}


def test_correct_code_passes_every_test():
    r = run_python(SQUARE, SQUARE_TESTS)
    assert (r.status, r.tests_passed, r.tests_total, r.pass_rate) == ("ok", 3, 3, 1.0)
    assert r.test_errors == [None, None, None]
    assert r.leftover_processes == 0


def test_wrong_code_fails_the_tests_it_gets_wrong():
    r = run_python("def square(x):\n    return x + x\n", SQUARE_TESTS)  # right only at 0 (and 2)
    assert (r.status, r.tests_passed) == ("ok", 1)
    assert r.test_errors[0].startswith("AssertionError") and r.test_errors[2] is None


def test_code_that_raises_is_an_error_with_no_test_passed():
    r = run_python("def square(x):\n    return x * x\nraise ValueError('boom')\n", SQUARE_TESTS)
    assert (r.status, r.tests_passed) == ("error", 0)
    assert "ValueError: boom" in r.error


def test_syntax_error_and_sys_exit_do_not_pass():
    assert run_python("def square(x) return x", SQUARE_TESTS).tests_passed == 0
    r = run_python("import sys\nsys.exit(0)\n", SQUARE_TESTS)
    assert (r.status, r.tests_passed) == ("error", 0)


def test_runs_as_nobody_in_a_network_namespace_when_root():
    r = run_python("import os\nprint(os.geteuid())", [])
    if os.geteuid() != 0:
        pytest.skip("privilege drop applies only when the sandbox runs as root")
    assert r.uid == 65534 and r.stdout.strip() == "65534"
    assert r.network_mode in ("namespace", "user_namespace", "guard")


def test_infinite_loop_times_out_within_the_limit():
    start = time.monotonic()
    r = run_python("while True:\n    pass\n", ["assert True"], SandboxLimits(wall_seconds=1.0, cpu_seconds=5))
    elapsed = time.monotonic() - start
    assert r.status == "timeout" and r.tests_passed == 0
    # stopped at the wall limit, not hung (generous bound: other jobs may load the machine)
    assert r.wall_seconds >= 1.0 and elapsed < 30
    assert r.leftover_processes == 0


def test_cpu_limit_stops_a_busy_loop_before_the_wall_limit():
    r = run_python("while True:\n    pass\n", [], SandboxLimits(wall_seconds=10.0, cpu_seconds=1))
    assert r.status == "timeout" and "CPU" in r.error


def test_a_program_that_ignores_sigxcpu_is_a_timeout_not_an_error():
    """Past the soft CPU limit the kernel sends SIGXCPU; ignored, the hard limit's SIGKILL ends the code. Before, the
    PID namespace's relay tried to set a handler for SIGKILL, failed, and the run read as an error (exit code 1)."""
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    r = run_python(code, [], SandboxLimits(wall_seconds=10.0, cpu_seconds=1))
    assert r.status == "timeout" and "CPU" in r.error, r
    assert r.wall_seconds < 9.0  # the CPU limit's kill, not the wall clock's


@pytest.mark.parametrize(("returns", "passes"), [
    ("float(a + b)", True),  # 3.0 == 3 in Python: a correct solution
    ("[a + b, float(a)]", False),  # a list where a number is expected
    ("a + b == 3", False),  # True is not 3 (nor 1)
], ids=["float-for-int", "list", "bool"])
def test_numbers_compare_as_pythons_equality_does_but_bools_stay_apart(returns, passes):
    r = run_python(f"def add(a, b):\n    return {returns}\n", ["assert add(1, 2) == 3"])
    assert r.tests_passed == int(passes), r.test_errors
    nested = run_python("def pair():\n    return [1.0, {'k': 2.0}]\n", ["assert pair() == [1, {'k': 2}]",
                                                                        "assert pair() == [1, {'k': 3}]"])
    assert nested.test_errors[0] is None and nested.test_errors[1] is not None
    flag = run_python("def one():\n    return 1\n", ["assert one() == True", "assert one() == 1.0"])
    assert flag.test_errors[0] is not None and flag.test_errors[1] is None


@pytest.mark.parametrize("use_cgroup", [True, False], ids=["cgroup", "no-cgroup"])
def test_fork_bomb_is_stopped_and_no_process_survives(use_cgroup, own_temp_root):
    before = _sandbox_processes(own_temp_root)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_python(bomb, [], SandboxLimits(wall_seconds=5.0, max_processes=16, use_cgroup=use_cgroup))
    # "killed" is only ever the process cap's verdict (the 5 s wall limit gives "timeout")
    assert r.status == "killed", (r.status, r.error, r.process_limit)
    assert r.wall_seconds < 5.0
    if use_cgroup and r.process_limit == "cgroup":
        # the cgroup refuses the 17th task outright; the watcher stops on the refusal it counts in pids.events,
        # so its sampled count may lag the cap by a process that was already exiting
        assert 1 <= r.peak_processes <= 16
    else:
        assert r.peak_processes >= 16  # the watcher counted the cap itself
    assert r.leftover_processes == 0
    time.sleep(0.2)
    assert _sandbox_processes(own_temp_root) - before == set(), "a process of the fork bomb survived"


def test_watchdog_alone_stops_a_spawner_when_no_kernel_cap_applies(own_temp_root):
    if os.geteuid() != 0:
        pytest.skip("without root the rlimit always applies")
    # root keeps root and no cgroup: only the watchdog counts (a linear spawner, gentle on a shared machine)
    spawner = "import os, time\nfor _ in range(40):\n    if os.fork() == 0:\n        time.sleep(30)\n" \
              "        os._exit(0)\n    time.sleep(0.02)\ntime.sleep(30)\n"
    before = _sandbox_processes(own_temp_root)
    r = run_python(spawner, [], SandboxLimits(wall_seconds=5.0, max_processes=8, use_cgroup=False,
                                              drop_privileges=False))
    assert (r.process_limit, r.status) == ("watchdog", "killed")
    assert 8 <= r.peak_processes <= 12 and r.leftover_processes == 0
    time.sleep(0.2)
    assert _sandbox_processes(own_temp_root) - before == set()


def test_memory_hog_gets_memory_status():
    r = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n", ["assert True"],
                   SandboxLimits(memory_bytes=256 << 20))
    assert r.status == "memory" and r.tests_passed == 0
    assert r.leftover_processes == 0


@pytest.mark.parametrize("network", ["namespace", "guard"])
def test_network_call_to_a_local_listener_is_refused(network):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = ("import socket\n"
            "def reach():\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    s.sendall(b'leak')\n"
            "    return True\n")
    try:
        r = run_python(code, ["assert reach()"], SandboxLimits(network=network))
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever connected
    finally:
        server.close()
    assert r.status == "ok" and r.tests_passed == 0
    assert r.test_errors[0].split(":")[0] in ("OSError", "PermissionError", "ConnectionRefusedError")
    if network == "guard":
        assert r.network_mode == "guard" and r.test_errors[0].startswith("PermissionError")
    else:
        assert r.network_mode in ("namespace", "user_namespace", "guard")


def test_huge_output_is_capped():
    r = run_python("for _ in range(2000):\n    print('x' * 10000)\n", [], SandboxLimits(output_bytes=4096))
    assert r.status == "ok" and r.output_truncated
    assert len(r.stdout) == 4096


@pytest.mark.parametrize("private", [True, False], ids=["private-tmp", "shared-fs"])
def test_file_writes_are_capped_and_the_work_dir_is_removed(private):
    code = "import os\nprint(os.getcwd())\nwith open('big', 'wb') as f:\n    f.write(b'x' * (4 << 20))\n"
    r = run_python(code, [], SandboxLimits(file_bytes=1 << 20, private_filesystem=private))
    assert r.status in ("error", "timeout")  # SIGXFSZ or an OSError, never a 4 MiB file
    workdir = r.stdout.strip()
    if r.filesystem == "private":  # the run's own tmpfs /tmp, gone with its mount namespace
        assert workdir == "/tmp"
    else:
        assert workdir and not os.path.exists(workdir)


# --- the verdict is the parent's (issue 23 items 1-2): each attack passed every test before ---------------------------
def test_tests_split_into_the_expression_the_sandbox_sees_and_the_value_only_the_parent_holds():
    assert parse_tests(["assert f(1) == [1, (2, 'a')]", "assert 'x' == g()", "assert h() is None", "assert ok(2)",
                        "assert not ok(3)"]) == [
        SandboxCase("f(1)", [1, (2, "a")]), SandboxCase("g()", "x"), SandboxCase("h()", None),
        SandboxCase("ok(2)", True), SandboxCase("ok(3)", False)]
    for bad, why in (("assert f(1) == g(1)", "one side must be a literal"), ("x = 1", "not a single assert"),
                     ("assert f(1), 'msg'", "not a single assert"), ("assert f(", "not valid Python"),
                     ("assert f() == {1, 2}", "one side must be a literal")):  # a set has no plain-data form
        with pytest.raises(ValueError, match=why):
            parse_tests([bad])


def test_a_response_that_writes_pass_events_on_the_result_pipe_passes_nothing():
    forger = ("import os, sys\n"
              "def square(x):\n    return 0\n"
              "fd = int(sys.argv[2])\n"
              "for i in range(3):\n"
              "    os.write(fd, b'{\"event\": \"test\", \"index\": %d, \"passed\": true}\\n' % i)\n"
              "    os.write(fd, b'{\"event\": \"value\", \"index\": %d, \"json\": \"true\"}\\n' % i)\n"
              "os.write(fd, b'{\"event\": \"done\"}\\n')\n"
              "os._exit(0)\n")
    r = run_python(forger, SQUARE_TESTS)
    assert r.tests_passed == 0 and all(e for e in r.test_errors), r


def test_the_expected_values_are_not_in_the_sandbox_to_be_read():
    """A response that searches the calling frames and every live string for the expected answer."""
    reader = ("import gc, re, sys\n"
              "def secret():\n"
              "    pattern = re.compile('zeb' + 'ra-[0-9]+')\n"
              "    found, f = [], sys._getframe(1)\n"
              "    while f is not None:\n"
              "        found += list(f.f_locals.values())\n"
              "        f = f.f_back\n"
              "    for o in found + gc.get_objects():\n"
              "        items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else [o]\n"
              "        for t in items:\n"
              "            m = pattern.search(t) if isinstance(t, str) else None\n"
              "            if m:\n"
              "                return m.group(0)\n"
              "    return None\n")
    r = run_python(reader, ["assert secret() == 'zebra-4271'"])
    assert (r.status, r.tests_passed) == ("ok", 0), r
    assert "returned null" in r.test_errors[0]


@pytest.mark.parametrize("value", ["AlwaysEqual()", "Sneaky(7)", "1"], ids=["eq-object", "int-subclass", "int-for-bool"])
def test_objects_that_compare_equal_to_anything_do_not_pass(value):
    code = ("class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
            "class Sneaky(int):\n    def __eq__(self, other):\n        return True\n"
            f"def square(x):\n    return {value}\n")
    r = run_python(code, SQUARE_TESTS + ["assert square(1) == True"])
    assert r.tests_passed == 0, r.test_errors


def test_check_python_tests_gives_a_forging_wrong_function_no_credit():
    from posttrain.verifiable import check_python_tests

    record = {"reference": {"function": "square", "tests": SQUARE_TESTS}}
    forged = ("```python\nimport os, sys\ndef square(x):\n    return -1\n"
              "for i in range(3):\n"
              "    os.write(int(sys.argv[2]), b'{\"event\": \"test\", \"index\": %d, \"passed\": true}\\n' % i)\n"
              "```")
    res = check_python_tests(record, forged)
    assert (res.correct, res.score) == (False, 0.0), res
    assert check_python_tests(record, f"```python\n{SQUARE}```").correct


# --- containment by the kernel (issue 23 items 3-5): each attack got through before ----------------------------------
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mount and PID namespaces need root here")


@needs_root
def test_writes_to_tmp_and_dev_shm_do_not_outlive_the_run_and_are_capped_in_total(tmp_path):
    marker = f"hylight-leak-{os.getpid()}"
    code = ("import os\n"
            f"for d in ('/tmp', '/dev/shm'):\n    open(os.path.join(d, '{marker}'), 'w').write('x')\n"
            "n = 0\n"
            "try:\n"
            "    for i in range(64):\n"  # many files, each under the per-file limit
            "        with open(f'/dev/shm/fill{i}', 'wb') as f:\n            f.write(b'x' * (1 << 20))\n"
            "        n += 1\n"
            "except OSError:\n    pass\n"
            "print(n)\n")
    r = run_python(code, [], SandboxLimits(file_bytes=2 << 20, tmp_bytes=8 << 20))
    assert (r.filesystem, r.status) == ("private", "ok"), r
    assert int(r.stdout.strip()) < 9  # the tmpfs is 8 MiB in total, whatever the number of files
    assert not os.path.exists(f"/tmp/{marker}") and not os.path.exists(f"/dev/shm/{marker}")


@needs_root
def test_the_project_and_working_directory_are_hidden_and_other_processes_invisible():
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # empty, or absent where the project itself lies under /tmp (a clean clone's CI): the sandbox's /tmp is its own
    code = ("import os\n"
            f"print(sorted(os.listdir({project!r})) if os.path.exists({project!r}) else [])\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n")
    r = run_python(code, [])
    assert r.status == "ok" and r.pid_namespace, r
    listing, pids = r.stdout.strip().splitlines()
    assert listing == "[]"  # the prompts artifact, the reference solutions, the code: none readable
    assert eval(pids) == [1, 2]  # the namespace's init and the process running the code


@needs_root
def test_memory_is_capped_for_the_whole_run_not_per_process():
    """4 processes x 200 MiB under a 512 MiB limit: RLIMIT_AS alone allows each its 512 MiB."""
    code = ("import os, time\n"
            "for _ in range(3):\n"
            "    if os.fork() == 0:\n        break\n"
            "block = bytearray(200 << 20)\n"
            "for i in range(0, len(block), 4096):\n    block[i] = 1\n"
            "time.sleep(2)\n"
            "print('held')\n")
    r = run_python(code, [], SandboxLimits(memory_bytes=512 << 20, wall_seconds=8))
    assert r.memory_limit == "cgroup", r
    assert r.status == "memory" and r.stdout.count("held") < 3, r
    assert r.leftover_processes == 0


@needs_root
def test_a_double_forked_setsid_grandchild_dies_with_the_run(own_temp_root):
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n        time.sleep(30)\n    os._exit(0)\n"
            "time.sleep(0.3)\n")
    r = run_python(code, [], SandboxLimits(use_cgroup=False))
    assert r.pid_namespace and r.leftover_processes == 0, r
    time.sleep(0.2)
    assert _sandbox_processes(own_temp_root) == set()  # the grandchild kept the child's command line


_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD_HACKS = {
    "prints-pass": "def square(x):\n    return -1\nprint('PASS')\nprint('3/3 tests passed')\n",
    "exits-early": "import os\ndef square(x):\n    return -1\nos._exit(0)\n",
    "patches-the-serialiser": "import json\njson.dumps = lambda *a, **k: 'true'\ndef square(x):\n    return -1\n",
    "raises-systemexit-when-called": "def square(x):\n    raise SystemExit(0)\n",
    "recursion-bomb": "def square(x):\n    return square(x)\n",
    "imports-the-checker": "from posttrain.verifiable import check\ndef square(x):\n    return -1\n",
    "writes-into-the-project": (f"open({os.path.join(_PROJECT, 'hacked.txt')!r}, 'w').write('x')\n"
                                "def square(x):\n    return -1\n"),
}


@pytest.mark.parametrize("code", list(REWARD_HACKS.values()), ids=list(REWARD_HACKS))
def test_reward_hacking_responses_score_zero_and_leave_nothing_behind(code, own_temp_root):
    from posttrain.verifiable import check_python_tests

    res = check_python_tests({"reference": {"function": "square", "tests": SQUARE_TESTS}},
                             f"```python\n{code}```")
    assert (res.correct, res.score) == (False, 0.0), res
    assert _sandbox_processes(own_temp_root) == set()
    assert not os.path.exists(os.path.join(_PROJECT, "hacked.txt"))


def test_missing_containment_is_refused_by_name_unless_weaker_is_accepted(monkeypatch, own_temp_root):
    """A machine without a writable memory cgroup (simulated: the cgroup is not created) or without root: the run
    is refused before any code runs, naming what is missing; HYLIGHT_SANDBOX_CONTAINMENT=best_effort accepts it."""
    from posttrain import sandbox

    real = sandbox.MemoryCgroup

    class Unwritable(real):
        def __init__(self, limit, pids=None):
            super().__init__(None)

    monkeypatch.setattr(sandbox, "MemoryCgroup", Unwritable)
    marker = own_temp_root / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')\n" + SQUARE
    with pytest.raises(sandbox.SandboxUnavailable, match="memory cgroup.*HYLIGHT_SANDBOX_CONTAINMENT=best_effort"):
        run_python(code, SQUARE_TESTS, SandboxLimits(private_filesystem=False))
    assert not marker.exists() and _sandbox_processes(own_temp_root) == set()
    monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "best_effort")
    r = run_python(SQUARE, SQUARE_TESTS)
    assert (r.status, r.tests_passed, r.memory_limit) == ("ok", 3, "rlimit")
    monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "require")
    monkeypatch.setattr(sandbox, "MemoryCgroup", real)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    with pytest.raises(sandbox.SandboxUnavailable, match=r"root \(for the mount and PID namespaces\)"):
        run_python(SQUARE, SQUARE_TESTS)
    monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "sometimes")
    with pytest.raises(ValueError, match="HYLIGHT_SANDBOX_CONTAINMENT='sometimes'"):
        SandboxLimits()


def test_the_refusal_survives_pickling_with_its_message():
    """A Ray stage's error reaches the driver pickled: the message must come back as written, not re-joined from
    its own characters (an H100 run printed "s; a; n; d; b; o; x" before __reduce__)."""
    import pickle

    from posttrain import sandbox

    e = sandbox.SandboxUnavailable(["a writable memory cgroup", "root"])
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is sandbox.SandboxUnavailable
    assert str(back) == str(e) and back.missing == e.missing
    assert "without a writable memory cgroup; root." in str(back)


_CHILD_REFUSAL = r'''
import json, os, sys
sys.path.insert(0, sys.argv[2])
# this user namespace may create no PID namespace: what the sandbox's child meets on a host that forbids them
open("/proc/sys/user/max_pid_namespaces", "w").write("0")
from posttrain.sandbox import SandboxLimits, SandboxUnavailable, run_python
marker = os.path.join(sys.argv[1], "ran")
code = f"open({marker!r}, 'w').write('x')\ndef f(x):\n    return x\n"
out = {}
try:
    run_python(code, ["assert f(1) == 1"], SandboxLimits(use_cgroup=False, drop_privileges=False, containment="require"))
    out["require"] = "ran"
except SandboxUnavailable as e:
    out["require"] = e.missing
out["ran_under_require"] = os.path.exists(marker)
r = run_python(code, ["assert f(1) == 1"], SandboxLimits(use_cgroup=False, drop_privileges=False, containment="best_effort"))
out["best_effort"] = [r.status, r.tests_passed, r.pid_namespace, os.path.exists(marker)]
print(json.dumps(out))
'''


@needs_root
def test_the_child_refuses_when_it_cannot_create_a_namespace_and_runs_nothing(tmp_path):
    """The parent finds root and goes on; the child then fails to create its PID namespace (a user namespace whose
    max_pid_namespaces is 0). Under "require" the child reports what is missing and the code never runs; under
    best_effort it runs and the result says there was no PID namespace."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    visible = Path("/var/tmp") / f"hylight-child-refusal-{os.getpid()}"  # not under the sandbox's private /tmp
    visible.mkdir(mode=0o777, exist_ok=True)
    try:
        proc = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", _CHILD_REFUSAL,
                               str(visible), str(Path(__file__).resolve().parents[1])],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0 and "max_pid_namespaces" in proc.stderr:
            pytest.skip(f"cannot limit PID namespaces in a user namespace here: {proc.stderr[-300:]}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(visible, ignore_errors=True)
    assert out["require"] == ["a PID namespace"], out
    assert out["ran_under_require"] is False
    assert out["best_effort"] == ["ok", 1, False, True], out  # it ran, and its result says without a PID namespace


def test_a_guard_mode_run_is_named_in_the_containment_record_that_becomes_the_mlflow_tags():
    """Guard mode (no network namespace; ctypes gets past it, as the module says) is opt-in, and when a run used it
    the stage's `hylight.sandbox.network_mode` tag says so (record_sandbox tags containment_record())."""
    from posttrain.sandbox import containment_record

    containment_record()  # forget earlier runs of this process
    run_python("x = 1\n", [], SandboxLimits(network="namespace"))
    run_python("x = 1\n", [], SandboxLimits(network="guard"))
    record = containment_record()
    assert record["runs"] == "2" and "guard" in record["network_mode"].split(","), record
    assert containment_record()["runs"] == "0"  # forgotten once read
