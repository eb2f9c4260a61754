"""Stage ``ingest``'s readers: datatrove's JSONL and Parquet readers, subclassed so that every physical record is
either a valid document or a :class:`QuarantinedRecord` with a reason from :data:`QUARANTINE_REASONS` (the stock
readers skip a bad line with a warning, lose a file at a ``UnicodeDecodeError`` and drop a record without text).
JSONL is read as bytes, decompressed a chunk at a time, and a line longer than ``max_record_bytes`` is never held
whole."""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import zstandard
from datatrove.data import Document
from datatrove.pipeline.readers import JsonlReader, ParquetReader

from data.documents import JsonlGzWriter
from data.ingest_inputs import COMPRESSIONS, InputFile
from data.ingest_params import IngestParams

RAW_LIMIT_BYTES = 2048  # quarantine keeps this much of each bad record

QUARANTINE_REASONS: dict[str, str] = {
    "bad_json": "the line is not valid JSON",
    "invalid_utf8": "the line is not valid UTF-8",
    "blank_line": "the line is empty or only whitespace",
    "not_an_object": "the record is a JSON value other than an object",
    "missing_text": "the text field is absent or null",
    "text_not_string": "the text field is not a string",
    "empty_text": "the text is empty or only whitespace",
    "too_short": "the text has fewer than min_chars characters",
    "too_long": "the JSONL line (or Parquet row as JSON) is longer than max_record_bytes",
    "nul_in_text": "the text holds NUL (U+0000) characters: binary or mis-decoded data",
    "bad_id_type": "the id is present but not a non-empty string or an integer",
    "bad_domain_type": "the domain field is present but not a string",
    "bad_source_type": "the source field is present but not a string",
    "bad_metadata_type": "metadata is not an object (or JSON text of one), or holds values JSON cannot hold",
    "duplicate_id": "an earlier record in input order has the same id",
    "corrupt_file": "the rest of the file could not be read (counts as one record)",
}

_CHUNK_BYTES = 1 << 16  # small, so a truncated stream loses at most this much before the damage
_ZSTD_FEED_BYTES = 1 << 10  # zstd can expand 1 KiB to ~40 MiB: feed it little at a time
# what a damaged or cut-short compressed stream raises (zlib, lzma and zstd errors are no OSError)
_STREAM_ERRORS = (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError, zstandard.ZstdError)
_UTF8_BOM = b"\xef\xbb\xbf"


