"""Packed training data for the ``pretrain`` stage: a mixture turned into fixed-length token rows.

Inputs are three artifacts: the ``mixture`` (data/mix.py: per document, in input order, its ``sample_count`` and its
``tokens`` incl. BOS/EOS), the ``scored_documents`` it was planned from (data/documents.py) and the ``tokenizer``
(data/tokenizer.py). :func:`build_packed_dataset` writes:

* ``train_tokens.npy`` int32 [rows, seq_len]: every document with ``sample_count > 0`` appears exactly
  ``sample_count`` times (§4.1.3.2: the mixture's repetition is what the model sees), as ``[BOS] + ids + [EOS]``,
  the instances in a deterministic shuffle of ``seed``, concatenated and cut into rows. A document that does not fit
  in the rest of a row continues at the start of the next row (a *continuation* segment). Nothing is dropped: the
  last row is padded with PAD, and pad positions are out of the loss.
* ``train_segment_starts.npy`` int32 and ``train_segment_index.npy`` int64 [rows + 1]: row ``i``'s
  segment starts are ``starts[index[i]:index[i + 1]]``, row-local, beginning with 0 and ending with
  ``seq_len``; a padded tail is a segment of its own. These are the varlen boundaries (§3.2: packed
  documents reset the lightning state and mask softmax attention at each boundary).
* ``eval_*``: the same for the held-out documents, each once, in id-hash order.
* ``unigram_counts.npy`` int64 [vocab]: token counts over the training rows' non-pad tokens.
* ``eval_documents.json``: the held-out ids; ``packing.json``: :class:`PackedDatasetInfo`.

Memory is O(number of documents) plus one document: every used document is tokenized once and appended to a scratch
file of unique tokens; rows are then copied from that file (memory-mapped) in shuffled order through a fixed-size
buffer straight to disk. Every file is written under a temporary name and renamed into place.

Reading: :class:`PackedRows` (memory-mapped rows), :func:`make_batch` (B rows -> one packed sequence with
``cu_seqlens``, restarting ``position_ids`` and labels masked at segment starts and padding), :class:`RowLoader`
(resumable, rank-sharded row order over epochs) and :func:`unigram_loss` (the baseline eval loss a trained model
must beat).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import torch

from data.documents import iter_documents, unit_hash
from data.mix import PACKING_TOKENS_PER_DOC, iter_mixture
from data.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
from pipeline.artifacts import atomic_file

FORMAT_VERSION = 1
INFO_FILE = "packing.json"
UNIGRAM_FILE = "unigram_counts.npy"
EVAL_IDS_FILE = "eval_documents.json"
COPY_FILE = "copy_curriculum.json"  # a copy curriculum's rows and schedule (pretrain/retrieval_rows.add_copy_rows)
SPLITS = ("train", "eval")
IGNORE_INDEX = -100  # transformers' cross-entropy ignore index
TOKEN_DTYPE = np.dtype("<i4")
# numpy SeedSequence ignores trailing zeros ([s] == [s, 0]): every purpose gets a distinct nonzero tag
_SHUFFLE_TAG = 1  # order of the training document instances
_LOADER_TAG = 2  # RowLoader's per-epoch row permutations
# documents whose near-duplicates are assumed seen elsewhere (data/mix.py ZERO_REASONS): last choice for eval
_SEEN_ELSEWHERE_REASON = "duplicates_exhaust_cap"
_ENCODE_BATCH_DOCS = 256
_ENCODE_BATCH_CHARS = 8_000_000  # bounds the texts held at once (a single larger document is encoded alone)
_WRITE_BUFFER_TOKENS = 1 << 20  # rows are copied to disk through a buffer of about this many tokens
_PROGRESS_EVERY_S = 5.0


class TokenCountMismatchError(ValueError):
    """A document's token count differs from the mixture's: wrong tokenizer or documents artifact."""


def split_file(split: str, what: str) -> str:
    """Name of a split's file in the packed artifact, e.g. ``train_tokens.npy``."""
    return f"{split}_{what}.npy"


# --- what packing.json holds --------------------------------------------------------------------
@dataclass(frozen=True)
class SplitInfo:
    rows: int  # rows of seq_len tokens
    tokens: int  # real (non-pad) tokens
    pad_tokens: int  # PAD at the end of the last row; out of the loss
    loss_tokens: int  # label positions that count: tokens minus one per real segment (its first token)
    segments: int  # real segments (document pieces), incl. continuations; the pad tail is not counted
    continuation_segments: int  # rows that start in the middle of a document
    documents: int  # distinct documents
    document_instances: int  # documents x times each appears


