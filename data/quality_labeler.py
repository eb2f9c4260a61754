"""Labelers of the ``quality`` stage: who rates a sample of documents before the scorer learns from it.

The paper (§4.1.1) labels documents with "our previous-generation model as the reward labeler" on
knowledge depth, practical helpfulness and category. Three labelers, chosen by ``labeler.kind``; the
first two use a trained model, the third is a heuristic:

* ``causal_lm`` -- the paper's path: an instruction-following causal LM (a local Hugging Face
  directory, or a previous pipeline run's model artifact) is prompted with :data:`RUBRIC_TEMPLATE` and
  answers in a fixed format. :func:`parse_reply` is strict: a reply that is not exactly usable is
  rejected with one reason of :data:`REJECT_REASONS`; rejected documents are counted and left out of
  the training labels.
* ``reward_model`` -- a Bradley-Terry reward model (the ``reward_model`` stage's artifact, or any saved
  ``AutoModelForSequenceClassification`` with one output and a chat template) scores each document as the
  assistant's answer to one user turn per dimension (:data:`DEFAULT_REWARD_PROMPTS`). A reward has no
  absolute scale (only differences are trained), so a document's label is its reward's mid-rank
  percentile among the labeled sample, times 5: **relative to the sample, not an absolute grade**. The
  category comes from ``category_map`` as for ``reference``.
* ``reference`` (the offline default) -- **a reference-similarity heuristic, not a reward model**,
  so the pipeline runs without any LM. DCLM-style weak labels: per score dimension, a logistic
  classifier on hashed word uni+bigrams (DCLM's fastText features) separates curated high-quality
  passages (``data/quality_refs/<dimension>.txt``) from random windows of the corpus being scored
  (equally many per domain); its probability times 5 is the label. The category comes from the
  document's domain / id through ``category_map``. The classifier deliberately does not use the scorer's sentence embeddings: with the
  same features, the scorer's held-out agreement would only show that a linear model can copy a linear
  model.

Every labeler returns a :class:`LabelOutcome`: accepted labels by document id, rejections by reason,
and a description of itself for the report.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from data.documents import QUALITY_CATEGORY as CATEGORY
from data.documents import QUALITY_DIMENSIONS as DIMENSIONS  # the score dimensions, in this order everywhere
from data.documents import SCORE_MAX, SCORE_MIN
from data.reward_scoring import REWARD_MODEL_DIR
from pipeline.stage import (
    MANIFEST_NAME,
    StageParams,
    content_fingerprint,
    file_fingerprint,
    portable_name,
    sha256_file,
)

REFS_DIR = Path(__file__).parent / "quality_refs"
PASSAGE_MARKER = "### passage:"

# Categories follow the corpus families of §4.1.1 (reference works, academic text, web, code) plus
# what the shipped sample holds (licences, changelogs, quotations); "other" catches the rest.
DEFAULT_TAXONOMY = ("reference", "tutorial", "academic", "code", "legal", "news", "creative",
                    "conversation", "other")
# Ordered: the first pattern matching the document's domain or id wins. Tuned to the sample corpus.
DEFAULT_CATEGORY_MAP = {
    "*/tutorial/*": "tutorial",
    "*/howto/*": "tutorial",
    "*quickstart*": "tutorial",
    "misc/fortunes/*": "creative",
    "misc/*news/*": "news",
    "misc/debian-changelog/*": "news",
    "code": "code",
    "legal": "legal",
    "manual": "reference",
    "prose": "reference",
}

REJECT_REASONS: dict[str, str] = {
    "no_answer": "the reply is empty or names none of knowledge_depth, helpfulness, category",
    "duplicate_field": "a field is given more than once",
    "missing_field": "one or two of the three fields are absent",
    "not_a_number": "a score is not a plain number",
    "out_of_range": f"a score is outside {SCORE_MIN:g}..{SCORE_MAX:g}",
    "unknown_category": "the category is not in the taxonomy",
    "non_finite_reward": "the reward model scored the document NaN or infinite (reward_model labeler)",
}
MAX_EXAMPLES_PER_REASON = 3  # rejected replies kept verbatim in the report, per reason


# --- labels -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Label:
    knowledge_depth: float
    helpfulness: float
    category: str

    def scores(self) -> tuple[float, float]:
        return (self.knowledge_depth, self.helpfulness)

    def as_dict(self) -> dict[str, Any]:
        return {**dict(zip(DIMENSIONS, self.scores(), strict=True)), CATEGORY: self.category}


@dataclass(frozen=True)
class LabelDoc:
    """What a labeler sees of a document: its id, domain and (truncated) text."""

    id: str
    text: str
    domain: str


@dataclass
class LabelOutcome:
    labels: dict[str, Label] = field(default_factory=dict)  # accepted, by document id
    rejected: dict[str, str] = field(default_factory=dict)  # document id -> reason
    replies: dict[str, str] = field(default_factory=dict)  # raw replies (causal_lm only)
    info: dict[str, Any] = field(default_factory=dict)  # labeler kind, model, digests...

    @property
    def rejected_counts(self) -> dict[str, int]:
        counts = Counter(self.rejected.values())
        return {r: counts.get(r, 0) for r in REJECT_REASONS}

    def rejected_examples(self) -> dict[str, list[dict[str, str]]]:
        out: dict[str, list[dict[str, str]]] = {}
        for doc_id, reason in self.rejected.items():
            ex = out.setdefault(reason, [])
            if len(ex) < MAX_EXAMPLES_PER_REASON:
                ex.append({"id": doc_id, "reply": self.replies.get(doc_id, "")[:300]})
        return out


# --- strict reply parsing -------------------------------------------------------------------------
class MalformedReply(ValueError):
    """A labeler reply that cannot be used; ``reason`` is a key of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_FIELD_LINE = re.compile(r"^[ \t]*(knowledge[ _-]depth|helpfulness|category)[ \t]*:[ \t]*(.*?)[ \t\r]*$",
                         re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
_FIELDS = (*DIMENSIONS, CATEGORY)


def _field_name(raw: str) -> str:
    return re.sub(r"[ -]", "_", raw.strip().lower())


def _reply_fields(reply: str) -> list[tuple[str, Any]]:
    """(field, value) pairs in the reply: a JSON object if the reply is one, else ``field: value`` lines."""
    text = reply.strip()
    if text.startswith("{") and text.endswith("}"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            return [(_field_name(k), v) for k, v in obj.items() if _field_name(k) in _FIELDS]
    return [(_field_name(m.group(1)), m.group(2)) for m in _FIELD_LINE.finditer(reply)]


def _score(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise MalformedReply("not_a_number", f"{name}={value!r}")
    if isinstance(value, str):
        v = value.strip().strip("\"'")
        if not _NUMBER.fullmatch(v):
            raise MalformedReply("not_a_number", f"{name}={value!r}")
        value = float(v)
    value = float(value)
    if not (SCORE_MIN <= value <= SCORE_MAX):  # also rejects NaN
        raise MalformedReply("out_of_range", f"{name}={value:g} (expected {SCORE_MIN:g}..{SCORE_MAX:g})")
    return value


def parse_reply(reply: str, taxonomy: Sequence[str]) -> Label:
    """The label in a labeler's reply, or :class:`MalformedReply` with the first failing reason.

    Accepted: three lines ``knowledge_depth: <0-5>``, ``helpfulness: <0-5>``, ``category: <name>`` (in
    any order, field names case-insensitive, ``knowledge depth`` spelled with a space or hyphen too;
    other lines are ignored), or one JSON object with those keys. Scores are plain numbers (``3``,
    ``4.5``) in 0..5; the category is a taxonomy name (case-insensitive). Checks run in the order of
    :data:`REJECT_REASONS`, so a reply gets exactly one reason.
    """
    pairs = _reply_fields(reply or "")
    if not pairs:
        raise MalformedReply("no_answer", "no knowledge_depth / helpfulness / category field")
    seen = Counter(name for name, _ in pairs)
    dup = sorted(n for n, c in seen.items() if c > 1)
    if dup:
        raise MalformedReply("duplicate_field", f"given more than once: {', '.join(dup)}")
    values = dict(pairs)
    missing = [f for f in _FIELDS if f not in values]
    if missing:
        raise MalformedReply("missing_field", f"missing: {', '.join(missing)}")
    scores = [_score(d, values[d]) for d in DIMENSIONS]
    raw_cat = values[CATEGORY]
    category = raw_cat.strip().strip("\"'").lower() if isinstance(raw_cat, str) else None
    if category not in {t.lower() for t in taxonomy}:
        raise MalformedReply("unknown_category", f"category={raw_cat!r} (taxonomy: {', '.join(taxonomy)})")
    return Label(knowledge_depth=scores[0], helpfulness=scores[1], category=category)


# --- params ---------------------------------------------------------------------------------------
class _CategoryFromMetadataParams(StageParams):
    """For labelers that give no category themselves (reference, reward_model): it comes from the metadata."""

    category_map: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_CATEGORY_MAP), description=(
        "Ordered {pattern: category}: the first fnmatch pattern matching the document's domain or its id "
        "gives its category; every category must be in taxonomy."))
    default_category: str = Field("other", description="Category of documents no pattern matches.")


def _model_path_not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("model_path is empty; give a local model directory or a model artifact")
    return v


class ReferenceLabelerParams(_CategoryFromMetadataParams):
    kind: Literal["reference"] = "reference"
    refs_dir: str | None = Field(None, description=(
        "Directory holding <dimension>.txt reference passages (knowledge_depth.txt, helpfulness.txt; "
        "format in data/quality_refs/README.md). null: the shipped data/quality_refs."))
    negatives: int = Field(400, ge=10, description=(
        "Random windows of the input corpus used as the negative class: equally many per domain, "
        "documents by id hash, reference source documents excluded."))
    regularization_c: float = Field(1.0, gt=0, description="Inverse L2 strength of the logistic classifiers.")


class CausalLMLabelerParams(StageParams):
    kind: Literal["causal_lm"]
    model_path: str = Field(description=(
        "A local Hugging Face causal LM directory (AutoModelForCausalLM.from_pretrained) or a previous "
        "pipeline run's model artifact directory."))
    tokenizer_path: str | None = Field(None, description="Tokenizer directory when model_path has none.")
    max_new_tokens: int = Field(64, ge=8, le=512, description="Greedy generation budget per reply.")
    doc_tokens: int = Field(512, ge=16, description="The document is cut to this many tokens in the prompt.")
    batch_size: int = Field(8, ge=1, description="Prompts generated together (left-padded).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "Where the labeler model runs: auto = the stage's GPU when it has one (bf16; greedy replies may then "
        "differ from a CPU run's), else the CPU (fp32)."))

    _path_not_blank = field_validator("model_path")(_model_path_not_blank)


