"""Stage ``dedup``'s accounting and report: every document kept or dropped with one reason (checked), the
tallies per domain and eval set, ``dedup_report.json``, the run's metrics and its two plots."""

from __future__ import annotations

import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from data.decontamination import ContaminationIndex
from data.dedup_exact import FirstPassCounts
from data.dedup_minhash import MinhashResult
from data.dedup_output import CLUSTERS_NAME, DROPPED_SAMPLES_NAME
from data.dedup_params import DedupParams
from data.dedup_state import DROP_REASONS, KEPT, NEAR, REASON_OF, scalar
from pipeline.stage import metric_key

REPORT_NAME = "dedup_report.json"


@dataclass
class DedupTally:
    """What the decisions came to, read from the state when the output is written."""

    kept: int
    counts: dict[str, int]  # dropped documents per reason
    domains: dict[str, Counter[str]]  # per domain: in, kept and each drop reason
    contaminated_docs: int
    dup_counts: Counter[int]  # clusters per dup_count
    clusters: int  # representatives that took a near duplicate


def tally(db: sqlite3.Connection, n_docs: int, written: int, index: ContaminationIndex | None) -> DedupTally:
    """Accounting (every document is kept or dropped with one reason; a mismatch is a bug), per-domain and
    per-cluster-size counts, and each eval set's matches (added to ``index.tallies``)."""
    by_reason = dict(db.execute("SELECT reason, COUNT(*) FROM doc GROUP BY reason").fetchall())
    counts = {r: by_reason.get(code, 0) for code, r in REASON_OF.items()}
    kept = by_reason.get(KEPT, 0)
    if n_docs != kept + sum(counts.values()) or kept != written:
        raise RuntimeError(f"dedup accounting is off: in {n_docs} != kept {kept} (written {written}) + "
                           f"dropped {counts} (a bug in data/dedup.py)")

    # per-domain and per-eval-set tallies
    domains: dict[str, Counter[str]] = defaultdict(Counter)
    for dom, reason, count in db.execute("SELECT domain, reason, COUNT(*) FROM doc GROUP BY domain, reason"):
        domains[dom]["in"] += count
        domains[dom]["kept" if reason == KEPT else REASON_OF[reason]] += count
    contaminated_docs = 0
    for size, matches in db.execute("SELECT size, matches FROM grp WHERE matches IS NOT NULL ORDER BY gid"):
        contaminated_docs += size
        if index is not None:
            found = orjson.loads(matches)
            for name in {m["eval_set"] for m in found}:
                index.tallies[name].contaminated_docs += size
            for m in found:
                index.tallies[m["eval_set"]].matched_items.add(m["item"])
                index.tallies[m["eval_set"]].matches[m["method"]] += 1
    dup_counts: Counter[int] = Counter(dict(db.execute(
        "SELECT dup_count, COUNT(*) FROM cluster GROUP BY dup_count").fetchall()))
    clusters = scalar(db, f"SELECT COUNT(DISTINCT dup_of) FROM doc WHERE reason = {NEAR}")
    return DedupTally(kept, counts, domains, contaminated_docs, dup_counts, clusters)


def near_precision(params: DedupParams, verification: dict[str, Any]) -> float | None:
    """Share of near duplicates at or above the threshold: measured (verify: exact) or estimated."""
    return verification["precision"] if params.verify == "exact" else verification["precision_estimate"]


