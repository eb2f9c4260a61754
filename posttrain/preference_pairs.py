"""Preference pairs for reward-model training (report §5.2): (prompt, chosen, rejected) triples, built by the
pipeline from the ``prompts`` stage's pools and read from user JSONL files.

Pairs the pipeline builds (deterministic in the seed; every verifiable pair is checked with the prompt's exact
checker: chosen must be judged correct, rejected incorrect, else the prompt is skipped with a counted reason):

* **verifiable** prompts: chosen = the reference answer written the way the checker reads it (``Answer: <answer>``;
  for code the reference solution in a ```` ```python ```` block). Rejected, one of
  ``wrong_answer`` (the same format with a perturbed value: a number moved by a small delta, a text with two
  characters swapped or a word dropped), ``no_answer`` (a reply that gives no answer) or, for code,
  ``failing_code`` (the reference solution with one mutation — an off-by-one, a flipped comparison, a ``return
  None`` — that fails at least one hidden test in the sandbox). What they teach: ``no_answer`` and ``failing_code``
  carry surface signals a small model can learn; ``wrong_answer`` differs from chosen only in the value, so a reward
  model can rank it only by actually solving the task — a small model will not, and the per-kind accuracy in the
  stage report shows it.
* **corpus** prompts (open-ended): chosen = a real human answer, which the prompt record carries only in two cases:
  a ``response`` field, or a ``continuation`` prompt whose source document is in the optional documents input (the
  document's next ``continuation_words`` words after the excerpt are the real continuation). Other open-ended
  prompts have no real answer and make no pair (counted as ``no_reference_response``). Rejected = a SYNTHETIC
  degradation of chosen: ``shuffled`` (its sentences in a seeded random order: teaches coherence/order),
  ``repeated`` (its opening words looped to the same length: teaches against repetition loops) or ``truncated``
  (cut mid-sentence at 30-60 %: teaches completeness — and is the one kind where "longer wins" is right).
  These pairs teach fluency and form, not helpfulness in the report's sense; §5.2's helpfulness RM is trained on
  human or model-judged comparisons, which the user pair files are for.
* **user** pairs: JSONL, one ``{"prompt": str, "chosen": str, "rejected": str}`` a line (optional ``id``), checked
  with ``file:line`` errors.

Every pair is a user turn + an assistant turn in the tokenizer's chat template (``data.reward_scoring.chat_messages``). Held-out
split: a seeded hash of the pair's group (the prompt's split group from :func:`posttrain.prompts.split_group`, so
the prompts of one code template or one retrieval document are never on both sides; a user pair's prompt text).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from data.documents import iter_documents, unit_hash
from pipeline.user_jsonl import iter_checked_jsonl, jsonl_file_problems
from posttrain.prompts import OPEN_ENDED_TEMPLATES, split_group
from posttrain.verifiable import CHECKERS, check

PAIR_SOURCES = ("verifiable", "corpus", "user")
PAIR_KINDS = ("wrong_answer", "no_answer", "failing_code", "shuffled", "repeated", "truncated", "user")
SPLITS = ("train", "heldout")
NO_ANSWER_REPLY = "I am not able to work this out."


@dataclass(frozen=True)
class PreferencePair:
    id: str
    prompt: str
    chosen: str
    rejected: str
    source: str  # one of PAIR_SOURCES
    kind: str  # how the rejected response was made, one of PAIR_KINDS
    group: str  # split key: pairs of one group are all train or all held out
    split: str = "train"

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# --- verifiable prompts -------------------------------------------------------------------------------------------
def reference_response(record: dict[str, Any]) -> str:
    """The reference answer as a response the record's checker reads (posttrain.verifiable's extraction rules)."""
    ref = record["reference"]
    if record["checker"] == "python_tests":
        return f"```python\n{ref['solution'].rstrip()}\n```"
    return f"Answer: {ref['answer']}"


def _wrong_value(record: dict[str, Any], rng: random.Random) -> str | None:
    answer = str(record["reference"]["answer"])
    if record["checker"] == "exact_number":
        delta = rng.choice((-10, -2, -1, 1, 2, 10))
        return str(Decimal(answer) + delta)
    if len(answer) >= 2:
        chars = list(answer)
        i = rng.randrange(len(chars) - 1)
        chars[i], chars[i + 1] = chars[i + 1], chars[i]  # an adjacent swap (may be a no-op on "aa": checked)
        wrong = "".join(chars)
        if wrong != answer:
            return wrong
    words = answer.split()
    if len(words) >= 2:
        del words[rng.randrange(len(words))]
        return " ".join(words)
    return answer + answer[-1:] if answer else None


_FLIP = {"<=": ">", ">=": "<", "<": ">=", ">": "<="}
_MUTATIONS: tuple[tuple[str, str, str], ...] = (  # (name, pattern, replacement): one substitution each
    ("off_by_one", r" \+ 1\b", ""),
    ("flipped_comparison", r"(?<![<>=!])(<=|>=|<|>)(?!=)", "flip"),
    ("returns_none", r"(\n\s*return )[^\n]+\s*$", r"\1None\n"),
)


def code_mutations(solution: str) -> list[tuple[str, str]]:
    """(name, mutated solution) for each mutation that changes the text."""
    out = []
    for name, pattern, repl in _MUTATIONS:
        if repl == "flip":
            mutated = re.sub(pattern, lambda m: _FLIP[m.group(1)], solution, count=1)
        else:
            mutated = re.sub(pattern, repl, solution, count=1)
        if mutated != solution:
            out.append((name, mutated))
    return out


def verifiable_pair(record: dict[str, Any], seed: int) -> tuple[PreferencePair | None, str]:
    """(pair, '') or (None, why no pair): chosen judged correct and rejected judged incorrect by ``check``."""
    rng = random.Random(f"{seed}/pairs/{record['id']}")
    chosen = reference_response(record)
    if not check(record, chosen).correct:
        return None, "reference_not_correct"
    candidates: list[tuple[str, str]] = []
    if record["checker"] == "python_tests":
        muts = code_mutations(record["reference"]["solution"])
        rng.shuffle(muts)
        candidates = [("failing_code", f"```python\n{m.rstrip()}\n```") for _, m in muts]
    else:
        wrong = _wrong_value(record, rng)
        first = "no_answer" if rng.random() < 1 / 3 else "wrong_answer"
        options = {"no_answer": NO_ANSWER_REPLY, "wrong_answer": None if wrong is None else f"Answer: {wrong}"}
        candidates = [(k, options[k]) for k in (first, *(k for k in options if k != first)) if options[k]]
    for kind, rejected in candidates:
        if not check(record, rejected).correct:
            return PreferencePair(id=f"pair/{record['id']}", prompt=record["prompt"], chosen=chosen,
                                  rejected=rejected, source="verifiable", kind=kind, group=split_group(record)), ""
    return None, "no_wrong_response"


# --- open-ended corpus prompts ------------------------------------------------------------------------------------
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def degrade(text: str, kind: str, rng: random.Random) -> str:
    """A synthetic worse version of ``text`` (see the module docstring for what each kind teaches)."""
    words = text.split()
    if kind == "shuffled":
        parts = _SENTENCE_END.split(text.strip())
        if len(parts) < 3:  # too few sentences: shuffle 5-word chunks instead
            parts = [" ".join(words[i:i + 5]) for i in range(0, len(words), 5)]
        order = list(range(len(parts)))
        while order == sorted(order) and len(parts) > 1:
            rng.shuffle(order)
        return " ".join(parts[i] for i in order)
    if kind == "repeated":
        loop = words[:rng.randint(6, 12)]
        return " ".join((loop * (len(words) // max(1, len(loop)) + 1))[:len(words)])
    if kind == "truncated":
        return " ".join(words[:max(1, int(len(words) * rng.uniform(0.3, 0.6)))]).rstrip(".!?")
    raise ValueError(f"unknown degradation {kind!r}; known: shuffled, repeated, truncated")


def excerpt_of(record: dict[str, Any]) -> str | None:
    """The corpus excerpt inside an open-ended prompt (the text the template put after its instruction)."""
    template = OPEN_ENDED_TEMPLATES.get(record.get("task_type", ""))
    if template is None:
        return None
    head = template.split("{excerpt}")[0]
    return record["prompt"][len(head):] if record["prompt"].startswith(head) else None


def continuations(records: list[dict[str, Any]], documents: Path | None, n_words: int) -> dict[str, str]:
    """Prompt id -> the real text that follows a ``continuation`` prompt's excerpt in its source document."""
    wanted: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("source") == "corpus" and r.get("task_type") == "continuation" and r.get("origin"):
            wanted.setdefault(r["origin"], []).append(r)
    out: dict[str, str] = {}
    if documents is None or not wanted:
        return out
    for doc in iter_documents(documents):
        for r in wanted.get(doc["id"], ()):
            excerpt = (excerpt_of(r) or "").split()
            words = doc["text"].split()
            if not excerpt:
                continue
            for i in (j for j, w in enumerate(words) if w == excerpt[0]):
                if words[i:i + len(excerpt)] == excerpt:
                    follow = words[i + len(excerpt):i + len(excerpt) + n_words]
                    if len(follow) >= 20:  # a real paragraph's worth; shorter tails make no pair
                        out[r["id"]] = " ".join(follow)
                    break
    return out


