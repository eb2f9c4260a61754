"""The processes of one sandbox run (:mod:`posttrain.sandbox`): the per-run pids and memory cgroups it joins, the
live processes of its session and process group (``/proc``), killing all of them, and its output drained under a
cap. The parent enforces with these what the child cannot enforce on itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

_CGROUP_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))


def _stat_fields(pid: int | str) -> list[bytes]:
    """/proc/PID/stat after "pid (comm) ": state ppid pgrp session ... ([] when the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return []
    return stat[stat.rfind(b")") + 2:].split()


def _alive(pid: int) -> bool:
    """Exists and is not a zombie (a killed process stays listed until its parent or init reaps it)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in (b"Z", b"X")


def session_pids(sid: int) -> list[int]:
    """Live pids whose session or process group is ``sid`` (the run's child is a session leader)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        if len(fields) > 3 and fields[0] not in (b"Z", b"X") and sid in (int(fields[2]), int(fields[3])):
            found.append(int(entry.name))
    return found


class RunCgroup:
    """A per-run cgroup directory, if one could be made and configured: what the run joins (``procs_file``),
    lists (``pids``), counts a limit event in (``hit_limit``) and removes."""

    EVENTS = ("", "")  # (file, key) whose nonzero count means the limit acted

    def __init__(self) -> None:
        self.dir: Path | None = None

    def _make(self, parent: Path, settings: dict[str, int], optional: dict[str, int] | None = None) -> bool:
        """Create a run directory under ``parent`` and write ``settings`` (and those ``optional`` files the kernel
        offers); False, with nothing left behind, if it refuses."""
        d = parent / f"hylight-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            d.mkdir()
            for name, value in settings.items():
                (d / name).write_text(str(value))
            for name, value in (optional or {}).items():
                if (d / name).exists():
                    (d / name).write_text(str(value))
        except OSError:
            if d.exists():
                _rmdir_quiet(d)
            return False
        self.dir = d
        return True

    @property
    def procs_file(self) -> str | None:
        return str(self.dir / "cgroup.procs") if self.dir else None

    def pids(self) -> list[int]:
        return [p for p in map(int, _read(self.dir / "cgroup.procs").split()) if _alive(p)] if self.dir else []

    def hit_limit(self) -> bool:
        if not self.dir:
            return False
        file, want = self.EVENTS
        for line in _read(self.dir / file).splitlines():
            key, _, n = line.partition(" ")
            if key == want and n.strip() not in ("", "0"):
                return True
        return False

    def remove(self) -> None:
        if self.dir:
            _rmdir_quiet(self.dir)


class PidsCgroup(RunCgroup):
    """A per-run pids cgroup (v1 ``pids`` hierarchy or a v2 directory with the pids controller), if writable.
    ``hit_limit``: a fork was refused by the cap (v1 and v2 both count them as ``max N`` in pids.events)."""

    EVENTS = ("pids.events", "max")

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        for root in _CGROUP_ROOTS if limit is not None else ():
            if not (root / "pids.max").exists() and not (root / "cgroup.procs").exists():
                continue
            if root == Path("/sys/fs/cgroup") and "pids" not in _read(root / "cgroup.subtree_control"):
                continue
            if self._make(root, {"pids.max": limit}):
                return


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _rmdir_quiet(d: Path) -> None:
    for _ in range(50):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


class MemoryCgroup(RunCgroup):
    """A per-run memory limit for the whole run, tmpfs pages included, if the kernel lets this process set one.
    RLIMIT_AS alone caps each process, so N processes could hold N times it.

    - cgroup v1: a run directory in the ``memory`` hierarchy, under this process's own; ``hit_limit``: ``oom_kill N``
      in memory.oom_control.
    - cgroup v2 (one unified tree; a process belongs to one directory of it): ``memory.max`` on the run's pids
      directory (``shared``: joined and removed once, as the pids cgroup), swap off there (``memory.swap.max`` 0)
      so swap is no way around it; ``hit_limit``: ``oom_kill N`` in memory.events."""

    EVENTS = ("memory.oom_control", "oom_kill")

    def __init__(self, limit: int | None, pids: PidsCgroup | None = None) -> None:
        super().__init__()
        self.shared = False
        if limit is None:
            return
        root = Path("/sys/fs/cgroup/memory")
        if (root / "memory.limit_in_bytes").exists():
            own = next((line.split(":", 2)[2] for line in _read(Path("/proc/self/cgroup")).splitlines()
                        if line.split(":", 2)[1:2] == ["memory"]), "/")
            # swap too, where it is accounted (memsw): not a way around the limit
            self._make(root / own.lstrip("/"), {"memory.limit_in_bytes": limit},
                       {"memory.memsw.limit_in_bytes": limit})
            return
        unified = pids.dir if pids is not None else None
        if unified is None or not (unified / "memory.max").exists():
            return  # no v2 memory controller delegated to the run's directory
        try:
            (unified / "memory.max").write_text(str(limit))
            if (unified / "memory.swap.max").exists():
                (unified / "memory.swap.max").write_text("0")
        except OSError:
            return
        self.dir, self.shared, self.EVENTS = unified, True, ("memory.events", "oom_kill")

    @property
    def procs_file(self) -> str | None:
        return None if self.shared else super().procs_file  # the pids directory's, joined already

    def remove(self) -> None:
        if not self.shared:
            super().remove()


def kill_run(proc: subprocess.Popen, cgroup: PidsCgroup, memory: MemoryCgroup) -> None:
    """SIGKILL every process of the run until none is left (a fork bomb refills while we kill: loop)."""
    sid = proc.pid
    for _ in range(400):
        proc.poll()  # reap the child itself, so it does not linger as a zombie
        pids = set(cgroup.pids()) | set(memory.pids()) | set(session_pids(sid))
        if not pids:
            return
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


class CappedPipe:
    """Drains a pipe on a thread, keeping the first ``cap`` bytes (and counting the rest)."""

    def __init__(self, stream: int, cap: int) -> None:
        self.buf = bytearray()
        self.cap = cap
        self.total = 0
        self.fd = stream
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.total += len(chunk)
            room = self.cap - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
        os.close(self.fd)

    def text(self) -> str:
        self.thread.join(timeout=2)
        return self.buf.decode("utf-8", "replace")

    @property
    def truncated(self) -> bool:
        return self.total > self.cap
