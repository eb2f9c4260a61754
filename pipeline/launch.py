"""Run a multi-process job (the DeepSpeed launcher, torchrun, ...) from inside a stage, leaving nothing behind.

Three things defeat the obvious ``Popen`` + ``killpg``: launchers start their ranks in new sessions
(torchrun's elastic agent ``setsid``s every rank), a force-cancelled Ray worker dies by SIGKILL without
running any cleanup, and on a worker's exit Ray SIGKILLs the worker's direct children (its
``kill_child_processes_on_worker_exit``). So two small processes stand between the caller and the job
(Linux)::

    caller (stage worker) ── relay ── supervisor (child subreaper) ── launcher ── ranks (any session)

- The *relay* is the caller's only child. It dies with the caller (``PR_SET_PDEATHSIG``), forwards the
  caller's SIGTERM, and passes the job's exit status back. Whoever kills it cannot reach the supervisor.
- The *supervisor* is a child subreaper (``PR_SET_CHILD_SUBREAPER``): every process of the job that
  loses its parent is re-parented to it, whatever session it moved to, so ``/proc`` always shows the
  whole job as its descendants. It gets SIGTERM when the relay dies and also polls the caller's pid;
  either way it stops the job: SIGTERM to every descendant, a grace period, then SIGKILL.
- When the launcher exits, stragglers it left running are killed as well, so the output pipe closes
  and nothing outlives the call.

This module imports only the standard library: it runs itself as a script (``python -I``).
"""

from __future__ import annotations

import collections
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_SUPERVISE_FLAG = "--hylight-supervise"
_WATCH_FLAG = "--hylight-watch"


class ProcessTreeError(RuntimeError):
    """A launched job exited with a non-zero status; ``tail`` holds its last lines of output."""

    def __init__(self, name: str, cmd: Sequence[str], returncode: int, tail: list[str]):
        self.name, self.cmd, self.returncode, self.tail = name, list(cmd), returncode, tail
        if returncode < 0:
            try:
                how = f"was killed by {signal.Signals(-returncode).name}"
            except ValueError:
                how = f"was killed by signal {-returncode}"
        else:
            how = f"exited with status {returncode}"
        shown = shlex.join(self.cmd)
        shown = shown if len(shown) <= 300 else shown[:300] + " ..."
        lines = "\n".join(f"  | {line}" for line in tail) or "  | (no output)"
        super().__init__(f"{name}: `{shown}` {how}; its last {len(tail)} line(s) of output:\n{lines}")

    def __reduce__(self):  # Ray pickles a stage's exception to the driver: rebuild it from its fields
        return (type(self), (self.name, self.cmd, self.returncode, self.tail))


