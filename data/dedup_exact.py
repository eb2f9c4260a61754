"""Stage ``dedup``'s first pass: exact-duplicate groups (text equal after collapsing whitespace, and case with
``exact_casefold``), each group's leader and contamination, and the leaders that go on to MinHash."""

from __future__ import annotations

import hashlib
import re
import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from data.decontamination import ContaminationIndex
from data.dedup_params import DedupParams
from data.dedup_state import Rows
from data.documents import DUP_COUNT, DUP_MEMBERS, iter_documents
from pipeline.stage import StageContext

_WHITESPACE = re.compile(r"\s+")  # str patterns: \s is str.isspace(), what str.split() splits on


def exact_key(text: str, casefold: bool) -> tuple[bytes, int]:
    """Hash of the whitespace-collapsed (optionally casefolded) text, and that text's length.

    ``" ".join(text.split())`` without the word list (one copy of the text, not an object per word)."""
    norm = _WHITESPACE.sub(" ", text).strip()
    if casefold:
        norm = norm.casefold()
    return hashlib.blake2b(norm.encode("utf-8"), digest_size=16).digest(), len(norm)


@dataclass
class FirstPassCounts:
    """What the first pass counts; everything per document or group is in the state database."""

    docs: int = 0
    bytes: int = 0
    groups: int = 0
    leaders: int = 0  # signature docs: groups whose first document goes on to MinHash


def incoming(meta: dict[str, Any]) -> tuple[int, list[str]]:
    count = meta.get(DUP_COUNT, 1)
    members = meta.get(DUP_MEMBERS) or []
    weight = count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else 1
    return weight, [str(m) for m in members] if isinstance(members, list) else []


def first_pass(params: DedupParams, ctx: StageContext, docs_path: Path, db: sqlite3.Connection,
                index: ContaminationIndex | None, signature_docs: Path) -> FirstPassCounts:
    """Read every document once: its row in ``doc``, exact groups (``grp``, looked up by hash) with their
    leader and contamination, and the groups whose first document goes on to MinHash (``sig``; their document
    positions also go to ``signature_docs``, int64, for the signature shards)."""
    drop_contaminated = params.decontamination == "drop"
    docs = Rows(db, "INSERT INTO doc (pos, id, domain, chars, weight, incoming, grp) VALUES (?, ?, ?, ?, ?, ?, ?)")
    sigs = Rows(db, "INSERT INTO sig (s, grp) VALUES (?, ?)")
    n = FirstPassCounts()
    with open(signature_docs, "wb") as positions:
        for i, rec in enumerate(ctx.track(iter_documents(docs_path), what="documents read")):
            text, doc_id = rec["text"], rec["id"]
            weight, members = incoming(rec.get("metadata") or {})
            key, length = exact_key(text, params.exact_casefold)
            n.docs += 1
            n.bytes += len(text.encode("utf-8"))
            found = db.execute("SELECT gid, leader_chars, leader_id FROM grp WHERE hash = ?", (key,)).fetchone()
            if found is not None:
                gid, chars, leader_id = found
                if (-length, doc_id) < (-chars, leader_id):  # the rank: longest, smaller id (then earlier)
                    db.execute("UPDATE grp SET size = size + 1, leader = ?, leader_chars = ?, leader_id = ? "
                               "WHERE gid = ?", (i, length, doc_id, gid))
                else:
                    db.execute("UPDATE grp SET size = size + 1 WHERE gid = ?", (gid,))
            else:
                gid = n.groups
                n.groups += 1
                matches = index.check(text) if index is not None else None
                db.execute("INSERT INTO grp VALUES (?, ?, ?, ?, ?, 1, ?)",
                           (gid, key, i, length, doc_id, orjson.dumps(matches) if matches else None))
                if not (matches and drop_contaminated):
                    sigs.add(n.leaders, gid)
                    positions.write(struct.pack("<q", i))
                    n.leaders += 1
            docs.add(i, doc_id, rec.get("domain") or "unknown", length, weight,
                     orjson.dumps(members) if members else None, gid)
    docs.flush()
    sigs.flush()
    return n
