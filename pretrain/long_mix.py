"""A long-context phase's data: the source-weight schedule and the packed rows that follow it (§4.2, Table 6).

Sources (Table 6's categories, by a sample's length in tokens): **short** (< ``short_max``), **medium**
(``short_max`` .. ``medium_max``) and **long** (> ``medium_max``) -- corpus documents by their own length and the
assembled long documents (``pretrain/long_data.py``) by theirs -- plus **qa**, the long-QA samples.

Schedule (:func:`phase_weights`): over a phase's first ``transition_frac`` the short/medium/long weights move
linearly from the previous phase's (for the first phase: the corpus's own shares, what pretraining saw) to this
phase's; during its last ``qa_last_frac``, ``qa_share`` of the tokens are long QA and the sources share the rest.

Rows (:func:`plan_rows`): row ``j`` of the phase (rows are consumed in order) gets the weights at its position.
Medium, long and QA samples are never cut by a row end (a sample longer than the phase length is first cut into
windows of that length, each one segment); a row takes such samples while one fits and its source is behind its
cumulative target by at least half the sample, then the rest of the row is filled with short documents, which
are cut at the row end and continue in the next row (as pretraining packs). Realised token shares therefore
follow the targets within about one sample. The rows are written in the format of ``pretrain/packed_data.py``
(``packing.json``, ``train_tokens.npy``, segment files), plus ``train_no_loss.npy``: positions whose label does not
count (a QA sample's context and question; padding).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import atomic_file
from pretrain.long_data import make_long_qa, word_start_tokens
from pretrain.packed_data import (
    EVAL_IDS_FILE,
    FORMAT_VERSION,
    INFO_FILE,
    TOKEN_DTYPE,
    UNIGRAM_FILE,
    PackedDatasetInfo,
    SplitInfo,
    _save_npy,
    split_file,
)

SOURCES = ("short", "medium", "long", "qa")
SHORT, MEDIUM, LONG, QA = range(4)
PHASE_DATA_FILE = "phase_data.json"
STORES = ("corpus", "long")  # where a pool's samples live: corpus documents, assembled long documents
# numpy SeedSequence tags (distinct, nonzero), one per purpose
_QUEUE_TAG, _QA_TAG = 11, 12


def length_category(tokens: np.ndarray, short_max: int, medium_max: int) -> np.ndarray:
    """SHORT (< short_max), MEDIUM (short_max .. medium_max) or LONG (> medium_max) per sample length."""
    n = np.asarray(tokens)
    return np.where(n < short_max, SHORT, np.where(n <= medium_max, MEDIUM, LONG))


def phase_weights(progress: float, previous: np.ndarray, target: np.ndarray, *, transition_frac: float,
                  qa_share: float, qa_last_frac: float) -> np.ndarray:
    """Token shares [short, medium, long, qa] at ``progress`` in [0, 1) of a phase (module docstring)."""
    prev = np.asarray(previous, float) / np.sum(previous)
    goal = np.asarray(target, float) / np.sum(target)
    ramp = 1.0 if transition_frac <= 0 else min(1.0, progress / transition_frac)
    w = prev + (goal - prev) * ramp
    qa = qa_share if progress >= 1.0 - qa_last_frac else 0.0
    return np.append(w * (1.0 - qa), qa)


# --- samples and the queues that hand them out ------------------------------------------------------------------
@dataclass
class Piece:
    """Part of a row: one segment."""

    source: int
    tokens: np.ndarray
    ref: tuple[str, int]  # (store, item) it comes from, for counting distinct samples
    continuation: bool = False  # starts in the middle of its sample
    no_loss: np.ndarray | None = None  # a QA sample's context/question; None: every label counts


class SampleQueue:
    """Samples of one source (never cut by a row end), in a seeded order that is reshuffled each pass over the
    pool; a sample longer than ``seq_len`` is handed out as consecutive windows of ``seq_len`` tokens."""

    def __init__(self, pool: np.ndarray, tokens_of: Callable[[str, int], np.ndarray], seq_len: int,
                 seed: list[int]) -> None:
        """``pool``: int64 [n, 2], (index in :data:`STORES`, item) of every sample, repeated for samples to be seen
        more often per pass; ``tokens_of(store name, item)`` reads one."""
        self.pool = np.asarray(pool, np.int64).reshape(-1, 2)
        self.tokens_of, self.seq_len, self.seed = tokens_of, seq_len, seed
        self.epochs = 0  # completed passes over the pool
        self._order: np.ndarray = np.zeros(0, np.int64)
        self._next = 0
        self._windows: list[Piece] = []

    def __bool__(self) -> bool:
        return len(self.pool) > 0

    def _refill(self) -> None:
        if self._next >= self._order.size:
            if self._order.size:
                self.epochs += 1
            self._order = np.random.default_rng([*self.seed, self.epochs]).permutation(len(self.pool))
            self._next = 0
        store, item = self.pool[int(self._order[self._next])].tolist()
        ref = (STORES[store], item)
        self._next += 1
        tokens = self.tokens_of(*ref)
        self._windows = [Piece(-1, tokens[s:s + self.seq_len], ref, continuation=s > 0)
                         for s in range(0, tokens.size, self.seq_len)][::-1]

    def peek_len(self) -> int:
        if not self._windows:
            self._refill()
        return int(self._windows[-1].tokens.size)

    def take(self) -> Piece:
        self.peek_len()
        return self._windows.pop()


class QAQueue:
    """Long-QA samples made on demand from a queue of context documents (``pretrain/long_data.make_long_qa``), each
    written to ``writer`` when it is taken (a sample made for a peek but never placed is not kept)."""

    def __init__(self, contexts: SampleQueue, make: Callable[[np.ndarray, str, np.random.Generator], Any],
                 writer: Any, seed: list[int], *, bos: int, eos: int) -> None:
        self.contexts, self.make, self.writer, self.bos, self.eos = contexts, make, writer, bos, eos
        self.rng = np.random.default_rng(seed)
        self._pending: Any = None

    def __bool__(self) -> bool:
        return bool(self.contexts)

    def peek_len(self) -> int:
        if self._pending is None:
            piece = self.contexts.take()
            ctx = np.asarray(piece.tokens)
            ctx = ctx[1:] if ctx.size and ctx[0] == self.bos else ctx
            ctx = ctx[:-1] if ctx.size and ctx[-1] == self.eos else ctx
            self._pending = self.make(ctx, f"{piece.ref[0]}:{piece.ref[1]}", self.rng)
        return int(self._pending.tokens.size)

    def take(self) -> Piece:
        self.peek_len()
        qa, self._pending = self._pending, None
        index = self.writer.add(qa.tokens, **qa.meta)
        return Piece(QA, qa.tokens, ("qa", index), no_loss=qa.no_loss)


class ShortStream:
    """Short documents as a stream of tokens: :meth:`fill` cuts it into exactly the tokens asked; a document cut at
    a row end continues in the next row. An empty pool fills with padding (out of the loss)."""

    def __init__(self, queue: SampleQueue, pad_id: int) -> None:
        self.queue, self.pad_id = queue, pad_id
        self._rest: Piece | None = None
        self.pad_tokens = 0

    def fill(self, space: int) -> list[Piece]:
        pieces: list[Piece] = []
        while space > 0:
            if not self.queue:
                pad = np.full(space, self.pad_id, TOKEN_DTYPE)
                pieces.append(Piece(SHORT, pad, ("pad", 0), no_loss=np.ones(space, bool)))
                self.pad_tokens += space
                return pieces
            piece = self._rest if self._rest is not None else self.queue.take()
            self._rest = None
            if piece.tokens.size > space:
                self._rest = Piece(SHORT, piece.tokens[space:], piece.ref, continuation=True)
                piece = Piece(SHORT, piece.tokens[:space], piece.ref, piece.continuation)
            piece.source = SHORT
            pieces.append(piece)
            space -= piece.tokens.size
        return pieces


def plan_rows(rows: int, seq_len: int, weights_of_row: Callable[[int], np.ndarray],
              queues: dict[int, SampleQueue | QAQueue], short: ShortStream,
              realised: np.ndarray) -> Iterator[list[Piece]]:
    """The phase's rows, in order, as lists of pieces (module docstring); ``realised`` [rows, 4] receives the
    tokens each row took from each source."""
    target = np.zeros(len(SOURCES))
    done = np.zeros(len(SOURCES))
    for j in range(rows):
        target += weights_of_row(j) * seq_len
        space, pieces = seq_len, []
        while True:
            behind = target - done
            for s in sorted((MEDIUM, LONG, QA), key=lambda s: -behind[s]):
                queue = queues.get(s)
                if not queue:
                    continue
                n = queue.peek_len()
                if n <= space and behind[s] >= n / 2:
                    piece = queue.take()
                    piece.source = s
                    pieces.append(piece)
                    space -= n
                    done[s] += n
                    realised[j, s] += n
                    break
            else:
                break
        pieces += short.fill(space)
        done[SHORT] += space
        realised[j, SHORT] += space
        yield pieces


# --- writing a phase's rows -------------------------------------------------------------------------------------
@dataclass
class _SplitWriter:
    """Rows of one split to ``<split>_tokens.npy`` / ``<split>_no_loss.npy`` (memory-mapped while written, renamed
    into place at the end) and the segment files; unigram counts of its real tokens."""

    out_dir: Path
    split: str
    rows: int
    seq_len: int
    vocab_size: int
    pad_id: int
    starts: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=lambda: [0])
    stats: dict[str, int] = field(default_factory=lambda: dict(tokens=0, pad_tokens=0, loss_tokens=0, segments=0,
                                                               continuation_segments=0, document_instances=0))
    refs: set = field(default_factory=set)
    written: int = 0

    def __post_init__(self) -> None:
        pid = os.getpid()
        self._tmp = {what: self.out_dir / f".{split_file(self.split, what)}.tmp-{pid}"
                     for what in ("tokens", "no_loss")}
        self.tokens = np.lib.format.open_memmap(self._tmp["tokens"], "w+", TOKEN_DTYPE, (self.rows, self.seq_len))
        self.no_loss = np.lib.format.open_memmap(self._tmp["no_loss"], "w+", np.bool_, (self.rows, self.seq_len))
        self.unigram = np.zeros(self.vocab_size, np.int64)

    def add(self, pieces: list[Piece]) -> None:
        j, at = self.written, 0
        for p in pieces:
            n = int(p.tokens.size)
            self.tokens[j, at:at + n] = p.tokens
            mask = np.zeros(n, bool) if p.no_loss is None else p.no_loss
            self.no_loss[j, at:at + n] = mask
            self.starts.append(at)
            is_pad = p.ref[0] == "pad"
            if not is_pad:
                if int(p.tokens.max()) >= self.vocab_size:
                    raise ValueError(f"{self.split} rows hold token id {int(p.tokens.max())} >= vocab size "
                                     f"{self.vocab_size}: the tokenizer and the checkpoint disagree")
                self.unigram += np.bincount(p.tokens, minlength=self.vocab_size)
                self.stats["tokens"] += n
                self.stats["segments"] += 1
                self.stats["continuation_segments"] += p.continuation
                self.stats["document_instances"] += not p.continuation
                self.stats["loss_tokens"] += int((~mask[1:]).sum())  # a segment's first label never counts
                self.refs.add(p.ref)
            else:
                self.stats["pad_tokens"] += n
            at += n
        if at != self.seq_len:
            raise RuntimeError(f"{self.split} row {j} holds {at} tokens, not {self.seq_len} (a bug in long_mix.py)")
        self.starts.append(self.seq_len)
        self.index.append(len(self.starts))
        self.written += 1

    def close(self) -> SplitInfo:
        if self.written != self.rows:
            raise RuntimeError(f"{self.split}: wrote {self.written} rows of {self.rows} (a bug in long_mix.py)")
        self.tokens.flush()
        self.no_loss.flush()
        del self.tokens, self.no_loss
        for what, tmp in self._tmp.items():
            os.replace(tmp, self.out_dir / split_file(self.split, what))
        _save_npy(self.out_dir / split_file(self.split, "segment_starts"), np.asarray(self.starts, np.int32))
        _save_npy(self.out_dir / split_file(self.split, "segment_index"), np.asarray(self.index, np.int64))
        return SplitInfo(rows=self.rows, documents=len(self.refs), **self.stats)


@dataclass
class PhaseSources:
    """What a phase's rows are drawn from."""

    queues: dict[int, SampleQueue | QAQueue]
    short: ShortStream
    eval_samples: list[np.ndarray]  # held-out long documents of the phase length, one row each
    previous: np.ndarray  # short/medium/long weights the phase starts from
    target: np.ndarray  # and moves to


