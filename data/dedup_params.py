"""The params of stage ``dedup`` (data/dedup.py), which its decontamination (data/decontamination.py) reads too."""

from __future__ import annotations

from typing import Literal

from datatrove.pipeline.dedup.minhash import MinhashConfig
from pydantic import Field, field_validator

from pipeline.stage import StageParams


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
