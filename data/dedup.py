"""Stage ``dedup``: exact and MinHash-LSH near-duplicate removal, and eval-set decontamination.

One representative per duplicate cluster is kept and carries the repetition signal that mixing uses
(§4.1.3.2): ``metadata[DUP_COUNT]`` (cluster size, >= 1 on every kept document) and
``metadata[DUP_MEMBERS]`` (ids of the removed members, at most ``max_members_listed``). Every input
document is kept or dropped with a reason from :data:`DROP_REASONS`; ``in == kept + dropped`` is checked.

Order of work, and what a reader of the output should know:

1. **Decontamination** (when eval sets are given) is decided once per exact-duplicate group, before
   dedup: in ``drop`` mode contaminated documents leave before clustering, so a representative is
   never contaminated; in ``flag`` mode they stay and get ``metadata[CONTAMINATION]``. Two checks:

   - *n-gram containment* (embedded items): the share of an item's word n-grams
     (``contamination_ngram``, 13 by default, like GPT-3's 13-gram overlap; an item shorter than that
     is one n-gram of its full length) found in the document. Eval items are short and training
     documents long, so a Jaccard (or a MinHash estimate of it) between the two is near 0 even when
     the item is copied verbatim: containment, looked up exactly in an inverted index, is the test
     that sees it. Items under ``contamination_min_words`` words are not checked (counted).
   - *MinHash-LSH Jaccard* (near-copies of an item as a document): datasketch ``MinHashLSH`` over the
     items' ``n_grams`` shingles, queried by each document short enough to reach the threshold (J <=
     min/max set size); candidates are confirmed with the exact Jaccard. This catches an item
     re-posted with small edits, which break most of its 13-grams.

   Eval item text: the first of ``decontaminate_text_keys`` that is a non-empty string (by default
   ``text``, ``prompt``, ``question``, ``problem``, ``input``; answers are not matched: a document
   that holds the question is contaminated with or without the answer). Text is normalized like the
   MinHash shingles (datatrove's ``simplify_text``: lowercase, punctuation and diacritics removed,
   digit runs -> 0), so items that differ only in their numbers count as the same text.
2. **Exact dedup**: groups of documents whose text is equal after collapsing whitespace (and case,
   with ``exact_casefold``). In each group the *leader* is the longest text (characters of the
   whitespace-collapsed text, so members tie unless case differs), ties broken by the smaller id;
   the others are dropped as ``exact_duplicate``.
3. **Near dedup** of the leaders with datatrove's MinHash stages (``MinhashDedupSignature`` ->
   ``MinhashDedupBuckets`` -> ``MinhashDedupCluster``; ``bands`` x ``rows`` hashes, S-curve
   threshold (1/bands)^(1/rows), 11 x 11 -> 0.804). datatrove's ``MinhashDedupFilter`` is not used:
   it keeps the union-find root (not a chosen representative) and annotates only survivors; we read
   the cluster ids it would read (``*.clusters``) and apply them ourselves. In a cluster the
   representative is again the longest leader (ties: smaller id); the other leaders are dropped as
   ``near_duplicate``. Leaders with fewer than ``n_grams`` words have no shingles: exact dedup only.
4. **Verification**: the exact Jaccard of the shingle sets of (representative, member) for up to
   ``verify_pairs`` near pairs (a deterministic hash sample) gives ``precision_estimate`` = share of
   pairs at or above ``jaccard_threshold`` (``edge_precision_estimate``: the same for LSH's own
   candidate pairs; the gap between the two is chaining, A~B and B~C but A !~ C). ``verify: drop_false_positives`` checks every pair and
   keeps members below the threshold as their own representatives (they are not compared with each
   other again).

Word tokenizer: datatrove picks spaCy for English, which dominates the signature cost.
``word_tokenizer: fast`` (default) uses :class:`FastMinhashSignature`: the same ``simplify_text``
output (a faster equivalent, checked by the tests), words split on whitespace (each CJK character a
word) and n-gram hashes combined with numpy. ``spacy`` runs datatrove's stock signature step.

Input documents that already carry ``DUP_COUNT`` (from an earlier dedup) count with that weight, and
their ``DUP_MEMBERS`` are carried to the representative, so deduping twice keeps the full count.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import shutil
import time
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson
import regex
from datatrove.data import Document
from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupSignature,
)
from datatrove.utils.binaryio import read_tuples_from_file
from datatrove.utils.hashes.xxhash import xxhash64
from datatrove.utils.text import NUMBERS_PATTERN, PUNCTUATION
from datatrove.utils.word_tokenizers import WordTokenizer
from pydantic import Field, field_validator

from data.documents import (
    ANY_DOCUMENTS,
    DOCUMENTS_TYPE,
    DUP_COUNT,
    DUP_MEMBERS,
    EVAL_CONTAMINATION,
    EVALSET_TYPE,
    DocumentWriter,
    iter_documents,
)
from pipeline.stage import (
    Artifact,
    InputSpec,
    StageContext,
    StageKind,
    StageParams,
    file_fingerprint,
    metric_key,
)

REPORT_NAME = "dedup_report.json"
CLUSTERS_NAME = "clusters.jsonl.gz"
DROPPED_SAMPLES_NAME = "dropped_samples.jsonl.gz"
# metadata set in decontamination: flag mode on contaminated kept documents
CONTAMINATION = EVAL_CONTAMINATION

DROP_REASONS: dict[str, str] = {
    "exact_duplicate": "same text (whitespace-collapsed) as a kept document or one of its near duplicates",
    "near_duplicate": "in a MinHash-LSH cluster whose representative was kept",
    "eval_contamination": "contains or nearly copies an evaluation item (decontamination: drop)",
}
_KEPT, _EXACT, _NEAR, _CONTAMINATED = 0, 1, 2, 3
_REASON_OF = {_EXACT: "exact_duplicate", _NEAR: "near_duplicate", _CONTAMINATED: "eval_contamination"}
_MAX_FLAGS = 10  # contamination matches kept per document


class DedupParams(StageParams):
    exact_casefold: bool = Field(False, description=(
        "Exact dedup also ignores case (text is always compared with whitespace runs collapsed)."))
    n_grams: int = Field(5, ge=1, description="Shingle size in words for MinHash (datatrove n_grams).")
    bands: int = Field(11, ge=1, description=(
        "LSH bands (datatrove MinhashConfig.num_buckets). S-curve threshold = (1/bands)^(1/rows)."))
    rows: int = Field(11, ge=1, description="Hashes per band (datatrove MinhashConfig.hashes_per_bucket).")
    seed: int = Field(1, description="Seed of the MinHash permutations and of the verification sample.")
    word_tokenizer: Literal["fast", "spacy"] = Field("fast", description=(
        "fast: whitespace words of datatrove-simplified text, numpy n-gram hashing; spacy: datatrove's "
        "stock signature step (spaCy blank tokenizer for `language`, ~5-10x slower)."))
    language: str = Field("en", description="Language of datatrove's word tokenizer (word_tokenizer: spacy).")
    jaccard_threshold: float = Field(0.8, gt=0, le=1, description=(
        "Exact shingle Jaccard at or above which a (representative, member) pair counts as a true "
        "duplicate in verification."))
    verify: Literal["estimate", "drop_false_positives"] = Field("estimate", description=(
        "estimate: exact Jaccard on a sample of verify_pairs near pairs -> precision_estimate. "
        "drop_false_positives: check every pair and keep members below jaccard_threshold."))
    verify_pairs: int = Field(200, ge=0, description="Near pairs checked for precision_estimate (estimate mode).")
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


# --- fast shingling ---------------------------------------------------------------------------------
_PUNCT_OR_SPACE = re.compile("[" + re.escape(PUNCTUATION) + r"\s]+")
_MARKS = regex.compile(r"\p{Mn}+")


def simplify(text: str) -> str:
    """Same output as datatrove's ``simplify_text(text, TextNormConfig())``, several times faster.

    datatrove maps punctuation to spaces with ``str.translate``, collapses whitespace with a second
    regex pass and drops combining marks character by character; here one regex does the first two
    and ASCII text skips the third (it has no marks).
    """
    text = NUMBERS_PATTERN.sub("0", text.lower())
    text = _PUNCT_OR_SPACE.sub(" ", text).strip()
    if not text.isascii():
        text = _MARKS.sub("", unicodedata.normalize("NFD", text)).strip()
    return text


_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
_WORD = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")
_SENTENCE_BREAK = re.compile(r"(?<=[.!?。！？])\s+|\n+")


class FastWordTokenizer(WordTokenizer):
    """Whitespace words; each kana/CJK/hangul character is a word (those scripts have no spaces).

    A datatrove ``WordTokenizer``: meant for text already simplified (no punctuation), as in MinHash.
    """

    def __init__(self) -> None:
        super().__init__(language=None)

    def word_tokenize(self, text: str) -> list[str]:
        return text.split() if text.isascii() else _WORD.findall(text)

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        """Sentence spans: breaks after . ! ? (and CJK full stops) followed by space, and at newlines."""
        spans, start = [], 0
        for m in _SENTENCE_BREAK.finditer(text):
            spans.append((start, m.start()))
            start = m.end()
        spans.append((start, len(text)))
        return [(s, e) for s, e in spans if text[s:e].strip()]

    def sent_tokenize(self, text: str) -> list[str]:
        return [text[s:e].strip() for s, e in self.span_tokenize(text)]


_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant of the polynomial n-gram hash
_MIX1, _MIX2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


def ngram_hashes(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """64-bit hashes of every word n-gram (in order, with repeats): a polynomial over the word hashes,
    then murmur3's fmix64 so the bits are well spread for the MinHash permutations."""
    count = len(word_hashes) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    h = word_hashes[:count].copy()
    for j in range(1, n):
        h = h * _MULT + word_hashes[j:j + count]  # wraps mod 2^64
    h ^= h >> np.uint64(33)
    h *= _MIX1
    h ^= h >> np.uint64(33)
    h *= _MIX2
    h ^= h >> np.uint64(33)
    return h


