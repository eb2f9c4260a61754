"""Stage ``ingest``: JSONL / Parquet files (and the shipped sample corpus) -> one ``documents`` dataset.

Every physical record of every input is either written as a normalized document
(:class:`data.documents.DocumentRecord`) or kept in ``quarantine.jsonl.gz`` with a reason from
:data:`QUARANTINE_REASONS`, so ``read == ingested + quarantined`` holds and is checked.

Reading goes through datatrove's ``JsonlReader`` / ``ParquetReader``, subclassed because the stock ones
drop data silently (a bad JSON line is skipped with a warning, a ``UnicodeDecodeError`` ends the whole
file, a document without text is dropped). Ours (:mod:`data.ingest_readers`) read bytes and decode each line
strictly, and their adapter validates each record and raises :class:`data.ingest_readers.RecordRejected` instead of
returning nothing.

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

Where the code lives: this module tells the story (:func:`run`); the params are in :mod:`data.ingest_params`, the
input files in :mod:`data.ingest_inputs`, the readers and the quarantine in :mod:`data.ingest_readers`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from datatrove.data import Document

from data.documents import DOCUMENTS_TYPE, DocumentWriter, record_from_datatrove
from data.ingest_inputs import SAMPLE_CORPUS_DIR, SAMPLE_CORPUS_GLOB, InputFile, expand, resolve_inputs
from data.ingest_params import IngestParams
from data.ingest_readers import QUARANTINE_REASONS, READERS, QuarantinedRecord, QuarantineWriter
from pipeline.artifacts import write_text_atomic
from pipeline.stage import StageContext, StageKind, file_fingerprint, metric_key

# names importable from the stage's module (tests and other stages' tests import them from here)
__all__ = ["QUARANTINE_NAME", "QUARANTINE_REASONS", "REPORT_NAME", "SAMPLE_CORPUS_DIR", "SAMPLE_CORPUS_GLOB", "STAGE",
           "IngestParams", "fingerprint", "resolve_inputs", "run", "validate_external"]

QUARANTINE_NAME = "quarantine.jsonl.gz"
REPORT_NAME = "ingest_report.json"


@dataclass
class FileTally:
    format: str
    read: int = 0
    ingested: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    @property
    def quarantined(self) -> int:
        return sum(self.reasons.values())



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

    read, ingested, reasons, quarantined = _check_accounting(tallies, writer.count)
    report = _report(inputs, tallies, domains, domain_bytes)
    report_path = ctx.out_dir / REPORT_NAME
    write_text_atomic(report_path, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
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

    _warn_whole_file_problems(ctx, tallies, params.text_key)
    by_reason = ", ".join(f"{r}={n}" for r, n in sorted(reasons.items())) or "none"
    if quarantined:
        # out_dir is a temp dir renamed on commit: name the file inside the artifact, not this path
        ctx.logger.warning("ingest quarantined %d of %d records (%s); see %s in this stage's artifact "
                           "(`hylight status` shows its path)", quarantined, read, by_reason, QUARANTINE_NAME)
    ctx.progress(f"read {read} records from {len(inputs)} file(s): ingested {ingested} in "
                 f"{len(domains)} domain(s), quarantined {quarantined} ({by_reason})")


def _check_accounting(tallies: dict[str, FileTally], written: int) -> tuple[int, int, Counter[str], int]:
    """(read, ingested, quarantined per reason, quarantined), checked: read == ingested + quarantined per file and
    in all, and every ingested document written."""
    read = sum(t.read for t in tallies.values())
    ingested = sum(t.ingested for t in tallies.values())
    reasons: Counter[str] = sum((t.reasons for t in tallies.values()), Counter())
    quarantined = sum(reasons.values())
    for display, t in tallies.items():
        if t.read != t.ingested + t.quarantined:
            raise RuntimeError(f"ingest accounting is off for {display}: read {t.read} != ingested "
                               f"{t.ingested} + quarantined {t.quarantined} (a bug in data/ingest.py)")
    if read != ingested + quarantined or ingested != written:
        raise RuntimeError(f"ingest accounting is off: read {read}, ingested {ingested} (written "
                           f"{written}), quarantined {quarantined} (a bug in data/ingest.py)")
    return read, ingested, reasons, quarantined


def _report(inputs: list[InputFile], tallies: dict[str, FileTally], domains: Counter[str],
            domain_bytes: Counter[str]) -> dict[str, Any]:
    """The content of ``ingest_report.json``: totals, per reason, per domain and per file."""
    reasons: Counter[str] = sum((t.reasons for t in tallies.values()), Counter())
    return {
        "read": sum(t.read for t in tallies.values()), "ingested": sum(t.ingested for t in tallies.values()),
        "quarantined": sum(reasons.values()),
        "quarantined_by_reason": dict(sorted(reasons.items())),
        "domains": {d: {"docs": domains[d], "bytes": domain_bytes[d]} for d in sorted(domains)},
        "files": [{"file": i.display, "format": i.format, "id_prefix": i.key,
                   "read": tallies[i.display].read, "ingested": tallies[i.display].ingested,
                   "quarantined": tallies[i.display].quarantined,
                   "quarantined_by_reason": dict(sorted(tallies[i.display].reasons.items()))}
                  for i in inputs],
        "quarantine_file": QUARANTINE_NAME,
    }


def _warn_whole_file_problems(ctx: StageContext, tallies: dict[str, FileTally], text_key: str) -> None:
    """Whole-file problems a per-record count would hide: an empty file, a file of which nothing was ingested."""
    for display, t in tallies.items():
        if t.read == 0:
            ctx.logger.warning("ingest: %s holds no records (an empty file)", display)
        elif t.ingested == 0:
            why = ", ".join(f"{r}={n}" for r, n in t.reasons.most_common())
            ctx.logger.warning("ingest: no record of %s was ingested (%d read: %s); check the file's format "
                               "and text_key=%r", display, t.read, why, text_key)


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
            expand(pattern, params.format)
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
