"""Stage ``dedup``'s decisions: exact duplicates and contamination, then near duplicates among the LSH
candidates, by the exact shingle Jaccard (``verify: exact``) or datatrove's clusters with a sampled precision
(``verify: estimate``), and each document's cluster (its kept representative and the cluster's dup_count)."""

from __future__ import annotations

import hashlib
import heapq
import math
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from datatrove.pipeline.dedup.minhash import MinhashDedupSignature

from data import dedup_state  # BATCH read at call time (a test shrinks it)
from data.dedup_minhash import MinhashResult, SignatureRows
from data.dedup_params import DedupParams
from data.dedup_state import CONTAMINATED, EXACT, KEPT, NEAR, Rows, ShingleStore, scalar
from data.minhash import jaccard
from pipeline.stage import StageContext


def estimate_margin(params: DedupParams) -> float:
    """How far below the threshold a candidate's MinHash estimate may be and still be checked exactly:
    5 standard errors of the estimate at the threshold, sqrt(t (1 - t) / hashes) (at least 0.05)."""
    t, hashes = params.jaccard_threshold, params.bands * params.rows
    return max(0.05, 5 * math.sqrt(t * (1 - t) / hashes))


def base_decisions(params: DedupParams, db: sqlite3.Connection) -> None:
    """Exact duplicates (``dup_of`` their group's leader) and contamination; every leader kept for now. Each
    signature doc gets its leader, chosen now that the first pass is over."""
    if params.decontamination == "drop":
        db.execute(f"UPDATE doc SET reason = {CONTAMINATED} WHERE grp IN (SELECT gid FROM grp WHERE matches IS NOT NULL)")
    db.execute(f"UPDATE doc SET reason = {EXACT}, dup_of = (SELECT leader FROM grp WHERE gid = doc.grp) "
               f"WHERE reason = {KEPT} AND pos != (SELECT leader FROM grp WHERE gid = doc.grp)")
    db.execute("UPDATE sig SET leader = (SELECT leader FROM grp WHERE gid = sig.grp)")


# signature docs in some LSH band group, with their leader, by the leader's rank (longest, smaller id, earlier)
_CANDIDATE_LEADERS_BY_RANK = """
    SELECT sig.s, sig.leader FROM sig JOIN doc ON doc.pos = sig.leader WHERE sig.s IN (SELECT s FROM band)
    ORDER BY doc.chars DESC, doc.id, doc.pos"""
# the unplaced signature docs that share a band group with ?, with their leader
_UNPLACED_CANDIDATES = """
    SELECT sig.s, sig.leader FROM sig
    WHERE sig.s IN (SELECT other.s FROM band AS own JOIN band AS other ON other.g = own.g WHERE own.s = ?)
      AND sig.placed = 0
    ORDER BY sig.s"""


def near_exact(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection,
                mh: MinhashResult, sig_step: MinhashDedupSignature, work: Path) -> dict[str, Any]:
    """verify: exact. Longest leader first; each unplaced one is a representative and takes the unplaced
    LSH candidates (same hashes in some band) whose exact Jaccard with it reaches the threshold."""
    t = params.jaccard_threshold
    margin = estimate_margin(params)
    ctx.progress(f"checking LSH candidates of {scalar(db, 'SELECT COUNT(DISTINCT s) FROM band')} leaders "
                 f"with the exact Jaccard (>= {t})")
    shingles = ShingleStore(work / "shingles.u64", db)
    rows = SignatureRows(work / "signature_rows", mh.offsets, params.bands * params.rows)
    try:
        shingles.fill(docs_path, (pos for (pos,) in db.execute(
            "SELECT leader FROM sig WHERE s IN (SELECT s FROM band) ORDER BY leader")), sig_step)
        tally: Counter[str] = Counter()
        for r, rep in db.execute(_CANDIDATE_LEADERS_BY_RANK):
            if scalar(db, "SELECT placed FROM sig WHERE s = ?", (r,)):
                continue
            db.execute("UPDATE sig SET placed = 1 WHERE s = ?", (r,))
            _take_candidates(db, r, rep, rows, shingles, t - margin, t, tally)
    finally:
        shingles.close()
        rows.close()
    # the only per-document array: 8 bytes per near duplicate, for the quantiles
    arr = np.fromiter((j for (j,) in db.execute(f"SELECT jaccard FROM doc WHERE reason = {NEAR}")), dtype=np.float64)
    return {
        "mode": "exact", "jaccard_threshold": t, "estimate_margin": round(margin, 4),
        "near_pairs": len(arr), "candidate_pairs": tally["candidate_pairs"],
        "pairs_checked": tally["pairs_checked"], "skipped_by_estimate": tally["skipped_by_estimate"],
        "checked_below_threshold": tally["below_threshold"],
        # every dropped member was measured: this is the precision, not an estimate of it
        "precision": float((arr >= t).mean()) if len(arr) else None,
        "min_member_jaccard": round(float(arr.min()), 4) if len(arr) else None,
        "jaccard_quantiles": _quantiles(arr), "lsh_pairs": scalar(db, "SELECT COUNT(*) FROM edge"),
    }


