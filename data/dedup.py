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
   removes the rest. Candidates whose MinHash estimate of J is more than :func:`data.dedup_near.estimate_margin`
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

- ``state.sqlite`` (:data:`data.dedup_state.SCHEMA`): a row per document (id, domain, length, incoming weight and members,
  exact group, decision), per exact group (hash, leader, contamination matches), per signature doc, per
  member of an LSH band group and per LSH pair, and each cluster's dup_count. The page cache is capped at
  :data:`data.dedup_state.CACHE_KIB`; the sorts (rank order, input order of members) spill to SQLite's temporary files.
- ``signature_rows/``: every signature doc's whole signature (8 bytes x bands x rows), written by the
  signature shards beside datatrove's files (which hold each band sorted by hash) and read by position.
- ``shingles.u64``: the shingle sets the exact Jaccard needs (8 bytes per shingle of each leader in some LSH
  band group), written in a second pass over the documents and read back one set at a time.

Work in the stage's process goes a document, a block of :data:`data.dedup_state.BATCH` rows, or a shingle set
at a time: LSH pairs stream from datatrove's .dups files, a representative's candidates come in blocks (one large cluster
of boilerplate costs time, candidates x representatives as before, not memory), a kept document's
dup_members are read up to ``max_members_listed`` and its clusters.jsonl row is written member by member.
What still grows: 8 bytes per near duplicate (the Jaccard quantiles of the report); datatrove's signature
step sorts each band of its shard in memory (8 x rows + 4 bytes per leader of the shard, in the shard task);
with ``verify: estimate``, datatrove's cluster step keeps a union-find over every document in an LSH pair.

Input documents that already carry ``DUP_COUNT`` (from an earlier dedup) count with that weight, and
their ``DUP_MEMBERS`` are carried to the representative, so deduping twice keeps the full count.

Where the code lives: this module tells the story (:func:`run`); the first pass and exact groups are in
:mod:`data.dedup_exact`, the state on disk in :mod:`data.dedup_state`, the MinHash-LSH shards in
:mod:`data.dedup_minhash`, the decisions (near duplicates, clusters) in :mod:`data.dedup_near`, the output
files in :mod:`data.dedup_output` and the accounting, report, metrics and plots in :mod:`data.dedup_report`.
"""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

from data.decontamination import build_contamination_index, resolve_decontaminate_paths
from data.dedup_exact import first_pass
from data.dedup_minhash import run_minhash, signature_step
from data.dedup_near import assign_clusters, base_decisions, near_estimate, near_exact
from data.dedup_output import CLUSTERS_NAME, DROPPED_SAMPLES_NAME, write_clusters, write_documents
from data.dedup_params import DedupParams
from data.dedup_report import (
    REPORT_NAME,
    build_report,
    cluster_size_figure,
    domain_rates_figure,
    near_precision,
    stage_metrics,
    tally,
)
from data.dedup_state import CONTAMINATION, DROP_REASONS, open_state
from data.documents import ANY_DOCUMENTS, DOCUMENTS_TYPE, EVALSET_TYPE, write_jsonl_gz
from data.minhash import Shingler
from pipeline.artifacts import write_text_atomic
from pipeline.stage import InputSpec, StageContext, StageKind, file_fingerprint

__all__ = ["CLUSTERS_NAME", "CONTAMINATION", "DROP_REASONS", "DROPPED_SAMPLES_NAME", "REPORT_NAME", "STAGE",
           "fingerprint", "run", "validate_external"]


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
    with open_state(work / "state.sqlite") as db:
        # pass 1: exact groups + contamination + signatures of the leaders; then LSH buckets
        ctx.progress(f"reading {docs_path} (MinHash {params.bands}x{params.rows}, {params.n_grams}-grams, "
                     f"{params.word_tokenizer} words, S-curve {params.s_curve_threshold:.3f}, verify: "
                     f"{params.verify} at Jaccard {params.jaccard_threshold})")
        n = first_pass(params, ctx, docs_path, db, index, work / "signature_docs.i64")
        if n.docs == 0:
            raise ValueError(f"dedup: documents artifact {docs_path} holds no documents")
        mh = run_minhash(params, ctx, docs_path, db, n.leaders, work)
        t_minhash = time.perf_counter()

        # near duplicates (pass 2 over the candidates' documents for their exact shingle sets)
        base_decisions(params, db)
        if params.verify == "exact":
            verification = near_exact(params, ctx, docs_path, db, mh, sig_step, work)
        else:
            verification = near_estimate(params, ctx, docs_path, db, sig_step, work)
        assign_clusters(db)
        t_verify = time.perf_counter()

        # pass 3: write kept documents with their cluster metadata; samples of the dropped
        written, samples = write_documents(params, ctx, docs_path, db, n.docs)
        t_write = time.perf_counter()
        n_cluster_rows = write_clusters(db, ctx.out_dir / CLUSTERS_NAME)
        write_jsonl_gz(ctx.out_dir / DROPPED_SAMPLES_NAME, [s for r in DROP_REASONS for s in samples[r]])
        # accounting (every document is kept or dropped with one reason), per-domain and per-eval-set tallies
        t = tally(db, n.docs, written, index)

    total_s = time.perf_counter() - start
    precision = near_precision(params, verification)
    report = build_report(params, n, mh, t, verification, index, n_cluster_rows)
    report_path = ctx.out_dir / REPORT_NAME
    write_text_atomic(report_path, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    ctx.log_artifact(report_path)

    ctx.set_rows("documents", t.kept)
    for r, c in t.counts.items():
        ctx.set_rows(r, c)
    ctx.log_summary({"in": n.docs, "kept": t.kept, "exact_duplicates": t.counts["exact_duplicate"],
                     "near_duplicates": t.counts["near_duplicate"], "contaminated": t.contaminated_docs,
                     "near_precision": float("nan") if precision is None else precision})
    ctx.log_metrics(stage_metrics(params, n, t, verification, index, seconds={
        "read_minhash": t_minhash - start, "verify": t_verify - t_minhash, "write": t_write - t_verify,
        "total": total_s}))
    ctx.log_figure(cluster_size_figure(t.dup_counts), "cluster_sizes.png")
    ctx.log_figure(domain_rates_figure(t.domains), "dup_rates_by_domain.png")

    if precision is not None and precision < 0.5 and params.verify == "estimate":
        ctx.logger.warning("dedup: only %.0f%% of %d verified near pairs reach Jaccard %.2f with their "
                           "representative; use verify: exact", 100 * precision,
                           verification["pairs_checked"], params.jaccard_threshold)
    ctx.progress(f"{n.docs} documents ({n.bytes / 1e6:.1f} MB) in {total_s:.1f}s: kept {t.kept}, exact "
                 f"{t.counts['exact_duplicate']}, near {t.counts['near_duplicate']}, contaminated "
                 f"{t.contaminated_docs} ({params.decontamination}); near-duplicate precision "
                 f"{'n/a' if precision is None else f'{precision:.3f}'}"
                 f"{' (estimate)' if params.verify == 'estimate' else ''}")


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
