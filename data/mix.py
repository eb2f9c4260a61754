"""Stage ``mix``: a repetition-aware data mixture over quality-scored documents (artifact type ``mixture``).

Inputs: a ``scored_documents`` artifact (each record carries ``metadata["quality"]`` from the quality
stage and, from dedup, ``metadata["dup_count"]``) and the trained ``tokenizer``. Output: a manifest that
says how many times each document is trained on (its *sample count*), with stats and plots.

The plan itself -- quality buckets with the paper's epoch caps, the quality tilt that zeroes no
category, integer sample counts on an exact token budget, the ablation mode -- is
:mod:`data.mix_plan` (its params in :mod:`data.mix_params`); this module reads the documents, counts their tokens
and writes the outputs.

* **Tokens.** Counted with the trained tokenizer (``tokenizer.json``, no special tokens added by the
  tokenizer) plus :data:`PACKING_TOKENS_PER_DOC` = 2 for the BOS/EOS that pretraining packing adds
  around every document: the budget is what the model will consume.

Output files: ``mixture.jsonl.gz`` (one row per input document, in input order, see
:class:`MixtureEntry`; every input document appears, a 0 count carries its reason),
``mixture_stats.json`` and ``plots/`` (category and bucket shares before/after, sample counts per
bucket). Read the manifest with :func:`iter_mixture`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from data.documents import (
    DUP_COUNT,
    QUALITY,
    QUALITY_CATEGORY,
    QUALITY_DIMENSIONS,
    SCORE_MAX,
    SCORE_MIN,
    SCORED_DOCUMENTS_TYPE,
    JsonlGzWriter,
    count_documents,
    iter_document_range,
    read_jsonl_gz,
)
from data.mix_params import (
    DEFAULT_BUCKETS,
    PAPER_LOW_QUALITY_MAX_EPOCHS,
    PAPER_MAX_EPOCHS,
    AblationParams,
    BucketSpec,
    MixParams,
    ScoreWeights,
    over_paper_caps,
)
from data.mix_plan import (
    ZERO_REASONS,
    BudgetShortfallError,
    DocumentTable,
    MixturePlan,
    group_sum,
    plan_mixture,
)
from data.tokenizer import TOKENIZER_TYPE
from pipeline.artifacts import write_text_atomic
from pipeline.shards import split_ranges
from pipeline.stage import InputSpec, StageContext, StageKind, metric_key, track

__all__ = [  # the planner's names, also importable from here (the stage's public surface)
    "DEFAULT_BUCKETS", "PAPER_LOW_QUALITY_MAX_EPOCHS", "PAPER_MAX_EPOCHS", "ZERO_REASONS", "AblationParams",
    "BucketSpec", "BudgetShortfallError", "DocumentTable", "MissingQualityError", "MixParams", "MixturePlan",
    "ScoreWeights", "STAGE", "iter_mixture", "mixture_stats", "over_paper_caps", "plan_mixture",
    "read_scored_documents", "run",
]

MIXTURE_TYPE = "mixture"
MANIFEST_FILE = "mixture.jsonl.gz"
STATS_FILE = "mixture_stats.json"
PACKING_TOKENS_PER_DOC = 2  # BOS + EOS added around every document by pretraining packing
ENCODE_BATCH_DOCS = 512


class MissingQualityError(ValueError):
    """The documents were not scored: mix needs metadata['quality'] on every document."""



def _quality_of(rec: dict[str, Any], where: Path) -> tuple[float, float, str]:
    meta = rec.get("metadata") or {}
    q = meta.get(QUALITY)
    if q is None:
        raise MissingQualityError(
            f"mix needs documents scored by a quality stage: document {rec['id']!r} in {where} has no "
            f"metadata[{QUALITY!r}] (expected {{'knowledge_depth': 0-5, 'helpfulness': 0-5, 'category': str}}); "
            "put a quality stage between dedup and mix")
    if not isinstance(q, dict):
        raise MissingQualityError(f"document {rec['id']!r} in {where}: metadata[{QUALITY!r}] is "
                                  f"{type(q).__name__}, expected an object from the quality stage")
    values = []
    for key in QUALITY_DIMENSIONS:
        v = q.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not SCORE_MIN <= v <= SCORE_MAX:
            raise MissingQualityError(
                f"document {rec['id']!r} in {where}: metadata[{QUALITY!r}][{key!r}] = {v!r}; expected a "
                f"number in [{SCORE_MIN}, {SCORE_MAX}] from the quality stage")
        values.append(float(v))
    cat = q.get(QUALITY_CATEGORY)
    if not isinstance(cat, str) or not cat:
        raise MissingQualityError(f"document {rec['id']!r} in {where}: metadata[{QUALITY!r}][{QUALITY_CATEGORY!r}] = "
                                  f"{cat!r}; expected a non-empty string from the quality stage")
    return values[0], values[1], cat


def _dup_count_of(rec: dict[str, Any], where: Path) -> int:
    v = (rec.get("metadata") or {}).get(DUP_COUNT, 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"document {rec['id']!r} in {where}: metadata[{DUP_COUNT!r}] = {v!r}; dedup writes "
                         "an integer >= 1 (absent means 1)")
    return v


@dataclass
class ScoredShard:
    """Documents [start, stop) of a scored documents artifact to read and count tokens of (plain data)."""

    docs_path: str
    tokenizer_file: str
    file_counts: list[int] | None
    start: int
    stop: int


@dataclass
class ScoredColumns:
    """Per document of a shard, in input order: what the mixture plan needs."""

    ids: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    kd: list[float] = field(default_factory=list)
    hp: list[float] = field(default_factory=list)
    cats: list[str] = field(default_factory=list)
    doms: list[str] = field(default_factory=list)
    dups: list[int] = field(default_factory=list)

    def extend(self, other: ScoredColumns) -> None:
        for name in ("ids", "tokens", "kd", "hp", "cats", "doms", "dups"):
            getattr(self, name).extend(getattr(other, name))


def read_scored_shard(shard: ScoredShard, progress: Callable[[str], None]) -> ScoredColumns:
    """Quality, dup_count, domain and token count (trained tokenizer, + BOS/EOS) of documents [start, stop).
    A document's count does not depend on the batch it is encoded in."""
    from tokenizers import Tokenizer  # heavy: the Rust tokenizers library

    tok = Tokenizer.from_file(shard.tokenizer_file)
    docs_path = Path(shard.docs_path)
    out = ScoredColumns()
    texts: list[str] = []

    def flush() -> None:
        encodings = tok.encode_batch_fast(texts, add_special_tokens=False)
        out.tokens.extend(len(e.ids) + PACKING_TOKENS_PER_DOC for e in encodings)
        texts.clear()

    records = iter_document_range(docs_path, shard.start, shard.stop, shard.file_counts)
    for rec in track(records, progress, total=shard.stop - shard.start, what="documents tokenized"):
        k, h, c = _quality_of(rec, docs_path)
        out.ids.append(rec["id"])
        out.kd.append(k)
        out.hp.append(h)
        out.cats.append(c)
        out.doms.append(rec.get("domain") or "unknown")
        out.dups.append(_dup_count_of(rec, docs_path))
        texts.append(rec["text"])
        if len(texts) >= ENCODE_BATCH_DOCS:
            flush()
    if texts:
        flush()
    return out


