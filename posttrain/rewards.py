"""The reward hierarchy (report §5.2) that later stages score responses with: SFT rejection sampling (§5.3), DPO's
best/worst pair selection (§5.4.1) and GRPO (§5.4.2).

Components of one (prompt record, response):

* ``correctness`` — verifiable prompts only (a ``checker`` in the record): the exact checker's score
  (:func:`posttrain.verifiable.check`: 1/0 for answers, the share of hidden tests passed for code, which runs in the
  sandbox), and ``correct``;
* ``helpfulness_rm`` — the reward model's raw score (:class:`posttrain.reward_model.RewardModelScorer`), when a
  reward model is given;
* ``constraints`` — rule-based instruction-constraint checks (§5.2 Helpfulness: "automated rule-based constraint
  verification"), each a named rule with pass/fail, only the rules that apply to the prompt:
  ``length_within_limits`` (min_chars <= stripped length <= max_chars), ``required_format`` (the prompt asks for an
  ``Answer:`` line -> the response has one; asks for a ```` ```python ```` block -> it has one), ``no_repetition_loop``
  (at most ``max_repeated_ngram_share`` of the word n-grams repeat an earlier one), ``same_script_as_prompt`` (the
  dominant writing system of the letters — Latin, Cyrillic, CJK, ... — matches the prompt's: a script check standing in
  for language identification, which needs a model). ``constraints`` = share of applicable rules passed.

Truthfulness and harmlessness (the other two §5.2 dimensions) have no component here: they need a fact-verification
pipeline and a harmlessness reward model, which the project does not have.

The total, and the hierarchy: with ``secondary = w_rm * tanh(helpfulness_rm / rm_scale) + w_c * constraints`` (terms
with no value count 0), ``secondary`` lies in ``[-w_rm, w_rm + w_c]``, a span of ``2 w_rm + w_c``.

* verifiable prompt: ``total = C * tier + secondary``, ``tier = (correct + correctness) / 2``: 1 for a correct
  response, at most 1/2 for an incorrect one (partial test credit still orders wrong code among itself). Because
  :class:`RewardWeights` requires ``C / 2 > 2 w_rm + w_c``, a correct response ALWAYS outranks an incorrect one,
  whatever the reward model or the rules say (correctness first, §5.2's order);
* open-ended prompt: ``total = secondary``. Totals rank responses to the same prompt; totals of different prompts are
  not comparable.
"""

from __future__ import annotations

import math
import re
import time
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data.reward_scoring import RewardModelScorer
from posttrain.verifiable import ANSWER_INSTRUCTION, CHECKERS, CODE_INSTRUCTION, answer_line, check

RULES = ("length_within_limits", "required_format", "no_repetition_loop", "same_script_as_prompt")


@dataclass(frozen=True)
class RewardWeights:
    correctness: float = 8.0  # C: C/2 = 4 > 2 * 1 + 1
    helpfulness_rm: float = 1.0  # w_rm
    constraints: float = 1.0  # w_c
    rm_scale: float = 1.0  # reward-model scores are squashed with tanh(score / rm_scale)

    def __post_init__(self) -> None:
        if min(self.correctness, self.helpfulness_rm, self.constraints) < 0 or self.rm_scale <= 0:
            raise ValueError(f"reward weights must be >= 0 and rm_scale > 0, got {self}")
        span = 2 * self.helpfulness_rm + self.constraints
        if self.correctness / 2 <= span:
            raise ValueError(
                f"reward weights {self}: correctness/2 = {self.correctness / 2} must exceed the span of the secondary "
                f"terms 2*helpfulness_rm + constraints = {span}, so that a correct answer always outranks a wrong "
                f"one (§5.2 hierarchy); raise correctness above {2 * span} or lower the other weights")


@dataclass(frozen=True)
class ConstraintLimits:
    min_chars: int = 1
    max_chars: int = 8000
    ngram: int = 4  # word n-gram size of the repetition rule
    max_repeated_ngram_share: float = 0.3
    min_words_for_repetition: int = 12  # shorter responses cannot loop meaningfully: the rule passes