def write_phase_rows(out_dir: str | Path, sources: PhaseSources, *, seq_len: int, rows: int, seed: int,
                     weights_of_row: Callable[[int], np.ndarray], vocab_size: int, special_ids: dict[str, int],
                     inherited: dict[str, Any], describe: dict[str, Any]) -> dict[str, Any]:
    """Plan and write the phase's training rows and its eval rows in ``out_dir``; ``packing.json`` last. Returns
    what :data:`PHASE_DATA_FILE` records: targets and realised shares by tenth of the phase, sample counts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    realised = np.zeros((rows, len(SOURCES)), np.int64)
    train = _SplitWriter(out_dir, "train", rows, seq_len, vocab_size, special_ids["pad"])
    for pieces in plan_rows(rows, seq_len, weights_of_row, sources.queues, sources.short, realised):
        train.add(pieces)
    train_info = train.close()
    ev = _SplitWriter(out_dir, "eval", len(sources.eval_samples), seq_len, vocab_size, special_ids["pad"])
    for k, sample in enumerate(sources.eval_samples):
        ev.add([Piece(LONG, sample, ("eval", k))])
    eval_info = ev.close()
    _save_npy(out_dir / UNIGRAM_FILE, train.unigram)
    with atomic_file(out_dir / EVAL_IDS_FILE) as f:
        f.write(b"[]\n")  # held-out long documents, not mixture documents: listed in phase_data.json

    targets = np.stack([weights_of_row(j) for j in range(rows)])
    tenths = np.minimum((np.arange(rows) * 10) // rows, 9)
    by_tenth = []
    for t in range(10):
        sel = tenths == t
        if sel.any():
            by_tenth.append({"rows": int(sel.sum()),
                             "target": dict(zip(SOURCES, np.round(targets[sel].mean(0), 6).tolist(), strict=True)),
                             "realised": dict(zip(SOURCES, np.round(realised[sel].sum(0) / (sel.sum() * seq_len),
                                                                    6).tolist(), strict=True))})
    epochs = {SOURCES[s]: (q.contexts.epochs if isinstance(q, QAQueue) else q.epochs)
              for s, q in sources.queues.items() if q}
    data = {**describe, "seq_len": seq_len, "rows": rows, "previous_weights": sources.previous.tolist(),
            "target_weights": sources.target.tolist(), "by_tenth": by_tenth,
            "tokens_by_source": dict(zip(SOURCES, realised.sum(0).tolist(), strict=True)),
            "passes_over_pool": epochs, "short_passes": sources.short.queue.epochs,
            "pad_tokens": sources.short.pad_tokens, "eval_rows": len(sources.eval_samples),
            "qa_samples": sources.queues[QA].writer.count if sources.queues.get(QA) else 0}
    with atomic_file(out_dir / PHASE_DATA_FILE) as f:
        f.write((json.dumps(data, indent=1) + "\n").encode())
    _save_npy(out_dir / "row_sources.npy", realised)
    info = PackedDatasetInfo(format_version=FORMAT_VERSION, seq_len=seq_len, seed=seed, vocab_size=vocab_size,
                             special_ids=special_ids, train=train_info, eval=eval_info, **inherited)
    with atomic_file(out_dir / INFO_FILE) as f:  # last: its presence means the rest is complete
        f.write(info.to_json().encode())
    return data


def row_sources(data_dir: str | Path) -> np.ndarray:
    """int64 [rows, 4]: tokens of each source in each training row of a written phase."""
    return np.load(Path(data_dir) / "row_sources.npy")


def corpus_shares(data: Any, short_max: int, medium_max: int) -> np.ndarray:
    """short/medium/long token shares of the corpus documents as pretraining trained on them (tokens x
    sample_count): where the first phase's transition starts."""
    tokens = data.lengths * data.counts
    cat = length_category(data.lengths, short_max, medium_max)
    shares = np.bincount(cat, weights=tokens, minlength=3).astype(float)
    return shares / max(shares.sum(), 1.0)


