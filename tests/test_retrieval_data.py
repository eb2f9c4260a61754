"""Retrieval-bearing training data (data/retrieval.py, pretrain/retrieval_rows.py) and the in-training probe
(pretrain/probe.py): formats disjoint from the eval's, answers copied from far back, counts that add up, determinism,
and a probe that measures what a plain forward pass measures."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from data import eval_tasks
from data.retrieval import (
    DEFAULT_KINDS,
    FACT_QUESTIONS,
    FACT_STATEMENTS,
    KINDS,
    TEMPLATES,
    RetrievalMaker,
    make_key,
    make_name,
)
from pretrain.packed_data import PackedRows, build_packed_dataset, loss_mask, make_batch
from pretrain.retrieval_rows import (
    RETRIEVAL_FILE,
    add_retrieval_rows,
    positions,
    read_retrieval,
    retrieval_metrics,
    retrieval_rows_for,
)
from tests.pretrain_fixtures import build_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    return build_inputs(root, documents=120, max_chars=3000, vocab_size=512, domains=("prose", "manual"))


@pytest.fixture(scope="module")
def tokenizer(inputs):
    return Tokenizer.from_file(str(inputs.tokenizer.path / "tokenizer.json"))


@pytest.fixture(scope="module")
def packed(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "data"
    build_packed_dataset(inputs.mixture.path, inputs.documents.path, inputs.tokenizer.path, out, seq_len=256,
                         seed=0, eval_documents=8)
    return out


def _context(packed: Path) -> np.ndarray:
    rows = PackedRows(packed, "train")
    special = list(rows.info.special_ids.values())
    toks = np.concatenate([rows.row(i)[0] for i in range(len(rows))])
    return toks[~np.isin(toks, special)]


def _maker(tokenizer: Tokenizer) -> RetrievalMaker:
    return RetrievalMaker(tokenizer, bos=tokenizer.token_to_id("<|bos|>"), eos=tokenizer.token_to_id("<|eos|>"))


def _samples(tokenizer, packed, n_per_kind=25, lengths=(96, 200, 700)):
    maker, ctx, rng = _maker(tokenizer), _context(packed), np.random.default_rng(7)
    out = []
    for kind in KINDS:
        for i in range(n_per_kind):
            length = lengths[i % len(lengths)]
            start = int(rng.integers(0, ctx.size - length))
            out.append(maker.make(kind, ctx[start:start + length], length, rng))
    return out


def _has_subsequence(hay: np.ndarray, needle: np.ndarray) -> bool:
    if needle.size == 0 or needle.size > hay.size:
        return False
    windows = np.lib.stride_tricks.sliding_window_view(hay, needle.size)
    return bool((windows == needle).all(axis=1).any())


# --- formats ------------------------------------------------------------------------------------------------------
EVAL_FORMATS = [eval_tasks.NEEDLE, eval_tasks.QUESTION, eval_tasks.MR_NEEDLE_REQUEST, eval_tasks.MR_FINAL_REQUEST,
                *eval_tasks.MR_FILLER_REQUESTS]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower().replace("{city}", " ").replace("{number}", " ").replace("{cities}", " "))


def test_retrieval_templates_share_no_three_word_phrase_with_the_eval_templates():
    def trigrams(text):
        w = _words(text)
        return {tuple(w[i:i + 3]) for i in range(len(w) - 2)}

    eval_grams = set().union(*(trigrams(t) for t in EVAL_FORMATS))
    ours = set().union(*(trigrams(t) for t in TEMPLATES))
    assert eval_grams and not (ours & eval_grams)
    for word in ("magic", "special", "city", "number"):
        assert all(word not in _words(t) for t in TEMPLATES), word


def test_retrieval_samples_never_spell_the_eval_needle_or_its_cities(tokenizer, packed):
    cities = {c.lower() for c in eval_tasks.CITIES}
    for s in _samples(tokenizer, packed):
        text = tokenizer.decode(s.tokens.tolist(), skip_special_tokens=False)
        assert "special magic" not in text.lower()
        assert "magic number" not in text.lower()
        for key in re.findall(r"\(ref ([a-z]+-[a-z]+) =", text):
            assert not set(key.split("-")) & cities, key
    rng = np.random.default_rng(0)
    assert not {make_key(rng).replace("-", "") for _ in range(2000)} & cities


# --- what a sample is ------------------------------------------------------------------------------------------------
def test_every_kind_makes_exactly_the_asked_length_with_answers_copied_from_earlier_in_the_sample(tokenizer, packed):
    maker = _maker(tokenizer)
    eos = tokenizer.token_to_id("<|eos|>")
    seen = set()
    for s in _samples(tokenizer, packed):
        seen.add(s.kind)
        assert s.tokens.dtype == np.int32 and s.no_loss.shape == s.answer.shape == s.tokens.shape
        assert s.tokens[-1] == eos and s.answer[-1] and s.no_loss[0]
        assert not (s.answer & s.no_loss).any()  # every answer token is a target
        assert s.answer_tokens >= 2
        # the answer spans: each run of answer tokens, minus the closing mark, occurs before the query
        runs = np.split(np.flatnonzero(s.answer), np.flatnonzero(np.diff(np.flatnonzero(s.answer)) > 1) + 1)
        first = int(runs[0][0])
        for run in runs:
            span = s.tokens[run]
            span = span[span != eos]
            closers = [maker.encode(t) for t in (")", "»", "\"")]
            for c in closers:
                if span.size > c.size and (span[-c.size:] == c).all():
                    span = span[:-c.size]
            if s.kind in ("lookup", "multi_lookup"):  # the value, spelt as in its record
                span = span[1:] if span.size > 1 else span
            assert _has_subsequence(s.tokens[:first], span), (s.kind, s.meta)
    assert seen == set(KINDS)


def test_an_answer_eos_off_keeps_the_eos_in_the_sample_and_out_of_the_loss(tokenizer, packed):
    """answer_eos=False: the same tokens and targets but for the closing EOS, which is no target and no answer."""
    ctx, eos = _context(packed), tokenizer.token_to_id("<|eos|>")
    on = _maker(tokenizer)
    off = RetrievalMaker(tokenizer, bos=tokenizer.token_to_id("<|bos|>"), eos=eos, answer_eos=False)
    for kind in KINDS:
        a = on.make(kind, ctx[:400], 400, np.random.default_rng(11))
        b = off.make(kind, ctx[:400], 400, np.random.default_rng(11))
        assert (a.tokens == b.tokens).all() and b.tokens[-1] == eos, kind
        assert a.answer[-1] and not a.no_loss[-1] and not b.answer[-1] and b.no_loss[-1], kind
        assert (a.answer[:-1] == b.answer[:-1]).all() and (a.no_loss[:-1] == b.no_loss[:-1]).all(), kind
        assert b.answer_tokens == a.answer_tokens - 1 >= 1, kind


def test_a_sample_is_determined_by_its_seed(tokenizer, packed):
    a = _samples(tokenizer, packed, n_per_kind=3)
    b = _samples(tokenizer, packed, n_per_kind=3)
    assert all((x.tokens == y.tokens).all() and (x.no_loss == y.no_loss).all() for x, y in zip(a, b, strict=True))


def test_records_and_queries_are_out_of_the_loss_and_context_text_is_in(tokenizer, packed):
    maker, ctx = _maker(tokenizer), _context(packed)
    s = maker.make("multi_lookup", ctx[:600], 600, np.random.default_rng(3))
    text_positions = ~s.no_loss & ~s.answer
    assert text_positions.sum() > 300  # the natural text around the records is modelled
    record = maker.encode(" (ref")
    starts = [i for i in range(s.tokens.size - record.size) if (s.tokens[i:i + record.size] == record).all()]
    assert len(starts) == s.meta["records"]
    assert all(s.no_loss[i:i + record.size].all() for i in starts)


def test_a_sample_shorter_than_its_parts_is_refused_with_the_reason(tokenizer, packed):
    maker, ctx = _maker(tokenizer), _context(packed)
    with pytest.raises(ValueError, match="at least 96 tokens"):
        maker.make("repeat", ctx[:64], 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="needs 300 context tokens"):
        maker.make("lookup", ctx[:100], 300, np.random.default_rng(0))
    with pytest.raises(ValueError, match="unknown retrieval kind"):
        maker.make("trivia", ctx[:300], 300, np.random.default_rng(0))


def _fact_pattern(template: str) -> re.Pattern:
    """A fact statement or question template as a regex with named groups (name, thing, value)."""
    out = ""
    pieces = re.split(r"(\{name\}|\{thing\}|\{value\})", template)
    groups = {"{name}": r"(?P<name>[A-Z][a-z]+)", "{thing}": r"(?P<thing>[a-z]+)", "{value}": r"(?P<value>[a-z0-9]+)"}
    for piece in pieces:
        out += groups.get(piece, re.escape(piece))
    return re.compile(out)


def test_a_fact_sample_asks_in_words_for_the_value_one_planted_sentence_states(tokenizer, packed):
    """The fact kind: sentences stating values planted in the text (out of the loss), a question in words about
    one of them at the end (out of the loss), and that sentence's value as the answer (the target)."""
    maker, ctx = _maker(tokenizer), _context(packed)
    statements = [_fact_pattern(t) for t in FACT_STATEMENTS]
    questions = [_fact_pattern(t.strip("\n")) for t in FACT_QUESTIONS]
    cities = set(eval_tasks.CITIES)
    seen_facts, seen_questions = set(), set()
    for seed in range(40):
        length = (120, 300, 700)[seed % 3]
        start = seed * 37 % (ctx.size - length)
        s = maker.make("fact", ctx[start:start + length], length, np.random.default_rng(seed))
        answer = tokenizer.decode(s.tokens[s.answer & (s.tokens != tokenizer.token_to_id("<|eos|>"))].tolist())
        planted = tokenizer.decode(s.tokens[:int(np.flatnonzero(s.answer)[0])].tolist())
        q = [m for p in questions for m in p.finditer(planted)]
        assert len(q) == 1, planted[-200:]
        name, thing = q[0]["name"], q[0]["thing"]
        stated = [m for p in statements for m in p.finditer(planted) if m.start() < q[0].start()]
        assert len(stated) == s.meta["facts"] and 1 <= s.meta["facts"] <= 4
        assert not {m["name"] for m in stated} & cities
        value = next(m["value"] for m in stated if m["name"] == name and m["thing"] == thing)
        assert answer == f" {value}.", (answer, value)
        # planted sentences and the question are no target; the text around them is
        for m in stated:
            ids = maker.encode(m.group(0))
            hits = [i for i in range(s.tokens.size - ids.size + 1) if (s.tokens[i:i + ids.size] == ids).all()]
            assert hits and all(s.no_loss[i:i + ids.size].all() for i in hits), m.group(0)
        assert (~s.no_loss & ~s.answer).sum() > length // 4
        seen_facts.add(s.meta["facts"])
        seen_questions.add(q[0].re.pattern)
    assert seen_facts == {1, 2, 3, 4} and len(seen_questions) == len(FACT_QUESTIONS)
    assert "number" not in " ".join(FACT_STATEMENTS + FACT_QUESTIONS).lower()


