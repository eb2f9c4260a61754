"""Stage ``dedup``'s MinHash-LSH candidates: datatrove's signature, bucket and (verify: estimate) cluster steps,
run in shards (Ray tasks with ``resources.tasks`` > 1), and their pairs and clusters loaded into the state.

``signature_rows/`` holds every signature doc's whole signature (8 bytes x bands x rows), written by the
signature shards beside datatrove's files (which hold each band sorted by hash) and read by position
(:class:`SignatureRows`)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.dedup.minhash import (
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupSignature,
)

from data.dedup_params import DedupParams
from data.dedup_state import int64s, u32_records
from data.documents import count_documents, iter_document_range
from data.minhash import BoundedMinhashSignature, FastMinhashSignature, Shingler, quiet_datatrove
from pipeline.shards import split_ranges
from pipeline.stage import StageContext, track


def signature_step(params: DedupParams, output_folder: str | Path, shingler: Shingler | None = None,
                   ) -> MinhashDedupSignature:
    """The signature step ``params.word_tokenizer`` asks for (also used by the benchmark)."""
    if params.word_tokenizer == "fast":
        return FastMinhashSignature(str(output_folder), params.minhash_config(), shingler)
    return BoundedMinhashSignature(str(output_folder), config=params.minhash_config(), language=params.language)



@dataclass
class SignatureShard:
    """Signature docs [start, stop) (documents ``signature_docs[start:stop]`` of the input), as datatrove's
    signature step of rank ``rank`` (plain data: it travels to a Ray task)."""

    params: dict[str, Any]
    docs_path: str
    file_counts: list[int]
    signature_docs: str  # int64 file: every signature doc's document position, in signature order
    start: int
    stop: int
    rank: int
    world_size: int
    output_folder: str
    rows_folder: str  # where the shard writes its docs' whole signatures (:class:`SignatureRows`)


def signature_shard(shard: SignatureShard, progress: Callable[[str], None]) -> int:
    """MinHash signatures of one shard's signature docs, written as datatrove rank ``shard.rank``'s files, and
    (for the near-duplicate check) as rows in document order."""
    params = DedupParams.model_validate(shard.params)
    n = shard.stop - shard.start

    def leaders() -> Iterator[Document]:
        positions = int64s(Path(shard.signature_docs), shard.start, shard.stop)
        if (want := next(positions, None)) is None:
            return
        records = iter_document_range(shard.docs_path, want, sum(shard.file_counts), shard.file_counts)
        for i, rec in enumerate(records, want):
            if i == want:
                yield Document(text=rec["text"], id=str(i))
                if (want := next(positions, None)) is None:
                    return

    step = signature_step(params, shard.output_folder)
    rows = Path(shard.rows_folder) / f"{shard.rank:05d}.u64"
    with quiet_datatrove(), recording_rows(step, rows):
        step.run(track(leaders(), progress, total=n, what="documents signed"), rank=shard.rank,
                 world_size=shard.world_size)
    if rows.stat().st_size != n * 8 * step.num_hashes:
        raise RuntimeError(f"dedup: {rows} holds {rows.stat().st_size} bytes for {n} documents: datatrove's "
                           "signature step no longer calls get_shingles/get_signature once per document")
    return n


@contextmanager
def recording_rows(step: MinhashDedupSignature, path: Path) -> Iterator[None]:
    """While open, ``step`` also appends each document's whole signature (bands x rows uint64) to ``path``, in
    document order, zeros for a document without shingles: datatrove's files hold each band sorted by hash, the
    near-duplicate check reads signatures by position. datatrove's ``run`` calls ``get_shingles`` once per
    document and ``get_signature`` once after each non-empty result (the caller checks the file's size)."""
    get_shingles, get_signature = step.get_shingles, step.get_signature
    no_shingles = bytes(8 * step.num_hashes)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        def shingles(text: str) -> np.ndarray:
            found = get_shingles(text)
            if found.size == 0:
                out.write(no_shingles)
            return found

        def signature(found: np.ndarray) -> list[list[int]]:
            sig = get_signature(found)
            out.write(np.asarray(sig, dtype="<u8").tobytes())
            return sig

        step.get_shingles, step.get_signature = shingles, signature  # instance attributes shadow the methods
        try:
            yield
        finally:
            del step.get_shingles, step.get_signature


class SignatureRows:
    """Whole signatures of signature docs, ``[k, bands * rows]`` uint64, read with ``pread`` from the files that
    :func:`signature_shard` wrote (one per rank; rank r's docs start at signature doc ``offsets[r]``)."""

    def __init__(self, folder: Path, offsets: list[int], hashes: int) -> None:
        self.first = np.asarray(offsets, dtype=np.int64)
        self.hashes = hashes
        self.fds = [os.open(folder / f"{rank:05d}.u64", os.O_RDONLY) for rank in range(len(offsets))]

    def get(self, sig_docs: np.ndarray) -> np.ndarray:
        ranks = np.searchsorted(self.first, sig_docs, side="right") - 1
        size = 8 * self.hashes
        data = b"".join(os.pread(self.fds[rank], size, size * local)
                        for rank, local in zip(ranks.tolist(), (sig_docs - self.first[ranks]).tolist(), strict=True))
        return np.frombuffer(data, dtype="<u8").reshape(len(sig_docs), self.hashes)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


@dataclass
class BucketShard:
    """LSH bands [start, stop): datatrove's bucket step, one band at a time, over every rank's signatures."""

    params: dict[str, Any]
    signatures: str
    buckets: str
    start: int
    stop: int


def bucket_shard(shard: BucketShard, progress: Callable[[str], None]) -> int:
    params = DedupParams.model_validate(shard.params)
    config = params.minhash_config()
    with quiet_datatrove():
        for band in range(shard.start, shard.stop):  # one task per band, as datatrove's executor would run them
            MinhashDedupBuckets(shard.signatures, shard.buckets, config=config).run(rank=band, world_size=params.bands)
    return shard.stop - shard.start


@dataclass
class MinhashResult:
    signed: int  # signature docs that had a signature (the others have fewer than n_grams words)
    offsets: list[int]  # per signature shard (datatrove rank): its first signature doc


def run_minhash(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection, leaders: int,
                 work: Path) -> MinhashResult:
    """datatrove's MinHash stages on the signature docs: signatures in shards (datatrove ranks, contiguous in
    input order), LSH buckets in shards of bands, clusters here (verify: estimate); the pairs and clusters go to
    the state. Every pair datatrove writes is (rank, doc in rank); rank r's docs start at signature doc
    ``offsets[r]``, and ties in a band's sorted merge are broken by (rank, doc), i.e. input order: the pairs,
    and all that follows, are those of one rank."""
    config = params.minhash_config()
    buckets, clusters = work / "buckets", work / "clusters"
    tasks = ctx.resources.tasks
    ranges = split_ranges(leaders, tasks)
    file_counts = count_documents(docs_path)
    dump = params.model_dump(mode="json")
    ctx.map_shards(signature_shard, [
        SignatureShard(dump, str(docs_path), file_counts, str(work / "signature_docs.i64"), a, b, rank, len(ranges),
                       str(work / "signatures"), str(work / "signature_rows"))
        for rank, (a, b) in enumerate(ranges)], what="signatures")
    ctx.map_shards(bucket_shard, [BucketShard(dump, str(work / "signatures"), str(buckets), a, b)
                                  for a, b in split_ranges(params.bands, tasks)], what="lsh_bands")
    offsets = [a for a, _ in ranges]
    load_band_groups(db, buckets, offsets)
    if params.verify == "estimate":
        with quiet_datatrove():
            MinhashDedupCluster(str(buckets), str(clusters), config=config, save_cluster_id=True).run(world_size=1)
        load_clusters(db, clusters, offsets)
    record = (params.rows * config.hash_config.precision // 8) + 4
    signed = sum((work / "signatures" / "bucket_000" / f"{rank:05d}.minhash.sig").stat().st_size // record
                 for rank in range(len(ranges)))
    return MinhashResult(signed, offsets)


def load_band_groups(db: sqlite3.Connection, buckets: Path, offsets: list[int]) -> None:
    """Each band's groups of signature docs with equal hashes (table ``band``) and every LSH pair (``edge``),
    streamed from datatrove's .dups files. datatrove writes a band's equal-hash group d1..dk as the chain (d1, d2),
    (d2, d3), ... (a merge of the hash-sorted signature files, where a doc has one record per band), so a pair
    starts a new group unless its first doc is the previous pair's second."""
    first = np.asarray(offsets, dtype=np.int64)
    gid = -1
    for dups in sorted(buckets.glob("*.dups")):  # one file per band
        last = -1
        for block in u32_records(dups, 4):
            a, b = first[block[:, 0]] + block[:, 1], first[block[:, 2]] + block[:, 3]
            starts = a != np.concatenate(([last], b[:-1]))
            groups = gid + np.cumsum(starts)
            gid, last = int(groups[-1]), int(b[-1])
            db.executemany("INSERT INTO band (g, s) VALUES (?, ?)",
                           np.concatenate([np.stack([groups[starts], a[starts]], 1), np.stack([groups, b], 1)]).tolist())
            db.executemany("INSERT OR IGNORE INTO edge (a, b) VALUES (?, ?)",
                           np.stack([np.minimum(a, b), np.maximum(a, b)], 1).tolist())
    db.execute("CREATE INDEX band_by_s ON band (s, g)")
    db.execute("CREATE INDEX band_by_g ON band (g, s)")


def load_clusters(db: sqlite3.Connection, clusters: Path, offsets: list[int]) -> None:
    """datatrove's clusters (verify: estimate): (doc in rank, cluster id) per rank file."""
    for path in sorted(clusters.glob("*.clusters")):  # none when there is no pair at all
        first = offsets[int(path.name.split(".")[0])]
        for block in u32_records(path, 2):
            db.executemany("INSERT OR REPLACE INTO lsh_cluster (s, cid) VALUES (?, ?)",
                           np.stack([block[:, 0] + first, block[:, 1]], 1).tolist())