def _take_candidates(db: sqlite3.Connection, r: int, rep: int, rows: SignatureRows, shingles: ShingleStore,
                     min_estimate: float, t: float, tally: Counter[str]) -> None:
    """Representative ``rep`` (leader of signature doc ``r``) takes each unplaced LSH candidate whose exact Jaccard
    with it reaches ``t``; a candidate whose MinHash estimate is below ``min_estimate`` is not checked. Candidates
    come ``dedup_state.BATCH`` at a time and shingle sets one at a time: memory does not grow with the cluster (its work is
    candidates x representatives, as before)."""
    signature = rows.get(np.array([r]))[0]
    rep_shingles: np.ndarray | None = None
    candidates = db.execute(_UNPLACED_CANDIDATES, (r,))
    while block := candidates.fetchmany(dedup_state.BATCH):
        sig_docs, leaders = np.array(block, dtype=np.int64).T
        check = ~((rows.get(sig_docs) == signature).mean(axis=1) < min_estimate)
        tally["candidate_pairs"] += len(block)
        tally["skipped_by_estimate"] += len(block) - int(check.sum())
        for c, member in zip(sig_docs[check].tolist(), leaders[check].tolist(), strict=True):
            if rep_shingles is None:
                rep_shingles = shingles.get(rep)
            j = jaccard(rep_shingles, shingles.get(member))
            tally["pairs_checked"] += 1
            if j >= t:  # placed now, so no later representative sees it (the cursor is past it)
                db.execute("UPDATE sig SET placed = 1 WHERE s = ?", (c,))
                db.execute(f"UPDATE doc SET reason = {NEAR}, dup_of = ?, jaccard = ? WHERE pos = ?", (rep, j, member))
            else:
                tally["below_threshold"] += 1


class _FirstByKey:
    """The ``k`` items of smallest key in a stream, ties to the earlier: ``sorted(stream, key)[:k]`` in O(k)."""

    def __init__(self, k: int) -> None:
        self.k, self.seen = k, 0
        self.items: list[tuple[bytes, int, Any]] = []

    def add(self, key: bytes, item: Any) -> None:
        self.items.append((key, self.seen, item))
        self.seen += 1
        if len(self.items) >= 2 * self.k + dedup_state.BATCH:
            self.items = heapq.nsmallest(self.k, self.items)

    def result(self) -> list[Any]:
        return [item for _, _, item in heapq.nsmallest(self.k, self.items)]


