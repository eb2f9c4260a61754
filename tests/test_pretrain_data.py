"""Packed pretraining data (pretrain/packed_data.py): every document exactly sample_count times (§4.1.3.2), row and
segment boundaries (§3.2 varlen packing), held-out eval documents, determinism, resumable row order, batch
labels, bounded memory, token-count checks, the unigram baseline."""

from __future__ import annotations

import gzip
import json
import math
import random
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, pre_tokenizers, trainers

from data.documents import DocumentWriter, unit_hash
from data.mix import MANIFEST_FILE
from data.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, build_tokenizer
from pretrain.packed_data import (
    EVAL_IDS_FILE,
    FORMAT_VERSION,
    INFO_FILE,
    UNIGRAM_FILE,
    PackedDatasetInfo,
    PackedRows,
    RowLoader,
    SplitInfo,
    TokenCountMismatchError,
    build_packed_dataset,
    make_batch,
    split_file,
    unigram_loss,
)

WORDS = ("the of model data energy cell function return value loop proof theorem lemma we think that it is "
         "a good idea to test this carefully 42 1999 , . ; ( )").split()
SEQ_LEN = 32


# --- tiny artifacts: documents, tokenizer, mixture ---------------------------------------------------
def _text(rng: random.Random, n_words: int, tag: int) -> str:
    return f"doc{tag} " + " ".join(rng.choice(WORDS) for _ in range(n_words))  # tag: every text unique


