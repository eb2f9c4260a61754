"""Stage ``quality``'s report: every document's scores gathered a block at a time (:class:`ScoreStats`, on disk in
the work dir), ``quality_report.json`` and the plots (score distributions per domain, category x quality heat map,
held-out agreement)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from data.documents import QUALITY_DIMENSIONS as DIMENSIONS
from data.documents import SCORE_MAX, SCORE_MIN
from data.quality_embeddings import npy_header
from data.quality_labels import REJECT_REASONS, LabelOutcome
from data.quality_params import QualityParams
from data.quality_sample import Corpus
from data.quality_scorer import QualityScorer

REPORT_NAME = "quality_report.json"
QUALITY_BUCKETS = (0, 1, 2, 3, 4, 5)  # edges of the heat map's score buckets
HIST_EDGES = np.linspace(SCORE_MIN, SCORE_MAX, 11)  # the report's score histograms
PLOT_POINTS_CAP = 50_000  # a domain's violin is drawn from at most this many scores (evenly spaced rows)


class ScoreStats:
    """What the report and the plots need from every document's scores, gathered a block at a time. In memory:
    counts per category, per (domain, category), per (category, dimension, bucket) and the histograms -- they grow with the
    number of domains and categories, not documents. On disk in work_dir: every document's rounded scores
    (float64 [N, 2]) and each domain's (one .npy per domain, 16 bytes per document each), written a block at
    a time and read back through read-only memmaps for the report's exact means (the same numpy reductions
    over the same arrays as before) and the violins. Those pages are file-backed and clean (reclaimable)."""

    def __init__(self, work_dir: Path, domains: dict[str, int], categories: Sequence[str]) -> None:
        self.dir = work_dir / "scores"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.n_docs = sum(domains.values())
        self.domains = domains
        self.domain_files = {dom: self.dir / f"domain-{i:05d}.npy" for i, dom in enumerate(domains)}
        self.all_file = self.dir / "all.npy"
        dims = len(DIMENSIONS)
        for path, rows in [(self.all_file, self.n_docs), *((self.domain_files[d], c) for d, c in domains.items())]:
            with open(path, "wb") as f:
                npy_header(f, (rows, dims), np.dtype("<f8"))
        self.categories = list(categories)
        self.category_counts = np.zeros(len(categories), dtype=np.int64)
        self.domain_categories: dict[str, np.ndarray] = {d: np.zeros(len(categories), dtype=np.int64)
                                                         for d in domains}
        self.edges = np.array(QUALITY_BUCKETS, dtype=float)
        self.grid = np.zeros((len(categories), dims, len(self.edges) - 1), dtype=np.int64)
        self.histograms = np.zeros((dims, len(HIST_EDGES) - 1), dtype=np.int64)  # the report's, per dimension

    def add(self, rounded: np.ndarray, cat_idx: np.ndarray, domains: Sequence[str]) -> None:
        with open(self.all_file, "ab") as f:
            f.write(np.ascontiguousarray(rounded, dtype="<f8").tobytes())
        np.add.at(self.category_counts, cat_idx, 1)
        for i in range(rounded.shape[1]):  # each score's bin does not depend on the others: block sums are exact
            self.histograms[i] += np.histogram(rounded[:, i], bins=HIST_EDGES)[0]
        for i in range(rounded.shape[1]):
            buckets = np.clip(np.searchsorted(self.edges, rounded[:, i], side="right") - 1, 0, len(self.edges) - 2)
            np.add.at(self.grid[:, i, :], (cat_idx, buckets), 1)
        rows_of: dict[str, list[int]] = defaultdict(list)
        for j, d in enumerate(domains):
            rows_of[d].append(j)
        for d, rows in rows_of.items():
            with open(self.domain_files[d], "ab") as f:
                f.write(np.ascontiguousarray(rounded[rows], dtype="<f8").tobytes())
            np.add.at(self.domain_categories[d], cat_idx[rows], 1)

    def scores(self) -> np.ndarray:
        """Every document's rounded scores, [N, 2] float64, a read-only memmap."""
        return np.load(self.all_file, mmap_mode="r")

    def domain_scores(self, dom: str) -> np.ndarray:
        return np.load(self.domain_files[dom], mmap_mode="r")

    def category_counter(self, counts: np.ndarray) -> dict[str, int]:
        return dict(sorted((self.categories[c], int(v)) for c, v in enumerate(counts) if v))