def test_fact_names_are_never_an_eval_city():
    """The syllables spell Lima (li-ma): a draw that spells it is drawn again."""
    from data.retrieval import _SYLLABLES

    class Draws:  # a generator that first spells Lima, then Tami
        def __init__(self) -> None:
            self.out = [2, [_SYLLABLES.index("li"), _SYLLABLES.index("ma")], 2,
                        [_SYLLABLES.index("ta"), _SYLLABLES.index("mi")]]

        def integers(self, low, high=None, size=None):  # noqa: ANN001, ANN201
            return np.asarray(self.out.pop(0))

    assert "Lima" in eval_tasks.CITIES and make_name(Draws()) == "Tami"
    rng = np.random.default_rng(0)
    names = {make_name(rng) for _ in range(20000)}
    assert len(names) > 5000 and not names & set(eval_tasks.CITIES)


def test_the_retrieval_params_default_to_the_kinds_earlier_runs_used_and_accept_fact():
    from pretrain.stage import PretrainParams
    assert PretrainParams().retrieval_kinds == list(DEFAULT_KINDS) and "fact" not in DEFAULT_KINDS
    assert "fact" in KINDS
    assert PretrainParams(retrieval_kinds=["fact", "lookup"]).retrieval_kinds == ["fact", "lookup"]
    with pytest.raises(ValueError, match="retrieval_kinds=\\['trivia'\\]: a non-empty list of .*fact"):
        PretrainParams(retrieval_kinds=["trivia"])


