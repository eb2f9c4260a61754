"""The reward hierarchy (report §5.2): components, constraint rules and totals checked by hand, and the ordering
property (a correct answer outranks a wrong one whatever the reward model says)."""

from __future__ import annotations

import itertools
import math

import pytest

from posttrain.rewards import (
    ConstraintLimits,
    RewardHierarchy,
    RewardWeights,
    check_constraints,
    combine,
    dominant_script,
    repeated_ngram_share,
)
from posttrain.verifiable import ANSWER_INSTRUCTION, CODE_INSTRUCTION

ARITH = {"id": "a1", "prompt": f"Compute 40 + 2. {ANSWER_INSTRUCTION}", "checker": "exact_number",
         "reference": {"answer": "42"}}
OPEN = {"id": "o1", "prompt": "Explain to a newcomer what a compiler does."}


class FixedScores:
    """A stand-in scorer returning given reward-model scores (the hierarchy's arithmetic is under test here; the
    real reward model is tested in tests/test_reward_model.py)."""

    def __init__(self, scores: list[float]) -> None:
        self.scores = scores

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        assert len(prompts) == len(responses) == len(self.scores)
        return list(self.scores)


def test_repeated_ngram_share_by_hand() -> None:
    assert repeated_ngram_share("a b c d", 2) == 0.0  # ab bc cd
    assert repeated_ngram_share("a b a b a b", 2) == pytest.approx(3 / 5)  # ab ba ab ba ab: 3 repeats of 5
    assert repeated_ngram_share("a", 2) == 0.0


def test_dominant_script() -> None:
    assert dominant_script("Hello, world 42") == "LATIN"
    assert dominant_script("Привет мир, ok") == "CYRILLIC"
    assert dominant_script("1 + 2 = 3") is None


def test_constraint_rules_apply_only_where_the_prompt_asks() -> None:
    assert check_constraints(ARITH["prompt"], "The sum is 42.\nAnswer: 42") == {
        "length_within_limits": True, "required_format": True, "same_script_as_prompt": True}
    assert check_constraints(ARITH["prompt"], "42")["required_format"] is False
    code_prompt = f"Write a Python function f that returns 1. {CODE_INSTRUCTION}"
    assert check_constraints(code_prompt, "```python\ndef f():\n    return 1\n```")["required_format"] is True
    assert check_constraints(code_prompt, "def f(): return 1")["required_format"] is False
    loop = "the cat sat on the mat " * 5  # 30 words: 26 4-grams, 20 repeat an earlier one
    rules = check_constraints(OPEN["prompt"], loop)
    assert "required_format" not in rules and rules["no_repetition_loop"] is False
    assert check_constraints(OPEN["prompt"], "Это ответ на русском языке.")["same_script_as_prompt"] is False
    assert check_constraints(OPEN["prompt"], "", ConstraintLimits(min_chars=1))["length_within_limits"] is False
    assert check_constraints(OPEN["prompt"], "x" * 11, ConstraintLimits(max_chars=10))["length_within_limits"] is False


def test_weights_that_could_let_a_wrong_answer_win_are_refused() -> None:
    with pytest.raises(ValueError, match="always outranks"):
        RewardWeights(correctness=6.0, helpfulness_rm=1.0, constraints=1.0)  # C/2 = 3 = span
    RewardWeights(correctness=6.1, helpfulness_rm=1.0, constraints=1.0)


def test_components_and_totals_by_hand() -> None:
    w = RewardWeights(correctness=8.0, helpfulness_rm=1.0, constraints=1.0, rm_scale=2.0)
    h = RewardHierarchy(w, scorer=FixedScores([0.5, -3.0, 1.0]))
    right, wrong, open_ = h.score([ARITH, ARITH, OPEN], ["Answer: 42", "Answer: 41", "A compiler translates code."])
    # right: tier 1; rules length/format/script all pass -> 1; rm tanh(0.25)
    assert (right.correctness, right.correct, right.constraints) == (1.0, True, 1.0)
    assert right.total == pytest.approx(8.0 + math.tanh(0.25) + 1.0)
    assert wrong.correctness == 0.0 and wrong.correct is False and "41" in wrong.reason
    assert wrong.total == pytest.approx(0.0 + math.tanh(-1.5) + 1.0)
    # open-ended: no correctness; length and script rules apply, format does not
    assert open_.correctness is None and open_.rules == {"length_within_limits": True, "same_script_as_prompt": True}
    assert open_.total == pytest.approx(math.tanh(0.5) + 1.0)
    assert combine(w, None, None, None, None) == 0.0


def test_partial_code_credit_orders_wrong_code_but_stays_below_any_correct_answer() -> None:
    w = RewardWeights()
    half_tests = combine(w, 0.8, False, 100.0, 1.0)  # 4/5 tests, best possible secondary
    none_pass = combine(w, 0.0, False, 100.0, 1.0)
    correct_worst = combine(w, 1.0, True, -100.0, 0.0)  # correct, worst possible secondary
    assert none_pass < half_tests < correct_worst
    assert half_tests == pytest.approx(8.0 * (0 + 0.8) / 2 + math.tanh(100.0) + 1.0)  # 5.2


@pytest.mark.parametrize("weights", [RewardWeights(), RewardWeights(correctness=3.1, helpfulness_rm=0.5,
                                                                    constraints=0.5, rm_scale=0.1)])
def test_a_correct_answer_outranks_every_wrong_one_whatever_the_reward_model_says(weights: RewardWeights) -> None:
    rm_scores = [-1e6, -5.0, -0.1, 0.0, 0.3, 7.0, 1e6]
    responses = ["Answer: 42", "42", "Answer: 41", "I do not know", "Answer: 42 " + "again and again " * 10]
    combos = list(itertools.product(responses, rm_scores))
    h = RewardHierarchy(weights, scorer=FixedScores([s for _, s in combos]))
    scored = h.score([ARITH] * len(combos), [r for r, _ in combos])
    correct = [c.total for c in scored if c.correct]
    wrong = [c.total for c in scored if not c.correct]
    assert len(correct) == 3 * len(rm_scores) and len(wrong) == 2 * len(rm_scores)
    assert min(correct) > max(wrong)


def test_without_a_reward_model_the_component_is_absent_and_counts_zero() -> None:
    (c,) = RewardHierarchy().score([ARITH], ["Answer: 42"])
    assert c.helpfulness_rm is None and c.total == pytest.approx(8.0 + 1.0)
    with pytest.raises(ValueError, match="2 prompt records but 1 responses"):
        RewardHierarchy().score([ARITH, ARITH], ["x"])