def phase_sources(data: Any, *, phase: int, seq_len: int, short_max: int, medium_max: int, previous: np.ndarray,
                  target: np.ndarray, qa_share: float, eval_rows: int, seed: int, tokenizer: Any, qa_writer: Any,
                  special_ids: dict[str, int]) -> PhaseSources:
    """The queues of a phase (``data`` is a ``pretrain.long_data.LongData``): corpus documents the pretraining run
    trained on, each ``sample_count`` times per pass, and the assembled long documents, by length category; long
    QA made from assembled documents that fit the phase; eval rows of held-out documents assembled to its length."""
    held = np.flatnonzero(data.counts > 0)
    corpus = np.repeat(held, data.counts[held])
    corpus_cat = length_category(data.lengths[corpus], short_max, medium_max)
    long_docs = data.long_documents
    long_cat = length_category(long_docs.lengths, short_max, medium_max)
    pools = {s: np.concatenate([_refs(0, corpus[corpus_cat == s]), _refs(1, np.flatnonzero(long_cat == s))])
             for s in (SHORT, MEDIUM, LONG)}

    def tokens_of(store: str, item: int) -> np.ndarray:
        return data.document(item) if store == "corpus" else long_docs.tokens(item)

    ranges = {SHORT: f"< {short_max}", MEDIUM: f"{short_max}..{medium_max}", LONG: f"> {medium_max}"}
    for s in (SHORT, MEDIUM, LONG):
        if not len(pools[s]) and max(previous[s], target[s]) > 0 and s != SHORT:
            raise ValueError(f"phase {phase}: the {SOURCES[s]} source has weight {max(previous[s], target[s]):g} "
                             f"but no corpus or assembled document is {ranges[s]} tokens long; add long_document_"
                             f"lengths in that range or give it weight 0")
    queues: dict[int, SampleQueue | QAQueue] = {
        s: SampleQueue(pools[s], tokens_of, seq_len, [seed, _QUEUE_TAG, phase, s]) for s in (MEDIUM, LONG)}
    if qa_share > 0:
        fits = np.flatnonzero(long_docs.lengths <= seq_len)
        contexts = _refs(1, fits if fits.size else np.arange(len(long_docs)))
        if not len(contexts):
            raise ValueError(f"phase {phase}: qa_share={qa_share} but no long document was assembled to make long QA "
                             "from (the held-in documents of every domain are shorter than the smallest length)")
        make = partial(_make_qa, length=seq_len, tokenizer=tokenizer, word_start=word_start_tokens(tokenizer),
                       bos=special_ids["bos"], eos=special_ids["eos"], make=make_long_qa)
        queues[QA] = QAQueue(SampleQueue(contexts, tokens_of, seq_len, [seed, _QUEUE_TAG, phase, QA]), make,
                             qa_writer, [seed, _QA_TAG, phase], bos=special_ids["bos"], eos=special_ids["eos"])
    short = ShortStream(SampleQueue(pools[SHORT], tokens_of, seq_len, [seed, _QUEUE_TAG, phase, SHORT]),
                        special_ids["pad"])
    held_out = data.eval_documents(seq_len)
    if not len(held_out):
        raise ValueError(f"phase {phase}: no held-out long document of {seq_len} tokens could be assembled for its "
                         "eval rows (the pretraining run's held-out documents of each domain are shorter in all): "
                         "pretrain with more eval_documents, or use shorter phases")
    evals = [held_out.tokens(k) for k in range(min(len(held_out), eval_rows))]
    return PhaseSources(queues, short, evals, np.asarray(previous, float), np.asarray(target, float))


def _refs(store: int, items: np.ndarray) -> np.ndarray:
    return np.stack([np.full(len(items), store, np.int64), np.asarray(items, np.int64)], axis=1)


def _make_qa(context: np.ndarray, context_id: str, rng: np.random.Generator, *, make: Callable[..., Any],
             **kw: Any) -> Any:
    return make(context, rng=rng, context_id=context_id, **kw)