def _records(n: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    # lengths from a few tokens to several rows, so documents fit, cross one row end, or span rows
    return [{"id": f"doc-{i:03d}", "text": _text(rng, rng.choice([2, 5, 9, 20, 45, 120]), i), "source": "test",
             "domain": "prose", "metadata": {}} for i in range(n)]


def _write_documents(path: Path, records: list[dict]) -> Path:
    with DocumentWriter(path, shard_docs=16) as w:  # several shards: input order spans files
        for r in records:
            w.write(r)
    return path


def _train_tokenizer(path: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """data/tokenizer.py's BPE pipeline and special tokens (ids 0..7), trained directly (~0.2 s)."""
    tok = build_tokenizer()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def _encode(tokenizer_dir: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def _write_mixture(path: Path, records: list[dict], counts: list[int], tokens: list[int],
                   zero_reasons: dict[str, str] | None = None) -> Path:
    """A mixture manifest as data/mix.py writes it (one row per document, in input order)."""
    path.mkdir(parents=True, exist_ok=True)
    zero_reasons = zero_reasons or {}
    with gzip.GzipFile(path / MANIFEST_FILE, "wb", mtime=0) as f:
        for r, c, t in zip(records, counts, tokens, strict=True):
            f.write(orjson.dumps({
                "id": r["id"], "sample_count": c, "full_sample_count": c, "tokens": t, "bucket": "mid",
                "category": "prose", "domain": r["domain"], "score": 2.5, "dup_count": 1, "max_epochs": 4,
                "expected_epochs": float(c),
                "zero_reason": None if c else zero_reasons.get(r["id"], "budget")}) + b"\n")
    return path


class Corpus:
    """Documents + tokenizer + mixture artifacts in one directory, with what the test expects of them."""

    def __init__(self, root: Path, records: list[dict], counts: list[int], tokenizer_dir: Path | None = None,
                 zero_reasons: dict[str, str] | None = None) -> None:
        self.records, self.counts = records, counts
        self.documents = _write_documents(root / "documents", records)
        self.tokenizer = tokenizer_dir or _train_tokenizer(root / "tokenizer", [r["text"] for r in records])
        tok = Tokenizer.from_file(str(self.tokenizer / "tokenizer.json"))
        self.special = {n: tok.token_to_id(t) for n, t in (("bos", BOS_TOKEN), ("eos", EOS_TOKEN), ("pad", PAD_TOKEN))}
        self.docs = {r["id"]: (self.special["bos"], *_encode(self.tokenizer, r["text"]), self.special["eos"])
                     for r in records}
        self.mixture = _write_mixture(root / "mixture", records, counts, [len(self.docs[r["id"]]) for r in records],
                                      zero_reasons)

    def build(self, out: Path, **kw) -> PackedDatasetInfo:
        kw = {"seq_len": SEQ_LEN, "seed": 0, "eval_documents": 3} | kw
        return build_packed_dataset(self.mixture, self.documents, self.tokenizer, out, **kw)


def _counts(n: int) -> list[int]:
    return [(0, 1, 2, 3, 4, 1, 2)[i % 7] for i in range(n)]  # 0 for every 7th: 6 unsampled in 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    records = _records()
    return Corpus(tmp_path_factory.mktemp("corpus"), records, _counts(len(records)))


@pytest.fixture(scope="module")
def packed(corpus, tmp_path_factory) -> tuple[Path, PackedDatasetInfo]:
    out = tmp_path_factory.mktemp("packed")
    return out, corpus.build(out)


def _segments(rows: PackedRows) -> list[tuple[int, tuple[int, ...]]]:
    """(row, tokens) of every real segment, in row order."""
    out = []
    for i in range(len(rows)):
        tokens, starts, pad = rows.row(i)
        for s, e in zip(starts[:-1], starts[1:], strict=True):
            if not pad[s]:
                out.append((i, tuple(int(t) for t in tokens[s:e])))
    return out


def _documents_in(rows: PackedRows, bos: int) -> Counter:
    """Documents of a split, rebuilt from its rows: the real tokens in row order, split before each BOS."""
    stream = [t for _, seg in _segments(rows) for t in seg]
    cuts = [i for i, t in enumerate(stream) if t == bos] + [len(stream)]
    assert cuts[0] == 0, "a split's first token must be a document's BOS"
    return Counter(tuple(stream[a:b]) for a, b in zip(cuts, cuts[1:], strict=False))


# --- the training stream ------------------------------------------------------------------------
def test_every_document_appears_exactly_sample_count_times_in_training_rows(corpus, packed):
    out, info = packed
    rows = PackedRows(out, "train")
    eval_ids = {e["id"] for e in json.loads((out / EVAL_IDS_FILE).read_text())}
    expected = Counter({corpus.docs[r["id"]]: c for r, c in zip(corpus.records, corpus.counts, strict=True)
                        if c > 0 and r["id"] not in eval_ids})
    assert _documents_in(rows, corpus.special["bos"]) == expected
    assert info.train.document_instances == sum(expected.values())
    assert info.train.tokens == sum(len(d) * c for d, c in expected.items()) == info.mixture_tokens
    assert info.train.rows == math.ceil(info.train.tokens / SEQ_LEN) == len(rows)
    assert info.train.pad_tokens == info.train.rows * SEQ_LEN - info.train.tokens
    assert 0 < info.train.pad_tokens < SEQ_LEN  # this corpus's total is not a multiple of 32
    assert info.train.rows > 20


def test_segments_stay_in_their_row_and_only_continuations_start_without_bos(corpus, packed):
    out, info = packed
    rows = PackedRows(out, "train")
    bos, eos, pad_id = corpus.special["bos"], corpus.special["eos"], corpus.special["pad"]
    continuations = 0
    for i in range(len(rows)):
        tokens, starts, pad = rows.row(i)
        assert starts.dtype == np.int32 and starts[0] == 0 and starts[-1] == SEQ_LEN
        assert (np.diff(starts) > 0).all()
        real = tokens[~pad]
        # a boundary at every document start in the row, and nowhere else except the row start and padding
        expected_starts = {0, *np.flatnonzero(real == bos).tolist()} | ({int(real.size)} if pad.any() else set())
        assert set(starts[:-1].tolist()) == expected_starts
        for s, e in zip(starts[:-1], starts[1:], strict=True):
            seg = tokens[s:e]
            if pad[s]:
                assert (seg == pad_id).all() and e == SEQ_LEN  # the pad tail is the row's last segment
                continue
            assert bos not in seg[1:] and eos not in seg[:-1]  # one document (piece) per segment
            assert seg[-1] == eos or e == SEQ_LEN  # a document ends inside its row or runs to the row end
        continuations += int(tokens[0] != bos)
        if i > 0:  # a row starts mid-document exactly when the previous row ended mid-document
            prev_tokens, prev_starts, _ = rows.row(i - 1)
            assert (tokens[0] != bos) == (prev_tokens[-1] != eos)
    assert continuations == info.train.continuation_segments > 0
    assert info.train.segments == info.train.document_instances + continuations


def test_pad_positions_are_only_at_the_end_of_the_last_row(packed):
    out, info = packed
    rows = PackedRows(out, "train")
    for i in range(len(rows)):
        tokens, _, pad = rows.row(i)
        assert pad.sum() == (info.train.pad_tokens if i == len(rows) - 1 else 0)
    tokens, _, pad = rows.row(len(rows) - 1)
    assert pad[-info.train.pad_tokens:].all() and (tokens[pad] == info.special_ids["pad"]).all()


def test_unigram_counts_are_the_non_pad_training_tokens(corpus, packed):
    out, info = packed
    rows = PackedRows(out, "train")
    counts = np.load(out / UNIGRAM_FILE)
    assert counts.dtype == np.int64 and counts.shape == (info.vocab_size,) == (300,)
    expected = np.zeros(info.vocab_size, np.int64)
    for i in range(len(rows)):
        tokens, _, pad = rows.row(i)
        np.add.at(expected, tokens[~pad], 1)
    np.testing.assert_array_equal(counts, expected)
    assert counts[corpus.special["pad"]] == 0 and counts.sum() == info.train.tokens


def test_packing_json_records_the_build(corpus, packed):
    out, info = packed
    on_disk = json.loads((out / INFO_FILE).read_text())
    assert PackedDatasetInfo.from_dict(on_disk) == info
    assert on_disk["format_version"] == FORMAT_VERSION and on_disk["seq_len"] == SEQ_LEN and on_disk["seed"] == 0
    assert on_disk["special_ids"] == corpus.special == {"bos": 0, "eos": 1, "pad": 2}
    assert info.mixture_documents == 40
    assert info.unused_documents == 6 - 3  # 6 unsampled, 3 of them held out for eval
    assert not list(out.glob(".*")), "scratch and temp files must be gone"


# --- eval ---------------------------------------------------------------------------------------
def test_eval_prefers_never_trained_documents_in_hash_order(corpus, packed):
    out, info = packed
    unsampled = [r["id"] for r, c in zip(corpus.records, corpus.counts, strict=True) if c == 0]
    by_hash = sorted(unsampled, key=lambda i: unit_hash(0, "eval", i))
    eval_docs = json.loads((out / EVAL_IDS_FILE).read_text())
    assert [e["id"] for e in eval_docs] == by_hash[:3]
    assert not any(e["held_out_from_training"] for e in eval_docs)
    assert info.eval_from_unsampled == 3 and info.held_out_from_training == 0
    ev = PackedRows(out, "eval")
    assert _documents_in(ev, corpus.special["bos"]) == Counter(corpus.docs[i] for i in by_hash[:3])
    assert info.eval.document_instances == info.eval.documents == 3


def test_eval_takes_sampled_documents_only_when_short_and_removes_them_from_training(corpus, tmp_path):
    info = corpus.build(tmp_path, eval_documents=10)
    eval_docs = json.loads((tmp_path / EVAL_IDS_FILE).read_text())
    held = [e["id"] for e in eval_docs if e["held_out_from_training"]]
    count_of = {r["id"]: c for r, c in zip(corpus.records, corpus.counts, strict=True)}
    assert len(eval_docs) == 10 and len(held) == info.held_out_from_training == 4  # 6 unsampled + 4
    assert all(count_of[i] > 0 for i in held) and info.eval_from_unsampled == 6
    sampled_by_hash = sorted((i for i, c in count_of.items() if c > 0), key=lambda i: unit_hash(0, "eval", i))
    assert sorted(held) == sorted(sampled_by_hash[:4])
    train_docs = _documents_in(PackedRows(tmp_path, "train"), corpus.special["bos"])
    eval_set = {corpus.docs[e["id"]] for e in eval_docs}
    assert not eval_set & set(train_docs), "an eval document is in the training rows"
    assert info.held_out_training_tokens == sum(len(corpus.docs[i]) * count_of[i] for i in held)
    assert info.train.tokens + info.held_out_training_tokens == info.mixture_tokens


def test_eval_prefers_documents_not_marked_as_seen_through_duplicates(tmp_path, corpus):
    records = corpus.records[:10]
    counts = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    seen = {"doc-000": "duplicates_exhaust_cap", "doc-001": "duplicates_exhaust_cap"}
    c = Corpus(tmp_path / "c", records, counts, tokenizer_dir=corpus.tokenizer, zero_reasons=seen)
    c.build(tmp_path / "out", eval_documents=2)
    ids = [e["id"] for e in json.loads((tmp_path / "out" / EVAL_IDS_FILE).read_text())]
    assert "doc-002" in ids and len(set(ids) & set(seen)) == 1


# --- determinism --------------------------------------------------------------------------------
def test_same_seed_gives_identical_bytes_and_another_seed_another_order(corpus, packed, tmp_path):
    out, _ = packed
    corpus.build(tmp_path / "again")
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    corpus.build(tmp_path / "other", seed=1)
    a = np.load(out / split_file("train", "tokens"))
    b = np.load(tmp_path / "other" / split_file("train", "tokens"))
    assert not np.array_equal(a, b)
    # a different eval choice changes the training set, so compare the instances of the shared documents
    other_eval = {e["id"] for e in json.loads((tmp_path / "other" / EVAL_IDS_FILE).read_text())}
    assert all(corpus.counts[int(i[4:])] == 0 for i in other_eval)  # both builds hold out unsampled docs
    bos = corpus.special["bos"]
    assert _documents_in(PackedRows(out), bos) == _documents_in(PackedRows(tmp_path / "other"), bos)


# --- batches ------------------------------------------------------------------------------------
def _write_packed(path: Path, rows: list[list[int]], starts: list[list[int]], pad_tokens: int,
                  vocab_size: int = 10, split: str = "train") -> PackedRows:
    """A packed dataset written by hand in the documented layout (bos=0, eos=1, pad=2)."""
    path.mkdir(parents=True, exist_ok=True)
    seq_len = len(rows[0])
    flat = [s for row in starts for s in row]
    index = np.cumsum([0] + [len(s) for s in starts])
    for sp in ("train", "eval"):
        n = len(rows) if sp == split else 0
        np.save(path / split_file(sp, "tokens"), np.asarray(rows if n else np.zeros((0, seq_len)), np.int32))
        np.save(path / split_file(sp, "segment_starts"), np.asarray(flat if n else [], np.int32))
        np.save(path / split_file(sp, "segment_index"), np.asarray(index if n else [0], np.int64))
    tokens = len(rows) * seq_len - pad_tokens
    segments = len(flat) - len(rows) - (1 if pad_tokens else 0)
    used = SplitInfo(rows=len(rows), tokens=tokens, pad_tokens=pad_tokens, loss_tokens=tokens - segments,
                     segments=segments, continuation_segments=0, documents=0, document_instances=0)
    empty = SplitInfo(0, 0, 0, 0, 0, 0, 0, 0)
    info = PackedDatasetInfo(
        format_version=FORMAT_VERSION, seq_len=seq_len, seed=0, vocab_size=vocab_size,
        special_ids={"bos": 0, "eos": 1, "pad": 2}, train=used if split == "train" else empty,
        eval=used if split == "eval" else empty, mixture_documents=0, mixture_tokens=0, unused_documents=0,
        eval_from_unsampled=0, held_out_from_training=0, held_out_training_tokens=0)
    (path / INFO_FILE).write_text(info.to_json())
    return PackedRows(path, split)  # type: ignore[arg-type]


# row 0: doc A (BOS 5 6 EOS), doc B starts (BOS 7 8 9); row 1: B continues (3 EOS), doc C (BOS 4 EOS), pad x3
HAND_ROWS = [[0, 5, 6, 1, 0, 7, 8, 9], [3, 1, 0, 4, 1, 2, 2, 2]]
HAND_STARTS = [[0, 4, 8], [0, 2, 5, 8]]


def test_make_batch_flattens_rows_with_masked_labels_by_hand(tmp_path):
    rows = _write_packed(tmp_path, HAND_ROWS, HAND_STARTS, pad_tokens=3)
    b = make_batch(rows, [0, 1])
    assert b.input_ids.dtype == b.labels.dtype == b.position_ids.dtype == torch.int64
    assert b.cu_seqlens.dtype == torch.int32
    assert b.input_ids.tolist() == [HAND_ROWS[0] + HAND_ROWS[1]]
    x = -100  # masked: each segment's first label (the prediction across a boundary) and the padding
    assert b.labels.tolist() == [[x, 5, 6, 1, x, 7, 8, 9, x, 1, x, 4, 1, x, x, x]]
    assert b.cu_seqlens.tolist() == [0, 4, 8, 10, 13, 16]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 1, 2]]
    assert b.tokens == 9 and b.rows == (0, 1)
    # the other order: the row boundary moves, the padded tail is still masked
    b = make_batch(rows, [1, 0])
    assert b.cu_seqlens.tolist() == [0, 2, 5, 8, 12, 16]
    assert b.labels.tolist() == [[x, 1, x, 4, 1, x, x, x, x, 5, 6, 1, x, 7, 8, 9]]


@pytest.mark.slow  # ~3 s, mostly importing the model
def test_make_batch_loss_equals_each_segment_run_alone_in_the_model(tmp_path):
    """The contract with the model: a packed batch's loss is the mean next-token loss of its segments, each
    run separately (no attention or lightning state crosses a boundary, no label crosses one)."""
    from model.modeling import HybridForCausalLM
    from model.sizes import config_for

    torch.manual_seed(0)
    model = HybridForCausalLM(config_for("tiny", vocab_size=10, num_hidden_layers=2,
                                         attention_pattern=["lightning", "softmax"])).double().eval()
    rows = _write_packed(tmp_path, HAND_ROWS, HAND_STARTS, pad_tokens=3)
    b = make_batch(rows, [0, 1])
    with torch.no_grad():
        packed = model(b.input_ids, cu_seqlens=b.cu_seqlens, labels=b.labels, output_router_logits=False).loss
        losses = []
        for row, starts in zip(HAND_ROWS, HAND_STARTS, strict=True):
            for s, e in zip(starts[:-1], starts[1:], strict=True):
                seg = torch.tensor(row[s:e])
                if (seg == 2).all() or len(seg) < 2:
                    continue
                logits = model(seg[None]).logits[0]
                losses.append(F.cross_entropy(logits[:-1], seg[1:], reduction="none"))
    alone = torch.cat(losses)
    assert alone.numel() == b.tokens
    # transformers' causal loss computes in float32
    torch.testing.assert_close(packed, alone.mean().float(), rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # the same tokens without the boundaries: documents leak into each other
        wrong = model(b.input_ids, labels=b.labels, output_router_logits=False).loss
    assert not torch.isclose(wrong, packed, rtol=1e-4)


def test_make_batch_over_built_rows_counts_the_loss_tokens(packed):
    out, info = packed
    rows = PackedRows(out, "train")
    b = make_batch(rows, list(range(len(rows))))
    assert b.tokens == info.train.loss_tokens
    assert b.cu_seqlens[-1] == len(rows) * SEQ_LEN
    assert set(range(0, len(rows) * SEQ_LEN, SEQ_LEN)) <= set(b.cu_seqlens.tolist())
    assert b.cu_seqlens.numel() - 1 == info.train.segments + 1  # + the pad tail


# --- the row loader -----------------------------------------------------------------------------
def test_row_loader_resumes_exactly_across_batch_size_changes_and_epochs():
    schedule = [3, 3, 6, 6, 12, 12, 12, 24, 24, 5, 7]
    ref = RowLoader(37, seed=5)
    expected = [ref.next_indices(n) for n in schedule]
    assert ref.epoch == sum(schedule) // 37 >= 3
    for cut in range(1, len(schedule)):
        a = RowLoader(37, seed=5)
        for n in schedule[:cut]:
            a.next_indices(n)
        state = json.loads(json.dumps(a.state_dict()))  # plain ints: survives a JSON checkpoint
        assert all(type(v) is int for v in state.values())
        b = RowLoader(37, seed=5)
        b.load_state_dict(state)
        assert [b.next_indices(n) for n in schedule[cut:]] == expected[cut:]


def test_row_loader_walks_a_new_permutation_every_epoch():
    loader = RowLoader(50, seed=1)
    epochs = [loader.next_indices(50) for _ in range(3)]
    assert all(sorted(e) == list(range(50)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and loader.epoch == 3 and loader.position == 0
    assert RowLoader(50, seed=2).next_indices(50) != epochs[0]


def test_row_loader_ranks_never_share_a_row_within_an_epoch():
    n, world = 60, 3
    loaders = [RowLoader(n, seed=7, rank=r, world_size=world) for r in range(world)]
    got = [[i for n_rows in (4, 4, 8, 4) for i in loaders[r].next_indices(n_rows)] for r in range(world)]
    flat = [i for g in got for i in g]
    assert sorted(flat) == list(range(n))  # 20 rows each: one epoch, disjoint, complete
    single = RowLoader(n, seed=7).next_indices(n)
    assert got[1][:4] == single[1:12:3]  # rank r takes every world_size-th slot of the global order
    assert {loader.state_dict()["position"] for loader in loaders} == {0}


def test_row_loader_rejects_a_state_from_another_dataset():
    state = RowLoader(10, seed=0).state_dict()
    with pytest.raises(ValueError, match="same packed dataset"):
        RowLoader(11, seed=0).load_state_dict(state)


# --- errors -------------------------------------------------------------------------------------
def test_token_count_mismatch_names_the_document_and_the_likely_cause(corpus, tmp_path):
    tokens = [len(corpus.docs[r["id"]]) for r in corpus.records]
    tokens[5] += 1
    bad = _write_mixture(tmp_path / "mixture", corpus.records, corpus.counts, tokens)
    with pytest.raises(TokenCountMismatchError, match=r"'doc-005'.*different tokenizer or documents"):
        build_packed_dataset(bad, corpus.documents, corpus.tokenizer, tmp_path / "out", seq_len=SEQ_LEN, seed=0,
                             eval_documents=3)
    assert not (tmp_path / "out" / INFO_FILE).exists() and not list((tmp_path / "out").glob(".*"))


def test_another_tokenizer_is_caught_by_the_token_counts(corpus, tmp_path):
    other = _train_tokenizer(tmp_path / "tok", [r["text"] for r in corpus.records], vocab_size=270)
    with pytest.raises(TokenCountMismatchError, match="different tokenizer"):
        build_packed_dataset(corpus.mixture, corpus.documents, other, tmp_path / "out", seq_len=SEQ_LEN, seed=0,
                             eval_documents=3)


def test_documents_that_are_not_the_mixture_input_are_refused(corpus, tmp_path):
    docs = _write_documents(tmp_path / "docs", corpus.records[1:] + corpus.records[:1])
    with pytest.raises(ValueError, match="not the scored_documents artifact"):
        build_packed_dataset(corpus.mixture, docs, corpus.tokenizer, tmp_path / "out", seq_len=SEQ_LEN, seed=0,
                             eval_documents=3)


# --- unigram baseline ---------------------------------------------------------------------------
def test_unigram_loss_by_hand(tmp_path):
    # eval row: doc (BOS 3 4 EOS), doc (BOS 3 EOS), one pad; label positions: 3, 4, EOS, 3, EOS
    rows = _write_packed(tmp_path, [[0, 3, 4, 1, 0, 3, 1, 2]], [[0, 4, 7, 8]], pad_tokens=1, split="eval")
    counts = np.array([2, 2, 0, 5, 1, 0, 0, 0, 0, 0])  # N = 10 training tokens, V = 10
    p = {3: 6 / 20, 4: 2 / 20, 1: 3 / 20}  # (count + 1) / (N + V)
    expected = -(2 * math.log(p[3]) + math.log(p[4]) + 2 * math.log(p[1])) / 5
    assert unigram_loss(rows, counts) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="vocab size"):
        unigram_loss(rows, counts[:9])


def test_unigram_loss_of_a_built_dataset_is_below_uniform(packed):
    out, info = packed
    loss = unigram_loss(PackedRows(out, "eval"), np.load(out / UNIGRAM_FILE))
    assert 0 < loss < math.log(info.vocab_size)


# --- memory -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_memory_is_bounded_by_one_document_not_by_its_repetitions(corpus, tmp_path):
    """A 1.2 MB document (725k tokens) packed 1x and 24x: the peak of Python/numpy allocations does not grow
    with the training stream (24x = 70 MB of int32 rows); it is the one document in flight (measured ~17 MB,
    mostly the tokenizer's Python list of ids)."""
    rng = random.Random(3)
    big = {"id": "big", "text": _text(rng, 250_000, 999), "source": "test", "domain": "prose", "metadata": {}}
    records = [*corpus.records[:6], big]
    peaks, infos = [], []
    for reps in (1, 24):
        c = Corpus(tmp_path / f"c{reps}", records, [0, 1, 1, 2, 1, 1, reps], tokenizer_dir=corpus.tokenizer)
        tracemalloc.start()
        infos.append(c.build(tmp_path / f"out{reps}", seq_len=256, eval_documents=1))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    big_tokens = len(c.docs["big"])
    stream_bytes = infos[1].train.tokens * 4
    assert infos[1].train.rows > 100 * 24 and stream_bytes > 60e6
    assert peaks[1] < peaks[0] + 2e6, f"peak grew with repetition: {peaks}"
    assert peaks[1] < stream_bytes / 3, f"peak {peaks[1]:,} vs a {stream_bytes:,}-byte training stream"
    assert peaks[0] < 60 * big_tokens + len(big["text"]) * 4, f"peak {peaks[0]:,} for {big_tokens:,} tokens"
    rows = PackedRows(tmp_path / "out24")
    assert _documents_in(rows, c.special["bos"])[c.docs["big"]] == 24



def test_no_eval_documents_gives_an_empty_eval_split(corpus, tmp_path):
    info = corpus.build(tmp_path, eval_documents=0)
    ev = PackedRows(tmp_path, "eval")
    assert len(ev) == info.eval.rows == info.eval.tokens == 0 and info.unused_documents == 6
    assert ev.tokens.shape == (0, SEQ_LEN)
    with pytest.raises(ValueError, match="no label positions"):
        unigram_loss(ev, np.load(tmp_path / UNIGRAM_FILE))
    with pytest.raises(ValueError, match="at least one row"):
        RowLoader(ev, seed=0)


@pytest.mark.slow  # ~3 s alone: the real mix stage imports matplotlib for its plots
def test_packs_a_mixture_planned_by_the_real_mix_stage(corpus, tmp_path):
    """The contract with data/mix.py: its token counts (encode_batch_fast + 2) agree with packing's, and every
    sample_count it plans is what the rows hold."""
    from data.mix import MixParams, iter_mixture
    from data.mix import run as mix
    from pipeline.stage import Artifact, StageContext

    rng = random.Random(1)
    scored = [r | {"metadata": {"quality": {"knowledge_depth": rng.uniform(0, 5), "helpfulness": rng.uniform(0, 5),
                                            "category": ("a", "b")[i % 2]}}} for i, r in enumerate(corpus.records)]
    docs = _write_documents(tmp_path / "scored", scored)
    ctx = StageContext(tmp_path / "mix", stage_name="mix", inputs={
        "documents": Artifact(docs, {"type": "scored_documents", "digest": "d"}),
        "tokenizer": Artifact(corpus.tokenizer, {"type": "tokenizer", "digest": "t"})})
    unique = sum(len(d) for d in corpus.docs.values())
    mix(MixParams(token_budget=int(0.9 * unique)), ctx)
    plan = {row["id"]: row["sample_count"] for row in iter_mixture(ctx.out_dir)}
    assert 0 in plan.values() and max(plan.values()) >= 2
    info = build_packed_dataset(ctx.out_dir, docs, corpus.tokenizer, tmp_path / "out", seq_len=SEQ_LEN, seed=3,
                                eval_documents=2)
    eval_ids = {e["id"] for e in json.loads((tmp_path / "out" / EVAL_IDS_FILE).read_text())}
    expected = Counter({corpus.docs[i]: c for i, c in plan.items() if c > 0 and i not in eval_ids})
    assert _documents_in(PackedRows(tmp_path / "out"), corpus.special["bos"]) == expected
    assert info.train.tokens + info.held_out_training_tokens == info.mixture_tokens