class RecordRejected(Exception):
    """Raised by the adapter for a record that must be quarantined."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in QUARANTINE_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class QuarantinedRecord:
    file: str
    line: int
    reason: str
    detail: str
    raw: str

    @classmethod
    def of(cls, file: str, line: int, reason: str, detail: str, raw: bytes) -> QuarantinedRecord:
        return cls(file, line, reason, detail, raw[:RAW_LIMIT_BYTES].decode("utf-8", errors="replace"))


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class _AccountingReader:
    """What both readers share: the validating adapter, the reject path and the read counter.

    ``read_file`` yields only valid documents; every other record goes to ``on_reject``. After a file,
    ``records_read`` == documents yielded + records rejected.
    """

    def _setup(self, source: InputFile, params: IngestParams, seen_ids: set[str],
               on_reject: Callable[[QuarantinedRecord], None]) -> None:
        self.source = source
        self.params = params
        self.seen_ids = seen_ids  # shared across the run's readers: ids are unique over all inputs
        self.on_reject = on_reject
        self.records_read = 0
        self.add_file_path = False  # our source/file go into the record itself

    def _reject(self, line: int, reason: str, detail: str, raw: bytes) -> None:
        self.stat_update(f"quarantined.{reason}")  # type: ignore[attr-defined]  # datatrove counters
        self.on_reject(QuarantinedRecord.of(self.source.display, line, reason, detail, raw))

    def _record(self, data: Any, line: int, raw: bytes) -> Document | None:
        try:
            return self.get_document_from_dict(data, self.source.display, line)  # type: ignore[attr-defined]
        except RecordRejected as r:
            self._reject(line, r.reason, r.detail, raw)
            return None

    def _optional_str(self, data: dict, key: str, reason: str) -> str | None:
        value = data.pop(key, None)
        if value is not None and not isinstance(value, str):
            raise RecordRejected(reason, f"{key!r} is {_type_name(value)}, expected a string")
        return value or None

    def _default_adapter(self, data: Any, path: str, id_in_file: int) -> dict:
        """Validate and normalize one record; datatrove calls this through ``get_document_from_dict``."""
        p = self.params
        if not isinstance(data, dict):
            raise RecordRejected("not_an_object", f"a JSON {_type_name(data)}, expected an object")
        data = dict(data)
        text = data.pop(p.text_key, None)
        if text is None:
            raise RecordRejected("missing_text", f"no {p.text_key!r} value (keys: {', '.join(sorted(data))})")
        if not isinstance(text, str):
            raise RecordRejected("text_not_string", f"{p.text_key!r} is {_type_name(text)}")
        if not text.strip():
            raise RecordRejected("empty_text", f"{p.text_key!r} is {text!r}")
        if "\x00" in text:
            raise RecordRejected("nul_in_text", f"{p.text_key!r} holds {text.count(chr(0))} NUL character(s), "
                                 f"the first at character {text.index(chr(0))}")
        if len(text) < p.min_chars:
            raise RecordRejected("too_short", f"{len(text)} characters < min_chars={p.min_chars}")

        doc_id = data.pop(p.id_key, None)
        if doc_id is None:
            doc_id = f"{self.source.key}/{id_in_file}"
        elif isinstance(doc_id, bool) or not isinstance(doc_id, str | int) or doc_id == "":
            raise RecordRejected("bad_id_type", f"{p.id_key!r} is {doc_id!r:.80}")
        doc_id = str(doc_id)

        domain = self._optional_str(data, p.domain_key, "bad_domain_type") or p.default_domain
        source = self._optional_str(data, p.source_key, "bad_source_type") or f"{path}:{id_in_file}"

        metadata = data.pop("metadata", None)
        if isinstance(metadata, str):  # datatrove's convention: metadata may be JSON text
            try:
                metadata = orjson.loads(metadata)
            except orjson.JSONDecodeError as e:
                raise RecordRejected("bad_metadata_type", f"metadata is a string but not JSON ({e})") from e
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise RecordRejected("bad_metadata_type", f"metadata is {_type_name(metadata)}, expected an object")
        metadata = metadata | data  # other top-level fields join metadata (top level wins, as in documents.py)
        try:
            orjson.dumps(metadata)
        except TypeError as e:  # Parquet columns can hold bytes, decimals...
            raise RecordRejected("bad_metadata_type", f"metadata cannot be written as JSON ({e})") from e

        # checked last so that only accepted records claim their id
        if doc_id in self.seen_ids:
            raise RecordRejected("duplicate_id", f"id {doc_id!r} was already ingested")
        self.seen_ids.add(doc_id)
        # the shape record_from_datatrove() turns into a DocumentRecord
        return {"text": text, "id": doc_id,
                "metadata": {"source": source, "domain": domain, "metadata": metadata}}


def _compression(filepath: str) -> str | None:
    return COMPRESSIONS.get(Path(filepath).suffix.lower())


def _zstd_chunks(raw: BinaryIO) -> Iterator[bytes]:
    """Decompressed zstd frames, one after another. python-zstandard's stream reader ends silently
    where a file is cut short; here that is an ``EOFError``, like gzip's, bz2's and xz's."""
    dctx = zstandard.ZstdDecompressor()
    frame = None  # the frame being decoded, None between frames
    out: list[bytes] = []
    size = 0
    while block := raw.read(_CHUNK_BYTES):
        for i in range(0, len(block), _ZSTD_FEED_BYTES):
            data = block[i:i + _ZSTD_FEED_BYTES]
            while data:
                frame = frame or dctx.decompressobj()
                piece = frame.decompress(data)
                out.append(piece)
                size += len(piece)
                data, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
            if size >= _CHUNK_BYTES:
                yield b"".join(out)
                out, size = [], 0
    if size:
        yield b"".join(out)
    if frame is not None:
        raise EOFError("the zstd stream ends inside a frame (file cut short?)")


def _chunks(raw: BinaryIO, compression: str | None) -> Iterator[bytes]:
    """The decompressed bytes of a file, at most about 64 KiB at a time."""
    if compression == "zstd":
        yield from _zstd_chunks(raw)
        return
    f: Any = {None: lambda r: r, "gzip": lambda r: gzip.GzipFile(fileobj=r, mode="rb"),
              "bz2": bz2.BZ2File, "xz": lzma.LZMAFile}[compression](raw)
    while chunk := f.read(_CHUNK_BYTES):
        yield chunk