def run_process_tree(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
                     log: Callable[[str], None] = print, name: str = "job", grace_s: float = 5.0) -> None:
    """Run ``cmd`` and every process it starts to completion; stream its output lines to ``log``.

    ``env`` replaces the environment when given (as in :mod:`subprocess`; pass ``{**os.environ, ...}``
    to add to it). stdout and stderr are merged; a line rewritten with ``\\r`` (progress bars) is
    logged as its last state. On a non-zero exit :class:`ProcessTreeError` carries the last
    ``TAIL_LINES`` lines. Whatever ends the call — success, failure, an exception raised by ``log``,
    KeyboardInterrupt, or this process being SIGKILLed — no process of the job is left running
    (SIGTERM first, SIGKILL after ``grace_s`` seconds).
    """
    if not cmd:
        raise ValueError(f"{name}: empty command")
    if not sys.platform.startswith("linux"):
        raise OSError(f"{name}: run_process_tree needs Linux (prctl child-subreaper and parent-death signal)")
    relay = [sys.executable, "-I", os.path.abspath(__file__), _SUPERVISE_FLAG, str(os.getpid()),
             f"{grace_s:g}", "--", *map(str, cmd)]
    # A session of its own: the terminal's Ctrl-C goes to the orchestrator, which cancels the stage;
    # the job is then stopped through the relay and the supervisor, in order.
    proc = subprocess.Popen(relay, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            line = next((part for part in reversed(text.split("\r")) if part.strip()), "")
            tail.append(line)
            log(line)
        returncode = proc.wait()
    except BaseException:
        _stop_job(proc, grace_s)
        raise
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
    if returncode != 0:
        raise ProcessTreeError(name, cmd, returncode, list(tail))


def _stop_job(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the relay (passed on to the supervisor, which stops the job and exits); if that takes
    too long, SIGKILL the relay's whole process group."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=grace_s + 10)
        except subprocess.TimeoutExpired:
            pass  # falls through to the group kill
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # last resort; also catches anything left in its group
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# --------------------------------------------------------------------------------------------
# the relay and the supervisor (`python -I launch.py --hylight-supervise CALLER_PID GRACE -- CMD...`)


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}) failed: {os.strerror(err)}")


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` of this host started (clock ticks since boot), or None if unknown."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 of stat, starttime


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process ``pid`` of this host still runs (an exited, unreaped one does not). With
    ``start_ticks`` (from :func:`process_start_ticks`), a newer process that reused the pid does not count."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    fields = _stat_fields(pid)
    if fields is None or fields[0] == b"Z":
        return False
    return start_ticks is None or int(fields[19]) == start_ticks


def _say(message: str) -> None:
    """Best effort: once the caller is dead nobody reads the pipe, and a write must not kill us."""
    try:
        os.write(2, f"[hylight launch] {message}\n".encode())
    except OSError:
        pass


def _children_map() -> dict[int, list[int]]:
    """ppid -> pids of every process visible in /proc."""
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:
            kids[int(fields[1])].append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), read from /proc."""
    kids = _children_map()
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _reap() -> dict[int, int]:
    """Collect every exited child without blocking: pid -> wait status."""
    done = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = status


def _kill_all(grace_s: float) -> None:
    """SIGTERM every descendant, wait up to ``grace_s``, then SIGKILL until none is left."""
    me = os.getpid()

    def signal_all(sig: int) -> int:
        pids = descendants(me)
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        return len(pids)

    if signal_all(signal.SIGTERM) == 0:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap()
        if not descendants(me):
            return
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while signal_all(signal.SIGKILL):  # new processes may appear while we kill: loop until none
        if time.monotonic() > deadline:  # e.g. stuck in uninterruptible I/O: say so rather than hang
            _say(f"{len(descendants(me))} process(es) survive SIGKILL: {descendants(me)}")
            return
        time.sleep(0.05)
        _reap()


def _supervise(relay: int, caller: int, caller_start: int | None, grace_s: float, cmd: list[str]) -> int:
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: stop.append(s))
    if os.getppid() != relay:  # the relay died before the death signal was armed
        return 128 + signal.SIGTERM
    try:
        # inherits stdout/stderr (the caller's pipe), env and cwd; if the supervisor itself is killed,
        # the launcher gets SIGTERM and can still stop the ranks it started
        root = subprocess.Popen(cmd, preexec_fn=lambda: _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM))
    except OSError as e:
        _say(f"cannot start {cmd[0]!r}: {e}")
        return 127
    status = None
    last_check = 0.0
    while status is None:
        now = time.monotonic()
        gone = False
        if now - last_check >= 0.25:  # the caller itself, in case the relay was stopped, not killed
            last_check, gone = now, not pid_alive(caller, caller_start)
        if stop or gone or os.getppid() != relay:
            why = f"signal {signal.Signals(stop[0]).name}" if stop else "its caller exited"
            _say(f"stopping the job ({why})")
            _kill_all(grace_s)
            root.returncode = -signal.SIGKILL  # reaped by _kill_all; keeps Popen from warning
            return 128 + (stop[0] if stop else signal.SIGTERM)
        status = _reap().get(root.pid)
        if status is None:
            time.sleep(0.05)
    root.returncode = os.waitstatus_to_exitcode(status)
    left = descendants(os.getpid())
    if left:
        _say(f"{cmd[0]} exited and left {len(left)} process(es) running: killing them")
        _kill_all(grace_s)
    return root.returncode


def _exit_like(code: int) -> None:
    """Exit with ``code``; a negative one (died of that signal) by dying of the same signal."""
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL/SIGSTOP cannot be handled; they need no reset
            pass
        os.kill(os.getpid(), -code)
        time.sleep(1)
        code = 128 - code
    os._exit(code)


def _main(argv: list[str]) -> None:
    caller, grace_s = int(argv[0]), float(argv[1])
    caller_start = process_start_ticks(caller)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the relay dies with the caller
    if os.getppid() != caller:
        _exit_like(128 + signal.SIGTERM)
    relay = os.getpid()
    child = os.fork()
    if child == 0:  # the supervisor
        sys.stdout.flush()
        _exit_like(_supervise(relay, caller, caller_start, grace_s, argv[3:]))
    # the relay: hold no end of the output pipe, pass signals on, report the supervisor's status
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: os.kill(child, s))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            status = 0
            break
    _exit_like(os.waitstatus_to_exitcode(status))


# --------------------------------------------------------------------------------------------
# the driver's watchdog (`python -I launch.py --hylight-watch DRIVER_PID START_TICKS INTERVAL`)
#
# A local Ray started by `hylight run` shares the driver's fate only in part: measured with Ray 2.60, after a
# SIGKILL of the driver alone, gcs_server, raylet and the workers exit within seconds, but DashboardAgent and
# RuntimeEnvAgent are re-parented to init and live on for one to two minutes. A SIGKILL cannot be handled, so a
# separate process does the cleanup: it notes the driver's descendants while the driver lives (a process that
# loses its parent drops out of the tree, so what was seen is kept while it lives) and, once the driver is gone,
# kills every one of them still running (same pid and start time) and whatever they started.


def start_watchdog(pid: int | None = None, interval_s: float = 1.0) -> int:
    """Start the watchdog of process ``pid`` (default: this one); returns the watchdog's pid. It runs in a session
    of its own and is not a child of ``pid`` (Ray SIGKILLs a dead driver's direct children, as it does a worker's),
    so neither a kill of the driver's process group nor Ray reaches it. It exits once the driver's processes are
    gone."""
    pid = os.getpid() if pid is None else pid
    starter = subprocess.run([sys.executable, "-I", os.path.abspath(__file__), _WATCH_FLAG, str(pid),
                              str(process_start_ticks(pid) or 0), f"{interval_s:g}"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True, check=True, timeout=60)
    return int(starter.stdout)


def _watch(driver: int, driver_start: int | None, interval_s: float) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver
    seen: dict[int, int | None] = {}  # pid -> start ticks of every descendant of the driver seen so far
    while pid_alive(driver, driver_start):
        kids = _children_map()
        todo = list(kids.get(driver, []))
        while todo:
            p = todo.pop()
            if p not in seen:
                seen[p] = process_start_ticks(p)
            todo.extend(kids.get(p, []))
        seen = {p: t for p, t in seen.items() if pid_alive(p, t)}
        time.sleep(interval_s)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        live = [p for p, t in seen.items() if pid_alive(p, t)]
        kids = _children_map()
        live += [k for p in live for k in kids.get(p, []) if k not in seen]
        if not live:
            return 0
        for p in live:
            seen.setdefault(p, process_start_ticks(p))
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return 1


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == _SUPERVISE_FLAG:
    _main(sys.argv[2:])
elif __name__ == "__main__" and len(sys.argv) > 4 and sys.argv[1] == _WATCH_FLAG:
    watcher = os.fork()  # the starter exits at once: the watchdog is nobody's child but init's (or a subreaper's)
    if watcher:
        print(watcher, flush=True)
        os._exit(0)
    os.close(1)
    os.open(os.devnull, os.O_WRONLY)
    os._exit(_watch(int(sys.argv[2]), int(sys.argv[3]) or None, float(sys.argv[4])))