def corpus_pair(record: dict[str, Any], chosen: str, seed: int) -> PreferencePair:
    rng = random.Random(f"{seed}/pairs/{record['id']}")
    kind = ("shuffled", "repeated", "truncated")[int(unit_hash(seed, "pairs/degrade", record["id"]) * 3)]
    return PreferencePair(id=f"pair/{record['id']}", prompt=record["prompt"], chosen=chosen,
                          rejected=degrade(chosen, kind, rng), source="corpus", kind=kind, group=split_group(record))


# --- user pair files ----------------------------------------------------------------------------------------------
def pair_problem(obj: Any) -> str | None:
    """Why a user JSONL object is not a preference pair, or None."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(obj.get(key), str) or not obj[key].strip():
            return f"needs a non-empty string field {key!r}"
    if "id" in obj and not isinstance(obj["id"], str):
        return "field 'id' must be a string"
    if obj["chosen"] == obj["rejected"]:
        return "'chosen' and 'rejected' are the same text: a pair needs two different responses"
    return None


def iter_pair_file(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, parsed object or None, problem or None) for every non-blank line."""
    return iter_checked_jsonl(path, pair_problem)


def pair_file_problems(paths: Iterable[str], field: str = "user_pair_files") -> list[tuple[str, str]]:
    """(field, 'file:line: problem') for missing files and bad lines (first 5 a file)."""
    return jsonl_file_problems(paths, field, "pair file", pair_problem)