# --- rows in a packed split ------------------------------------------------------------------------------------------
def test_positions_spread_the_added_rows_evenly_and_keep_the_plain_rows_in_order():
    at = positions(9, 3)
    assert at.sum() == 3 and at.size == 12
    assert np.flatnonzero(at).tolist() == [2, 6, 10]
    assert positions(5, 0).sum() == 0
    assert retrieval_rows_for(300, 0.25) == 100 and retrieval_rows_for(10, 0.0) == 0
    with pytest.raises(ValueError, match="retrieval_share"):
        retrieval_rows_for(10, 1.0)


@pytest.fixture(scope="module")
def mixed(packed, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed") / "data"
    shutil.copytree(packed, out)
    plain = len(PackedRows(packed, "train"))
    record = add_retrieval_rows(out, tokenizer, added_rows=retrieval_rows_for(plain, 0.25), seed=0, min_tokens=96)
    return out, record


def test_retrieval_rows_counts_add_up_and_the_plain_rows_are_unchanged(packed, mixed):
    out, record = mixed
    before, after = PackedRows(packed, "train"), PackedRows(out, "train")
    added = record["rows"]
    assert len(after) == len(before) + added and record["plain_rows"] == len(before)
    assert record["share_of_rows"] == pytest.approx(0.25, abs=0.01)
    assert sum(c["samples"] for c in record["by_kind"].values()) == record["samples"]
    assert all(c["samples"] > 0 for c in record["by_kind"].values())
    at = positions(len(before), added)
    plain_rows = [i for i in range(len(after)) if not at[i]]
    for j, i in enumerate(plain_rows):  # the plain rows, in their order, with the same labels
        t0, s0, p0 = before.row(j)
        t1, s1, p1 = after.row(i)
        assert (t0 == t1).all() and (s0 == s1).all() and (loss_mask(s0, p0) == loss_mask(s1, p1)).all()
    info = after.info.train
    assert info.rows == len(after)
    assert info.tokens == before.info.train.tokens + added * 256
    real = sum(int((~after.row(i)[2]).sum()) for i in range(len(after)) if at[i])
    loss = sum(int(loss_mask(after.row(i)[1], after.row(i)[2]).sum()) for i in range(len(after)))
    assert info.loss_tokens == loss and record["loss_tokens"] == sum(
        int(loss_mask(after.row(i)[1], after.row(i)[2]).sum()) for i in range(len(after)) if at[i])
    assert real > record["answer_tokens"] > 0
    unigram = np.load(out / "unigram_counts.npy")
    pad = after.info.special_ids["pad"]
    all_tokens = np.concatenate([after.row(i)[0] for i in range(len(after))])
    assert unigram.sum() == info.tokens == int((all_tokens != pad).sum()) - 0  # no padding among real tokens
    assert read_retrieval(out) == record == json.loads((out / RETRIEVAL_FILE).read_text())
    m = retrieval_metrics(record)
    assert m["retrieval.rows"] == added and m["retrieval.samples"] == record["samples"]
    assert retrieval_metrics(None) == {}


def test_retrieval_rows_batch_with_answers_as_labels_and_prompts_masked(mixed):
    out, _ = mixed
    rows = PackedRows(out, "train")
    at = np.flatnonzero(positions(rows.info.train.rows - json.loads((out / RETRIEVAL_FILE).read_text())["rows"],
                                  json.loads((out / RETRIEVAL_FILE).read_text())["rows"]))
    b = make_batch(rows, at[:2].tolist())
    labels = b.labels[0].numpy()
    assert (labels == -100).any() and (labels != -100).sum() > 100
    tokens, starts, no_loss = rows.row(int(at[0]))
    assert (labels[:256][no_loss] == -100).all()


def test_retrieval_rows_are_determined_by_the_seed_and_refused_twice(packed, tokenizer, tmp_path, mixed):
    out, _ = mixed
    again = tmp_path / "again"
    shutil.copytree(packed, again)
    plain = len(PackedRows(packed, "train"))
    add_retrieval_rows(again, tokenizer, added_rows=retrieval_rows_for(plain, 0.25), seed=0, min_tokens=96)
    for name in ("train_tokens.npy", "train_no_loss.npy", "train_segment_starts.npy", "unigram_counts.npy"):
        assert (np.load(out / name) == np.load(again / name)).all(), name
    with pytest.raises(ValueError, match="already holds retrieval rows"):
        add_retrieval_rows(again, tokenizer, added_rows=3, seed=0)
    other = tmp_path / "other"
    shutil.copytree(packed, other)
    add_retrieval_rows(other, tokenizer, added_rows=retrieval_rows_for(plain, 0.25), seed=1, min_tokens=96)
    assert not (np.load(out / "train_tokens.npy") == np.load(other / "train_tokens.npy")).all()
    with pytest.raises(ValueError, match="retrieval kinds"):
        add_retrieval_rows(tmp_path / "x", tokenizer, added_rows=3, seed=0, kinds=["trivia"])


def test_answers_only_rows_count_just_the_answers_and_keep_the_same_tokens(packed, tokenizer, tmp_path, mixed):
    """loss_on="answers": the same rows (same seed) with every label off but the answers' (and the filler's text)."""
    out, record = mixed
    ans = tmp_path / "answers"
    shutil.copytree(packed, ans)
    plain = len(PackedRows(packed, "train"))
    rec = add_retrieval_rows(ans, tokenizer, added_rows=retrieval_rows_for(plain, 0.25), seed=0, min_tokens=96,
                             loss_on="answers")
    assert (np.load(out / "train_tokens.npy") == np.load(ans / "train_tokens.npy")).all()
    assert rec["loss_on"] == "answers" and record["loss_on"] == "all"
    assert rec["answer_tokens"] == record["answer_tokens"]
    # per kind, the counted labels are the answers after each sample's first token (here: all of them)
    for kind, c in rec["by_kind"].items():
        assert c["loss_tokens"] == c["answer_tokens"], kind
        assert record["by_kind"][kind]["loss_tokens"] > c["loss_tokens"], kind
    a, b = PackedRows(out, "train"), PackedRows(ans, "train")
    at = np.flatnonzero(positions(plain, rec["rows"]))
    for i in at[:20]:
        t, starts, nl_all = a.row(int(i))
        _, _, nl_ans = b.row(int(i))
        assert (nl_ans | ~nl_all).sum() >= (~nl_all).sum() and (~nl_ans & nl_all).sum() == 0  # a subset of all's
    for i in np.flatnonzero(~positions(plain, rec["rows"]))[:5]:  # plain rows untouched
        assert (a.row(int(i))[2] == b.row(int(i))[2]).all()
    with pytest.raises(ValueError, match="loss_on"):
        add_retrieval_rows(tmp_path / "y", tokenizer, added_rows=3, seed=0, loss_on="context")


def test_rows_without_the_answer_eos_target_have_one_label_fewer_a_sample(packed, tokenizer, tmp_path, mixed):
    """answer_eos=False through add_retrieval_rows: the same rows (same seed), each sample's closing EOS no label,
    in both loss_on modes; retrieval.json says which."""
    out, record = mixed
    plain = len(PackedRows(packed, "train"))
    for loss_on in ("all", "answers"):
        d = tmp_path / loss_on
        shutil.copytree(packed, d)
        rec = add_retrieval_rows(d, tokenizer, added_rows=retrieval_rows_for(plain, 0.25), seed=0, min_tokens=96,
                                 loss_on=loss_on, answer_eos=False)
        assert (np.load(out / "train_tokens.npy") == np.load(d / "train_tokens.npy")).all()
        assert rec["answer_eos"] is False and record["answer_eos"] is True
        assert rec["answer_tokens"] == record["answer_tokens"] - record["samples"]
        if loss_on == "all":
            for kind, c in rec["by_kind"].items():
                assert c["loss_tokens"] == record["by_kind"][kind]["loss_tokens"] - c["samples"], kind
            assert rec["loss_tokens"] == record["loss_tokens"] - record["samples"]
        else:
            assert all(c["loss_tokens"] == c["answer_tokens"] for c in rec["by_kind"].values())


def _window_hashes(tokens: np.ndarray, special: list[int], n: int = 24) -> np.ndarray:
    """A 64-bit polynomial hash of every ``n``-token window of ``tokens`` with the special tokens taken out."""
    t = tokens[~np.isin(tokens, special)].astype(np.uint64)
    if t.size < n:
        return np.zeros(0, np.uint64)
    powers = np.uint64(1_000_003) ** np.arange(n, dtype=np.uint64)  # wraps around mod 2**64, as meant
    return (np.lib.stride_tricks.sliding_window_view(t, n) * powers).sum(axis=1, dtype=np.uint64)


def test_retrieval_rows_hold_no_held_out_text(packed, mixed):
    """The samples' contexts come from the training rows: no 24-token window of a held-out document is in them."""
    out, record = mixed
    rows = PackedRows(out, "train")
    at = np.flatnonzero(positions(record["plain_rows"], record["rows"]))
    special = list(rows.info.special_ids.values())
    plain = PackedRows(packed, "train")
    train_text = np.concatenate([_window_hashes(plain.row(i)[0], special) for i in range(len(plain))])
    ev = PackedRows(out, "eval")
    held = np.concatenate([_window_hashes(ev.row(i)[0], special) for i in range(len(ev))])
    held = np.setdiff1d(held, train_text)  # text the held-out documents share with training ones is not theirs
    assert held.size > 1000
    mixed_in = np.concatenate([_window_hashes(rows.row(int(i))[0], special) for i in at])
    assert mixed_in.size > 1000 and not np.isin(mixed_in, held).any()


# --- the in-training probe -------------------------------------------------------------------------------------------
def _tiny_model(vocab: int):
    from model.modeling import HybridForCausalLM
    from model.sizes import config_for

    torch.manual_seed(0)
    return HybridForCausalLM(config_for("tiny", vocab_size=vocab)).eval()


def test_the_probe_measures_what_a_plain_forward_pass_measures(packed, inputs):
    from pretrain.probe import PROBE_METRICS, RetrievalProbe

    rows = PackedRows(packed, "eval")
    probe = RetrievalProbe(inputs.tokenizer.path, rows, seq_len=128, trials=3, seed=0, copy_tokens=20)
    model = _tiny_model(rows.info.vocab_size)
    got = probe.run(model, torch.device("cpu"))
    assert set(got) == set(PROBE_METRICS) and not model.training

    def logprobs(ids):  # one sequence alone, the plain way
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, -1)

    acc, gain = [], []
    for t in probe.copy:
        lp = logprobs(t.ids)
        first, second = np.asarray(t.first_copy_targets()), np.asarray(t.second_copy_targets())
        ids = torch.tensor(t.ids)
        acc.append(float((lp[second - 1].argmax(-1) == ids[second]).float().mean()))
        gain.append(float(-lp[first - 1, ids[first]].mean() + lp[second - 1, ids[second]].mean()))
    assert got["copy_accuracy"] == pytest.approx(np.mean(acc), abs=1e-6)
    assert got["copy_loss_gain"] == pytest.approx(np.mean(gain), abs=1e-4)
    choice, margin = [], []
    for t, cands in zip(probe.niah, probe.candidates, strict=True):
        lls = []
        for c in cands:
            lp = logprobs(t.ids + c)
            pos = np.arange(len(t.ids), len(t.ids) + len(c))
            lls.append(float(lp[pos - 1, torch.tensor(c)].sum()))
        choice.append(lls[0] > max(lls[1:]))
        margin.append(lls[0] - np.mean(lls[1:]))
    assert got["niah_choice_accuracy"] == pytest.approx(np.mean(choice))
    assert got["niah_answer_margin"] == pytest.approx(np.mean(margin), abs=1e-3)
    assert len(probe.niah) == 3 and all(len(t.ids) == 128 for t in probe.niah)
    assert [t.depth for t in probe.niah] == [0.0, 0.5, 1.0]


