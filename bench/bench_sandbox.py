"""Cost of one sandboxed code check (posttrain/sandbox.py) with and without the kernel containment: the private
mount namespace + PID namespace (private_filesystem) and the pids + memory cgroups (use_cgroup).

    PYTHONPATH=. python bench/bench_sandbox.py [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from posttrain.sandbox import SandboxLimits, run_python

CODE = "def square(x):\n    return x * x\n"
TESTS = ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    a = p.parse_args()
    print(f"{platform.platform()} · python {platform.python_version()} · {os.cpu_count()} CPUs · "
          f"load {os.getloadavg()[0]:.1f} · root {os.geteuid() == 0}")
    print("| private filesystem + PID namespace | cgroups (pids, memory) | ms per check (median) | in force |")
    print("| --- | --- | --- | --- |")
    for private, cgroups in ((True, True), (False, True), (False, False)):
        lim = SandboxLimits(private_filesystem=private, use_cgroup=cgroups, containment="best_effort")
        run_python(CODE, TESTS, lim)  # warm the page cache
        times, r = [], None
        for _ in range(a.runs):
            t = time.perf_counter()
            r = run_python(CODE, TESTS, lim)
            times.append(time.perf_counter() - t)
            assert r.tests_passed == 3, r
        times.sort()
        print(f"| {private} | {cgroups} | {times[len(times) // 2] * 1000:.0f} | filesystem {r.filesystem}, "
              f"pid namespace {r.pid_namespace}, memory {r.memory_limit}, processes {r.process_limit} |")


if __name__ == "__main__":
    main()