@dataclass(frozen=True)
class PackedDatasetInfo:
    format_version: int
    seq_len: int
    seed: int
    vocab_size: int
    special_ids: dict[str, int]  # bos, eos, pad
    train: SplitInfo
    eval: SplitInfo
    mixture_documents: int  # rows of the mixture manifest
    mixture_tokens: int  # sum(tokens x sample_count) in the mixture
    unused_documents: int  # sample_count 0 and not chosen for eval
    eval_from_unsampled: int  # eval documents the mixture never trained on
    held_out_from_training: int  # eval documents taken from the training set (not enough unsampled ones)
    held_out_training_tokens: int  # their tokens x sample_count, removed from training
    # the seed that chose the held-out documents: the pretraining run's, carried unchanged (like the four fields
    # above) by the stages that continue its checkpoint with a seed of their own (long_context); None in a
    # packing.json written before it was recorded, whose `seed` is then the one (see :func:`heldout_seed`)
    heldout_seed: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PackedDatasetInfo:
        d = dict(d)
        for split in SPLITS:
            d[split] = SplitInfo(**d[split])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def split(self, name: str) -> SplitInfo:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}: use one of {SPLITS}")
        return self.train if name == "train" else self.eval


def _save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_file(path) as f:
        np.save(f, array, allow_pickle=False)


def _npy_header(f: IO[bytes], dtype: np.dtype, shape: tuple[int, ...]) -> None:
    np.lib.format.write_array_header_1_0(
        f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})


