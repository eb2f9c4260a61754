"""Does this machine contain the code sandbox? Runs the containment attacks of tests/test_sandbox.py against
``posttrain.sandbox.run_python`` on this host (no pytest needed: for lent GPU machines) and prints one JSON line per
attack with the fields the result records (filesystem, pid_namespace, memory_limit, process_limit, network_mode).

    python bench/check_sandbox_host.py              # containment "require": a missing piece is refused by name
    HYLIGHT_SANDBOX_CONTAINMENT=best_effort python bench/check_sandbox_host.py

Exit code 0 when every attack was contained, 1 otherwise (2: the sandbox refused to run here, with the reason).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.sandbox import SandboxLimits, SandboxUnavailable, run_python  # noqa: E402

ATTACKS = {
    # 4 processes x 200 MiB under a 512 MiB limit: a per-process cap (RLIMIT_AS) lets all four hold theirs
    "memory_whole_run": (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n        break\n"
        "block = bytearray(200 << 20)\n"
        "for i in range(0, len(block), 4096):\n    block[i] = 1\n"
        "time.sleep(2)\n"
        "print('held')\n",
        SandboxLimits(memory_bytes=512 << 20, wall_seconds=8),
        lambda r: r.status == "memory" and r.stdout.count("held") < 3 and r.leftover_processes == 0,
    ),
    "tmp_does_not_persist": (
        "open('/tmp/hylight-sandbox-probe', 'w').write('x')\nopen('/dev/shm/hylight-sandbox-probe', 'w').write('x')\n",
        SandboxLimits(),
        lambda r: r.status == "ok" and not any(Path(p, "hylight-sandbox-probe").exists() for p in ("/tmp", "/dev/shm")),
    ),
    "setsid_grandchild_dies": (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n        time.sleep(30)\n    os._exit(0)\n"
        "time.sleep(0.3)\n",
        SandboxLimits(),
        lambda r: r.leftover_processes == 0 and r.pid_namespace,
    ),
    "project_hidden": (
        f"import os\nprint(os.listdir({str(Path(__file__).resolve().parents[1])!r}))\n",
        SandboxLimits(),
        lambda r: r.stdout.strip() == "[]",
    ),
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        SandboxLimits(wall_seconds=3, max_processes=16),
        lambda r: r.status != "ok" and r.leftover_processes == 0,
    ),
    "network": (
        "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 80))\nprint('connected')\n",
        SandboxLimits(),
        lambda r: "connected" not in r.stdout,
    ),
}


def main() -> int:
    contained = True
    for name, (code, limits, ok) in ATTACKS.items():
        for p in ("/tmp", "/dev/shm"):
            Path(p, "hylight-sandbox-probe").unlink(missing_ok=True)
        t0 = time.perf_counter()
        try:
            r = run_python(code, [], limits)
        except SandboxUnavailable as e:
            print(json.dumps({"attack": name, "refused": str(e)}))
            return 2
        good = bool(ok(r))
        contained &= good
        print(json.dumps({"attack": name, "contained": good, "status": r.status, "seconds": round(time.perf_counter()
                          - t0, 3), "filesystem": r.filesystem, "pid_namespace": r.pid_namespace,
                          "memory_limit": r.memory_limit, "process_limit": r.process_limit,
                          "network_mode": r.network_mode, "leftover_processes": r.leftover_processes,
                          "error": r.error[:160]}))
    print(json.dumps({"host": os.uname().nodename, "euid": os.geteuid(), "all_contained": contained}))
    return 0 if contained else 1


if __name__ == "__main__":
    sys.exit(main())
