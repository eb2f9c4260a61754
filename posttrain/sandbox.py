"""Run untrusted Python (a response's code + its test cases) in a limited subprocess (report §5.2, Correctness:
"programming solutions undergo comprehensive testing in a secured sandbox environment, with performance metrics
derived from test case success rates").

:func:`run_python` starts ``python -I -S -B posttrain/sandbox_child.py`` in a fresh session (its own process group)
and a temporary working directory that is removed afterwards. The child (see its docstring) joins a pids cgroup,
leaves the network, drops root, sets its rlimits and then runs the code and the tests, one JSON line per event on a
private pipe. The parent enforces what the child cannot enforce on itself:

* **wall time**: past ``wall_seconds`` every process of the run is killed (status ``timeout``); CPU time is the
  child's RLIMIT_CPU (SIGXCPU, also ``timeout``);
* **processes**: the child's pids cgroup caps the tasks at ``max_processes`` (when a pids cgroup is writable, v1 or
  v2); when not, and not root, RLIMIT_NPROC does (root ignores it; the child drops root first when it can). A
  watchdog polls the count (cgroup, else ``/proc`` for the run's session and process group) every few ms and kills
  the run when the cap is reached (status ``killed``) — a fork bomb is stopped at once, not at the time limit;
* **output**: stdout/stderr are drained continuously and only the first ``output_bytes`` are kept
  (``output_truncated``); RLIMIT_FSIZE caps files written;
* **cleanup**: at the end every process of the cgroup, session and process group is SIGKILLed and waited for, the
  cgroup and the temporary directory are removed, and ``leftover_processes`` (re-counted afterwards) is reported.

(The cgroups, the ``/proc`` accounting, the kill and the capped output are :mod:`posttrain.sandbox_processes`.)

Statuses: ``ok`` (the code ran and every reported test finished, passed or not), ``error`` (the code raised or the
child died before finishing), ``timeout``, ``memory`` (MemoryError under the address-space limit), ``killed`` (the
process cap). Which isolation was in force is in the result: ``network_mode`` (``namespace``, ``user_namespace`` or
``guard``), ``process_limit`` (``cgroup``, ``rlimit`` or ``watchdog``), ``uid``.

**The verdict is the parent's.** A test is an ``assert`` statement of one of the forms ``assert CALL == LITERAL``
(either side may be the literal), ``assert CALL is None``, ``assert CALL`` (expects ``True``) or ``assert not CALL``
(expects ``False``); :func:`parse_tests` splits each into the expression the child evaluates and the value the parent
expects. Only the expressions enter the sandbox. The child sends back each value as JSON. The parent compares that
with the expected value as plain data, as Python's ``==`` would (``3.0`` equals ``3``) except that a bool equals
only a bool (``1`` is not ``True``): :func:`_same`. So the response cannot read the
expected values, because they are never in its process. It cannot forge a pass by writing "passed" on the result
pipe, because the parent reads values there, not verdicts. And an object whose ``__eq__`` always says True is not
plain data, so it fails. A response can still write values on the pipe in place of its function's, but it must know
the right ones to gain anything, which is solving the task.

**Containment by the kernel**, as root (what the result records: ``filesystem``, ``pid_namespace``,
``memory_limit``). The run has a private mount namespace. ``/tmp`` and ``/dev/shm`` are its own size-capped tmpfs,
gone when it ends. The project, the caller's working directory and home directory (where the artifacts, the
prompts' reference answers among them, usually live) are empty and read-only to it. A PID namespace hides every
other process. When the run ends, the kernel kills whatever it left behind, double-forked ``setsid`` processes
included. A memory cgroup caps the whole run's memory, tmpfs pages included: RLIMIT_AS alone caps each process.

What a machine without these gets, reported in the same fields rather than refused: not root, or no mount
namespace, leaves the host's filesystem (``filesystem="shared"``: world-readable files are readable, and
``/tmp`` writes outlive the run) and process table. No writable memory cgroup (v1 ``memory`` hierarchy, or v2
with the memory controller) leaves RLIMIT_AS per process (``memory_limit="rlimit"``). The "guard" network mode
blocks Python's socket module but not libc called through ctypes. ``SandboxLimits(private_filesystem=False, use_cgroup=False, network="guard")`` runs
those fallbacks on purpose.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from posttrain.sandbox_processes import CappedPipe, MemoryCgroup, PidsCgroup, kill_run, session_pids

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
NOBODY_UID = 65534
Status = Literal["ok", "error", "timeout", "memory", "killed"]


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 << 20  # address space (RLIMIT_AS): the interpreter itself takes ~30 MiB of it
    max_processes: int = 32  # tasks in the run, the child included
    output_bytes: int = 64 << 10  # kept of each of stdout and stderr
    file_bytes: int = 16 << 20
    open_files: int = 64
    network: Literal["namespace", "guard"] = "namespace"  # guard: skip the namespace (tests of the fallback)
    # root: a private mount namespace (tmpfs /tmp and /dev/shm of tmp_bytes each, hidden directories) and a PID
    # namespace. False: the host's filesystem and process table (tests of the fallback)
    private_filesystem: bool = True
    tmp_bytes: int = 64 << 20
    hide_paths: tuple[str, ...] = ()  # besides the project, the working directory and the home directory
    drop_privileges: bool = True  # when running as root: run the code as nobody (65534)
    use_cgroup: bool = True  # False: RLIMIT_NPROC (or, as root keeping root, the watchdog alone) caps processes
    poll_seconds: float = 0.01
    # "require": what the fields above ask for must be in force, else SandboxUnavailable before the code runs;
    # "best_effort": fall back and report it (filesystem, pid_namespace, memory_limit, network_mode). The default
    # comes from HYLIGHT_SANDBOX_CONTAINMENT (unset: require), so a pipeline run opts in from its environment
    containment: Literal["require", "best_effort"] = field(default_factory=lambda: _default_containment())


CONTAINMENT_ENV = "HYLIGHT_SANDBOX_CONTAINMENT"


def _default_containment() -> Literal["require", "best_effort"]:
    value = os.environ.get(CONTAINMENT_ENV, "require")
    if value not in ("require", "best_effort"):
        raise ValueError(f"{CONTAINMENT_ENV}={value!r}: use require (the default) or best_effort")
    return value  # type: ignore[return-value]


# what this process's runs had since the last containment_record(): field -> values seen, and how many runs
_SEEN: dict[str, set[str]] = {}
_RUNS = [0]
_SEEN_LOCK = threading.Lock()
_RECORDED = ("filesystem", "pid_namespace", "memory_limit", "process_limit", "network_mode")


def containment_record() -> dict[str, str]:
    """The containment the sandbox's runs in this process had since the last call, which it then forgets: the mode
    asked for (``HYLIGHT_SANDBOX_CONTAINMENT``), the number of runs, and each recorded field's values across them
    (``filesystem: "private"``, or ``"private,shared"`` if some ran weaker). Stages that check code put it in their
    report and their MLflow tags, so a ``best_effort`` run is visible beside the numbers it produced."""
    with _SEEN_LOCK:
        out = {"containment": _default_containment(), "runs": str(_RUNS[0])}
        out |= {f: ",".join(sorted(_SEEN[f])) for f in _RECORDED if f in _SEEN}
        _SEEN.clear()
        _RUNS[0] = 0
    return out


def record_sandbox(ctx) -> dict[str, str]:
    """End of a stage that checked code: its ``containment_record()`` as MLflow tags (``hylight.sandbox.*``) and
    returned for the stage's report."""
    record = containment_record()
    ctx.set_tags({f"hylight.sandbox.{k}": v for k, v in record.items()})
    return record


