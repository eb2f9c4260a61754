"""Retrieval-bearing rows mixed into a packed training split (``pretrain`` and each ``long_context`` phase).

``retrieval_share`` of a training run's rows are made of ``data/retrieval.py`` samples (a far-back span copied as
the answer to a late query: repeated passages, quoted continuations, key-to-value look-ups, several look-ups at
once) instead of plain documents. Our departure from the report (issue 22): its data is not public, and the
pipeline's sample corpus teaches a small model no copying in a one-GPU budget (BENCHMARKS.md).

The samples are made here, from the split's own training rows (their text with the special tokens taken out), so
they hold only held-in text: the held-out documents that the eval stage builds its haystacks from never appear.
A retrieval row is filled with samples of lengths drawn uniformly from ``[min_tokens, seq_len]`` (cut to the
row's space); a rest shorter than ``min_tokens`` is one more plain-text segment. The rows are spread evenly
among the split's rows (``long_context`` reads its rows in order, so the share is the same in every part of a
phase), and the split's files and ``packing.json`` are rewritten: ``train_no_loss.npy`` marks what does not count
(the samples' prompts, and with ``loss_on="answers"`` their natural-text context too; padding; a long-QA context), the segment files and unigram counts include the new rows,
``retrieval.json`` says what was made (rows, samples, tokens and answer tokens per kind).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from data.retrieval import (
    COPY_DRAWS,
    COPY_MARK,
    DEFAULT_KINDS,
    KINDS,
    MIN_SAMPLE_TOKENS,
    RetrievalMaker,
    copy_sample,
)
from data.tokenizer import SPECIAL_TOKENS
from pipeline.artifacts import atomic_file
from pretrain.copy_schedule import curriculum_rows_for
from pretrain.packed_data import (
    COPY_FILE,
    INFO_FILE,
    TOKEN_DTYPE,
    UNIGRAM_FILE,
    PackedRows,
    SplitInfo,
    _save_npy,
    loss_mask,
    read_info,
    split_file,
)

RETRIEVAL_FILE = "retrieval.json"
LOSS_ON = ("all", "answers")  # what of a retrieval sample is a training target
_ROWS_TAG = 21  # numpy SeedSequence tag (distinct, nonzero) of the retrieval rows' draws
_COPY_TAG = 22  # ... and of the copy curriculum's


def retrieval_rows_for(rows: int, share: float) -> int:
    """Rows to add to ``rows`` plain rows so that ``share`` of all rows are retrieval rows."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"retrieval_share={share}: use a share in [0, 1)")
    return int(round(rows * share / (1.0 - share)))


def positions(plain: int, added: int) -> np.ndarray:
    """bool [plain + added]: where the added rows go, spread evenly (the plain rows keep their order)."""
    total = plain + added
    at = np.zeros(total, bool)
    if added:
        at[((np.arange(added) + 0.5) * total / added).astype(np.int64)] = True
    return at


class TrainingText:
    """Held-in text for the samples: a random training row's tokens onward, special tokens removed."""

    def __init__(self, rows: PackedRows, special: Sequence[int], rng: np.random.Generator) -> None:
        self.rows, self.rng = rows, rng
        self.special = np.asarray(sorted(set(int(s) for s in special)), np.int64)

    def take(self, n: int) -> np.ndarray:
        out: list[np.ndarray] = []
        have, r = 0, int(self.rng.integers(len(self.rows)))
        for _ in range(len(self.rows)):
            tokens, _, pad = self.rows.row(r % len(self.rows))
            keep = tokens[~pad & ~np.isin(tokens, self.special)]
            out.append(keep)
            have += keep.size
            if have >= n:
                return np.concatenate(out)[:n].astype(TOKEN_DTYPE)
            r += 1
        raise ValueError(f"retrieval rows: the training rows hold only {have} text tokens, fewer than the {n} a "
                         "sample needs; lower min_tokens or add data")