def read_scored_documents(docs_path: Path, tokenizer_file: Path, ctx: StageContext | None = None) -> DocumentTable:
    """Quality, dup_count, domain and token count (with the trained tokenizer, + BOS/EOS) per document; with a
    ``ctx``, in ``resources.tasks`` shards (StageContext.map_shards)."""
    if ctx is None:
        cols = read_scored_shard(ScoredShard(str(docs_path), str(tokenizer_file), None, 0, sys.maxsize),
                                 lambda _: None)
    else:
        file_counts = count_documents(docs_path)
        shards = [ScoredShard(str(docs_path), str(tokenizer_file), file_counts, a, b)
                  for a, b in split_ranges(sum(file_counts), ctx.resources.tasks)]
        cols = ScoredColumns()
        for part in ctx.map_shards(read_scored_shard, shards, what="tokenization"):
            cols.extend(part)
    return DocumentTable.from_columns(cols.ids, cols.tokens, cols.kd, cols.hp, cols.cats, cols.doms, cols.dups)


# --- outputs ----------------------------------------------------------------------------------------
class MixtureEntry(TypedDict):
    id: str
    sample_count: int  # times to train on the document in this mixture
    full_sample_count: int  # in the full schedule (== sample_count unless ablation)
    tokens: int  # per pass, incl. BOS/EOS
    bucket: str
    category: str
    domain: str
    score: float
    dup_count: int
    max_epochs: int  # the cap that applied to this document
    expected_epochs: float  # continuous rate before integer rounding
    zero_reason: str | None  # why sample_count is 0 (a key of ZERO_REASONS), else None


