"""What a prompt record of the ``prompts`` stage is: the rules a user JSONL line must meet (:func:`record_problem`,
one rule for spec validation and the stage) and the §5.1 tags (:data:`TAG_FIELDS`), with :func:`heuristic_tags` for
a user prompt that brings none (keyword and length rules, not a classifier).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from pipeline.user_jsonl import iter_checked_jsonl
from posttrain.sandbox import parse_tests
from posttrain.verifiable import CHECKERS

TAG_FIELDS = ("task_type", "domain", "difficulty")


# --- user prompt records ------------------------------------------------------------------------------------------
def record_problem(obj: Any) -> str | None:
    """Why a user JSONL object is not a prompt record, or None (the one rule for validation and the stage)."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    if not isinstance(obj.get("prompt"), str):
        return "needs a string field 'prompt'"
    for key in ("id", "response", *TAG_FIELDS):
        if key in obj and not isinstance(obj[key], str):
            return f"field {key!r} must be a string"
    if "checker" in obj:
        if obj["checker"] not in CHECKERS:
            return f"checker {obj['checker']!r} is unknown (known: {', '.join(CHECKERS)})"
        ref = obj.get("reference")
        need = ("function", "tests") if obj["checker"] == "python_tests" else ("answer",)
        if not isinstance(ref, dict) or any(k not in ref for k in need):
            return f"checker {obj['checker']!r} needs a 'reference' object with {', '.join(need)}"
        why = _reference_problem(obj["checker"], ref)
        if why:
            return why
    return _value_problem(obj, "")


def _reference_problem(checker: str, ref: dict[str, Any]) -> str | None:
    """Why a checker's reference values cannot be checked against (types, not only keys), or None."""
    if checker == "python_tests":
        if not isinstance(ref["function"], str) or not ref["function"].isidentifier():
            return "reference.function must be a Python identifier (a string)"
        tests = ref["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            return "reference.tests must be a non-empty list of strings (one test statement each), not " + (
                "a string" if isinstance(tests, str) else type(tests).__name__)
        try:  # the sandbox takes only tests whose expected value the parent can hold (posttrain/sandbox.py)
            parse_tests(tests)
        except ValueError as e:
            return f"reference.{e}"
    elif checker == "exact_number":
        answer = ref["answer"]
        if isinstance(answer, bool) or not isinstance(answer, int | float | str):
            return f"reference.answer must be a number (or a numeric string), got {type(answer).__name__}"
        try:
            ok = Decimal(str(answer)).is_finite()
        except InvalidOperation:
            ok = False
        if not ok:
            return f"reference.answer {answer!r} is not a finite number"
    elif not isinstance(ref["answer"], str | int | float) or isinstance(ref["answer"], bool):
        return f"reference.answer must be a string (or a number), got {type(ref['answer']).__name__}"
    if "casefold" in ref and not isinstance(ref["casefold"], bool):
        return f"reference.casefold must be true or false, got {ref['casefold']!r}"
    return None


def _value_problem(value: Any, where: str) -> str | None:
    """Values JSON cannot hold (NaN, Infinity: Python's parser takes them, strict JSON has none) or text with a
    NUL character, anywhere in the record."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'a value'} is {value!r}, which is not a JSON number"
    if isinstance(value, str) and "\x00" in value:
        return f"{where or 'a string'} holds a NUL character"
    if isinstance(value, dict):
        for k, v in value.items():
            why = _value_problem(v, f"{where}.{k}" if where else str(k))
            if why:
                return why
    elif isinstance(value, list):
        for i, v in enumerate(value):
            why = _value_problem(v, f"{where}[{i}]")
            if why:
                return why
    return None


def iter_user_file(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    return iter_checked_jsonl(path, record_problem)


# --- tagging ------------------------------------------------------------------------------------------------------
_CODE_HINT = re.compile(r"```|\bdef |\bfunction\b|\bpython\b|\bjavascript\b|\bsql\b|\bcode\b|\bbug\b", re.I)
_MATH_HINT = re.compile(r"\d+\s*[-+*/^=]\s*\d+|\bsolve\b|\bequation\b|\bintegral\b|\bprobability\b|\bprove\b", re.I)
_CREATIVE_HINT = re.compile(r"\b(poem|story|essay|haiku|lyrics|fiction)\b", re.I)
_SUMMARY_HINT = re.compile(r"\bsummari[sz]e|\btl;?dr\b", re.I)


def heuristic_tags(prompt: str) -> dict[str, str]:
    """Rule-derived tags for a prompt that brings none (keyword and length rules, not a trained classifier)."""
    if _CODE_HINT.search(prompt):
        task, domain = "code", "programming"
    elif _MATH_HINT.search(prompt):
        task, domain = "math", "math"
    elif _CREATIVE_HINT.search(prompt):
        task, domain = "creative_writing", "creative-writing"
    elif _SUMMARY_HINT.search(prompt):
        task, domain = "summarization", "general-knowledge"
    elif prompt.rstrip().endswith("?"):
        task, domain = "question_answering", "general-knowledge"
    else:
        task, domain = "instruction", "general-knowledge"
    words = len(prompt.split())
    difficulty = "easy" if words < 30 else "medium" if words < 200 else "hard"
    return {"task_type": task, "domain": domain, "difficulty": difficulty}