def _write_train_split(data_dir: Path, total: int, seq_len: int, vocab: int, tag: str,
                       rows: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """Rewrite the training split's token rows, no-loss mask, segment starts and index from ``rows``: ``total``
    ``(tokens, segment_starts, no_loss)`` in order. Written under temporary names, checked, then renamed into place
    (the caller writes ``packing.json`` last: its presence means the rest is complete)."""
    pid = os.getpid()
    tmp = {w: data_dir / f".{split_file('train', w)}.{tag}-{pid}" for w in ("tokens", "no_loss")}
    tokens = np.lib.format.open_memmap(tmp["tokens"], "w+", TOKEN_DTYPE, (total, seq_len))
    no_loss = np.lib.format.open_memmap(tmp["no_loss"], "w+", np.bool_, (total, seq_len))
    starts: list[np.ndarray] = []
    index = np.zeros(total + 1, np.int64)
    j = -1
    for j, (row, row_starts, pad) in enumerate(rows):
        tokens[j] = row
        no_loss[j] = pad
        starts.append(np.asarray(row_starts, np.int32))
        index[j + 1] = index[j] + len(row_starts)
    if j + 1 != total:
        raise RuntimeError(f"{tag} rows: made {j + 1} rows, not {total} (a bug in pretrain/retrieval_rows.py)")
    if int(tokens.max(initial=0)) >= vocab:
        raise ValueError(f"{tag} rows hold a token id >= the vocabulary size {vocab}: wrong tokenizer")
    tokens.flush()
    no_loss.flush()
    del tokens, no_loss
    os.replace(tmp["tokens"], data_dir / split_file("train", "tokens"))
    os.replace(tmp["no_loss"], data_dir / split_file("train", "no_loss"))
    _save_npy(data_dir / split_file("train", "segment_starts"), np.concatenate(starts).astype(np.int32))
    _save_npy(data_dir / split_file("train", "segment_index"), index)


def _commit(data_dir: Path, record_file: str, record: dict[str, Any], info: Any) -> None:
    """What was made (``record_file``), then ``packing.json`` last: its presence means the rest is complete."""
    with atomic_file(data_dir / record_file) as f:
        f.write((json.dumps(record, indent=1) + "\n").encode())
    with atomic_file(data_dir / INFO_FILE) as f:
        f.write(info.to_json().encode())


def add_retrieval_rows(data_dir: str | Path, tokenizer: Any, *, added_rows: int, seed: int,
                       kinds: Sequence[str] = DEFAULT_KINDS, min_tokens: int = 256, loss_on: str = "all",
                       answer_eos: bool = True, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Add ``added_rows`` retrieval rows to the training split in ``data_dir`` (module docstring); return what
    ``retrieval.json`` records. ``tokenizer`` is the run's ``tokenizers.Tokenizer``. ``loss_on``: ``"all"`` (a
    sample's natural-text context and its answer are targets) or ``"answers"`` (the answers alone: the copy targets
    are then a larger share of the run's loss; the context's text is still read, as the plain rows teach it).
    ``answer_eos``: whether the EOS after each answer is a target (:class:`data.retrieval.RetrievalMaker`)."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"retrieval loss_on={loss_on!r}: expected one of {', '.join(LOSS_ON)}")
    data_dir = Path(data_dir)
    if (data_dir / RETRIEVAL_FILE).exists():
        raise ValueError(f"{data_dir} already holds retrieval rows ({RETRIEVAL_FILE}); pack it again to change them")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"retrieval kinds {list(kinds)}: use a non-empty list of {', '.join(KINDS)}")
    info = read_info(data_dir)
    seq_len = info.seq_len
    if min_tokens < MIN_SAMPLE_TOKENS or min_tokens > seq_len:
        raise ValueError(f"retrieval min_tokens={min_tokens}: use {MIN_SAMPLE_TOKENS}..{seq_len} (the row length)")
    special = info.special_ids
    plain = PackedRows(data_dir, "train")
    rng = np.random.default_rng([seed, _ROWS_TAG])
    maker = RetrievalMaker(tokenizer, bos=special["bos"], eos=special["eos"], answer_eos=answer_eos)
    contexts = TrainingText(plain, special.values(), rng)
    total = len(plain) + added_rows
    at = positions(len(plain), added_rows)
    vocab = info.vocab_size

    unigram = np.load(data_dir / UNIGRAM_FILE)
    by_kind = {k: {"samples": 0, "tokens": 0, "answer_tokens": 0, "loss_tokens": 0} for k in kinds}
    filler = {"segments": 0, "tokens": 0}
    added = {"tokens": 0, "loss_tokens": 0, "segments": 0}

    def made_rows() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        p, made = 0, 0
        for j in range(total):
            if not at[j]:
                yield plain.row(p)
                p += 1
                continue
            pieces, masks, row_starts_l, space = [], [], [0], seq_len
            while space > 0:
                if space < min_tokens:  # the rest: plain text, one segment
                    text = contexts.take(space)
                    pieces.append(text)
                    masks.append(np.zeros(space, bool))
                    filler["segments"] += 1
                    filler["tokens"] += space
                    break
                n = min(int(rng.integers(min_tokens, seq_len + 1)), space)
                if space - n and space - n < MIN_SAMPLE_TOKENS:
                    n = space  # no rest too short for anything but filler
                kind = kinds[int(rng.integers(len(kinds)))]
                s = maker.make(kind, contexts.take(n), n, rng)
                pieces.append(s.tokens)
                masks.append(~s.answer if loss_on == "answers" else s.no_loss)
                counts = by_kind[kind]
                counts["samples"] += 1
                counts["tokens"] += n
                counts["answer_tokens"] += s.answer_tokens
                counts["loss_tokens"] += int((~masks[-1][1:]).sum())  # a segment's first label never counts
                space -= n
                if space:
                    row_starts_l.append(seq_len - space)
            row, pad = np.concatenate(pieces), np.concatenate(masks)
            row_starts = np.asarray([*row_starts_l, seq_len], np.int32)
            np.add(unigram, np.bincount(row, minlength=vocab), out=unigram)
            added["tokens"] += seq_len
            added["segments"] += len(row_starts) - 1
            added["loss_tokens"] += int(loss_mask(row_starts, pad).sum())
            made += 1
            if progress and made % 256 == 0:
                progress(f"retrieval rows: {made:,}/{added_rows:,}")
            yield row, row_starts, pad

    _write_train_split(data_dir, total, seq_len, vocab, "retrieval", made_rows())
    _save_npy(data_dir / UNIGRAM_FILE, unigram)

    t = info.train
    samples = sum(c["samples"] for c in by_kind.values())
    train = SplitInfo(rows=total, tokens=t.tokens + added["tokens"], pad_tokens=t.pad_tokens,
                      loss_tokens=t.loss_tokens + added["loss_tokens"], segments=t.segments + added["segments"],
                      continuation_segments=t.continuation_segments,
                      documents=t.documents + samples + filler["segments"],
                      document_instances=t.document_instances + samples + filler["segments"])
    record = {"rows": added_rows, "plain_rows": len(plain), "seq_len": seq_len, "samples": samples,
              "tokens": added["tokens"], "loss_tokens": added["loss_tokens"],
              "answer_tokens": sum(c["answer_tokens"] for c in by_kind.values()),
              "share_of_rows": added_rows / max(total, 1), "filler": filler, "by_kind": by_kind,
              "kinds": list(kinds), "min_tokens": min_tokens, "loss_on": loss_on, "answer_eos": answer_eos,
              "seed": seed}
    _commit(data_dir, RETRIEVAL_FILE, record, replace(info, train=train))
    if progress:
        progress(f"retrieval rows: {added_rows:,} of {total:,} training rows, {samples:,} samples ("
                 + ", ".join(f"{k} {c['samples']:,}" for k, c in by_kind.items()) + ")")
    return record


