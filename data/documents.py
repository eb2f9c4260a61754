"""The normalized document dataset every data stage reads and writes (artifact type ``documents``).

Layout: ``<artifact>/documents/part-NNNNN.jsonl.gz``, one JSON object per line with the fields of
:class:`DocumentRecord`. It is plain gzip'd JSON Lines so datatrove's ``JsonlReader`` reads it directly
(:func:`datatrove_reader`) and people can ``zcat`` it.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterable, Iterator
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
# the quality contract (§4.1.1), read by quality, its labelers and scorer, and mix: the score dimensions
# in this order everywhere, their range, and the category field
QUALITY_DIMENSIONS = ("knowledge_depth", "helpfulness")
QUALITY_CATEGORY = "category"
SCORE_MIN, SCORE_MAX = 0.0, 5.0
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


class JsonlGzWriter:
    """One gzip'd JSON Lines file, written so the same rows give the same bytes: gzip ``mtime=0`` and no file
    name in the header (a stage that writes under a temporary name and renames, as long_context's sample index
    does, would otherwise record the temporary name, which holds its process id).

    Every JSONL.gz file of an artifact goes through here, so the artifact digest depends on content only.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.count = 0
        self._raw = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        self._fh: gzip.GzipFile | None = gzip.GzipFile(filename="", mode="wb", fileobj=self._raw, compresslevel=6,
                                                       mtime=0)

    def write(self, row: Any) -> None:
        if self._fh is None:
            raise ValueError(f"JsonlGzWriter: {self.path} is closed")
        self._fh.write(orjson.dumps(row) + b"\n")
        self.count += 1

    def write_pieces(self, pieces: Iterable[bytes], buffer_bytes: int = 1 << 16) -> None:
        """One row given as consecutive pieces of its JSON text, for a row too long to build at once (dedup's
        cluster with every member). The pieces joined must be what :meth:`write` would write for the row, less
        the newline; the file is then the same bytes (deflate's output does not depend on how its input is cut)."""
        if self._fh is None:
            raise ValueError(f"JsonlGzWriter: {self.path} is closed")
        buffer = bytearray()
        for piece in pieces:
            buffer += piece
            if len(buffer) >= buffer_bytes:
                self._fh.write(buffer)
                buffer.clear()
        self._fh.write(buffer)
        self._fh.write(b"\n")
        self.count += 1

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            finally:
                self._fh = None
                self._raw.close()

    def __enter__(self) -> JsonlGzWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_jsonl_gz(path: str | Path, rows: Iterable[Any]) -> int:
    """Write ``rows`` to one deterministic gzip'd JSONL file; returns how many were written."""
    with JsonlGzWriter(path) as w:
        for row in rows:
            w.write(row)
        return w.count


def read_jsonl_gz(path: str | Path) -> Iterator[Any]:
    """The rows of a gzip'd JSONL file, in order."""
    with gzip.open(path, "rb") as f:
        for line in f:
            yield orjson.loads(line)


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
        self._out: JsonlGzWriter | None = None

    def write(self, record: dict[str, Any]) -> None:
        if self._out is None or self.count % self.shard_docs == 0:
            self.close()
            self._shard += 1
            self._out = JsonlGzWriter(self.dir / f"{self.prefix}-{self._shard:05d}.jsonl.gz")
        self._out.write(record)
        self.count += 1

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def __enter__(self) -> DocumentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def document_files(artifact_path: str | Path, subdir: str = DOCUMENTS_DIR) -> list[Path]:
    return sorted((Path(artifact_path) / subdir).glob("*.jsonl.gz"))


def iter_documents(artifact_path: str | Path, subdir: str = DOCUMENTS_DIR) -> Iterator[DocumentRecord]:
    """All records of a documents artifact, in shard order."""
    for path in document_files(artifact_path, subdir):
        yield from read_jsonl_gz(path)


def count_documents(artifact_path: str | Path, subdir: str = DOCUMENTS_DIR) -> list[int]:
    """Documents (lines) in each file of :func:`document_files`, in order: decompressed, not parsed."""
    counts = []
    for path in document_files(artifact_path, subdir):
        with gzip.open(path, "rb") as f:
            counts.append(sum(1 for _ in f))
    return counts


def iter_document_range(artifact_path: str | Path, start: int, stop: int, file_counts: list[int] | None = None,
                        subdir: str = DOCUMENTS_DIR) -> Iterator[DocumentRecord]:
    """Records ``start`` to ``stop - 1`` (positions in :func:`iter_documents` order). Files wholly outside the
    range are not opened when ``file_counts`` (:func:`count_documents`) is given; lines before ``start`` in a
    file are skipped unparsed."""
    files = document_files(artifact_path, subdir)
    if file_counts is not None and len(file_counts) != len(files):
        raise ValueError(f"{artifact_path}: {len(files)} document files but {len(file_counts)} counts given")
    first = 0  # position of the current file's first document
    for k, path in enumerate(files):
        if first >= stop:
            return
        if file_counts is not None and first + file_counts[k] <= start:
            first += file_counts[k]
            continue
        with gzip.open(path, "rb") as f:
            for line in f:
                if first >= stop:
                    return
                if first >= start:
                    yield orjson.loads(line)
                first += 1


def merge_document_shards(shard_dirs: list[Path], out_dir: str | Path, subdir: str = DOCUMENTS_DIR) -> int:
    """The documents that shards wrote (each with a :class:`DocumentWriter` under its directory), in shard order,
    as one artifact's ``documents/``: the same files, byte for byte, as one writer given all of them in that
    order. One shard's files are moved (they are that writer's output); several are read and written again.
    Returns the number of documents."""
    out = Path(out_dir) / subdir
    if len(shard_dirs) == 1:
        src = Path(shard_dirs[0]) / subdir
        out.mkdir(parents=True, exist_ok=True)
        n = 0
        for path in sorted(src.glob("*.jsonl.gz")):
            with gzip.open(path, "rb") as f:
                n += sum(1 for _ in f)
            path.replace(out / path.name)
        return n
    with DocumentWriter(out_dir, subdir) as writer:
        for d in shard_dirs:
            for rec in iter_documents(d, subdir):
                writer.write(rec)
        return writer.count


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
    from datatrove.pipeline.readers import JsonlReader  # heavy: datatrove

    return JsonlReader(str(Path(artifact_path) / subdir), glob_pattern="*.jsonl.gz",
                       add_file_path=False, **kwargs)
