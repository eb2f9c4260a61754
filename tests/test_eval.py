"""The ``eval`` stage (issue 11 item 3): NIAH prompts built to the token, on held-out text only; exact-match and recall
scoring; multi-round NIAH dialogues; acc_norm and the §4.1.3.1 log acc_norm² on hand-computed examples; lm-eval JSONL
task files and their errors; the power analysis against hand-computed and published values; and the stage end to
end on a tiny pretrained checkpoint (report, MLflow metrics, plots).

The fast tests need no model; the slow ones share one tiny pretraining run (module scope, ~20 s) and one eval run.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from data.eval_tasks import (
    CHAT_QUESTION,
    NEEDLE,
    QUESTION,
    MCItem,
    TokenStream,
    build_cloze_task,
    build_copy_trials,
    build_multi_round_trial,
    build_next_sentence_task,
    build_niah_trials,
    needle_rounds,
    niah_chat_prompt,
    niah_distractors,
    niah_prompt,
    read_lm_eval_jsonl,
)
from evaluation.eval import EvalParams
from evaluation.heldout import heldout_documents
from evaluation.metrics import (
    NIAH_ANSWER_KINDS,
    choice_scores,
    log_acc_norm2,
    min_detectable_accuracy_difference,
    min_samples_for_accuracy_difference,
    min_samples_for_mean_difference,
    niah_answer_kind,
    niah_correct,
    niah_prefix_digits,
    recall,
)
from pipeline.stage import Artifact, StageContext
from tests.pretrain_fixtures import PretrainInputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> PretrainInputs:
    from tests.pretrain_fixtures import build_inputs

    return build_inputs(tmp_path_factory.mktemp("eval_inputs"))  # every 10th of 120 documents never sampled


@dataclass
class Tok:
    encode: object
    decode: object
    render: object
    bos: int


@pytest.fixture(scope="module")
def tok(inputs: PretrainInputs) -> Tok:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    t = Tokenizer.from_file(str(inputs.tokenizer.path / "tokenizer.json"))
    chat = AutoTokenizer.from_pretrained(inputs.tokenizer.path)
    return Tok(encode=lambda s: t.encode(s, add_special_tokens=False).ids,
               decode=lambda ids: t.decode(ids, skip_special_tokens=True),
               render=lambda m: chat.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
               bos=t.token_to_id("<|bos|>"))


def _docs(inputs: PretrainInputs) -> list[tuple[str, str]]:
    from data.documents import iter_documents

    return [(r["id"], r["text"]) for r in iter_documents(inputs.documents.path)]


# --- NIAH prompts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("length", [100, 300])
def test_niah_prompt_has_the_requested_tokens_and_the_needle_at_its_depth(tok: Tok, depth: float, length: int) -> None:
    stream = TokenStream(np.arange(1000, 1500))  # token ids that are easy to trace back to stream positions
    t = niah_prompt(stream, offset=37, length=length, depth=depth, city="Oslo", number="1234567", encode=tok.encode,
                    bos_id=tok.bos)
    needle = tok.encode(" " + NEEDLE.format(city="Oslo", number="1234567"))
    question = tok.encode(QUESTION.format(city="Oslo"))
    hay_len = length - 1 - len(needle) - len(question)
    assert len(t.ids) == length and t.ids[0] == tok.bos
    assert t.needle_start == 1 + round(depth * hay_len)  # depth = share of the haystack before the needle
    assert t.ids[t.needle_start:t.needle_start + len(needle)] == needle and t.needle_len == len(needle)
    assert t.ids[-len(question):] == question
    haystack = t.ids[1:t.needle_start] + t.ids[t.needle_start + len(needle):-len(question)]
    assert haystack == list(range(1037, 1037 + hay_len))  # one contiguous piece of the stream, in order


def test_niah_chat_prompt_is_the_haystack_and_needle_as_a_user_turn_without_the_completion_cue(tok: Tok) -> None:
    words = " ".join(f"river{i % 50} stone" for i in range(400))
    stream = TokenStream(np.asarray(tok.encode(words), np.int64))
    t = niah_prompt(stream, offset=5, length=300, depth=0.5, city="Oslo", number="1234567", encode=tok.encode,
                    bos_id=tok.bos)
    ids = niah_chat_prompt(t, tok.encode, tok.decode, tok.render)
    plain = tok.decode(t.ids[1:])  # the plain prompt's text: haystack, needle, the question with its cue
    assert plain.endswith(QUESTION.format(city="Oslo"))
    body = plain[:-len(QUESTION.format(city="Oslo"))]
    assert ids == tok.encode(tok.render([{"role": "user", "content": body + CHAT_QUESTION.format(city="Oslo")}]))
    text = tok.decode(ids)
    assert NEEDLE.format(city="Oslo", number="1234567") in text and body.strip()[:40] in text
    assert text.count("The special magic Oslo number is:") == 1  # the needle's; the cue is not there


def test_niah_haystack_wraps_around_the_held_out_stream_and_never_leaves_it(tok: Tok) -> None:
    stream = TokenStream(np.arange(1000, 1100))
    t = niah_prompt(stream, offset=90, length=200, depth=0.5, city="Lima", number="7654321", encode=tok.encode,
                    bos_id=tok.bos)
    hay = t.ids[1:t.needle_start] + t.ids[t.needle_start + t.needle_len:-len(tok.encode(QUESTION.format(city="Lima")))]
    assert hay == [1000 + (90 + i) % 100 for i in range(len(hay))]


def test_niah_prompt_too_short_for_needle_and_question_says_so(tok: Tok) -> None:
    with pytest.raises(ValueError, match="no room for a haystack"):
        niah_prompt(TokenStream(np.arange(100)), 0, 20, 0.5, "Oslo", "1234567", tok.encode, tok.bos)


def test_niah_trials_cover_the_grid_with_fresh_needles(tok: Tok) -> None:
    stream = TokenStream(np.arange(1000, 3000))
    trials = build_niah_trials(stream, tok.encode, tok.bos, [128, 256], [0.0, 0.5, 1.0], trials=3, seed=5)
    assert len(trials) == 2 * 3 * 3
    assert sorted({(t.length, t.depth) for t in trials}) == [(L, d) for L in (128, 256) for d in (0.0, 0.5, 1.0)]
    assert all(len(t.ids) == t.length for t in trials)
    assert len({t.number for t in trials}) == len(trials) and all(len(t.number) == 7 for t in trials)
    again = build_niah_trials(stream, tok.encode, tok.bos, [128, 256], [0.0, 0.5, 1.0], trials=3, seed=5)
    assert [t.ids for t in again] == [t.ids for t in trials]  # seeded


def test_niah_distractors_are_other_seven_digit_numbers_drawn_apart_from_the_trials(tok: Tok) -> None:
    stream = TokenStream(np.arange(1000, 3000))
    trials = build_niah_trials(stream, tok.encode, tok.bos, [128], [0.0, 0.5, 1.0], trials=4, seed=5)
    wrong = niah_distractors(trials, 3, seed=5)
    assert len(wrong) == len(trials)
    for t, w in zip(trials, wrong, strict=True):
        assert len(w) == 3 and len(set(w)) == 3 and t.number not in w
        assert all(re.fullmatch(r"[1-9]\d{6}", x) for x in w)
    assert niah_distractors(trials, 3, seed=5) == wrong and niah_distractors(trials, 3, seed=6) != wrong
    # their own random stream: the trials a seed builds do not depend on whether distractors are drawn
    again = build_niah_trials(stream, tok.encode, tok.bos, [128], [0.0, 0.5, 1.0], trials=4, seed=5)
    assert [t.ids for t in again] == [t.ids for t in trials]


def test_copy_trials_repeat_random_ordinary_tokens_once_after_bos() -> None:
    vocab = list(range(10, 500))
    trials = build_copy_trials(vocab, 1, trials=3, n=16, seed=0)
    assert len(trials) == 3 and len({tuple(t.ids) for t in trials}) == 3
    for t in trials:
        r = t.ids[1:17]
        assert t.ids == [1, *r, *r] and set(r) <= set(vocab)
        # each second-copy target is the token that followed its predecessor in the first copy
        assert [t.ids[p] for p in t.second_copy_targets()] == r[1:]
        assert [t.ids[p] for p in t.first_copy_targets()] == r[1:]
        assert min(t.second_copy_targets()) - 1 == 17  # predicted from the second copy's first token on
    with pytest.raises(ValueError, match="too few"):
        build_copy_trials(vocab, 1, trials=1, n=3, seed=0)


class _InductionOracle:
    """A stand-in for the eval stage's Scorer that predicts by induction alone: after a token seen before, the
    token that followed its latest earlier occurrence (probability 0.9), else uniform. The copy probe must find
    it copies (second copy) and cannot guess (first copy)."""

    def __init__(self, vocab: int) -> None:
        import torch

        self.torch, self.device, self.bos, self.vocab = torch, torch.device("cpu"), 0, vocab

    def ordinary_token_ids(self) -> list[int]:
        return list(range(1, self.vocab))

    def token_logprobs(self, ids, hits: bool = False):  # noqa: ANN001, ANN201
        torch = self.torch
        logp = torch.full((ids.shape[0], ids.shape[1] - 1), -math.log(self.vocab))
        hit = torch.zeros_like(logp, dtype=torch.bool)
        for b, row in enumerate(ids.tolist()):
            last: dict[int, int] = {}
            for t in range(len(row) - 1):
                if row[t] in last:
                    guess = row[last[row[t]] + 1]
                    logp[b, t] = math.log(0.9) if guess == row[t + 1] else math.log(0.1 / self.vocab)
                    hit[b, t] = guess == row[t + 1]
                last[row[t]] = t
        return (logp, hit) if hits else logp


def test_copy_probe_credits_a_copying_model_on_the_second_copy_only(tmp_path: Path) -> None:
    from evaluation.eval import _copy_probe

    ctx = StageContext(tmp_path / "out", {}, stage_name="eval")
    got = _copy_probe(_InductionOracle(vocab=5000), EvalParams(copy_trials=4, copy_tokens=32, copy_pool="vocab"), ctx)
    # with 5,000 ids and 32 draws a repeated id inside one copy is rare; the oracle then guesses its latest follower
    assert got["accuracy"] > 0.95 and got["trials"] == 4
    assert got["first_copy_loss"] == pytest.approx(math.log(5000), rel=0.05)
    assert got["second_copy_loss"] < 0.3 and got["loss_gain"] > 8
    assert _copy_probe(_InductionOracle(5000), EvalParams(copy_trials=0), ctx) is None


def test_copy_probe_draws_from_the_held_out_texts_tokens_by_default(tmp_path: Path) -> None:
    from data.eval_tasks import TokenStream
    from evaluation.eval import _copy_probe

    ctx = StageContext(tmp_path / "out", {}, stage_name="eval")
    held = np.asarray([0, 7, 9, 11, 7, 13, 200, 4999, 9, 0], np.int64)  # 0 is BOS, not an ordinary id here
    stream = TokenStream(held)
    got = _copy_probe(_InductionOracle(vocab=5000), EvalParams(copy_trials=4, copy_tokens=32), ctx, stream)
    assert got["pool"] == "seen" and got["pool_size"] == 6 and got["uniform_loss"] == pytest.approx(math.log(6))
    whole = _copy_probe(_InductionOracle(vocab=5000), EvalParams(copy_trials=4, copy_tokens=32, copy_pool="vocab"),
                        ctx, stream)
    assert whole["pool_size"] == 4999
    with pytest.raises(ValueError, match="held-out text"):
        _copy_probe(_InductionOracle(vocab=5000), EvalParams(copy_trials=4), ctx)


# --- scoring ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("answer", "right"), [
    (" 1234567.", True), ("1234567", True), (" is: 1234567 and 42", True),
    (" 12345678", False), (" 123 4567", False), (" 7 then 1234567", False), (" the number", False), ("", False),
])
def test_niah_answer_is_an_exact_match_of_the_first_number(answer: str, right: bool) -> None:
    assert niah_correct(answer, "1234567") is right


@pytest.mark.parametrize(("answer", "share"), [
    (" 1234567.", 1.0), (" 123456\n", 6 / 7), (" 12345677777", 1.0), (" 1299999", 2 / 7), (" 7654321", 0.0),
    (" the number", 0.0), ("", 0.0), (" 1 then 1234567", 1 / 7),
])
def test_niah_prefix_digits_is_the_share_of_the_needles_digits_copied_from_its_start(answer: str, share: float) -> None:
    """A copy with a wrong end (one digit short, or running on) keeps the digits it got right; exact match does not."""
    assert niah_prefix_digits(answer, "1234567") == pytest.approx(share)
    assert (niah_prefix_digits(answer, "1234567") == 1.0) >= niah_correct(answer, "1234567")


@pytest.mark.parametrize(("answer", "kind"), [
    (" 1234567.", "correct"), (" 123456.  The", "near_copy"), (" 12345677777", "near_copy"),
    (" 1239999", "near_copy"), (" 1299999", "other_number"), (" 4, 4, 4,", "other_number"),
    ("  If bash is not specified", "text"), (" 9. To", "other_number"), ("", "text"), (" the 1234567", "correct"),
    (" it is 123", "near_copy"),
])
def test_niah_answers_are_sorted_into_kinds(answer: str, kind: str) -> None:
    """Correct; a wrong copy of the needle (its first 3+ digits); another number first; or text first (the haystack
    went on). The first number decides correct and near_copy wherever it stands, the first character the rest."""
    assert niah_answer_kind(answer, "1234567") == kind
    assert kind in NIAH_ANSWER_KINDS


def test_multi_round_recall_counts_whole_numbers_found() -> None:
    assert recall("Oslo: 111, Lima 222.", ["111", "222", "333"]) == [True, True, False]
    assert recall("1112223", ["111", "222"]) == [False, False]  # digits inside a longer number do not count


# --- multi-round NIAH ---------------------------------------------------------------------------------------------
def test_multi_round_dialogue_puts_needle_rounds_at_their_depths_and_fills_to_the_length(
        tok: Tok, inputs: PretrainInputs) -> None:
    docs = _docs(inputs)[:30]
    stream = TokenStream(np.concatenate([np.asarray(tok.encode(t + "\n\n")) for _, t in docs]))
    t = build_multi_round_trial(stream, tok.encode, tok.decode, tok.render, 600, 8, [0.25, 0.5, 0.75],
                                np.random.default_rng(0))
    assert t.needle_rounds == [2, 4, 6]
    assert abs(len(t.ids) - 600) <= 2, len(t.ids)
    assert t.ids[-2:] == tok.encode("<|assistant|>\n")  # the template's generation prompt ends the dialogue
    text = tok.decode(t.ids)
    # each needle is an assistant turn, in depth order, and the last request names every city
    at = [text.index(NEEDLE.format(city=c, number=n)) for c, n in zip(t.cities, t.numbers, strict=True)]
    assert at == sorted(at)
    last = text[text.rindex("Earlier in our conversation"):]
    assert all(c in last for c in t.cities) and not any(n in last for n in t.numbers)
    assert len(set(t.cities)) == 3


def test_needle_rounds_must_be_distinct_with_a_filler_round() -> None:
    assert needle_rounds(4, [0.25, 0.5, 0.75]) == [1, 2, 3]
    assert needle_rounds(10, [0.0, 1.0]) == [0, 9]
    with pytest.raises(ValueError, match="distinct"):
        needle_rounds(3, [0.25, 0.5, 0.75])


# --- multiple-choice metrics on hand-computed examples -------------------------------------------------------------
def test_acc_acc_norm_and_log_acc_norm2_by_hand() -> None:
    # log-likelihoods -4, -6, -3 of choices of 2, 4 and 1 characters (= bytes): per-char scores -2, -1.5, -3
    s = choice_scores([-4.0, -6.0, -3.0], ["ab", "abcd", "a"], gold=1)
    assert s.acc == 0.0  # raw argmax is choice 2
    assert s.acc_norm == 1.0  # normalised argmax is choice 1
    # log softmax at gold of (-2, -1.5, -3): -1.5 - ln(e^-2 + e^-1.5 + e^-3) = -1.5 - ln(0.408252) = -0.604131
    assert s.log_acc_norm2 == pytest.approx(-1.5 - math.log(math.exp(-2) + math.exp(-1.5) + math.exp(-3)), abs=1e-12)
    assert s.log_acc_norm2 == pytest.approx(-0.604131, abs=1e-6)


def test_log_acc_norm2_divides_by_utf8_bytes_where_acc_norm_divides_by_characters() -> None:
    # "é" is 1 character but 2 bytes. acc_norm (lm-eval: characters): -2/1 = -2 < -3/2 = -1.5 -> picks choice 1.
    # log acc_norm² (§4.1.3.1: bytes): -2/2 = -1 > -1.5 -> favours choice 0: -1 - ln(e^-1 + e^-1.5) = -0.474077
    s = choice_scores([-2.0, -3.0], ["é", "ab"], gold=0)
    assert s.acc_norm == 0.0
    assert s.log_acc_norm2 == pytest.approx(-1 - math.log(math.exp(-1) + math.exp(-1.5)), abs=1e-12)
    assert s.log_acc_norm2 > math.log(0.5)


def test_log_acc_norm2_of_indistinguishable_choices_is_log_one_over_choices() -> None:
    assert log_acc_norm2([-3.0, -6.0, -2.0, -9.0], ["abc", "abcdef", "a.", "123456789"], 2) == \
        pytest.approx(math.log(1 / 4), abs=1e-12)
    with pytest.raises(ValueError):
        log_acc_norm2([-1.0, -2.0], ["a", "b"], 2)


# --- built multiple-choice tasks ----------------------------------------------------------------------------------
def test_cloze_items_hide_the_last_word_of_a_held_out_sentence_among_words_of_other_documents(
        inputs: PretrainInputs) -> None:
    docs = _docs(inputs)[:40]
    texts = dict(docs)
    task = build_cloze_task(docs, n=30, n_choices=4, context_chars=300, seed=1)
    assert task.name == "cloze" and len(task.items) == 30
    assert len({i.gold for i in task.items}) > 1  # the right answer is not always in the same place
    for item in task.items:
        gold = item.choices[item.gold]
        text = texts[item.source]
        assert len(item.choices) == 4 and len({c.lower() for c in item.choices}) == 4 and len(item.context) <= 300
        # in the source document, the context's last words are followed by the gold word and the sentence's end
        tail = item.context.split()[-3:]
        words = text.split()
        assert any(words[k:k + 3] == tail and re.fullmatch(re.escape(gold) + r"[.!?]", words[k + 3])
                   for k in range(len(words) - 3)), (item.context[-60:], gold)
        for c in item.choices:  # distractors end sentences of other documents
            if c != gold:
                assert any(re.search(rf"\b{re.escape(c)}[.!?]", t) for i, t in docs if i != item.source)


def test_next_sentence_items_offer_the_sentence_that_follows_in_the_same_document(inputs: PretrainInputs) -> None:
    docs = _docs(inputs)[:40]
    texts = dict(docs)
    task = build_next_sentence_task(docs, n=25, n_choices=3, context_chars=200, seed=2)
    assert len(task.items) == 25
    for item in task.items:
        text = texts[item.source]
        gold = item.choices[item.gold]
        at = text.index(item.context)
        assert text[at + len(item.context):].lstrip().startswith(gold)  # the gold sentence follows the context
        assert len(set(item.choices)) == 3
        for c in item.choices:  # distractors are sentences of other documents
            if c != gold:
                assert any(c in t for i, t in docs if i != item.source)
    assert build_next_sentence_task(docs, 25, 3, 200, seed=2).items == task.items


def test_mc_continuation_uses_lm_evals_space_delimiter() -> None:
    assert MCItem("The cat sat on the", ["mat", "moon"], 0).continuation(0) == " mat"
    assert MCItem("Answer:\n", ["yes", "no"], 1).continuation(1) == "no"


# --- lm-eval JSONL ------------------------------------------------------------------------------------------------
def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_lm_eval_jsonl_reads_the_common_shapes(tmp_path: Path) -> None:
    path = _write(tmp_path / "mytask.jsonl", [
        json.dumps({"query": "Q: 2+2=", "choices": ["3", "4"], "gold": 1}),
        "",
        json.dumps({"context": "The sky is", "choices": {"text": ["blue", "green", "red"], "label": ["A", "B", "C"]},
                    "gold": 0}),
        json.dumps({"query": "Pick", "choices": ["x", "y"], "gold": "y", "extra": 1}),
    ])
    task = read_lm_eval_jsonl(path)
    assert task.name == "mytask"
    assert [(i.context, i.choices, i.gold) for i in task.items] == [
        ("Q: 2+2=", ["3", "4"], 1), ("The sky is", ["blue", "green", "red"], 0), ("Pick", ["x", "y"], 1)]
    assert task.items[1].source == f"{path}:3"
    gz = tmp_path / "zipped.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"query": "a", "choices": ["b", "c"], "gold": 0}) + "\n")
    assert read_lm_eval_jsonl(gz).name == "zipped" and len(read_lm_eval_jsonl(gz).items) == 1


GOOD = json.dumps({"query": "q", "choices": ["a", "b"], "gold": 0})


@pytest.mark.parametrize(("bad", "message"), [
    ('{"query": "q", "choices": ["a", "b"], "gold": 0', "not valid JSON"),
    (json.dumps({"choices": ["a", "b"], "gold": 0}), "no 'query' or 'context' field"),
    (json.dumps({"query": "q", "choices": ["a"], "gold": 0}), "'choices' must be a list of at least 2"),
    (json.dumps({"query": "q", "choices": "a b", "gold": 0}), "'choices' must be a list"),
    (json.dumps({"query": "q", "choices": ["a", "b"], "gold": 2}), "'gold' must be the index"),
    (json.dumps({"query": "q", "choices": ["a", "b"], "gold": True}), "'gold' must be the index"),
    (json.dumps({"query": "q", "choices": ["a", "b"]}), "'gold' must be the index"),
    (json.dumps({"query": 3, "choices": ["a", "b"], "gold": 0}), "'query' must be a string"),
    (json.dumps(["q", ["a", "b"], 0]), "expected a JSON object"),
])
def test_lm_eval_jsonl_bad_line_names_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path / "t.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError) as e:
        read_lm_eval_jsonl(path)
    assert f"{path}:3" in str(e.value) and message in str(e.value)


def test_lm_eval_jsonl_without_items_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no items"):
        read_lm_eval_jsonl(_write(tmp_path / "empty.jsonl", ["", "  "]))


# --- power analysis -----------------------------------------------------------------------------------------------
def test_min_samples_for_accuracy_difference_by_hand() -> None:
    # p1 .5, p2 .6: pbar .55; z .975 = 1.959964, z .8 = 0.841621
    # (1.959964 sqrt(2 .55 .45) + 0.841621 sqrt(.25 + .24))^2 / .1^2 = (1.378956 + 0.589135)^2 / .01 = 387.34 -> 388
    assert min_samples_for_accuracy_difference(0.5, 0.6) == 388
    assert min_samples_for_accuracy_difference(0.6, 0.5) == 388
    # p1 .25, p2 .30: (1.959964 sqrt(.39875) + 0.841621 sqrt(.3975))^2 / .05^2 = (1.237651 + 0.530623)^2 / .0025
    # = 1250.72 -> 1251
    assert min_samples_for_accuracy_difference(0.25, 0.30) == 1251
    assert min_samples_for_accuracy_difference(0.5, 0.6, power=0.9) > 388  # more power costs samples
    with pytest.raises(ValueError):
        min_samples_for_accuracy_difference(0.5, 0.5)


def test_min_samples_for_mean_difference_matches_gpower() -> None:
    # two-sided two-sample t-test, alpha .05, power .8: d = .5 -> 64 per group, d = .8 -> 26 (G*Power, Cohen)
    assert min_samples_for_mean_difference(0.5, 1.0) == 64
    assert min_samples_for_mean_difference(0.8, 1.0) == 26
    assert min_samples_for_mean_difference(0.1, 0.2) == 64  # only delta / sd matters


def test_min_detectable_difference_inverts_the_sample_size() -> None:
    d = min_detectable_accuracy_difference(0.5, 388)
    assert d == pytest.approx(0.1, abs=2e-3)
    assert min_samples_for_accuracy_difference(0.5, 0.5 + d) <= 388 < min_samples_for_accuracy_difference(0.5, 0.5 + d - 1e-3)
    assert min_detectable_accuracy_difference(0.5, 5) == math.inf  # 5 items cannot even detect 0.5 -> 1.0


# --- params and held-out documents ---------------------------------------------------------------------------------
def test_params_need_the_trained_length_and_twice_it() -> None:
    with pytest.raises(ValueError, match="including 1 and 2"):
        EvalParams(context_multiples=[1.0, 4.0])
    with pytest.raises(ValueError, match="needle_depths"):
        EvalParams(needle_depths=[1.5])
    assert EvalParams(context_multiples=[0.5, 1, 2, 4]).context_multiples == [0.5, 1, 2, 4]


def test_tiny_dag_binds_eval_to_pretrain_mix_and_quality_and_checks_task_files(tmp_path: Path) -> None:
    from pipeline.spec import SpecError, load_spec

    repo = Path(__file__).resolve().parents[1]
    spec = load_spec(repo / "dags/tiny.yaml", overrides=[f"artifact_root={tmp_path}"])
    assert spec.stages["eval"].inputs == {"checkpoint": ["pretrain"], "mixture": ["mix"], "documents": ["quality"],
                                          "prompts": ["prompts"]}
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(SpecError) as e:
        load_spec(repo / "dags/tiny.yaml", overrides=[f"artifact_root={tmp_path}", f"eval.task_files=[{missing}]"])
    assert "stage 'eval', field params.task_files.0" in str(e.value) and "missing.jsonl" in str(e.value)


def test_task_file_content_is_part_of_the_cache_key(tmp_path: Path) -> None:
    from evaluation.eval import STAGE

    path = _write(tmp_path / "t.jsonl", [GOOD])
    params = EvalParams(task_files=[str(path)])
    before = STAGE.fingerprint(params)
    _write(path, [GOOD, GOOD])
    assert STAGE.fingerprint(params) != before


def test_heldout_documents_are_exactly_the_pretrain_stages_held_out_set(inputs: PretrainInputs, tmp_path: Path) -> None:
    """12 documents are never sampled; asking for 20 takes 8 out of training. The eval stage recomputes the same set
    pretrain/packed_data.py recorded (eval_documents.json), from the mixture and packing.json alone."""
    from pretrain.packed_data import build_packed_dataset

    packed = tmp_path / "packed"
    info = build_packed_dataset(inputs.mixture.path, inputs.documents.path, inputs.tokenizer.path, packed,
                                seq_len=128, seed=3, eval_documents=20)
    assert (info.eval_from_unsampled, info.held_out_from_training) == (12, 8)
    held = heldout_documents(packed, inputs.mixture.path, inputs.documents.path)
    recorded = [e["id"] for e in json.loads((packed / "eval_documents.json").read_text())]
    assert [i for i, _ in held.docs] == recorded and held.seq_len == 128
    texts = dict(_docs(inputs))
    assert all(text == texts[i] for i, text in held.docs)


def test_heldout_documents_refuse_a_mixture_the_checkpoint_was_not_trained_on(inputs: PretrainInputs,
                                                                               tmp_path: Path) -> None:
    from pretrain.packed_data import build_packed_dataset

    packed = tmp_path / "packed"
    build_packed_dataset(inputs.mixture.path, inputs.documents.path, inputs.tokenizer.path, packed, seq_len=128,
                         seed=0, eval_documents=12)
    other = tmp_path / "mixture"
    other.mkdir()
    with gzip.open(inputs.mixture.path / "mixture.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    rows[1]["sample_count"] += 1
    with gzip.open(other / "mixture.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with pytest.raises(ValueError, match="bind the eval stage to the mix"):
        heldout_documents(packed, other, inputs.documents.path)
    with pytest.raises(FileNotFoundError, match="packing.json"):
        heldout_documents(tmp_path, inputs.mixture.path, inputs.documents.path)


def test_heldout_documents_of_a_continued_checkpoint_are_pretrains(inputs: PretrainInputs, tmp_path: Path) -> None:
    """long_context and post-training checkpoints carry pretrain's held-out fields beside their own `eval` block:
    the eval stage finds pretrain's held-out documents through them, and refuses a record that does not match."""
    from pretrain.packed_data import build_packed_dataset

    packed = tmp_path / "packed"
    build_packed_dataset(inputs.mixture.path, inputs.documents.path, inputs.tokenizer.path, packed, seq_len=128,
                         seed=0, eval_documents=20)  # 8 taken from training: another seed's choice shows in their tokens
    base = heldout_documents(packed, inputs.mixture.path, inputs.documents.path)
    packing = json.loads((packed / "packing.json").read_text())
    continued = tmp_path / "continued"
    continued.mkdir()
    # a later stage's own rows: 3 long documents, another length
    (continued / "packing.json").write_text(json.dumps({**packing, "seq_len": 512,
                                                         "eval": {**packing["eval"], "documents": 3, "tokens": 999}}))
    again = heldout_documents(continued, inputs.mixture.path, inputs.documents.path)
    assert again.docs == base.docs and again.seq_len == 512
    # a continuing stage with a seed of its own (long_context_reseeded: 1000) records pretrain's as heldout_seed
    assert packing["heldout_seed"] == packing["seed"] == 0
    (continued / "packing.json").write_text(json.dumps({**packing, "seed": 1000, "seq_len": 512,
                                                         "eval": {**packing["eval"], "documents": 3, "tokens": 999}}))
    assert heldout_documents(continued, inputs.mixture.path, inputs.documents.path).docs == base.docs
    # a record written before heldout_seed existed names only its own seed: refused, not another held-out set
    (continued / "packing.json").write_text(json.dumps({**packing, "seed": 1000, "heldout_seed": None, "seq_len": 512,
                                                         "eval": {**packing["eval"], "documents": 3, "tokens": 999}}))
    with pytest.raises(ValueError, match="not the pretrain stage's held-out set"):
        heldout_documents(continued, inputs.mixture.path, inputs.documents.path)
    (continued / "packing.json").write_text(json.dumps({**packing, "seq_len": 512, "eval": {"documents": 3, "tokens": 9},
                                                         "held_out_training_tokens": 1 + packing["held_out_training_tokens"]}))
    with pytest.raises(ValueError, match="not the pretrain stage's held-out set"):
        heldout_documents(continued, inputs.mixture.path, inputs.documents.path)


