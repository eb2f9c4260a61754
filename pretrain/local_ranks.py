"""Start the ranks of a one-machine training job: ``python -m pretrain.local_ranks N -m pretrain.train --config C``
runs ``python -m pretrain.train --config C`` N times, each with ``RANK``/``LOCAL_RANK``, ``WORLD_SIZE``/
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and one free ``MASTER_PORT``. The launcher binds that port
itself and hands the listening socket to rank 0 (``HYLIGHT_STORE_FD``), so two jobs started at once on one
machine cannot be given the same port: with a port only looked up free and bound later, two concurrent
sequence-parallel stages once drew the same one, and one job's rank joined the other's store (one failed, the
other trained on with a stranger's rank: issue 34's CPU rehearsal of dags/lasp-gpu.yaml). So rank 0 must serve
the store on that socket (``pretrain.train.init_distributed`` does); a rank 0 that opens its own store on
``MASTER_PORT`` finds the port taken.

In place of ``torchrun --standalone``, whose agent opens two rendezvous stores listening on every interface: here
rank 0 hosts the only store, on loopback (:func:`pretrain.train.init_distributed`), so a local run is not reachable
from the network. The first rank to fail stops the others (SIGTERM, then SIGKILL after a grace period) and the
launcher exits with its status; a SIGTERM or SIGINT to the launcher is passed on to every rank.

Standard library only: the launcher should not spend seconds importing torch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

LOOPBACK = "127.0.0.1"
GRACE_S = 10.0
STORE_FD_ENV = "HYLIGHT_STORE_FD"  # rank 0's inherited listening socket for the store (pretrain/train.py)


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel picks it); the store's server binds it moments later."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def listening_loopback_socket() -> socket.socket:
    """A socket bound to a port the kernel picks on 127.0.0.1 and listening: the port is this job's from now on."""
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    return sock


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torch.distributed's env:// rendezvous and :func:`pretrain.train.init_distributed` read."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)}


def run_ranks(world: int, args: list[str]) -> int:
    """Run ``python *args`` as ranks 0..world-1 until all exit; the first failed rank's status, else 0 (a rank
    killed by a signal gives 128 + its number, as a shell reports it)."""
    with listening_loopback_socket() as sock:  # held until rank 0 has its own copy: no other job can take the port
        port, fd = sock.getsockname()[1], sock.fileno()
        ranks = [subprocess.Popen([sys.executable, *args], pass_fds=(fd,) if r == 0 else (),
                                  env={**os.environ, **rank_env(r, world, port),
                                       **({STORE_FD_ENV: str(fd)} if r == 0 else {})})
                 for r in range(world)]

    def stop(*_: object) -> None:
        for p in ranks:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status, deadline = 0, None
    while [p for p in ranks if p.poll() is None]:  # polls every rank (any() would stop at the first live one)
        failed = [p.returncode for p in ranks if p.returncode not in (None, 0)]
        if failed and deadline is None:  # the others would wait on the failed rank until the store's timeout
            status, deadline = failed[0], time.monotonic() + GRACE_S
            stop()
        if deadline is not None and time.monotonic() > deadline:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    status = status or next((p.returncode for p in ranks if p.returncode), 0)
    return 128 - status if status < 0 else status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python -m pretrain.local_ranks N <python args: -m module ... | script.py ...>", file=sys.stderr)
        return 2
    return run_ranks(int(argv[0]), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