def near_estimate(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection,
                   sig_step: MinhashDedupSignature, work: Path) -> dict[str, Any]:
    """verify: estimate. datatrove's clusters as they are; exact Jaccard of a hash sample of
    (representative, member) pairs -> precision_estimate, and of LSH's own candidate pairs ->
    edge_precision_estimate (high edge and low member precision: chaining, A~B, B~C, A !~ C)."""
    def order(a_id: str, b_id: str) -> bytes:
        return hashlib.blake2b(f"{params.seed}\0{a_id}\0{b_id}".encode(), digest_size=8).digest()

    pairs, near = _FirstByKey(params.verify_pairs), Rows(db, f"UPDATE doc SET reason = {NEAR}, dup_of = ? WHERE pos = ?")
    cluster, rep, rep_id = None, -1, ""
    for cid, leader, leader_id in db.execute(
            "SELECT c.cid, sig.leader, doc.id FROM lsh_cluster AS c JOIN sig ON sig.s = c.s "
            "JOIN doc ON doc.pos = sig.leader ORDER BY c.cid, doc.chars DESC, doc.id, doc.pos"):
        if cid != cluster:  # its first leader by rank is the representative
            cluster, rep, rep_id = cid, leader, leader_id
            continue
        near.add(rep, leader)
        pairs.add(order(rep_id, leader_id), (rep, leader))
    near.flush()
    edges = _FirstByKey(params.verify_pairs)
    for a, a_id, b, b_id in db.execute(
            "SELECT sa.leader, da.id, sb.leader, dbb.id FROM edge JOIN sig AS sa ON sa.s = edge.a "
            "JOIN sig AS sb ON sb.s = edge.b JOIN doc AS da ON da.pos = sa.leader JOIN doc AS dbb ON dbb.pos = sb.leader "
            "ORDER BY sa.leader, sb.leader"):
        edges.add(order(a_id, b_id), (a, b))
    sample, edge_sample = pairs.result(), edges.result()
    if sample or edge_sample:
        ctx.progress(f"verifying {len(sample)} of {pairs.seen} near-duplicate pairs with exact Jaccard")
    shingles = ShingleStore(work / "shingles.u64", db)
    try:
        shingles.fill(docs_path, iter(sorted({i for pair in sample + edge_sample for i in pair})), sig_step)
        arr = np.array([jaccard(shingles.get(rep), shingles.get(m)) for rep, m in sample])
        edge_j = np.array([jaccard(shingles.get(a), shingles.get(b)) for a, b in edge_sample])
    finally:
        shingles.close()
    db.executemany("UPDATE doc SET jaccard = ? WHERE pos = ?",
                   [(j, m) for (_, m), j in zip(sample, arr.tolist(), strict=True)])
    t = params.jaccard_threshold
    return {
        "mode": "estimate", "jaccard_threshold": t, "near_pairs": pairs.seen, "pairs_checked": len(sample),
        "precision_estimate": float((arr >= t).mean()) if len(arr) else None,
        "jaccard_quantiles": _quantiles(arr),
        "lsh_pairs": edges.seen, "lsh_pairs_checked": len(edge_sample),
        "edge_precision_estimate": float((edge_j >= t).mean()) if len(edge_j) else None,
    }


def _quantiles(arr: np.ndarray) -> dict[str, float]:
    return ({q: round(float(np.quantile(arr, float(q))), 4) for q in ("0.0", "0.1", "0.5", "0.9", "1.0")}
            if len(arr) else {})


def assign_clusters(db: sqlite3.Connection) -> None:
    """Each document's representative (``rep``: the kept document of its cluster) and, per representative, the
    cluster's dup_count (incoming weights summed) and number of members."""
    db.execute(f"UPDATE doc SET rep = CASE reason WHEN {KEPT} THEN pos WHEN {NEAR} THEN dup_of END")
    # an exact duplicate's leader is kept or a near duplicate (contamination takes the whole group)
    db.execute(f"UPDATE doc SET rep = (SELECT leader.rep FROM doc AS leader WHERE leader.pos = doc.dup_of) "
               f"WHERE reason = {EXACT}")
    db.execute("CREATE INDEX doc_by_rep ON doc (rep, pos)")
    db.execute("INSERT INTO cluster (rep, dup_count, members) "
               "SELECT rep, SUM(weight), COUNT(*) - 1 FROM doc WHERE rep IS NOT NULL GROUP BY rep")