def _copy_pool(data_dir: Path, tokenizer: Any, info: Any, draw: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The ids copy rows draw from (every ordinary id) and their probabilities (None: uniform; ``draw`` "unigram":
    as often as the training text uses each, ids it never uses left out)."""
    specials = {tokenizer.token_to_id(t) for t in SPECIAL_TOKENS} | set(info.special_ids.values())
    pool = np.asarray([i for i in range(info.vocab_size) if i not in specials], TOKEN_DTYPE)
    if draw != "unigram":
        return pool, None
    counts = np.load(data_dir / UNIGRAM_FILE).astype(np.float64)[pool]
    if not counts.sum():
        raise ValueError(f"copy draw='unigram': the training text of {data_dir} uses no ordinary token")
    pool, counts = pool[counts > 0], counts[counts > 0]
    return pool, counts / counts.sum()


def _checked_copy_args(span_tokens: Sequence[int], gap_tokens: Sequence[int], rows: int, share: float, draw: str,
                       keep_rows: int, keep_slots: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """:func:`add_copy_rows`' arguments checked: (span min, max), (gap min, max)."""
    lo, hi = (int(x) for x in span_tokens)
    if not 1 <= lo <= hi:
        raise ValueError(f"copy span_tokens={list(span_tokens)}: use [min, max] with 1 <= min <= max")
    glo, ghi = (int(x) for x in gap_tokens)
    if not 0 <= glo <= ghi:
        raise ValueError(f"copy gap_tokens={list(gap_tokens)}: use [min, max] with 0 <= min <= max")
    if rows < 1 or not 0.0 < share <= 1.0:
        raise ValueError(f"copy rows={rows}, share={share}: need rows >= 1 and a share in (0, 1]")
    if not 0 <= keep_rows <= keep_slots or (keep_slots and not keep_rows):
        raise ValueError(f"copy keep_rows={keep_rows}, keep_slots={keep_slots}: need 0 <= keep_rows <= keep_slots")
    if draw not in COPY_DRAWS:
        raise ValueError(f"copy draw={draw!r}: use one of {', '.join(COPY_DRAWS)}")
    return (lo, hi), (glo, ghi)


def add_copy_rows(data_dir: str | Path, tokenizer: Any, *, rows: int, share: float, seed: int,
                  span_tokens: Sequence[int] = (32, 256), draw: str = "uniform", gap_tokens: Sequence[int] = (0, 0),
                  keep_rows: int = 0, keep_slots: int = 0,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Append ``rows`` copy-curriculum rows to the training split in ``data_dir`` and record the schedule that
    reads them (``copy_curriculum.json``): the first ``rows / share`` rows a run reads hold them at ``share``,
    evenly spread (all of them at share 1), the rest of those rows and everything after coming from the split's
    other rows (:class:`pretrain.packed_data.CurriculumLoader`). ``keep_rows`` more copy rows (made after those,
    alike) are read after that window, spread evenly over its next ``keep_slots`` rows (``copy_keep_share``). Our departure from the report (issue 33): natural
    text with the other retrieval kinds did not teach ``gpu-300m`` to copy; 1,000 steps of these rows alone did
    (BENCHMARKS.md, the fifth lease).

    A row holds :func:`data.retrieval.copy_sample` s, one segment each, their spans drawn uniformly from
    ``span_tokens`` (min, max) and their ids from the ordinary vocabulary (every id but the special tokens):
    ``draw`` "uniform", each id alike, or "unigram", as often as the training text uses it (its unigram counts;
    ids the text never uses are never drawn). On the CPU a toy model copied Zipf-drawn ids from a 4,096-id
    vocabulary after ~150-400 steps and uniformly drawn ones not in 200 (BENCHMARKS.md). ``gap_tokens`` (min, max):
    each sample puts that many more drawn ids between its span and the marker (:func:`copy_sample`'s gap), so the
    repeat is copied from farther back. A row's last sample keeps its drawn span and takes the rest of the row as
    its gap, which can exceed the max (without gaps, its span takes the rest). The loss counts the
    repeats alone. The unigram counts leave the rows out: the unigram baseline describes the text. ``packing.json``'s train split counts them (rows, tokens, segments)."""
    data_dir = Path(data_dir)
    if (data_dir / COPY_FILE).exists():
        raise ValueError(f"{data_dir} already holds copy rows ({COPY_FILE}); pack it again to change them")
    (lo, hi), (glo, ghi) = _checked_copy_args(span_tokens, gap_tokens, rows, share, draw, keep_rows, keep_slots)
    info = read_info(data_dir)
    seq_len, special = info.seq_len, info.special_ids
    mark = np.asarray(tokenizer.encode(COPY_MARK, add_special_tokens=False).ids, TOKEN_DTYPE)
    shortest = 2 * lo + glo + mark.size + 2
    if shortest > seq_len:
        raise ValueError(f"copy span_tokens min {lo}, gap_tokens min {glo}: a sample of {shortest} tokens does not "
                         f"fit a {seq_len}-token row")
    pool, weights = _copy_pool(data_dir, tokenizer, info, draw)
    plain = PackedRows(data_dir, "train")
    rng = np.random.default_rng([seed, _COPY_TAG])
    made_copies = rows + keep_rows  # the window's first, then the kept ones: one stream, so the window's are as before
    total = len(plain) + made_copies

    made = {"samples": 0, "span_tokens": 0, "gap_tokens": 0, "loss_tokens": 0}

    def made_rows() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for j in range(total):
            if j < len(plain):
                yield plain.row(j)
                continue
            pieces, masks, row_starts_l, space = [], [], [0], seq_len
            while space:
                gap = int(rng.integers(glo, ghi + 1)) if ghi else 0  # no draw without gaps: the rows stay as they were
                want = int(rng.integers(lo, hi + 1))
                n = min(2 * want + gap + mark.size + 2, space)
                if space - n < shortest:
                    n = space  # the last sample takes the rest of the row
                if ghi:  # with gaps, the rest goes to the gap (the span keeps its draw); a cut sample keeps spans >= lo
                    gap = max(min(gap, n - mark.size - 2 - 2 * lo), n - mark.size - 2 - 2 * want)
                s = copy_sample(pool, n, rng, bos=special["bos"], eos=special["eos"], mark=mark, weights=weights,
                                gap=gap)
                pieces.append(s.tokens)
                masks.append(s.no_loss)
                made["samples"] += 1
                made["span_tokens"] += s.meta["span_tokens"]
                made["gap_tokens"] += gap
                space -= n
                if space:
                    row_starts_l.append(seq_len - space)
            row, pad = np.concatenate(pieces), np.concatenate(masks)
            row_starts = np.asarray([*row_starts_l, seq_len], np.int32)
            made["loss_tokens"] += int(loss_mask(row_starts, pad).sum())
            if progress and (j - len(plain) + 1) % 1024 == 0:
                progress(f"copy rows: {j - len(plain) + 1:,}/{made_copies:,}")
            yield row, row_starts, pad

    _write_train_split(data_dir, total, seq_len, info.vocab_size, "copy", made_rows())
    samples, loss_tokens = made["samples"], made["loss_tokens"]

    t = info.train
    train = replace(t, rows=total, tokens=t.tokens + made_copies * seq_len, loss_tokens=t.loss_tokens + loss_tokens,
                    segments=t.segments + samples, documents=t.documents + samples,
                    document_instances=t.document_instances + samples)
    record = {"rows": made_copies, "plain_rows": total - made_copies, "share": share,
              "first_copy_row": total - made_copies, "curriculum_rows": curriculum_rows_for(rows, share),
              "keep_rows": keep_rows, "keep_slots": keep_slots, "seq_len": seq_len, "samples": samples,
              "span_tokens": [lo, hi], "mean_span_tokens": made["span_tokens"] / max(samples, 1),
              "gap_tokens": [glo, ghi], "mean_gap_tokens": made["gap_tokens"] / max(samples, 1),
              "loss_tokens": loss_tokens, "pool": int(pool.size), "draw": draw, "marker_tokens": int(mark.size),
              "seed": seed}
    _commit(data_dir, COPY_FILE, record, replace(info, train=train))
    if progress:
        progress(f"copy curriculum: {rows:,} rows ({samples:,} samples, spans of {lo}-{hi} ids drawn {draw} from "
                 f"{pool.size:,}) "
                 f"read as {share:.0%} of the first {record['curriculum_rows']:,} rows"
                 + (f", then {keep_rows:,} more as {keep_rows / keep_slots:.1%} of the next {keep_slots:,}"
                    if keep_rows else ""))
    return record


def read_copy(data_dir: str | Path) -> dict[str, Any] | None:
    """What :func:`add_copy_rows` recorded, or None where the split has no copy curriculum."""
    path = Path(data_dir) / COPY_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def copy_metrics(record: dict[str, Any] | None) -> dict[str, float]:
    """Flat MLflow metrics of an :func:`add_copy_rows` record (empty without one)."""
    if not record:
        return {}
    return {f"copy_curriculum.{k}": record[k] for k in ("rows", "samples", "loss_tokens", "curriculum_rows",
                                                        "share", "mean_span_tokens", "mean_gap_tokens", "keep_rows")
            if k in record}  # records written before gaps existed lack mean_gap_tokens


def read_retrieval(data_dir: str | Path) -> dict[str, Any] | None:
    """What :func:`add_retrieval_rows` recorded, or None where the split has no retrieval rows."""
    path = Path(data_dir) / RETRIEVAL_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def retrieval_metrics(record: dict[str, Any] | None, prefix: str = "retrieval") -> dict[str, float]:
    """Flat MLflow metrics of a :func:`add_retrieval_rows` record (empty without one)."""
    if not record:
        return {}
    out = {f"{prefix}.rows": record["rows"], f"{prefix}.samples": record["samples"],
           f"{prefix}.tokens": record["tokens"], f"{prefix}.answer_tokens": record["answer_tokens"],
           f"{prefix}.share_of_rows": record["share_of_rows"]}
    for kind, c in record["by_kind"].items():
        out |= {f"{prefix}.{kind}.samples": c["samples"], f"{prefix}.{kind}.answer_tokens": c["answer_tokens"]}
    return out


