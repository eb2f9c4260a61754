"""What the params of the two training stages (``pretrain``, ``long_context``) share: the engine's knobs
(``pretrain/engine_config.py``), the ranks per node, the retrieval rows, and the checks on them.

The knobs are flat fields of each stage's params (``pretrain.peak_lr`` in a DAG, as ``hylight stages --markdown``
lists them); :meth:`pretrain.engine_config.EngineConfig.for_run` turns a stage's params into the rank config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from data.retrieval import DEFAULT_KINDS as DEFAULT_RETRIEVAL_KINDS
from data.retrieval import KINDS as RETRIEVAL_KINDS
from pipeline.stage import StageParams
from pretrain.engine_config import EngineKnobs
from pretrain.launch import layout_problems


class TrainingParams(EngineKnobs, StageParams):
    """Base of a training stage's params. A subclass says which fields set its row lengths: ``row_lengths()``, by
    field, e.g. ``{"seq_len": 256}`` (``RunShape``'s for ``pretrain``; one per phase for ``long_context``)."""

    processes: int | None = Field(None, ge=1, description=(
        "Training ranks to launch on each node; default one per GPU of the stage's resources (1 on CPU). Several "
        "CPU ranks train with gloo (tests of expert parallelism)."))
    retrieval_share: float = Field(0.0, ge=0, lt=1, description=(
        "Share of the training rows made of retrieval-bearing samples (data/retrieval.py: a far-back span copied "
        "as the answer to a late query), from the run's own held-in text; 0: none. Our departure from the report "
        "(its data is not public): natural text alone teaches a small model no copying in a one-GPU budget."))
    retrieval_kinds: list[str] = Field(default_factory=lambda: list(DEFAULT_RETRIEVAL_KINDS), description=(
        "Kinds of retrieval samples (repeat, continue, lookup, multi_lookup; also fact: a value stated in a "
        "sentence, asked for by a question in words), drawn uniformly from this list: a kind listed twice is drawn "
        "twice as often."))
    retrieval_min_tokens: int = Field(256, ge=96, description=(
        "Shortest retrieval sample; lengths are drawn uniformly up to seq_len."))
    retrieval_loss: Literal["all", "answers"] = Field("all", description=(
        "What of a retrieval sample is a training target: 'all' (its natural-text context and its answer) or "
        "'answers' (the answer alone, so the copy targets weigh more in the loss; the plain rows still teach the text)."))
    retrieval_answer_eos: bool = Field(True, description=(
        "Whether the EOS that ends each retrieval sample, right after its answer, is a training target (counted with "
        "the answer). Off: the EOS stays in the row but takes no loss; a model that copies the answer would predict "
        "what followed it in the context there."))

    def training_problems(self) -> list[str]:
        """The engine's knobs against each other and the row lengths: checkpoints on logged steps, the retrieval
        rows and the probe, and the rank layout as far as the params alone decide it (:func:`layout_problems`)."""
        problems = []
        if self.checkpoint_every and self.checkpoint_every % self.log_every:
            problems.append(f"checkpoint_every={self.checkpoint_every} must be a multiple of "
                            f"log_every={self.log_every} (a resumed run then logs the same loss windows as an "
                            "uninterrupted one)")
        if self.probe_every % self.log_every:
            problems.append(f"probe_every={self.probe_every} must be a multiple of log_every={self.log_every} (the "
                            "probe's metrics join a logged step)")
        if self.probe_every and self.sequence_parallel > 1:
            problems.append("probe_every needs sequence_parallel 1 (the probe runs whole rows on every rank)")
        if not self.retrieval_kinds or set(self.retrieval_kinds) - set(RETRIEVAL_KINDS):
            problems.append(f"retrieval_kinds={self.retrieval_kinds}: a non-empty list of "
                            f"{', '.join(RETRIEVAL_KINDS)}")
        shortest = min(self.row_lengths().values())
        if self.retrieval_share and self.retrieval_min_tokens > shortest:
            problems.append(f"retrieval_min_tokens={self.retrieval_min_tokens} is longer than a row "
                            f"({shortest} tokens)")
        return problems + [msg for _, msg in layout_problems(self)]

    @model_validator(mode="after")
    def _training(self) -> TrainingParams:
        problems = self.training_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self