class Shingler:
    """simplify -> words -> word hashes, with a one-text memo so the decontamination check and the
    signature step (which see the same ``str`` object) tokenize a document once."""

    def __init__(self, tokenizer: WordTokenizer | None = None, cache_words: int = 1 << 20) -> None:
        self.tokenizer = tokenizer or FastWordTokenizer()
        self._cache: dict[str, int] = {}
        self._cache_words = cache_words
        self._memo_text: str | None = None
        self._memo: np.ndarray = np.empty(0, dtype=np.uint64)

    def word_hashes(self, text: str) -> np.ndarray:
        if text is not self._memo_text:
            if len(self._cache) > self._cache_words:
                self._cache.clear()
            cache = self._cache
            words = self.tokenizer.word_tokenize(simplify(text))
            hashes = [cache.get(w) for w in words]
            for i, h in enumerate(hashes):
                if h is None:
                    hashes[i] = cache[words[i]] = xxhash64(words[i])
            self._memo_text = text
            self._memo = np.array(hashes, dtype=np.uint64)
        return self._memo

    def shingles(self, text: str, n: int) -> np.ndarray:
        return ngram_hashes(self.word_hashes(text), n)


class FastMinhashSignature(MinhashDedupSignature):
    """datatrove's signature step with the :class:`Shingler` in place of spaCy + per-n-gram hashing.

    Shingles are the same word n-grams of the same simplified text; only their 64-bit hash function
    differs, so signatures are not interchangeable with the stock step's (nothing here mixes them).
    """

    def __init__(self, output_folder: str, config: MinhashConfig, shingler: Shingler | None = None) -> None:
        super().__init__(output_folder, config=config)
        self.shingler = shingler or Shingler()
        self.word_tokenizer = self.shingler.tokenizer  # what a caller inspecting the step sees

    def get_shingles(self, text: str) -> np.ndarray:
        return self.shingler.shingles(text, self.config.n_grams).reshape((-1, 1))


