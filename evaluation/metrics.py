"""Scores of the ``eval`` stage: NIAH answers, multiple-choice metrics (acc, acc_norm, log acc_norm²) and the power
analysis of §4.1.3.1. Plain Python and numpy; the model-side numbers (log-likelihoods, generations) come from
``evaluation/eval.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

_NUMBER = re.compile(r"\d+")


# --- NIAH -----------------------------------------------------------------------------------------------------
def first_number(text: str) -> str | None:
    """The first run of digits in a generated answer (None if there is none)."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def niah_correct(generated: str, number: str) -> bool:
    """Exact match: the first number the model writes is the needle's number, digit for digit."""
    return first_number(generated) == number


def niah_prefix_digits(generated: str, number: str) -> float:
    """The share of the needle's digits that the first number in the answer reproduces from its start: a copy that
    stops one digit early scores 6/7, one that runs on past the number's end 1.0, no number 0. Exact match is
    :func:`niah_correct`; this separates a copy with a wrong end from no copy (the ninth GPU lease: 5 of 13 wrong
    answers at 8K were the needle's first 6 or 7 digits)."""
    got = first_number(generated) or ""
    same = 0
    for a, b in zip(got, number, strict=False):  # the shorter of the two bounds the prefix
        if a != b:
            break
        same += 1
    return same / len(number)


NIAH_ANSWER_KINDS = ("correct", "near_copy", "other_number", "text")
NEAR_COPY_DIGITS = 3  # leading digits of the needle a wrong answer must reproduce to count as a copy gone wrong


def niah_answer_kind(generated: str, number: str) -> str:
    """What a NIAH answer is, for reading why an accuracy is what it is: "correct" (:func:`niah_correct`),
    "near_copy" (the first number begins with at least NEAR_COPY_DIGITS of the needle's digits and is still wrong:
    a copy that ended or looped wrong), "other_number" (the answer begins with a number, not a near copy) or
    "text" (it begins with anything but a digit: the model went on with the haystack, or wrote something else,
    instead of answering). The first number decides "correct" and "near_copy" wherever it stands in the answer.
    In the twelfth GPU lease long_context's 10 wrong answers at 8K were 6 text, 3 other numbers and 1 near copy;
    the copy-keep branch's 15 were 8 near copies."""
    if niah_correct(generated, number):
        return "correct"
    if round(niah_prefix_digits(generated, number) * len(number)) >= min(NEAR_COPY_DIGITS, len(number)):
        return "near_copy"
    return "other_number" if generated.lstrip()[:1].isdigit() else "text"


def recall(generated: str, numbers: Sequence[str]) -> list[bool]:
    """Multi-round NIAH: which of the needles' numbers appear (as whole numbers) in the answer."""
    found = set(_NUMBER.findall(generated))
    return [n in found for n in numbers]


# --- multiple choice --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceScores:
    """One multiple-choice item's scores."""

    acc: float  # argmax of the summed log-likelihoods is gold
    acc_norm: float  # argmax of log-likelihood / characters of the choice is gold (lm-eval's acc_norm)
    log_acc_norm2: float  # the paper's log acc_norm² (below)


def log_acc_norm2(logliks: Sequence[float], choices: Sequence[str], gold: int) -> float:
    """§4.1.3.1: ``log acc_norm²(x) = log softmax_{p'(c), c in C_x} {p'(c*)}``, ``p'(c) = p(c) / bytes(c)``.

    ``p(c)`` is read as the choice's log-likelihood (the sum over its tokens), so ``p'(c)`` is the byte-normalised
    log-likelihood and the metric is the log of the probability that a softmax over the choices' byte-normalised
    scores gives the gold choice (<= 0; log(1/|C|) for a model that cannot tell the choices apart). Read literally as a
    probability in [0, 1], ``p(c) / bytes(c)`` would put every choice's softmax logit within 1/bytes of 0: the metric
    would sit at log(1/|C|) for every model, with none of the discriminative power the section asks of it. ``bytes``
    is the UTF-8 length of the choice (tokenizer-independent, as the section says).
    """
    if not 0 <= gold < len(choices) or len(logliks) != len(choices):
        raise ValueError(f"gold={gold} with {len(choices)} choices and {len(logliks)} log-likelihoods")
    scores = np.asarray(logliks, np.float64) / np.asarray([_bytes(c) for c in choices], np.float64)
    return float(scores[gold] - _logsumexp(scores))