# --- the stage on a tiny pretrained checkpoint ----------------------------------------------------------------------
SEQ = 256  # a 512-token vocabulary spends ~170 tokens on a multi-round dialogue's template, requests and needles
TASK_FILE_ITEMS = [
    {"query": "The capital of France is", "choices": ["Paris", "a banana", "seventeen"], "gold": 0},
    {"context": "Water freezes at zero degrees", "choices": ["Celsius", "pages"], "gold": 0},
    {"query": "One, two, three,", "choices": ["four", "blue", "dog", "the"], "gold": 0},
    {"query": "The opposite of hot is", "choices": ["warm", "cold"], "gold": 1},
    {"query": "Cats and", "choices": ["dogs", "equations"], "gold": 0},
]


@dataclass
class EvalRun:
    ctx: StageContext
    report: dict
    pretrain_summary: dict
    checkpoint: Path


@pytest.fixture(scope="module")
def evaluated(inputs: PretrainInputs, tmp_path_factory: pytest.TempPathFactory) -> EvalRun:
    from evaluation.eval import run
    from pipeline.stage import Resources
    from pretrain.stage import PretrainParams
    from pretrain.stage import run as pretrain

    root = tmp_path_factory.mktemp("eval_stage")
    pctx = StageContext(root / "ckpt", inputs.as_inputs(), stage_name="pretrain", resources=Resources(cpus=1),
                        resume_dir=root / "resume")
    pretrain(PretrainParams(seq_len=SEQ, micro_batch_rows=4, batch_rows=8, max_batch_rows=8, train_tokens=65536,
                            peak_lr=3e-3, log_every=4, checkpoint_every=8, eval_documents=12), pctx)
    task_file = root / "facts.jsonl"
    task_file.write_text("".join(json.dumps(i) + "\n" for i in TASK_FILE_ITEMS))
    checkpoint = Artifact(path=pctx.out_dir, manifest={"type": "checkpoint", "digest": "test-checkpoint"})
    from posttrain.prompts import PromptsParams
    from posttrain.prompts import run as run_prompts

    prompts_ctx = StageContext(root / "prompts", {"documents": inputs.documents}, stage_name="prompts")
    run_prompts(PromptsParams(verifiable={"arithmetic": 40, "string": 40, "retrieval": 0, "code": 4}, open_ended=0),
                prompts_ctx)
    prompts = Artifact(path=prompts_ctx.out_dir, manifest={"type": "prompts", "digest": "test-prompts"})
    ctx = StageContext(root / "out", {"checkpoint": checkpoint, "mixture": inputs.mixture, "documents": inputs.documents,
                                      "prompts": prompts}, stage_name="eval")
    run(EvalParams(needle_depths=[0.0, 0.5, 1.0], niah_trials=2, cloze_items=12, next_sentence_items=10,
                   mr_niah_depths=[0.25, 0.75], loss_windows=4, task_files=[str(task_file)], seed=1,
                   pass_rate_prompts=10, pass_rate_max_new_tokens=16, niah_chat=True), ctx)
    return EvalRun(ctx, json.loads((ctx.out_dir / "report.json").read_text()), pctx.summary, pctx.out_dir)


