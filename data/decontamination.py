"""Decontamination for ``dedup``: which training documents contain, or nearly copy, an evaluation item.

Two checks per document (the stage decides once per exact-duplicate group, before near dedup):

- *n-gram containment* (embedded items): the share of an item's word n-grams (``contamination_ngram``,
  13 by default, like GPT-3's 13-gram overlap; an item shorter than that is one n-gram of its full
  length) found in the document. Eval items are short and training documents long, so a Jaccard (or a
  MinHash estimate of it) between the two is near 0 even when the item is copied verbatim: containment,
  looked up exactly in a sorted n-gram index, is the test that sees it. Items under
  ``contamination_min_words`` words are not checked (counted).
- *MinHash-LSH Jaccard* (near-copies of an item as a document): datasketch ``MinHashLSH`` over the
  items' ``n_grams`` shingles, queried by each document short enough to reach the threshold (J <=
  min/max set size); candidates are confirmed with the exact Jaccard. This catches an item re-posted
  with small edits, which break most of its 13-grams.

Eval item text: the first of ``decontaminate_text_keys`` that is a non-empty string (by default
``text``, ``prompt``, ``question``, ``problem``, ``input``; answers are not matched: a document that
holds the question is contaminated with or without the answer). Text is normalized like the MinHash
shingles (:func:`data.minhash.simplify`: lowercase, punctuation and diacritics removed, digit runs -> 0),
so items that differ only in their numbers count as the same text.
"""

from __future__ import annotations

import glob
import gzip
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from data.dedup_params import DedupParams
from data.minhash import Shingler, jaccard, ngram_hashes
from pipeline.stage import Artifact, StageContext


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
        from datasketch import MinHash, MinHashLSH  # heavy: datasketch (scipy), only with eval sets to check

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


