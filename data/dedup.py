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
   removes the rest. Candidates whose MinHash estimate of J is more than :func:`estimate_margin`
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

Input documents that already carry ``DUP_COUNT`` (from an earlier dedup) count with that weight, and
their ``DUP_MEMBERS`` are carried to the representative, so deduping twice keeps the full count.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupSignature,
)
from datatrove.utils.binaryio import read_tuples_from_file
from pydantic import Field, field_validator

from data.decontamination import ContaminationIndex, build_contamination_index, resolve_decontaminate_paths
from data.documents import (
    ANY_DOCUMENTS,
    DOCUMENTS_TYPE,
    DUP_COUNT,
    DUP_MEMBERS,
    EVAL_CONTAMINATION,
    EVALSET_TYPE,
    DocumentWriter,
    count_documents,
    iter_document_range,
    iter_documents,
    write_jsonl_gz,
)
from data.minhash import BoundedMinhashSignature, FastMinhashSignature, Shingler, jaccard, quiet_datatrove
from pipeline.shards import split_ranges
from pipeline.stage import (
    InputSpec,
    StageContext,
    StageKind,
    StageParams,
    file_fingerprint,
    metric_key,
    track,
)

REPORT_NAME = "dedup_report.json"
CLUSTERS_NAME = "clusters.jsonl.gz"
DROPPED_SAMPLES_NAME = "dropped_samples.jsonl.gz"
# metadata set in decontamination: flag mode on contaminated kept documents
CONTAMINATION = EVAL_CONTAMINATION

DROP_REASONS: dict[str, str] = {
    "exact_duplicate": "same text (whitespace-collapsed) as a kept document or one of its near duplicates",
    "near_duplicate": "exact shingle Jaccard >= jaccard_threshold with the kept representative "
                      "(verify: estimate: in its MinHash-LSH cluster)",
    "eval_contamination": "contains or nearly copies an evaluation item (decontamination: drop)",
}
_KEPT, _EXACT, _NEAR, _CONTAMINATED = 0, 1, 2, 3
_REASON_OF = {_EXACT: "exact_duplicate", _NEAR: "near_duplicate", _CONTAMINATED: "eval_contamination"}
_MAX_FLAGS = 10  # contamination matches kept per document