def signature_step(params: DedupParams, output_folder: str | Path, shingler: Shingler | None = None,
                   ) -> MinhashDedupSignature:
    """The signature step ``params.word_tokenizer`` asks for (also used by the benchmark)."""
    if params.word_tokenizer == "fast":
        return FastMinhashSignature(str(output_folder), params.minhash_config(), shingler)
    return MinhashDedupSignature(str(output_folder), config=params.minhash_config(), language=params.language)


@contextmanager
def _quiet_datatrove() -> Iterator[None]:
    """datatrove logs every step at INFO through loguru; this stage reports its own progress."""
    from datatrove.utils.logging import logger

    logger.disable("datatrove")
    try:
        yield
    finally:
        logger.enable("datatrove")


def exact_key(text: str, casefold: bool) -> tuple[bytes, int]:
    """Hash of the whitespace-collapsed (optionally casefolded) text, and that text's length."""
    norm = " ".join(text.split())
    if casefold:
        norm = norm.casefold()
    return hashlib.blake2b(norm.encode("utf-8"), digest_size=16).digest(), len(norm)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sets given as unique sorted arrays (0 when both are empty)."""
    if len(a) == 0 and len(b) == 0:
        return 0.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


# --- decontamination ------------------------------------------------------------------------------
@dataclass
class EvalSetTally:
    source: str
    items: int = 0
    checked: int = 0
    too_short: int = 0
    no_text: int = 0
    contaminated_docs: int = 0
    matched_items: set[str] = field(default_factory=set)
    matches: Counter[str] = field(default_factory=Counter)  # by method

    def as_report(self) -> dict[str, Any]:
        return {"source": self.source, "items": self.items, "checked_items": self.checked,
                "too_short_items": self.too_short, "items_without_text": self.no_text,
                "contaminated_docs": self.contaminated_docs, "matched_items": len(self.matched_items),
                "doc_matches_by_method": dict(sorted(self.matches.items()))}


@dataclass(frozen=True)
class EvalItem:
    eval_set: str
    item_id: str
    n: int  # word length of the containment n-grams (shorter items: their own length)
    grams: np.ndarray  # unique containment n-grams
    shingles: np.ndarray  # unique n_grams-shingles (for the Jaccard check)


def _eval_files_of_artifact(art: Artifact) -> list[tuple[str, Path]]:
    base = art.manifest.get("stage") or art.path.name
    files = sorted(p for p in art.path.rglob("*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")))
    if not files:
        raise FileNotFoundError(f"dedup: evalset artifact {art.path} holds no .jsonl or .jsonl.gz file")
    return [(f"{base}/{_stem(p.relative_to(art.path).as_posix())}", p) for p in files]


def _stem(name: str) -> str:
    return re.sub(r"\.jsonl(\.gz)?$", "", name)


def resolve_decontaminate_paths(paths: list[str]) -> list[Path]:
    """Files named by ``decontaminate_paths`` (globs expanded, sorted), each once."""
    out: list[Path] = []
    for pattern in paths:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob.glob(expanded, recursive=True)) if glob.escape(expanded) != expanded else [expanded]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"dedup: decontaminate_paths entry {pattern!r} names no file "
                                    f"(resolved against {os.getcwd()})")
        out += [Path(m).resolve() for m in matches if Path(m).resolve() not in out]
    return out


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield line_no, orjson.loads(line)
                except orjson.JSONDecodeError as e:
                    raise ValueError(f"dedup: eval set {path} line {line_no} is not valid JSON: {e}") from e


class ContaminationIndex:
    """Eval items indexed two ways: exact n-gram -> items (containment) and a datasketch MinHashLSH."""

    def __init__(self, params: DedupParams, shingler: Shingler,
                 eval_files: list[tuple[str, Path]]) -> None:
        from datasketch import MinHash, MinHashLSH

        self.p = params
        self.shingler = shingler
        self.items: list[EvalItem] = []
        self.tallies: dict[str, EvalSetTally] = {}
        for name, path in eval_files:
            if name in self.tallies:
                name = f"{name}#{len(self.tallies)}"
            tally = self.tallies[name] = EvalSetTally(source=str(path))
            for line_no, rec in _read_jsonl(path):
                tally.items += 1
                text = self._item_text(rec)
                if text is None:
                    tally.no_text += 1
                    continue
                words = shingler.word_hashes(text)
                if len(words) < params.contamination_min_words:
                    tally.too_short += 1
                    continue
                item_id = str(rec["id"]) if isinstance(rec, dict) and rec.get("id") is not None else str(line_no)
                n = min(params.contamination_ngram, len(words))
                self.items.append(EvalItem(name, item_id, n, np.unique(ngram_hashes(words, n)),
                                           np.unique(ngram_hashes(words, params.n_grams))))
                tally.checked += 1
            if tally.items and tally.no_text == tally.items:
                raise ValueError(f"dedup: no record of eval set {path} has a non-empty string in any of "
                                 f"{params.decontaminate_text_keys}; set decontaminate_text_keys")

        # containment: per n-gram length, the (gram, item) pairs sorted by gram
        by_len: dict[int, list[tuple[np.ndarray, int]]] = defaultdict(list)
        for k, item in enumerate(self.items):
            by_len[item.n].append((item.grams, k))
        self.grams: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n, entries in by_len.items():
            g = np.concatenate([grams for grams, _ in entries])
            owner = np.concatenate([np.full(len(grams), k, dtype=np.int64) for grams, k in entries])
            order = np.argsort(g, kind="stable")
            self.grams[n] = (g[order], owner[order])
        self.gram_count = np.array([len(i.grams) for i in self.items], dtype=np.int64)

        # near-copies: MinHashLSH over the items' shingles; documents longer than this cannot reach J
        self._minhash_cls = MinHash
        self.lsh = MinHashLSH(threshold=params.contamination_jaccard, num_perm=params.contamination_num_perm)
        max_shingles = 0
        for k, item in enumerate(self.items):
            if len(item.shingles):
                self.lsh.insert(k, self._minhash(item.shingles))
                max_shingles = max(max_shingles, len(item.shingles))
        self.max_doc_shingles = int(max_shingles / params.contamination_jaccard)

    def _item_text(self, rec: Any) -> str | None:
        if isinstance(rec, dict):
            for key in self.p.decontaminate_text_keys:
                value = rec.get(key)
                if isinstance(value, str) and value.strip():
                    return value
        return None

    def _minhash(self, values: np.ndarray) -> Any:
        # our shingles are already 64-bit hashes: identity hashfunc, datasketch's 64-bit scheme
        m = self._minhash_cls(num_perm=self.p.contamination_num_perm, seed=self.p.seed, scheme="affine64",
                              hashfunc=int)
        m.update_batch(values.tolist())
        return m

    def check(self, text: str) -> list[dict[str, Any]]:
        """Matches of one document: [{eval_set, item, method, score}], best first."""
        words = self.shingler.word_hashes(text)
        found: dict[int, tuple[str, float]] = {}
        for n, (grams, owner) in self.grams.items():
            doc = np.unique(ngram_hashes(words, n))
            if not len(doc):
                continue
            lo = np.searchsorted(grams, doc, "left")
            hi = np.searchsorted(grams, doc, "right")
            hit = hi > lo
            if not hit.any():
                continue
            owners = np.concatenate([owner[a:b] for a, b in zip(lo[hit], hi[hit], strict=True)])
            items, counts = np.unique(owners, return_counts=True)
            share = counts / self.gram_count[items]
            for k, c in zip(items.tolist(), share.tolist(), strict=True):
                if c >= self.p.contamination_containment:
                    found[k] = ("ngram_containment", c)
        shingles = np.unique(ngram_hashes(words, self.p.n_grams))
        if 0 < len(shingles) <= self.max_doc_shingles:
            for k in self.lsh.query(self._minhash(shingles)):
                j = jaccard(self.items[k].shingles, shingles)
                if j >= self.p.contamination_jaccard and k not in found:
                    found[k] = ("minhash_jaccard", j)
        return [{"eval_set": self.items[k].eval_set, "item": self.items[k].item_id, "method": m,
                 "score": round(s, 4)} for k, (m, s) in sorted(found.items(), key=lambda kv: (-kv[1][1], kv[0]))]


def build_contamination_index(params: DedupParams, ctx: StageContext, shingler: Shingler,
                              ) -> ContaminationIndex | None:
    """Index of every eval set: evalset artifacts on ``eval_sets``, then ``decontaminate_paths``."""
    files: list[tuple[str, Path]] = []
    for art in ctx.input_list("eval_sets"):
        files += _eval_files_of_artifact(art)
    files += [(_stem(p.name), p) for p in resolve_decontaminate_paths(params.decontaminate_paths)]
    return ContaminationIndex(params, shingler, files) if files else None


# --- the stage ----------------------------------------------------------------------------------------
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
    group_size: list[int] = field(default_factory=list)
    minhash_groups: list[int] = field(default_factory=list)  # signature doc index -> group
    matches: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # group -> contamination
    bytes: int = 0

    def rank(self, i: int) -> tuple[int, str, int]:
        """Sort key of representative choice: longest (whitespace-collapsed) text, smaller id, input order."""
        return (-self.chars[i], self.ids[i], i)


def _incoming(meta: dict[str, Any]) -> tuple[int, list[str]]:
    count = meta.get(DUP_COUNT, 1)
    members = meta.get(DUP_MEMBERS) or []
    weight = count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else 1
    return weight, [str(m) for m in members] if isinstance(members, list) else []


def _first_pass(params: DedupParams, ctx: StageContext, docs_path: Path, corpus: _Corpus,
                index: ContaminationIndex | None) -> Iterator[Document]:
    """Read every document once: exact groups, contamination per group, and the group leaders that go
    on to MinHash (yielded to datatrove's signature step as it consumes them)."""
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
        corpus.group_size.append(1)
        if index is not None and (found := index.check(text)):
            corpus.matches[gid] = found
            if drop_contaminated:
                continue
        corpus.minhash_groups.append(gid)
        yield Document(text=text, id=str(gid))


@dataclass
class _MinhashResult:
    cluster_of: dict[int, int]  # signature doc index -> datatrove cluster id
    edges: set[tuple[int, int]]  # candidate pairs LSH found (signature doc indices), before clustering
    signed: int  # leaders that had a signature (the others have fewer than n_grams words)


def _run_minhash(params: DedupParams, sig_step: MinhashDedupSignature, leaders: Iterator[Document],
                 work: Path) -> _MinhashResult:
    """datatrove's MinHash stages 1-3 on the leaders, run in-process one task at a time."""
    config = params.minhash_config()
    buckets, clusters = work / "buckets", work / "clusters"
    with _quiet_datatrove():
        sig_step.run(leaders, rank=0, world_size=1)
        for band in range(params.bands):  # one task per band, as datatrove's executor would run them
            MinhashDedupBuckets(str(work / "signatures"), str(buckets), config=config).run(
                rank=band, world_size=params.bands)
        MinhashDedupCluster(str(buckets), str(clusters), config=config, save_cluster_id=True).run(world_size=1)
    record = (params.rows * config.hash_config.precision // 8) + 4
    signed = (work / "signatures" / "bucket_000" / "00000.minhash.sig").stat().st_size // record
    edges: set[tuple[int, int]] = set()
    for dups in sorted(buckets.glob("*.dups")):
        with open(dups, "rb") as f:
            edges.update((min(a, b), max(a, b)) for _, a, _, b in read_tuples_from_file(f, "4I", lines_to_buffer=-1))
    cluster_of: dict[int, int] = {}
    if (cluster_file := clusters / "000000.clusters").exists():  # absent when there is no pair at all
        with open(cluster_file, "rb") as f:
            cluster_of = {doc: cid for doc, cid in read_tuples_from_file(f, "2I", lines_to_buffer=-1)}
    return _MinhashResult(cluster_of, edges, signed)


@dataclass
class _Decisions:
    reason: np.ndarray  # int8 per document: _KEPT / _EXACT / _NEAR / _CONTAMINATED
    duplicate_of: np.ndarray  # document it duplicates (exact: group leader; near: representative)
    jaccard: dict[int, float] = field(default_factory=dict)  # verified member leader -> exact J
    rekept: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))  # rep -> members
    clusters: int = 0

    def representative(self, i: int) -> int:
        while self.reason[i] in (_EXACT, _NEAR):
            i = int(self.duplicate_of[i])
        return i