def iter_mixture(artifact_path: str | Path, only_sampled: bool = False) -> Iterator[MixtureEntry]:
    """Rows of a mixture artifact's manifest, in the documents' input order."""
    for row in read_jsonl_gz(Path(artifact_path) / MANIFEST_FILE):
        if not only_sampled or row["sample_count"] > 0:
            yield row


def _write_manifest(path: Path, table: DocumentTable, plan: MixturePlan, buckets: list[BucketSpec]) -> None:
    names = [b.name for b in buckets]
    with JsonlGzWriter(path) as f:
        for i, doc_id in enumerate(table.ids):
            row: MixtureEntry = {
                "id": doc_id, "sample_count": int(plan.count[i]), "full_sample_count": int(plan.full_count[i]),
                "tokens": int(table.tokens[i]), "bucket": names[plan.bucket[i]],
                "category": table.categories[table.category[i]], "domain": table.domains[table.domain[i]],
                "score": round(float(plan.score[i]), 6), "dup_count": int(table.dup_count[i]),
                "max_epochs": int(plan.cap[i]), "expected_epochs": round(float(plan.expected_epochs[i]), 6),
                "zero_reason": plan.zero_reason[i]}
            f.write(row)


def _share_table(groups: np.ndarray, names: list[str], tokens: np.ndarray, counts: np.ndarray) -> dict[str, Any]:
    n = len(names)
    unique = group_sum(groups, tokens, n)
    mixed = group_sum(groups, tokens * counts, n)
    docs = np.bincount(groups, minlength=n)
    sampled = np.bincount(groups, weights=(counts > 0).astype(np.float64), minlength=n)
    u_total, m_total = max(int(unique.sum()), 1), max(int(mixed.sum()), 1)
    return {name: {"documents": int(docs[g]), "sampled_documents": int(sampled[g]),
                   "unique_tokens": int(unique[g]), "mixture_tokens": int(mixed[g]),
                   "share_before": float(unique[g] / u_total), "share_after": float(mixed[g] / m_total),
                   "effective_epochs": float(mixed[g] / unique[g]) if unique[g] else 0.0}
            for g, name in enumerate(names)}


def _bucket_stats(table: DocumentTable, plan: MixturePlan, buckets: list[BucketSpec],
                  counts: np.ndarray) -> dict[str, Any]:
    out = _share_table(plan.bucket, [b.name for b in buckets], table.tokens, counts)
    for b, spec in enumerate(buckets):
        m = plan.bucket == b
        c = counts[m]
        upper = buckets[b + 1].min_score if b + 1 < len(buckets) else SCORE_MAX
        out[spec.name] |= {
            "score_range": [spec.min_score, upper], "max_epochs": spec.max_epochs, "weight": spec.weight,
            "mean_sample_count": float(c.mean()) if c.size else 0.0,
            "mean_sample_count_of_sampled": float(c[c > 0].mean()) if (c > 0).any() else 0.0,
            "max_sample_count": int(c.max()) if c.size else 0,
            "documents_at_cap": int(((c == plan.cap[m]) & (plan.cap[m] > 0)).sum()),
            "sample_count_histogram": {str(k): int(v) for k, v in enumerate(np.bincount(c, minlength=spec.max_epochs + 1))},
            "mean_dup_count": float(table.dup_count[m].mean()) if m.any() else 0.0,
            "max_exposures_counting_duplicates": int((c + table.dup_count[m] - 1)[c > 0].max()) if (c > 0).any() else 0,
        }
    return out