class DedupParams(StageParams):
    exact_casefold: bool = Field(False, description=(
        "Exact dedup also ignores case (text is always compared with whitespace runs collapsed)."))
    n_grams: int = Field(5, ge=1, description="Shingle size in words for MinHash (datatrove n_grams).")
    bands: int = Field(20, ge=1, description=(
        "LSH bands (datatrove MinhashConfig.num_buckets). Candidate probability at Jaccard J: "
        "1 - (1 - J^rows)^bands; the default 20 x 6 finds pairs at J = 0.8 with P = 0.998 and leaves "
        "the threshold to the exact check (with verify: estimate use a steeper banding, e.g. 11 x 11)."))
    rows: int = Field(6, ge=1, description="Hashes per band (datatrove MinhashConfig.hashes_per_bucket).")
    seed: int = Field(1, description="Seed of the MinHash permutations and of the verification sample.")
    word_tokenizer: Literal["fast", "spacy"] = Field("fast", description=(
        "fast: whitespace words of datatrove-simplified text, numpy n-gram hashing; spacy: datatrove's "
        "stock shingling (spaCy blank tokenizer for `language`, ~5-10x slower)."))
    language: str = Field("en", description="Language of datatrove's word tokenizer (word_tokenizer: spacy).")
    jaccard_threshold: float = Field(0.8, gt=0, le=1, description=(
        "Exact shingle Jaccard with its kept representative at or above which a document is a near "
        "duplicate (verify: exact drops nothing below it; verify: estimate measures against it)."))
    verify: Literal["exact", "estimate"] = Field("exact", description=(
        "exact: a near duplicate is dropped only when its exact Jaccard with the kept representative "
        "reaches jaccard_threshold (LSH gives the candidates). estimate: datatrove's behaviour, every "
        "LSH cluster keeps one document; the exact Jaccard of verify_pairs sampled pairs estimates the "
        "precision."))
    verify_pairs: int = Field(200, ge=0, description="Near pairs checked for precision_estimate (verify: estimate).")
    max_members_listed: int = Field(100, ge=0, description=(
        "Cap on metadata.dup_members per kept document (dup_count always holds the full size)."))
    dropped_samples: int = Field(20, ge=0, description="Dropped documents per reason kept in dropped_samples.jsonl.gz.")
    decontaminate_paths: list[str] = Field(default_factory=list, description=(
        "Eval sets to decontaminate against: JSONL/JSONL.gz files or globs, one eval set per file "
        "(named by file stem). Item text: first of decontaminate_text_keys. Evalset artifacts on the "
        "eval_sets input are used too."))
    decontaminate_text_keys: list[str] = Field(
        default_factory=lambda: ["text", "prompt", "question", "problem", "input"],
        description="Fields tried in order for an eval item's text (the first non-empty string wins).")
    decontamination: Literal["drop", "flag"] = Field("drop", description=(
        "drop: contaminated documents are dropped (reason eval_contamination); flag: kept, with "
        "metadata.eval_contamination listing the matches."))
    contamination_ngram: int = Field(13, ge=1, description=(
        "Word n-gram of the containment check (items shorter than this are one n-gram)."))
    contamination_min_words: int = Field(8, ge=1, description="Eval items with fewer words are not checked.")
    contamination_containment: float = Field(0.5, gt=0, le=1, description=(
        "A document is contaminated by an item when this share of the item's n-grams occur in it."))
    contamination_jaccard: float = Field(0.5, gt=0, le=1, description=(
        "...or when its n_grams-shingle Jaccard with the item is at least this (MinHash-LSH, verified)."))
    contamination_num_perm: int = Field(128, ge=2, description="Permutations of the datasketch MinHashLSH.")

    @field_validator("decontaminate_paths")
    @classmethod
    def _paths_not_blank(cls, paths: list[str]) -> list[str]:
        for i, p in enumerate(paths):
            if not p.strip():
                raise ValueError(f"decontaminate_paths[{i}] is empty; give a JSONL file or glob")
        return paths

    @field_validator("decontaminate_text_keys")
    @classmethod
    def _keys_given(cls, keys: list[str]) -> list[str]:
        if not keys or any(not k for k in keys):
            raise ValueError("decontaminate_text_keys needs at least one non-empty field name, e.g. ['text']")
        return keys

    @property
    def s_curve_threshold(self) -> float:
        return (1 / self.bands) ** (1 / self.rows)

    def detection_probability(self, jaccard: float) -> float:
        """Chance that LSH pairs two documents of this Jaccard: 1 - (1 - J^rows)^bands."""
        return 1 - (1 - jaccard**self.rows) ** self.bands

    def minhash_config(self) -> MinhashConfig:
        return MinhashConfig(n_grams=self.n_grams, num_buckets=self.bands, hashes_per_bucket=self.rows,
                             seed=self.seed)


def estimate_margin(params: DedupParams) -> float:
    """How far below the threshold a candidate's MinHash estimate may be and still be checked exactly:
    5 standard errors of the estimate at the threshold, sqrt(t (1 - t) / hashes) (at least 0.05)."""
    t, hashes = params.jaccard_threshold, params.bands * params.rows
    return max(0.05, 5 * math.sqrt(t * (1 - t) / hashes))


def signature_step(params: DedupParams, output_folder: str | Path, shingler: Shingler | None = None,
                   ) -> MinhashDedupSignature:
    """The signature step ``params.word_tokenizer`` asks for (also used by the benchmark)."""
    if params.word_tokenizer == "fast":
        return FastMinhashSignature(str(output_folder), params.minhash_config(), shingler)
    return BoundedMinhashSignature(str(output_folder), config=params.minhash_config(), language=params.language)


_WHITESPACE = re.compile(r"\s+")  # str patterns: \s is str.isspace(), what str.split() splits on


def exact_key(text: str, casefold: bool) -> tuple[bytes, int]:
    """Hash of the whitespace-collapsed (optionally casefolded) text, and that text's length.

    ``" ".join(text.split())`` without the word list (one copy of the text, not an object per word)."""
    norm = _WHITESPACE.sub(" ", text).strip()
    if casefold:
        norm = norm.casefold()
    return hashlib.blake2b(norm.encode("utf-8"), digest_size=16).digest(), len(norm)


# --- reading the documents ------------------------------------------------------------------------
@dataclass
class _Corpus:
    """What the first pass keeps per document and per exact-duplicate group (no text)."""

    ids: list[str] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)  # of the whitespace-collapsed text
    weights: list[int] = field(default_factory=list)  # incoming dup_count (1 unless deduped before)
    incoming_members: dict[int, list[str]] = field(default_factory=dict)
    group_of: list[int] = field(default_factory=list)
    leader: list[int] = field(default_factory=list)  # per group: its longest document (ties: smaller id)
    first_of_group: list[int] = field(default_factory=list)  # per group: its first document (the one signed)
    group_size: list[int] = field(default_factory=list)
    minhash_groups: list[int] = field(default_factory=list)  # signature doc index -> group
    matches: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # group -> contamination
    bytes: int = 0

    def rank(self, i: int) -> tuple[int, str, int]:
        """Sort key of representative choice: longest (whitespace-collapsed) text, smaller id, input order."""
        return (-self.chars[i], self.ids[i], i)

    def leader_of_signature(self, sig_doc: int) -> int:
        return self.leader[self.minhash_groups[sig_doc]]