def user_pairs(path: str | Path) -> list[PreferencePair]:
    out = []
    for line_no, obj, problem in iter_pair_file(path):
        if problem:
            raise ValueError(f"{path}:{line_no}: {problem} (expected {{\"prompt\", \"chosen\", \"rejected\"}} strings)")
        out.append(PreferencePair(id=obj.get("id") or f"user/{Path(path).name}/{line_no}", prompt=obj["prompt"],
                                  chosen=obj["chosen"], rejected=obj["rejected"], source="user", kind="user",
                                  group=f"user-prompt/{' '.join(obj['prompt'].split()).casefold()}"))
    return out


# --- all together -------------------------------------------------------------------------------------------------
@dataclass
class PairSet:
    pairs: list[PreferencePair]
    skipped: Counter  # reason -> prompts that made no pair

    def split(self, name: str) -> list[PreferencePair]:
        return [p for p in self.pairs if p.split == name]

    def counts(self) -> dict[str, dict[str, int]]:
        """Pairs by split and source, by split and kind."""
        out: dict[str, dict[str, int]] = {}
        for s in SPLITS:
            rows = self.split(s)
            out[s] = {**{f"source.{k}": n for k, n in sorted(Counter(p.source for p in rows).items())},
                      **{f"kind.{k}": n for k, n in sorted(Counter(p.kind for p in rows).items())}, "total": len(rows)}
        return out


def build_pairs(records: list[dict[str, Any]], *, seed: int, heldout_fraction: float,
                documents: Path | None = None, continuation_words: int = 60,
                user_files: Iterable[str] = (), check_workers: int = 4) -> PairSet:
    """Pairs from prompt ``records`` (each at most once) and user files, with their train/heldout split."""
    skipped: Counter = Counter()
    pairs: list[PreferencePair] = []
    seen: set[str] = set()
    follow = continuations(records, documents, continuation_words)
    unique = []
    for rec in records:
        if rec["id"] not in seen:  # a prompt listed in two pools (dpo is a subset of sft) counts once
            seen.add(rec["id"])
            unique.append(rec)
    # the checks of code responses run in sandbox subprocesses: overlap them (each pair is seeded by its prompt id,
    # so the result does not depend on the order they finish in)
    verifiable = [r for r in unique if r.get("checker") in CHECKERS]
    with ThreadPoolExecutor(max_workers=check_workers) as pool:
        checked = dict(zip((r["id"] for r in verifiable), pool.map(lambda r: verifiable_pair(r, seed), verifiable),
                           strict=True))
    for rec in unique:
        if rec["id"] in checked:
            pair, why = checked[rec["id"]]
        elif isinstance(rec.get("response"), str) and rec["response"].strip():
            pair, why = corpus_pair(rec, rec["response"], seed), ""
        elif rec["id"] in follow:
            pair, why = corpus_pair(rec, follow[rec["id"]], seed), ""
        else:
            pair, why = None, "no_reference_response"
        if pair is None:
            skipped[why] += 1
        else:
            pairs.append(pair)
    for path in user_files:
        pairs.extend(user_pairs(path))
    split = [PreferencePair(**{**asdict(p), "split": "heldout" if unit_hash(seed, "pairs/heldout", p.group)
                                < heldout_fraction else "train"}) for p in pairs]
    return PairSet(split, skipped)