def single_label_category(outcome: LabelOutcome) -> str | None:
    """The category when every accepted label has the same one (the category head would be a constant)."""
    cats = {lab.category for lab in outcome.labels.values()}
    return next(iter(cats)) if len(cats) == 1 else None


def single_category_warning(category: str, n_labels: int, kind: str, domains: list[str]) -> str:
    seen = sorted(set(domains))
    why = (f"no labeler.category_map pattern matches this corpus's domains or ids (domains: "
           f"{seen[:10]}{' ...' if len(seen) > 10 else ''}); add patterns for them, or label with kind "
           "causal_lm" if kind == "reference" else "the labeler named no other category")
    return (f"all {n_labels} accepted labels have category {category!r}, so the scorer's category head is a "
            f"constant: {why}")


def build_report(params: QualityParams, corpus: Corpus, outcome: LabelOutcome, fit_report: dict[str, Any],
            metrics: dict[str, Any], scorer: QualityScorer, stats: ScoreStats,
            n_sample: int, n_train: int, n_heldout: int, label_seconds: float,
            embed_seconds: float) -> dict[str, Any]:
    per_domain = {}
    for dom in sorted(corpus.domains):
        s = stats.domain_scores(dom)  # the domain's rows in input order, as scores[rows] was
        per_domain[dom] = {"documents": corpus.domains[dom]} | {
            f"mean_{d}": float(s[:, i].mean()) for i, d in enumerate(DIMENSIONS)} | {
            "categories": stats.category_counter(stats.domain_categories[dom])}
        del s
    scores = stats.scores()
    hist_edges = HIST_EDGES
    return {
        "documents": corpus.n_docs,
        "labeler": outcome.info | ({"fit": fit_report} if fit_report else {}),
        "labels": {"sample": n_sample, "accepted": len(outcome.labels),
                   "rejected": sum(outcome.rejected_counts.values()),
                   "rejected_by_reason": outcome.rejected_counts,
                   "reject_reasons": REJECT_REASONS,
                   "rejected_examples": outcome.rejected_examples(),
                   "train": n_train, "heldout": n_heldout,
                   "label_categories": dict(sorted(Counter(lab.category for lab in outcome.labels.values())
                                                   .items())),
                   "single_category": single_label_category(outcome)},
        "scorer": {"encoder": scorer.config["encoder"], "ridge_alpha": scorer.config["ridge_alpha"],
                   "category_c": scorer.config["category_c"], "categories": scorer.categories},
        # timings go to metrics only, so the artifact's bytes depend on inputs and params alone
        "heldout": metrics,
        "scores": {d: {"mean": float(scores[:, i].mean()),
                       "histogram": {"edges": hist_edges.tolist(),
                                     "counts": stats.histograms[i].tolist()}}
                   for i, d in enumerate(DIMENSIONS)},
        "categories": stats.category_counter(stats.category_counts),
        "per_domain": per_domain,
        "params": params.model_dump(mode="json"),
    }