def _incoming(meta: dict[str, Any]) -> tuple[int, list[str]]:
    count = meta.get(DUP_COUNT, 1)
    members = meta.get(DUP_MEMBERS) or []
    weight = count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else 1
    return weight, [str(m) for m in members] if isinstance(members, list) else []


def _first_pass(params: DedupParams, ctx: StageContext, docs_path: Path, corpus: _Corpus,
                index: ContaminationIndex | None) -> None:
    """Read every document once: exact groups, contamination per group, and the groups whose first document
    goes on to MinHash (``corpus.minhash_groups``, in input order)."""
    groups: dict[bytes, int] = {}
    drop_contaminated = params.decontamination == "drop"
    for i, rec in enumerate(ctx.track(iter_documents(docs_path), what="documents read")):
        text = rec["text"]
        weight, members = _incoming(rec.get("metadata") or {})
        corpus.ids.append(rec["id"])
        corpus.domains.append(rec.get("domain") or "unknown")
        key, length = exact_key(text, params.exact_casefold)
        corpus.chars.append(length)
        corpus.weights.append(weight)
        if members:
            corpus.incoming_members[i] = members
        corpus.bytes += len(text.encode("utf-8"))
        gid = groups.get(key)
        if gid is not None:
            corpus.group_of.append(gid)
            corpus.group_size[gid] += 1
            if corpus.rank(i) < corpus.rank(corpus.leader[gid]):
                corpus.leader[gid] = i
            continue
        gid = groups[key] = len(corpus.leader)
        corpus.group_of.append(gid)
        corpus.leader.append(i)
        corpus.first_of_group.append(i)
        corpus.group_size.append(1)
        if index is not None and (found := index.check(text)):
            corpus.matches[gid] = found
            if drop_contaminated:
                continue
        corpus.minhash_groups.append(gid)


def _shingle_sets(docs_path: Path, corpus: _Corpus, leaders: set[int], sig_step: MinhashDedupSignature,
                  ) -> dict[int, np.ndarray]:
    """Unique shingles (sorted uint64) of the given leaders, by a second pass over the documents."""
    out: dict[int, np.ndarray] = {}
    if leaders:
        for i, rec in enumerate(iter_documents(docs_path)):
            if i in leaders:
                out[i] = np.unique(sig_step.get_shingles(rec["text"]).ravel())
    return out


# --- MinHash-LSH (datatrove) ----------------------------------------------------------------------
@dataclass
class _MinhashResult:
    edges: set[tuple[int, int]]  # candidate pairs LSH wrote (signature doc indices), all bands
    band_groups: list[list[int]]  # per band, the signature docs that share that band's hashes (size >= 2)
    signed: int  # leaders that had a signature (the others have fewer than n_grams words)
    offsets: list[int]  # per signature shard (datatrove rank): its first signature doc index
    cluster_of: dict[int, int] = field(default_factory=dict)  # verify: estimate: datatrove's clusters


@dataclass
class SignatureShard:
    """Signature docs [start, stop) (documents ``signature_docs[start:stop]`` of the input), as datatrove's
    signature step of rank ``rank`` (plain data: it travels to a Ray task)."""

    params: dict[str, Any]
    docs_path: str
    file_counts: list[int]
    signature_docs: str  # .npy of every signature doc's document position, in signature order
    start: int
    stop: int
    rank: int
    world_size: int
    output_folder: str


def signature_shard(shard: SignatureShard, progress: Callable[[str], None]) -> int:
    """MinHash signatures of one shard's signature docs, written as datatrove rank ``shard.rank``'s files."""
    params = DedupParams.model_validate(shard.params)
    positions = np.load(shard.signature_docs, mmap_mode="r")[shard.start:shard.stop]
    wanted = set(positions.tolist())

    def leaders() -> Iterator[Document]:
        if not len(positions):
            return
        records = iter_document_range(shard.docs_path, int(positions[0]), int(positions[-1]) + 1, shard.file_counts)
        for i, rec in enumerate(records, int(positions[0])):
            if i in wanted:
                yield Document(text=rec["text"], id=str(i))

    step = signature_step(params, shard.output_folder)
    with quiet_datatrove():
        step.run(track(leaders(), progress, total=len(positions), what="documents signed"), rank=shard.rank,
                 world_size=shard.world_size)
    return len(positions)