def _decide(params: DedupParams, corpus: _Corpus, cluster_of: dict[int, int],
            ) -> tuple[_Decisions, list[tuple[int, int]]]:
    n = len(corpus.ids)
    d = _Decisions(reason=np.zeros(n, dtype=np.int8), duplicate_of=np.full(n, -1, dtype=np.int64))
    contaminated = set(corpus.matches) if params.decontamination == "drop" else set()
    for i, gid in enumerate(corpus.group_of):
        if gid in contaminated:
            d.reason[i] = _CONTAMINATED
        elif i != corpus.leader[gid]:
            d.reason[i], d.duplicate_of[i] = _EXACT, corpus.leader[gid]
    members: dict[int, list[int]] = defaultdict(list)
    for sig_doc, cid in cluster_of.items():
        members[cid].append(corpus.leader[corpus.minhash_groups[sig_doc]])
    pairs = []  # (representative, member) leaders
    for cid in sorted(members):
        leaders = sorted(members[cid], key=corpus.rank)
        d.clusters += 1
        for m in leaders[1:]:
            d.reason[m], d.duplicate_of[m] = _NEAR, leaders[0]
            pairs.append((leaders[0], m))
    return d, pairs


def _verify(params: DedupParams, ctx: StageContext, docs_path: Path, corpus: _Corpus, d: _Decisions,
            pairs: list[tuple[int, int]], edges: list[tuple[int, int]], sig_step: MinhashDedupSignature,
            ) -> dict[str, Any]:
    """Exact shingle Jaccard of (representative, member) pairs -> precision estimate (and re-keeping).

    Also of a sample of LSH's own candidate pairs (``edge_precision_estimate``): where that is high and
    the representative's precision low, the loss comes from chaining (A~B, B~C, A !~ C), not banding.
    """
    drop_fp = params.verify == "drop_false_positives"

    def sampled(candidates: list[tuple[int, int]]) -> list[tuple[int, int]]:
        def order(pair: tuple[int, int]) -> bytes:
            key = f"{params.seed}\0{corpus.ids[pair[0]]}\0{corpus.ids[pair[1]]}"
            return hashlib.blake2b(key.encode(), digest_size=8).digest()
        return sorted(candidates, key=order)[:params.verify_pairs]

    sample = pairs if drop_fp else sampled(pairs)
    edge_sample = sampled(edges)
    need = {i for pair in sample + edge_sample for i in pair}
    shingles: dict[int, np.ndarray] = {}
    if need:
        ctx.progress(f"verifying {len(sample)} of {len(pairs)} near-duplicate pairs with exact Jaccard")
        for i, rec in enumerate(iter_documents(docs_path)):
            if i in need:
                shingles[i] = np.unique(sig_step.get_shingles(rec["text"]).ravel())
    values = []
    for rep, m in sample:
        j = d.jaccard[m] = jaccard(shingles[rep], shingles[m])
        values.append(j)
        if drop_fp and j < params.jaccard_threshold:
            d.reason[m], d.duplicate_of[m] = _KEPT, -1
            d.rekept[rep].append(m)
    arr = np.array(values)
    edge_j = np.array([jaccard(shingles[a], shingles[b]) for a, b in edge_sample])
    return {
        "mode": params.verify,
        "near_pairs": len(pairs),
        "pairs_checked": len(sample),
        "jaccard_threshold": params.jaccard_threshold,
        "precision_estimate": float((arr >= params.jaccard_threshold).mean()) if len(arr) else None,
        "jaccard_quantiles": ({q: round(float(np.quantile(arr, float(q))), 4)
                               for q in ("0.0", "0.1", "0.5", "0.9", "1.0")} if len(arr) else {}),
        "false_positives_rekept": sum(len(v) for v in d.rekept.values()),
        "lsh_pairs": len(edges),
        "lsh_pairs_checked": len(edge_sample),
        "edge_precision_estimate": (float((edge_j >= params.jaccard_threshold).mean())
                                    if len(edge_j) else None),
    }