def build_report(params: DedupParams, n: FirstPassCounts, mh: MinhashResult, t: DedupTally,
                 verification: dict[str, Any], index: ContaminationIndex | None,
                 n_cluster_rows: int) -> dict[str, Any]:
    """The content of ``dedup_report.json``."""
    return {
        "documents": {"in": n.docs, "kept": t.kept, "dropped": t.counts, "bytes_in": n.bytes},
        "exact": {"groups": n.groups,
                  "normalization": "whitespace collapsed" + (", casefolded" if params.exact_casefold else "")},
        "minhash": {
            "n_grams": params.n_grams, "bands": params.bands, "rows": params.rows,
            "hashes": params.bands * params.rows, "word_tokenizer": params.word_tokenizer,
            "s_curve_threshold": round(params.s_curve_threshold, 4),
            "detection_probability": {str(j): round(params.detection_probability(j), 4)
                                      for j in (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)},
            "leaders": n.leaders, "leaders_with_signature": mh.signed,
            "leaders_too_short": n.leaders - mh.signed,
            "clusters": t.clusters,
        },
        "cluster_sizes": {str(k): v for k, v in sorted(t.dup_counts.items()) if k > 1},
        "verification": verification,
        "decontamination": None if index is None else {
            "mode": params.decontamination, "contaminated_docs": t.contaminated_docs,
            "ngram": params.contamination_ngram, "min_words": params.contamination_min_words,
            "containment_threshold": params.contamination_containment,
            "jaccard_threshold": params.contamination_jaccard, "num_perm": params.contamination_num_perm,
            "eval_sets": {name: e.as_report() for name, e in sorted(index.tallies.items())},
        },
        "domains": {dom: {k: c[k] for k in ("in", "kept", *DROP_REASONS)} for dom, c in sorted(t.domains.items())},
        "params": params.model_dump(),
        "files": {"clusters": CLUSTERS_NAME, "cluster_rows": n_cluster_rows,
                  "dropped_samples": DROPPED_SAMPLES_NAME},
    }


def stage_metrics(params: DedupParams, n: FirstPassCounts, t: DedupTally, verification: dict[str, Any],
                  index: ContaminationIndex | None, seconds: dict[str, float]) -> dict[str, float]:
    """The run's metrics: LSH and verification counts, ``seconds`` (read_minhash, verify, write, total), rates
    per domain and contaminated documents per eval set."""
    total_s = seconds["total"]
    metrics: dict[str, float] = {
        "s_curve_threshold": params.s_curve_threshold, "clusters": t.clusters,
        "near_pairs": verification["near_pairs"], "pairs_verified": verification["pairs_checked"],
        "lsh_pairs": verification["lsh_pairs"],
        **{f"seconds.{k}": v for k, v in seconds.items()},
        "docs_per_s": n.docs / total_s, "mb_per_s": n.bytes / 1e6 / total_s,
    }
    for key in ("candidate_pairs", "skipped_by_estimate", "checked_below_threshold", "min_member_jaccard",
                "edge_precision_estimate"):
        if verification.get(key) is not None:
            metrics[key] = verification[key]
    for dom, c in sorted(t.domains.items()):
        key = metric_key(dom)
        metrics[f"dup_rate.{key}"] = (c["exact_duplicate"] + c["near_duplicate"]) / c["in"]
        metrics[f"exact_rate.{key}"] = c["exact_duplicate"] / c["in"]
        metrics[f"near_rate.{key}"] = c["near_duplicate"] / c["in"]
    if index is not None:
        for name, e in sorted(index.tallies.items()):
            metrics[f"contaminated_docs.{metric_key(name)}"] = e.contaminated_docs
    return metrics


def cluster_size_figure(dup_counts: Counter[int]) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global backend state in a worker

    fig = Figure(figsize=(5.5, 3.5))
    ax = fig.add_subplot()
    sizes = sorted(k for k in dup_counts if k > 1)
    if sizes:
        ax.bar([str(k) for k in sizes], [dup_counts[k] for k in sizes], color="tab:blue")
        ax.set_yscale("log")
        ax.tick_params(axis="x", labelrotation=90 if len(sizes) > 12 else 0, labelsize=7)
    else:
        ax.text(0.5, 0.5, "no duplicates", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("cluster size (dup_count of the kept representative)")
    ax.set_ylabel("clusters")
    ax.set_title(f"Duplicate clusters: {sum(dup_counts[k] for k in sizes)} with size > 1", fontsize=9)
    return fig


def domain_rates_figure(domains: dict[str, Counter[str]]) -> Any:
    from matplotlib.figure import Figure  # heavy: only the plots need it

    names = sorted(domains)
    fig = Figure(figsize=(max(4.0, 0.7 * len(names) + 2), 3.5))
    ax = fig.add_subplot()
    bottom = np.zeros(len(names))
    for reason, color in zip(DROP_REASONS, ("tab:blue", "tab:orange", "tab:red"), strict=True):
        rates = np.array([domains[n][reason] / domains[n]["in"] for n in names])
        ax.bar(names, rates, bottom=bottom, label=reason, color=color)
        bottom += rates
    ax.set_ylabel("share of the domain's documents dropped")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelrotation=45)
    ax.set_title("Dropped by dedup per domain", fontsize=9)
    return fig