def _note_containment(result: SandboxResult) -> None:
    with _SEEN_LOCK:
        _RUNS[0] += 1
        for f in _RECORDED:
            _SEEN.setdefault(f, set()).add(str(getattr(result, f)).lower())


class SandboxUnavailable(RuntimeError):
    """The containment asked for cannot be set up here; the message names what is missing and the opt-out."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__(
            "sandbox: refusing to run untrusted code without " + "; ".join(missing) + ". Run as root on a Linux "
            "machine that has them, or accept weaker containment explicitly with "
            f"{CONTAINMENT_ENV}=best_effort (each check's reason then names what was in force)")
        self.missing = list(missing)

    def __reduce__(self):  # rebuilt from the list, not the message (a Ray worker's error reaches the driver pickled)
        return type(self), (self.missing,)


@dataclass
class SandboxResult:
    status: Status
    tests_total: int
    tests_passed: int
    test_errors: list[str | None] = field(default_factory=list)  # per test: None (passed) or why it failed
    error: str = ""  # the code's exception, or why the run was stopped
    stdout: str = ""
    stderr_tail: str = ""
    output_truncated: bool = False
    network_mode: str = "unknown"
    process_limit: str = "watchdog"
    memory_limit: str = "rlimit"  # "cgroup": one limit for the whole run; "rlimit": per process only
    filesystem: str = "shared"  # "private": own /tmp, /dev/shm, hidden directories (see SandboxLimits)
    pid_namespace: bool = False
    uid: int | None = None
    returncode: int | None = None
    wall_seconds: float = 0.0
    peak_processes: int = 0
    leftover_processes: int = 0

    @property
    def pass_rate(self) -> float:
        return self.tests_passed / self.tests_total if self.tests_total else 0.0


# --- tests as (expression, expected value) -----------------------------------------------------------------------
@dataclass(frozen=True)
class SandboxCase:
    expression: str  # evaluated in the sandbox, after the response's code
    expected: object  # plain data; never sent to the sandbox


def parse_tests(tests: list[str] | tuple[str, ...]) -> list[SandboxCase]:
    """Each ``assert`` statement as a :class:`SandboxCase` (forms in the module docstring); ValueError names the first
    statement of another form."""
    return [_test_case(t, i) for i, t in enumerate(tests)]


def _test_case(test: str, index: int) -> SandboxCase:
    form = ("assert EXPR == LITERAL, assert LITERAL == EXPR, assert EXPR is None, assert EXPR or assert not EXPR "
            "(LITERAL: a Python literal such as 4, 'ab', [1, 2], None)")
    try:
        body = ast.parse(test).body
    except SyntaxError as e:
        raise ValueError(f"test {index}: not valid Python ({e.msg}); a test is one of: {form}") from None
    if len(body) != 1 or not isinstance(body[0], ast.Assert) or body[0].msg is not None:
        raise ValueError(f"test {index}: {test[:80]!r} is not a single assert statement; a test is one of: {form}")
    expr = body[0].test
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        left, right = expr.left, expr.comparators[0]
        if isinstance(expr.ops[0], ast.Eq):
            for call, want in ((left, right), (right, left)):
                value = _literal(want)
                if value is not _NOT_LITERAL:
                    return SandboxCase(ast.unparse(call), value)
            raise ValueError(f"test {index}: {test[:80]!r} compares two expressions; one side must be a literal: "
                             f"{form}")
        if isinstance(expr.ops[0], ast.Is) and _literal(right) is None:
            return SandboxCase(ast.unparse(left), None)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return SandboxCase(ast.unparse(expr.operand), False)
    return SandboxCase(ast.unparse(expr), True)


_NOT_LITERAL = object()


def _literal(node: ast.AST) -> object:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL
    try:
        canonical_json(value)
    except (TypeError, ValueError):  # a set, bytes or complex literal has no plain-data form
        return _NOT_LITERAL
    return value


def canonical_json(value: object) -> str:
    """The comparison form of a test's value: JSON with sorted keys. It tells 1, 1.0 and True apart, and a tuple
    equals the list of the same items, since JSON has no tuples."""
    return json.dumps(value, sort_keys=True, allow_nan=True)


# --- the run's surroundings -------------------------------------------------------------------------------
def _hidden_paths(lim: SandboxLimits) -> list[str]:
    """Directories the sandbox sees as empty: the project, the working and home directories and the limits'
    extra ones, except any that holds the standard library (imports after the preload still need it)."""
    project = Path(__file__).resolve().parents[1]
    stdlib = Path(os.__file__).resolve().parent
    out: list[str] = []
    for p in (project, Path.cwd(), Path.home(), *map(Path, lim.hide_paths)):
        p = p.resolve()
        if p == Path("/") or stdlib.is_relative_to(p) or str(p) in out:
            continue
        out.append(str(p))
    return out


# --- the run ----------------------------------------------------------------------------------------------------
def run_python(code: str, tests: list[str] | tuple[str, ...] = (), limits: SandboxLimits | None = None,
               ) -> SandboxResult:
    """Run ``code``, then evaluate each test's expression in the same sandboxed interpreter. The parent compares
    the values with the tests' expected values, which never enter the sandbox (see the module docstring). A test
    of another form raises ValueError before anything runs."""
    lim = limits or SandboxLimits()
    cases = parse_tests(tests)
    root = os.geteuid() == 0
    drop_uid = NOBODY_UID if (root and lim.drop_privileges) else None
    workdir = Path(tempfile.mkdtemp(prefix="hylight-sandbox-"))
    cgroup = PidsCgroup(lim.max_processes if lim.use_cgroup else None)
    if cgroup.dir:
        process_limit = "cgroup"
    elif not root or drop_uid is not None:
        process_limit = "rlimit"
    else:
        process_limit = "watchdog"
    nproc = None
    if process_limit == "rlimit":  # RLIMIT_NPROC counts every process of the uid, not of this run
        nproc = lim.max_processes + (0 if drop_uid is not None else _user_process_count(os.getuid()))
    memory = MemoryCgroup(lim.memory_bytes if lim.use_cgroup else None, cgroup)
    missing = [what for asked, have, what in (
        (lim.use_cgroup, cgroup.dir, "a writable pids cgroup (v1 /sys/fs/cgroup/pids, or v2 with the pids controller)"),
        (lim.use_cgroup, memory.dir, "a writable memory cgroup (v1 /sys/fs/cgroup/memory, or v2 with the memory controller)"),
        (lim.private_filesystem, root, "root (for the mount and PID namespaces)")) if asked and not have]
    if missing and lim.containment == "require":
        cgroup.remove()
        memory.remove()
        shutil.rmtree(workdir, ignore_errors=True)
        raise SandboxUnavailable(missing)
    job = {"code": code, "expressions": [c.expression for c in cases], "network": lim.network,
           "cgroup_procs": [f for f in (cgroup.procs_file, memory.procs_file) if f],
           "private_filesystem": lim.private_filesystem, "tmp_bytes": lim.tmp_bytes, "hide": _hidden_paths(lim),
           "require": lim.containment == "require",
           "drop_to_uid": drop_uid, "nproc": nproc,
           "limits": {"memory_bytes": lim.memory_bytes, "cpu_seconds": max(1, int(lim.cpu_seconds)),
                      "file_bytes": lim.file_bytes, "open_files": lim.open_files}}
    job_file = workdir / "job.json"
    job_file.write_text(json.dumps(job))
    if drop_uid is not None:
        os.chown(workdir, drop_uid, drop_uid)
        os.chmod(job_file, 0o600)  # the job stays root's: read by the child before it drops root
    res_r, res_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    stopped: str | None = None
    peak = 0
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(CHILD_SCRIPT), str(job_file), str(res_w)],
            cwd=workdir, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, pass_fds=(res_w,),
            start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir)},
        )
    finally:
        for fd in (res_w, out_w, err_w):
            os.close(fd)
    results = CappedPipe(res_r, 1 << 20)
    out = CappedPipe(out_r, lim.output_bytes)
    err = CappedPipe(err_r, lim.output_bytes * 4)
    sid = proc.pid
    try:
        while proc.poll() is None:
            if time.monotonic() - start > lim.wall_seconds:
                stopped = "timeout"
                break
            count = len(cgroup.pids()) if cgroup.dir else len(session_pids(sid))
            peak = max(peak, count)
            if count >= lim.max_processes or cgroup.hit_limit():
                stopped = "killed"
                break
            time.sleep(lim.poll_seconds)
    finally:
        kill_run(proc, cgroup, memory)
        proc.wait()
    wall = time.monotonic() - start
    leftover = len(set(cgroup.pids()) | set(memory.pids()) | set(session_pids(sid)))
    if memory.hit_limit():
        stopped = "memory"
    cgroup.remove()
    memory.remove()
    events = [_parse(line) for line in results.text().splitlines()]
    shutil.rmtree(workdir, ignore_errors=True)
    refused = next((e for e in events if e.get("event") == "refused"), None)
    if refused is not None:  # the child could not set up what was asked, and did not run the code
        raise SandboxUnavailable([str(m) for m in refused.get("missing", [])] or ["the requested containment"])
    return _result(events, cases, proc.returncode, stopped, out, err, lim, process_limit, wall, peak, leftover,
                   "cgroup" if memory.dir else "rlimit")


def _user_process_count(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                n += entry.stat().st_uid == uid
            except OSError:
                pass
    return n


def _parse(line: str) -> dict:
    try:
        obj = json.loads(line)
        return obj if isinstance(obj, dict) else {}
    except ValueError:
        return {}


def _same(got: object, want: object) -> bool:
    """Python's ``==`` on plain data, as ``assert EXPR == LITERAL`` would judge it, except that a bool equals only a
    bool (``True`` is not ``1`` here): an int and a float of the same value are equal (``3.0 == 3``), NaN equals
    nothing, lists and dicts compare element by element."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return got == want
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)
    return type(got) is type(want) and got == want


