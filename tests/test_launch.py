"""pipeline.launch.run_process_tree: output streaming, error tails, and no process of a launched job
outliving its caller — on success, failure, exceptions, KeyboardInterrupt, or the caller's SIGKILL.

The job is tests/process_tree.py: three levels of sleeping processes, the second in a session of its own
(as torchrun starts its ranks), so a process-group kill alone would miss levels 2 and 3.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.launch import ProcessTreeError, pid_alive, run_process_tree

TREE = Path(__file__).with_name("process_tree.py")


def tree_cmd(pid_file: Path, *extra: str) -> list[str]:
    return [sys.executable, str(TREE), "1", "3", str(pid_file), *extra]


def pids(pid_file: Path) -> list[int]:
    return [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []


def wait_for(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def alive(ps: list[int]) -> list[int]:
    return [p for p in ps if pid_alive(p)]


class StopAfter(Exception):
    pass


def test_output_lines_stream_in_order_and_progress_bars_log_their_last_state():
    lines: list[str] = []
    script = "print('one', flush=True); print('10%\\r50%\\r100%', flush=True); print('three')"
    run_process_tree([sys.executable, "-c", script], log=lines.append, name="echo")
    assert lines == ["one", "100%", "three"]


def test_env_replaces_the_environment_and_cwd_is_used(tmp_path):
    lines: list[str] = []
    script = "import os; print(os.getcwd()); print(os.environ.get('HYLIGHT_X')); print('PATH' in os.environ)"
    run_process_tree([sys.executable, "-c", script], env={"HYLIGHT_X": "7"}, cwd=tmp_path, log=lines.append)
    assert lines == [str(tmp_path), "7", "False"]


def test_non_zero_exit_raises_with_the_last_40_lines():
    script = "import sys\nfor i in range(100): print(f'line {i}')\nsys.exit(3)"
    with pytest.raises(ProcessTreeError) as e:
        run_process_tree([sys.executable, "-c", script], log=lambda _: None, name="trainer")
    err = e.value
    assert err.returncode == 3 and err.tail == [f"line {i}" for i in range(60, 100)]
    msg = str(err)
    assert msg.startswith("trainer: `") and "exited with status 3" in msg and "last 40 line(s)" in msg
    assert "line 99" in msg and "line 59" not in msg
    # a stage's exception crosses Ray by pickle: it must come back whole (an H100 run once got Ray's
    # UnserializableException instead of the trainer's traceback)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ProcessTreeError and str(back) == msg and back.tail == err.tail and back.returncode == 3


def test_a_job_killed_by_a_signal_is_reported_as_such():
    script = "import os, signal; print('bye', flush=True); os.kill(os.getpid(), signal.SIGSEGV)"
    with pytest.raises(ProcessTreeError, match="was killed by SIGSEGV") as e:
        run_process_tree([sys.executable, "-c", script], log=lambda _: None)
    assert e.value.returncode == -signal.SIGSEGV and e.value.tail == ["bye"]


def test_a_command_that_cannot_start_fails_clearly():
    with pytest.raises(ProcessTreeError, match="cannot start 'no-such-launcher-xyz'") as e:
        run_process_tree(["no-such-launcher-xyz", "--nproc_per_node", "2"], log=lambda _: None)
    assert e.value.returncode == 127


@pytest.mark.parametrize("raised", [StopAfter, KeyboardInterrupt])
def test_an_exception_in_the_caller_kills_the_whole_tree_before_returning(tmp_path, raised):
    pid_file = tmp_path / "pids"
    seen: list[str] = []

    def log(line: str) -> None:
        seen.append(line)
        if len(seen) == 3:  # all three levels are up
            raise raised()

    # the deepest level ignores SIGTERM: it is stopped by the SIGKILL after the grace period
    with pytest.raises(raised):
        run_process_tree(tree_cmd(pid_file, "--ignore-term"), log=log, name="tree", grace_s=0.5)
    ps = pids(pid_file)
    assert len(ps) == 3 and [s.split()[:2] for s in seen] == [["level", "1"], ["level", "2"], ["level", "3"]]
    assert alive(ps) == []  # already gone when the call returns: nothing to wait for


def test_processes_left_behind_by_a_finished_launcher_are_killed(tmp_path):
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(f"""\
        import os, subprocess, time
        subprocess.Popen({tree_cmd(pid_file)!r}, start_new_session=True)
        while not (os.path.exists({str(pid_file)!r}) and len(open({str(pid_file)!r}).read().split()) == 3):
            time.sleep(0.05)
        print("launcher done", flush=True)
    """)
    lines: list[str] = []
    run_process_tree([sys.executable, "-c", script], log=lines.append, name="leaky", grace_s=1)
    assert "launcher done" in lines
    assert any("left 3 process(es) running: killing them" in line for line in lines)
    assert len(pids(pid_file)) == 3 and alive(pids(pid_file)) == []


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGKILL with its children"])
def test_when_the_caller_dies_the_tree_dies_too(tmp_path, how):
    """The caller stands in for a Ray worker that is force-cancelled: SIGKILL, no cleanup runs, and Ray
    also SIGKILLs the worker's direct children (kill_child_processes_on_worker_exit)."""
    pid_file = tmp_path / "pids"
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from pipeline.launch import run_process_tree
        run_process_tree({tree_cmd(pid_file)!r}, log=lambda line: None, name="tree")
    """)])
    try:
        assert wait_for(lambda: len(pids(pid_file)) == 3), "the tree did not start"
        ps = pids(pid_file)
        relay = _children(caller.pid)
        helpers = relay + _children(relay[0])  # the relay and the supervisor
        assert len(helpers) == 2 and alive(ps) == ps
        caller.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
        if how == "SIGKILL with its children":
            os.kill(relay[0], signal.SIGKILL)
        caller.wait(timeout=10)
        assert wait_for(lambda: not alive(ps + helpers), timeout_s=10), \
            f"still running after the caller died: {alive(ps + helpers)}"
    finally:
        caller.kill()
        caller.wait()
        for p in alive(pids(pid_file)):  # never leave sleepers behind on a failed assertion
            os.kill(p, signal.SIGKILL)


def test_a_killed_relay_stops_the_job_and_fails_the_call(tmp_path):
    pid_file = tmp_path / "pids"
    seen: list[str] = []

    def log(line: str) -> None:
        seen.append(line)
        if len(seen) == 3:
            relay = [p for p in _children(os.getpid()) if b"--hylight-supervise" in _cmdline(p)]
            os.kill(relay[0], signal.SIGKILL)

    with pytest.raises(ProcessTreeError, match="was killed by SIGKILL"):
        run_process_tree(tree_cmd(pid_file), log=log, name="tree")
    assert len(pids(pid_file)) == 3
    assert wait_for(lambda: not alive(pids(pid_file)), timeout_s=10)


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]