def test_the_copy_probe_draws_from_held_out_tokens_or_from_the_whole_vocabulary(packed, inputs):
    from tokenizers import Tokenizer

    from pretrain.probe import RetrievalProbe

    rows = PackedRows(packed, "eval")
    special = set(Tokenizer.from_file(str(inputs.tokenizer.path / "tokenizer.json")).get_added_tokens_decoder())
    seen = RetrievalProbe(inputs.tokenizer.path, rows, seq_len=128, trials=6, seed=0, copy_tokens=40)
    held = set()
    for i in range(len(rows)):
        held |= set(rows.row(i)[0].tolist())
    drawn = {x for t in seen.copy for x in t.ids[1:]}
    assert drawn <= held - special and seen.copy_pool_size < rows.info.vocab_size - len(special)
    whole = RetrievalProbe(inputs.tokenizer.path, rows, seq_len=128, trials=6, seed=0, copy_tokens=40,
                           copy_pool="vocab")
    assert whole.copy_pool_size == rows.info.vocab_size - len(special)
    assert {x for t in whole.copy for x in t.ids[1:]} - held  # some ids no held-out text holds
    with pytest.raises(ValueError, match="copy_pool"):
        RetrievalProbe(inputs.tokenizer.path, rows, seq_len=128, trials=2, seed=0, copy_pool="corpus")


