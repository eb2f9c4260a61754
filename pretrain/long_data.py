"""Long-context data made from the corpus (§4.2 long-context extension; issue 11 item 2).

The corpus rarely holds documents as long as the long-context phases train on, so the ``long_context`` stage makes
them, and long question-answering samples from them:

* **Long documents** (:func:`assemble_long_documents`): the documents of one group (the mixture's ``domain``:
  ingest's ``source`` falls back to ``file:line``, unique per record, so it groups nothing) are concatenated in
  corpus order, ``[BOS] doc1 SEP doc2 SEP ... [EOS]`` with SEP the tokens of a blank line, into documents of
  exactly the target lengths asked (the targets are taken in turn, per group). A document cut at a target's end
  continues in the group's next long document. Only one unfinished long document per group is open at a time,
  held as spans of the token file: memory is O(members of the open ones), whatever the lengths. Every input
  document is accounted for: its tokens are either in long documents or in its group's unfinished tail
  (:class:`AssemblyStats`, which checks the sum).
* **Long QA** (:func:`make_long_qa`): a fact, "The access code of {name} is {number}.", is planted at one position
  (a word boundary nearest a drawn depth) of a long document, a question about it follows the document, and the
  number is the answer. Only the answer and the EOS after it are training targets (``no_loss`` is False there).

Both are token samples on disk (:class:`TokenSampleWriter` / :class:`TokenSamples`): ``<name>.bin`` (raw int32, the
samples back to back) and ``<name>.jsonl.gz`` (one index row per sample: offset, length and what it was made of),
each written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.documents import JsonlGzWriter, read_jsonl_gz
from data.mix import iter_mixture
from data.retrieval import word_starts as word_start_tokens  # noqa: F401  (one definition, re-exported for long_mix)
from data.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
from pipeline.artifacts import write_text_atomic
from pretrain.packed_data import TOKEN_DTYPE, _choose_eval, _Progress, _read_mixture, _tokenize_used

SEPARATOR_TEXT = "\n\n"  # between the documents of a long document
NEEDLE_TEMPLATE = " The access code of {name} is {number}."
QUESTION_TEMPLATE = "\n\nQuestion: What is the access code of {name}?\nAnswer:"
ANSWER_TEMPLATE = " {number}"
FIRST_NAMES = ("Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kira", "Luca",
               "Maya", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wen", "Yusuf")
LAST_NAMES = ("Abbott", "Brook", "Castell", "Dunmore", "Eriksen", "Falk", "Gallo", "Hart", "Ivers", "Jansen",
              "Kowal", "Lind", "Moreau", "Novak", "Ortiz", "Pike", "Quist", "Reyes", "Stone", "Toft", "Varga", "Wolfe")


# --- token samples on disk ------------------------------------------------------------------------------------
class TokenSampleWriter:
    """Appends token samples to ``<directory>/<name>.bin`` and their index rows to ``<name>.jsonl.gz``; both appear
    under their final names on :meth:`close` (a killed build leaves only temporary files)."""

    def __init__(self, directory: str | Path, name: str) -> None:
        self.dir, self.name = Path(directory), name
        self.dir.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self.dir / f".{name}.bin.tmp-{os.getpid()}"
        self._tmp_index = self.dir / f".{name}.jsonl.gz.tmp-{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 (closed in close())
        self._index = JsonlGzWriter(self._tmp_index)
        self.count, self.tokens = 0, 0

    def add(self, tokens: np.ndarray, **meta: Any) -> int:
        """Append one sample; returns its index."""
        arr = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
        self._index.write({"offset": self.tokens, "tokens": int(arr.size), **meta})
        self._bin.write(arr.data)
        self.tokens += int(arr.size)
        self.count += 1
        return self.count - 1

    def close(self) -> None:
        self._bin.close()
        self._index.close()
        os.replace(self._tmp_bin, self.dir / f"{self.name}.bin")
        os.replace(self._tmp_index, self.dir / f"{self.name}.jsonl.gz")

    def __enter__(self) -> TokenSampleWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # leave nothing under the final names
            self._bin.close()
            self._index.close()
            self._tmp_bin.unlink(missing_ok=True)
            self._tmp_index.unlink(missing_ok=True)


class TokenSamples:
    """The samples a :class:`TokenSampleWriter` wrote: ``tokens(i)`` (memory-mapped), ``meta[i]``, ``lengths``."""

    def __init__(self, directory: str | Path, name: str) -> None:
        path = Path(directory) / f"{name}.bin"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the long-context data in {directory} is incomplete")
        self.meta: list[dict[str, Any]] = list(read_jsonl_gz(Path(directory) / f"{name}.jsonl.gz"))
        self.offsets = np.asarray([m["offset"] for m in self.meta], np.int64)
        self.lengths = np.asarray([m["tokens"] for m in self.meta], np.int64)
        size = path.stat().st_size // TOKEN_DTYPE.itemsize
        if int(self.lengths.sum()) != size:
            raise ValueError(f"{path} holds {size} tokens but its index lists {int(self.lengths.sum())}: rebuild it")
        self._tokens = np.memmap(path, TOKEN_DTYPE, mode="r") if size else np.zeros(0, TOKEN_DTYPE)

    def __len__(self) -> int:
        return len(self.meta)

    def tokens(self, i: int) -> np.ndarray:
        return self._tokens[self.offsets[i]:self.offsets[i] + self.lengths[i]]


# --- long documents -------------------------------------------------------------------------------------------
@dataclass
class AssemblyStats:
    """What :func:`assemble_long_documents` did with its input; ``tokens_in == tokens_used + tokens_left``."""

    documents_in: int = 0
    tokens_in: int = 0  # the input documents' own tokens (no BOS/EOS)
    long_documents: int = 0
    long_document_tokens: int = 0  # incl. BOS, EOS and separators
    tokens_used: int = 0  # input tokens that are in long documents
    tokens_left: int = 0  # input tokens in the groups' unfinished tails
    documents_fully_used: int = 0
    documents_partly_used: int = 0  # cut: the start in a long document, the rest in the group's unfinished tail
    documents_unused: int = 0  # wholly in an unfinished tail
    groups: int = 0
    per_length: dict[str, int] = field(default_factory=dict)  # long documents per target length

    def check(self) -> None:
        if self.tokens_used + self.tokens_left != self.tokens_in or \
                self.documents_fully_used + self.documents_partly_used + self.documents_unused != self.documents_in:
            raise RuntimeError(f"long-document assembly lost track of its input: {asdict(self)} "
                               "(a bug in pretrain/long_data.py)")


@dataclass
class _OpenDocument:
    target: int
    pieces: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # (input index, first token, tokens)
    content: int = 0  # tokens between BOS and EOS so far (separators included)
    trailing: int = 0  # separator tokens after the last piece (when no more of the next document fitted)


def assemble_long_documents(documents: Iterable[tuple[str, str, np.ndarray]], targets: Sequence[int],
                            writer: TokenSampleWriter, *, bos: int, eos: int,
                            separator: Sequence[int]) -> AssemblyStats:
    """Concatenate ``documents`` -- ``(id, group, token ids without BOS/EOS)``, in corpus order -- group by group into
    long documents of exactly the ``targets`` lengths (module docstring), written to ``writer`` with their members
    (``[id, first token, end token]`` of each document piece). A long document's content (``targets - 2`` tokens
    between BOS and EOS) is its members joined by ``separator``, cut at that length: the member that does not fit
    continues in the group's next long document."""
    if not targets or min(targets) < 3:
        raise ValueError(f"long document lengths {list(targets)}: give at least one, each of 3 tokens or more")
    sep = np.asarray(separator, TOKEN_DTYPE)
    stats = AssemblyStats()
    open_docs: dict[str, _OpenDocument] = {}
    made: dict[str, int] = {}  # long documents made per group: its next target is targets[made % len(targets)]
    ids: list[str] = []
    lengths: list[int] = []
    used: list[int] = []  # tokens of each input document that are in a written long document

    def emit(group: str, doc: _OpenDocument) -> None:
        parts = [np.asarray([bos], TOKEN_DTYPE)]
        for k, (_, _, span) in enumerate(doc.pieces):
            parts += [sep, span] if k else [span]
        parts += [sep[:doc.trailing], np.asarray([eos], TOKEN_DTYPE)]
        tokens = np.concatenate(parts)
        if tokens.size != doc.target:
            raise RuntimeError(f"long document of {tokens.size} tokens, asked {doc.target} (a bug in long_data.py)")
        for i, _, span in doc.pieces:
            used[i] += span.size
        writer.add(tokens, id=f"long-{group}-{made.get(group, 0)}", group=group,
                   members=[[ids[i], first, first + int(span.size)] for i, first, span in doc.pieces])
        made[group] = made.get(group, 0) + 1
        stats.long_documents += 1
        stats.long_document_tokens += int(tokens.size)
        stats.per_length[str(doc.target)] = stats.per_length.get(str(doc.target), 0) + 1

    for doc_id, group, tokens in documents:
        i = len(ids)
        ids.append(doc_id)
        lengths.append(int(tokens.size))
        used.append(0)
        start = 0
        while start < tokens.size:
            doc = open_docs.get(group)
            if doc is None:
                doc = open_docs[group] = _OpenDocument(targets[made.get(group, 0) % len(targets)])
            budget = doc.target - 2 - doc.content
            gap = min(sep.size, budget) if doc.pieces else 0
            take = min(budget - gap, int(tokens.size) - start)
            if take > 0:
                doc.pieces.append((i, start, tokens[start:start + take]))
                doc.content += gap + take
                start += take
            else:  # only (part of) the separator fitted
                doc.content += gap
                doc.trailing = gap
            if doc.content >= doc.target - 2:
                emit(group, doc)
                del open_docs[group]
    stats.groups = len(set(made) | set(open_docs))
    n, u = np.asarray(lengths, np.int64), np.asarray(used, np.int64)
    stats.documents_in, stats.tokens_in = len(ids), int(n.sum())
    stats.tokens_used = int(u.sum())
    stats.tokens_left = stats.tokens_in - stats.tokens_used
    stats.documents_fully_used = int((u == n).sum())
    stats.documents_unused = int(((u == 0) & (n > 0)).sum())
    stats.documents_partly_used = stats.documents_in - stats.documents_fully_used - stats.documents_unused
    stats.check()
    return stats