@dataclass
class BucketShard:
    """LSH bands [start, stop): datatrove's bucket step, one band at a time, over every rank's signatures."""

    params: dict[str, Any]
    signatures: str
    buckets: str
    start: int
    stop: int


def bucket_shard(shard: BucketShard, progress: Callable[[str], None]) -> int:
    params = DedupParams.model_validate(shard.params)
    config = params.minhash_config()
    with quiet_datatrove():
        for band in range(shard.start, shard.stop):  # one task per band, as datatrove's executor would run them
            MinhashDedupBuckets(shard.signatures, shard.buckets, config=config).run(rank=band, world_size=params.bands)
    return shard.stop - shard.start


def _run_minhash(params: DedupParams, ctx: StageContext, docs_path: Path, corpus: _Corpus,
                 work: Path) -> _MinhashResult:
    """datatrove's MinHash stages on the signature docs: signatures in shards (datatrove ranks, contiguous in
    input order), LSH buckets in shards of bands, clusters here. Every pair datatrove writes is (rank, doc in
    rank); rank r's docs start at signature doc ``offsets[r]``, and ties in a band's sorted merge are broken by
    (rank, doc), i.e. input order: the pairs, and all that follows, are those of one rank."""
    config = params.minhash_config()
    buckets, clusters = work / "buckets", work / "clusters"
    work.mkdir(parents=True, exist_ok=True)
    np.save(work / "signature_docs.npy", np.array([corpus.first_of_group[g] for g in corpus.minhash_groups],
                                                  dtype=np.int64))
    tasks = ctx.resources.tasks
    ranges = split_ranges(len(corpus.minhash_groups), tasks)
    file_counts = count_documents(docs_path)
    dump = params.model_dump(mode="json")
    ctx.map_shards(signature_shard, [
        SignatureShard(dump, str(docs_path), file_counts, str(work / "signature_docs.npy"), a, b, rank,
                       len(ranges), str(work / "signatures")) for rank, (a, b) in enumerate(ranges)], what="signatures")
    ctx.map_shards(bucket_shard, [BucketShard(dump, str(work / "signatures"), str(buckets), a, b)
                                  for a, b in split_ranges(params.bands, tasks)], what="lsh_bands")
    if params.verify == "estimate":
        with quiet_datatrove():
            MinhashDedupCluster(str(buckets), str(clusters), config=config, save_cluster_id=True).run(world_size=1)
    offsets = [a for a, _ in ranges]
    record = (params.rows * config.hash_config.precision // 8) + 4
    signed = sum((work / "signatures" / "bucket_000" / f"{rank:05d}.minhash.sig").stat().st_size // record
                 for rank in range(len(ranges)))
    edges: set[tuple[int, int]] = set()
    band_groups: list[list[int]] = []
    for dups in sorted(buckets.glob("*.dups")):  # one file per band
        with open(dups, "rb") as f:
            pairs = [(offsets[fa] + a, offsets[fb] + b)
                     for fa, a, fb, b in read_tuples_from_file(f, "4I", lines_to_buffer=-1)]
        edges.update((min(a, b), max(a, b)) for a, b in pairs)
        band_groups += _components(pairs)
    result = _MinhashResult(edges, band_groups, signed, offsets)
    for cluster_file in sorted(clusters.glob("*.clusters")):  # none when there is no pair at all
        rank = int(cluster_file.name.split(".")[0])
        with open(cluster_file, "rb") as f:
            result.cluster_of |= {offsets[rank] + doc: cid
                                  for doc, cid in read_tuples_from_file(f, "2I", lines_to_buffer=-1)}
    return result


def _components(pairs: list[tuple[int, int]]) -> list[list[int]]:
    """Connected components of one band's pairs. datatrove writes a band's equal-hash group d1..dk as the
    chain (d1, d2), (d2, d3), ...: its components are the groups."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = x = parent[parent[x]]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = defaultdict(list)
    for x in parent:
        groups[find(x)].append(x)
    return [sorted(g) for _, g in sorted(groups.items())]


def _read_signatures(work: Path, params: DedupParams, n_docs: int, offsets: list[int]) -> np.ndarray:
    """Every signature doc's hashes, [n_docs, bands * rows] uint64, from datatrove's signature files of every
    rank (zeros for leaders without shingles; they are in no band group)."""
    rec = np.dtype([("hashes", "<u8", (params.rows,)), ("doc", "<u4")])
    sigs = np.zeros((n_docs, params.bands, params.rows), dtype=np.uint64)
    for band in range(params.bands):
        for rank, offset in enumerate(offsets):
            data = np.fromfile(work / "signatures" / f"bucket_{band:03d}" / f"{rank:05d}.minhash.sig", dtype=rec)
            sigs[data["doc"].astype(np.int64) + offset, band] = data["hashes"]
    return sigs.reshape(n_docs, -1)


# --- decisions ------------------------------------------------------------------------------------
@dataclass
class _Decisions:
    reason: np.ndarray  # int8 per document: _KEPT / _EXACT / _NEAR / _CONTAMINATED
    duplicate_of: np.ndarray  # document it duplicates (exact: group leader; near: representative)
    jaccard: dict[int, float] = field(default_factory=dict)  # near member leader -> exact J with its rep
    clusters: int = 0  # representatives with at least one near duplicate

    def representative(self, i: int) -> int:
        while self.reason[i] in (_EXACT, _NEAR):
            i = int(self.duplicate_of[i])
        return i


def _base_decisions(params: DedupParams, corpus: _Corpus) -> _Decisions:
    """Exact duplicates and contamination; every leader kept for now."""
    n = len(corpus.ids)
    d = _Decisions(reason=np.zeros(n, dtype=np.int8), duplicate_of=np.full(n, -1, dtype=np.int64))
    contaminated = set(corpus.matches) if params.decontamination == "drop" else set()
    for i, gid in enumerate(corpus.group_of):
        if gid in contaminated:
            d.reason[i] = _CONTAMINATED
        elif i != corpus.leader[gid]:
            d.reason[i], d.duplicate_of[i] = _EXACT, corpus.leader[gid]
    return d


def _near_exact(params: DedupParams, ctx: StageContext, docs_path: Path, corpus: _Corpus, d: _Decisions,
                mh: _MinhashResult, sig_step: MinhashDedupSignature, work: Path) -> dict[str, Any]:
    """verify: exact. Longest leader first; each unplaced one is a representative and takes the unplaced
    LSH candidates (same hashes in some band) whose exact Jaccard with it reaches the threshold."""
    t = params.jaccard_threshold
    margin = estimate_margin(params)
    groups_of: dict[int, list[int]] = defaultdict(list)
    for g, members in enumerate(mh.band_groups):
        for s in members:
            groups_of[s].append(g)
    sigs = _read_signatures(work, params, len(corpus.minhash_groups), mh.offsets) if groups_of else None
    ctx.progress(f"checking LSH candidates of {len(groups_of)} leaders with the exact Jaccard (>= {t})")
    shingles = _shingle_sets(docs_path, corpus, {corpus.leader_of_signature(s) for s in groups_of}, sig_step)
    placed: set[int] = set()
    tally: Counter[str] = Counter()
    values: list[float] = []
    for r in sorted(groups_of, key=lambda s: corpus.rank(corpus.leader_of_signature(s))):
        if r in placed:
            continue
        placed.add(r)
        candidates = sorted({c for g in groups_of[r] for c in mh.band_groups[g]} - placed)
        if not candidates:
            continue
        assert sigs is not None
        estimates = (sigs[candidates] == sigs[r]).mean(axis=1)
        rep = corpus.leader_of_signature(r)
        for c, est in zip(candidates, estimates.tolist(), strict=True):
            tally["candidate_pairs"] += 1
            if est < t - margin:
                tally["skipped_by_estimate"] += 1
                continue
            member = corpus.leader_of_signature(c)
            j = jaccard(shingles[rep], shingles[member])
            tally["pairs_checked"] += 1
            if j >= t:
                placed.add(c)
                d.reason[member], d.duplicate_of[member] = _NEAR, rep
                d.jaccard[member] = j
                values.append(j)
            else:
                tally["below_threshold"] += 1
    d.clusters = len({int(d.duplicate_of[m]) for m in d.jaccard})
    arr = np.array(values)
    return {
        "mode": "exact", "jaccard_threshold": t, "estimate_margin": round(margin, 4),
        "near_pairs": len(values), "candidate_pairs": tally["candidate_pairs"],
        "pairs_checked": tally["pairs_checked"], "skipped_by_estimate": tally["skipped_by_estimate"],
        "checked_below_threshold": tally["below_threshold"],
        # every dropped member was measured: this is the precision, not an estimate of it
        "precision": float((arr >= t).mean()) if len(arr) else None,
        "min_member_jaccard": round(float(arr.min()), 4) if len(arr) else None,
        "jaccard_quantiles": _quantiles(arr), "lsh_pairs": len(mh.edges),
    }


def _near_estimate(params: DedupParams, ctx: StageContext, docs_path: Path, corpus: _Corpus, d: _Decisions,
                   mh: _MinhashResult, sig_step: MinhashDedupSignature) -> dict[str, Any]:
    """verify: estimate. datatrove's clusters as they are; exact Jaccard of a hash sample of
    (representative, member) pairs -> precision_estimate, and of LSH's own candidate pairs ->
    edge_precision_estimate (high edge and low member precision: chaining, A~B, B~C, A !~ C)."""
    members: dict[int, list[int]] = defaultdict(list)
    for sig_doc, cid in mh.cluster_of.items():
        members[cid].append(corpus.leader_of_signature(sig_doc))
    pairs = []  # (representative, member) leaders
    for cid in sorted(members):
        leaders = sorted(members[cid], key=corpus.rank)
        d.clusters += 1
        for m in leaders[1:]:
            d.reason[m], d.duplicate_of[m] = _NEAR, leaders[0]
            pairs.append((leaders[0], m))
    edges = sorted((corpus.leader_of_signature(a), corpus.leader_of_signature(b)) for a, b in mh.edges)

    def sampled(candidates: list[tuple[int, int]]) -> list[tuple[int, int]]:
        def order(pair: tuple[int, int]) -> bytes:
            key = f"{params.seed}\0{corpus.ids[pair[0]]}\0{corpus.ids[pair[1]]}"
            return hashlib.blake2b(key.encode(), digest_size=8).digest()
        return sorted(candidates, key=order)[:params.verify_pairs]

    sample, edge_sample = sampled(pairs), sampled(edges)
    if sample or edge_sample:
        ctx.progress(f"verifying {len(sample)} of {len(pairs)} near-duplicate pairs with exact Jaccard")
    shingles = _shingle_sets(docs_path, corpus, {i for pair in sample + edge_sample for i in pair}, sig_step)
    arr = np.array([jaccard(shingles[rep], shingles[m]) for rep, m in sample])
    for (_, m), j in zip(sample, arr.tolist(), strict=True):
        d.jaccard[m] = j
    edge_j = np.array([jaccard(shingles[a], shingles[b]) for a, b in edge_sample])
    t = params.jaccard_threshold
    return {
        "mode": "estimate", "jaccard_threshold": t, "near_pairs": len(pairs), "pairs_checked": len(sample),
        "precision_estimate": float((arr >= t).mean()) if len(arr) else None,
        "jaccard_quantiles": _quantiles(arr),
        "lsh_pairs": len(edges), "lsh_pairs_checked": len(edge_sample),
        "edge_precision_estimate": float((edge_j >= t).mean()) if len(edge_j) else None,
    }


def _quantiles(arr: np.ndarray) -> dict[str, float]:
    return ({q: round(float(np.quantile(arr, float(q))), 4) for q in ("0.0", "0.1", "0.5", "0.9", "1.0")}
            if len(arr) else {})


# --- the stage ------------------------------------------------------------------------------------
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
    sig_step = signature_step(params, work / "signatures", shingler)

    # pass 1: exact groups + contamination + signatures of the leaders; then LSH buckets
    corpus = _Corpus()
    ctx.progress(f"reading {docs_path} (MinHash {params.bands}x{params.rows}, {params.n_grams}-grams, "
                 f"{params.word_tokenizer} words, S-curve {params.s_curve_threshold:.3f}, verify: {params.verify} "
                 f"at Jaccard {params.jaccard_threshold})")
    _first_pass(params, ctx, docs_path, corpus, index)
    n_in = len(corpus.ids)
    if n_in == 0:
        raise ValueError(f"dedup: documents artifact {docs_path} holds no documents")
    mh = _run_minhash(params, ctx, docs_path, corpus, work)
    t_minhash = time.perf_counter()

    # near duplicates (pass 2 over the candidates' documents for their exact shingle sets)
    d = _base_decisions(params, corpus)
    if params.verify == "exact":
        verification = _near_exact(params, ctx, docs_path, corpus, d, mh, sig_step, work)
    else:
        verification = _near_estimate(params, ctx, docs_path, corpus, d, mh, sig_step)
    t_verify = time.perf_counter()
    members: dict[int, list[int]] = defaultdict(list)
    for i in np.flatnonzero((d.reason == _EXACT) | (d.reason == _NEAR)).tolist():
        members[d.representative(i)].append(i)

    # pass 3: write kept documents with their cluster metadata; samples of the dropped
    flagged = params.decontamination == "flag"
    samples: dict[str, list[dict[str, Any]]] = {r: [] for r in DROP_REASONS}
    dup_counts: Counter[int] = Counter()
    with DocumentWriter(ctx.out_dir) as writer:
        for i, rec in enumerate(ctx.track(iter_documents(docs_path), total=n_in, what="documents written")):
            if i >= n_in or rec["id"] != corpus.ids[i]:
                raise RuntimeError(f"dedup: {docs_path} changed while the stage read it (document {i})")
            reason = int(d.reason[i])
            if reason == _KEPT:
                ms = members.get(i, [])
                listed = list(corpus.incoming_members.get(i, []))
                for m in ms:
                    listed += [corpus.ids[m], *corpus.incoming_members.get(m, [])]
                meta = dict(rec.get("metadata") or {})
                meta[DUP_COUNT] = corpus.weights[i] + sum(corpus.weights[m] for m in ms)
                meta[DUP_MEMBERS] = listed[:params.max_members_listed]
                gid = corpus.group_of[i]
                if flagged and gid in corpus.matches:
                    meta[CONTAMINATION] = corpus.matches[gid][:_MAX_FLAGS]
                rec["metadata"] = meta
                writer.write(dict(rec))
                dup_counts[meta[DUP_COUNT]] += 1
            elif len(samples[_REASON_OF[reason]]) < params.dropped_samples:
                sample: dict[str, Any] = {"id": rec["id"], "reason": _REASON_OF[reason], "domain": rec.get("domain")}
                if reason == _CONTAMINATED:
                    sample["matches"] = corpus.matches[corpus.group_of[i]][:_MAX_FLAGS]
                else:
                    sample["duplicate_of"] = corpus.ids[int(d.duplicate_of[i])]
                    sample["representative"] = corpus.ids[d.representative(i)]
                    if i in d.jaccard:
                        sample["jaccard"] = round(d.jaccard[i], 4)
                sample["text"] = rec["text"][:2000]
                samples[_REASON_OF[reason]].append(sample)
    t_write = time.perf_counter()

    # accounting: every document is kept or dropped with one reason
    counts = {r: int((d.reason == code).sum()) for code, r in _REASON_OF.items()}
    kept = int((d.reason == _KEPT).sum())
    if n_in != kept + sum(counts.values()) or kept != writer.count:
        raise RuntimeError(f"dedup accounting is off: in {n_in} != kept {kept} (written {writer.count}) + "
                           f"dropped {counts} (a bug in data/dedup.py)")

    def cluster_rows() -> Iterator[dict[str, Any]]:
        for rep in sorted(members):
            yield {
                "representative": corpus.ids[rep],
                "dup_count": corpus.weights[rep] + sum(corpus.weights[m] for m in members[rep]),
                "members": [{"id": corpus.ids[m], "reason": _REASON_OF[int(d.reason[m])],
                             "duplicate_of": corpus.ids[int(d.duplicate_of[m])],
                             **({"jaccard": round(d.jaccard[m], 4)} if m in d.jaccard else {})}
                            for m in members[rep]]}

    n_cluster_rows = write_jsonl_gz(ctx.out_dir / CLUSTERS_NAME, cluster_rows())
    write_jsonl_gz(ctx.out_dir / DROPPED_SAMPLES_NAME, [s for r in DROP_REASONS for s in samples[r]])

    # per-domain and per-eval-set tallies
    domains: dict[str, Counter[str]] = defaultdict(Counter)
    for i, dom in enumerate(corpus.domains):
        domains[dom]["in"] += 1
        domains[dom]["kept" if d.reason[i] == _KEPT else _REASON_OF[int(d.reason[i])]] += 1
    contaminated_docs = sum(corpus.group_size[g] for g in corpus.matches)
    if index is not None:
        for gid, found in corpus.matches.items():
            for name in {m["eval_set"] for m in found}:
                index.tallies[name].contaminated_docs += corpus.group_size[gid]
            for m in found:
                index.tallies[m["eval_set"]].matched_items.add(m["item"])
                index.tallies[m["eval_set"]].matches[m["method"]] += 1

    total_s = time.perf_counter() - start
    precision = verification["precision"] if params.verify == "exact" else verification["precision_estimate"]
    report = {
        "documents": {"in": n_in, "kept": kept, "dropped": counts, "bytes_in": corpus.bytes},
        "exact": {"groups": len(corpus.leader),
                  "normalization": "whitespace collapsed" + (", casefolded" if params.exact_casefold else "")},
        "minhash": {
            "n_grams": params.n_grams, "bands": params.bands, "rows": params.rows,
            "hashes": params.bands * params.rows, "word_tokenizer": params.word_tokenizer,
            "s_curve_threshold": round(params.s_curve_threshold, 4),
            "detection_probability": {str(j): round(params.detection_probability(j), 4)
                                      for j in (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)},
            "leaders": len(corpus.minhash_groups), "leaders_with_signature": mh.signed,
            "leaders_too_short": len(corpus.minhash_groups) - mh.signed,
            "clusters": d.clusters,
        },
        "cluster_sizes": {str(k): v for k, v in sorted(dup_counts.items()) if k > 1},
        "verification": verification,
        "decontamination": None if index is None else {
            "mode": params.decontamination, "contaminated_docs": contaminated_docs,
            "ngram": params.contamination_ngram, "min_words": params.contamination_min_words,
            "containment_threshold": params.contamination_containment,
            "jaccard_threshold": params.contamination_jaccard, "num_perm": params.contamination_num_perm,
            "eval_sets": {name: t.as_report() for name, t in sorted(index.tallies.items())},
        },
        "domains": {dom: {k: c[k] for k in ("in", "kept", *DROP_REASONS)} for dom, c in sorted(domains.items())},
        "params": params.model_dump(),
        "files": {"clusters": CLUSTERS_NAME, "cluster_rows": n_cluster_rows,
                  "dropped_samples": DROPPED_SAMPLES_NAME},
    }
    report_path = ctx.out_dir / REPORT_NAME
    report_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    ctx.log_artifact(report_path)

    ctx.set_rows("documents", kept)
    for r, c in counts.items():
        ctx.set_rows(r, c)
    ctx.log_summary({"in": n_in, "kept": kept, "exact_duplicates": counts["exact_duplicate"],
                     "near_duplicates": counts["near_duplicate"], "contaminated": contaminated_docs,
                     "near_precision": float("nan") if precision is None else precision})
    metrics: dict[str, float] = {
        "s_curve_threshold": params.s_curve_threshold, "clusters": d.clusters,
        "near_pairs": verification["near_pairs"], "pairs_verified": verification["pairs_checked"],
        "lsh_pairs": verification["lsh_pairs"],
        "seconds.read_minhash": t_minhash - start, "seconds.verify": t_verify - t_minhash,
        "seconds.write": t_write - t_verify, "seconds.total": total_s,
        "docs_per_s": n_in / total_s, "mb_per_s": corpus.bytes / 1e6 / total_s,
    }
    for key in ("candidate_pairs", "skipped_by_estimate", "checked_below_threshold", "min_member_jaccard",
                "edge_precision_estimate"):
        if verification.get(key) is not None:
            metrics[key] = verification[key]
    for dom, c in sorted(domains.items()):
        key = metric_key(dom)
        metrics[f"dup_rate.{key}"] = (c["exact_duplicate"] + c["near_duplicate"]) / c["in"]
        metrics[f"exact_rate.{key}"] = c["exact_duplicate"] / c["in"]
        metrics[f"near_rate.{key}"] = c["near_duplicate"] / c["in"]
    if index is not None:
        for name, t in sorted(index.tallies.items()):
            metrics[f"contaminated_docs.{metric_key(name)}"] = t.contaminated_docs
    ctx.log_metrics(metrics)
    ctx.log_figure(_cluster_size_figure(dup_counts), "cluster_sizes.png")
    ctx.log_figure(_domain_rates_figure(domains), "dup_rates_by_domain.png")

    if precision is not None and precision < 0.5 and params.verify == "estimate":
        ctx.logger.warning("dedup: only %.0f%% of %d verified near pairs reach Jaccard %.2f with their "
                           "representative; use verify: exact", 100 * precision,
                           verification["pairs_checked"], params.jaccard_threshold)
    ctx.progress(f"{n_in} documents ({corpus.bytes / 1e6:.1f} MB) in {total_s:.1f}s: kept {kept}, exact "
                 f"{counts['exact_duplicate']}, near {counts['near_duplicate']}, contaminated "
                 f"{contaminated_docs} ({params.decontamination}); near-duplicate precision "
                 f"{'n/a' if precision is None else f'{precision:.3f}'}"
                 f"{' (estimate)' if params.verify == 'estimate' else ''}")


def _cluster_size_figure(dup_counts: Counter[int]) -> Any:
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


def _domain_rates_figure(domains: dict[str, Counter[str]]) -> Any:
    from matplotlib.figure import Figure

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