def test_pretrain_and_long_context_refuse_the_same_bad_retrieval_and_probe_params():
    from pydantic import ValidationError

    from pretrain.long_context import LongContextParams
    from pretrain.stage import PretrainParams

    for make in (lambda **kw: PretrainParams(seq_len=256, **kw), lambda **kw: LongContextParams(**kw)):
        with pytest.raises(ValidationError, match="probe_every=15 must be a multiple of log_every=10"):
            make(probe_every=15, log_every=10, checkpoint_every=50)
        with pytest.raises(ValidationError, match="retrieval_kinds"):
            make(retrieval_kinds=["trivia"])
        with pytest.raises(ValidationError, match="retrieval_min_tokens=4096 is longer than a row"):
            make(retrieval_share=0.5, retrieval_min_tokens=4096)
        assert make(probe_every=20, log_every=10, checkpoint_every=50, retrieval_share=0.5,
                    retrieval_min_tokens=128).probe_every == 20


# --- the copy curriculum (issue 33) ---------------------------------------------------------------------------
def test_a_copy_sample_repeats_its_span_after_the_marker_with_the_loss_on_the_repeat_alone():
    from data.retrieval import copy_sample

    mark = np.asarray([7, 8, 9], np.int32)
    pool = np.arange(20, 60, dtype=np.int32)
    for length in (9, 10, 57, 300):  # odd and even rest after [BOS], the marker and [EOS]
        s = copy_sample(pool, length, np.random.default_rng(length), bos=1, eos=2, mark=mark)
        span = s.meta["span_tokens"]
        assert s.tokens.size == length == s.no_loss.size and s.tokens[0] == 1 and s.tokens[-1] == 2
        assert span == (length - 5) // 2
        first, second = s.tokens[length - 1 - span - 3 - span:length - 1 - span - 3], s.tokens[length - 1 - span:-1]
        assert (first == second).all() and (s.tokens[length - 1 - span - 3:length - 1 - span] == mark).all()
        assert np.isin(first, pool).all()
        # the targets: the second R alone (not the EOS, whose place can only be counted)
        assert (~s.no_loss).sum() == span and (~s.no_loss[length - 1 - span:length - 1]).all() and s.no_loss[-1]
        assert (s.answer == ~s.no_loss).all()
    a = copy_sample(pool, 300, np.random.default_rng(0), bos=1, eos=2, mark=mark)
    b = copy_sample(pool, 300, np.random.default_rng(1), bos=1, eos=2, mark=mark)
    assert not (a.tokens == b.tokens).all()
    with pytest.raises(ValueError, match="no room for its span"):
        copy_sample(pool, 6, np.random.default_rng(0), bos=1, eos=2, mark=mark)


def test_a_copy_sample_with_a_gap_repeats_its_span_that_much_farther_back():
    from data.retrieval import copy_sample

    mark = np.asarray([7, 8, 9], np.int32)
    pool = np.arange(20, 60, dtype=np.int32)
    for length, gap in ((300, 100), (57, 0), (58, 41)):
        s = copy_sample(pool, length, np.random.default_rng(length), bos=1, eos=2, mark=mark, gap=gap)
        span = s.meta["span_tokens"]
        assert span == (length - 5 - gap) // 2 and s.meta["gap_tokens"] == gap and s.tokens.size == length
        end = length - 1  # the EOS
        second = s.tokens[end - span:end]
        marker = s.tokens[end - span - 3:end - span]
        gap_ids = s.tokens[end - span - 3 - gap:end - span - 3]
        first = s.tokens[end - span - 3 - gap - span:end - span - 3 - gap]
        assert (first == second).all() and (marker == mark).all() and np.isin(gap_ids, pool).all()
        assert (~s.no_loss).sum() == span and (~s.no_loss[end - span:end]).all()  # the gap is no target
    # no gap: the same draws as before gaps existed, so the rows of a run without them are unchanged
    a = copy_sample(pool, 300, np.random.default_rng(0), bos=1, eos=2, mark=mark)
    b = copy_sample(pool, 300, np.random.default_rng(0), bos=1, eos=2, mark=mark, gap=0)
    assert (a.tokens == b.tokens).all()
    with pytest.raises(ValueError, match="the gap 296"):
        copy_sample(pool, 300, np.random.default_rng(0), bos=1, eos=2, mark=mark, gap=296)
    with pytest.raises(ValueError, match="use 0 or more"):
        copy_sample(pool, 300, np.random.default_rng(0), bos=1, eos=2, mark=mark, gap=-1)


