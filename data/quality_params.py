"""Params of stage ``quality`` (:mod:`data.quality`): who labels the sample (``labeler``, one of
:mod:`data.quality_labeler`'s kinds), the taxonomy, the sample and split, and the scorer's training."""

from __future__ import annotations

import re
from collections import Counter
from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from data.quality_labels import (
    DEFAULT_TAXONOMY,
    CausalLMLabelerParams,
    ReferenceLabelerParams,
    RewardModelLabelerParams,
)
from data.quality_scorer import ENCODER_MAX_TOKENS
from pipeline.stage import StageParams


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