# the user turn a document answers when the reward model scores it for each dimension
DEFAULT_REWARD_PROMPTS = {
    "knowledge_depth": "Write a passage that explains a subject in depth, with accurate and specific knowledge.",
    "helpfulness": "Write something that a reader can put to practical use.",
}


class RewardModelLabelerParams(_CategoryFromMetadataParams):
    kind: Literal["reward_model"]
    model_path: str = Field(description=(
        "A reward_model stage artifact (its reward_model/ directory is used) or a saved reward model directory "
        "(AutoModelForSequenceClassification with num_labels=1, its tokenizer and chat template beside it)."))
    prompts: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_REWARD_PROMPTS), description=(
        "Per score dimension (knowledge_depth, helpfulness), the user turn whose answer the document is taken to "
        "be when the reward model scores it."))
    doc_tokens: int = Field(512, ge=16, description="The document is cut to this many tokens before scoring.")
    batch_size: int = Field(16, ge=1, description="Documents scored together (memory: batch x longest).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "Where the reward model runs: auto = the stage's GPU when it has one (bf16), else the CPU (fp32)."))

    _path_not_blank = field_validator("model_path")(_model_path_not_blank)

    @field_validator("prompts")
    @classmethod
    def _one_prompt_per_dimension(cls, v: dict[str, str]) -> dict[str, str]:
        if set(v) != set(DIMENSIONS) or any(not p.strip() for p in v.values()):
            raise ValueError(f"prompts needs one non-empty prompt for each of {list(DIMENSIONS)}, got {sorted(v)}")
        return v


LabelerParams = ReferenceLabelerParams | CausalLMLabelerParams | RewardModelLabelerParams


# --- category from metadata -----------------------------------------------------------------------
def category_from_metadata(doc_id: str, domain: str, category_map: dict[str, str], default: str) -> str:
    """First ``category_map`` pattern (in order) matching the domain or the id; else ``default``."""
    for pattern, category in category_map.items():
        if fnmatch.fnmatchcase(domain, pattern) or fnmatch.fnmatchcase(doc_id, pattern):
            return category
    return default


# --- reference (DCLM-style) labeler ----------------------------------------------------------------
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
    from sklearn.feature_extraction.text import HashingVectorizer

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
        import numpy as np
        from sklearn.linear_model import LogisticRegression

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


# --- causal LM labeler ----------------------------------------------------------------------------
RUBRIC_TEMPLATE = """\
You rate documents for a language-model training corpus.

Rate the document below on two scales from 0 (none) to 5 (excellent), and name its category.
- knowledge_depth: how much specific, accurate knowledge it conveys and how deeply it explains why \
and how things work. 0 = none (noise, boilerplate), 3 = solid factual content, 5 = expert explanation.
- helpfulness: how useful it is to a reader who wants to understand or do something. 0 = useless, \
3 = useful with effort, 5 = clear, complete and directly usable.
- category: exactly one of: {categories}.

Document:
<<<
{document}
>>>

Reply with exactly these three lines and nothing else:
knowledge_depth: <integer 0-5>
helpfulness: <integer 0-5>
category: <one category from the list>"""


def _directory_fingerprint(path: Path) -> dict[str, Any]:
    """Content identity of a model directory: its artifact digest, else each file's fingerprint."""
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        return {"artifact_digest": json.loads(manifest.read_text())["digest"]}
    return {"files": [{"path": p.relative_to(path).as_posix(), **content_fingerprint(p)}
                      for p in sorted(path.rglob("*")) if p.is_file()]}


def _model_directory(path: Path) -> Path:
    """``path`` itself when it holds a config.json; a training stage's checkpoint artifact holds its model in
    ``model/`` (pretrain/export.py), so that is taken too."""
    if (path / "config.json").is_file():
        return path
    if (path / "model" / "config.json").is_file():
        return path / "model"
    raise FileNotFoundError(
        f"causal_lm labeler: model_path {path} is not a Hugging Face model directory (no config.json, nor "
        "model/config.json of a checkpoint artifact); give a saved model directory or a checkpoint artifact")


def _labeler_device(choice: str, kind: str = "causal_lm") -> str:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{kind} labeler: device=cuda but this process sees no GPU (give the quality stage "
                           "`resources: {gpus: 1}` or set labeler.device to auto/cpu)")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


class CausalLMLabeler:
    """Prompts a local causal LM with :data:`RUBRIC_TEMPLATE`; greedy decoding; strict parsing."""

    kind = "causal_lm"

    def __init__(self, params: CausalLMLabelerParams, taxonomy: Sequence[str]) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.params = params
        self.taxonomy = tuple(taxonomy)
        given = Path(params.model_path).expanduser()
        self.model_path = _model_directory(given)
        tok_path = Path(params.tokenizer_path).expanduser() if params.tokenizer_path else self.model_path
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(
                f"causal_lm labeler: no tokenizer loadable from {tok_path} ({e}); set labeler.tokenizer_path "
                "to a tokenizer directory (e.g. the tokenizer stage's artifact)") from e
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(f"causal_lm labeler: tokenizer {tok_path} has neither a pad nor an eos "
                                 "token, so prompts cannot be batched")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if json.loads((self.model_path / "config.json").read_text()).get("model_type") == "hylight_hybrid":
            import model  # noqa: F401  (registers hylight_hybrid with the Auto classes; a fresh worker lacks it)
        self.device = torch.device(_labeler_device(params.device))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, local_files_only=True,
                                                          dtype=dtype).to(self.device).eval()
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None) or getattr(
            self.model.config, "n_positions", None)
        self.fingerprint = _directory_fingerprint(given)

    def _prompt(self, document: str) -> str:
        text = RUBRIC_TEMPLATE.format(categories=", ".join(self.taxonomy), document=document)
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return text + "\n"

    def _doc_budget(self) -> int:
        """Document tokens that fit beside the rubric and the reply in the model's context."""
        budget = self.params.doc_tokens
        if self.max_positions:
            rubric = len(self.tokenizer(self._prompt(""), add_special_tokens=False).input_ids)
            budget = min(budget, self.max_positions - rubric - self.params.max_new_tokens)
        if budget < 16:
            raise ValueError(
                f"causal_lm labeler: the model's context ({self.max_positions} positions) leaves {budget} "
                f"tokens for the document beside the rubric and max_new_tokens={self.params.max_new_tokens}")
        return budget

    def label(self, docs: Sequence[LabelDoc], progress: Callable[[str], None] | None = None) -> LabelOutcome:
        import torch

        outcome = LabelOutcome(info=self.describe())
        budget = self._doc_budget()
        tok = self.tokenizer
        for start in range(0, len(docs), self.params.batch_size):
            batch = docs[start:start + self.params.batch_size]
            cut = [tok.decode(tok(d.text, add_special_tokens=False).input_ids[:budget]) for d in batch]
            prompts = [self._prompt(c) for c in cut]
            # a chat template writes its own BOS; a plain prompt gets the tokenizer's specials
            enc = tok(prompts, return_tensors="pt", padding=True,
                      add_special_tokens=not bool(tok.chat_template))
            enc = enc.to(self.device)
            with torch.inference_mode():
                out = self.model.generate(**enc, max_new_tokens=self.params.max_new_tokens, do_sample=False,
                                          pad_token_id=tok.pad_token_id)
            replies = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for d, reply in zip(batch, replies, strict=True):
                outcome.replies[d.id] = reply
                try:
                    outcome.labels[d.id] = parse_reply(reply, self.taxonomy)
                except MalformedReply as e:
                    outcome.rejected[d.id] = e.reason
            if progress:
                progress(f"labeled {min(start + len(batch), len(docs))}/{len(docs)} documents "
                         f"({len(outcome.rejected)} replies rejected)")
        return outcome

    def describe(self) -> dict[str, Any]:
        return {"labeler_kind": self.kind, "model_path": str(self.model_path),
                "model_fingerprint": self.fingerprint, "model_class": type(self.model).__name__,
                "device": str(self.device),
                "generation": {"greedy": True, "max_new_tokens": self.params.max_new_tokens,
                               "doc_tokens": self.params.doc_tokens},
                "rubric_sha256": hashlib.sha256(RUBRIC_TEMPLATE.encode()).hexdigest()}


