"""The ``reference`` labeler of the ``quality`` stage (the offline default): a reference-similarity heuristic, not a
reward model. Per score dimension a logistic classifier on hashed word uni+bigrams separates curated passages
(``data/quality_refs/<dimension>.txt``) from windows of the corpus being scored; its probability times 5 is the
label, and the category comes from ``category_map``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.documents import QUALITY_DIMENSIONS as DIMENSIONS
from data.documents import SCORE_MAX
from data.quality_labels import Label, LabelDoc, LabelOutcome, ReferenceLabelerParams, category_from_metadata
from pipeline.stage import portable_name, sha256_file

REFS_DIR = Path(__file__).parent / "quality_refs"
PASSAGE_MARKER = "### passage:"


@dataclass(frozen=True)
class ReferencePassage:
    doc_id: str
    text: str


def load_reference_passages(path: str | Path) -> list[ReferencePassage]:
    """Passages of a reference file (``### passage: <doc id>`` then text; comments before the first)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference file {path} does not exist (see data/quality_refs/README.md)")
    passages: list[ReferencePassage] = []
    doc_id: str | None = None
    lines: list[str] = []

    def close(lineno: int) -> None:
        text = "\n".join(lines).strip()
        if not text:
            raise ValueError(f"{path}:{lineno}: passage from {doc_id!r} is empty")
        passages.append(ReferencePassage(doc_id or "", text))

    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 ({e.reason}); a reference file is UTF-8 text") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith(PASSAGE_MARKER):
            if doc_id is not None:
                close(lineno)
            doc_id, lines = line[len(PASSAGE_MARKER):].strip(), []
            if not doc_id:
                raise ValueError(f"{path}:{lineno}: '{PASSAGE_MARKER}' needs the source document id after it")
        elif doc_id is not None:
            lines.append(line)
    if doc_id is not None:
        close(lineno + 1)
    if len(passages) < 5:
        raise ValueError(f"{path}: {len(passages)} passages; a reference set needs at least 5 "
                         f"(each starting with a '{PASSAGE_MARKER} <doc id>' line)")
    return passages


def reference_files(params: ReferenceLabelerParams) -> dict[str, Path]:
    root = Path(params.refs_dir).expanduser() if params.refs_dir else REFS_DIR
    return {dim: root / f"{dim}.txt" for dim in DIMENSIONS}


def _ngram_vectorizer() -> Any:
    from sklearn.feature_extraction.text import HashingVectorizer  # heavy: scikit-learn

    # DCLM's classifier is fastText on word uni+bigrams; hashed counts, L2-normalised, are the same view
    return HashingVectorizer(n_features=2**18, ngram_range=(1, 2), alternate_sign=False, norm="l2",
                             lowercase=True)


class ReferenceLabeler:
    """Per dimension, P(reference passage | text) from a classifier trained refs-vs-random, times 5."""

    kind = "reference"

    def __init__(self, params: ReferenceLabelerParams, taxonomy: Sequence[str]) -> None:
        self.params = params
        self.taxonomy = tuple(taxonomy)
        self.files = reference_files(params)
        self.references = {dim: load_reference_passages(p) for dim, p in self.files.items()}
        self._vectorizer = _ngram_vectorizer()
        self._classifiers: dict[str, Any] = {}

    @property
    def source_ids(self) -> set[str]:
        """Documents the references were taken from (kept out of the negatives)."""
        return {p.doc_id for ps in self.references.values() for p in ps}

    def window_chars(self) -> int:
        """Negatives are windows as long as the median reference passage (same length scale)."""
        lengths = sorted(len(p.text) for ps in self.references.values() for p in ps)
        return lengths[len(lengths) // 2]

    def fit(self, negatives: Sequence[str]) -> dict[str, dict[str, float]]:
        """Train one classifier per dimension; returns its training-set separation for the report."""
        from sklearn.linear_model import LogisticRegression  # heavy: scikit-learn

        if len(negatives) < 10:
            raise ValueError(f"reference labeler: {len(negatives)} negative windows; the corpus is too "
                             "small to contrast the references with (need >= 10 documents)")
        fit_report: dict[str, dict[str, float]] = {}
        for dim, passages in self.references.items():
            texts = [p.text for p in passages] + list(negatives)
            y = np.r_[np.ones(len(passages)), np.zeros(len(negatives))]
            clf = LogisticRegression(C=self.params.regularization_c, class_weight="balanced",
                                     max_iter=2000)
            clf.fit(self._vectorizer.transform(texts), y)
            self._classifiers[dim] = clf
            p = clf.predict_proba(self._vectorizer.transform(texts))[:, 1]
            fit_report[dim] = {"positives": len(passages), "negatives": len(negatives),
                               "mean_p_positives": float(p[: len(passages)].mean()),
                               "mean_p_negatives": float(p[len(passages):].mean())}
        return fit_report

    def label(self, docs: Sequence[LabelDoc], progress: Callable[[str], None] | None = None) -> LabelOutcome:
        if not self._classifiers:
            raise RuntimeError("ReferenceLabeler.label() before fit()")
        outcome = LabelOutcome(info=self.describe())
        if not docs:
            return outcome
        x = self._vectorizer.transform([d.text for d in docs])
        probs = {dim: clf.predict_proba(x)[:, 1] for dim, clf in self._classifiers.items()}
        for i, d in enumerate(docs):
            category = category_from_metadata(d.id, d.domain, self.params.category_map,
                                              self.params.default_category)
            outcome.labels[d.id] = Label(
                *(round(SCORE_MAX * float(probs[dim][i]), 4) for dim in DIMENSIONS), category=category)
        return outcome

    def describe(self) -> dict[str, Any]:
        return {"labeler_kind": self.kind,
                "references": {dim: {**portable_name(p), "sha256": sha256_file(p),
                                     "passages": len(self.references[dim])}
                               for dim, p in self.files.items()},
                "features": "hashed word 1-2 grams (2^18), L2-normalised",
                "classifier": f"logistic regression, C={self.params.regularization_c}, balanced classes",
                "category_source": "category_map over domain / id",
                "kind_of_labels": "reference-similarity heuristic (not a reward model)"}
