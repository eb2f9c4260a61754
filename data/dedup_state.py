"""Stage ``dedup``'s state on disk, in the work dir, so the stage's memory does not grow with the corpus.

- ``state.sqlite`` (:data:`SCHEMA`): a row per document (id, domain, length, incoming weight and members,
  exact group, decision), per exact group (hash, leader, contamination matches), per signature doc, per
  member of an LSH band group and per LSH pair, and each cluster's dup_count. The page cache is capped at
  :data:`CACHE_KIB`; the sorts (rank order, input order of members) spill to SQLite's temporary files.
- ``shingles.u64`` (:class:`ShingleStore`): the shingle sets the exact Jaccard needs, written in a second pass
  over the documents and read back one set at a time.

Each document's decision is one of the reason codes here (:data:`KEPT` or a :data:`DROP_REASONS` key).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np
from datatrove.pipeline.dedup.minhash import MinhashDedupSignature

from data.documents import EVAL_CONTAMINATION, iter_documents

# metadata set in decontamination: flag mode on contaminated kept documents
CONTAMINATION = EVAL_CONTAMINATION

DROP_REASONS: dict[str, str] = {
    "exact_duplicate": "same text (whitespace-collapsed) as a kept document or one of its near duplicates",
    "near_duplicate": "exact shingle Jaccard >= jaccard_threshold with the kept representative "
                      "(verify: estimate: in its MinHash-LSH cluster)",
    "eval_contamination": "contains or nearly copies an evaluation item (decontamination: drop)",
}
KEPT, EXACT, NEAR, CONTAMINATED = 0, 1, 2, 3
REASON_OF = {EXACT: "exact_duplicate", NEAR: "near_duplicate", CONTAMINATED: "eval_contamination"}
MAX_FLAGS = 10  # contamination matches kept per document

# --- the SQLite file ----------------------------------------------------------------------------------
CACHE_KIB = 16 * 1024  # SQLite page cache; sorts, DISTINCTs and IN-lists beyond it spill to temporary files
BATCH = 4096  # rows per executemany; LSH candidates per block of the near-duplicate check

SCHEMA = """
CREATE TABLE doc (                      -- one row per input document, no text
    pos INTEGER PRIMARY KEY,            -- position in iter_documents order
    id TEXT NOT NULL,
    domain TEXT NOT NULL,
    chars INTEGER NOT NULL,             -- of the whitespace-collapsed text
    weight INTEGER NOT NULL,            -- incoming dup_count (1 unless deduped before)
    incoming BLOB,                      -- incoming dup_members (JSON), NULL when none
    grp INTEGER NOT NULL,               -- its exact-duplicate group
    reason INTEGER NOT NULL DEFAULT 0,  -- KEPT / EXACT / NEAR / CONTAMINATED
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
def open_state(path: Path) -> Iterator[sqlite3.Connection]:
    """A fresh state database: scratch (no journal, no fsync), one transaction for the whole stage (dirty pages
    spill to the file when the cache is full), page cache capped at ``CACHE_KIB``. Committed, never rolled
    back, when closed: without a journal there is nothing to roll back with."""
    path.unlink(missing_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.executescript("PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF; PRAGMA locking_mode = EXCLUSIVE; "
                         f"PRAGMA temp_store = FILE; PRAGMA cache_size = -{CACHE_KIB};" + SCHEMA)
        db.execute("BEGIN")
        yield db
    finally:
        with suppress(sqlite3.Error):
            db.commit()
        db.close()


def scalar(db: sqlite3.Connection, sql: str, args: tuple[Any, ...] = ()) -> Any:
    return db.execute(sql, args).fetchone()[0]


class Rows:
    """Parameter rows of one SQL statement, executed ``BATCH`` at a time."""

    def __init__(self, db: sqlite3.Connection, sql: str) -> None:
        self.db, self.sql = db, sql
        self.rows: list[tuple[Any, ...]] = []

    def add(self, *row: Any) -> None:
        self.rows.append(row)
        if len(self.rows) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.db.executemany(self.sql, self.rows)
            self.rows = []


def int64s(path: Path, start: int, stop: int) -> Iterator[int]:
    """Items ``start`` to ``stop - 1`` of a file of little-endian int64, read a block at a time."""
    with open(path, "rb") as f:
        f.seek(8 * start)
        for block_start in range(start, stop, BATCH):
            yield from np.fromfile(f, dtype="<i8", count=min(BATCH, stop - block_start)).tolist()


def u32_records(path: Path, width: int) -> Iterator[np.ndarray]:
    """A file of records of ``width`` little-endian uint32 (datatrove's .dups and .clusters), as [k, width] int64
    blocks of at most ``BATCH`` records."""
    with open(path, "rb") as f:
        while len(block := np.fromfile(f, dtype="<u4", count=BATCH * width)):
            yield block.reshape(-1, width).astype(np.int64)



class ShingleStore:
    """Unique shingles (sorted uint64) of the leaders that the exact Jaccard needs, computed in a second pass over
    the documents and appended to one file; table ``shingle`` holds each one's (offset, count)."""

    def __init__(self, path: Path, db: sqlite3.Connection) -> None:
        self.path, self.db = path, db
        self.fd = -1

    def fill(self, docs_path: Path, leaders: Iterator[int], sig_step: MinhashDedupSignature) -> None:
        """Shingles of ``leaders`` (document positions, ascending)."""
        index = Rows(self.db, "INSERT INTO shingle (pos, offset, count) VALUES (?, ?, ?)")
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