@dataclass(frozen=True)
class RewardComponents:
    correctness: float | None  # checker score in [0, 1]; None: not a verifiable prompt
    correct: bool | None
    helpfulness_rm: float | None  # raw reward-model score; None: no reward model
    constraints: float | None  # share of applicable rules passed; None: no rule applies
    rules: dict[str, bool] = field(default_factory=dict)  # applicable rule -> passed
    total: float = 0.0
    reason: str = ""  # the checker's reason

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# --- the rules ----------------------------------------------------------------------------------------------------
def repeated_ngram_share(text: str, n: int) -> float:
    """Share of the word n-grams of ``text`` that repeat an earlier n-gram (0 when it has none)."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return (len(grams) - len(set(grams))) / len(grams)


def dominant_script(text: str) -> str | None:
    """The writing system of most letters of ``text`` (first word of the Unicode name: LATIN, CYRILLIC, CJK, ...),
    or None when it has no letters."""
    counts: Counter = Counter()
    for ch in text:
        if ch.isalpha():
            name = unicodedata.name(ch, "")
            counts[name.split(" ")[0] if name else "UNKNOWN"] += 1
    return counts.most_common(1)[0][0] if counts else None


_PY_FENCE = re.compile(r"```[ \t]*python[ \t]*\n", re.IGNORECASE)


def check_constraints(prompt: str, response: str, limits: ConstraintLimits = ConstraintLimits()) -> dict[str, bool]:
    """Applicable rule -> passed (see the module docstring for each rule)."""
    text = response if isinstance(response, str) else ""
    rules = {"length_within_limits": limits.min_chars <= len(text.strip()) <= limits.max_chars}
    if ANSWER_INSTRUCTION in prompt:
        rules["required_format"] = answer_line(text) is not None
    elif CODE_INSTRUCTION in prompt:
        rules["required_format"] = bool(_PY_FENCE.search(text))
    if len(text.split()) >= limits.min_words_for_repetition:
        rules["no_repetition_loop"] = repeated_ngram_share(text, limits.ngram) <= limits.max_repeated_ngram_share
    prompt_script, response_script = dominant_script(prompt), dominant_script(text)
    if prompt_script is not None and response_script is not None:
        rules["same_script_as_prompt"] = prompt_script == response_script
    return rules


# --- combining ----------------------------------------------------------------------------------------------------
def combine(weights: RewardWeights, correctness: float | None, correct: bool | None, helpfulness_rm: float | None,
            constraints: float | None) -> float:
    """The total (module docstring): ``C * (correct + correctness) / 2 + secondary`` for verifiable prompts, else
    ``secondary``."""
    secondary = 0.0
    if helpfulness_rm is not None:
        secondary += weights.helpfulness_rm * math.tanh(helpfulness_rm / weights.rm_scale)
    if constraints is not None:
        secondary += weights.constraints * constraints
    if correctness is None:
        return secondary
    return weights.correctness * (float(bool(correct)) + correctness) / 2 + secondary


# The reward model reads at most this many tokens of a (prompt, response) chat, its end (the response and the end of
# the prompt, where the score is read): the reward model trains on pairs of a few hundred tokens, and a batch of 32
# long-context prompts (~6K tokens each, the prompts stage's long_retrieval) at full length would cost the memory
# of 32 x 6K tokens for a score it never learnt to give. Every prompt before long_retrieval is shorter.
RM_MAX_TOKENS = 2048


class RewardHierarchy:
    """Scores batches of (prompt record, response) with the components and total above."""

    def __init__(self, weights: RewardWeights = RewardWeights(), reward_model_dir: str | Path | None = None,
                 limits: ConstraintLimits = ConstraintLimits(), scorer: Any = None, device: Any = "cpu") -> None:
        """``scorer``: anything with ``score(prompts, responses) -> list[float]`` (default: the reward model in
        ``reward_model_dir`` via RewardModelScorer, on ``device``, reading the last :data:`RM_MAX_TOKENS` tokens;
        neither: no helpfulness_rm component)."""
        self.weights, self.limits = weights, limits
        if scorer is None and reward_model_dir is not None:
            scorer = RewardModelScorer(reward_model_dir, device=device, max_length=RM_MAX_TOKENS)
        self.scorer = scorer
        # the last score() call's seconds in the reward model and in the checkers (the code checker runs the sandbox)
        self.last_seconds = {"reward_model": 0.0, "checkers": 0.0}

    def score(self, records: Sequence[dict[str, Any]], responses: Sequence[str]) -> list[RewardComponents]:
        if len(records) != len(responses):
            raise ValueError(f"reward hierarchy: {len(records)} prompt records but {len(responses)} responses")
        seconds = self.last_seconds = {"reward_model": 0.0, "checkers": 0.0}
        start = time.monotonic()
        rm = (self.scorer.score([r["prompt"] for r in records], list(responses)) if self.scorer is not None
              else [None] * len(records))
        seconds["reward_model"] = time.monotonic() - start
        out = []
        for rec, resp, rm_score in zip(records, responses, rm, strict=True):
            correctness = correct = None
            reason = ""
            if rec.get("checker") in CHECKERS:
                start = time.monotonic()
                res = check(rec, resp)
                seconds["checkers"] += time.monotonic() - start
                correctness, correct, reason = res.score, res.correct, res.reason
            rules = check_constraints(rec["prompt"], resp, self.limits)
            share = sum(rules.values()) / len(rules) if rules else None
            total = combine(self.weights, correctness, correct, rm_score, share)
            out.append(RewardComponents(correctness, correct, rm_score, share, rules, total, reason))
        return out

    def timing(self) -> str:
        """Where the last score() call's time went, for a progress line."""
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.last_seconds.items())