@pytest.mark.slow
def test_stage_reports_every_metric_in_range(evaluated: EvalRun) -> None:
    s = evaluated.ctx.summary
    for name in ("niah_accuracy", "niah_accuracy_2x", "multi_round_niah_recall", "multi_round_niah_recall_2x",
                 "mc_acc_norm", "mc_acc_norm.cloze", "mc_acc_norm.next_sentence", "mc_acc_norm.facts",
                 "mc_acc.cloze", f"niah_accuracy_at_{SEQ}", f"niah_accuracy_at_{2 * SEQ}", "niah_choice_accuracy",
                 "niah_choice_accuracy_2x", "copy_accuracy", "niah_chat_accuracy", "niah_chat_accuracy_2x"):
        assert 0.0 <= s[name] <= 1.0, name
    for name in ("niah_answer_margin", "niah_answer_margin_2x", "copy_loss_gain"):
        assert math.isfinite(s[name]), name
    for name in ("mc_log_acc_norm2", "mc_log_acc_norm2.cloze", "mc_log_acc_norm2.next_sentence", "mc_log_acc_norm2.facts"):
        assert -20 < s[name] < 0, name
    assert s["mc_items.cloze"] == 12 and s["mc_items.next_sentence"] == 10 and s["mc_items.facts"] == 5
    assert s["mc_acc_norm"] == pytest.approx(np.mean([s[f"mc_acc_norm.{t}"] for t in ("cloze", "next_sentence", "facts")]))
    acc_norm = s["mc_acc_norm.cloze"]  # the power analysis of the task's own accuracy
    assert s["mc_min_items.cloze"] == min_samples_for_accuracy_difference(acc_norm, acc_norm + 0.05)
    assert s["mc_mde.cloze"] == pytest.approx(min_detectable_accuracy_difference(acc_norm, 12))
    # everything in the summary reached the sink (MLflow in a pipeline run), with the loss curve by position
    logged = {k for k, _, step in evaluated.ctx.sink.metrics if step is None}
    assert set(s) <= logged
    curve = [(step, v) for k, v, step in evaluated.ctx.sink.metrics if k == "loss_by_position"]
    assert [p for p, _ in curve] == [p for p, _ in evaluated.report["loss_by_position"]["curve"]] and curve[-1][0] == 2 * SEQ - 1
    assert {p.name for p, _ in evaluated.ctx.sink.artifacts} == {"niah.png", "loss_by_position.png", "report.json"}
    for name in ("niah.png", "loss_by_position.png"):
        assert (evaluated.ctx.out_dir / "plots" / name).stat().st_size > 10_000


