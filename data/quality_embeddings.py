"""Stage ``quality``'s embeddings: every document encoded once (a frozen sentence encoder), in
``resources.tasks`` shards, into .npy files in the work dir, read back a block of rows at a time."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.documents import count_documents, iter_document_range
from data.quality_params import QualityParams
from data.quality_scorer import SentenceEncoder
from pipeline.shards import split_ranges
from pipeline.stage import StageContext

EMBED_CHUNK_DOCS = 512  # documents encoded per call; shard boundaries are multiples of it (same batches)
F32 = np.dtype("<f4")


@dataclass
class EmbedShard:
    """Embed documents [start, stop) into an .npy at ``out`` (plain data: it travels to a Ray task)."""

    docs_path: str
    file_counts: list[int]
    start: int
    stop: int
    out: str
    max_tokens: int
    batch_size: int
    threads: int
    chunk_docs: int


def npy_header(f: Any, shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Write an .npy header for a C-ordered array of ``shape``; returns the data's offset."""
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                             "shape": shape})
    return f.tell()


def embed_shard(shard: EmbedShard, progress: Callable[[str], None]) -> int:
    """A shard's embeddings, [stop - start, E] float32, encoded ``chunk_docs`` documents per call counted from
    ``start`` (a multiple of ``chunk_docs``): every chunk is the one a single task would encode. Each chunk is
    appended to the file with a plain write: nothing is mapped, so the written pages are not this process's."""
    encoder = SentenceEncoder(shard.max_tokens, shard.batch_size, shard.threads)
    n = shard.stop - shard.start
    start = time.perf_counter()
    row = 0
    chunk: list[str] = []
    with open(shard.out, "wb") as f:
        npy_header(f, (n, encoder.dim), F32)

        def flush() -> None:
            nonlocal row, chunk
            if row + len(chunk) > n:
                raise RuntimeError(f"quality: more than {n} documents in {shard.docs_path}[{shard.start}:"
                                   f"{shard.stop}] (the input changed while the stage ran)")
            f.write(np.ascontiguousarray(encoder.encode(chunk), dtype=F32).tobytes())
            row += len(chunk)
            chunk = []
            progress(f"embedded {row}/{n} documents ({row / (time.perf_counter() - start):.1f} docs/s)")

        for rec in iter_document_range(shard.docs_path, shard.start, shard.stop, shard.file_counts):
            chunk.append(rec["text"])
            if len(chunk) >= shard.chunk_docs:
                flush()
        if chunk:
            flush()
    if row != n:
        raise RuntimeError(f"quality: embedded {row} documents of {shard.docs_path}[{shard.start}:{shard.stop}], "
                           f"expected {n} (the input changed while the stage ran)")
    return row


class Embeddings:
    """Every document's embedding, in the shards' .npy files in work_dir, read a block of rows at a time
    (``np.fromfile`` at the rows' offset: nothing is mapped, nothing whole-corpus is in memory)."""

    def __init__(self, shards: Sequence[EmbedShard]) -> None:
        self.parts: list[tuple[int, int, str, int]] = []  # (start, stop, path, data offset)
        self.dim = 0
        for s in shards:
            with open(s.out, "rb") as f:
                np.lib.format.read_magic(f)  # version 1.0: written by npy_header
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                if shape[0] != s.stop - s.start or fortran or dtype != F32:
                    raise RuntimeError(f"quality: {s.out} holds {shape} {dtype}, expected {s.stop - s.start} rows")
                self.parts.append((s.start, s.stop, s.out, f.tell()))
                self.dim = shape[1]

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows [a, b) as float32 [b - a, E]."""
        out = np.empty((b - a, self.dim), dtype=np.float32)
        for start, stop, path, offset in self.parts:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                out[lo - a:hi - a] = np.fromfile(path, dtype=F32, count=(hi - lo) * self.dim,
                                                 offset=offset + (lo - start) * self.dim * 4).reshape(hi - lo, self.dim)
        return out

    def take(self, positions: Sequence[int]) -> np.ndarray:
        """Rows at ``positions`` (the labeled documents) as float32 [len(positions), E]."""
        out = np.empty((len(positions), self.dim), dtype=np.float32)
        for j, n in enumerate(positions):
            out[j] = self.rows(n, n + 1)[0]
        return out


def embed_all(docs_path: Path, n_docs: int, params: QualityParams, ctx: StageContext) -> tuple[Embeddings, float]:
    """Embeddings [N, E] of every document into .npy files in ctx.work_dir, in ``resources.tasks`` shards (left
    as they are: no concatenated copy); returns their reader and the seconds spent. One shard encodes on ``cpus``
    threads, several on one thread each."""
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    ranges = split_ranges(n_docs, ctx.resources.tasks, align=EMBED_CHUNK_DOCS)
    threads = max(1, int(ctx.resources.cpus)) if len(ranges) == 1 else 1
    file_counts = count_documents(docs_path)
    shards = [EmbedShard(str(docs_path), file_counts, a, b, str(ctx.work_dir / f"embeddings-{i:05d}.npy"),
                         params.max_tokens, params.batch_size, threads, EMBED_CHUNK_DOCS)
              for i, (a, b) in enumerate(ranges)]
    embedded = ctx.map_shards(embed_shard, shards, what="embeddings")
    if sum(embedded) != n_docs:
        raise RuntimeError(f"quality: embedded {sum(embedded)} documents, expected {n_docs}")
    return Embeddings(shards), time.perf_counter() - start
