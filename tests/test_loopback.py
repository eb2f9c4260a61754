"""A local training run listens on loopback only (README, 'Environment'): the process group that
``pretrain.train.init_distributed`` sets up, alone or under ``pretrain.local_ranks``, opens no socket on 0.0.0.0 or
``::`` (torch's own TCPStore server, and torchrun's agent, listen on every interface).

Each probe is a fresh process (a process group cannot be torn down and set up again cleanly in pytest's): it runs the
stage's init, then lists every TCP listener of its job from /proc/net/tcp{,6}, matched by socket inode to the job's
file descriptors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent("""
    import json, os, socket
    import torch.distributed as dist
    from pretrain.train import init_distributed

    def job_pids(world):
        if world == 1:
            return [os.getpid()]
        launcher = os.getppid()  # pretrain.local_ranks: its children are the ranks
        children = []
        for task in os.listdir(f"/proc/{launcher}/task"):
            children += open(f"/proc/{launcher}/task/{task}/children").read().split()
        return [launcher, *map(int, children)]

    def address(hex_addr, family):
        raw = bytes.fromhex(hex_addr)  # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order
        return socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))

    def listeners(pids):
        inodes = set()
        for pid in pids:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        found = []
        for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
            for row in open(table).read().splitlines()[1:]:
                f = row.split()
                if f[3] == "0A" and f[9] in inodes:  # state 0A: LISTEN
                    host, port = f[1].split(":")
                    found.append([address(host, family), int(port, 16)])
        return found

    rank, world, _ = init_distributed()
    dist.barrier()  # every rank's listeners are open
    if rank == 0:
        print("LISTENERS " + json.dumps(listeners(job_pids(world))), flush=True)
    dist.barrier()
""")


def _listeners_of(cmd: list[str], tmp_path: Path) -> list[list]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
                        "NCCL_SOCKET_IFNAME", "TORCHELASTIC_USE_AGENT_STORE"}}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("LISTENERS "))
    return json.loads(line[len("LISTENERS "):])


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_local_training_process_group_listens_on_loopback_only(ranks: int, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    launch = [sys.executable, str(probe)] if ranks == 1 else [sys.executable, "-m", "pretrain.local_ranks", "2",
                                                                str(probe)]
    found = _listeners_of(launch, tmp_path)
    assert found, "the probe saw no listener at all: the store's server should be one"
    assert all(host in ("127.0.0.1", "::1") for host, _ in found), f"listeners off loopback: {found}"


def test_local_ranks_stops_the_other_ranks_when_one_fails_and_exits_with_its_status() -> None:
    rank = "import os, sys, time; sys.exit(7) if os.environ['RANK'] == '1' else time.sleep(120)"
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pretrain.local_ranks", "3", "-c", rank], cwd=REPO, timeout=60)
    assert out.returncode == 7
    assert time.monotonic() - start < 30  # ranks 0 and 2 were stopped, not waited for