def test_copy_rows_with_gaps_put_each_repeat_its_gap_farther_back(mixed, tokenizer, tmp_path):
    from data.retrieval import COPY_MARK
    from pretrain.retrieval_rows import add_copy_rows, copy_metrics

    src, _ = mixed
    out = tmp_path / "data"
    shutil.copytree(src, out)
    record = add_copy_rows(out, tokenizer, rows=8, share=1.0, seed=0, span_tokens=(8, 24), gap_tokens=(40, 120))
    mark = np.asarray(tokenizer.encode(COPY_MARK, add_special_tokens=False).ids)
    rows, gaps = PackedRows(out, "train"), []
    for i in range(record["first_copy_row"], len(rows)):
        tokens, starts, no_loss = rows.row(i)
        keep = loss_mask(starts, no_loss)
        for j, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True)):  # [BOS] (x) R G MARK R [EOS]
            seg, lab = tokens[a:b], keep[a:b]
            span = int(lab.sum())
            m = len(seg) - 1 - span - mark.size  # where the marker starts
            assert (seg[m:m + mark.size] == mark).all() and lab[m + mark.size:-1].all() and not lab[:m].any()
            # the span: the first R is the span ids after [BOS] and the odd lead id, the rest up to the marker is G
            body = m - 1
            gap = None
            for lead in (0, 1):
                g = body - lead - span
                if (seg[1 + lead:1 + lead + span] == seg[-1 - span:-1]).all() and g >= 0:
                    gap = g
                    break
            last = j == len(starts) - 2  # a row's last sample takes the rest of the row as its gap
            assert gap is not None and 40 <= gap and (gap <= 120 or last), (i, j, gap)
            assert 8 <= span <= 24  # the spans keep their range
            gaps.append(gap)
    assert record["gap_tokens"] == [40, 120] and len(gaps) == record["samples"]
    assert record["mean_gap_tokens"] == pytest.approx(sum(gaps) / len(gaps))
    assert copy_metrics(record)["copy_curriculum.mean_gap_tokens"] == record["mean_gap_tokens"]
    with pytest.raises(ValueError, match="gap_tokens"):
        add_copy_rows(tmp_path / "other", tokenizer, rows=8, share=1.0, seed=0, gap_tokens=(9, 3))


@pytest.fixture(scope="module")
def with_copy(mixed, tokenizer, tmp_path_factory):
    from pretrain.retrieval_rows import add_copy_rows

    src, _ = mixed
    out = tmp_path_factory.mktemp("copy") / "data"
    shutil.copytree(src, out)
    record = add_copy_rows(out, tokenizer, rows=12, share=0.4, seed=0, span_tokens=(8, 40))
    return src, out, record


