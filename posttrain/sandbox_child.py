"""The sandboxed child (run by :mod:`posttrain.sandbox` as ``python -I -S -B sandbox_child.py JOB RESULT_FD``).

Everything here runs *before* the untrusted code, with the parent's privileges; the order matters:

1. join the per-run cgroups (pids: the fork-bomb limit; memory: one limit for every process of the run), while
   still allowed to write to them;
2. leave the network: a fresh network namespace (``unshare(CLONE_NEWNET)``: no interface but a down loopback),
   or, for an unprivileged user, a user + network namespace; when neither is permitted, an in-process guard that
   makes every socket call fail (weaker: code that reaches libc through ctypes or execs a program bypasses it);
3. import the standard-library modules responses may use (after step 4 the interpreter's files may be unreadable);
3b. (root) a private mount namespace: size-capped tmpfs on ``/tmp`` and ``/dev/shm`` (gone when the run ends),
   and an empty read-only tmpfs over each hidden directory (the project, the caller's working and home
   directories); then a PID namespace: this process forks the namespace's init, which mounts its own ``/proc``
   (other processes are invisible) and forks the process that runs the code. When the init exits, the kernel
   kills every process left in the namespace, double-forked and ``setsid`` ones included;
4. when running as root, drop to an unprivileged uid/gid (the code cannot touch others' files or signal their
   processes, and RLIMIT_NPROC, which root ignores, applies);
5. resource limits: address space, CPU seconds, file size, open files, processes, no core dumps;
6. run the response's code, then evaluate each test expression in the same namespace and send its value as JSON,
   one line per event on RESULT_FD. The expected values are not here. The parent compares, so nothing this process
   writes is a verdict.

Standard library only: the child starts with ``-S`` (no site-packages).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
# imported before privileges drop, so responses can use them (report §5.2 programming tasks need no more)
PRELOAD = ("math", "re", "string", "collections", "itertools", "functools", "heapq", "bisect", "operator",
           "random", "statistics", "fractions", "decimal", "typing", "dataclasses", "socket", "time", "copy",
           "array", "enum", "textwrap", "unicodedata", "encodings.idna")


def _emit(fd, obj):
    try:
        os.write(fd, (json.dumps(obj) + "\n").encode())
    except (OSError, ValueError, MemoryError):
        pass


def _leave_network(libc, want):
    if want == "namespace":
        if libc.unshare(CLONE_NEWNET) == 0:
            return "namespace"
        if os.geteuid() != 0 and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            return "user_namespace"
    _install_socket_guard()
    return "guard"


def _install_socket_guard():
    import socket  # only in the sandboxed child, before the untrusted code

    def refuse(*_a, **_k):
        raise PermissionError("network access is disabled in the sandbox")

    class NoSocket(socket.socket):
        def __init__(self, *a, **k):
            refuse()

    socket.socket = NoSocket
    for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo", "gethostbyname"):
        setattr(socket, name, refuse)
    import _socket  # the C module too: code could reach it directly

    _socket.socket = NoSocket


CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 16384, 1 << 18


def _mount(libc, source, target, fstype, flags, data):
    if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                  data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


def _private_filesystem(libc, job):
    """A mount namespace of private tmpfs /tmp and /dev/shm and hidden directories: "private", else "shared"."""
    if os.geteuid() != 0 or not job["private_filesystem"] or libc.unshare(CLONE_NEWNS) != 0:
        return "shared"
    _mount(libc, "none", "/", None, MS_REC | MS_PRIVATE, None)  # nothing mounted here reaches the host
    for target in ("/tmp", "/dev/shm"):
        if os.path.isdir(target):
            _mount(libc, "tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['tmp_bytes']},mode=1777")
    for path in job["hide"]:
        if os.path.isdir(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    os.chdir("/tmp")
    return "private"


def _die_of(sig):
    """End this process by ``sig``. SIGKILL and SIGSTOP take no handler (setting one raises, which would end the
    process with exit code 1 instead: a CPU-limit kill then read as an error, not a timeout)."""
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


def _reraise(status):
    """Exit as the waited-for process did: the parent reads a signal death as -signal."""
    if os.WIFSIGNALED(status):
        _die_of(os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _pid_namespace(libc, filesystem):
    """Fork into a new PID namespace; returns in the process that runs the code (True), or False when none."""
    if os.geteuid() != 0 or filesystem != "private" or libc.unshare(CLONE_NEWPID) != 0:
        return False
    init = os.fork()
    if init:  # outside the namespace: wait for its init and end as the worker ended
        status = os.waitpid(init, 0)[1]
        code = os.waitstatus_to_exitcode(status)
        if 128 < code < 128 + signal.NSIG:  # init's 128+sig: die of sig (the parent maps -SIGXCPU to "timeout")
            _die_of(code - 128)
        _reraise(status)
    _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)  # only this namespace's pids
    worker = os.fork()
    if worker:  # the namespace's init: reap orphans until the worker ends, then end (the kernel kills the rest)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == worker:
                # init ignores the signals it has no handler for, even its own: a death by signal leaves as 128+sig
                os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status))
    return True


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        job = json.load(f)
    fd = int(sys.argv[2])
    libc = ctypes.CDLL(None, use_errno=True)
    for procs in job["cgroup_procs"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    network = _leave_network(libc, job["network"])
    for name in PRELOAD:
        __import__(name)
    filesystem = _private_filesystem(libc, job)
    pid_namespace = _pid_namespace(libc, filesystem)
    if os.geteuid() == 0 and job["drop_to_uid"] is not None:
        os.setgroups([])
        os.setgid(job["drop_to_uid"])
        os.setuid(job["drop_to_uid"])
    lim = job["limits"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_seconds"], lim["cpu_seconds"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
    if job["nproc"] is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (job["nproc"], job["nproc"]))
    if job["require"]:  # refuse before the code runs, rather than run it with less than was asked
        missing = [what for asked, have, what in (
            (job["network"] == "namespace", network != "guard", "a network namespace"),
            (job["private_filesystem"], filesystem == "private", "a mount namespace"),
            (job["private_filesystem"], pid_namespace, "a PID namespace")) if asked and not have]
        if missing:
            _emit(fd, {"event": "refused", "missing": missing})
            return
    _emit(fd, {"event": "start", "network": network, "uid": os.geteuid(), "filesystem": filesystem,
               "pid_namespace": pid_namespace})
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    expressions = job["expressions"]
    code = job["code"]
    dumps = json.dumps  # bound before the response runs (it could replace json.dumps, but not this name)
    del job  # nothing of the job but what the code needs stays reachable by name
    try:
        exec(compile(code, "<response>", "exec"), ns)  # noqa: S102 -- this process is the sandbox
        _emit(fd, {"event": "code", "ok": True})
    except MemoryError:
        _emit(fd, {"event": "memory"})
        return
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: a response must not end the run
        _emit(fd, {"event": "code", "ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
        return
    for i, expression in enumerate(expressions):
        try:
            value = eval(compile(expression, f"<test {i}>", "eval"), ns)  # noqa: S307 -- this process is the sandbox
            # plain data only: JSON has no place for an object that compares equal to anything
            _emit(fd, {"event": "value", "index": i, "json": dumps(value, sort_keys=True, allow_nan=True)})
        except MemoryError:
            _emit(fd, {"event": "memory"})
            return
        except BaseException as e:
            _emit(fd, {"event": "value", "index": i, "error": f"{type(e).__name__}: {e}"[:300]})
    _emit(fd, {"event": "done"})


if __name__ == "__main__":
    main()
