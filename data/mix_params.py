"""Params of the ``mix`` stage (:mod:`data.mix`; the planner in :mod:`data.mix_plan` says what each one does): the
score, the buckets with their epoch caps (§4.1.3.2), the category/domain tilt, the budget and the ablation mode."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from data.documents import SCORE_MAX, SCORE_MIN
from pipeline.stage import StageParams


class BucketSpec(StageParams):
    name: str = Field(description="Bucket name (used in the manifest, stats and metric names).")
    min_score: float = Field(description="Inclusive lower bound of the score; the bucket ends where the next begins.")
    max_epochs: int = Field(ge=1, description="Most times a document of this bucket may be trained on.")
    weight: float = Field(gt=0, description="Relative sampling rate (epochs per unit lambda) of the bucket's documents.")

    @field_validator("name")
    @classmethod
    def _name_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("bucket name must be a non-empty string")
        return v

    @field_validator("weight")
    @classmethod
    def _weight_finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"bucket weight must be finite (got {v})")
        return v


# §4.1.3.2: "low-quality data suffer a substantial decrease in performance after training for more than
# two epochs, while high-quality data can be effectively trained for up to four epochs". Caps above these
# are refused unless allow_over_paper_caps says the user means it.
PAPER_LOW_QUALITY_MAX_EPOCHS = 2  # the lowest-score bucket holds the low-quality data
PAPER_MAX_EPOCHS = 4  # no data, however good, beyond four epochs


def over_paper_caps(buckets: list[BucketSpec]) -> list[str]:
    """Why each bucket's cap exceeds the paper's finding (empty: none does). ``buckets`` in score order."""
    problems = []
    for i, b in enumerate(buckets):
        if i == 0 and b.max_epochs > PAPER_LOW_QUALITY_MAX_EPOCHS:
            problems.append(f"bucket {b.name!r} (the lowest scores, from {b.min_score}) has max_epochs="
                            f"{b.max_epochs} > {PAPER_LOW_QUALITY_MAX_EPOCHS}, the paper's cap for low-quality data")
        elif b.max_epochs > PAPER_MAX_EPOCHS:
            problems.append(f"bucket {b.name!r} has max_epochs={b.max_epochs} > {PAPER_MAX_EPOCHS}, the paper's "
                            "cap for high-quality data")
    return problems


# low <= 2 and high <= 4 epochs: §4.1.3.2. Weights equal the caps (module docstring).
DEFAULT_BUCKETS = (
    {"name": "low", "min_score": 0.0, "max_epochs": 2, "weight": 2.0},
    {"name": "mid", "min_score": 2.0, "max_epochs": 3, "weight": 3.0},
    {"name": "high", "min_score": 3.5, "max_epochs": 4, "weight": 4.0},
)


class ScoreWeights(StageParams):
    knowledge_depth: float = Field(1.0, ge=0, description="Weight of knowledge_depth in the score.")
    helpfulness: float = Field(1.0, ge=0, description="Weight of helpfulness in the score.")

    @model_validator(mode="after")
    def _some_weight(self) -> ScoreWeights:
        total = self.knowledge_depth + self.helpfulness
        if not (total > 0 and math.isfinite(total)):
            raise ValueError(f"score_weights must be finite with a positive sum (got knowledge_depth="
                             f"{self.knowledge_depth}, helpfulness={self.helpfulness})")
        return self


class AblationParams(StageParams):
    enabled: bool = Field(False, description="Plan a small ablation run with the full run's repetition (§4.1.3.2).")
    full_token_budget: int | None = Field(None, gt=0, description="Tokens of the full training schedule.")
    ablation_token_budget: int | None = Field(None, gt=0, description="Tokens of the small ablation run.")

    @model_validator(mode="after")
    def _budgets_when_enabled(self) -> AblationParams:
        if not self.enabled:
            return self
        if self.full_token_budget is None or self.ablation_token_budget is None:
            raise ValueError("ablation.enabled needs ablation.full_token_budget (tokens of the full run) "
                             "and ablation.ablation_token_budget (tokens of the small run)")
        if self.ablation_token_budget > self.full_token_budget:
            raise ValueError(f"ablation.ablation_token_budget={self.ablation_token_budget} exceeds "
                             f"ablation.full_token_budget={self.full_token_budget}; an ablation run is "
                             "a down-sample of the full schedule")
        return self


def _default_buckets() -> list[BucketSpec]:
    return [BucketSpec(**b) for b in DEFAULT_BUCKETS]


class MixParams(StageParams):
    token_budget: int | None = Field(
        None, gt=0,
        description="Tokens of the mixture (incl. 2 BOS/EOS per document). Required unless ablation.enabled, "
                    "where the budgets come from ablation.*.")
    score_weights: ScoreWeights = Field(default_factory=ScoreWeights, description=(
        "score = (w_kd * knowledge_depth + w_h * helpfulness) / (w_kd + w_h)."))
    buckets: list[BucketSpec] = Field(default_factory=_default_buckets, description=(
        "Score buckets in increasing min_score, the first starting at <= 0: name, min_score, max_epochs, "
        "weight. Default low [0,2) <= 2 epochs, mid [2,3.5) <= 3, high [3.5,5] <= 4 (paper §4.1.3.2: "
        "low <= 2, high <= 4), weights 2/3/4."))
    category_weights: dict[str, float] = Field(default_factory=dict, description=(
        "Multiplier on the sampling rate per quality category (> 0); unlisted categories weigh 1 (uniform)."))
    domain_weights: dict[str, float] = Field(default_factory=dict, description=(
        "Multiplier on the sampling rate per domain/source (> 0); unlisted domains weigh 1 (uniform)."))
    min_category_share: float = Field(0.5, ge=0.0, le=1.0, description=(
        "Every category gets at least this fraction of its natural (deduplicated) token share of the "
        "budget, as far as its epoch caps allow: the quality tilt never zeroes a category."))
    count_duplicates_against_cap: bool = Field(False, description=(
        "Count the dup_count - 1 removed near-duplicates as exposures: the cap on sample_count becomes "
        "max_epochs - (dup_count - 1). Off: after global dedup the model sees the content sample_count times."))
    on_budget_shortfall: Literal["fail", "shrink"] = Field("fail", description=(
        "When the budget exceeds sum(tokens x max_epochs): fail with the achievable tokens, or shrink the "
        "budget to it (warned, logged as budget_shrunk_to)."))
    ablation: AblationParams = Field(default_factory=AblationParams, description=(
        "enabled, full_token_budget, ablation_token_budget: keep each document's full-run repetition, "
        "down-sample documents to the ablation budget (§4.1.3.2)."))
    allow_over_paper_caps: bool = Field(False, description=(
        "Accept bucket caps above the paper's (§4.1.3.2): the lowest-score bucket above 2 epochs or any bucket "
        "above 4. Off: such buckets are a validation error. On: the run warns and records them "
        "(tag mix.over_paper_caps, metric over_paper_caps, stats over_paper_caps)."))
    seed: int = Field(0, description="Salt of the per-document hash draws.")

    @field_validator("buckets")
    @classmethod
    def _buckets_cover_scores(cls, buckets: list[BucketSpec]) -> list[BucketSpec]:
        if not buckets:
            raise ValueError("buckets must hold at least one bucket")
        names = [b.name for b in buckets]
        if len(set(names)) != len(names):
            raise ValueError(f"bucket names must be unique (got {names})")
        bounds = [b.min_score for b in buckets]
        if any(lo >= hi for lo, hi in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"buckets must be listed in strictly increasing min_score (got {bounds})")
        if bounds[0] > SCORE_MIN:
            raise ValueError(f"the first bucket must start at min_score <= {SCORE_MIN} so every score has a "
                             f"bucket (got {bounds[0]} for {names[0]!r})")
        if bounds[-1] > SCORE_MAX:
            raise ValueError(f"bucket {names[-1]!r} starts at {bounds[-1]} > {SCORE_MAX}, the highest score; "
                             "it could hold no document")
        return buckets

    @field_validator("category_weights", "domain_weights")
    @classmethod
    def _weights_positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if not (w > 0 and math.isfinite(w))}
        if bad:
            raise ValueError(f"weights must be finite and > 0 (a category/domain is tilted, never zeroed; "
                             f"filter it upstream to drop it); got {bad}")
        return v

    @model_validator(mode="after")
    def _one_budget(self) -> MixParams:
        if self.ablation.enabled and self.token_budget is not None:
            raise ValueError("token_budget is unused with ablation.enabled: the full schedule is planned for "
                             "ablation.full_token_budget and down-sampled to ablation.ablation_token_budget; "
                             "remove token_budget")
        if not self.ablation.enabled and self.token_budget is None:
            raise ValueError("token_budget is required: the number of tokens (incl. 2 BOS/EOS per document) "
                             "the mixture should hold")
        problems = over_paper_caps(self.buckets)
        if problems and not self.allow_over_paper_caps:
            raise ValueError("; ".join(problems) + ". Lower max_epochs, or set allow_over_paper_caps: true to "
                             "train beyond the paper's caps on purpose (the run then records a warning)")
        return self
