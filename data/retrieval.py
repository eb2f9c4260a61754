"""Retrieval-bearing training samples made from corpus text: the answer to a late query is a span to copy from far back.

Why (issue 22; our departure from §4, whose data is not public): trained on natural text alone, a small model forms
no copying mechanism in the few million tokens a one-GPU run sees (BENCHMARKS.md: NIAH 0 and copy accuracy 0.000 for
every ablation variant after 6M tokens), while the same architecture learns to copy within a few hundred steps once
the data asks for it. These samples ask for it: each one is natural text (the ``context``: held-in corpus tokens)
with something planted or chosen in it, and a query at the end whose answer is a verbatim copy of a far-back span.
Training targets (``no_loss`` False) are the context (natural text, modelled like any document) and the answer;
the planted passages and records, the query and its cue are not (they cannot be predicted where they first appear,
and which one a query names cannot be known before it does). ``answer`` marks the answer alone.

Kinds (:data:`KINDS`), all built in token space so a sample is exactly the asked number of tokens:

* ``repeat``: a passage (up to a third of the sample) is marked ``«…»`` where it stands in the context; at the end
  it is asked for again ("The marked passage again: «") and the whole passage is the answer.
* ``continue``: a span stands unmarked in the context; at the end its first few tokens are quoted and the 8 to 32
  tokens that followed them are the answer (a question about a passage whose answer is a verbatim span).
* ``lookup``: many ``(ref KEY = VALUE)`` records planted at word boundaries through the context; one is queried
  at the end (``ref KEY =``), its VALUE is the answer (key-to-value lookup over many pairs).
* ``multi_lookup``: the same with two to eight records queried in turn (several needles at once).
* ``fact``: one to four sentences stating a value (``Tamiro's badge is 40712.``, three phrasings) planted at word
  boundaries through the context; at the end a question in words about one of them (three phrasings, e.g.
  ``Question: What is Tamiro's badge?`` ``Answer:``), its value the answer. Not in the default kinds.
  Why (issue 33, the thirteenth lease): after long_context the hybrid ranks the NIAH needle's number far above
  other numbers in every trial it misses, and still answers with text: ``lookup``'s records and queries are
  syntax (``ref KEY =``), and nothing taught it to answer a question in words at a cue in running text. The
  phrasings share no three-word phrase with the eval's (a test checks), the names are syllables, never a city,
  and no template says "number".

Besides the kinds, :func:`copy_sample` makes the pretrain stage's **copy curriculum** rows (``copy_share``,
``pretrain/retrieval_rows.py``): a span of token ids drawn uniformly from the ordinary vocabulary, a marker, the
same span again, the loss on the repeat alone. No corpus text: it is the plainest copying task, the one measured to
cross the phase change at ``gpu-300m`` with the 32K vocabulary (issue 33), and the curriculum puts it first.

The passages and spans are corpus words in a random order (``_scrambled``), not runs of corpus text: the run's
corpus is small and read several times, so a model memorises it, and a memorised passage's continuation can be
recalled without looking back (the first GPU run with verbatim corpus passages learned no copying: BENCHMARKS.md).
Only copying reproduces a random order of words.

Keys are made of syllables (``tovu-remi``), values are digit strings or lower-case codes of varying length.
**Nothing here uses the eval stage's templates** (``data/eval_tasks.py``: the "special magic {city} number"
needle and question, the multi-round NIAH dialogue): the eval measures transfer of the copying mechanism, not a
memorised format. ``tests/test_retrieval_data.py`` checks the formats are disjoint. The eval's city list is read
only to keep it out of the fact kind's names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from data import eval_tasks

DEFAULT_KINDS = ("repeat", "continue", "lookup", "multi_lookup")  # the params' default: what earlier runs used
KINDS = (*DEFAULT_KINDS, "fact")
TOKEN_DTYPE = np.dtype("<i4")

# The text of every template (tests check none shares a format with the eval stage's)
REPEAT_OPEN = " «"
REPEAT_CLOSE = "»"
REPEAT_QUERY = "\n\nThe marked passage again: «"
CONTINUE_QUERY = "\n\nIn the text above, what follows \""
CONTINUE_ANSWER = "\"? It reads: \""
CONTINUE_CLOSE = "\""
RECORD = " (ref {key} = {value})"
RECORD_QUERY = "\nref {key} ="
RECORD_ANSWER = " {value})"
QUERIES_OPEN = "\n\nLook-ups:"
COPY_MARK = "\n\nSame again:\n"
# fact: a statement planted in the text, a question in words at the end; each split at its value ("{value}")
FACT_STATEMENTS = (" {name}'s {thing} is {value}.", " The {thing} of {name} is {value}.",
                   " {name} was given {thing} {value}.")
FACT_QUESTIONS = ("\n\nQuestion: What is {name}'s {thing}?\nAnswer:", "\n\nWhich {thing} does {name} have? It is",
                  "\n\nLooking back, {name}'s {thing} was")
FACT_CLOSE = "."
FACT_THINGS = ("badge", "locker", "ticket", "serial", "pin", "room", "account", "order", "seat", "permit")
TEMPLATES = (REPEAT_OPEN, REPEAT_CLOSE, REPEAT_QUERY, CONTINUE_QUERY, CONTINUE_ANSWER, CONTINUE_CLOSE, RECORD,
             RECORD_QUERY, RECORD_ANSWER, QUERIES_OPEN, COPY_MARK, *FACT_STATEMENTS, *FACT_QUESTIONS, FACT_CLOSE)

_EVAL_CITIES = frozenset(eval_tasks.CITIES)  # a fact's name is never one (make_name)
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
_CODE_CHARS = "abcdefghjkmnpqrstuvwxyz23456789"
MIN_SAMPLE_TOKENS = 96  # below this a sample has no room for its context and query


@dataclass(frozen=True)
class RetrievalSample:
    """``tokens`` int32 ``[BOS] ... [EOS]``; ``no_loss`` bool (True where the label does not count: BOS, the
    planted records, the query and its cue, and the closing EOS when the maker's ``answer_eos`` is off); ``answer``
    bool (the answer's tokens, and the EOS after them when ``answer_eos`` is on)."""

    tokens: np.ndarray
    no_loss: np.ndarray
    answer: np.ndarray
    kind: str
    meta: dict[str, Any]

    @property
    def answer_tokens(self) -> int:
        return int(self.answer.sum())


COPY_DRAWS = ("uniform", "unigram")  # how a copy curriculum draws its span ids (pretrain copy_draw)


def copy_sample(pool: np.ndarray, length: int, rng: np.random.Generator, *, bos: int, eos: int,
                mark: np.ndarray, weights: np.ndarray | None = None, gap: int = 0) -> RetrievalSample:
    """``[BOS] (x) R G MARK R [EOS]`` of exactly ``length`` tokens: ``R`` token ids drawn (with replacement) from
    ``pool``, uniformly or with probabilities ``weights`` (one per pool id, summing to 1), as long as the length
    allows (``x``: one more drawn id where the length is odd, not a target). ``G``: ``gap`` more ids drawn the same
    way between the span and the marker (none by default), so the repeat looks ``gap`` positions farther back.
    Targets (``no_loss`` False) are the second ``R`` alone, which is also what ``answer`` marks. The first ``R``, the
    gap and the marker cannot be predicted. The EOS is not a target either: where it comes can only be counted, and
    a model that copies predicts the marker there (what followed the span's last id; with a gap, the gap's first
    id), so its loss works against copying. On the CPU, with it a target, a
    toy learnt nothing from spans of 4-16 ids in 900 steps; without it, it copied 0.8 of them by step 300
    (BENCHMARKS.md, "The whole spec in one lease")."""
    mark = np.asarray(mark, TOKEN_DTYPE)
    if gap < 0:
        raise ValueError(f"a copy sample's gap is {gap} ids: use 0 or more")
    span, odd = divmod(length - 2 - mark.size - gap, 2)
    if span < 1:
        raise ValueError(f"a copy sample of {length} tokens has no room for its span (the marker is {mark.size}, "
                         f"the gap {gap})")
    pool = np.asarray(pool, TOKEN_DTYPE)
    if pool.size < 2:
        raise ValueError(f"copy samples need a pool of at least 2 token ids, got {pool.size}")
    n = span + odd + gap
    r = pool[rng.integers(pool.size, size=n) if weights is None else rng.choice(pool.size, size=n, p=weights)]
    lead, span_ids, gap_ids = r[:odd], r[odd:odd + span], r[odd + span:]
    tokens = np.concatenate([[bos], lead, span_ids, gap_ids, mark, span_ids, [eos]]).astype(TOKEN_DTYPE)
    answer = np.zeros(length, bool)
    answer[length - 1 - span:length - 1] = True
    return RetrievalSample(tokens, ~answer, answer, "copy", {"span_tokens": int(span), "gap_tokens": int(gap)})


def make_key(rng: np.random.Generator) -> str:
    """Two groups of two or three syllables: ``tovu-remi``."""
    n1, n2 = (int(x) for x in rng.integers(2, 4, size=2))
    syl = [_SYLLABLES[int(i)] for i in rng.integers(len(_SYLLABLES), size=n1 + n2)]
    return "".join(syl[:n1]) + "-" + "".join(syl[n1:])


def make_name(rng: np.random.Generator) -> str:
    """A capitalised name of two or three syllables (``Tamiro``), never one of the eval's NIAH cities (``Lima``,
    ``Manila`` and ``Bogota`` are spelt with these syllables)."""
    while True:
        syl = [_SYLLABLES[int(i)] for i in rng.integers(len(_SYLLABLES), size=int(rng.integers(2, 4)))]
        name = "".join(syl).capitalize()
        if name not in _EVAL_CITIES:
            return name


def make_value(rng: np.random.Generator) -> str:
    """Half digit strings of 3 to 9 digits (no leading zero), half lower-case codes of 4 to 8 characters."""
    digits, n = rng.random() < 0.5, int(rng.integers(3, 10))
    if digits:
        d = rng.integers(10, size=n)
        d[0] = 1 + d[0] % 9
        return "".join(map(str, d.tolist()))
    return "".join(_CODE_CHARS[int(i)] for i in rng.integers(len(_CODE_CHARS), size=max(4, n - 1)))


def word_starts(tokenizer: Any) -> np.ndarray:
    """bool [vocab]: tokens that begin with whitespace (byte-level BPE's Ġ, Ċ, ĉ); planting before one never
    splits a word."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    starts = np.zeros(vocab, bool)
    for token, i in tokenizer.get_vocab(with_added_tokens=False).items():
        starts[i] = token[:1] in ("Ġ", "Ċ", "ĉ")
    return starts


class RetrievalMaker:
    """Makes :class:`RetrievalSample` s of an exact length from context tokens (corpus text without special tokens).

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (the pipeline's byte-level BPE); ``bos``/``eos`` its special ids.
    ``answer_eos``: whether the EOS that ends each sample (right after its answer) is a target counted with the
    answer (True) or stays in the sample as a token no loss is taken on (False). A model that copies the answer
    would predict what followed it in the context there; on the CPU an EOS target after short copied spans kept a
    toy from learning to copy at all (BENCHMARKS.md, the fourth and eighth leases).
    """

    def __init__(self, tokenizer: Any, *, bos: int, eos: int, answer_eos: bool = True) -> None:
        self.tokenizer, self.bos, self.eos = tokenizer, int(bos), int(eos)
        self.answer_eos = bool(answer_eos)
        self.word_start = word_starts(tokenizer)
        self._cache: dict[str, np.ndarray] = {}
        self.makers: dict[str, Callable[[np.ndarray, int, np.random.Generator], RetrievalSample]] = {
            "repeat": self._repeat, "continue": self._continue, "lookup": self._lookup,
            "multi_lookup": self._multi_lookup, "fact": self._fact}

    def encode(self, text: str) -> np.ndarray:
        ids = self._cache.get(text)
        if ids is None:
            ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, TOKEN_DTYPE)
            if len(self._cache) < 4096:
                self._cache[text] = ids
        return ids

    def make(self, kind: str, context: np.ndarray, length: int, rng: np.random.Generator) -> RetrievalSample:
        """A ``kind`` sample of exactly ``length`` tokens; ``context`` must hold at least ``length`` tokens."""
        if kind not in self.makers:
            raise ValueError(f"unknown retrieval kind {kind!r}: expected one of {', '.join(KINDS)}")
        if length < MIN_SAMPLE_TOKENS:
            raise ValueError(f"a retrieval sample needs at least {MIN_SAMPLE_TOKENS} tokens, asked {length}")
        context = np.asarray(context, TOKEN_DTYPE)
        if context.size < length:
            raise ValueError(f"a {length}-token retrieval sample needs {length} context tokens, got {context.size}")
        sample = self.makers[kind](context, length, rng)
        if sample.tokens.size != length or sample.no_loss.shape != sample.tokens.shape:
            raise RuntimeError(f"{kind}: made {sample.tokens.size} tokens, not {length} (a bug in data/retrieval.py)")
        return sample

    # --- helpers -------------------------------------------------------------------------------------------------
    def _boundary(self, ctx: np.ndarray, at: int) -> int:
        """The word boundary of ``ctx`` nearest ``at`` (the start and the end count as boundaries)."""
        b = np.flatnonzero(self.word_start[ctx])
        b = np.concatenate([[0], b, [ctx.size]])
        return int(b[np.argmin(np.abs(b - at))])

    def _assemble(self, parts: Sequence[tuple[np.ndarray, str]], kind: str, meta: dict[str, Any]) -> RetrievalSample:
        """``[BOS] parts... [EOS]``; each part is ``"text"`` (context: a target), ``"answer"`` (a target, counted
        as answer) or ``"prompt"`` (not a target: planted records, query, cue, markers). The EOS ends the answer:
        an answer target, or with ``answer_eos`` off no target."""
        toks = [np.asarray([self.bos], TOKEN_DTYPE)]
        role = ["prompt"]
        for ids, r in parts:
            toks.append(np.asarray(ids, TOKEN_DTYPE))
            role += [r] * len(ids)
        toks.append(np.asarray([self.eos], TOKEN_DTYPE))
        role.append("answer" if self.answer_eos else "prompt")
        roles = np.asarray(role)
        return RetrievalSample(np.concatenate(toks), roles == "prompt", roles == "answer", kind, meta)

    # --- the kinds -----------------------------------------------------------------------------------------------
    def _scrambled(self, source: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` tokens of whole words drawn at random from ``source``, in random order: corpus words whose
        sequence no amount of memorising the corpus predicts, so only copying reproduces it."""
        starts = np.flatnonzero(self.word_start[source])
        if starts.size < 2:
            return source[:n].copy()
        ends = np.append(starts[1:], source.size)
        picked: list[np.ndarray] = []
        have = 0
        while have < n:
            k = rng.integers(starts.size, size=max(8, (n - have) // 2))
            for s, e in zip(starts[k].tolist(), ends[k].tolist(), strict=True):
                picked.append(source[s:min(e, s + 8)])
                have += picked[-1].size
                if have >= n:
                    break
        return np.concatenate(picked)[:n]

    def _repeat(self, context: np.ndarray, length: int, rng: np.random.Generator) -> RetrievalSample:
        opener, closer, query = self.encode(REPEAT_OPEN), self.encode(REPEAT_CLOSE), self.encode(REPEAT_QUERY)
        fixed = 2 + opener.size + 2 * closer.size + query.size
        top = max(9, (length - fixed) // 3)
        n = int(rng.integers(8, top))  # passage tokens: up to a third of the sample
        room = length - fixed - 2 * n  # context tokens around the marked passage
        if room < 1:
            raise ValueError(f"repeat: {length} tokens leave no room for the context")
        ctx = context[:room]
        start = self._boundary(ctx, int(rng.integers(0, room + 1)))
        passage = self._scrambled(context, n, rng)
        parts = [(ctx[:start], "text"), (opener, "prompt"), (passage, "prompt"), (closer, "prompt"),
                 (ctx[start:], "text"), (query, "prompt"), (passage, "answer"), (closer, "answer")]
        return self._assemble(parts, "repeat", {"passage_tokens": n, "depth": round(start / max(room, 1), 4)})

    def _continue(self, context: np.ndarray, length: int, rng: np.random.Generator) -> RetrievalSample:
        q, a, close = self.encode(CONTINUE_QUERY), self.encode(CONTINUE_ANSWER), self.encode(CONTINUE_CLOSE)
        avail = length - 2 - q.size - a.size - close.size
        cue_n = int(rng.integers(4, 9))
        ans_n = int(rng.integers(min(8, avail // 5), max(min(8, avail // 5) + 1, min(33, avail // 3 - cue_n))))
        span_n = cue_n + ans_n + int(rng.integers(0, 17))  # the planted span runs on past the answer
        room = avail - cue_n - ans_n - span_n
        if room < 1:
            raise ValueError(f"continue: {length} tokens leave no room for the context")
        ctx = context[:room]
        start = self._boundary(ctx, int(rng.integers(0, room + 1)))
        span = self._scrambled(context, span_n, rng)
        cue, answer = span[:cue_n], span[cue_n:cue_n + ans_n]
        parts = [(ctx[:start], "text"), (span, "prompt"), (ctx[start:], "text"), (q, "prompt"), (cue, "prompt"),
                 (a, "prompt"), (answer, "answer"), (close, "answer")]
        return self._assemble(parts, "continue", {"cue_tokens": cue_n, "answer_tokens": ans_n,
                                                  "depth": round(start / max(room, 1), 4)})

    def _records(self, context: np.ndarray, length: int, rng: np.random.Generator, queries: int,
                 kind: str) -> RetrievalSample:
        # up to 32 records, about as many as fit in a quarter of the sample (a record is ~12 tokens)
        records = min(int(rng.integers(max(queries, 4), 33)), max(queries, length // 48))
        pairs: list[tuple[str, str]] = []
        keys: set[str] = set()
        while len(pairs) < records:
            key = make_key(rng)
            if key not in keys:
                keys.add(key)
                pairs.append((key, make_value(rng)))
        planted = [np.asarray(e.ids, TOKEN_DTYPE) for e in self.tokenizer.encode_batch(
            [RECORD.format(key=k, value=v) for k, v in pairs], add_special_tokens=False)]
        asked = [int(i) for i in rng.choice(records, size=queries, replace=False)]
        head = self.encode(QUERIES_OPEN)
        q_parts = []
        for i in asked:
            k, v = pairs[i]
            q_parts += [(self.encode(RECORD_QUERY.format(key=k)), "prompt"),
                        (self.encode(RECORD_ANSWER.format(value=v)), "answer")]
        fixed = 2 + head.size + sum(len(p) for p, _ in q_parts)
        # as many records as the length allows (at least the queried ones), leaving half the sample to context
        while records > queries and sum(p.size for p in planted) > (length - fixed) // 2:
            drop = next(j for j in range(records - 1, -1, -1) if j not in asked)
            del planted[drop], pairs[drop]
            asked = [i - (i > drop) for i in asked]
            records -= 1
        room = length - fixed - sum(p.size for p in planted)
        if room < 1:
            if queries > 1:  # a short sample with long spellings (a small vocabulary): ask fewer
                return self._records(context, length, rng, queries - 1, kind)
            raise ValueError(f"{kind}: {length} tokens leave no room for the context")
        ctx = context[:room]
        at = sorted(self._boundary(ctx, int(x)) for x in rng.integers(0, room + 1, size=records))
        order = rng.permutation(records)  # which record goes to which position
        parts: list[tuple[np.ndarray, str]] = []
        prev = 0
        for pos, j in zip(at, order, strict=True):
            parts += [(ctx[prev:pos], "text"), (planted[j], "prompt")]
            prev = pos
        parts += [(ctx[prev:], "text"), (head, "prompt"), *q_parts]
        depth = {pairs[int(j)][0]: round(pos / max(room, 1), 4) for pos, j in zip(at, order, strict=True)}
        return self._assemble(parts, kind, {"records": records, "queries": queries,
                                            "depths": [depth[pairs[i][0]] for i in asked]})

    def _lookup(self, context: np.ndarray, length: int, rng: np.random.Generator) -> RetrievalSample:
        return self._records(context, length, rng, 1, "lookup")

    def _multi_lookup(self, context: np.ndarray, length: int, rng: np.random.Generator) -> RetrievalSample:
        queries = min(int(rng.integers(2, 9)), max(2, length // 160))  # short samples: fewer queries
        return self._records(context, length, rng, queries, "multi_lookup")

    def _fact(self, context: np.ndarray, length: int, rng: np.random.Generator) -> RetrievalSample:
        facts = int(rng.integers(1, 5))
        names: list[str] = []
        while len(names) < facts:
            name = make_name(rng)
            if name not in names:
                names.append(name)
        things = [FACT_THINGS[int(i)] for i in rng.integers(len(FACT_THINGS), size=facts)]
        values = [make_value(rng) for _ in range(facts)]
        asked = int(rng.integers(facts))

        def split(template: str, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            # before, " value", after: encoded apart, so the answer's tokens are the planted value's tokens
            before, _, after = template.partition(" {value}")
            return (self.encode(before.format(name=names[i], thing=things[i])), self.encode(" " + values[i]),
                    self.encode(after))

        planted = [np.concatenate(split(FACT_STATEMENTS[int(rng.integers(len(FACT_STATEMENTS)))], i))
                   for i in range(facts)]
        question = self.encode(FACT_QUESTIONS[int(rng.integers(len(FACT_QUESTIONS)))].format(
            name=names[asked], thing=things[asked]))
        value, close = self.encode(" " + values[asked]), self.encode(FACT_CLOSE)
        fixed = 2 + question.size + value.size + close.size
        while len(planted) > 1 and sum(p.size for p in planted) > (length - fixed) // 2:  # a short sample: fewer
            drop = next(j for j in range(len(planted) - 1, -1, -1) if j != asked)
            del planted[drop]
            asked -= asked > drop
        room = length - fixed - sum(p.size for p in planted)
        if room < 1:
            raise ValueError(f"fact: {length} tokens leave no room for the context")
        ctx = context[:room]
        at = sorted(self._boundary(ctx, int(x)) for x in rng.integers(0, room + 1, size=len(planted)))
        order = rng.permutation(len(planted))
        parts: list[tuple[np.ndarray, str]] = []
        prev = 0
        for pos, j in zip(at, order, strict=True):
            parts += [(ctx[prev:pos], "text"), (planted[j], "prompt")]
            prev = pos
        parts += [(ctx[prev:], "text"), (question, "prompt"), (value, "answer"), (close, "answer")]
        depth = next(pos for pos, j in zip(at, order, strict=True) if j == asked)
        return self._assemble(parts, "fact", {"facts": len(planted), "depth": round(depth / max(room, 1), 4)})