def mixture_stats(table: DocumentTable, plan: MixturePlan, params: MixParams,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything mixture_stats.json holds (JSON-able)."""
    tokens, counts = table.tokens, plan.count
    zero = Counter(r for r in plan.zero_reason if r is not None)
    categories = _share_table(table.category, table.categories, tokens, counts)
    for c, name in enumerate(table.categories):
        categories[name] |= {"floor_share": params.min_category_share * categories[name]["share_before"],
                             "floor_binding": plan.budget.floor_binding[c],
                             "floor_unmet": plan.budget.floor_unmet[c],
                             "weight": params.category_weights.get(name, 1.0)}
    domains = _share_table(table.domain, table.domains, tokens, counts)
    for name in table.domains:
        domains[name]["weight"] = params.domain_weights.get(name, 1.0)
    b = plan.budget
    stats: dict[str, Any] = {
        "inputs": inputs or {},
        "budget": {"requested": b.requested, "capacity_at_caps": b.capacity, "target": b.target,
                   "achieved_full_schedule": b.achieved, "tokens": plan.tokens,
                   "shrunk": b.shrunk_to is not None, "budget_shrunk_to": b.shrunk_to,
                   "tolerance": "0 <= target - achieved < tokens of one document",
                   "lambda": b.lam},
        "tokens": {"unique_input": int(tokens.sum()), "mixture": plan.tokens,
                   "packing_tokens_per_document": PACKING_TOKENS_PER_DOC,
                   "effective_epochs": plan.tokens / max(int(tokens.sum()), 1)},
        "documents": {"input": len(table), "sampled": int((counts > 0).sum()),
                      "zero_sample_count": dict(sorted(zero.items())),
                      "zero_reasons": {r: ZERO_REASONS[r] for r in sorted(zero)}},
        "buckets": _bucket_stats(table, plan, params.buckets, counts),
        "categories": categories,
        "domains": domains,
        "warnings": plan.warnings,
        "unused_weights": {
            "category_weights": sorted(set(params.category_weights) - set(table.categories)),
            "domain_weights": sorted(set(params.domain_weights) - set(table.domains))},
        "params": params.model_dump(),
    }
    if plan.ablation is not None:
        a = plan.ablation
        full = _bucket_stats(table, plan, params.buckets, plan.full_count)
        eligible = plan.full_count > 0
        stats["ablation"] = {
            "full_token_budget": a.full_token_budget, "ablation_token_budget": a.ablation_token_budget,
            "p": a.p, "tokens": a.achieved, "full_schedule_tokens": b.achieved,
            "eligible_documents": int(eligible.sum()), "selected_documents": int((counts > 0).sum()),
            "selected_fraction": float((counts > 0).sum() / max(int(eligible.sum()), 1)),
            "full_schedule_buckets": full,
            "full_schedule_categories": _share_table(table.category, table.categories, tokens, plan.full_count),
            # §4.1.3.2: repetition of a document present in the run, ablation vs full
            "mean_repetition_by_bucket": {
                spec.name: {"full": full[spec.name]["mean_sample_count_of_sampled"],
                            "ablation": stats["buckets"][spec.name]["mean_sample_count_of_sampled"]}
                for spec in params.buckets},
        }
    return stats


def _share_figure(stats: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global backend state in a worker

    fig = Figure(figsize=(10, 4))
    for ax, key, title in ((fig.add_subplot(1, 2, 1), "categories", "category"),
                           (fig.add_subplot(1, 2, 2), "buckets", "quality bucket")):
        rows = stats[key]
        names = list(rows)
        x = np.arange(len(names))
        before = [rows[n]["share_before"] for n in names]
        after = [rows[n]["share_after"] for n in names]
        ax.bar(x - 0.2, before, 0.4, label="before (deduplicated corpus)", color="tab:gray")
        ax.bar(x + 0.2, after, 0.4, label="after (mixture)", color="tab:blue")
        if key == "categories":
            floors = [rows[n]["floor_share"] for n in names]
            ax.scatter(x + 0.2, floors, marker="_", s=300, color="tab:red", label="floor", zorder=3)
        ax.set_xticks(x, names, rotation=45, ha="right")
        ax.set_ylabel("token share")
        ax.set_title(f"Token share per {title}", fontsize=9)
        ax.legend(fontsize=7)
    return fig


def _epochs_figure(stats: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure  # heavy: only the plots need it

    buckets = stats["buckets"]
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    width = 0.8 / max(len(buckets), 1)
    for j, (name, s) in enumerate(buckets.items()):
        hist = s["sample_count_histogram"]
        ks = np.array([int(k) for k in hist])
        frac = np.array(list(hist.values()), dtype=float) / max(s["documents"], 1)
        ax.bar(ks + (j - (len(buckets) - 1) / 2) * width, frac, width,
               label=f"{name} (cap {s['max_epochs']}, {s['effective_epochs']:.2f} epochs)")
    ax.set_xlabel("sample count (times a document is trained on)")
    ax.set_ylabel("fraction of the bucket's documents")
    ax.set_title("Repetition per quality bucket", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def run(params: MixParams, ctx: StageContext) -> None:
    docs = ctx.input("documents")
    tok = ctx.input("tokenizer")
    ctx.progress(f"reading and tokenizing {docs.path}")
    table = read_scored_documents(docs.path, tok.file("tokenizer.json"), ctx)
    if not len(table):
        raise ValueError(f"mix: documents artifact {docs.path} holds no documents")
    plan = plan_mixture(table, params)
    over_caps = over_paper_caps(params.buckets)  # only non-empty with allow_over_paper_caps (validated)
    for w in [*plan.warnings, *(f"allow_over_paper_caps: {p}" for p in over_caps)]:
        ctx.logger.warning("mix: %s", w)
        ctx.progress(f"WARNING: {w}")
    if over_caps:
        ctx.set_tags({"mix.over_paper_caps": "; ".join(over_caps)})

    stats = mixture_stats(table, plan, params, inputs={
        "documents": {"path": str(docs.path), "digest": docs.manifest.get("digest")},
        "tokenizer": {"path": str(tok.path), "digest": tok.manifest.get("digest")}})
    zero = stats["documents"]["zero_sample_count"]
    sampled = stats["documents"]["sampled"]
    if len(table) != sampled + sum(zero.values()):  # every document is used or has a reason
        raise RuntimeError(f"mix accounting is off: {len(table)} documents != {sampled} sampled + {zero} "
                           "(a bug in data/mix.py)")

    _write_manifest(ctx.out_dir / MANIFEST_FILE, table, plan, params.buckets)
    if over_caps:
        stats["over_paper_caps"] = over_caps
    stats_path = ctx.out_dir / STATS_FILE
    write_text_atomic(stats_path, json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    ctx.log_artifact(stats_path, "mixture")
    ctx.log_figure(_share_figure(stats), "category_share.png")
    ctx.log_figure(_epochs_figure(stats), "epochs_per_bucket.png")

    b = plan.budget
    summary = {"tokens": plan.tokens, "documents": len(table), "unique_documents_sampled": sampled,
               "budget_requested": b.requested, "budget_achieved": b.achieved,
               "effective_epochs": stats["tokens"]["effective_epochs"]}
    if b.shrunk_to is not None:
        summary["budget_shrunk_to"] = b.shrunk_to
    if plan.ablation is not None:
        summary |= {"ablation_tokens": plan.ablation.achieved, "ablation_p": plan.ablation.p}
    ctx.log_summary(summary)
    metrics: dict[str, float] = {"capacity_at_caps": b.capacity, "unique_tokens": stats["tokens"]["unique_input"],
                                 "over_paper_caps": len(over_caps)}
    metrics |= {f"zero.{r}": zero.get(r, 0) for r in ZERO_REASONS}
    for name, s in stats["buckets"].items():
        key = metric_key(name)
        metrics |= {f"epochs.{key}": s["effective_epochs"], f"max_sample_count.{key}": s["max_sample_count"],
                    f"bucket_share_before.{key}": s["share_before"], f"bucket_share_after.{key}": s["share_after"]}
    for group, prefix in (("categories", "category"), ("domains", "domain")):
        for name, s in stats[group].items():
            key = f"{prefix}.{metric_key(name)}"
            metrics |= {f"share_before.{key}": s["share_before"], f"share_after.{key}": s["share_after"]}
    ctx.log_metrics(metrics)
    ctx.set_rows("documents", len(table))
    ctx.set_rows("sampled_documents", sampled)
    ctx.set_rows("tokens", plan.tokens)
    ctx.progress(f"mixture of {plan.tokens:,} tokens from {sampled} of {len(table)} documents "
                 f"({stats['tokens']['effective_epochs']:.2f} epochs over the unique tokens); "
                 + ", ".join(f"{n}: {s['effective_epochs']:.2f} epochs" for n, s in stats["buckets"].items()))


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("mixture_stats.json", "plots/*"),
    name="mix",
    params=MixParams,
    run=run,
    produces=MIXTURE_TYPE,
    inputs={
        "documents": InputSpec(SCORED_DOCUMENTS_TYPE, doc="documents with metadata['quality'] (and dup_count from dedup)"),
        "tokenizer": InputSpec(TOKENIZER_TYPE, doc="the trained tokenizer: token counts per document (+2 BOS/EOS)"),
    },
    splits_work=True,
    doc="Repetition-aware mixture (MiniMax-01 §4.1.1, §4.1.3.2): quality buckets with epoch caps (low <= 2, "
        "high <= 4), uniform start tilted toward quality with a per-category floor, integer sample counts "
        "within one document of the token budget, and an ablation mode that keeps the full run's repetition.",
)