def reward_model_directory(path: Path) -> Path:
    """``path`` itself when it holds a config.json, else a reward_model artifact's ``reward_model/``."""
    for candidate in (path, path / REWARD_MODEL_DIR):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"reward_model labeler: model_path {path} is neither a saved reward model (no config.json) nor a "
        f"reward_model stage artifact (no {REWARD_MODEL_DIR}/config.json)")


def mid_rank_percentiles(values: Sequence[float]) -> list[float]:
    """Each value's mid-rank percentile in (0, 1): (average 1-based rank among equal values - 0.5) / n."""
    from scipy.stats import rankdata  # a dependency of scikit-learn, which the quality stage needs

    if not values:
        return []
    return [float(r) for r in (rankdata(values, method="average") - 0.5) / len(values)]


class RewardModelLabeler:
    """Scores each document with a reward model, once per dimension; the label is the reward's percentile x 5."""

    kind = "reward_model"

    def __init__(self, params: RewardModelLabelerParams, taxonomy: Sequence[str]) -> None:
        import torch

        from data.reward_scoring import RewardModelScorer

        self.params = params
        self.taxonomy = tuple(taxonomy)
        given = Path(params.model_path).expanduser()
        self.model_path = reward_model_directory(given)
        self.device = torch.device(_labeler_device(params.device, self.kind))
        self.scorer = RewardModelScorer(self.model_path, batch_size=params.batch_size)
        if self.device.type == "cuda":
            self.scorer.model.to(device=self.device, dtype=torch.bfloat16)
        if not self.scorer.tokenizer.chat_template:
            raise ValueError(f"reward_model labeler: the tokenizer in {self.model_path} has no chat template; the "
                             "reward model scores (user turn, answer) conversations in its chat format")
        self.fingerprint = _directory_fingerprint(given)

    def label(self, docs: Sequence[LabelDoc], progress: Callable[[str], None] | None = None) -> LabelOutcome:
        outcome = LabelOutcome(info=self.describe())
        tok = self.scorer.tokenizer
        cut = [tok.decode(tok(d.text, add_special_tokens=False).input_ids[:self.params.doc_tokens]) for d in docs]
        rewards: dict[str, list[float]] = {}
        step = max(self.params.batch_size * 8, 1)  # a progress line every few batches
        for n_dim, dim in enumerate(DIMENSIONS):
            rewards[dim] = []
            for start in range(0, len(cut), step):
                part = cut[start:start + step]
                rewards[dim] += self.scorer.score([self.params.prompts[dim]] * len(part), part)
                if progress:
                    done = n_dim * len(cut) + start + len(part)
                    progress(f"scored {done}/{len(cut) * len(DIMENSIONS)} (document, dimension) pairs")
        finite = [i for i in range(len(docs)) if all(math.isfinite(rewards[d][i]) for d in DIMENSIONS)]
        pct = {d: mid_rank_percentiles([rewards[d][i] for i in finite]) for d in DIMENSIONS}
        for i, d in enumerate(docs):
            outcome.replies[d.id] = "; ".join(f"{dim} reward {rewards[dim][i]:.6g}" for dim in DIMENSIONS)
        span = SCORE_MAX - SCORE_MIN
        for j, i in enumerate(finite):
            d = docs[i]
            category = category_from_metadata(d.id, d.domain, self.params.category_map, self.params.default_category)
            outcome.labels[d.id] = Label(knowledge_depth=SCORE_MIN + span * pct[DIMENSIONS[0]][j],
                                         helpfulness=SCORE_MIN + span * pct[DIMENSIONS[1]][j], category=category)
        kept = set(finite)
        for i, d in enumerate(docs):
            if i not in kept:
                outcome.rejected[d.id] = "non_finite_reward"
        outcome.info["rewards"] = {dim: _summary([rewards[dim][i] for i in finite]) for dim in DIMENSIONS}
        return outcome

    def describe(self) -> dict[str, Any]:
        return {"labeler_kind": self.kind, "model_path": str(self.model_path),
                "model_fingerprint": self.fingerprint, "model_class": type(self.scorer.model).__name__,
                "device": str(self.device), "doc_tokens": self.params.doc_tokens, "prompts": dict(self.params.prompts),
                "label": "mid-rank percentile of the reward among the labeled sample, times 5 (relative, not an "
                         "absolute grade)"}


def _summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {"count": len(ordered), "min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def make_labeler(params: LabelerParams,
                 taxonomy: Sequence[str]) -> ReferenceLabeler | CausalLMLabeler | RewardModelLabeler:
    if isinstance(params, ReferenceLabelerParams):
        return ReferenceLabeler(params, taxonomy)
    if isinstance(params, RewardModelLabelerParams):
        return RewardModelLabeler(params, taxonomy)
    return CausalLMLabeler(params, taxonomy)


def labeler_fingerprint(params: LabelerParams) -> dict[str, Any]:
    """What the labeler reads besides the input documents, for the stage's cache key."""
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # this module is not in code_digest
    if isinstance(params, ReferenceLabelerParams):
        return {"code": code, "references": [file_fingerprint(p) for p in reference_files(params).values()
                                             if p.is_file()]}
    path = Path(params.model_path).expanduser()
    fp: dict[str, Any] = {"code": code, "model": _directory_fingerprint(path) if path.is_dir() else None}
    if isinstance(params, RewardModelLabelerParams):
        return fp
    if params.tokenizer_path and Path(params.tokenizer_path).expanduser().is_dir():
        fp["tokenizer"] = _directory_fingerprint(Path(params.tokenizer_path).expanduser())
    return fp