def choice_scores(logliks: Sequence[float], choices: Sequence[str], gold: int) -> ChoiceScores:
    """acc, acc_norm (lm-eval: ``argmax(ll / len(choice))``, ties to the first choice) and log acc_norm²."""
    ll = np.asarray(logliks, np.float64)
    chars = np.asarray([max(len(c), 1) for c in choices], np.float64)
    return ChoiceScores(acc=float(int(np.argmax(ll)) == gold), acc_norm=float(int(np.argmax(ll / chars)) == gold),
                        log_acc_norm2=log_acc_norm2(logliks, choices, gold))


def _bytes(choice: str) -> int:
    return max(len(choice.encode("utf-8")), 1)


def _logsumexp(x: np.ndarray) -> float:
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum()))


# --- power analysis (§4.1.3.1: minimal test size at 95% confidence and 80% power) ------------------------------
def _z(alpha: float, power: float) -> tuple[float, float]:
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha={alpha}, power={power}: both must lie in (0, 1)")
    n = NormalDist()
    return n.inv_cdf(1 - alpha / 2), n.inv_cdf(power)


def min_samples_for_accuracy_difference(p1: float, p2: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Smallest test size n (per model) at which a two-sided two-proportion z-test at level ``alpha`` detects
    accuracies ``p1`` vs ``p2`` with probability ``power``; the models are scored on independent samples of size n.

    Normal approximation with the pooled variance under H0 and no continuity correction (Fleiss, Levin & Paik,
    *Statistical Methods for Rates and Proportions*, ch. 4):
    ``n = (z_{1-a/2} sqrt(2 pbar (1 - pbar)) + z_{1-b} sqrt(p1 (1 - p1) + p2 (1 - p2)))^2 / (p1 - p2)^2``,
    ``pbar = (p1 + p2) / 2``, rounded up.
    """
    if not (0 <= p1 <= 1 and 0 <= p2 <= 1) or p1 == p2:
        raise ValueError(f"p1={p1}, p2={p2}: need two different accuracies in [0, 1]")
    za, zb = _z(alpha, power)
    pbar = (p1 + p2) / 2
    n = (za * math.sqrt(2 * pbar * (1 - pbar)) + zb * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2))) ** 2 / (p1 - p2) ** 2
    return math.ceil(n - 1e-9)


def min_samples_for_mean_difference(delta: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Smallest n per model at which a two-sided two-sample t-test (equal n, common standard deviation ``sd``) at
    level ``alpha`` detects a difference ``delta`` of means (e.g. of mean log acc_norm²) with probability ``power``.

    Exact power from the noncentral t distribution: df = 2n - 2, noncentrality ``(delta / sd) sqrt(n / 2)``,
    power = P(|T| > t_{1-a/2, df}), as G*Power computes it (d = delta / sd = 0.5 -> 64 per group, 0.8 -> 26).
    """
    from scipy import stats  # a dependency of scikit-learn, which the quality stage needs

    if delta <= 0 or sd <= 0:
        raise ValueError(f"delta={delta}, sd={sd}: need delta > 0 and sd > 0")
    _z(alpha, power)
    d = delta / sd

    def achieved(n: int) -> float:
        df, ncp = 2 * n - 2, d * math.sqrt(n / 2)
        t = stats.t.ppf(1 - alpha / 2, df)
        return float(stats.nct.sf(t, df, ncp) + stats.nct.cdf(-t, df, ncp))

    lo, hi = 2, 4
    while achieved(hi) < power:  # power rises with n: double, then bisect
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if achieved(mid) >= power else (mid + 1, hi)
    return lo


def min_detectable_accuracy_difference(p: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest gain d over accuracy ``p`` (to ``p + d``) that ``n`` samples per model detect by
    :func:`min_samples_for_accuracy_difference`; inf if not even ``p`` -> 1 is detectable."""
    if n < 1 or not 0 <= p <= 1:
        raise ValueError(f"p={p}, n={n}: need an accuracy in [0, 1] and at least one sample")
    if p == 1 or min_samples_for_accuracy_difference(p, 1.0, alpha, power) > n:
        return math.inf
    lo, hi = 0.0, 1.0 - p  # n does not detect lo, detects hi: bisect (the required n falls as d grows)
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid > 0 and min_samples_for_accuracy_difference(p, p + mid, alpha, power) <= n:
            hi = mid
        else:
            lo = mid
    return hi