def test_copy_rows_are_appended_after_the_other_rows_with_counts_that_add_up(tokenizer, with_copy):
    from data.retrieval import COPY_MARK
    from data.tokenizer import SPECIAL_TOKENS
    from pretrain.retrieval_rows import add_copy_rows, copy_metrics, read_copy

    src, out, record = with_copy
    before, after = PackedRows(src, "train"), PackedRows(out, "train")
    assert len(after) == len(before) + 12 and record["first_copy_row"] == len(before)
    assert record["curriculum_rows"] == 30  # 12 rows at 40%
    for i in range(len(before)):  # the rows before are unchanged, labels included
        t0, s0, p0 = before.row(i)
        t1, s1, p1 = after.row(i)
        assert (t0 == t1).all() and (s0 == s1).all() and (loss_mask(s0, p0) == loss_mask(s1, p1)).all()
    mark = np.asarray(tokenizer.encode(COPY_MARK, add_special_tokens=False).ids)
    specials = {tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    samples, loss = 0, 0
    for i in range(len(before), len(after)):
        tokens, starts, no_loss = after.row(i)
        keep = loss_mask(starts, no_loss)
        loss += int(keep.sum())
        for a, b in zip(starts[:-1], starts[1:], strict=True):  # every segment: [BOS] R MARK R [EOS]
            seg, lab = tokens[a:b], keep[a:b]
            span = int(lab.sum())  # the targets are the repeat alone
            assert seg[0] == tokenizer.token_to_id("<|bos|>") and seg[-1] == tokenizer.token_to_id("<|eos|>")
            assert (seg[-1 - span:-1] == seg[-1 - span - mark.size - span:-1 - mark.size - span]).all()
            assert (seg[-1 - span - mark.size:-1 - span] == mark).all() and lab[-1 - span:-1].all() and not lab[-1]
            assert not set(seg[-1 - span:-1].tolist()) & specials and span >= 8
            samples += 1
    assert samples == record["samples"] and loss == record["loss_tokens"] > 0
    info = after.info.train
    assert info.rows == len(after) and info.tokens == before.info.train.tokens + 12 * 256
    assert info.loss_tokens == before.info.train.loss_tokens + loss
    assert (np.load(out / "unigram_counts.npy") == np.load(src / "unigram_counts.npy")).all()  # text only
    assert read_copy(out) == record and read_copy(src) is None
    assert copy_metrics(record)["copy_curriculum.rows"] == 12 and copy_metrics(None) == {}
    with pytest.raises(ValueError, match="already holds copy rows"):
        add_copy_rows(out, tokenizer, rows=3, share=0.5, seed=0)


def test_unigram_copy_rows_draw_ids_as_often_as_the_text_uses_them(mixed, tokenizer, tmp_path):
    """copy_draw 'unigram': every span id is one the training text uses, drawn in proportion to its count (the
    uniform draw gives the text's 10 commonest ids ~10/pool of the draws, the unigram draw their share of the
    text)."""
    from pretrain.retrieval_rows import add_copy_rows

    src, _ = mixed
    out = tmp_path / "data"
    shutil.copytree(src, out)
    record = add_copy_rows(out, tokenizer, rows=40, share=1.0, seed=0, span_tokens=(16, 48), draw="unigram")
    counts = np.load(out / "unigram_counts.npy").astype(np.float64)
    rows = PackedRows(out, "train")
    drawn = []
    for i in range(record["first_copy_row"], len(rows)):
        tokens, starts, no_loss = rows.row(i)
        keep = loss_mask(starts, no_loss)
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            span = int(keep[a:b].sum()) - 1
            drawn.append(tokens[a:b][-1 - span:-1])  # the repeat: the drawn ids
    drawn = np.concatenate(drawn)
    from data.tokenizer import SPECIAL_TOKENS

    assert (counts[drawn] > 0).all()  # never an id the text does not use
    ordinary = counts.copy()
    ordinary[[tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] + list(rows.info.special_ids.values())] = 0
    assert record["draw"] == "unigram" and record["pool"] == int((ordinary > 0).sum())
    top = np.argsort(ordinary)[::-1][:10]
    text_share = ordinary[top].sum() / ordinary.sum()
    drawn_share = np.isin(drawn, top).mean()
    assert abs(drawn_share - text_share) < 0.05 and drawn_share > 5 * 10 / record["pool"], (drawn_share, text_share)
    with pytest.raises(ValueError, match="copy draw='zipf'"):
        add_copy_rows(tmp_path / "other", tokenizer, rows=1, share=1.0, seed=0, draw="zipf")


def test_the_curriculum_reads_each_copy_row_once_first_and_then_the_plain_epochs(with_copy):
    """The loader of a split with a copy curriculum: copy rows at the share in the first curriculum_rows slots, in
    order, each once; the other slots walk exactly the epochs a plain loader over the other rows walks."""
    from pretrain.packed_data import CurriculumLoader, RowLoader, make_loader

    _, out, record = with_copy
    rows = PackedRows(out, "train")
    first, n_copy, until = record["first_copy_row"], record["rows"], record["curriculum_rows"]
    loader = make_loader(rows, seed=3)
    assert isinstance(loader, CurriculumLoader)
    order = [i for n in (4, 4, 8, 3, 16, 16, 16, 16) for i in loader.next_indices(n)]
    copies = [k for k, i in enumerate(order) if i >= first]
    assert [order[k] for k in copies] == list(range(first, first + n_copy))  # each once, in order
    assert copies[-1] < until and len([k for k in copies if k < until // 2]) in (n_copy // 2, n_copy // 2 + 1)
    plain = [i for i in order if i < first]
    ref = RowLoader(first, seed=3).next_indices(len(plain))  # same epochs as a plain loader's
    assert plain == ref
    eval_loader = make_loader(PackedRows(out, "eval"), seed=3)  # the held-out split: no curriculum
    assert type(eval_loader) is RowLoader


def test_the_curriculum_loader_resumes_exactly_and_splits_slots_between_ranks(with_copy):
    from pretrain.packed_data import CurriculumLoader

    _, out, record = with_copy
    kw = dict(copy_start=record["first_copy_row"], copy_rows=record["rows"], curriculum_rows=record["curriculum_rows"],
              seed=1)
    total = record["first_copy_row"] + record["rows"]
    schedule = [2, 2, 4, 4, 8, 3, 8, 8]
    ref = CurriculumLoader(total, **kw)
    expected = [ref.next_indices(n) for n in schedule]
    for cut in range(1, len(schedule)):
        a = CurriculumLoader(total, **kw)
        for n in schedule[:cut]:
            a.next_indices(n)
        b = CurriculumLoader(total, **kw)
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        assert [b.next_indices(n) for n in schedule[cut:]] == expected[cut:]
    world = 2
    ranks = [CurriculumLoader(total, rank=r, world_size=world, **kw) for r in range(world)]
    single = CurriculumLoader(total, **kw).next_indices(40)
    got = [ranks[r].next_indices(20) for r in range(world)]
    assert got[0] == single[0::2] and got[1] == single[1::2]
    with pytest.raises(ValueError, match="not saved by this copy curriculum"):
        CurriculumLoader(total, **kw).load_state_dict({"position": 0, "epoch": 0, "seed": 1, "rows": total})
    with pytest.raises(ValueError, match="must be the last"):
        CurriculumLoader(total, **(kw | {"copy_start": 3}))


def test_pretrain_params_check_the_copy_curriculum():
    from pretrain.stage import PretrainParams

    ok = PretrainParams(seq_len=256, copy_share=0.5, copy_until_tokens=100_000, copy_span_tokens=[16, 64])
    assert ok.copy_share == 0.5
    with pytest.raises(ValueError, match="copy_until_tokens"):
        PretrainParams(seq_len=256, copy_share=0.5, copy_until_tokens=100)
    with pytest.raises(ValueError, match="copy_span_tokens"):
        PretrainParams(seq_len=256, copy_share=0.5, copy_until_tokens=100_000, copy_span_tokens=[64, 16])
    with pytest.raises(ValueError, match="does not fit"):
        PretrainParams(seq_len=256, copy_share=0.5, copy_until_tokens=100_000, copy_span_tokens=[200, 300])
    assert ok.copy_draw == "uniform" and ok.copy_gap_tokens == [0, 0]
    with pytest.raises(ValueError, match="copy_gap_tokens"):
        PretrainParams(seq_len=256, copy_share=0.5, copy_until_tokens=100_000, copy_gap_tokens=[50, 10])
    with pytest.raises(ValueError, match="gap does not fit"):
        PretrainParams(seq_len=256, copy_share=0.5, copy_until_tokens=100_000, copy_span_tokens=[16, 64],
                       copy_gap_tokens=[230, 240])
    with pytest.raises(ValueError, match="copy_draw"):
        PretrainParams(seq_len=256, copy_share=0.5, copy_until_tokens=100_000, copy_draw="zipf")


def test_a_pure_copy_window_reads_only_copy_rows_then_the_plain_epochs_from_their_start():
    """copy_share 1: the curriculum's window holds nothing but copy rows; the plain rows then start at their first
    epoch's first slot, as a run without the curriculum starts."""
    from pretrain.copy_schedule import copy_rows_for
    from pretrain.packed_data import CurriculumLoader, RowLoader

    assert copy_rows_for(10 * 256, 256, 1.0, 6 * 256) == 6
    loader = CurriculumLoader(20 + 6, copy_start=20, copy_rows=6, curriculum_rows=6, seed=4)
    first = loader.next_indices(6)
    assert first == list(range(20, 26))
    assert loader.next_indices(25) == RowLoader(20, seed=4).next_indices(25)


def test_copy_rows_kept_after_the_window_are_read_once_each_spread_over_their_slots():
    """copy_keep_share: the window reads its copy rows as before; the kept ones follow, one every keep_slots /
    keep_rows slots after it, in order; then plain rows alone. The plain rows walk a plain loader's epochs."""
    from pretrain.copy_schedule import copy_keep_rows_for
    from pretrain.packed_data import CurriculumLoader, RowLoader

    assert copy_keep_rows_for(100 * 256, 256, 0.1, 60) == (4, 40)  # 10% of the 40 rows after a 60-row window
    assert copy_keep_rows_for(100 * 256, 256, 0.0, 60) == (0, 0)
    assert copy_keep_rows_for(100 * 256, 256, 0.01, 60) == (0, 0)  # under one row: none
    with pytest.raises(ValueError, match="copy_keep_share"):
        copy_keep_rows_for(100 * 256, 256, 1.0, 60)
    kept = CurriculumLoader(20 + 10, copy_start=20, copy_rows=10, curriculum_rows=6, seed=4, keep_rows=4,
                            keep_slots=40)
    order = kept.next_indices(6) + kept.next_indices(50)
    assert order[:6] == list(range(20, 26))  # the window: its 6 copy rows alone, as without kept rows
    at = [k for k, i in enumerate(order) if i >= 20][6:]
    assert [order[k] for k in at] == [26, 27, 28, 29] and at == [15, 25, 35, 45]  # one every 10 slots
    plain = [i for i in order if i < 20]
    assert plain == RowLoader(20, seed=4).next_indices(len(plain))
    window_only = CurriculumLoader(20 + 6, copy_start=20, copy_rows=6, curriculum_rows=6, seed=4)
    assert window_only.next_indices(52) == [i for i in order if i < 26]  # the same rows, less the kept ones
    state = kept.state_dict()
    assert state["keep_rows"] == 4 and state["keep_slots"] == 40
    with pytest.raises(ValueError, match="not saved by this copy curriculum"):
        CurriculumLoader(20 + 10, copy_start=20, copy_rows=10, curriculum_rows=6, seed=4, keep_rows=4,
                         keep_slots=80).load_state_dict(state)  # kept rows spread otherwise
    old = {k: v for k, v in window_only.state_dict().items() if not k.startswith("keep")}  # saved before the param
    fresh = CurriculumLoader(20 + 6, copy_start=20, copy_rows=6, curriculum_rows=6, seed=4)
    fresh.load_state_dict(old)
    assert fresh.slot == 52
    with pytest.raises(ValueError, match="keep_rows"):
        CurriculumLoader(30, copy_start=20, copy_rows=10, curriculum_rows=6, seed=4, keep_rows=10, keep_slots=40)
    with pytest.raises(ValueError, match="keep_rows"):
        CurriculumLoader(30, copy_start=20, copy_rows=10, curriculum_rows=6, seed=4, keep_rows=4, keep_slots=3)


def test_kept_copy_rows_follow_the_window_s_rows_unchanged(mixed, tokenizer, tmp_path):
    """add_copy_rows with keep_rows: the window's rows are the very rows made without them (one stream, in order),
    the kept ones come after, the record counts both, and the split's loader reads them as recorded."""
    from pretrain.packed_data import CurriculumLoader, make_loader
    from pretrain.retrieval_rows import add_copy_rows, copy_metrics

    src, _ = mixed
    plain_dir, kept_dir = tmp_path / "plain", tmp_path / "kept"
    shutil.copytree(src, plain_dir)
    shutil.copytree(src, kept_dir)
    a = add_copy_rows(plain_dir, tokenizer, rows=6, share=0.5, seed=0, span_tokens=(8, 40))
    b = add_copy_rows(kept_dir, tokenizer, rows=6, share=0.5, seed=0, span_tokens=(8, 40), keep_rows=3, keep_slots=30)
    assert (a["rows"], b["rows"], b["keep_rows"], b["keep_slots"]) == (6, 9, 3, 30)
    assert a["curriculum_rows"] == b["curriculum_rows"] == 12 and a["first_copy_row"] == b["first_copy_row"]
    ra, rb = PackedRows(plain_dir, "train"), PackedRows(kept_dir, "train")
    assert len(rb) == len(ra) + 3 and rb.info.train.tokens == ra.info.train.tokens + 3 * 256
    for i in range(len(ra)):
        assert all((x == y).all() for x, y in zip(ra.row(i), rb.row(i), strict=True))
    assert b["samples"] > a["samples"] and b["loss_tokens"] > a["loss_tokens"]
    assert copy_metrics(b)["copy_curriculum.keep_rows"] == 3
    loader = make_loader(rb, seed=0)
    assert isinstance(loader, CurriculumLoader) and (loader.keep_rows, loader.keep_slots) == (3, 30)
    first = b["first_copy_row"]
    order = loader.next_indices(42)
    assert [i for i in order[12:] if i >= first] == [first + 6, first + 7, first + 8]
    with pytest.raises(ValueError, match="keep_rows"):
        add_copy_rows(tmp_path / "bad", tokenizer, rows=6, share=0.5, seed=0, keep_rows=5, keep_slots=2)


def test_every_kept_copy_row_is_read_within_the_run_when_the_window_rounds_up():
    """A window of 21 rows at share 0.7 spans ceil(21 / 0.7) = 31 slots (one more than the 30 of copy_until_tokens,
    by float rounding): the kept rows spread over the slots after those 31, so a run that reads exactly its
    train_tokens still reads every copy row once (a review found the last one read past the run's end)."""
    from pretrain.packed_data import CurriculumLoader
    from pretrain.stage import PretrainParams

    p = PretrainParams(seq_len=256, copy_share=0.7, copy_until_tokens=30 * 256, train_tokens=100 * 256, batch_rows=4,
                       micro_batch_rows=4, max_batch_rows=4, copy_keep_share=0.2)
    rows, (kept, slots) = p.copy_schedule()
    assert (rows, kept, slots) == (21, 13, 69)
    for world in (1, 2):
        loaders = [CurriculumLoader(50 + rows + kept, copy_start=50, copy_rows=rows + kept, curriculum_rows=31, seed=0,
                                    keep_rows=kept, keep_slots=slots, rank=r, world_size=world) for r in range(world)]
        per_rank = 4 if world == 1 else 5  # 100 slots in whole steps
        read = [i for _ in range(100 // (per_rank * world)) for ld in loaders for i in ld.next_indices(per_rank)]
        assert len(read) == 100 and sorted(i for i in read if i >= 50) == list(range(50, 50 + rows + kept)), world


def test_pretrain_params_refuse_kept_copy_rows_without_a_window():
    from pretrain.stage import PretrainParams

    ok = PretrainParams(seq_len=256, copy_share=1.0, copy_until_tokens=100_000, copy_keep_share=0.05)
    assert ok.copy_keep_share == 0.05 and PretrainParams().copy_keep_share == 0.0
    with pytest.raises(ValueError, match="set copy_share"):
        PretrainParams(seq_len=256, copy_keep_share=0.05)
    with pytest.raises(ValueError, match="copy_keep_share"):
        PretrainParams(seq_len=256, copy_share=1.0, copy_until_tokens=100_000, copy_keep_share=1.0)
    with pytest.raises(ValueError, match="keeps no copy row: of the 100 rows the run reads, the copy window takes the "
                                         "first 100"):  # the window takes the whole run
        PretrainParams(seq_len=256, copy_share=1.0, copy_until_tokens=200 * 256, train_tokens=100 * 256,
                       copy_keep_share=0.5)
