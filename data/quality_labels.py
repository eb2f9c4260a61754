"""What the ``quality`` stage's labelers (:mod:`data.quality_labeler`) share: the labels they give
(:class:`LabelOutcome`), the strict parsing of a language model's reply (:func:`parse_reply`), the labelers'
params and the category a document's domain or id gives through ``category_map``."""

from __future__ import annotations

import fnmatch
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, field_validator

from data.documents import QUALITY_CATEGORY as CATEGORY
from data.documents import QUALITY_DIMENSIONS as DIMENSIONS  # the score dimensions, in this order everywhere
from data.documents import SCORE_MAX, SCORE_MIN
from pipeline.stage import StageParams

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