# --- long QA --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LongQA:
    """One long QA sample: ``[BOS] context[:p] needle context[p:] question answer [EOS]``."""

    tokens: np.ndarray  # int32
    no_loss: np.ndarray  # bool: False only at the answer's tokens and the EOS after them (the training targets)
    meta: dict[str, Any]


def make_long_qa(context: np.ndarray, length: int, rng: np.random.Generator, tokenizer: Any,
                 word_start: np.ndarray, *, bos: int, eos: int, context_id: str) -> LongQA:
    """A sample of at most ``length`` tokens from ``context`` (token ids without BOS/EOS; cut to make room for the
    fact, the question and the answer): the fact about a drawn name and six-digit number is planted at the word
    boundary nearest a uniformly drawn depth, the question asks for the number, the number is the answer."""
    name = f"{FIRST_NAMES[rng.integers(len(FIRST_NAMES))]} {LAST_NAMES[rng.integers(len(LAST_NAMES))]}"
    number = int(rng.integers(100_000, 1_000_000))

    def encode(text: str) -> np.ndarray:
        return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, TOKEN_DTYPE)

    needle = encode(NEEDLE_TEMPLATE.format(name=name, number=number))
    question = encode(QUESTION_TEMPLATE.format(name=name))
    answer = encode(ANSWER_TEMPLATE.format(number=number))
    room = length - 2 - needle.size - question.size - answer.size
    if room < 1:
        raise ValueError(f"a long-QA sample needs more than {length} tokens (fact {needle.size}, question "
                         f"{question.size}, answer {answer.size} + BOS/EOS): use longer phases")
    ctx = np.asarray(context[:room], TOKEN_DTYPE)
    depth = float(rng.random())
    boundaries = np.flatnonzero(word_start[ctx])
    boundaries = np.concatenate([[0], boundaries, [ctx.size]])  # the start and the end are boundaries too
    p = int(boundaries[np.argmin(np.abs(boundaries - depth * ctx.size))])
    tokens = np.concatenate([[bos], ctx[:p], needle, ctx[p:], question, answer, [eos]]).astype(TOKEN_DTYPE)
    answer_start = tokens.size - 1 - answer.size
    no_loss = np.ones(tokens.size, bool)
    no_loss[answer_start:] = False
    meta = {"context_id": context_id, "name": name, "number": number, "answer": ANSWER_TEMPLATE.format(number=number),
            "drawn_depth": round(depth, 6), "depth": round(p / max(ctx.size, 1), 6), "context_tokens": int(ctx.size),
            "needle_start": 1 + p, "needle_end": 1 + p + int(needle.size), "answer_start": int(answer_start)}
    return LongQA(tokens, no_loss, meta)


