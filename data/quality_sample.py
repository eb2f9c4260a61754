"""Stage ``quality``'s label sample: one pass over the input checks ids are unique (on disk), counts documents per
domain and picks the sample (smallest id hashes); a second reads the sample's texts and the reference labeler's
negatives; ``labels.jsonl.gz`` records every sampled document's label or rejection."""

from __future__ import annotations

import hashlib
import heapq
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.documents import JsonlGzWriter, iter_documents, unit_hash
from data.quality_labels import Label, LabelOutcome
from pipeline.stage import StageContext

LABELS_NAME = "labels.jsonl.gz"
NEGATIVE_SPAN_CHARS = 20_000  # a negative window is drawn from the first this many characters
ID_BLOCK = 4096  # ids inserted into the uniqueness table at once


class UniqueIds:
    """Ids seen so far in an on-disk SQLite table (a Python set of every id grew with the corpus); a repeated
    id raises. SQLite's page cache is bounded (its default 2 MB); the table is a file in work_dir."""

    def __init__(self, path: Path, docs_path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        self.docs_path = docs_path
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA synchronous=OFF")
        self.db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY) WITHOUT ROWID")
        self.block: list[str] = []

    def add(self, doc_id: str) -> None:
        self.block.append(doc_id)
        if len(self.block) >= ID_BLOCK:
            self.flush()

    def flush(self) -> None:
        """Check the block against itself and the table, then insert it. Checked before inserting: with no journal
        a ROLLBACK is undefined in SQLite (pages of a large block may already be written)."""
        block, self.block = self.block, []
        seen: set[str] = set()
        for i in block:
            if i in seen:
                self._repeated(i)
            seen.add(i)
        for a in range(0, len(block), 500):  # well under SQLite's limit of bound variables
            part = block[a:a + 500]
            found = self.db.execute(f"SELECT id FROM ids WHERE id IN ({','.join('?' * len(part))})", part).fetchone()
            if found:
                self._repeated(found[0])
        self.db.executemany("INSERT INTO ids VALUES (?)", [(i,) for i in block])

    def _repeated(self, doc_id: str) -> None:
        raise ValueError(f"quality: document id {doc_id!r} occurs twice in {self.docs_path}; ids must be unique "
                         "(ingest quarantines duplicate ids)")

    def close(self) -> None:
        self.db.close()


def ids_digest() -> Any:
    return hashlib.blake2b(digest_size=16)


def add_id(digest: Any, doc_id: str) -> None:
    b = doc_id.encode("utf-8", "surrogatepass")
    digest.update(len(b).to_bytes(8, "little") + b)


@dataclass
class Corpus:
    """What the stage keeps of its input after the first pass: counts per domain and the label sample (the
    ids of the sampled documents only, not every id)."""

    n_docs: int
    domains: dict[str, int]  # documents per domain, in first-seen order
    negative_domains: int  # domains with a document the reference labeler may take as a negative
    sample: list[int]  # positions of the label sample, in input order
    ids: dict[int, str]  # position -> id of the sampled documents
    sample_domains: dict[int, str]  # position -> domain of the sampled documents
    ids_digest: str  # of every id in input order: the writing pass checks the input is unchanged


def domain_of(rec: dict[str, Any]) -> str:
    return rec.get("domain") or "unknown"


def scan(docs_path: Path, ctx: StageContext, k: int, seed: int, exclude: set[str]) -> Corpus:
    """One pass: unique ids (on disk), documents per domain, and the k documents with the smallest (seed,
    "label", id) hashes (a heap of size k; ties by position, like ``heapq.nsmallest``)."""
    unique = UniqueIds(ctx.work_dir / "ids.sqlite", docs_path)
    digest = ids_digest()
    domains: Counter[str] = Counter()
    negative_domains: set[str] = set()
    heap: list[tuple[float, int, str, str]] = []  # (-hash, -position, id, domain): the root is the largest
    n = 0
    try:
        for n, rec in enumerate(ctx.track(iter_documents(docs_path), what="documents scanned"), start=1):
            doc_id, dom = rec["id"], domain_of(rec)
            unique.add(doc_id)
            add_id(digest, doc_id)
            domains[dom] += 1
            if doc_id not in exclude:
                negative_domains.add(dom)
            item = (-unit_hash(seed, "label", doc_id), -(n - 1), doc_id, dom)
            if len(heap) < k:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)
        unique.flush()
    finally:
        unique.close()
        (ctx.work_dir / "ids.sqlite").unlink(missing_ok=True)
    if not n:
        raise ValueError(f"quality: documents artifact {docs_path} holds no documents")
    picked = sorted((-m, doc_id, dom) for _, m, doc_id, dom in heap)
    return Corpus(n, dict(domains), len(negative_domains), [m for m, _, _ in picked],
                   {m: i for m, i, _ in picked}, {m: d for m, _, d in picked}, digest.hexdigest())


def texts_and_negatives(docs_path: Path, corpus: Corpus, k: int, seed: int, exclude: set[str] | None,
                         max_chars: int) -> tuple[dict[int, str], list[int]]:
    """The sample's texts and, when ``exclude`` is given (the reference labeler), about ``k`` negatives with
    their texts: equally many per domain, the smallest (seed, "negative", id) hashes of each (a heap per
    domain of that size, each holding the texts it keeps: bounded by ``k`` plus a document per domain).

    Stratified so a small domain's register (licences, man pages) is contrasted with the references as
    much as a large one's; with uniform sampling the labels mostly learn "not code".
    """
    wanted = set(corpus.sample)
    texts: dict[int, str] = {}
    per_domain = -(-k // max(1, corpus.negative_domains))
    heaps: dict[str, list[tuple[float, int, str, str]]] = defaultdict(list)  # (-hash, -position, id, text)
    for n, rec in enumerate(iter_documents(docs_path)):
        if n in wanted:
            texts[n] = rec["text"][:max_chars]
        if exclude is None or rec["id"] in exclude or per_domain == 0:
            continue
        heap = heaps[domain_of(rec)]
        key = (-unit_hash(seed, "negative", rec["id"]), -n)
        if len(heap) < per_domain:
            heapq.heappush(heap, (*key, rec["id"], rec["text"][:max_chars]))
        elif key > heap[0][:2]:
            heapq.heapreplace(heap, (*key, rec["id"], rec["text"][:max_chars]))
    negatives: list[int] = []
    for heap in heaps.values():
        for _, m, doc_id, text in heap:
            negatives.append(-m)
            texts[-m] = text
            corpus.ids.setdefault(-m, doc_id)
    return texts, sorted(negatives)


def negative_window(text: str, doc_id: str, length: int, seed: int) -> str:
    """A window of ``length`` characters at a hash-chosen offset (whole text when shorter)."""
    if len(text) <= length:
        return text
    start = int(unit_hash(seed, "negative-offset", doc_id) * (len(text) - length))
    return text[start:start + length]


def write_labels(path: Path, sample: list[int], corpus: Corpus, outcome: LabelOutcome,
                  heldout: set[int]) -> None:
    with JsonlGzWriter(path) as f:
        for n in sample:
            doc_id = corpus.ids[n]
            row: dict[str, Any] = {"id": doc_id, "domain": corpus.sample_domains[n]}
            label: Label | None = outcome.labels.get(doc_id)
            if label is not None:
                row |= {"status": "accepted", "split": "heldout" if n in heldout else "train"} | label.as_dict()
            else:
                row |= {"status": "rejected", "reason": outcome.rejected[doc_id]}
            if doc_id in outcome.replies:
                row["reply"] = outcome.replies[doc_id]
            f.write(row)