@pytest.mark.slow
def test_stage_eval_pass_rate_is_the_checkers_verdict_on_the_held_out_pool(evaluated: EvalRun) -> None:
    from posttrain.verifiable import check

    pool = [json.loads(x) for x in (evaluated.ctx.inputs["prompts"].path / "pools" / "eval.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (evaluated.ctx.out_dir / "pass_rate.jsonl").read_text().splitlines()]
    n = min(10, len(pool))  # pass_rate_prompts=10
    assert n >= 5 and [r["id"] for r in rows] == [r["id"] for r in pool[:n]]  # in pool order
    for rec, row in zip(pool, rows, strict=False):
        assert row["correct"] == check(rec, row["response"]).correct
    s = evaluated.ctx.summary
    assert s["eval_pass_rate"] == pytest.approx(sum(r["correct"] for r in rows) / n) and s["eval_pass_prompts"] == n
    for t in {r["task_type"] for r in rows}:
        typed = [r["correct"] for r in rows if r["task_type"] == t]
        assert s[f"eval_pass_rate.{t}"] == pytest.approx(sum(typed) / len(typed))
    assert evaluated.report["pass_rate"]["prompts"] == n


@pytest.mark.slow
def test_stage_loss_at_the_trained_length_is_a_real_model_loss(evaluated: EvalRun) -> None:
    """Loss of the held-out stream at positions < T: below the unigram baseline pretrain measured (a misaligned
    target would sit far above it) and near pretrain's own held-out loss."""
    s, p = evaluated.ctx.summary, evaluated.pretrain_summary
    # measured: 4.753 at positions < 256 vs pretrain's eval_loss 4.792 and unigram 5.382 after 65K tokens
    assert s[f"eval_loss_at_{SEQ}"] < p["unigram_loss"] - 0.3, (s, p)
    assert abs(s[f"eval_loss_at_{SEQ}"] - p["eval_loss"]) < 0.3, (s, p)
    assert math.isfinite(s[f"eval_loss_at_{2 * SEQ}"])


@pytest.mark.slow
def test_stage_niah_grid_is_scored_by_exact_match_over_every_cell(evaluated: EvalRun) -> None:
    niah = evaluated.report["niah"]
    assert niah["lengths"] == [SEQ, 2 * SEQ] and niah["depths"] == [0.0, 0.5, 1.0]
    assert len(niah["trials"]) == 2 * 3 * 2
    for row in niah["trials"]:
        assert row["correct"] == niah_correct(row["answer"], row["number"])
        assert row["prefix_digits"] == niah_prefix_digits(row["answer"], row["number"])
        assert row["kind"] == niah_answer_kind(row["answer"], row["number"])
        assert row["choice_correct"] == (row["answer_loglik"] > max(row["distractor_logliks"]))
        assert row["margin"] == pytest.approx(row["answer_loglik"] - np.mean(row["distractor_logliks"]))
        assert len(row["distractors"]) == 3 and row["number"] not in row["distractors"]
    for length in niah["lengths"]:
        rows = [r for r in niah["trials"] if r["length"] == length]
        assert niah["choice_accuracy_by_length"][str(length)] == pytest.approx(np.mean([r["choice_correct"] for r in rows]))
        assert niah["margin_by_length"][str(length)] == pytest.approx(np.mean([r["margin"] for r in rows]))
        kinds = niah["answer_kinds_by_length"][str(length)]
        assert list(kinds) == list(NIAH_ANSWER_KINDS) and sum(kinds.values()) == len(rows)
        assert kinds["correct"] == sum(r["correct"] for r in rows)
    assert evaluated.ctx.summary["niah_choice_accuracy_2x"] == niah["choice_accuracy_by_length"][str(2 * SEQ)]
    for length, key in ((SEQ, "niah_prefix_digits"), (2 * SEQ, "niah_prefix_digits_2x")):
        rows = [r for r in niah["trials"] if r["length"] == length]
        assert evaluated.ctx.summary[key] == pytest.approx(np.mean([r["prefix_digits"] for r in rows]))
        assert evaluated.ctx.summary[key] >= niah["accuracy_by_length"][str(length)]
    copy = evaluated.report["copy_probe"]
    assert copy["trials"] == 8 and len(copy["rows"]) == 8
    assert evaluated.ctx.summary["copy_accuracy"] == pytest.approx(np.mean([r["second_copy_accuracy"] for r in copy["rows"]]))
    assert copy["loss_gain"] == pytest.approx(copy["first_copy_loss"] - copy["second_copy_loss"])
    for j, length in enumerate(niah["lengths"]):
        for i, depth in enumerate(niah["depths"]):
            cell = [r["correct"] for r in niah["trials"] if r["length"] == length and r["depth"] == depth]
            assert niah["accuracy"][i][j] == pytest.approx(np.mean(cell))
    assert evaluated.ctx.summary["niah_accuracy"] == pytest.approx(niah["accuracy_by_length"][str(SEQ)])
    # niah_chat: every trial again in the chat template, scored the same way
    for row in niah["trials"]:
        assert row["chat_correct"] == niah_correct(row["chat_answer"], row["number"])
    for length, key in ((SEQ, "niah_chat_accuracy"), (2 * SEQ, "niah_chat_accuracy_2x")):
        cell = [r["chat_correct"] for r in niah["trials"] if r["length"] == length]
        assert niah["chat_accuracy_by_length"][str(length)] == pytest.approx(np.mean(cell))
        assert evaluated.ctx.summary[key] == pytest.approx(np.mean(cell))
    mr = evaluated.report["multi_round_niah"]
    for row in mr["trials"]:
        assert row["found"] == recall(row["answer"], row["numbers"])
        assert abs(row["prompt_tokens"] - row["length"]) <= 2


@pytest.mark.slow
def test_stage_niah_answers_are_greedy_decoding_with_and_without_the_recurrent_cache(evaluated: EvalRun,
                                                                                    tok: Tok) -> None:
    """The stage's answers (HybridCache decode) are what full recomputation at every step gives."""
    import torch
    from transformers import AutoModelForCausalLM

    import model  # noqa: F401

    m = AutoModelForCausalLM.from_pretrained(evaluated.checkpoint / "model").eval()
    row = evaluated.report["niah"]["trials"][-1]
    held = heldout_documents(evaluated.checkpoint, evaluated.ctx.input("mixture").path,
                             evaluated.ctx.input("documents").path)
    stream = TokenStream(np.concatenate([np.asarray(tok.encode(t) + tok.encode("\n\n")) for _, t in held.docs]))
    trials = build_niah_trials(stream, tok.encode, tok.bos, [SEQ, 2 * SEQ], [0.0, 0.5, 1.0], 2, seed=1)
    t = trials[-1]
    assert (t.city, t.number, t.needle_start) == (row["city"], row["number"], row["needle_start"])
    ids = torch.tensor([t.ids])
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=12, do_sample=False, use_cache=False, pad_token_id=m.config.pad_token_id,
                         eos_token_id=m.config.eos_token_id)
    assert tok.decode(out[0, ids.shape[1]:].tolist()) == row["answer"]
    chat = niah_chat_prompt(t, tok.encode, tok.decode, tok.render)  # niah_chat: the same trial as a user turn
    assert len(chat) == row["chat_prompt_tokens"]
    with torch.no_grad():
        out = m.generate(torch.tensor([chat]), max_new_tokens=24, do_sample=False, use_cache=False,
                         pad_token_id=m.config.pad_token_id, eos_token_id=m.config.eos_token_id)
    assert tok.decode(out[0, len(chat):].tolist()) == row["chat_answer"]
    # the forced choice's log-likelihoods are an unpadded forward of prompt + " <number>" for each number
    for number, got in zip([t.number, *row["distractors"]], [row["answer_loglik"], *row["distractor_logliks"]],
                           strict=True):
        cont = tok.encode(f" {number}")
        with torch.no_grad():
            logp = m(torch.tensor([[*t.ids, *cont]])).logits[0].double().log_softmax(-1)
        assert got == pytest.approx(sum(float(logp[len(t.ids) - 1 + j, c]) for j, c in enumerate(cont)), abs=1e-4)
    # the probability that the answer begins with a number: the next-token mass on every digit-led token, the
    # tokenizer's ids counted here by their own text
    with torch.no_grad():
        p_next = m(torch.tensor([t.ids])).logits[0, -1].double().softmax(-1)
    from tokenizers import Tokenizer

    t_ = Tokenizer.from_file(str(evaluated.checkpoint / "model" / "tokenizer.json"))
    special = set(t_.get_added_tokens_decoder())
    digit_led = [i for i in range(t_.get_vocab_size(with_added_tokens=True))
                 if i not in special and t_.decode([i]).lstrip()[:1].isdigit()]
    assert len(digit_led) >= 10
    assert row["number_start_prob"] == pytest.approx(float(p_next[digit_led].sum()), abs=1e-5)
    rows = [r for r in evaluated.report["niah"]["trials"] if r["length"] == SEQ]
    assert evaluated.ctx.summary["niah_number_start_prob"] == pytest.approx(np.mean([r["number_start_prob"]
                                                                                     for r in rows]))
    assert all(0.0 <= r["number_start_prob"] <= 1.0 for r in evaluated.report["niah"]["trials"])


@pytest.mark.slow
def test_stage_choice_logliks_equal_an_unpadded_forward_per_choice(evaluated: EvalRun) -> None:
    import torch

    from evaluation.scorer import Scorer

    scorer = Scorer(evaluated.checkpoint)
    item = MCItem("The capital of France is", ["Paris", "a big yellow banana", "x"], 0)
    got = scorer.choice_logliks(item, max_len=SEQ)
    for k, choice in enumerate(item.choices):
        ctx_ids = scorer.encode(item.context)
        cont = scorer.encode(" " + choice)
        ids = torch.tensor([[scorer.bos, *ctx_ids, *cont]])
        with torch.no_grad():
            logp = scorer.model(ids).logits[0].double().log_softmax(-1)
        want = sum(float(logp[len(ctx_ids) + j, tok]) for j, tok in enumerate(cont))
        assert got[k] == pytest.approx(want, abs=1e-4)
    lines = [json.loads(line) for line in (evaluated.ctx.out_dir / "mc_items.jsonl").read_text().splitlines()]
    facts = [r for r in lines if r["task"] == "facts"]
    assert len(facts) == 5 and all(len(r["logliks"]) == len(TASK_FILE_ITEMS[r["index"]]["choices"]) for r in facts)
    for r in facts:
        s = choice_scores(r["logliks"], TASK_FILE_ITEMS[r["index"]]["choices"], TASK_FILE_ITEMS[r["index"]]["gold"])
        assert (r["acc"], r["acc_norm"], r["log_acc_norm2"]) == (s.acc, s.acc_norm, s.log_acc_norm2)


@pytest.mark.slow
def test_stage_haystacks_and_items_come_from_held_out_documents_only(evaluated: EvalRun, inputs: PretrainInputs) -> None:
    held = evaluated.report["held_out"]
    unsampled = [doc_id for k, (doc_id, _) in enumerate(_docs(inputs)) if k % 10 == 0]  # the fixture's sample_count 0
    assert sorted(held["ids"]) == sorted(unsampled) and held["held_out_from_training"] == 0
    sources = {json.loads(line)["source"] for line in (evaluated.ctx.out_dir / "mc_items.jsonl").read_text().splitlines()
               if json.loads(line)["task"] in ("cloze", "next_sentence")}
    assert sources and sources <= set(unsampled)
