"""Shingling and MinHash signatures shared by ``dedup`` and its decontamination check.

What is datatrove's and what is ours (so a reader knows what to trust and what to test):

- datatrove: the MinHash scheme and file formats (:class:`MinhashDedupSignature`: seeded universal
  hashes ``(a * x + b) mod (2^61 - 1)``, per-band sorted signature files), LSH banding
  (``MinhashDedupBuckets``) and clustering (``MinhashDedupCluster``), and the text normalization
  (``simplify_text``) that :func:`simplify` reproduces faster.
- ours: :class:`FastWordTokenizer` and :func:`ngram_hashes` (whitespace words, numpy n-gram hashing:
  the stock step tokenizes with spaCy and hashes each joined n-gram string in Python, 5-10x slower),
  :class:`BoundedMinhashSignature` (the same signature computed over fixed-size blocks of shingles with a
  running minimum: datatrove's ``get_signature`` materializes an N-shingles x hashes uint64 array, 1 KB
  per shingle at 121 hashes, so a 4M-word document needed ~7.6 GB), and :func:`jaccard`, the exact
  Jaccard of two shingle sets as sorted unique uint64 arrays. datasketch has no exact set Jaccard (its
  ``MinHash.jaccard`` is the estimate), and ``np.intersect1d`` on sorted hash arrays is the whole job.

Memory per document, beyond its text: 8 bytes per word (word hashes) and 8 per shingle. Text is
normalized, tokenized and hashed in pieces of :data:`PIECE_CHARS` characters, n-grams and signatures in
blocks of :data:`BLOCK_ROWS` rows, so no other working set grows with the length of the document.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import regex
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
from datatrove.utils.hashes.xxhash import xxhash64
from datatrove.utils.text import NUMBERS_PATTERN, PUNCTUATION
from datatrove.utils.word_tokenizers import WordTokenizer

_MERSENNE_PRIME = np.uint64((1 << 61) - 1)  # datatrove's modulus of the permutations
PIECE_CHARS = 1 << 18  # text is normalized, tokenized and hashed this many characters at a time
BLOCK_ROWS = 4096  # shingles per block of the n-gram and signature computations

# --- normalization and words ------------------------------------------------------------------------
_PUNCT_OR_SPACE = re.compile("[" + re.escape(PUNCTUATION) + r"\s]+")
_MARKS = regex.compile(r"\p{Mn}+")


def simplify(text: str) -> str:
    """Same output as datatrove's ``simplify_text(text, TextNormConfig())``, several times faster.

    datatrove maps punctuation to spaces with ``str.translate``, collapses whitespace with a second
    regex pass and drops combining marks character by character; here one regex does the first two
    and ASCII text skips the third (it has no marks). The output's only whitespace is single spaces.
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


_SPACE = re.compile(r"\s")


