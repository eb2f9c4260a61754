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

Where the code lives: the labels, reply parsing and params in :mod:`data.quality_labels`, the reference labeler in
:mod:`data.quality_reference_labeler`, the causal LM and reward model labelers in :mod:`data.quality_model_labelers`;
this module picks one (:func:`make_labeler`) and fingerprints what it reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.documents import QUALITY_DIMENSIONS as DIMENSIONS
from data.quality_labels import (
    DEFAULT_CATEGORY_MAP,
    DEFAULT_REWARD_PROMPTS,
    DEFAULT_TAXONOMY,
    REJECT_REASONS,
    CausalLMLabelerParams,
    Label,
    LabelDoc,
    LabelerParams,
    LabelOutcome,
    MalformedReply,
    ReferenceLabelerParams,
    RewardModelLabelerParams,
    category_from_metadata,
    parse_reply,
)
from data.quality_model_labelers import (
    RUBRIC_TEMPLATE,
    CausalLMLabeler,
    RewardModelLabeler,
    directory_fingerprint,
    mid_rank_percentiles,
    reward_model_directory,
)
from data.quality_reference_labeler import (
    PASSAGE_MARKER,
    REFS_DIR,
    ReferenceLabeler,
    ReferencePassage,
    load_reference_passages,
    reference_files,
)
from pipeline.stage import file_fingerprint

# the labelers' public names, importable from here (tests and the quality stage's modules import them)
__all__ = ["DEFAULT_CATEGORY_MAP", "DEFAULT_REWARD_PROMPTS", "DEFAULT_TAXONOMY", "DIMENSIONS", "PASSAGE_MARKER",
           "REFS_DIR", "REJECT_REASONS", "RUBRIC_TEMPLATE", "CausalLMLabeler", "CausalLMLabelerParams", "Label",
           "LabelDoc", "LabelOutcome", "LabelerParams", "MalformedReply", "ReferenceLabeler", "ReferenceLabelerParams",
           "ReferencePassage", "RewardModelLabeler", "RewardModelLabelerParams", "category_from_metadata",
           "labeler_fingerprint", "load_reference_passages", "make_labeler", "mid_rank_percentiles", "parse_reply",
           "reference_files", "reward_model_directory"]


def make_labeler(params: LabelerParams,
                 taxonomy: Sequence[str]) -> ReferenceLabeler | CausalLMLabeler | RewardModelLabeler:
    if isinstance(params, ReferenceLabelerParams):
        return ReferenceLabeler(params, taxonomy)
    if isinstance(params, RewardModelLabelerParams):
        return RewardModelLabeler(params, taxonomy)
    return CausalLMLabeler(params, taxonomy)


def labeler_fingerprint(params: LabelerParams) -> dict[str, Any]:
    """What the labeler reads besides the input documents and its code, for the stage's cache key (the labeler's
    modules are in the stage's code digest: ``data.quality`` imports them)."""
    if isinstance(params, ReferenceLabelerParams):
        return {"references": [file_fingerprint(p) for p in reference_files(params).values() if p.is_file()]}
    path = Path(params.model_path).expanduser()
    fp: dict[str, Any] = {"model": directory_fingerprint(path) if path.is_dir() else None}
    if isinstance(params, RewardModelLabelerParams):
        return fp
    if params.tokenizer_path and Path(params.tokenizer_path).expanduser().is_dir():
        fp["tokenizer"] = directory_fingerprint(Path(params.tokenizer_path).expanduser())
    return fp