def _verdict(case: SandboxCase, event: dict) -> str | None:
    """None when the child's value for ``case`` equals its expected value (both as plain JSON data, compared by
    :func:`_same`), else why."""
    if "json" not in event:
        return str(event.get("error", "no value"))[:300]
    got, want = event["json"], canonical_json(case.expected)
    try:
        equal = isinstance(got, str) and _same(json.loads(got), json.loads(want))
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: not the expected value
        equal = False
    if not equal:
        return f"AssertionError: {case.expression[:80]} returned {str(got)[:80]}, expected {want[:80]}"
    return None


def _result(events: list[dict], cases: list[SandboxCase], returncode: int | None, stopped: str | None, out: CappedPipe,
            err: CappedPipe, lim: SandboxLimits, process_limit: str, wall: float, peak: int,
            leftover: int, memory_limit: str) -> SandboxResult:
    start = next((e for e in events if e.get("event") == "start"), {})
    errors: list[str | None] = ["not run"] * len(cases)
    seen: set[int] = set()
    for e in events:  # the first value event per index counts; the verdict is computed here, not reported
        i = e.get("index")
        if e.get("event") == "value" and isinstance(i, int) and 0 <= i < len(cases) and i not in seen:
            seen.add(i)
            errors[i] = _verdict(cases[i], e)
    code_event = next((e for e in events if e.get("event") == "code"), None)
    stderr = err.text()
    error = ""
    if stopped == "memory":  # the run's memory cgroup: its processes together reached the limit
        status: Status = "memory"
        error = f"memory limit ({lim.memory_bytes >> 20} MiB for the whole run) reached"
    elif any(e.get("event") == "memory" for e in events) or "MemoryError" in stderr:
        status = "memory"
        error = f"memory limit ({lim.memory_bytes >> 20} MiB address space) reached"
    elif stopped == "killed":
        status, error = "killed", f"process limit ({lim.max_processes}) reached: every process of the run killed"
    elif stopped == "timeout" or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        status = "timeout"
        error = (f"wall time limit ({lim.wall_seconds:g} s) reached" if stopped == "timeout"
                 else f"CPU time limit ({lim.cpu_seconds} s) reached")
    elif code_event is not None and not code_event.get("ok"):
        status, error = "error", str(code_event.get("error", "the code raised"))
    elif not any(e.get("event") == "done" for e in events):
        status, error = "error", f"the sandboxed interpreter ended early (exit code {returncode})"
    else:
        status = "ok"
    result = SandboxResult(
        status=status, tests_total=len(cases), tests_passed=sum(e is None for e in errors), test_errors=errors,
        error=error, stdout=out.text(), stderr_tail=stderr[-2000:], output_truncated=out.truncated or err.truncated,
        network_mode=str(start.get("network", "unknown")), process_limit=process_limit, memory_limit=memory_limit,
        filesystem=str(start.get("filesystem", "shared")), pid_namespace=start.get("pid_namespace") is True,
        uid=start.get("uid"), returncode=returncode, wall_seconds=round(wall, 3), peak_processes=peak,
        leftover_processes=leftover)
    _note_containment(result)
    return result
