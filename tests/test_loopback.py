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


SUM_RANK = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    from pretrain.train import _loopback_store

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=_loopback_store(rank, world), rank=rank, world_size=world)
    value = float(sys.argv[1])
    for _ in range(20):
        t = torch.tensor([value])
        dist.all_reduce(t)
        assert t.item() == value * world, f"job {value}: all-reduce gave {t.item()}, another job's rank joined"
    dist.destroy_process_group()
""")


def test_two_jobs_started_at_once_keep_their_own_stores_even_if_a_port_lookup_repeats(tmp_path: Path) -> None:
    """Two 2-rank jobs started at once on one machine, each all-reducing its own value, with the port lookup
    (``free_loopback_port``) made to give both the same port, as the kernel can: two concurrent sequence-parallel
    stages of the lasp-gpu rehearsal drew one port, and one failed while the other trained with the stranger's rank.
    The launcher no longer looks a port up: it binds one and gives the listening socket to rank 0, so each job
    keeps its own store (with the lookup, as before, this test fails)."""
    import socket

    rank = tmp_path / "sum_rank.py"
    rank.write_text(SUM_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = (f"import sys; import pretrain.local_ranks as lr; lr.free_loopback_port = lambda: {port}; "
                "sys.exit(lr.main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    jobs = [subprocess.Popen([sys.executable, "-c", launcher, "2", str(rank), value], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for value in ("1", "100")]
    outs = [job.communicate(timeout=240)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(o[-2000:] for o in outs)
