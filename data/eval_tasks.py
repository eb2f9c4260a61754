"""What the ``eval`` stage asks the model: NIAH prompts, multi-round NIAH dialogues and multiple-choice tasks, all
built from held-out text (documents the checkpoint was not trained on), plus the reader for lm-eval JSONL task
files. No model here: ``evaluation/eval.py`` runs them, ``evaluation/metrics.py`` scores them. It lives in ``data/`` so that
pretraining's in-training probe (``pretrain/probe.py``) builds the same tasks with every import pointing down.

* **Vanilla NIAH** (§4.2, footnote 2): the needle "The special magic {city} number is: {number}." inside a haystack
  of held-out text, at a depth (the share of haystack tokens before it), then the question. Built in token space,
  so a prompt is exactly the requested number of tokens: ``[BOS] haystack[:at] needle haystack[at:] question``.
* **Multi-round NIAH** (§5.7.2, MR-NIAH): a dialogue in the chat template whose assistant turns are held-out text;
  the needles are earlier question/answer rounds at given depths of the history (25/50/75%), and the last round
  asks the model to repeat the numbers it gave. Scored by recall.
* **Multiple choice**: cloze (the last word of a held-out sentence among words from other documents) and
  next-sentence choice (the sentence that follows among sentences of other documents), and lm-eval's JSONL shape
  ``{"query" | "context", "choices", "gold"}``.
* **Diagnostics of retrieval** (why a NIAH accuracy is what it is): distractor numbers for a forced choice between
  the needle's number and numbers the prompt never held, and the copy probe (a random token sequence repeated once:
  how well the second copy is predicted is the induction, or copying, ability that NIAH's answer needs).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.user_jsonl import iter_checked_jsonl

CITIES = (
    "Amsterdam", "Bangkok", "Berlin", "Bogota", "Cairo", "Chicago", "Dakar", "Dublin", "Hanoi", "Havana",
    "Helsinki", "Istanbul", "Jakarta", "Kyoto", "Lagos", "Lima", "Lisbon", "Madrid", "Manila", "Melbourne",
    "Montreal", "Mumbai", "Nairobi", "Oslo", "Paris", "Prague", "Quito", "Santiago", "Seoul", "Sydney",
    "Tehran", "Tokyo", "Toronto", "Tunis", "Vienna", "Warsaw", "Zagreb", "Zurich",
)  # fmt: skip
NEEDLE = "The special magic {city} number is: {number}."
QUESTION = "\n\nWhat is the special magic {city} number? The special magic {city} number is:"
CHAT_QUESTION = "\n\nWhat is the special magic {city} number?"  # niah_chat_prompt: no completion cue in a chat
MR_NEEDLE_REQUEST = "Please give me the special magic number for {city}."
MR_FILLER_REQUESTS = (
    "Write a passage on any topic you like.", "Describe an event in a few paragraphs.",
    "Tell me about something you have read.", "Continue with another passage, please.",
    "Write a few paragraphs in your own words.",
)  # fmt: skip
MR_FINAL_REQUEST = "Earlier in our conversation you told me the special magic numbers for {cities}. Repeat each of them."

Encode = Callable[[str], list[int]]

# numpy SeedSequence ignores trailing zeros: every purpose gets a distinct nonzero tag
_NIAH_TAG, _MR_TAG, _CLOZE_TAG, _NEXT_TAG, _DISTRACTOR_TAG, _COPY_TAG = 11, 12, 13, 14, 15, 16


class TokenStream:
    """Held-out documents' tokens end to end (joined by a separator), read with wrap-around."""

    def __init__(self, tokens: np.ndarray) -> None:
        if tokens.size == 0:
            raise ValueError("the held-out text has no tokens: the eval stage needs held-out documents")
        self.tokens = np.asarray(tokens, np.int64)

    def __len__(self) -> int:
        return int(self.tokens.size)

    def take(self, offset: int, n: int) -> np.ndarray:
        """``n`` tokens from ``offset``; past the end it continues at the start (the text then repeats)."""
        idx = (offset + np.arange(n)) % self.tokens.size
        return self.tokens[idx]