def _pieces(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, cut before a whitespace character.

    :func:`simplify` is local (lowercasing, digit runs, punctuation/space runs, combining marks): a cut
    at whitespace gives, piece by piece, the same words as the whole text, without the whole text's
    temporaries (``re.sub`` on a long text holds an object per match)."""
    start, n = 0, len(text)
    while start < n:
        end = start + size
        if end >= n:
            yield text[start:]
            return
        cut = end
        while cut > start and not text[cut].isspace():
            cut -= 1
        if cut == start:  # no whitespace in the window: cut at the next one
            m = _SPACE.search(text, end)
            cut = m.start() if m else n
        yield text[start:cut]
        start = cut


# --- hashing ----------------------------------------------------------------------------------------
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant of the polynomial n-gram hash
_MIX1, _MIX2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


def ngram_hashes(word_hashes: np.ndarray, n: int, block: int = BLOCK_ROWS) -> np.ndarray:
    """64-bit hashes of every word n-gram (in order, with repeats): a polynomial over the word hashes,
    then murmur3's fmix64 so the bits are well spread for the MinHash permutations. Computed in blocks
    of ``block`` n-grams: the temporaries stay small whatever the length."""
    count = len(word_hashes) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    out = np.empty(count, dtype=np.uint64)
    for s in range(0, count, block):
        e = min(s + block, count)
        h = word_hashes[s:e].copy()
        for j in range(1, n):
            h *= _MULT
            h += word_hashes[s + j:e + j]  # wraps mod 2^64
        h ^= h >> np.uint64(33)
        h *= _MIX1
        h ^= h >> np.uint64(33)
        h *= _MIX2
        h ^= h >> np.uint64(33)
        out[s:e] = h
    return out


class Shingler:
    """simplify -> words -> word hashes, with a one-text memo so the decontamination check and the
    signature step (which see the same ``str`` object) tokenize a document once."""

    def __init__(self, tokenizer: WordTokenizer | None = None, cache_words: int = 1 << 20,
                 piece_chars: int = PIECE_CHARS) -> None:
        self.tokenizer = tokenizer or FastWordTokenizer()
        self._cache: dict[str, int] = {}
        self._cache_words = cache_words
        self._piece_chars = piece_chars
        self._memo_text: str | None = None
        self._memo: np.ndarray = np.empty(0, dtype=np.uint64)

    def word_hashes(self, text: str) -> np.ndarray:
        if text is not self._memo_text:
            parts = []
            for piece in _pieces(text, self._piece_chars):
                if len(self._cache) > self._cache_words:  # bounded word -> hash memo
                    self._cache.clear()
                cache = self._cache
                words = self.tokenizer.word_tokenize(simplify(piece))
                hashes = [cache.get(w) for w in words]
                for i, h in enumerate(hashes):
                    if h is None:
                        hashes[i] = cache[words[i]] = xxhash64(words[i].encode())  # bytes: newer xxhash refuses str
                parts.append(np.array(hashes, dtype=np.uint64))
            self._memo_text = text
            self._memo = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
        return self._memo

    def shingles(self, text: str, n: int) -> np.ndarray:
        return ngram_hashes(self.word_hashes(text), n)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sets given as unique sorted arrays (0 when both are empty)."""
    if len(a) == 0 and len(b) == 0:
        return 0.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


# --- signatures -------------------------------------------------------------------------------------
class BoundedMinhashSignature(MinhashDedupSignature):
    """datatrove's signature step with ``get_signature`` computed over blocks of :data:`BLOCK_ROWS`
    shingles, keeping a running minimum: the same values (checked by the tests), and a working set of
    ``BLOCK_ROWS x hashes`` words instead of ``shingles x hashes``. Shingles come from the stock step
    (spaCy words, ``word_tokenizer: spacy``)."""

    block_rows = BLOCK_ROWS

    def get_signature(self, shingles: np.ndarray) -> list[list[int]]:
        a, b = self.parameters  # [1, hashes] each
        flat = shingles.reshape(-1)
        sig = np.full(self.num_hashes, np.iinfo(np.uint64).max, dtype=np.uint64)
        for s in range(0, len(flat), self.block_rows):
            phv = (flat[s:s + self.block_rows, None] * a + b) % _MERSENNE_PRIME  # wraps like datatrove's
            if self.config.hash_config.precision == 32:
                phv = np.bitwise_and(phv, self.config.hash_config.max)
            np.minimum(sig, phv.min(axis=0), out=sig)
        return [x.tolist() for x in np.split(sig.astype(self.config.hash_config.np_dtype), self.config.num_buckets)]


class FastMinhashSignature(BoundedMinhashSignature):
    """The signature step with :class:`Shingler` shingles: :func:`simplify`, :class:`FastWordTokenizer`
    words, :func:`ngram_hashes`.

    Shingles are the same word n-grams of the same simplified text; only their 64-bit hash function
    differs, so signatures are not interchangeable with the stock step's (nothing here mixes them).
    """

    def __init__(self, output_folder: str, config: MinhashConfig, shingler: Shingler | None = None) -> None:
        shingler = shingler or Shingler()
        # our tokenizer as `language`: datatrove then builds none of its own (for English, spaCy's, whose
        # constructor fails unless spaCy is installed, though these shingles never use it)
        super().__init__(output_folder, config=config, language=shingler.tokenizer)
        self.shingler = shingler
        self.word_tokenizer = self.shingler.tokenizer  # what a caller inspecting the step sees

    def get_shingles(self, text: str) -> np.ndarray:
        return self.shingler.shingles(text, self.config.n_grams).reshape((-1, 1))


@contextmanager
def quiet_datatrove() -> Iterator[None]:
    """datatrove logs every step at INFO through loguru; the stages report their own progress."""
    from datatrove.utils.logging import logger  # heavy: datatrove

    logger.disable("datatrove")
    try:
        yield
    finally:
        logger.enable("datatrove")