class _Progress:
    def __init__(self, report: Callable[[str], None] | None) -> None:
        self.report = report
        self.last = time.monotonic()

    def __call__(self, message: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.report is not None and (force or now - self.last >= _PROGRESS_EVERY_S):
            self.last = now
            self.report(message)


# --- planning: which documents, how often, where ------------------------------------------------
@dataclass
class _MixtureTable:
    ids: list[str]
    counts: np.ndarray  # int64 sample_count per document
    tokens: np.ndarray  # int64 tokens per document incl. BOS/EOS
    seen_elsewhere: np.ndarray  # bool: zero_reason says its duplicates are trained on anyway


def _read_mixture(mixture_dir: Path) -> _MixtureTable:
    ids: list[str] = []
    counts: list[int] = []
    tokens: list[int] = []
    seen: list[bool] = []
    for row in iter_mixture(mixture_dir):
        ids.append(row["id"])
        counts.append(int(row["sample_count"]))
        tokens.append(int(row["tokens"]))
        seen.append(row.get("zero_reason") == _SEEN_ELSEWHERE_REASON)
    if not ids:
        raise ValueError(f"mixture {mixture_dir} lists no documents")
    if len(set(ids)) != len(ids):
        raise ValueError(f"mixture {mixture_dir} lists some document id more than once; ids must be unique "
                         "(dedup upstream guarantees this: was the mixture edited by hand?)")
    table = _MixtureTable(ids, np.asarray(counts, np.int64), np.asarray(tokens, np.int64), np.asarray(seen))
    if (table.counts < 0).any() or (table.tokens < PACKING_TOKENS_PER_DOC).any():
        bad = int(np.flatnonzero((table.counts < 0) | (table.tokens < PACKING_TOKENS_PER_DOC))[0])
        raise ValueError(f"mixture {mixture_dir}: document {ids[bad]!r} has sample_count={counts[bad]} and "
                         f"tokens={tokens[bad]}; expected sample_count >= 0 and tokens >= "
                         f"{PACKING_TOKENS_PER_DOC} (BOS + EOS)")
    return table


def heldout_seed(packing: dict[str, Any]) -> int:
    """The seed that chose a checkpoint's held-out documents, from its ``packing.json`` (:class:`PackedDatasetInfo`)."""
    seed = packing.get("heldout_seed")
    return int(packing["seed"] if seed is None else seed)


def _choose_eval(table: _MixtureTable, seed: int, eval_documents: int) -> np.ndarray:
    """Indices of the held-out documents, in id-hash order.

    Preference: never trained on (sample_count 0); then sample_count 0 but marked as seen through its
    duplicates; then, only if still short, sampled documents (which are then removed from training).
    Within each tier the order is ``unit_hash(seed, "eval", id)``: stable under adding documents.
    """
    if eval_documents > len(table.ids):
        raise ValueError(f"eval_documents={eval_documents} but the mixture holds only {len(table.ids)} "
                         "documents; lower eval_documents")
    key = np.asarray([unit_hash(seed, "eval", i) for i in table.ids])
    tier = np.where(table.counts > 0, 2, np.where(table.seen_elsewhere, 1, 0))
    chosen = np.lexsort((key, tier))[:eval_documents]  # by tier, then by hash
    return chosen[np.argsort(key[chosen], kind="stable")]


# --- tokenizing once into the unique-token scratch file ----------------------------------------
def _tokenize_used(documents_dir: Path, tokenizer: Any, table: _MixtureTable, used: np.ndarray,
                   special: dict[str, int], scratch: Path, progress: _Progress) -> np.ndarray:
    """Append ``[BOS] + ids + [EOS]`` of every used document to ``scratch``; return per-document offsets."""
    offsets = np.full(len(table.ids), -1, np.int64)
    bos = np.asarray([special["bos"]], TOKEN_DTYPE).tobytes()
    eos = np.asarray([special["eos"]], TOKEN_DTYPE).tobytes()
    n_used = int(used.sum())
    position = 0
    done = 0
    batch: list[tuple[int, str]] = []
    batch_chars = 0

    def flush(f: IO[bytes]) -> None:
        nonlocal position, done, batch_chars
        encodings = tokenizer.encode_batch_fast([t for _, t in batch], add_special_tokens=False)
        for (i, _), enc in zip(batch, encodings, strict=True):
            ids = np.asarray(enc.ids, TOKEN_DTYPE)
            if ids.size + PACKING_TOKENS_PER_DOC != table.tokens[i]:
                raise TokenCountMismatchError(
                    f"document {table.ids[i]!r} (#{i} of {documents_dir}) encodes to {ids.size} tokens + "
                    f"{PACKING_TOKENS_PER_DOC} BOS/EOS = {ids.size + PACKING_TOKENS_PER_DOC}, but the mixture "
                    f"says {int(table.tokens[i])}: the mixture was planned with a different tokenizer or "
                    "documents artifact; pass the tokenizer and scored_documents the mix stage read")
            offsets[i] = position
            f.write(bos)
            f.write(ids.data)
            f.write(eos)
            position += ids.size + PACKING_TOKENS_PER_DOC
        done += len(batch)
        batch.clear()
        batch_chars = 0
        progress(f"tokenized {done:,}/{n_used:,} documents ({position:,} tokens)")

    n_docs = 0
    with open(scratch, "wb") as f:
        for n_docs, rec in enumerate(iter_documents(documents_dir), 1):
            i = n_docs - 1
            if i >= len(table.ids) or rec["id"] != table.ids[i]:
                expected = table.ids[i] if i < len(table.ids) else "(end of the mixture)"
                raise ValueError(
                    f"documents {documents_dir} hold {rec['id']!r} at position {i} where the mixture lists "
                    f"{expected!r}: this is not the scored_documents artifact the mixture was planned from")
            if not used[i]:
                continue
            batch.append((i, rec["text"]))
            batch_chars += len(rec["text"])
            if len(batch) >= _ENCODE_BATCH_DOCS or batch_chars >= _ENCODE_BATCH_CHARS:
                flush(f)
        if batch:
            flush(f)
    if n_docs != len(table.ids):
        raise ValueError(f"documents {documents_dir} hold {n_docs} documents but the mixture lists "
                         f"{len(table.ids)}: this is not the scored_documents artifact the mixture was planned from")
    return offsets


# --- packing one split --------------------------------------------------------------------------
def _segment_layout(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Row-local segment starts and the per-row index for instances of ``lengths`` packed in order.

    A segment starts at every document instance and at every row start (a document cut by a row end
    continues as a new segment); the padded tail of the last row is one more segment.
    """
    total = int(lengths.sum())
    rows = -(-total // seq_len)
    pad = rows * seq_len - total
    doc_starts = np.cumsum(lengths) - lengths  # global positions, strictly increasing (lengths >= 2)
    row_starts = np.arange(rows, dtype=np.int64) * seq_len
    bounds = np.union1d(doc_starts, row_starts)
    if pad:
        bounds = np.append(bounds, total)
    row_of = bounds // seq_len
    per_row = np.bincount(row_of, minlength=rows)  # >= 1: every row starts a segment
    index = np.zeros(rows + 1, np.int64)
    index[1:] = np.cumsum(per_row + 1)  # + the closing seq_len
    starts = np.empty(int(index[-1]), np.int32)
    rank_in_row = np.arange(bounds.size) - (np.cumsum(per_row) - per_row)[row_of]
    starts[index[row_of] + rank_in_row] = bounds % seq_len
    starts[index[1:] - 1] = seq_len
    real_segments = int(bounds.size) - (1 if pad else 0)
    continuation = rows - int(np.count_nonzero(doc_starts % seq_len == 0))
    stats = {"rows": rows, "tokens": total, "pad_tokens": pad, "loss_tokens": total - real_segments,
             "segments": real_segments, "continuation_segments": continuation}
    return starts, index, stats


def _pack_split(out_dir: Path, split: str, order: np.ndarray, table: _MixtureTable, offsets: np.ndarray,
                unique: np.ndarray | None, seq_len: int, pad_id: int, vocab_size: int,
                progress: _Progress) -> tuple[SplitInfo, np.ndarray]:
    """Write a split's rows (instances of ``order`` concatenated) and boundaries; return info + unigram counts."""
    lengths = table.tokens[order]
    starts, index, stats = _segment_layout(lengths, seq_len)
    rows = stats["rows"]
    counts = np.zeros(vocab_size, np.int64)
    rows_per_flush = max(1, _WRITE_BUFFER_TOKENS // seq_len)
    buf = np.empty(rows_per_flush * seq_len, TOKEN_DTYPE)
    fill = 0
    written = 0

    def flush(f: IO[bytes], real: int, padded_to: int) -> None:
        nonlocal written
        if int(buf[:real].max(initial=0)) >= vocab_size:
            raise ValueError(f"{split} rows hold token id {int(buf[:real].max())} >= vocab size {vocab_size}: "
                             "the tokenizer artifact is inconsistent")
        counts[:] += np.bincount(buf[:real], minlength=vocab_size)
        buf[real:padded_to] = pad_id
        f.write(buf[:padded_to].data)
        written += padded_to // seq_len
        progress(f"{split}: wrote {written:,}/{rows:,} rows")

    with atomic_file(out_dir / split_file(split, "tokens")) as f:
        _npy_header(f, TOKEN_DTYPE, (rows, seq_len))
        if order.size and unique is None:
            raise RuntimeError(f"packing {split}: no tokens were written for its documents (a bug in pretrain/packed_data.py)")
        for first in range(0, order.size, 65536):
            for d in order[first:first + 65536].tolist():
                off, n = int(offsets[d]), int(table.tokens[d])
                done = 0
                while done < n:  # a long document runs over as many buffer flushes as it needs
                    take = min(n - done, buf.size - fill)
                    buf[fill:fill + take] = unique[off + done:off + done + take]
                    fill += take
                    done += take
                    if fill == buf.size:
                        flush(f, fill, fill)
                        fill = 0
        if fill:
            flush(f, fill, -(-fill // seq_len) * seq_len)
    if written != rows:
        raise RuntimeError(f"packing {split}: wrote {written} rows, planned {rows} (a bug in pretrain/packed_data.py)")
    _save_npy(out_dir / split_file(split, "segment_starts"), starts)
    _save_npy(out_dir / split_file(split, "segment_index"), index)
    info = SplitInfo(**stats, documents=int(np.unique(order).size), document_instances=int(order.size))
    return info, counts


def build_packed_dataset(mixture_dir: str | Path, documents_dir: str | Path, tokenizer_dir: str | Path,
                         out_dir: str | Path, *, seq_len: int, seed: int, eval_documents: int,
                         progress: Callable[[str], None] | None = None,
                         scratch_dir: str | Path | None = None) -> PackedDatasetInfo:
    """Pack a mixture into training and held-out eval rows of ``seq_len`` tokens (module docstring).

    ``scratch_dir`` holds the temporary unique-token file (about the size of the used documents'
    tokens x 4 bytes); default ``out_dir``. It is removed before returning.
    """
    from tokenizers import Tokenizer  # heavy: tokenizers (Rust extension), only where documents are tokenized

    mixture_dir, documents_dir, tokenizer_dir = Path(mixture_dir), Path(documents_dir), Path(tokenizer_dir)
    out_dir = Path(out_dir)
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: a row needs at least 2 tokens (one prediction)")
    if seed < 0:
        raise ValueError(f"seed={seed}: use a non-negative integer (numpy SeedSequence)")
    if eval_documents < 0:
        raise ValueError(f"eval_documents={eval_documents}: use 0 or more")
    tok_file = tokenizer_dir / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file} not found: tokenizer_dir must be a tokenizer artifact "
                                "(data/tokenizer.py writes tokenizer.json)")
    tokenizer = Tokenizer.from_file(str(tok_file))
    special = {}
    for name, token in (("bos", BOS_TOKEN), ("eos", EOS_TOKEN), ("pad", PAD_TOKEN)):
        tid = tokenizer.token_to_id(token)
        if tid is None:
            raise ValueError(f"{tok_file} has no {token!r} token: packing needs BOS/EOS/PAD "
                             "(train it with data/tokenizer.py, which adds them)")
        special[name] = int(tid)
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    report = _Progress(progress)

    table = _read_mixture(mixture_dir)
    eval_idx = _choose_eval(table, seed, eval_documents)
    is_eval = np.zeros(len(table.ids), bool)
    is_eval[eval_idx] = True
    train_counts = np.where(is_eval, 0, table.counts)
    if not (train_counts > 0).any():
        raise ValueError(f"mixture {mixture_dir}: no document is left for training ({int((table.counts > 0).sum())} "
                         f"sampled, eval_documents={eval_documents}); lower eval_documents")
    held_out = is_eval & (table.counts > 0)

    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(scratch_dir or out_dir) / f".unique_tokens-{os.getpid()}.int32"
    try:
        report(f"tokenizing {int(((train_counts > 0) | is_eval).sum()):,} used documents of "
               f"{len(table.ids):,}", force=True)
        offsets = _tokenize_used(documents_dir, tokenizer, table, (train_counts > 0) | is_eval, special,
                                 scratch, report)
        unique = np.memmap(scratch, TOKEN_DTYPE, mode="r") if scratch.stat().st_size else None
        # §4.1.3.2: each document appears exactly sample_count times, the instances shuffled
        instances = np.repeat(np.arange(len(table.ids)), train_counts)
        instances = np.random.default_rng([seed, _SHUFFLE_TAG]).permutation(instances)
        train, unigram = _pack_split(out_dir, "train", instances, table, offsets, unique, seq_len,
                                     special["pad"], vocab_size, report)
        ev, _ = _pack_split(out_dir, "eval", eval_idx, table, offsets, unique, seq_len, special["pad"],
                            vocab_size, report)
        del unique
    finally:
        scratch.unlink(missing_ok=True)

    info = PackedDatasetInfo(
        format_version=FORMAT_VERSION, seq_len=seq_len, seed=seed, vocab_size=vocab_size, special_ids=special,
        train=train, eval=ev, mixture_documents=len(table.ids),
        mixture_tokens=int((table.tokens * table.counts).sum()),
        unused_documents=int(((table.counts == 0) & ~is_eval).sum()),
        eval_from_unsampled=int((is_eval & (table.counts == 0)).sum()),
        held_out_from_training=int(held_out.sum()),
        held_out_training_tokens=int((table.tokens * table.counts)[held_out].sum()), heldout_seed=seed)
    if info.train.tokens + info.held_out_training_tokens != info.mixture_tokens:
        raise RuntimeError(f"packing lost tokens: {info.train.tokens} trained + {info.held_out_training_tokens} "
                           f"held out != {info.mixture_tokens} in the mixture (a bug in pretrain/packed_data.py)")
    if int(unigram.sum()) != info.train.tokens:
        raise RuntimeError("unigram counts do not cover the training tokens (a bug in pretrain/packed_data.py)")
    _save_npy(out_dir / UNIGRAM_FILE, unigram)
    eval_ids = [{"id": table.ids[i], "held_out_from_training": bool(held_out[i])} for i in eval_idx]
    with atomic_file(out_dir / EVAL_IDS_FILE) as f:
        f.write((json.dumps(eval_ids, indent=0) + "\n").encode())
    with atomic_file(out_dir / INFO_FILE) as f:  # last: its presence means the rest is complete
        f.write(info.to_json().encode())
    report(f"packed {train.rows:,} train rows ({train.tokens:,} tokens, {train.pad_tokens} pad) and "
           f"{ev.rows:,} eval rows from {ev.documents} held-out documents "
           f"({info.held_out_from_training} taken from training)", force=True)
    return info


# --- reading ------------------------------------------------------------------------------------
def read_info(path: str | Path) -> PackedDatasetInfo:
    """``packing.json`` of a packed dataset directory."""
    f = Path(path) / INFO_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: {path} is not a packed dataset (build_packed_dataset "
                                "writes packing.json last, so a missing one means an unfinished build)")
    return PackedDatasetInfo.from_dict(json.loads(f.read_text()))


class PackedRows:
    """Memory-mapped rows of one split: ``row(i) -> (tokens [seq_len], segment_starts [n + 1], pad_mask)``.

    ``pad_mask`` marks the positions whose label does not count besides segment starts: the padding at the end of
    the last row, or, where the split has a ``<split>_no_loss.npy`` (bool [rows, seq_len], written by the
    long-context phases, ``pretrain/long_mix.py``), the positions it marks: padding anywhere and the context of a
    long-QA sample, whose answer alone is the target.
    """

    def __init__(self, path: str | Path, split: Literal["train", "eval"] = "train") -> None:
        self.path = Path(path)
        self.info = read_info(self.path)
        self.split = split
        self.split_info = self.info.split(split)
        self.seq_len = self.info.seq_len
        self.pad_id = self.info.special_ids["pad"]
        self.tokens = np.load(self.path / split_file(split, "tokens"), mmap_mode="r")
        self.segment_starts = np.load(self.path / split_file(split, "segment_starts"), mmap_mode="r")
        self.segment_index = np.load(self.path / split_file(split, "segment_index"))
        no_loss = self.path / split_file(split, "no_loss")
        self.no_loss = np.load(no_loss, mmap_mode="r") if no_loss.is_file() else None
        if self.tokens.shape != (self.split_info.rows, self.seq_len) or \
                self.segment_index.shape != (self.split_info.rows + 1,) or \
                (self.no_loss is not None and self.no_loss.shape != self.tokens.shape):
            raise ValueError(f"{self.path}: {split} files disagree with packing.json (tokens "
                             f"{self.tokens.shape}, index {self.segment_index.shape}, expected "
                             f"{self.split_info.rows} rows of {self.seq_len}); rebuild the packed dataset")

    def __len__(self) -> int:
        return self.split_info.rows

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range: the {self.split} split has {n} rows")
        i %= n
        tokens = np.asarray(self.tokens[i])
        starts = np.asarray(self.segment_starts[self.segment_index[i]:self.segment_index[i + 1]])
        if self.no_loss is not None:
            return tokens, starts, np.array(self.no_loss[i], bool)
        pad_mask = np.zeros(self.seq_len, bool)
        if i == n - 1 and self.split_info.pad_tokens:  # only the last row is padded, at its end
            pad_mask[self.seq_len - self.split_info.pad_tokens:] = True
        return tokens, starts, pad_mask


def loss_mask(segment_starts: np.ndarray, pad_mask: np.ndarray) -> np.ndarray:
    """bool [seq_len]: label positions that count. Causal LM loss shifts labels by one, so the label at a
    segment's first token is the prediction from the previous segment's last token: masked, as is padding."""
    keep = ~np.asarray(pad_mask, bool)
    keep[np.asarray(segment_starts[:-1], np.int64)] = False
    return keep


@dataclass
class Batch:
    """B packed rows flattened into one sequence, as ``HybridForCausalLM`` takes packed documents."""

    input_ids: torch.Tensor  # int64 [1, B * seq_len]
    labels: torch.Tensor  # int64 [1, B * seq_len]; -100 at segment starts and padding
    cu_seqlens: torch.Tensor  # int32 [n_segments + 1] over the flattened tokens; every row start is a boundary
    position_ids: torch.Tensor  # int64 [1, B * seq_len], from 0 in each segment
    tokens: int  # label positions that count
    rows: tuple[int, ...]  # the row indices it holds

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device, non_blocking=True), self.labels.to(device, non_blocking=True),
                     self.cu_seqlens.to(device, non_blocking=True), self.position_ids.to(device, non_blocking=True),
                     self.tokens, self.rows)


def make_batch(rows: PackedRows, indices: Sequence[int]) -> Batch:
    """Flatten rows ``indices`` into one packed sequence with its boundaries, positions and labels."""
    if len(indices) == 0:
        raise ValueError("make_batch needs at least one row index")
    L = rows.seq_len
    ids = np.empty(len(indices) * L, np.int64)
    labels = np.empty_like(ids)
    positions = np.empty_like(ids)
    cu: list[np.ndarray] = []
    for b, i in enumerate(indices):
        tokens, starts, pad = rows.row(int(i))
        s = slice(b * L, (b + 1) * L)
        ids[s] = tokens
        labels[s] = np.where(loss_mask(starts, pad), tokens, IGNORE_INDEX)
        seg_len = np.diff(starts.astype(np.int64))
        positions[s] = np.arange(L) - np.repeat(starts[:-1].astype(np.int64), seg_len)
        cu.append(starts[:-1].astype(np.int64) + b * L)
    cu.append(np.asarray([len(indices) * L]))
    return Batch(input_ids=torch.from_numpy(ids)[None], labels=torch.from_numpy(labels)[None],
                 cu_seqlens=torch.from_numpy(np.concatenate(cu).astype(np.int32)),
                 position_ids=torch.from_numpy(positions)[None], tokens=int((labels != IGNORE_INDEX).sum()),
                 rows=tuple(int(i) for i in indices))


class RowLoader:
    """Row indices for training: a permutation of all rows per epoch (from ``(seed, epoch)``), walked in
    order; rank ``r`` of ``world_size`` takes every ``world_size``-th slot starting at ``r``, so ranks
    never share a row within an epoch. The state is the position in the global order (not a batch
    index), so the number of rows per call may change (batch-size schedule) and a resumed loader
    continues exactly where the saved one was. Every rank must request the same ``num_rows`` per call.
    ``shuffle=False`` walks the rows in their stored order every epoch (a long-context phase's rows follow its
    source schedule, ``pretrain/long_mix.py``).
    """

    def __init__(self, rows: PackedRows | int, *, seed: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True) -> None:
        self.num_rows = rows if isinstance(rows, int) else len(rows)
        if self.num_rows <= 0:
            raise ValueError("RowLoader needs at least one row (the packed split is empty)")
        if seed < 0:
            raise ValueError(f"seed={seed}: use a non-negative integer (numpy SeedSequence)")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.position = 0  # next slot of the current epoch's permutation (global, over all ranks)
        self.epoch = 0  # completed passes over the rows
        self._perms: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, _LOADER_TAG, epoch]).permutation(self.num_rows)
        return self._perms[epoch]

    def next_indices(self, num_rows: int) -> list[int]:
        """This rank's next ``num_rows`` row indices; advances every rank's shared position."""
        if num_rows < 1:
            raise ValueError(f"num_rows={num_rows}: ask for at least one row")
        slots = self.position + np.arange(num_rows, dtype=np.int64) * self.world_size + self.rank
        out = np.empty(num_rows, np.int64)
        for e in np.unique(slots // self.num_rows).tolist():
            sel = slots // self.num_rows == e
            out[sel] = self._permutation(self.epoch + e)[slots[sel] % self.num_rows]
        end = self.position + num_rows * self.world_size
        self.epoch += end // self.num_rows
        self.position = end % self.num_rows
        return out.tolist()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "epoch": self.epoch, "seed": self.seed, "rows": self.num_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("rows", self.num_rows) != self.num_rows or state.get("seed", self.seed) != self.seed:
            raise ValueError(f"RowLoader state was saved over {state.get('rows')} rows with seed {state.get('seed')}, "
                             f"this loader has {self.num_rows} rows and seed {self.seed}: resume with the same "
                             "packed dataset and seed")
        position, epoch = int(state["position"]), int(state["epoch"])
        if not 0 <= position < self.num_rows or epoch < 0:
            raise ValueError(f"RowLoader state position={position}, epoch={epoch} is out of range for "
                             f"{self.num_rows} rows")
        self.position, self.epoch = position, epoch


class CurriculumLoader(RowLoader):
    """A :class:`RowLoader` whose first ``curriculum_rows`` global slots hold ``copy_rows`` curriculum rows
    (``pretrain/retrieval_rows.add_copy_rows``: stored after the split's other rows, from ``copy_start``), spread
    evenly and each read once, in order; every other slot takes the next row of the epochs over the other rows,
    exactly as a plain loader over those rows would (so the curriculum delays, but never drops, a plain row).

    Slot ``g`` (global, over all ranks) is a copy slot when ``c(g + 1) > c(g)``, with ``c(g) = min(g, U) * C // U``
    the copy slots before it (integer arithmetic: every rank agrees). The state is the slot counter alone.

    ``keep_rows`` ``K`` (the last copy rows) are read after the window, evenly over its next ``keep_slots`` ``S``:
    ``c(g)`` gains ``clip(g - U, 0, S) * K // S`` (``copy_keep_share``); after those slots, plain rows alone.
    """

    def __init__(self, rows: PackedRows | int, *, copy_start: int, copy_rows: int, curriculum_rows: int, seed: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, keep_rows: int = 0,
                 keep_slots: int = 0) -> None:
        total = rows if isinstance(rows, int) else len(rows)
        if not 0 < copy_start < total or copy_start + copy_rows != total or copy_rows < 1:
            raise ValueError(f"copy rows [{copy_start}, {copy_start + copy_rows}) must be the last of the split's "
                             f"{total} rows, after at least one other row")
        if not 0 <= keep_rows < copy_rows or not keep_rows <= keep_slots or (keep_slots and not keep_rows):
            raise ValueError(f"keep_rows={keep_rows}, keep_slots={keep_slots}: need 0 <= keep_rows < copy_rows="
                             f"{copy_rows} and keep_rows <= keep_slots (both 0 without rows kept after the window)")
        if curriculum_rows < copy_rows - keep_rows:
            raise ValueError(f"curriculum_rows={curriculum_rows} < the window's copy rows {copy_rows - keep_rows}")
        super().__init__(copy_start, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle)
        self.total_rows, self.copy_start, self.copy_rows, self.curriculum_rows = total, copy_start, copy_rows, curriculum_rows
        self.keep_rows, self.keep_slots = keep_rows, keep_slots
        self.slot = 0  # next global slot

    def copies_before(self, slots: np.ndarray) -> np.ndarray:
        """Copy slots among the global slots ``[0, g)``, for each ``g`` in ``slots``."""
        before = np.minimum(slots, self.curriculum_rows) * (self.copy_rows - self.keep_rows) // self.curriculum_rows
        if not self.keep_rows:
            return before
        return before + np.clip(slots - self.curriculum_rows, 0, self.keep_slots) * self.keep_rows // self.keep_slots

    def next_indices(self, num_rows: int) -> list[int]:
        if num_rows < 1:
            raise ValueError(f"num_rows={num_rows}: ask for at least one row")
        g = self.slot + np.arange(num_rows, dtype=np.int64) * self.world_size + self.rank
        before = self.copies_before(g)
        is_copy = self.copies_before(g + 1) > before
        out = np.empty(num_rows, np.int64)
        out[is_copy] = self.copy_start + before[is_copy]
        plain = (g - before)[~is_copy]  # the plain rows' own slot counter
        picked = np.empty(plain.size, np.int64)
        for e in np.unique(plain // self.num_rows).tolist():
            sel = plain // self.num_rows == e
            picked[sel] = self._permutation(e)[plain[sel] % self.num_rows]
        out[~is_copy] = picked
        self.slot += num_rows * self.world_size
        return out.tolist()

    def state_dict(self) -> dict[str, int]:
        return {"slot": self.slot, "seed": self.seed, "rows": self.total_rows, "copy_rows": self.copy_rows,
                "curriculum_rows": self.curriculum_rows, "keep_rows": self.keep_rows, "keep_slots": self.keep_slots}

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        saved = {"keep_rows": 0, "keep_slots": 0} | state  # a state saved before rows were kept after the window
        if "slot" not in state or any(saved.get(k) != mine[k] for k in ("seed", "rows", "copy_rows", "curriculum_rows",
                                                                        "keep_rows", "keep_slots")):
            raise ValueError(f"loader state {state} was not saved by this copy curriculum ({mine}): resume with the "
                             "same packed dataset and seed")
        if int(state["slot"]) < 0:
            raise ValueError(f"loader state slot={state['slot']} is negative")
        self.slot = int(state["slot"])


def make_loader(rows: PackedRows, *, seed: int, rank: int = 0, world_size: int = 1,
                shuffle: bool = True) -> RowLoader:
    """The training split's loader: a :class:`CurriculumLoader` where the split holds a copy curriculum
    (``copy_curriculum.json``, ``pretrain/retrieval_rows.add_copy_rows``), else a :class:`RowLoader`."""
    record = rows.path / COPY_FILE
    if rows.split == "train" and record.is_file():
        c = json.loads(record.read_text())
        return CurriculumLoader(rows, copy_start=c["first_copy_row"], copy_rows=c["rows"],
                                curriculum_rows=c["curriculum_rows"], seed=seed, rank=rank, world_size=world_size,
                                shuffle=shuffle, keep_rows=c.get("keep_rows", 0), keep_slots=c.get("keep_slots", 0))
    return RowLoader(rows, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle)


def unigram_loss(eval_rows: PackedRows, unigram_counts: np.ndarray) -> float:
    """Mean NLL (nats) of the eval label positions under the add-one smoothed unigram of the training tokens.

    A model that learned nothing but token frequencies scores this; the trained model's eval loss must
    be clearly below it. Positions are those :func:`make_batch` keeps (not -100).
    """
    counts = np.asarray(unigram_counts, np.int64)
    if counts.ndim != 1 or counts.size != eval_rows.info.vocab_size:
        raise ValueError(f"unigram_counts has shape {counts.shape}; expected ({eval_rows.info.vocab_size},), "
                         f"the vocab size of {eval_rows.path}")
    log_p = np.log(counts + 1.0) - math.log(float(counts.sum()) + counts.size)
    total = 0.0
    n = 0
    for i in range(len(eval_rows)):
        tokens, starts, pad = eval_rows.row(i)
        targets = tokens[loss_mask(starts, pad)]
        total -= float(log_p[targets].sum())
        n += targets.size
    if n == 0:
        raise ValueError(f"{eval_rows.path} ({eval_rows.split}) has no label positions: build it with "
                         "eval_documents > 0")
    return total / n