def _lines(chunks: Iterable[bytes], max_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(line without its ``\\n``, its length in bytes) for every line of a byte stream. A line longer than
    ``max_bytes`` is not held whole: only its first RAW_LIMIT_BYTES come back, with its full length."""
    pending: list[bytes] = []  # the unfinished line (only its start, once it is too long)
    size = 0

    def add(part: bytes) -> None:
        nonlocal pending, size
        was_over = size > max_bytes
        size += len(part)
        if not was_over:
            pending.append(part)
            if size > max_bytes:  # keep its start for the quarantine, drop the rest
                head = bytearray()
                for piece in pending:
                    head += piece[:RAW_LIMIT_BYTES - len(head)]
                    if len(head) == RAW_LIMIT_BYTES:
                        break
                pending = [bytes(head)]

    def take() -> tuple[bytes, int]:
        nonlocal pending, size
        line = b"".join(pending), size
        pending, size = [], 0
        return line

    for chunk in chunks:
        *complete, tail = chunk.split(b"\n")
        for part in complete:
            if pending:
                add(part)
                yield take()
            else:
                yield (part if len(part) <= max_bytes else part[:RAW_LIMIT_BYTES]), len(part)
        if tail:
            add(tail)
    if pending:  # the last line has no \n
        yield take()


class IngestJsonlReader(_AccountingReader, JsonlReader):
    """datatrove's JsonlReader, reading bytes so that each bad line is quarantined, not the file lost."""

    name = "🐿 Jsonl (ingest)"

    def __init__(self, source: InputFile, params: IngestParams, seen_ids: set[str],
                 on_reject: Callable[[QuarantinedRecord], None]) -> None:
        super().__init__(str(source.path.parent), compression=None, text_key=params.text_key,
                         id_key=params.id_key)
        self._setup(source, params, seen_ids, on_reject)

    def read_file(self, filepath: str) -> Iterator[Document]:
        limit = self.params.limit
        with self.data_folder.open(filepath, "rb") as f:
            lines = _lines(_chunks(f, _compression(filepath)), self.params.max_record_bytes)
            line_no = 0
            while limit is None or line_no < limit:
                try:
                    raw, size = next(lines)
                except StopIteration:
                    break
                except _STREAM_ERRORS as e:  # cut-short or damaged gzip/bz2/xz/zstd...
                    self.records_read += 1
                    self._reject(line_no + 1, "corrupt_file",
                                 f"unreadable after line {line_no}: {type(e).__name__}: {e}", b"")
                    break
                line_no += 1
                self.records_read += 1
                with self.track_time():
                    doc = self._parse_line(raw, size, line_no)
                del raw  # a long line is not kept while its document is written
                if doc is not None:
                    yield doc

    def _parse_line(self, raw: bytes, size: int, line_no: int) -> Document | None:
        if size > self.params.max_record_bytes:
            self._reject(line_no, "too_long", f"the line is {size} bytes > max_record_bytes="
                         f"{self.params.max_record_bytes}", raw)
            return None
        body = raw[len(_UTF8_BOM):] if line_no == 1 and raw.startswith(_UTF8_BOM) else raw
        try:
            blank = not body.decode("utf-8").strip()  # strict: bad bytes are never silently replaced
        except UnicodeDecodeError as e:
            self._reject(line_no, "invalid_utf8", str(e), raw)
            return None
        if blank:
            self._reject(line_no, "blank_line", "empty or whitespace-only line", raw)
            return None
        try:
            data = orjson.loads(body)  # from the bytes: no second copy of a long line as str
        except orjson.JSONDecodeError as e:
            self._reject(line_no, "bad_json", str(e), raw)
            return None
        return self._record(data, line_no, raw)


class IngestParquetReader(_AccountingReader, ParquetReader):
    """datatrove's ParquetReader, checking each row's fields instead of dropping rows without text."""

    name = "📒 Parquet (ingest)"

    def __init__(self, source: InputFile, params: IngestParams, seen_ids: set[str],
                 on_reject: Callable[[QuarantinedRecord], None]) -> None:
        super().__init__(str(source.path.parent), text_key=params.text_key, id_key=params.id_key,
                         batch_size=min(1000, params.limit or 1000))
        self._setup(source, params, seen_ids, on_reject)

    def read_file(self, filepath: str) -> Iterator[Document]:
        import pyarrow as pa  # heavy: only Parquet inputs need it
        import pyarrow.parquet as pq  # heavy: pyarrow, only for Parquet inputs

        limit = self.params.limit
        row_no = 0
        pqf = None
        with self.data_folder.open(filepath, "rb") as f:
            try:
                # page CRCs, where the writer stored them, catch damage that would otherwise decode as text
                pqf = pq.ParquetFile(f, page_checksum_verification=True)
                for batch in pqf.iter_batches(batch_size=self.batch_size):
                    for row in batch.to_pylist():
                        if limit is not None and row_no >= limit:
                            return
                        row_no += 1
                        self.records_read += 1
                        raw = orjson.dumps(row, default=repr)
                        if len(raw) > self.params.max_record_bytes:
                            self._reject(row_no, "too_long", f"the row is {len(raw)} bytes as JSON > "
                                         f"max_record_bytes={self.params.max_record_bytes}", raw)
                            continue
                        with self.track_time():
                            doc = self._record(row, row_no, raw)
                        if doc is not None:
                            yield doc
            except (pa.ArrowException, OSError, ValueError) as e:
                self.records_read += 1
                total = pqf.metadata.num_rows if pqf is not None else None  # None: the footer is unreadable
                lost = f" ({total - row_no} of its {total} rows unread)" if total is not None else ""
                self._reject(row_no + 1, "corrupt_file",
                             f"unreadable after row {row_no}{lost}: {type(e).__name__}: {e}", b"")


READERS: dict[str, type[IngestJsonlReader] | type[IngestParquetReader]] = {
    "jsonl": IngestJsonlReader, "parquet": IngestParquetReader}


class QuarantineWriter(JsonlGzWriter):
    """``quarantine.jsonl.gz``: one JSON object per rejected record."""

    def write(self, q: QuarantinedRecord) -> None:
        super().write({"file": q.file, "line": q.line, "reason": q.reason, "detail": q.detail, "raw": q.raw})
