"""Stage ``dedup``'s output: the kept documents with their cluster metadata (a third pass over the input),
samples of the dropped, and ``clusters.jsonl.gz`` (one row per representative, written member by member)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from data.dedup_params import DedupParams
from data.dedup_state import CONTAMINATED, CONTAMINATION, DROP_REASONS, KEPT, MAX_FLAGS, REASON_OF, scalar
from data.documents import DUP_COUNT, DUP_MEMBERS, DocumentWriter, JsonlGzWriter, iter_documents
from pipeline.stage import StageContext

CLUSTERS_NAME = "clusters.jsonl.gz"
DROPPED_SAMPLES_NAME = "dropped_samples.jsonl.gz"

_OUTPUT_ROWS = """
    SELECT doc.pos, doc.id, doc.reason, doc.dup_of, doc.rep, doc.jaccard, doc.incoming, grp.matches,
           cluster.dup_count, cluster.members
    FROM doc JOIN grp ON grp.gid = doc.grp LEFT JOIN cluster ON cluster.rep = doc.pos ORDER BY doc.pos"""
_MEMBERS = """
    SELECT member.id, member.reason, dup_of.id, member.jaccard, member.incoming
    FROM doc AS member JOIN doc AS dup_of ON dup_of.pos = member.dup_of
    WHERE member.rep = ? AND member.pos != member.rep ORDER BY member.pos"""


def _id_of(db: sqlite3.Connection, pos: int) -> str:
    return scalar(db, "SELECT id FROM doc WHERE pos = ?", (pos,))


def _listed_members(db: sqlite3.Connection, rep: int, incoming: bytes | None, members: int, cap: int) -> list[str]:
    """dup_members of a kept document: its incoming members, then each of its ``members`` (input order) followed
    by that member's incoming members, cut at ``cap`` (read only up to the cap, however large the cluster)."""
    listed: list[str] = orjson.loads(incoming) if incoming else []
    for member_id, _, _, _, member_incoming in db.execute(_MEMBERS, (rep,)) if members else ():
        if len(listed) >= cap:
            break
        listed.append(member_id)
        if member_incoming:
            listed += orjson.loads(member_incoming)
    return listed[:cap]


def write_documents(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection,
                     n_in: int) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    """Pass 3: the kept documents with their cluster metadata, and samples of the dropped. Returns how many
    were written and the samples."""
    flagged = params.decontamination == "flag"
    samples: dict[str, list[dict[str, Any]]] = {r: [] for r in DROP_REASONS}
    rows = db.execute(_OUTPUT_ROWS)
    with DocumentWriter(ctx.out_dir) as writer:
        for i, rec in enumerate(ctx.track(iter_documents(docs_path), total=n_in, what="documents written")):
            row = rows.fetchone()
            if row is None or rec["id"] != row[1]:
                raise RuntimeError(f"dedup: {docs_path} changed while the stage read it (document {i})")
            pos, _, reason, dup_of, rep, j, incoming, matches, dup_count, members = row
            if reason == KEPT:
                meta = dict(rec.get("metadata") or {})
                meta[DUP_COUNT] = dup_count
                meta[DUP_MEMBERS] = _listed_members(db, pos, incoming, members, params.max_members_listed)
                if flagged and matches is not None:
                    meta[CONTAMINATION] = orjson.loads(matches)[:MAX_FLAGS]
                rec["metadata"] = meta
                writer.write(dict(rec))
            elif len(samples[REASON_OF[reason]]) < params.dropped_samples:
                sample: dict[str, Any] = {"id": rec["id"], "reason": REASON_OF[reason], "domain": rec.get("domain")}
                if reason == CONTAMINATED:
                    sample["matches"] = orjson.loads(matches)[:MAX_FLAGS]
                else:
                    sample["duplicate_of"] = _id_of(db, dup_of)
                    sample["representative"] = _id_of(db, rep)
                    if j is not None:
                        sample["jaccard"] = round(j, 4)
                sample["text"] = rec["text"][:2000]
                samples[REASON_OF[reason]].append(sample)
    return writer.count, samples


def _cluster_row(db: sqlite3.Connection, rep: int, rep_id: str, dup_count: int) -> Iterator[bytes]:
    """One line of clusters.jsonl.gz in pieces, a member at a time: the bytes ``orjson.dumps`` gives for
    {"representative", "dup_count", "members": [{"id", "reason", "duplicate_of", "jaccard"?}, ...]}."""
    yield b'{"representative":' + orjson.dumps(rep_id) + b',"dup_count":' + orjson.dumps(dup_count) + b',"members":['
    for k, (member_id, reason, dup_of_id, j, _) in enumerate(db.execute(_MEMBERS, (rep,))):
        member = {"id": member_id, "reason": REASON_OF[reason], "duplicate_of": dup_of_id,
                  **({"jaccard": round(j, 4)} if j is not None else {})}
        yield (b"," if k else b"") + orjson.dumps(member)
    yield b"]}"


def write_clusters(db: sqlite3.Connection, path: Path) -> int:
    """clusters.jsonl.gz: one row per representative with members, in input order."""
    with JsonlGzWriter(path) as out:
        for rep, rep_id, dup_count in db.execute(
                "SELECT cluster.rep, doc.id, cluster.dup_count FROM cluster JOIN doc ON doc.pos = cluster.rep "
                "WHERE cluster.members > 0 ORDER BY cluster.rep"):
            out.write_pieces(_cluster_row(db, rep, rep_id, dup_count))
        return out.count