def _rng(seed: int, tag: int) -> np.random.Generator:
    return np.random.default_rng([seed, tag])


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))  # 7 digits


# --- vanilla NIAH -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NiahTrial:
    length: int  # prompt tokens
    depth: float  # share of the haystack before the needle
    city: str
    number: str
    ids: list[int]
    needle_start: int  # index of the needle's first token in ids
    needle_len: int
    haystack_offset: int  # where in the held-out stream the haystack starts


def niah_prompt(stream: TokenStream, offset: int, length: int, depth: float, city: str, number: str,
                encode: Encode, bos_id: int) -> NiahTrial:
    """``[BOS] haystack[:at] needle haystack[at:] question``, exactly ``length`` tokens, ``at = round(depth * H)``
    of the ``H`` haystack tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} is outside [0, 1]")
    needle = encode(" " + NEEDLE.format(city=city, number=number))
    question = encode(QUESTION.format(city=city))
    hay_len = length - 1 - len(needle) - len(question)
    if hay_len < 1:
        raise ValueError(f"a NIAH prompt of {length} tokens has no room for a haystack: the needle and question "
                         f"alone take {len(needle) + len(question) + 1}; use longer context lengths")
    hay = stream.take(offset, hay_len).tolist()
    at = round(depth * hay_len)
    ids = [bos_id, *hay[:at], *needle, *hay[at:], *question]
    return NiahTrial(length, depth, city, number, ids, 1 + at, len(needle), offset)


def niah_chat_prompt(trial: NiahTrial, encode: Encode, decode: Callable[[list[int]], str],
                     render: Callable[[list[dict[str, str]]], str]) -> list[int]:
    """The trial as one user turn of a chat: its haystack and needle (the plain prompt's tokens without the BOS and
    the question, decoded) and :data:`CHAT_QUESTION`, rendered by ``render`` (the chat template with the assistant's
    turn opened) and encoded. The format a post-trained checkpoint was trained to answer in; the plain prompt's
    completion cue would be out of place there. Its length is the plain prompt's less the BOS and the cue's tokens
    (``CHAT_QUESTION`` is the shorter question) plus the template's, up to the few tokens that decoding and
    re-encoding the haystack can merge or split."""
    question = encode(QUESTION.format(city=trial.city))
    body = decode(trial.ids[1:len(trial.ids) - len(question)])
    return encode(render([{"role": "user", "content": body + CHAT_QUESTION.format(city=trial.city)}]))


def build_niah_trials(stream: TokenStream, encode: Encode, bos_id: int, lengths: Sequence[int],
                      depths: Sequence[float], trials: int, seed: int) -> list[NiahTrial]:
    """``trials`` prompts per (length, depth) cell, each with its own city, number and haystack offset."""
    rng = _rng(seed, _NIAH_TAG)
    out = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                city = CITIES[int(rng.integers(len(CITIES)))]
                out.append(niah_prompt(stream, int(rng.integers(len(stream))), length, depth, city, _number(rng),
                                       encode, bos_id))
    return out


def niah_distractors(trials: Sequence[NiahTrial], n: int, seed: int) -> list[list[str]]:
    """``n`` numbers per trial, drawn like needles' numbers (7 digits), none equal to the trial's number or to each
    other: the wrong answers of a forced choice. Their own random stream, so adding them changes no trial."""
    rng = _rng(seed, _DISTRACTOR_TAG)
    out = []
    for t in trials:
        picked: list[str] = []
        while len(picked) < n:
            x = _number(rng)
            if x != t.number and x not in picked:
                picked.append(x)
        out.append(picked)
    return out


# --- the copy probe -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CopyTrial:
    """``[BOS] R R``: ``R`` is ``n`` token ids drawn uniformly (with replacement) from the ordinary vocabulary."""

    ids: list[int]
    n: int

    def first_copy_targets(self) -> range:
        """Positions (in ``ids``) of the first copy's tokens after its first: text never seen, so the model can only
        guess (uniform random ids have no language to model)."""
        return range(2, 1 + self.n)

    def second_copy_targets(self) -> range:
        """Positions of the second copy's tokens after its first: each one is the token that followed the previous
        one in the first copy, which an induction (copying) mechanism predicts."""
        return range(self.n + 2, 1 + 2 * self.n)


def held_out_token_pool(tokens: np.ndarray, ordinary: Sequence[int]) -> list[int]:
    """The copy probe's ``copy_pool="seen"``: the distinct ``ordinary`` ids that occur in the held-out ``tokens``
    (tokens a model trained on the corpus has met; on a small corpus many of a large vocabulary's never are)."""
    return np.intersect1d(np.unique(np.asarray(tokens, np.int64)), np.asarray(ordinary, np.int64)).tolist()


def build_copy_trials(vocab: Sequence[int], bos_id: int, trials: int, n: int, seed: int) -> list[CopyTrial]:
    """``trials`` probes of ``n`` random tokens each, drawn from ``vocab`` (the ids that are not special tokens)."""
    if n < 4:
        raise ValueError(f"copy probe: {n} tokens per copy is too few (at least 4)")
    if len(vocab) < 2:
        raise ValueError("copy probe: the vocabulary has fewer than two ordinary tokens")
    rng = _rng(seed, _COPY_TAG)
    pool = np.asarray(vocab, np.int64)
    out = []
    for _ in range(trials):
        r = pool[rng.integers(len(pool), size=n)].tolist()
        out.append(CopyTrial([bos_id, *r, *r], n))
    return out


# --- multi-round NIAH ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MultiRoundTrial:
    length: int  # target prompt tokens
    ids: list[int]  # the rendered dialogue up to the assistant's answer, tokenized
    cities: list[str]
    numbers: list[str]
    depths: list[float]  # depth of each needle round in the history
    needle_rounds: list[int]
    rounds: int  # history rounds before the final question


def _dialogue(fillers: Sequence[str], needles: Sequence[int], cities: Sequence[str],
              numbers: Sequence[str], rounds: int) -> list[dict[str, str]]:
    messages, k = [], 0
    for r in range(rounds):
        if r in needles:
            i = needles.index(r)
            messages += [{"role": "user", "content": MR_NEEDLE_REQUEST.format(city=cities[i])},
                         {"role": "assistant", "content": NEEDLE.format(city=cities[i], number=numbers[i])}]
        else:
            messages += [{"role": "user", "content": MR_FILLER_REQUESTS[k % len(MR_FILLER_REQUESTS)]},
                         {"role": "assistant", "content": fillers[k]}]
            k += 1
    listed = ", ".join(cities[:-1]) + (" and " if len(cities) > 1 else "") + cities[-1]
    return messages + [{"role": "user", "content": MR_FINAL_REQUEST.format(cities=listed)}]


def needle_rounds(rounds: int, depths: Sequence[float]) -> list[int]:
    """History round of each needle: ``floor(depth * rounds)`` (the last round for depth 1); distinct, and at least one
    round left for filler text."""
    at = [min(int(d * rounds), rounds - 1) for d in depths]
    if len(set(at)) != len(at) or rounds - len(at) < 1:
        raise ValueError(f"multi-round NIAH: {rounds} rounds cannot hold needles at depths {list(depths)} in distinct "
                         "rounds plus a filler round; give more rounds (shorter mr_niah_round_tokens)")
    return at


def build_multi_round_trial(stream: TokenStream, encode: Encode, decode: Callable[[list[int]], str],
                            render: Callable[[list[dict[str, str]]], str], length: int, rounds: int,
                            depths: Sequence[float], rng: np.random.Generator) -> MultiRoundTrial:
    """A dialogue of ``rounds`` history rounds (+ the final question) rendered by ``render`` (the chat template with
    the generation prompt) to about ``length`` tokens: the filler answers share what the template, the requests and
    the needles leave, as consecutive pieces of held-out text. Needle ``i`` is round ``needle_rounds(...)[i]``."""
    needles = needle_rounds(rounds, depths)
    picked = rng.choice(len(CITIES), size=len(depths), replace=False)
    cities = [CITIES[int(i)] for i in picked]
    numbers = [_number(rng) for _ in depths]
    n_fill = rounds - len(needles)
    overhead = len(encode(render(_dialogue([""] * n_fill, needles, cities, numbers, rounds))))
    budget = length - overhead
    if budget < n_fill:
        raise ValueError(f"multi-round NIAH: {rounds} rounds need {overhead} tokens without any filler text, more "
                         f"than the context length {length}; use fewer rounds (longer mr_niah_round_tokens) or "
                         "longer contexts")
    offset = int(rng.integers(len(stream)))
    sizes = [budget // n_fill + (1 if i < budget % n_fill else 0) for i in range(n_fill)]
    ids: list[int] = []
    for _ in range(4):  # decode -> encode can merge across a piece's ends: correct the last piece, re-render
        starts = np.cumsum([0, *sizes[:-1]])
        fillers = [decode(stream.take(offset + int(s), n).tolist()).strip() for s, n in zip(starts, sizes, strict=True)]
        ids = encode(render(_dialogue(fillers, needles, cities, numbers, rounds)))
        if len(ids) == length or sizes[-1] + length - len(ids) < 1:
            break
        sizes[-1] += length - len(ids)
    return MultiRoundTrial(length, ids, cities, numbers, list(depths), needles, rounds)


# --- multiple choice ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MCItem:
    context: str
    choices: list[str]
    gold: int
    source: str = ""  # where it came from (document id, file:line)

    def continuation(self, i: int) -> str:
        """Choice ``i`` as scored after the context: lm-eval's target delimiter " " unless the context ends in
        whitespace (or is empty)."""
        sep = "" if not self.context or self.context[-1].isspace() else " "
        return sep + self.choices[i]


@dataclass
class MCTask:
    name: str
    items: list[MCItem] = field(default_factory=list)


# sentences: a capital start, no line break inside, 20-300 characters, ending in . ! or ? before whitespace/the end
_SENTENCE = re.compile(r"[A-Z][^\n.!?]{18,298}[.!?](?=\s|$)")
_LAST_WORD = re.compile(r"^(.*\S)\s+([A-Za-z][a-z]{2,})[.!?]$")


def _sentences(text: str) -> list[tuple[int, int]]:
    spans = []
    for m in _SENTENCE.finditer(text):
        s = m.group(0)
        letters = sum(ch.isalpha() or ch == " " for ch in s)
        if len(s.split()) >= 5 and letters >= 0.85 * len(s):
            spans.append(m.span())
    return spans


def _left_context(text: str, end: int, chars: int) -> str:
    """Up to ``chars`` characters of ``text`` before ``end``, starting at a word boundary."""
    start = max(0, end - chars)
    piece = text[start:end]
    if start > 0 and not text[start - 1].isspace():
        cut = re.search(r"\s", piece)
        piece = piece[cut.end():] if cut else ""
    return piece.lstrip()


def _assemble(name: str, candidates: list[tuple[str, str, str, int]], pool: list[tuple[str, int]], n: int,
              n_choices: int, rng: np.random.Generator) -> MCTask:
    """Items from (context, gold, source, doc) candidates, distractors drawn from ``pool`` (text, doc) entries of other
    documents, distinct from the gold and from each other (case-insensitively); gold at a random position."""
    task = MCTask(name)
    for cand in (candidates[int(i)] for i in rng.permutation(len(candidates))):
        if len(task.items) == n:
            break
        context, gold, source, doc = cand
        seen, distractors = {gold.lower()}, []
        for j in rng.permutation(len(pool)):
            text, other = pool[int(j)]
            if other != doc and text.lower() not in seen:
                seen.add(text.lower())
                distractors.append(text)
                if len(distractors) == n_choices - 1:
                    break
        if len(distractors) < n_choices - 1:
            continue
        at = int(rng.integers(n_choices))
        task.items.append(MCItem(context, [*distractors[:at], gold, *distractors[at:]], at, source))
    return task


def build_cloze_task(docs: Sequence[tuple[str, str]], n: int, n_choices: int, context_chars: int,
                     seed: int) -> MCTask:
    """Cloze over held-out ``(id, text)`` documents: the context is the text before a sentence's last word, the
    choices that word and words that end sentences of other documents."""
    candidates, pool = [], []
    for d, (doc_id, text) in enumerate(docs):
        for start, end in _sentences(text):
            m = _LAST_WORD.match(text[start:end])
            if m:
                context = _left_context(text, start, context_chars - len(m.group(1)) - 1)
                context = (context + " " if context else "") + m.group(1)
                candidates.append((context, m.group(2), doc_id, d))
                pool.append((m.group(2), d))
    return _assemble("cloze", candidates, pool, n, n_choices, _rng(seed, _CLOZE_TAG))


def build_next_sentence_task(docs: Sequence[tuple[str, str]], n: int, n_choices: int, context_chars: int,
                             seed: int) -> MCTask:
    """Next-sentence choice over held-out ``(id, text)`` documents: the context ends with a sentence, the choices are
    the sentence that follows it (only whitespace between them) and sentences of other documents."""
    candidates, pool = [], []
    for d, (doc_id, text) in enumerate(docs):
        spans = _sentences(text)
        pool += [(text[s:e], d) for s, e in spans]
        for (_, e0), (s1, e1) in zip(spans, spans[1:], strict=False):
            if not text[e0:s1].strip():
                candidates.append((_left_context(text, e0, context_chars), text[s1:e1], doc_id, d))
    return _assemble("next_sentence", candidates, pool, n, n_choices, _rng(seed, _NEXT_TAG))


# --- lm-eval JSONL task files -------------------------------------------------------------------------------------
def task_name(path: str | Path) -> str:
    """A task file's name: its file name without .jsonl / .jsonl.gz / .json."""
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _parse_item(obj: object, where: str) -> MCItem | str:
    """The item a line holds, or why it is not one."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    keys = [k for k in ("query", "context") if k in obj]
    if not keys:
        return ("no 'query' or 'context' field (lm-eval's multiple-choice shape is "
                '{"query": ..., "choices": [...], "gold": index}); it has ' + ", ".join(map(repr, obj)))
    context = obj[keys[0]]
    if not isinstance(context, str):
        return f"{keys[0]!r} must be a string, got {type(context).__name__}"
    choices = obj.get("choices")
    if isinstance(choices, dict):  # HF datasets shape: {"text": [...], "label": [...]}
        choices = choices.get("text")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        return (f"'choices' must be a list of at least 2 non-empty strings (or {{\"text\": [...]}}), "
                f"got {obj.get('choices')!r:.200}")
    gold = obj.get("gold")
    if isinstance(gold, str) and gold in choices:
        gold = choices.index(gold)
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        return f"'gold' must be the index of the right choice, 0..{len(choices) - 1} (or its text), got {obj.get('gold')!r:.200}"
    return MCItem(context, list(choices), gold, where)


def lm_eval_item_problem(obj: object) -> str | None:
    """Why a parsed line of a task file is not a multiple-choice item, or None (for spec validation)."""
    item = _parse_item(obj, "")
    return item if isinstance(item, str) else None


def read_lm_eval_jsonl(path: str | Path) -> MCTask:
    """A multiple-choice task file in lm-eval's JSONL shape (``.jsonl`` or ``.jsonl.gz``), one item a line; blank
    lines are skipped. A bad line (or a damaged file) raises ValueError naming the file and line."""
    path = Path(path)
    task = MCTask(task_name(path))
    for line_no, obj, problem in iter_checked_jsonl(path, lm_eval_item_problem):
        if problem:
            raise ValueError(f"{path}:{line_no}: {problem}")
        item = _parse_item(obj, f"{path}:{line_no}")
        assert isinstance(item, MCItem)  # lm_eval_item_problem passed it
        task.items.append(item)
    if not task.items:
        raise ValueError(f"{path}: no items (one JSON object per line expected)")
    return task
