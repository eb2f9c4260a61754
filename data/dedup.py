"""Stage ``dedup``: exact and MinHash-LSH near-duplicate removal, and eval-set decontamination.

One representative per duplicate cluster is kept and carries the repetition signal that mixing uses
(§4.1.3.2): ``metadata[DUP_COUNT]`` (cluster size, >= 1 on every kept document) and
``metadata[DUP_MEMBERS]`` (ids of the removed members, at most ``max_members_listed``). Every input
document is kept or dropped with a reason from :data:`DROP_REASONS`; ``in == kept + dropped`` is checked.

Order of work, and what a reader of the output should know:

1. **Decontamination** (when eval sets are given; :mod:`data.decontamination`) is decided once per
   exact-duplicate group, before dedup: in ``drop`` mode contaminated documents leave before
   clustering, so a representative is never contaminated; in ``flag`` mode they stay and get
   ``metadata[CONTAMINATION]``.
2. **Exact dedup**: groups of documents whose text is equal after collapsing whitespace (and case,
   with ``exact_casefold``). In each group the *leader* is the longest text (characters of the
   whitespace-collapsed text, so members tie unless case differs), ties broken by the smaller id;
   the others are dropped as ``exact_duplicate``.
3. **Candidates** for near dedup come from datatrove's MinHash stages run on the leaders
   (``MinhashDedupSignature`` -> ``MinhashDedupBuckets``; :mod:`data.minhash` says what is datatrove's and
   what is ours): two leaders are candidates when they agree on every hash of at least one of
   ``bands`` bands of ``rows`` hashes, with probability 1 - (1 - J^rows)^bands at Jaccard J. Leaders
   with fewer than ``n_grams`` words have no shingles: exact dedup only.
4. **Near dedup** (``verify: exact``, the default) honours ``jaccard_threshold``: no document is
   dropped as a near duplicate unless the exact Jaccard of its ``n_grams``-word shingle set with its
   kept representative is at least the threshold. Leaders are taken longest first (ties: smaller id);
   each one not yet placed becomes a representative and takes every unplaced LSH candidate whose exact
   Jaccard with it reaches the threshold. The default banding, 20 x 6, puts the LSH S-curve at 0.61 so
   that pairs at the threshold are found (P = 0.998 at J = 0.8, 0.9999 at 0.85) and the exact check
   removes the rest. Candidates whose MinHash estimate of J is more than :func:`estimate_margin`
   (5 standard errors) below the threshold are not checked exactly: that bounds the work on large
   candidate groups (shared boilerplate) and loses a true pair with probability < 1e-6.
   ``verify: estimate`` is datatrove's behaviour: every LSH cluster (connected component of candidate
   pairs, with chaining: A~B and B~C put A and C together) loses all but its longest leader, and the
   exact Jaccard of up to ``verify_pairs`` (representative, member) pairs estimates the precision.
   Faster on huge corpora, but it drops documents below the threshold (with the 11 x 11 banding it was
   written for, 22% of removed pairs on the planted benchmark set, BENCHMARKS.md).

Word tokenizer: datatrove picks spaCy for English, which dominates the signature cost.
``word_tokenizer: fast`` (default) uses :class:`data.minhash.FastMinhashSignature`: the same
``simplify_text`` output (a faster equivalent, checked by the tests), words split on whitespace (each
CJK character a word) and n-gram hashes combined with numpy. ``spacy`` runs datatrove's stock shingling.
Either way signatures are computed in bounded blocks (memory does not grow with document length beyond
a few bytes per word).

With ``resources.tasks`` = N (pipeline/shards.py) the signatures are computed by N Ray tasks, each over a
contiguous range of the leaders and written as datatrove's rank files (as datatrove's own executors shard the
signature step), and the LSH bands are bucketed by N tasks; exact groups, candidates, the exact Jaccard and the
output are decided once over all of them, so a duplicate pair split across shards is found as within one and
the artifact is the same for every N (tests/test_shards.py). Reading, exact grouping, decontamination and the
exact-Jaccard check stay in the stage's own process.

Where the state lives: on disk, in the work dir, so the stage's memory does not grow with the corpus.

- ``state.sqlite`` (:data:`_SCHEMA`): a row per document (id, domain, length, incoming weight and members,
  exact group, decision), per exact group (hash, leader, contamination matches), per signature doc, per
  member of an LSH band group and per LSH pair, and each cluster's dup_count. The page cache is capped at
  :data:`_CACHE_KIB`; the sorts (rank order, input order of members) spill to SQLite's temporary files.
- ``signature_rows/``: every signature doc's whole signature (8 bytes x bands x rows), written by the
  signature shards beside datatrove's files (which hold each band sorted by hash) and read by position.
- ``shingles.u64``: the shingle sets the exact Jaccard needs (8 bytes per shingle of each leader in some LSH
  band group), written in a second pass over the documents and read back one set at a time.

Work in the stage's process goes a document, a block of :data:`_BATCH` rows, or a shingle set at a time: LSH
pairs stream from datatrove's .dups files, a representative's candidates come in blocks (one large cluster
of boilerplate costs time, candidates x representatives as before, not memory), a kept document's
dup_members are read up to ``max_members_listed`` and its clusters.jsonl row is written member by member.
What still grows: 8 bytes per near duplicate (the Jaccard quantiles of the report); datatrove's signature
step sorts each band of its shard in memory (8 x rows + 4 bytes per leader of the shard, in the shard task);
with ``verify: estimate``, datatrove's cluster step keeps a union-find over every document in an LSH pair.

Input documents that already carry ``DUP_COUNT`` (from an earlier dedup) count with that weight, and
their ``DUP_MEMBERS`` are carried to the representative, so deduping twice keeps the full count.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import re
import shutil
import sqlite3
import struct
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from datatrove.data import Document
from datatrove.pipeline.dedup.minhash import (
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupSignature,
)

from data.decontamination import ContaminationIndex, build_contamination_index, resolve_decontaminate_paths
from data.dedup_params import DedupParams
from data.documents import (
    ANY_DOCUMENTS,
    DOCUMENTS_TYPE,
    DUP_COUNT,
    DUP_MEMBERS,
    EVAL_CONTAMINATION,
    EVALSET_TYPE,
    DocumentWriter,
    JsonlGzWriter,
    count_documents,
    iter_document_range,
    iter_documents,
    write_jsonl_gz,
)
from data.minhash import BoundedMinhashSignature, FastMinhashSignature, Shingler, jaccard, quiet_datatrove
from pipeline.shards import split_ranges
from pipeline.stage import (
    InputSpec,
    StageContext,
    StageKind,
    file_fingerprint,
    metric_key,
    track,
)

REPORT_NAME = "dedup_report.json"
CLUSTERS_NAME = "clusters.jsonl.gz"
DROPPED_SAMPLES_NAME = "dropped_samples.jsonl.gz"
# metadata set in decontamination: flag mode on contaminated kept documents
CONTAMINATION = EVAL_CONTAMINATION

DROP_REASONS: dict[str, str] = {
    "exact_duplicate": "same text (whitespace-collapsed) as a kept document or one of its near duplicates",
    "near_duplicate": "exact shingle Jaccard >= jaccard_threshold with the kept representative "
                      "(verify: estimate: in its MinHash-LSH cluster)",
    "eval_contamination": "contains or nearly copies an evaluation item (decontamination: drop)",
}
_KEPT, _EXACT, _NEAR, _CONTAMINATED = 0, 1, 2, 3
_REASON_OF = {_EXACT: "exact_duplicate", _NEAR: "near_duplicate", _CONTAMINATED: "eval_contamination"}
_MAX_FLAGS = 10  # contamination matches kept per document


def estimate_margin(params: DedupParams) -> float:
    """How far below the threshold a candidate's MinHash estimate may be and still be checked exactly:
    5 standard errors of the estimate at the threshold, sqrt(t (1 - t) / hashes) (at least 0.05)."""
    t, hashes = params.jaccard_threshold, params.bands * params.rows
    return max(0.05, 5 * math.sqrt(t * (1 - t) / hashes))


def signature_step(params: DedupParams, output_folder: str | Path, shingler: Shingler | None = None,
                   ) -> MinhashDedupSignature:
    """The signature step ``params.word_tokenizer`` asks for (also used by the benchmark)."""
    if params.word_tokenizer == "fast":
        return FastMinhashSignature(str(output_folder), params.minhash_config(), shingler)
    return BoundedMinhashSignature(str(output_folder), config=params.minhash_config(), language=params.language)


_WHITESPACE = re.compile(r"\s+")  # str patterns: \s is str.isspace(), what str.split() splits on


def exact_key(text: str, casefold: bool) -> tuple[bytes, int]:
    """Hash of the whitespace-collapsed (optionally casefolded) text, and that text's length.

    ``" ".join(text.split())`` without the word list (one copy of the text, not an object per word)."""
    norm = _WHITESPACE.sub(" ", text).strip()
    if casefold:
        norm = norm.casefold()
    return hashlib.blake2b(norm.encode("utf-8"), digest_size=16).digest(), len(norm)


# --- the stage's state: a SQLite file in the work dir ----------------------------------------------
_CACHE_KIB = 16 * 1024  # SQLite page cache; sorts, DISTINCTs and IN-lists beyond it spill to temporary files
_BATCH = 4096  # rows per executemany; LSH candidates per block of the near-duplicate check

_SCHEMA = """
CREATE TABLE doc (                      -- one row per input document, no text
    pos INTEGER PRIMARY KEY,            -- position in iter_documents order
    id TEXT NOT NULL,
    domain TEXT NOT NULL,
    chars INTEGER NOT NULL,             -- of the whitespace-collapsed text
    weight INTEGER NOT NULL,            -- incoming dup_count (1 unless deduped before)
    incoming BLOB,                      -- incoming dup_members (JSON), NULL when none
    grp INTEGER NOT NULL,               -- its exact-duplicate group
    reason INTEGER NOT NULL DEFAULT 0,  -- _KEPT / _EXACT / _NEAR / _CONTAMINATED
    dup_of INTEGER NOT NULL DEFAULT -1, -- exact: the group's leader; near: the representative
    jaccard REAL,                       -- near: exact Jaccard with the representative (estimate: when sampled)
    rep INTEGER                         -- the kept document of its cluster (NULL: contaminated)
);
CREATE TABLE grp (                      -- exact-duplicate groups
    gid INTEGER PRIMARY KEY,
    hash BLOB NOT NULL UNIQUE,          -- exact_key
    leader INTEGER NOT NULL,            -- its longest document (ties: smaller id, then earlier)
    leader_chars INTEGER NOT NULL,
    leader_id TEXT NOT NULL,
    size INTEGER NOT NULL,
    matches BLOB                        -- contamination matches (JSON), NULL when clean
);
CREATE TABLE sig (                      -- signature docs: the groups that go on to MinHash, in input order
    s INTEGER PRIMARY KEY,
    grp INTEGER NOT NULL,
    leader INTEGER,                     -- set when the first pass is over
    placed INTEGER NOT NULL DEFAULT 0   -- verify: exact: a representative, or taken by one
);
CREATE TABLE band (g INTEGER NOT NULL, s INTEGER NOT NULL);  -- LSH band groups: equal hashes in one band
CREATE TABLE edge (a INTEGER NOT NULL, b INTEGER NOT NULL, PRIMARY KEY (a, b)) WITHOUT ROWID;  -- LSH pairs
CREATE TABLE lsh_cluster (s INTEGER PRIMARY KEY, cid INTEGER NOT NULL);  -- verify: estimate: datatrove's
CREATE TABLE shingle (pos INTEGER PRIMARY KEY, offset INTEGER NOT NULL, count INTEGER NOT NULL);
CREATE TABLE cluster (rep INTEGER PRIMARY KEY, dup_count INTEGER NOT NULL, members INTEGER NOT NULL);
"""


@contextmanager
def _state(path: Path) -> Iterator[sqlite3.Connection]:
    """A fresh state database: scratch (no journal, no fsync), one transaction for the whole stage (dirty pages
    spill to the file when the cache is full), page cache capped at ``_CACHE_KIB``. Committed, never rolled
    back, when closed: without a journal there is nothing to roll back with."""
    path.unlink(missing_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.executescript("PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF; PRAGMA locking_mode = EXCLUSIVE; "
                         f"PRAGMA temp_store = FILE; PRAGMA cache_size = -{_CACHE_KIB};" + _SCHEMA)
        db.execute("BEGIN")
        yield db
    finally:
        with suppress(sqlite3.Error):
            db.commit()
        db.close()


def _scalar(db: sqlite3.Connection, sql: str, args: tuple[Any, ...] = ()) -> Any:
    return db.execute(sql, args).fetchone()[0]


class _Rows:
    """Parameter rows of one SQL statement, executed ``_BATCH`` at a time."""

    def __init__(self, db: sqlite3.Connection, sql: str) -> None:
        self.db, self.sql = db, sql
        self.rows: list[tuple[Any, ...]] = []

    def add(self, *row: Any) -> None:
        self.rows.append(row)
        if len(self.rows) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.db.executemany(self.sql, self.rows)
            self.rows = []


def _int64s(path: Path, start: int, stop: int) -> Iterator[int]:
    """Items ``start`` to ``stop - 1`` of a file of little-endian int64, read a block at a time."""
    with open(path, "rb") as f:
        f.seek(8 * start)
        for block_start in range(start, stop, _BATCH):
            yield from np.fromfile(f, dtype="<i8", count=min(_BATCH, stop - block_start)).tolist()


def _u32_records(path: Path, width: int) -> Iterator[np.ndarray]:
    """A file of records of ``width`` little-endian uint32 (datatrove's .dups and .clusters), as [k, width] int64
    blocks of at most ``_BATCH`` records."""
    with open(path, "rb") as f:
        while len(block := np.fromfile(f, dtype="<u4", count=_BATCH * width)):
            yield block.reshape(-1, width).astype(np.int64)


# --- reading the documents ------------------------------------------------------------------------
@dataclass
class _Counts:
    """What the first pass counts; everything per document or group is in the state database."""

    docs: int = 0
    bytes: int = 0
    groups: int = 0
    leaders: int = 0  # signature docs: groups whose first document goes on to MinHash


def _incoming(meta: dict[str, Any]) -> tuple[int, list[str]]:
    count = meta.get(DUP_COUNT, 1)
    members = meta.get(DUP_MEMBERS) or []
    weight = count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else 1
    return weight, [str(m) for m in members] if isinstance(members, list) else []


def _first_pass(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection,
                index: ContaminationIndex | None, signature_docs: Path) -> _Counts:
    """Read every document once: its row in ``doc``, exact groups (``grp``, looked up by hash) with their
    leader and contamination, and the groups whose first document goes on to MinHash (``sig``; their document
    positions also go to ``signature_docs``, int64, for the signature shards)."""
    drop_contaminated = params.decontamination == "drop"
    docs = _Rows(db, "INSERT INTO doc (pos, id, domain, chars, weight, incoming, grp) VALUES (?, ?, ?, ?, ?, ?, ?)")
    sigs = _Rows(db, "INSERT INTO sig (s, grp) VALUES (?, ?)")
    n = _Counts()
    with open(signature_docs, "wb") as positions:
        for i, rec in enumerate(ctx.track(iter_documents(docs_path), what="documents read")):
            text, doc_id = rec["text"], rec["id"]
            weight, members = _incoming(rec.get("metadata") or {})
            key, length = exact_key(text, params.exact_casefold)
            n.docs += 1
            n.bytes += len(text.encode("utf-8"))
            found = db.execute("SELECT gid, leader_chars, leader_id FROM grp WHERE hash = ?", (key,)).fetchone()
            if found is not None:
                gid, chars, leader_id = found
                if (-length, doc_id) < (-chars, leader_id):  # the rank: longest, smaller id (then earlier)
                    db.execute("UPDATE grp SET size = size + 1, leader = ?, leader_chars = ?, leader_id = ? "
                               "WHERE gid = ?", (i, length, doc_id, gid))
                else:
                    db.execute("UPDATE grp SET size = size + 1 WHERE gid = ?", (gid,))
            else:
                gid = n.groups
                n.groups += 1
                matches = index.check(text) if index is not None else None
                db.execute("INSERT INTO grp VALUES (?, ?, ?, ?, ?, 1, ?)",
                           (gid, key, i, length, doc_id, orjson.dumps(matches) if matches else None))
                if not (matches and drop_contaminated):
                    sigs.add(n.leaders, gid)
                    positions.write(struct.pack("<q", i))
                    n.leaders += 1
            docs.add(i, doc_id, rec.get("domain") or "unknown", length, weight,
                     orjson.dumps(members) if members else None, gid)
    docs.flush()
    sigs.flush()
    return n


class _ShingleStore:
    """Unique shingles (sorted uint64) of the leaders that the exact Jaccard needs, computed in a second pass over
    the documents and appended to one file; table ``shingle`` holds each one's (offset, count)."""

    def __init__(self, path: Path, db: sqlite3.Connection) -> None:
        self.path, self.db = path, db
        self.fd = -1

    def fill(self, docs_path: Path, leaders: Iterator[int], sig_step: MinhashDedupSignature) -> None:
        """Shingles of ``leaders`` (document positions, ascending)."""
        index = _Rows(self.db, "INSERT INTO shingle (pos, offset, count) VALUES (?, ?, ?)")
        offset = 0
        want = next(leaders, None)
        with open(self.path, "wb") as out:
            for i, rec in enumerate(iter_documents(docs_path) if want is not None else ()):
                if i == want:
                    shingles = np.unique(sig_step.get_shingles(rec["text"]).ravel())
                    out.write(shingles.astype("<u8").tobytes())
                    index.add(i, offset, len(shingles))
                    offset += len(shingles)
                    if (want := next(leaders, None)) is None:
                        break
        index.flush()
        self.fd = os.open(self.path, os.O_RDONLY)

    def get(self, pos: int) -> np.ndarray:
        offset, count = self.db.execute("SELECT offset, count FROM shingle WHERE pos = ?", (pos,)).fetchone()
        return np.frombuffer(os.pread(self.fd, 8 * count, 8 * offset), dtype="<u8")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# --- MinHash-LSH (datatrove) ----------------------------------------------------------------------
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
    rows_folder: str  # where the shard writes its docs' whole signatures (:class:`_SignatureRows`)


def signature_shard(shard: SignatureShard, progress: Callable[[str], None]) -> int:
    """MinHash signatures of one shard's signature docs, written as datatrove rank ``shard.rank``'s files, and
    (for the near-duplicate check) as rows in document order."""
    params = DedupParams.model_validate(shard.params)
    n = shard.stop - shard.start

    def leaders() -> Iterator[Document]:
        positions = _int64s(Path(shard.signature_docs), shard.start, shard.stop)
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
    with quiet_datatrove(), _recording_rows(step, rows):
        step.run(track(leaders(), progress, total=n, what="documents signed"), rank=shard.rank,
                 world_size=shard.world_size)
    if rows.stat().st_size != n * 8 * step.num_hashes:
        raise RuntimeError(f"dedup: {rows} holds {rows.stat().st_size} bytes for {n} documents: datatrove's "
                           "signature step no longer calls get_shingles/get_signature once per document")
    return n


@contextmanager
def _recording_rows(step: MinhashDedupSignature, path: Path) -> Iterator[None]:
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


class _SignatureRows:
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
class _MinhashResult:
    signed: int  # signature docs that had a signature (the others have fewer than n_grams words)
    offsets: list[int]  # per signature shard (datatrove rank): its first signature doc


def _run_minhash(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection, leaders: int,
                 work: Path) -> _MinhashResult:
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
    _load_band_groups(db, buckets, offsets)
    if params.verify == "estimate":
        with quiet_datatrove():
            MinhashDedupCluster(str(buckets), str(clusters), config=config, save_cluster_id=True).run(world_size=1)
        _load_clusters(db, clusters, offsets)
    record = (params.rows * config.hash_config.precision // 8) + 4
    signed = sum((work / "signatures" / "bucket_000" / f"{rank:05d}.minhash.sig").stat().st_size // record
                 for rank in range(len(ranges)))
    return _MinhashResult(signed, offsets)


def _load_band_groups(db: sqlite3.Connection, buckets: Path, offsets: list[int]) -> None:
    """Each band's groups of signature docs with equal hashes (table ``band``) and every LSH pair (``edge``),
    streamed from datatrove's .dups files. datatrove writes a band's equal-hash group d1..dk as the chain (d1, d2),
    (d2, d3), ... (a merge of the hash-sorted signature files, where a doc has one record per band), so a pair
    starts a new group unless its first doc is the previous pair's second."""
    first = np.asarray(offsets, dtype=np.int64)
    gid = -1
    for dups in sorted(buckets.glob("*.dups")):  # one file per band
        last = -1
        for block in _u32_records(dups, 4):
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


def _load_clusters(db: sqlite3.Connection, clusters: Path, offsets: list[int]) -> None:
    """datatrove's clusters (verify: estimate): (doc in rank, cluster id) per rank file."""
    for path in sorted(clusters.glob("*.clusters")):  # none when there is no pair at all
        first = offsets[int(path.name.split(".")[0])]
        for block in _u32_records(path, 2):
            db.executemany("INSERT OR REPLACE INTO lsh_cluster (s, cid) VALUES (?, ?)",
                           np.stack([block[:, 0] + first, block[:, 1]], 1).tolist())


# --- decisions ------------------------------------------------------------------------------------
def _base_decisions(params: DedupParams, db: sqlite3.Connection) -> None:
    """Exact duplicates (``dup_of`` their group's leader) and contamination; every leader kept for now. Each
    signature doc gets its leader, chosen now that the first pass is over."""
    if params.decontamination == "drop":
        db.execute(f"UPDATE doc SET reason = {_CONTAMINATED} WHERE grp IN (SELECT gid FROM grp WHERE matches IS NOT NULL)")
    db.execute(f"UPDATE doc SET reason = {_EXACT}, dup_of = (SELECT leader FROM grp WHERE gid = doc.grp) "
               f"WHERE reason = {_KEPT} AND pos != (SELECT leader FROM grp WHERE gid = doc.grp)")
    db.execute("UPDATE sig SET leader = (SELECT leader FROM grp WHERE gid = sig.grp)")


# signature docs in some LSH band group, with their leader, by the leader's rank (longest, smaller id, earlier)
_CANDIDATE_LEADERS_BY_RANK = """
    SELECT sig.s, sig.leader FROM sig JOIN doc ON doc.pos = sig.leader WHERE sig.s IN (SELECT s FROM band)
    ORDER BY doc.chars DESC, doc.id, doc.pos"""
# the unplaced signature docs that share a band group with ?, with their leader
_UNPLACED_CANDIDATES = """
    SELECT sig.s, sig.leader FROM sig
    WHERE sig.s IN (SELECT other.s FROM band AS own JOIN band AS other ON other.g = own.g WHERE own.s = ?)
      AND sig.placed = 0
    ORDER BY sig.s"""


def _near_exact(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection,
                mh: _MinhashResult, sig_step: MinhashDedupSignature, work: Path) -> dict[str, Any]:
    """verify: exact. Longest leader first; each unplaced one is a representative and takes the unplaced
    LSH candidates (same hashes in some band) whose exact Jaccard with it reaches the threshold."""
    t = params.jaccard_threshold
    margin = estimate_margin(params)
    ctx.progress(f"checking LSH candidates of {_scalar(db, 'SELECT COUNT(DISTINCT s) FROM band')} leaders "
                 f"with the exact Jaccard (>= {t})")
    shingles = _ShingleStore(work / "shingles.u64", db)
    rows = _SignatureRows(work / "signature_rows", mh.offsets, params.bands * params.rows)
    try:
        shingles.fill(docs_path, (pos for (pos,) in db.execute(
            "SELECT leader FROM sig WHERE s IN (SELECT s FROM band) ORDER BY leader")), sig_step)
        tally: Counter[str] = Counter()
        for r, rep in db.execute(_CANDIDATE_LEADERS_BY_RANK):
            if _scalar(db, "SELECT placed FROM sig WHERE s = ?", (r,)):
                continue
            db.execute("UPDATE sig SET placed = 1 WHERE s = ?", (r,))
            _take_candidates(db, r, rep, rows, shingles, t - margin, t, tally)
    finally:
        shingles.close()
        rows.close()
    # the only per-document array: 8 bytes per near duplicate, for the quantiles
    arr = np.fromiter((j for (j,) in db.execute(f"SELECT jaccard FROM doc WHERE reason = {_NEAR}")), dtype=np.float64)
    return {
        "mode": "exact", "jaccard_threshold": t, "estimate_margin": round(margin, 4),
        "near_pairs": len(arr), "candidate_pairs": tally["candidate_pairs"],
        "pairs_checked": tally["pairs_checked"], "skipped_by_estimate": tally["skipped_by_estimate"],
        "checked_below_threshold": tally["below_threshold"],
        # every dropped member was measured: this is the precision, not an estimate of it
        "precision": float((arr >= t).mean()) if len(arr) else None,
        "min_member_jaccard": round(float(arr.min()), 4) if len(arr) else None,
        "jaccard_quantiles": _quantiles(arr), "lsh_pairs": _scalar(db, "SELECT COUNT(*) FROM edge"),
    }


def _take_candidates(db: sqlite3.Connection, r: int, rep: int, rows: _SignatureRows, shingles: _ShingleStore,
                     min_estimate: float, t: float, tally: Counter[str]) -> None:
    """Representative ``rep`` (leader of signature doc ``r``) takes each unplaced LSH candidate whose exact Jaccard
    with it reaches ``t``; a candidate whose MinHash estimate is below ``min_estimate`` is not checked. Candidates
    come ``_BATCH`` at a time and shingle sets one at a time: memory does not grow with the cluster (its work is
    candidates x representatives, as before)."""
    signature = rows.get(np.array([r]))[0]
    rep_shingles: np.ndarray | None = None
    candidates = db.execute(_UNPLACED_CANDIDATES, (r,))
    while block := candidates.fetchmany(_BATCH):
        sig_docs, leaders = np.array(block, dtype=np.int64).T
        check = ~((rows.get(sig_docs) == signature).mean(axis=1) < min_estimate)
        tally["candidate_pairs"] += len(block)
        tally["skipped_by_estimate"] += len(block) - int(check.sum())
        for c, member in zip(sig_docs[check].tolist(), leaders[check].tolist(), strict=True):
            if rep_shingles is None:
                rep_shingles = shingles.get(rep)
            j = jaccard(rep_shingles, shingles.get(member))
            tally["pairs_checked"] += 1
            if j >= t:  # placed now, so no later representative sees it (the cursor is past it)
                db.execute("UPDATE sig SET placed = 1 WHERE s = ?", (c,))
                db.execute(f"UPDATE doc SET reason = {_NEAR}, dup_of = ?, jaccard = ? WHERE pos = ?", (rep, j, member))
            else:
                tally["below_threshold"] += 1


class _FirstByKey:
    """The ``k`` items of smallest key in a stream, ties to the earlier: ``sorted(stream, key)[:k]`` in O(k)."""

    def __init__(self, k: int) -> None:
        self.k, self.seen = k, 0
        self.items: list[tuple[bytes, int, Any]] = []

    def add(self, key: bytes, item: Any) -> None:
        self.items.append((key, self.seen, item))
        self.seen += 1
        if len(self.items) >= 2 * self.k + _BATCH:
            self.items = heapq.nsmallest(self.k, self.items)

    def result(self) -> list[Any]:
        return [item for _, _, item in heapq.nsmallest(self.k, self.items)]


def _near_estimate(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection,
                   sig_step: MinhashDedupSignature, work: Path) -> dict[str, Any]:
    """verify: estimate. datatrove's clusters as they are; exact Jaccard of a hash sample of
    (representative, member) pairs -> precision_estimate, and of LSH's own candidate pairs ->
    edge_precision_estimate (high edge and low member precision: chaining, A~B, B~C, A !~ C)."""
    def order(a_id: str, b_id: str) -> bytes:
        return hashlib.blake2b(f"{params.seed}\0{a_id}\0{b_id}".encode(), digest_size=8).digest()

    pairs, near = _FirstByKey(params.verify_pairs), _Rows(db, f"UPDATE doc SET reason = {_NEAR}, dup_of = ? WHERE pos = ?")
    cluster, rep, rep_id = None, -1, ""
    for cid, leader, leader_id in db.execute(
            "SELECT c.cid, sig.leader, doc.id FROM lsh_cluster AS c JOIN sig ON sig.s = c.s "
            "JOIN doc ON doc.pos = sig.leader ORDER BY c.cid, doc.chars DESC, doc.id, doc.pos"):
        if cid != cluster:  # its first leader by rank is the representative
            cluster, rep, rep_id = cid, leader, leader_id
            continue
        near.add(rep, leader)
        pairs.add(order(rep_id, leader_id), (rep, leader))
    near.flush()
    edges = _FirstByKey(params.verify_pairs)
    for a, a_id, b, b_id in db.execute(
            "SELECT sa.leader, da.id, sb.leader, dbb.id FROM edge JOIN sig AS sa ON sa.s = edge.a "
            "JOIN sig AS sb ON sb.s = edge.b JOIN doc AS da ON da.pos = sa.leader JOIN doc AS dbb ON dbb.pos = sb.leader "
            "ORDER BY sa.leader, sb.leader"):
        edges.add(order(a_id, b_id), (a, b))
    sample, edge_sample = pairs.result(), edges.result()
    if sample or edge_sample:
        ctx.progress(f"verifying {len(sample)} of {pairs.seen} near-duplicate pairs with exact Jaccard")
    shingles = _ShingleStore(work / "shingles.u64", db)
    try:
        shingles.fill(docs_path, iter(sorted({i for pair in sample + edge_sample for i in pair})), sig_step)
        arr = np.array([jaccard(shingles.get(rep), shingles.get(m)) for rep, m in sample])
        edge_j = np.array([jaccard(shingles.get(a), shingles.get(b)) for a, b in edge_sample])
    finally:
        shingles.close()
    db.executemany("UPDATE doc SET jaccard = ? WHERE pos = ?",
                   [(j, m) for (_, m), j in zip(sample, arr.tolist(), strict=True)])
    t = params.jaccard_threshold
    return {
        "mode": "estimate", "jaccard_threshold": t, "near_pairs": pairs.seen, "pairs_checked": len(sample),
        "precision_estimate": float((arr >= t).mean()) if len(arr) else None,
        "jaccard_quantiles": _quantiles(arr),
        "lsh_pairs": edges.seen, "lsh_pairs_checked": len(edge_sample),
        "edge_precision_estimate": float((edge_j >= t).mean()) if len(edge_j) else None,
    }


def _quantiles(arr: np.ndarray) -> dict[str, float]:
    return ({q: round(float(np.quantile(arr, float(q))), 4) for q in ("0.0", "0.1", "0.5", "0.9", "1.0")}
            if len(arr) else {})


def _clusters(db: sqlite3.Connection) -> None:
    """Each document's representative (``rep``: the kept document of its cluster) and, per representative, the
    cluster's dup_count (incoming weights summed) and number of members."""
    db.execute(f"UPDATE doc SET rep = CASE reason WHEN {_KEPT} THEN pos WHEN {_NEAR} THEN dup_of END")
    # an exact duplicate's leader is kept or a near duplicate (contamination takes the whole group)
    db.execute(f"UPDATE doc SET rep = (SELECT leader.rep FROM doc AS leader WHERE leader.pos = doc.dup_of) "
               f"WHERE reason = {_EXACT}")
    db.execute("CREATE INDEX doc_by_rep ON doc (rep, pos)")
    db.execute("INSERT INTO cluster (rep, dup_count, members) "
               "SELECT rep, SUM(weight), COUNT(*) - 1 FROM doc WHERE rep IS NOT NULL GROUP BY rep")


# --- writing --------------------------------------------------------------------------------------
_OUTPUT_ROWS = """
    SELECT doc.pos, doc.id, doc.reason, doc.dup_of, doc.rep, doc.jaccard, doc.incoming, grp.matches,
           cluster.dup_count, cluster.members
    FROM doc JOIN grp ON grp.gid = doc.grp LEFT JOIN cluster ON cluster.rep = doc.pos ORDER BY doc.pos"""
_MEMBERS = """
    SELECT member.id, member.reason, dup_of.id, member.jaccard, member.incoming
    FROM doc AS member JOIN doc AS dup_of ON dup_of.pos = member.dup_of
    WHERE member.rep = ? AND member.pos != member.rep ORDER BY member.pos"""


def _id_of(db: sqlite3.Connection, pos: int) -> str:
    return _scalar(db, "SELECT id FROM doc WHERE pos = ?", (pos,))


def _listed_members(db: sqlite3.Connection, rep: int, incoming: bytes | None, members: int, cap: int) -> list[str]:
    """dup_members of a kept document: its incoming members, then each of its ``members`` (input order) followed
    by that member's incoming members, cut at ``cap`` (read only up to the cap, however large the cluster)."""
    listed: list[str] = orjson.loads(incoming) if incoming else []
    for member_id, _, _, _, member_incoming in db.execute(_MEMBERS, (rep,)) if members else ():
        if len(listed) >= cap:
            break
        listed.append(member_id)
        if member_incoming:
            listed += orjson.loads(member_incoming)
    return listed[:cap]


def _write_documents(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection,
                     n_in: int) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    """Pass 3: the kept documents with their cluster metadata, and samples of the dropped. Returns how many
    were written and the samples."""
    flagged = params.decontamination == "flag"
    samples: dict[str, list[dict[str, Any]]] = {r: [] for r in DROP_REASONS}
    rows = db.execute(_OUTPUT_ROWS)
    with DocumentWriter(ctx.out_dir) as writer:
        for i, rec in enumerate(ctx.track(iter_documents(docs_path), total=n_in, what="documents written")):
            row = rows.fetchone()
            if row is None or rec["id"] != row[1]:
                raise RuntimeError(f"dedup: {docs_path} changed while the stage read it (document {i})")
            pos, _, reason, dup_of, rep, j, incoming, matches, dup_count, members = row
            if reason == _KEPT:
                meta = dict(rec.get("metadata") or {})
                meta[DUP_COUNT] = dup_count
                meta[DUP_MEMBERS] = _listed_members(db, pos, incoming, members, params.max_members_listed)
                if flagged and matches is not None:
                    meta[CONTAMINATION] = orjson.loads(matches)[:_MAX_FLAGS]
                rec["metadata"] = meta
                writer.write(dict(rec))
            elif len(samples[_REASON_OF[reason]]) < params.dropped_samples:
                sample: dict[str, Any] = {"id": rec["id"], "reason": _REASON_OF[reason], "domain": rec.get("domain")}
                if reason == _CONTAMINATED:
                    sample["matches"] = orjson.loads(matches)[:_MAX_FLAGS]
                else:
                    sample["duplicate_of"] = _id_of(db, dup_of)
                    sample["representative"] = _id_of(db, rep)
                    if j is not None:
                        sample["jaccard"] = round(j, 4)
                sample["text"] = rec["text"][:2000]
                samples[_REASON_OF[reason]].append(sample)
    return writer.count, samples


def _cluster_row(db: sqlite3.Connection, rep: int, rep_id: str, dup_count: int) -> Iterator[bytes]:
    """One line of clusters.jsonl.gz in pieces, a member at a time: the bytes ``orjson.dumps`` gives for
    {"representative", "dup_count", "members": [{"id", "reason", "duplicate_of", "jaccard"?}, ...]}."""
    yield b'{"representative":' + orjson.dumps(rep_id) + b',"dup_count":' + orjson.dumps(dup_count) + b',"members":['
    for k, (member_id, reason, dup_of_id, j, _) in enumerate(db.execute(_MEMBERS, (rep,))):
        member = {"id": member_id, "reason": _REASON_OF[reason], "duplicate_of": dup_of_id,
                  **({"jaccard": round(j, 4)} if j is not None else {})}
        yield (b"," if k else b"") + orjson.dumps(member)
    yield b"]}"


def _write_clusters(db: sqlite3.Connection, path: Path) -> int:
    """clusters.jsonl.gz: one row per representative with members, in input order."""
    with JsonlGzWriter(path) as out:
        for rep, rep_id, dup_count in db.execute(
                "SELECT cluster.rep, doc.id, cluster.dup_count FROM cluster JOIN doc ON doc.pos = cluster.rep "
                "WHERE cluster.members > 0 ORDER BY cluster.rep"):
            out.write_pieces(_cluster_row(db, rep, rep_id, dup_count))
        return out.count


# --- the stage ------------------------------------------------------------------------------------
def run(params: DedupParams, ctx: StageContext) -> None:
    start = time.perf_counter()
    docs_path = ctx.input("documents").path
    shingler = Shingler()
    index = build_contamination_index(params, ctx, shingler)
    if index is not None:
        ctx.progress(f"decontaminating against {len(index.tallies)} eval set(s), "
                     f"{len(index.items)} checkable items")
    work = ctx.work_dir / "minhash"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sig_step = signature_step(params, work / "signatures", shingler)
    with _state(work / "state.sqlite") as db:
        # pass 1: exact groups + contamination + signatures of the leaders; then LSH buckets
        ctx.progress(f"reading {docs_path} (MinHash {params.bands}x{params.rows}, {params.n_grams}-grams, "
                     f"{params.word_tokenizer} words, S-curve {params.s_curve_threshold:.3f}, verify: "
                     f"{params.verify} at Jaccard {params.jaccard_threshold})")
        n = _first_pass(params, ctx, docs_path, db, index, work / "signature_docs.i64")
        if n.docs == 0:
            raise ValueError(f"dedup: documents artifact {docs_path} holds no documents")
        mh = _run_minhash(params, ctx, docs_path, db, n.leaders, work)
        t_minhash = time.perf_counter()

        # near duplicates (pass 2 over the candidates' documents for their exact shingle sets)
        _base_decisions(params, db)
        if params.verify == "exact":
            verification = _near_exact(params, ctx, docs_path, db, mh, sig_step, work)
        else:
            verification = _near_estimate(params, ctx, docs_path, db, sig_step, work)
        _clusters(db)
        t_verify = time.perf_counter()

        # pass 3: write kept documents with their cluster metadata; samples of the dropped
        written, samples = _write_documents(params, ctx, docs_path, db, n.docs)
        t_write = time.perf_counter()
        n_cluster_rows = _write_clusters(db, ctx.out_dir / CLUSTERS_NAME)
        write_jsonl_gz(ctx.out_dir / DROPPED_SAMPLES_NAME, [s for r in DROP_REASONS for s in samples[r]])

        # accounting: every document is kept or dropped with one reason
        by_reason = dict(db.execute("SELECT reason, COUNT(*) FROM doc GROUP BY reason").fetchall())
        counts = {r: by_reason.get(code, 0) for code, r in _REASON_OF.items()}
        kept = by_reason.get(_KEPT, 0)
        if n.docs != kept + sum(counts.values()) or kept != written:
            raise RuntimeError(f"dedup accounting is off: in {n.docs} != kept {kept} (written {written}) + "
                               f"dropped {counts} (a bug in data/dedup.py)")

        # per-domain and per-eval-set tallies
        domains: dict[str, Counter[str]] = defaultdict(Counter)
        for dom, reason, count in db.execute("SELECT domain, reason, COUNT(*) FROM doc GROUP BY domain, reason"):
            domains[dom]["in"] += count
            domains[dom]["kept" if reason == _KEPT else _REASON_OF[reason]] += count
        contaminated_docs = 0
        for size, matches in db.execute("SELECT size, matches FROM grp WHERE matches IS NOT NULL ORDER BY gid"):
            contaminated_docs += size
            if index is not None:
                found = orjson.loads(matches)
                for name in {m["eval_set"] for m in found}:
                    index.tallies[name].contaminated_docs += size
                for m in found:
                    index.tallies[m["eval_set"]].matched_items.add(m["item"])
                    index.tallies[m["eval_set"]].matches[m["method"]] += 1
        dup_counts: Counter[int] = Counter(dict(db.execute(
            "SELECT dup_count, COUNT(*) FROM cluster GROUP BY dup_count").fetchall()))
        clusters = _scalar(db, f"SELECT COUNT(DISTINCT dup_of) FROM doc WHERE reason = {_NEAR}")

    total_s = time.perf_counter() - start
    precision = verification["precision"] if params.verify == "exact" else verification["precision_estimate"]
    report = {
        "documents": {"in": n.docs, "kept": kept, "dropped": counts, "bytes_in": n.bytes},
        "exact": {"groups": n.groups,
                  "normalization": "whitespace collapsed" + (", casefolded" if params.exact_casefold else "")},
        "minhash": {
            "n_grams": params.n_grams, "bands": params.bands, "rows": params.rows,
            "hashes": params.bands * params.rows, "word_tokenizer": params.word_tokenizer,
            "s_curve_threshold": round(params.s_curve_threshold, 4),
            "detection_probability": {str(j): round(params.detection_probability(j), 4)
                                      for j in (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)},
            "leaders": n.leaders, "leaders_with_signature": mh.signed,
            "leaders_too_short": n.leaders - mh.signed,
            "clusters": clusters,
        },
        "cluster_sizes": {str(k): v for k, v in sorted(dup_counts.items()) if k > 1},
        "verification": verification,
        "decontamination": None if index is None else {
            "mode": params.decontamination, "contaminated_docs": contaminated_docs,
            "ngram": params.contamination_ngram, "min_words": params.contamination_min_words,
            "containment_threshold": params.contamination_containment,
            "jaccard_threshold": params.contamination_jaccard, "num_perm": params.contamination_num_perm,
            "eval_sets": {name: t.as_report() for name, t in sorted(index.tallies.items())},
        },
        "domains": {dom: {k: c[k] for k in ("in", "kept", *DROP_REASONS)} for dom, c in sorted(domains.items())},
        "params": params.model_dump(),
        "files": {"clusters": CLUSTERS_NAME, "cluster_rows": n_cluster_rows,
                  "dropped_samples": DROPPED_SAMPLES_NAME},
    }
    report_path = ctx.out_dir / REPORT_NAME
    report_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    ctx.log_artifact(report_path)

    ctx.set_rows("documents", kept)
    for r, c in counts.items():
        ctx.set_rows(r, c)
    ctx.log_summary({"in": n.docs, "kept": kept, "exact_duplicates": counts["exact_duplicate"],
                     "near_duplicates": counts["near_duplicate"], "contaminated": contaminated_docs,
                     "near_precision": float("nan") if precision is None else precision})
    metrics: dict[str, float] = {
        "s_curve_threshold": params.s_curve_threshold, "clusters": clusters,
        "near_pairs": verification["near_pairs"], "pairs_verified": verification["pairs_checked"],
        "lsh_pairs": verification["lsh_pairs"],
        "seconds.read_minhash": t_minhash - start, "seconds.verify": t_verify - t_minhash,
        "seconds.write": t_write - t_verify, "seconds.total": total_s,
        "docs_per_s": n.docs / total_s, "mb_per_s": n.bytes / 1e6 / total_s,
    }
    for key in ("candidate_pairs", "skipped_by_estimate", "checked_below_threshold", "min_member_jaccard",
                "edge_precision_estimate"):
        if verification.get(key) is not None:
            metrics[key] = verification[key]
    for dom, c in sorted(domains.items()):
        key = metric_key(dom)
        metrics[f"dup_rate.{key}"] = (c["exact_duplicate"] + c["near_duplicate"]) / c["in"]
        metrics[f"exact_rate.{key}"] = c["exact_duplicate"] / c["in"]
        metrics[f"near_rate.{key}"] = c["near_duplicate"] / c["in"]
    if index is not None:
        for name, t in sorted(index.tallies.items()):
            metrics[f"contaminated_docs.{metric_key(name)}"] = t.contaminated_docs
    ctx.log_metrics(metrics)
    ctx.log_figure(_cluster_size_figure(dup_counts), "cluster_sizes.png")
    ctx.log_figure(_domain_rates_figure(domains), "dup_rates_by_domain.png")

    if precision is not None and precision < 0.5 and params.verify == "estimate":
        ctx.logger.warning("dedup: only %.0f%% of %d verified near pairs reach Jaccard %.2f with their "
                           "representative; use verify: exact", 100 * precision,
                           verification["pairs_checked"], params.jaccard_threshold)
    ctx.progress(f"{n.docs} documents ({n.bytes / 1e6:.1f} MB) in {total_s:.1f}s: kept {kept}, exact "
                 f"{counts['exact_duplicate']}, near {counts['near_duplicate']}, contaminated "
                 f"{contaminated_docs} ({params.decontamination}); near-duplicate precision "
                 f"{'n/a' if precision is None else f'{precision:.3f}'}"
                 f"{' (estimate)' if params.verify == 'estimate' else ''}")


def _cluster_size_figure(dup_counts: Counter[int]) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global backend state in a worker

    fig = Figure(figsize=(5.5, 3.5))
    ax = fig.add_subplot()
    sizes = sorted(k for k in dup_counts if k > 1)
    if sizes:
        ax.bar([str(k) for k in sizes], [dup_counts[k] for k in sizes], color="tab:blue")
        ax.set_yscale("log")
        ax.tick_params(axis="x", labelrotation=90 if len(sizes) > 12 else 0, labelsize=7)
    else:
        ax.text(0.5, 0.5, "no duplicates", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("cluster size (dup_count of the kept representative)")
    ax.set_ylabel("clusters")
    ax.set_title(f"Duplicate clusters: {sum(dup_counts[k] for k in sizes)} with size > 1", fontsize=9)
    return fig


def _domain_rates_figure(domains: dict[str, Counter[str]]) -> Any:
    from matplotlib.figure import Figure

    names = sorted(domains)
    fig = Figure(figsize=(max(4.0, 0.7 * len(names) + 2), 3.5))
    ax = fig.add_subplot()
    bottom = np.zeros(len(names))
    for reason, color in zip(DROP_REASONS, ("tab:blue", "tab:orange", "tab:red"), strict=True):
        rates = np.array([domains[n][reason] / domains[n]["in"] for n in names])
        ax.bar(names, rates, bottom=bottom, label=reason, color=color)
        bottom += rates
    ax.set_ylabel("share of the domain's documents dropped")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelrotation=45)
    ax.set_title("Dropped by dedup per domain", fontsize=9)
    return fig


def fingerprint(params: DedupParams) -> list[dict[str, Any]]:
    """Content of the decontamination files, for the cache key: edit an eval set and dedup reruns."""
    return [file_fingerprint(p) for p in resolve_decontaminate_paths(params.decontaminate_paths)]


def validate_external(params: DedupParams) -> list[tuple[str, str]]:
    """At spec validation: every ``decontaminate_paths`` entry names a file."""
    problems: list[tuple[str, str]] = []
    for i, pattern in enumerate(params.decontaminate_paths):
        try:
            resolve_decontaminate_paths([pattern])
        except FileNotFoundError as e:
            problems.append((f"decontaminate_paths.{i}", str(e).removeprefix("dedup: ")))
    return problems


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("dedup_report.json", "plots/*"),
    name="dedup",
    params=DedupParams,
    run=run,
    produces=DOCUMENTS_TYPE,
    inputs={
        "documents": InputSpec(ANY_DOCUMENTS, doc="documents to deduplicate (scored ones keep their scores)"),
        "eval_sets": InputSpec(EVALSET_TYPE, required=False, many=True,
                               doc="evaluation sets (*.jsonl[.gz] inside) to decontaminate against"),
    },
    fingerprint=fingerprint,
    validate_external=validate_external,
    splits_work=True,
    doc=("Exact (normalized-text hash) and near-duplicate removal: datatrove MinHash-LSH candidates with a "
         "fast word tokenizer, then the exact shingle Jaccard decides (nothing below jaccard_threshold is "
         "dropped); one representative per cluster keeps dup_count and dup_members; n-gram-containment "
         "and MinHash-LSH decontamination against eval sets; in = kept + dropped per reason is checked."),
)
