"""Stage ``ingest``: JSONL / Parquet files (and the shipped sample corpus) -> one ``documents`` dataset.

Every physical record of every input is either written as a normalized document
(:class:`data.documents.DocumentRecord`) or kept in ``quarantine.jsonl.gz`` with a reason from
:data:`QUARANTINE_REASONS`, so ``read == ingested + quarantined`` holds and is checked.

Reading goes through datatrove's ``JsonlReader`` / ``ParquetReader``, subclassed because the stock ones
drop data silently (a bad JSON line is skipped with a warning, a ``UnicodeDecodeError`` ends the whole
file, a document without text is dropped). Ours read bytes and decode each line strictly, and their
adapter validates each record and raises :class:`RecordRejected` instead of returning nothing.

Decisions a reader of the output should know:

- **Order.** The sample corpus first, then ``paths`` in the order given; each pattern's matches sorted.
  A file matched twice is read once. Output order is input order, so reruns are byte-identical.
- **ids.** A record's own id is kept verbatim (ints become strings). A record without one gets
  ``"<file key>/<line>"``, the file key being the file's stem (``part-0.jsonl.gz`` -> ``part-0``), or
  its path when two inputs share a stem. An id seen earlier in input order is quarantined as
  ``duplicate_id``: the first occurrence wins; records are never re-id'd.
- **Lines** are 1-based physical line numbers in JSONL (blank lines included, and quarantined as
  ``blank_line``) and 1-based row numbers in Parquet.
- **limit** caps the records *read* per file, good or bad, so a limited run is a prefix of each file.
- **A corrupt file** (a gzip/bz2/xz/zstd stream cut short or damaged, bad Parquet) keeps what was read
  before the damage (less up to 64 KiB of JSONL, or the Parquet batch, being decoded when it struck); the
  unreadable rest counts as one quarantined record with reason ``corrupt_file``.
- **Size.** A JSONL line (or a Parquet row, as JSON) longer than ``max_record_bytes`` is quarantined as
  ``too_long`` with its first 2 KiB. Such a JSONL line is never held whole: skipping it costs about
  ``max_record_bytes`` of memory however long it is, while ingesting a line of N bytes costs about 4N (its
  bytes, the parsed text, the JSON written out). A Parquet row is in memory anyway.
- **Text is kept verbatim**: no Unicode normalization, whitespace kept; only a UTF-8 byte order mark
  at the start of a JSONL file is dropped. Text holding NUL (U+0000) is quarantined as ``nul_in_text``
  (binary or mis-decoded data, e.g. UTF-16 read as UTF-8). JSON is parsed by orjson: integers beyond
  64 bits become floats (so such an id is ``bad_id_type``), numbers beyond a double are ``bad_json``.
- **Paths** are shown (in ``source`` and the quarantine) as written in ``paths``: relative patterns
  stay relative to the working directory, so the output does not depend on where a checkout lives.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import json
import logging
import lzma
import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson
import zstandard
from datatrove.data import Document
from datatrove.pipeline.readers import JsonlReader, ParquetReader
from pydantic import Field, field_validator, model_validator

from data.documents import DOCUMENTS_TYPE, DocumentWriter, JsonlGzWriter, record_from_datatrove
from pipeline.stage import StageContext, StageKind, StageParams, file_fingerprint, metric_key

SAMPLE_CORPUS_DIR = Path(__file__).parent / "sample_corpus"
SAMPLE_CORPUS_GLOB = "*.jsonl.gz"
QUARANTINE_NAME = "quarantine.jsonl.gz"
REPORT_NAME = "ingest_report.json"
RAW_LIMIT_BYTES = 2048  # quarantine keeps this much of each bad record

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz", ".json.gz", ".ndjson",
                  ".ndjson.gz")
# JSONL compression, by the file name's last suffix (also under format: jsonl)
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES: dict[str, tuple[str, ...]] = {"jsonl": JSONL_SUFFIXES, "parquet": PARQUET_SUFFIXES}

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

log = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 16  # small, so a truncated stream loses at most this much before the damage
_ZSTD_FEED_BYTES = 1 << 10  # zstd can expand 1 KiB to ~40 MiB: feed it little at a time
# what a damaged or cut-short compressed stream raises (zlib, lzma and zstd errors are no OSError)
_STREAM_ERRORS = (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError, zstandard.ZstdError)
_UTF8_BOM = b"\xef\xbb\xbf"


class IngestParams(StageParams):
    paths: list[str] = Field(default_factory=list, description=(
        "Files, directories (read recursively, known extensions only) or globs (** allowed). Relative "
        "paths resolve against the working directory; ~ is expanded."))
    sample_corpus: bool = Field(True, description="Also read the shipped corpus data/sample_corpus/*.jsonl.gz.")
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description=(
        "auto: by extension (.jsonl[.gz|.zst], .json.gz, .ndjson[.gz]; .parquet). Otherwise every matched "
        "file is read in this format."))
    text_key: str = Field("text", description="Field holding the document text.")
    id_key: str = Field("id", description="Field holding the id (else <file stem>/<line>).")
    domain_key: str = Field("domain", description="Field holding the domain (else default_domain).")
    source_key: str = Field("source", description="Field holding the source (else <file>:<line>).")
    default_domain: str = Field("unknown", description="Domain of records without a domain field.")
    limit: int | None = Field(None, description="Read at most this many records per file (quick runs).")
    min_chars: int = Field(1, description="Records with shorter text are quarantined as too_short.")
    max_record_bytes: int = Field(64 << 20, description=(
        "A JSONL line (or Parquet row as JSON) longer than this is quarantined as too_long. Ingesting a line "
        "of N bytes takes about 4N of memory; skipping a longer one about max_record_bytes."))

    @field_validator("paths")
    @classmethod
    def _paths_not_blank(cls, paths: list[str]) -> list[str]:
        for i, p in enumerate(paths):
            if not p.strip():
                raise ValueError(f"paths[{i}] is empty; give a file, directory or glob")
        return paths

    @field_validator("text_key", "id_key", "domain_key", "source_key", "default_domain")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value:
            raise ValueError("must be a non-empty string")
        return value

    @field_validator("limit")
    @classmethod
    def _limit_positive(cls, limit: int | None) -> int | None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 records per file, or null for no limit (got {limit})")
        return limit

    @field_validator("min_chars")
    @classmethod
    def _min_chars_positive(cls, min_chars: int) -> int:
        if min_chars < 1:
            raise ValueError(f"min_chars must be >= 1 (empty text is always quarantined; got {min_chars})")
        return min_chars

    @field_validator("max_record_bytes")
    @classmethod
    def _max_record_bytes_sane(cls, n: int) -> int:
        if n < 1024:
            raise ValueError(f"max_record_bytes must be >= 1024 (got {n})")
        return n

    @model_validator(mode="after")
    def _has_inputs_and_distinct_keys(self) -> IngestParams:
        if not self.sample_corpus and not self.paths:
            raise ValueError("ingest has no inputs: set paths (files, directories or globs) "
                             "or sample_corpus: true")
        keys = {"text_key": self.text_key, "id_key": self.id_key, "domain_key": self.domain_key,
                "source_key": self.source_key}
        seen: dict[str, str] = {}
        for name, key in keys.items():
            if key in seen:
                raise ValueError(f"{name} and {seen[key]} are both {key!r}; each field needs its own key")
            seen[key] = name
        if "metadata" in seen:
            raise ValueError(f"{seen['metadata']} is 'metadata', which is reserved for the metadata object")
        return self


# --- inputs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputFile:
    """One file to read: where it is, how it is shown, its format, and the prefix of generated ids."""

    path: Path  # absolute
    display: str  # as the user wrote it (or package-relative for the sample corpus)
    format: Literal["jsonl", "parquet"]
    key: str  # unique among this run's inputs


def _known_format(path: str, fmt: str) -> Literal["jsonl", "parquet"] | None:
    name = path.lower()
    for candidate, suffixes in SUFFIXES.items():
        if (fmt in ("auto", candidate)) and name.endswith(suffixes):
            return candidate  # type: ignore[return-value]
    return None


def _strip_suffix(display: str) -> str:
    lower = display.lower()
    for suffix in sorted(JSONL_SUFFIXES + PARQUET_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix):
            return display[: -len(suffix)]
    return str(Path(display).with_suffix("")) if Path(display).suffix else display


def _files_in_dir(directory: str, fmt: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        found += [os.path.join(root, f) for f in files if _known_format(f, fmt)]
    return sorted(found)


def _expand(pattern: str, fmt: str) -> list[tuple[str, Literal["jsonl", "parquet"]]]:
    """(display path, format) of the files one ``paths`` entry names; an error if it names none."""
    expanded = os.path.expanduser(pattern)
    where = f"(resolved against {os.getcwd()})" if not os.path.isabs(expanded) else ""
    if glob.escape(expanded) != expanded:  # a glob pattern
        matches = sorted(glob.glob(expanded, recursive=True))
        if not matches:
            raise FileNotFoundError(f"ingest: paths entry {pattern!r} matches no file {where}".rstrip())
    elif os.path.isdir(expanded) or os.path.isfile(expanded):
        matches = [expanded]
    else:
        raise FileNotFoundError(f"ingest: paths entry {pattern!r} does not exist {where}".rstrip())

    out: list[tuple[str, Literal["jsonl", "parquet"]]] = []
    skipped: list[str] = []
    for match in matches:
        if os.path.isdir(match):
            out += [(f, _known_format(f, fmt)) for f in _files_in_dir(match, fmt)]  # type: ignore[misc]
        elif (known := _known_format(match, fmt)) is not None:
            out.append((match, known))
        elif fmt != "auto":
            out.append((match, fmt))  # type: ignore[arg-type]  # the user said what it is
        else:
            skipped.append(match)
    known = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
    if skipped and matches == [expanded]:
        raise ValueError(f"ingest: cannot tell the format of {pattern!r} from its extension (known: "
                         f"{known}); set format: jsonl or parquet")
    if not out:
        raise FileNotFoundError(
            f"ingest: paths entry {pattern!r} matches no {'readable' if fmt == 'auto' else fmt} file "
            f"{where} (known extensions: {known}; {len(skipped)} other file(s) matched); "
            "set format to read other extensions")
    if skipped:
        log.warning("ingest: paths entry %r: skipping %d file(s) of unknown format, e.g. %s",
                    pattern, len(skipped), ", ".join(skipped[:3]))
    return out


def _unique_keys(displays: list[str]) -> list[str]:
    """Id prefixes: the file stem; where stems collide, the path without, then with, its extension."""
    keys = [Path(_strip_suffix(d)).name for d in displays]
    for longer in (_strip_suffix, str):
        counts = Counter(keys)
        keys = [longer(d) if counts[k] > 1 else k for d, k in zip(displays, keys, strict=True)]
    counts = Counter(keys)
    return [f"{k}#{i}" if counts[k] > 1 else k for i, k in enumerate(keys)]  # only for contrived names


def resolve_inputs(params: IngestParams) -> list[InputFile]:
    """The files ``params`` names, in reading order, each once."""
    named: list[tuple[str, Path, Literal["jsonl", "parquet"]]] = []
    if params.sample_corpus:
        files = sorted(SAMPLE_CORPUS_DIR.glob(SAMPLE_CORPUS_GLOB))
        if not files:
            raise FileNotFoundError(
                f"ingest: the shipped sample corpus is missing ({SAMPLE_CORPUS_DIR}/{SAMPLE_CORPUS_GLOB} "
                "matches nothing); reinstall hylight or set sample_corpus: false")
        named += [(f"data/sample_corpus/{f.name}", f.resolve(), "jsonl") for f in files]
    for pattern in params.paths:
        named += [(d, Path(d).resolve(), f) for d, f in _expand(pattern, params.format)]

    seen: set[Path] = set()
    kept = []
    for display, path, fmt in named:
        if path not in seen:
            seen.add(path)
            kept.append((display, path, fmt))
    keys = _unique_keys([d for d, _, _ in kept])
    return [InputFile(path=p, display=d, format=f, key=k) for (d, p, f), k in zip(kept, keys, strict=True)]


# --- readers --------------------------------------------------------------------------------------


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
        import pyarrow as pa
        import pyarrow.parquet as pq

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


# --- the stage ------------------------------------------------------------------------------------


@dataclass
class FileTally:
    format: str
    read: int = 0
    ingested: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    @property
    def quarantined(self) -> int:
        return sum(self.reasons.values())


class QuarantineWriter(JsonlGzWriter):
    """``quarantine.jsonl.gz``: one JSON object per rejected record."""

    def write(self, q: QuarantinedRecord) -> None:
        super().write({"file": q.file, "line": q.line, "reason": q.reason, "detail": q.detail, "raw": q.raw})


def run(params: IngestParams, ctx: StageContext) -> None:
    inputs = resolve_inputs(params)
    formats = Counter(i.format for i in inputs)
    ctx.progress(f"reading {len(inputs)} file(s): "
                 + ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items())))

    tallies = {i.display: FileTally(i.format) for i in inputs}
    domains: Counter[str] = Counter()
    domain_bytes: Counter[str] = Counter()
    seen_ids: set[str] = set()
    quarantine = QuarantineWriter(ctx.out_dir / QUARANTINE_NAME)

    def on_reject(q: QuarantinedRecord) -> None:
        tallies[q.file].reasons[q.reason] += 1
        quarantine.write(q)

    def documents() -> Iterator[tuple[InputFile, Document]]:
        for source in inputs:
            reader = READERS[source.format](source, params, seen_ids, on_reject)
            for doc in reader.read_file(source.path.name):
                yield source, doc
            tallies[source.display].read = reader.records_read

    try:
        with DocumentWriter(ctx.out_dir) as writer:
            for source, doc in ctx.track(documents(), what="documents"):
                record = record_from_datatrove(doc)
                writer.write(dict(record))
                tallies[source.display].ingested += 1
                domains[record["domain"]] += 1
                text = record["text"]
                domain_bytes[record["domain"]] += len(text) if text.isascii() else len(text.encode("utf-8"))
    finally:
        quarantine.close()

    read = sum(t.read for t in tallies.values())
    ingested = sum(t.ingested for t in tallies.values())
    reasons: Counter[str] = sum((t.reasons for t in tallies.values()), Counter())
    quarantined = sum(reasons.values())
    for display, t in tallies.items():
        if t.read != t.ingested + t.quarantined:
            raise RuntimeError(f"ingest accounting is off for {display}: read {t.read} != ingested "
                               f"{t.ingested} + quarantined {t.quarantined} (a bug in data/ingest.py)")
    if read != ingested + quarantined or ingested != writer.count:
        raise RuntimeError(f"ingest accounting is off: read {read}, ingested {ingested} (written "
                           f"{writer.count}), quarantined {quarantined} (a bug in data/ingest.py)")

    report = {
        "read": read, "ingested": ingested, "quarantined": quarantined,
        "quarantined_by_reason": dict(sorted(reasons.items())),
        "domains": {d: {"docs": domains[d], "bytes": domain_bytes[d]} for d in sorted(domains)},
        "files": [{"file": i.display, "format": i.format, "id_prefix": i.key,
                   "read": tallies[i.display].read, "ingested": tallies[i.display].ingested,
                   "quarantined": tallies[i.display].quarantined,
                   "quarantined_by_reason": dict(sorted(tallies[i.display].reasons.items()))}
                  for i in inputs],
        "quarantine_file": QUARANTINE_NAME,
    }
    report_path = ctx.out_dir / REPORT_NAME
    report_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    ctx.log_artifact(report_path)

    ctx.set_rows("documents", ingested)
    ctx.set_rows("quarantined", quarantined)
    ctx.log_summary({"read": read, "ingested": ingested, "quarantined": quarantined})
    metrics: dict[str, float] = {"files": len(inputs)}
    metrics |= {f"quarantined.{r}": reasons[r] for r in QUARANTINE_REASONS}
    for d in sorted(domains):
        metrics[f"docs.{metric_key(d)}"] = domains[d]
        metrics[f"bytes.{metric_key(d)}"] = domain_bytes[d]
    ctx.log_metrics(metrics)

    for display, t in tallies.items():  # whole-file problems a per-record count would hide
        if t.read == 0:
            ctx.logger.warning("ingest: %s holds no records (an empty file)", display)
        elif t.ingested == 0:
            why = ", ".join(f"{r}={n}" for r, n in t.reasons.most_common())
            ctx.logger.warning("ingest: no record of %s was ingested (%d read: %s); check the file's format "
                               "and text_key=%r", display, t.read, why, params.text_key)
    by_reason = ", ".join(f"{r}={n}" for r, n in sorted(reasons.items())) or "none"
    if quarantined:
        # out_dir is a temp dir renamed on commit: name the file inside the artifact, not this path
        ctx.logger.warning("ingest quarantined %d of %d records (%s); see %s in this stage's artifact "
                           "(`hylight status` shows its path)", quarantined, read, by_reason, QUARANTINE_NAME)
    ctx.progress(f"read {read} records from {len(inputs)} file(s): ingested {ingested} in "
                 f"{len(domains)} domain(s), quarantined {quarantined} ({by_reason})")


def fingerprint(params: IngestParams) -> list[dict[str, Any]]:
    """Content of every input file, for the cache key: edit an input and ingest reruns."""
    return [file_fingerprint(f.path) for f in resolve_inputs(params)]


def validate_external(params: IngestParams) -> list[tuple[str, str]]:
    """At spec validation (nothing created yet): every ``paths`` entry names readable files, and the
    sample corpus is there when asked for. (field, problem) pairs; the field points at the entry."""
    problems: list[tuple[str, str]] = []
    if params.sample_corpus and not any(SAMPLE_CORPUS_DIR.glob(SAMPLE_CORPUS_GLOB)):
        problems.append(("sample_corpus", f"the shipped sample corpus is missing ({SAMPLE_CORPUS_DIR}/"
                                          f"{SAMPLE_CORPUS_GLOB}); reinstall hylight or set sample_corpus: false"))
    for i, pattern in enumerate(params.paths):
        try:
            _expand(pattern, params.format)
        except (FileNotFoundError, ValueError) as e:
            problems.append((f"paths.{i}", str(e).removeprefix("ingest: ")))
    return problems


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("ingest_report.json",),
    name="ingest",
    params=IngestParams,
    run=run,
    produces=DOCUMENTS_TYPE,
    inputs={},
    fingerprint=fingerprint,
    validate_external=validate_external,
    doc=("Read JSONL/Parquet files or globs and the shipped sample corpus (through datatrove readers) "
         "into one documents dataset; malformed records go to quarantine.jsonl.gz with a reason, and "
         "read = ingested + quarantined is checked and logged."),
)
