"""The normalized document dataset every data stage reads and writes (artifact type ``documents``).

Layout: ``<artifact>/documents/part-NNNNN.jsonl.gz``, one JSON object per line with the fields of
:class:`DocumentRecord`. It is plain gzip'd JSON Lines so datatrove's ``JsonlReader`` reads it directly
(:func:`datatrove_reader`) and people can ``zcat`` it.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import orjson

DOCUMENTS_TYPE = "documents"
# documents that carry quality scores (metadata[QUALITY]); accepted wherever documents are
SCORED_DOCUMENTS_TYPE = "scored_documents"
ANY_DOCUMENTS = (DOCUMENTS_TYPE, SCORED_DOCUMENTS_TYPE)
DOCUMENTS_DIR = "documents"
SCHEMA_VERSION = 1

# metadata fields later stages rely on (one source of truth for their names)
DUP_COUNT = "dup_count"  # set by dedup on each kept document: size of its duplicate cluster (>= 1)
DUP_MEMBERS = "dup_members"  # set by dedup: ids of the removed members of its cluster
QUALITY = "quality"  # set by quality: {"knowledge_depth": 0-5, "helpfulness": 0-5, "category": str}
LANGUAGE = "language"  # set by clean's language filter on kept documents
LANGUAGE_SCORE = "language_score"
EVAL_CONTAMINATION = "eval_contamination"  # set by dedup in flag mode: the eval sets a document overlaps
EVALSET_TYPE = "evalset"  # artifact type of evaluation sets (*.jsonl[.gz] with id + text/prompt/question)


def unit_hash(seed: int, purpose: str, doc_id: str) -> float:
    """A uniform number in [0, 1) from (seed, purpose, id): same input -> same choice, on any machine."""
    h = hashlib.blake2b(f"{seed}\x00{purpose}\x00{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


class DocumentRecord(TypedDict):
    id: str
    text: str
    source: str
    domain: str
    metadata: dict[str, Any]


class DocumentWriter:
    """Writes documents into gzip'd JSONL shards of at most ``shard_docs`` documents."""

    def __init__(self, out_dir: str | Path, subdir: str = DOCUMENTS_DIR, shard_docs: int = 50_000,
                 prefix: str = "part") -> None:
        self.dir = Path(out_dir) / subdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_docs = shard_docs
        self.prefix = prefix
        self.count = 0
        self._shard = -1
        self._fh: gzip.GzipFile | None = None

    def _open_next(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._shard += 1
        path = self.dir / f"{self.prefix}-{self._shard:05d}.jsonl.gz"
        # mtime=0 keeps the bytes (and so the artifact digest) deterministic
        self._fh = gzip.GzipFile(path, "wb", compresslevel=6, mtime=0)

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None or self.count % self.shard_docs == 0:
            self._open_next()
        assert self._fh is not None
        self._fh.write(orjson.dumps(record) + b"\n")
        self.count += 1

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> DocumentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def document_files(artifact_path: str | Path, subdir: str = DOCUMENTS_DIR) -> list[Path]:
    return sorted((Path(artifact_path) / subdir).glob("*.jsonl.gz"))


def iter_documents(artifact_path: str | Path, subdir: str = DOCUMENTS_DIR) -> Iterator[DocumentRecord]:
    """All records of a documents artifact, in shard order."""
    for path in document_files(artifact_path, subdir):
        with gzip.open(path, "rb") as f:
            for line in f:
                yield orjson.loads(line)


def record_from_datatrove(doc: Any) -> DocumentRecord:
    """datatrove ``Document`` (as read by :func:`datatrove_reader`) -> our record."""
    meta = dict(doc.metadata)
    meta.pop("file_path", None)
    return {
        "id": doc.id,
        "text": doc.text,
        "source": meta.pop("source", ""),
        "domain": meta.pop("domain", ""),
        "metadata": meta.pop("metadata", {}) | meta,
    }


def datatrove_reader(artifact_path: str | Path, subdir: str = DOCUMENTS_DIR, **kwargs: Any) -> Any:
    """A datatrove ``JsonlReader`` over a documents artifact; ``source``/``domain`` land in metadata."""
    from datatrove.pipeline.readers import JsonlReader

    return JsonlReader(str(Path(artifact_path) / subdir), glob_pattern="*.jsonl.gz",
                       add_file_path=False, **kwargs)
