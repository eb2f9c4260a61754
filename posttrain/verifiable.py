"""Verifiable prompts and their exact checkers (report §5.1 prompt collection, §5.2 Correctness).

Four seeded generators make prompts whose answer can be checked exactly:

* ``arithmetic``: integer expressions, ``easy`` (a + b, a - b), ``medium`` (a * b + c), ``hard``
  ((a * b - c) // d + e, integer floor division stated in the prompt); checker ``exact_number``;
* ``string``: reverse, count a letter, sort words, upper/lower/title case, remove vowels; checker ``exact_text``
  (``exact_number`` for counts);
* ``retrieval``: a passage of corpus text with a planted fact (a code number for a named item) or a question
  about the passage itself (the word right after a quoted phrase that occurs once); checker ``exact_number`` /
  ``exact_text`` (case-insensitive);
  ``long`` retrieval (:func:`long_retrieval_records`): the planted fact in a window of thousands of words over several
  documents, for long-context SFT;
* ``code``: a small Python function to write, one example in the prompt and hidden test cases (expected values
  computed by the reference solution); checker ``python_tests`` (the tests run in :mod:`posttrain.sandbox`).

A record (a plain dict, one JSONL line): ``id``, ``prompt``, ``task_type``, ``domain``, ``difficulty``, ``source``
(``verifiable``), ``checker`` and ``reference`` (``answer``; for code ``function``, ``tests``, ``solution``).

Extraction rules (what a checker reads from a response; documented in every prompt too):

* ``exact_number``: the value on the last line starting ``Answer:`` (any case, optional markdown bold) if there is
  one, else the last number anywhere in the response; numbers may carry thousands commas and a sign; equal as
  exact decimals (``42``, ``42.0`` and ``42,000``/``42000`` compare by value).
* ``exact_text``: the rest of the last ``Answer:`` line if there is one, else the last non-empty line; stripped of
  whitespace, surrounding quotes/backticks/bold markers and one trailing period; compared exactly (or casefolded
  when the reference says ``casefold``).
* ``python_tests``: the last fenced code block (```` ```python ```` or ```` ``` ````) if there is one, else the whole
  response; run with the hidden tests in the sandbox; score = share of tests passed, correct = all passed.

Every checker is deterministic and total: any string (or None) gives a :class:`CheckResult`, responses are cut to
:data:`MAX_RESPONSE_CHARS` before parsing, and the sandbox bounds code by time, memory and processes.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from posttrain.sandbox import SandboxLimits, run_python

MAX_RESPONSE_CHARS = 20_000
ANSWER_INSTRUCTION = "Give the final answer on the last line, as 'Answer: <answer>'."
CODE_INSTRUCTION = "Reply with the function in one ```python code block."
TASK_TYPES = ("arithmetic", "string", "retrieval", "code")
DIFFICULTIES = ("easy", "medium", "hard")
LONG = "long"  # the difficulty of long-context retrieval records (long_retrieval_records)
LONG_ID_PREFIX = "verifiable/retrieval-long/"  # and their ids


@dataclass(frozen=True)
class CheckResult:
    correct: bool
    score: float  # in [0, 1]: 1/0 for exact answers, the share of tests passed for code
    reason: str


# --- extraction ---------------------------------------------------------------------------------------------------
_ANSWER_LINE = re.compile(r"^[ \t>*_#-]*answer[ \t*_]*[:：][ \t]*(.*)$", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"(?<![\w.])[-+−]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.])[-+−]?\d+(?:\.\d+)?")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def _text(response: Any) -> str:
    return response[:MAX_RESPONSE_CHARS] if isinstance(response, str) else ""


def answer_line(response: str) -> str | None:
    """The rest of the last ``Answer:`` line, or None."""
    found = _ANSWER_LINE.findall(response)
    return found[-1].strip() if found else None


def extract_number(response: Any) -> Decimal | None:
    """The ``exact_number`` rule (module docstring)."""
    text = _text(response)
    line = answer_line(text)
    pool = _NUMBER.findall(line)[:1] if line is not None else _NUMBER.findall(text)[-1:]
    if not pool:
        return None
    try:
        return Decimal(pool[0].replace(",", "").replace("−", "-"))
    except InvalidOperation:
        return None


def extract_text(response: Any) -> str | None:
    """The ``exact_text`` rule (module docstring)."""
    text = _text(response)
    line = answer_line(text)
    if line is None:
        lines = [s for s in text.splitlines() if s.strip()]
        if not lines:
            return None
        line = lines[-1]
    value = line.strip()
    period = False  # one trailing period, inside or outside the quotes
    for _ in range(3):
        value = value.strip().strip("*_").strip()
        if not period and value.endswith(".") and not value.endswith(".."):
            value, period = value[:-1].rstrip(), True
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'`":
            value = value[1:-1]
    return value.strip()


def extract_code(response: Any) -> str:
    """The ``python_tests`` rule: the last fenced block, else the whole response."""
    text = _text(response)
    blocks = _FENCE.findall(text)
    return blocks[-1][1] if blocks else text


# --- checkers -----------------------------------------------------------------------------------------------------
def check_exact_number(record: dict[str, Any], response: Any) -> CheckResult:
    want = Decimal(str(record["reference"]["answer"]))
    got = extract_number(response)
    if got is None:
        return CheckResult(False, 0.0, "no number found in the response")
    if got == want:
        return CheckResult(True, 1.0, f"answer {got} matches")
    return CheckResult(False, 0.0, f"answer {got} != reference {want}")


def check_exact_text(record: dict[str, Any], response: Any) -> CheckResult:
    ref = record["reference"]
    want = str(ref["answer"])
    got = extract_text(response)
    if not got:
        return CheckResult(False, 0.0, "no answer found in the response")
    same = got.casefold() == want.casefold() if ref.get("casefold") else got == want
    if same:
        return CheckResult(True, 1.0, "answer matches")
    return CheckResult(False, 0.0, f"answer {got[:80]!r} != reference {want[:80]!r}")


def check_python_tests(record: dict[str, Any], response: Any,
                       limits: SandboxLimits | None = None) -> CheckResult:
    ref = record["reference"]
    code = extract_code(response)
    if f"def {ref['function']}" not in code:
        return CheckResult(False, 0.0, f"no definition of {ref['function']}() in the response")
    r = run_python(code, ref["tests"], limits or SandboxLimits(wall_seconds=5, cpu_seconds=3))
    score = r.pass_rate if r.status in ("ok", "error") else 0.0
    correct = r.status == "ok" and r.tests_passed == r.tests_total
    first_fail = next((e for e in r.test_errors if e is not None), "")
    reason = (f"{r.tests_passed}/{r.tests_total} tests passed (sandbox {r.status}, network {r.network_mode}, "
              f"filesystem {r.filesystem}, memory {r.memory_limit})")
    if r.error or first_fail:
        reason += f": {(r.error or first_fail)[:160]}"
    return CheckResult(correct, score, reason)


CHECKERS: dict[str, Callable[[dict[str, Any], Any], CheckResult]] = {
    "exact_number": check_exact_number,
    "exact_text": check_exact_text,
    "python_tests": check_python_tests,
}


def check(record: dict[str, Any], response: Any) -> CheckResult:
    """Score ``response`` against a verifiable prompt record (the interface of every post-training reward)."""
    name = record.get("checker")
    if name not in CHECKERS:
        raise ValueError(f"prompt {record.get('id')!r} has checker {name!r}: not a verifiable prompt "
                         f"(checkers: {', '.join(CHECKERS)}); open-ended prompts need a reward model")
    return CHECKERS[name](record, response)


# --- generators ---------------------------------------------------------------------------------------------------
def _record(task_type: str, index: int, seed: int, prompt: str, domain: str, difficulty: str, checker: str,
            reference: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"verifiable/{task_type}/{seed}/{index:06d}", "prompt": prompt, "task_type": task_type,
            "domain": domain, "difficulty": difficulty, "source": "verifiable", "checker": checker,
            "reference": reference}


def arithmetic_task(rng: random.Random, difficulty: str) -> tuple[str, int]:
    """(expression, value): integers only, floor division stated."""
    if difficulty == "easy":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice("+-")
        return f"{a} {op} {b}", a + b if op == "+" else a - b
    if difficulty == "medium":
        a, b, c = rng.randint(11, 99), rng.randint(3, 30), rng.randint(1, 500)
        return f"{a} * {b} + {c}", a * b + c
    a, b, c, d, e = (rng.randint(11, 99), rng.randint(11, 99), rng.randint(1, 999), rng.randint(2, 9),
                     rng.randint(-50, 50))
    return f"({a} * {b} - {c}) // {d} + ({e})", (a * b - c) // d + e


_WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "orbit", "candle", "harbor",
          "violet", "basket", "meadow", "copper", "falcon", "ginger", "island", "jungle", "kettle", "lantern",
          "marble", "nectar", "pepper", "quartz", "saddle", "timber", "velvet", "walnut", "zephyr")


def _words(rng: random.Random, n: int) -> list[str]:
    return rng.sample(_WORDS, n)


def string_task(rng: random.Random, difficulty: str) -> tuple[str, str, str, bool]:
    """(instruction, answer, checker, casefold)."""
    n = {"easy": 1, "medium": 3, "hard": 5}[difficulty]
    words = _words(rng, n)
    phrase = " ".join(words)
    kind = rng.choice(("reverse", "count", "sort", "upper", "title", "vowels"))
    if kind == "reverse":
        return f"Reverse the characters of the text '{phrase}'.", phrase[::-1], "exact_text", False
    if kind == "count":
        letter = rng.choice(sorted(set(phrase.replace(" ", ""))))
        return (f"How many times does the letter '{letter}' occur in '{phrase}'?", str(phrase.count(letter)),
                "exact_number", False)
    if kind == "sort":
        words = _words(rng, n + 2)
        return (f"Sort these words alphabetically and give them separated by single spaces: {', '.join(words)}.",
                " ".join(sorted(words)), "exact_text", False)
    if kind == "upper":
        return f"Write '{phrase}' in upper case.", phrase.upper(), "exact_text", False
    if kind == "title":
        return f"Capitalize the first letter of every word of '{phrase}'.", phrase.title(), "exact_text", False
    return (f"Remove every vowel (a, e, i, o, u) from '{phrase}' and keep everything else.",
            re.sub(r"[aeiou]", "", phrase), "exact_text", False)


@dataclass(frozen=True)
class CodeTemplate:
    function: str
    difficulty: str
    description: str
    solution: str
    inputs: Callable[[random.Random], tuple[Any, ...]]


CODE_TEMPLATES: tuple[CodeTemplate, ...] = (
    CodeTemplate("sum_of_squares", "easy", "returns the sum of k * k for k from 1 to n (0 when n < 1)",
                 "def sum_of_squares(n):\n    return sum(k * k for k in range(1, n + 1))\n",
                 lambda r: (r.randint(-2, 60),)),
    CodeTemplate("count_vowels", "easy", "returns how many characters of the string s are vowels (aeiou, any case)",
                 "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
                 lambda r: (" ".join(r.sample(_WORDS, 3)).title(),)),
    CodeTemplate("is_palindrome", "easy", "returns True when the string s reads the same backwards, ignoring case "
                 "and non-letters", "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalpha()]\n"
                 "    return t == t[::-1]\n",
                 lambda r: (r.choice(["Level", "Race car", "No lemon, no melon", "stone", "Never odd or even",
                                      "river", "Step on no pets", "maple"]),)),
    CodeTemplate("second_largest", "medium", "returns the second largest distinct value of the list xs, or None "
                 "when it has fewer than two distinct values",
                 "def second_largest(xs):\n    v = sorted(set(xs))\n    return v[-2] if len(v) > 1 else None\n",
                 lambda r: ([r.randint(-9, 9) for _ in range(r.randint(1, 7))],)),
    CodeTemplate("rotate", "medium", "returns the list xs rotated right by k positions (k may exceed the length; "
                 "an empty list stays empty)",
                 "def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n"
                 "    return xs[-k:] + xs[:-k] if k else list(xs)\n",
                 lambda r: ([r.randint(0, 9) for _ in range(r.randint(0, 6))], r.randint(0, 9))),
    CodeTemplate("digit_root", "medium", "returns the repeated digit sum of the non-negative integer n until one "
                 "digit is left", "def digit_root(n):\n    while n >= 10:\n        n = sum(int(d) for d in str(n))\n"
                 "    return n\n", lambda r: (r.randint(0, 10**9),)),
    CodeTemplate("run_lengths", "hard", "returns the run-length encoding of the string s as a list of "
                 "[character, count] pairs, in order",
                 "def run_lengths(s):\n    out = []\n    for c in s:\n        if out and out[-1][0] == c:\n"
                 "            out[-1][1] += 1\n        else:\n            out.append([c, 1])\n    return out\n",
                 lambda r: ("".join(r.choice("aab") for _ in range(r.randint(0, 9))),)),
    CodeTemplate("merge_intervals", "hard", "returns the list of [start, end] intervals merged where they overlap "
                 "or touch, sorted by start",
                 "def merge_intervals(xs):\n    out = []\n    for a, b in sorted(xs):\n"
                 "        if out and a <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], b)\n"
                 "        else:\n            out.append([a, b])\n    return out\n",
                 lambda r: ([sorted((r.randint(0, 20), r.randint(0, 20))) for _ in range(r.randint(0, 5))],)),
)


def _call(fn: str, args: tuple[Any, ...]) -> str:
    return f"{fn}({', '.join(repr(a) for a in args)})"


def code_task(rng: random.Random, difficulty: str, n_tests: int) -> tuple[str, dict[str, Any]]:
    t = rng.choice([t for t in CODE_TEMPLATES if t.difficulty == difficulty])
    ns: dict[str, Any] = {}
    exec(t.solution, ns)  # noqa: S102 -- our own reference solution, computes the expected values
    fn = ns[t.function]
    cases, seen = [], set()
    for _ in range(n_tests * 20):
        args = t.inputs(rng)
        call = _call(t.function, args)
        if call not in seen:
            seen.add(call)
            cases.append((call, fn(*[_copy(a) for a in args])))
        if len(cases) == n_tests + 1:
            break
    example, hidden = cases[0], cases[1:]
    prompt = (f"Write a Python function {t.function} that {t.description}. For example, {example[0]} returns "
              f"{example[1]!r}. {CODE_INSTRUCTION}")
    return prompt, {"function": t.function, "solution": t.solution,
                    "tests": [f"assert {call} == {want!r}" for call, want in hidden]}


def _copy(a: Any) -> Any:
    return [_copy(x) for x in a] if isinstance(a, list) else a


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_ITEMS = ("blue vault", "north gate", "copper locker", "east archive", "silver cabinet", "harbor shed", "red safe")


def planted_fact_prompt(rng: random.Random, passage: str) -> tuple[str, dict[str, Any], str]:
    """(prompt, reference, checker): ``passage`` with "The code of the ITEM is NNNNN." planted at a random sentence
    boundary, and the question for that code (5 digits; ``exact_number``)."""
    item, code = rng.choice(_ITEMS), rng.randint(10_000, 99_999)
    parts = _SENTENCE_END.split(passage)
    at = rng.randint(0, len(parts))
    parts.insert(at, f"The code of the {item} is {code}.")
    passage = " ".join(parts)
    question = f"What is the code of the {item}?"
    return (f"Read the passage and answer the question.\n\nPassage:\n{passage}\n\nQuestion: {question} "
            f"{ANSWER_INSTRUCTION}", {"answer": str(code)}, "exact_number")


def long_retrieval_records(seed: int, n: int, texts: Sequence[tuple[str, str, str]], words: int
                           ) -> list[dict[str, Any]]:
    """Up to ``n`` long-context retrieval records (fewer when the texts run out): consecutive, non-overlapping
    windows of ``words`` words over ``texts`` ((doc_id, domain, text) tuples) joined in their order, each a
    :func:`planted_fact_prompt`. Task type ``retrieval``, difficulty ``long``, ids of their own
    (``verifiable/retrieval-long/...``); ``long_sources`` lists the window's documents. The report's long-context
    SFT data (Table 7's stage II) is not public: these are our stand-in, in the sft pool only (posttrain.prompts)."""
    if words < 1:
        raise ValueError(f"long retrieval windows of {words} words: use 1 or more")
    rng = random.Random(f"{seed}/retrieval-long")
    out: list[dict[str, Any]] = []
    window: list[str] = []
    sources: list[str] = []
    for doc_id, _domain, text in texts:
        ws = text.split()
        at = 0
        while at < len(ws) and len(out) < n:
            take = ws[at:at + words - len(window)]
            window += take
            at += len(take)
            if not sources or sources[-1] != doc_id:
                sources.append(doc_id)
            if len(window) == words:
                prompt, ref, checker = planted_fact_prompt(rng, " ".join(window))
                rec = _record("retrieval", len(out), seed, prompt, "long-context", LONG, checker, ref)
                rec["id"] = f"{LONG_ID_PREFIX}{seed}/{len(out):06d}"
                rec["long_sources"] = sources
                out.append(rec)
                window, sources = [], []
        if len(out) == n:
            break
    return out


def retrieval_task(rng: random.Random, difficulty: str, passage_text: str) -> tuple[str, dict[str, Any], str] | None:
    """(prompt, reference, checker) from a passage of corpus text, or None when the text is too short."""
    words_wanted = {"easy": 60, "medium": 200, "hard": 500}[difficulty]
    words = passage_text.split()
    if len(words) < 30:
        return None
    start = rng.randint(0, max(0, len(words) - words_wanted))
    passage = " ".join(words[start:start + words_wanted])
    if rng.random() < 0.5:  # planted fact at a random sentence boundary
        return planted_fact_prompt(rng, passage)
    pw = passage.split()  # a word right after a 3-word phrase that occurs exactly once in the passage
    order = list(range(len(pw) - 3))
    rng.shuffle(order)
    for i in order:
        phrase = " ".join(pw[i:i + 3])
        nxt = pw[i + 3].strip(".,;:!?\"'()[]{}")
        if nxt.isalpha() and len(nxt) > 1 and passage.count(phrase) == 1 and "'" not in phrase:
            return (f"Read the passage and answer the question.\n\nPassage:\n{passage}\n\nQuestion: which word "
                    f"comes right after the phrase '{phrase}' in the passage? {ANSWER_INSTRUCTION}",
                    {"answer": nxt, "casefold": True}, "exact_text")
    return None


def generate_verifiable(seed: int, counts: dict[str, int], passages: Sequence[tuple[str, str, str]] = (),
                        n_tests: int = 5) -> list[dict[str, Any]]:
    """``counts[task_type]`` records of each type, difficulties cycling easy/medium/hard; deterministic in
    ``seed`` (and the passages: (doc_id, domain, text) tuples, used by retrieval tasks in order of a seeded
    shuffle). Retrieval yields fewer than asked when the passages run out."""
    unknown = set(counts) - set(TASK_TYPES)
    if unknown:
        raise ValueError(f"unknown verifiable task types {sorted(unknown)}; known: {', '.join(TASK_TYPES)}")
    out: list[dict[str, Any]] = []
    for task_type in TASK_TYPES:
        rng = random.Random(f"{seed}/{task_type}")
        n = counts.get(task_type, 0)
        pool = list(passages)
        rng.shuffle(pool)
        k = 0
        for i in range(n):
            difficulty = DIFFICULTIES[i % 3]
            if task_type == "arithmetic":
                expr, value = arithmetic_task(rng, difficulty)
                floor = ", where // is integer division rounding down" if "//" in expr else ""
                out.append(_record(task_type, i, seed, f"Compute {expr}{floor}. {ANSWER_INSTRUCTION}", "math",
                                   difficulty, "exact_number", {"answer": str(value)}))
            elif task_type == "string":
                text, answer, checker, casefold = string_task(rng, difficulty)
                out.append(_record(task_type, i, seed, f"{text} {ANSWER_INSTRUCTION}", "language", difficulty,
                                   checker, {"answer": answer, "casefold": casefold}))
            elif task_type == "code":
                prompt, ref = code_task(rng, difficulty, n_tests)
                out.append(_record(task_type, i, seed, prompt, "programming", difficulty, "python_tests", ref))
            else:
                made = None
                while made is None and k < len(pool):
                    doc_id, domain, text = pool[k]
                    k += 1
                    made = retrieval_task(rng, difficulty, text)
                if made is None:
                    break
                prompt, ref, checker = made
                rec = _record(task_type, i, seed, prompt, "long-context", difficulty, checker, ref)
                rec["passage_source"] = {"id": doc_id, "domain": domain}
                out.append(rec)
    return out