def _write_gz_jsonl(path: Path, rows: Iterator[dict[str, Any]] | list[dict[str, Any]]) -> int:
    n = 0
    with gzip.GzipFile(path, "wb", compresslevel=6, mtime=0) as f:  # mtime=0: deterministic bytes
        for row in rows:
            f.write(orjson.dumps(row) + b"\n")
            n += 1
    return n


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

    # pass 1: exact groups + contamination + signatures of the leaders; then buckets and clusters
    corpus = _Corpus()
    ctx.progress(f"reading {docs_path} (MinHash {params.bands}x{params.rows}, {params.n_grams}-grams, "
                 f"{params.word_tokenizer} words, S-curve threshold {params.s_curve_threshold:.3f})")
    mh = _run_minhash(params, sig_step, _first_pass(params, ctx, docs_path, corpus, index), work)
    n_in = len(corpus.ids)
    if n_in == 0:
        raise ValueError(f"dedup: documents artifact {docs_path} holds no documents")
    t_minhash = time.perf_counter()

    # decisions, then verification (pass 2 over the verified pairs' documents)
    d, pairs = _decide(params, corpus, mh.cluster_of)
    leader_of_sig = [corpus.leader[g] for g in corpus.minhash_groups]
    edges = sorted((leader_of_sig[a], leader_of_sig[b]) for a, b in mh.edges)
    verification = _verify(params, ctx, docs_path, corpus, d, pairs, edges, sig_step)
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
        for rep in sorted(set(members) | set(d.rekept)):
            row: dict[str, Any] = {
                "representative": corpus.ids[rep],
                "dup_count": corpus.weights[rep] + sum(corpus.weights[m] for m in members.get(rep, [])),
                "members": [{"id": corpus.ids[m], "reason": _REASON_OF[int(d.reason[m])],
                             "duplicate_of": corpus.ids[int(d.duplicate_of[m])],
                             **({"jaccard": round(d.jaccard[m], 4)} if m in d.jaccard else {})}
                            for m in members.get(rep, [])]}
            if rep in d.rekept:
                row["rekept_below_threshold"] = [{"id": corpus.ids[m], "jaccard": round(d.jaccard[m], 4)}
                                                 for m in d.rekept[rep]]
            yield row

    n_cluster_rows = _write_gz_jsonl(ctx.out_dir / CLUSTERS_NAME, cluster_rows())
    _write_gz_jsonl(ctx.out_dir / DROPPED_SAMPLES_NAME, [s for r in DROP_REASONS for s in samples[r]])

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
    precision = verification["precision_estimate"]
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
                     "precision_estimate": float("nan") if precision is None else precision})
    metrics: dict[str, float] = {
        "s_curve_threshold": params.s_curve_threshold, "clusters": d.clusters,
        "near_pairs": len(pairs), "pairs_verified": verification["pairs_checked"],
        "lsh_pairs": len(edges), **({"edge_precision_estimate": verification["edge_precision_estimate"]}
                                    if verification["edge_precision_estimate"] is not None else {}),
        "seconds.read_minhash": t_minhash - start, "seconds.verify": t_verify - t_minhash,
        "seconds.write": t_write - t_verify, "seconds.total": total_s,
        "docs_per_s": n_in / total_s, "mb_per_s": corpus.bytes / 1e6 / total_s,
    }
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
                           "representative; consider verify: drop_false_positives", 100 * precision,
                           verification["pairs_checked"], params.jaccard_threshold)
    ctx.progress(f"{n_in} documents ({corpus.bytes / 1e6:.1f} MB) in {total_s:.1f}s: kept {kept}, exact "
                 f"{counts['exact_duplicate']}, near {counts['near_duplicate']}, contaminated "
                 f"{contaminated_docs} ({params.decontamination}); precision estimate "
                 f"{'n/a' if precision is None else f'{precision:.3f}'}")


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


STAGE = StageKind(
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
    doc=("Exact (normalized-text hash) and MinHash-LSH near-duplicate removal with datatrove's MinHash "
         "stages and a fast word tokenizer; one representative per cluster keeps dup_count and "
         "dup_members; exact-Jaccard precision estimate; n-gram-containment and MinHash-LSH "
         "decontamination against eval sets; in = kept + dropped per reason is checked and logged."),
)
