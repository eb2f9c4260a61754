"""What artifact integrity costs: commit (sha256 + fsync of every file) and lookup (re-hash of every file).

Usage: python bench/bench_artifact_integrity.py [--gib 1] [--files 1 16] [--root /tmp/x] [--repeat 3]
Writes an artifact of ``--gib`` GiB of random bytes split into N files, commits it through the real
ArtifactStore, then times ``lookup`` with the files in the page cache (warm) and evicted from it (cold:
posix_fadvise DONTNEED on each file, nothing else on the machine is touched), and the old size-only check
for comparison. Prints a markdown table with the machine and versions. Min of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import ssl
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.artifacts import ArtifactStore, _hash_threads  # noqa: E402


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def size_only(store: ArtifactStore, kind: str, key: str) -> bool:
    """The pre-integrity lookup: every listed file present with its size."""
    art = store.path_for(kind, key)
    import json

    m = json.loads((art / "manifest.json").read_text())
    return all((art / f["path"]).stat().st_size == f["size"] for f in m["files"])


def bench(root: Path, gib: float, n_files: int, repeat: int) -> dict[str, float]:
    store = ArtifactStore(root)
    key = f"{n_files:02d}" * 32
    total = int(gib * (1 << 30))
    per = total // n_files
    block = os.urandom(1 << 20)
    best: dict[str, float] = {}
    for _ in range(repeat):
        tmp = store.begin("bench", key)
        for i in range(n_files):
            with open(tmp / f"part-{i:03d}.bin", "wb") as f:
                for off in range(0, per, len(block)):
                    f.write(block[: per - off] if off + len(block) > per else block)
                    block = block[1:] + block[:1]  # no two MiB alike
        t0 = time.perf_counter()
        art = store.commit(tmp, type_="blob", schema_version=1, kind="bench", key=key, meta={})
        t = {"commit (sha256 + fsync)": time.perf_counter() - t0}
        files = [art.path / f["path"] for f in art.manifest["files"]]
        t0 = time.perf_counter()
        assert store.lookup("bench", key) is not None
        t["lookup, warm cache"] = time.perf_counter() - t0
        evict(files)
        t0 = time.perf_counter()
        assert store.lookup("bench", key) is not None
        t["lookup, cold cache"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert size_only(store, "bench", key)
        t["old size-only check"] = time.perf_counter() - t0
        for k, v in t.items():
            best[k] = min(best.get(k, float("inf")), v)
        shutil.rmtree(art.path)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--files", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--root", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="hylight-integrity-"))
    print(f"{platform.node()}: {os.cpu_count()} CPUs ({_hash_threads()} hashing threads), Python "
          f"{platform.python_version()}, {ssl.OPENSSL_VERSION}; artifact root {root}; min of {args.repeat}\n")
    rows = {n: bench(root, args.gib, n, args.repeat) for n in args.files}
    names = list(next(iter(rows.values())))
    print("| " + " | ".join(["files", *names]) + " |")
    print("|" + " --- |" * (len(names) + 1))
    for n, t in rows.items():
        gb = args.gib * (1 << 30) / 1e9
        print("| " + " | ".join([f"{n} x {args.gib / n * 1024:.0f} MiB",
                                 *(f"{v:.3f} s ({gb / v:.2f} GB/s)" if v > 0.01 else f"{v * 1e3:.2f} ms"
                                   for v in t.values())]) + " |")
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