# --- the stage's long data, built once ------------------------------------------------------------------------
CORPUS_TOKENS = "corpus.int32"  # [BOS] ids [EOS] of every held-in and held-out document, back to back
CORPUS_INDEX = "corpus_index.npz"
LONG_DOCUMENTS = "long_documents"  # assembled from held-in documents: what the phases train on
STATS_FILE = "long_data.json"


def eval_documents_name(seq_len: int) -> str:
    """Held-out documents assembled to a phase length: that phase's eval rows."""
    return f"eval_long_documents_{seq_len}"


def build_long_data(mixture_dir: str | Path, documents_dir: str | Path, tokenizer_dir: str | Path,
                    out_dir: str | Path, *, held_out_seed: int, held_out_documents: int, lengths: Sequence[int],
                    eval_lengths: Sequence[int], progress: Any = None) -> dict[str, Any]:
    """Tokenize the mixture's documents once and assemble the long documents, in ``out_dir`` (a fresh directory).

    The held-out documents are the pretraining run's (``pretrain/packed_data.py`` chooses them from ``held_out_seed`` and
    their number; the checkpoint's ``packing.json`` records both): the long documents are made of the documents it
    trained on (sample_count > 0, not held out), and each phase's eval rows of held-out documents assembled to the
    phase length. Returns (and writes to ``long_data.json``) the counts.
    """
    from tokenizers import Tokenizer  # heavy: tokenizers (Rust extension), only where documents are tokenized

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    special = {name: tokenizer.token_to_id(t)
               for name, t in (("bos", BOS_TOKEN), ("eos", EOS_TOKEN), ("pad", PAD_TOKEN))}
    report = _Progress(progress)
    table = _read_mixture(Path(mixture_dir))
    eval_idx = _choose_eval(table, held_out_seed, held_out_documents)
    is_eval = np.zeros(len(table.ids), bool)
    is_eval[eval_idx] = True
    held_in = (table.counts > 0) & ~is_eval
    domains = [row["domain"] for row in iter_mixture(mixture_dir)]
    report(f"tokenizing {int((held_in | is_eval).sum()):,} documents ({int(held_in.sum()):,} held in, "
           f"{int(is_eval.sum())} held out)", force=True)
    offsets = _tokenize_used(Path(documents_dir), tokenizer, table, held_in | is_eval, special,
                             out_dir / CORPUS_TOKENS, report)
    corpus = np.memmap(out_dir / CORPUS_TOKENS, TOKEN_DTYPE, mode="r")
    names, group_of = np.unique(np.asarray(domains), return_inverse=True)
    np.savez(out_dir / CORPUS_INDEX, offsets=offsets, tokens=table.tokens, counts=np.where(held_in, table.counts, 0),
             is_eval=is_eval, group=group_of, group_names=names)

    def members(mask: np.ndarray) -> Iterator[tuple[str, str, np.ndarray]]:
        for i in np.flatnonzero(mask).tolist():  # corpus order
            o, n = int(offsets[i]), int(table.tokens[i])
            yield table.ids[i], domains[i], corpus[o + 1:o + n - 1]  # without BOS/EOS

    separator = tokenizer.encode(SEPARATOR_TEXT, add_special_tokens=False).ids
    kw = {"bos": special["bos"], "eos": special["eos"], "separator": separator}
    with TokenSampleWriter(out_dir, LONG_DOCUMENTS) as w:
        train_stats = assemble_long_documents(members(held_in), sorted(set(lengths)), w, **kw)
    report(f"assembled {train_stats.long_documents:,} long documents {train_stats.per_length} from "
           f"{train_stats.documents_in:,} held-in documents in {train_stats.groups} domain(s)", force=True)
    eval_stats = {}
    for n in sorted(set(eval_lengths)):
        with TokenSampleWriter(out_dir, eval_documents_name(n)) as w:
            eval_stats[str(n)] = asdict(assemble_long_documents(members(is_eval), [n], w, **kw))
    stats = {"long_documents": asdict(train_stats), "eval_long_documents": eval_stats,
             "held_in_documents": int(held_in.sum()), "held_out_documents": int(is_eval.sum()),
             "mixture_documents": len(table.ids), "separator": separator, "special_ids": special}
    write_text_atomic(out_dir / STATS_FILE, json.dumps(stats, indent=1))
    return stats


class LongData:
    """What :func:`build_long_data` wrote: corpus documents and long documents as token samples."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.stats = json.loads((self.dir / STATS_FILE).read_text())
        index = np.load(self.dir / CORPUS_INDEX)
        self.offsets, self.lengths, self.counts = index["offsets"], index["tokens"], index["counts"]
        self.is_eval, self.group, self.group_names = index["is_eval"], index["group"], index["group_names"]
        size = (self.dir / CORPUS_TOKENS).stat().st_size // TOKEN_DTYPE.itemsize
        self._corpus = np.memmap(self.dir / CORPUS_TOKENS, TOKEN_DTYPE, mode="r") if size else np.zeros(0, TOKEN_DTYPE)
        self.long_documents = TokenSamples(self.dir, LONG_DOCUMENTS)

    def document(self, i: int) -> np.ndarray:
        """Corpus document ``i`` (mixture order) as ``[BOS] ids [EOS]``."""
        return self._corpus[self.offsets[i]:self.offsets[i] + self.lengths[i]]

    def eval_documents(self, seq_len: int) -> TokenSamples:
        return TokenSamples(self.dir, eval_documents_name(seq_len))