# --- plots ----------------------------------------------------------------------------------------
def _violin_data(scores: np.ndarray, i: int) -> np.ndarray:
    """Dimension ``i`` of a domain's scores (a memmap), every row up to :data:`PLOT_POINTS_CAP`, evenly spaced
    rows beyond (the violin's kernel density would otherwise hold the whole domain in memory)."""
    step = -(-len(scores) // PLOT_POINTS_CAP)
    return np.ascontiguousarray(scores[::step, i])


def distribution_figure(stats: ScoreStats) -> Any:
    import matplotlib  # heavy: only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    doms = sorted(stats.domains)
    fig, axes = plt.subplots(1, len(DIMENSIONS), figsize=(5 + 0.8 * len(doms), 3.8), sharey=True)
    for ax, (i, d) in zip(np.atleast_1d(axes), enumerate(DIMENSIONS), strict=True):
        data = [_violin_data(stats.domain_scores(dom), i) for dom in doms]
        varied = [j for j, v in enumerate(data) if np.ptp(v) > 0]
        if varied:
            ax.violinplot([data[j] for j in varied], positions=varied, showmedians=True)
        means = [float(np.mean(v)) if len(v) == stats.domains[dom] else float(stats.domain_scores(dom)[:, i].mean())
                 for dom, v in zip(doms, data, strict=True)]  # of every score, also where the violin has fewer
        ax.scatter(range(len(doms)), means, marker="x", color="black",
                   label="mean", zorder=3)
        ax.set_xticks(range(len(doms)), [f"{dom}\n(n={stats.domains[dom]})" for dom in doms],
                      fontsize=8)
        ax.set_title(d.replace("_", " "), fontsize=10)
        ax.set_ylim(SCORE_MIN - 0.2, SCORE_MAX + 0.2)
    np.atleast_1d(axes)[0].set_ylabel("score (0-5)")
    np.atleast_1d(axes)[0].legend(fontsize=8, loc="upper right")
    fig.suptitle("Quality score distributions per domain", fontsize=10)
    return fig


def heatmap_figure(stats: ScoreStats, taxonomy: Sequence[str]) -> Any:
    import matplotlib  # heavy: only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    predicted = {stats.categories[c] for c, v in enumerate(stats.category_counts) if v}
    present = [t for t in taxonomy if t in predicted]
    edges = stats.edges
    fig, axes = plt.subplots(1, len(DIMENSIONS), figsize=(10, 0.5 * len(present) + 2), sharey=True)
    for ax, (i, d) in zip(np.atleast_1d(axes), enumerate(DIMENSIONS), strict=True):
        grid = np.zeros((len(present), len(edges) - 1), dtype=int)
        for c, name in enumerate(stats.categories):
            if name in present:
                grid[present.index(name)] = stats.grid[c, i]
        share = grid / np.maximum(grid.sum(axis=1, keepdims=True), 1)  # colour: share of the category
        ax.imshow(share, cmap="viridis", aspect="auto", vmin=0, vmax=1)
        for (r, k), v in np.ndenumerate(grid):
            ax.text(k, r, str(v), ha="center", va="center", fontsize=7,
                    color="white" if share[r, k] < 0.5 else "black")
        ax.set_xticks(range(len(edges) - 1), [f"{a:g}-{b:g}" for a, b in pairwise(edges)])
        ax.set_yticks(range(len(present)), present)
        ax.set_xlabel(f"{d.replace('_', ' ')} bucket")
    fig.suptitle("Documents per predicted category x quality bucket (colour: share of the row)", fontsize=10)
    return fig


def agreement_figure(labels: np.ndarray, pred: np.ndarray, metrics: dict[str, Any]) -> Any:
    import matplotlib  # heavy: only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    fig, axes = plt.subplots(1, len(DIMENSIONS), figsize=(8, 3.8))
    for ax, (i, d) in zip(np.atleast_1d(axes), enumerate(DIMENSIONS), strict=True):
        m = metrics[d]
        ax.scatter(labels[:, i], pred[:, i], s=8, alpha=0.6)
        ax.plot([SCORE_MIN, SCORE_MAX], [SCORE_MIN, SCORE_MAX], color="gray", lw=0.8)
        ax.axhline(m["baseline_value"], color="tab:red", lw=0.8, ls="--", label="constant baseline")
        ax.set_xlabel("label")
        ax.set_ylabel("scorer")
        ax.set_title(f"{d.replace('_', ' ')}: MAE {m['mae']:.2f} (baseline {m['baseline_mae']:.2f})",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"Held-out agreement (n={metrics['n']})", fontsize=10)
    return fig
