"""posttrain.sft (§5.3, Table 7 Stages I and II): the target of a prompt is its best correct sample by the reward
hierarchy, the reference only when allowed; the n-gram and embedding diversity filters drop exactly the targets too
close to a kept one; TRL's SFTTrainer with the project's chat template puts the loss on the assistant tokens and their
<|end|> only; the stage end to end: a loadable checkpoint whose generation stops at the end of turn, the interface
metrics, the configured steps and schedules, changed weights, and every sft prompt accounted for."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.preference_pairs import reference_response
from posttrain.rewards import RewardHierarchy
from posttrain.sft import DROP_REASONS, SOURCES, SFTParams, choose_prompts
from posttrain.sft_selection import diversity_filter, ngram_jaccard, select_target, word_ngrams
from posttrain.verifiable import ANSWER_INSTRUCTION

ARITH = {"id": "arith/1", "prompt": f"Compute 40 + 2. {ANSWER_INSTRUCTION}", "task_type": "arithmetic",
         "checker": "exact_number", "reference": {"answer": "42"}}
OPEN = {"id": "open/1", "prompt": "Write one sentence about the sea.", "task_type": "continuation"}


def _select(record, texts, **kw):
    hierarchy = RewardHierarchy()
    comps = hierarchy.score([record] * len(texts), texts)
    ref = hierarchy.score([record], [reference_response(record)])[0] if record.get("checker") else None
    return select_target(record, texts, comps, reference_components=ref, **kw), comps


def test_a_correct_sample_beats_a_longer_wrong_one() -> None:
    wrong = "Let me think about this carefully, step by step, adding the tens and then the ones.\nAnswer: 41"
    (target, reason), comps = _select(ARITH, [wrong, "Answer: 42"], reference_fallback=True,
                                      temperatures=[1.0, 0.6])
    # by hand (no reward model): correct = 8 * (1 + 1) / 2 + constraints 1.0 = 9; wrong = 8 * 0 + 1.0 = 1
    assert [c.total for c in comps] == [1.0, 9.0]
    assert reason == "" and target.response == "Answer: 42" and target.source == "sampled"
    assert target.temperature == 0.6 and target.components.correct


def test_the_reference_is_the_target_only_when_fallback_is_allowed() -> None:
    wrong = ["Answer: 41", "Answer: 43"]
    (target, reason), _ = _select(ARITH, wrong, reference_fallback=False)
    assert target is None and reason == "no_correct_sample"
    (target, reason), _ = _select(ARITH, wrong, reference_fallback=True)
    assert reason == "" and target.source == "reference" and target.response == "Answer: 42"
    assert target.temperature is None and target.components.total == 9.0
    (target, reason), _ = _select(ARITH, [], reference_fallback=True)  # no finished sample at all
    assert target.source == "reference"
    # a reference its own checker rejects is never a target
    comps = RewardHierarchy().score([ARITH] * 2, wrong)
    rejected = RewardHierarchy().score([ARITH], ["Answer: 7"])[0]
    assert select_target(ARITH, wrong, comps, reference_fallback=True, reference_components=rejected) == (
        None, "reference_incorrect")


def test_open_ended_prompts_take_the_best_total_or_are_dropped() -> None:
    # constraints by hand: "" fails length -> 0/1; Cyrillic fails same_script -> 1/2; the English one passes 2/2
    texts = ["The sea is wide and grey under a low winter sky.", "Море широкое."]
    (target, reason), comps = _select(OPEN, texts, reference_fallback=True)
    assert [c.total for c in comps] == [1.0, 0.5]
    assert target.response == texts[0] and target.source == "sampled"
    (target, reason), _ = _select(OPEN, texts[1:], reference_fallback=True, min_open_ended_reward=0.75)
    assert target is None and reason == "below_min_reward"
    (target, reason), _ = _select(OPEN, [], reference_fallback=True)
    assert target is None and reason == "no_finished_sample"


def test_word_ngram_jaccard_by_hand() -> None:
    a, b = word_ngrams("The cat sat on the mat", 2), word_ngrams("the cat sat on the rug", 2)
    assert len(a) == 5 and len(a & b) == 4 and len(a | b) == 6
    assert ngram_jaccard(a, b) == pytest.approx(4 / 6)
    assert word_ngrams("one", 3) == {("one",)} and ngram_jaccard(set(), set()) == 0.0


def test_diversity_filters_drop_exactly_the_targets_too_close_to_a_kept_one() -> None:
    texts = ["the cat sat on the mat",         # kept
             "the cat sat on the rug",         # bigram Jaccard 4/6 = 0.667 with 0 > 0.6
             "a dog ran in the park",          # Jaccard 0 with 0; cosine 0.8 with 0
             "yes no",                         # under min_words: not compared
             "the cat sat on the rug today"]   # 4/7 = 0.571 with 0 (5/6 with the dropped 1, which blocks nothing)
    emb = [[1.0, 0.0], [1.0, 0.0], [0.8, 0.6], [1.0, 0.0], [0.0, 2.0]]
    kw = {"ngram_size": 2, "ngram_jaccard_max": 0.6, "min_words": 3}
    assert diversity_filter(texts, emb, embedding_cosine_max=0.75, **kw) == [
        "", "ngram_duplicate", "embedding_duplicate", "", ""]
    assert diversity_filter(texts, emb, embedding_cosine_max=0.85, **kw) == ["", "ngram_duplicate", "", "", ""]
    # 0.571 > 0.55: the last one goes too; no embeddings: only the n-gram filter
    assert diversity_filter(texts, None, embedding_cosine_max=0.5, ngram_size=2, ngram_jaccard_max=0.55,
                            min_words=3) == ["", "ngram_duplicate", "", "", "ngram_duplicate"]


def test_params_check_the_schedule() -> None:
    with pytest.raises(ValueError, match="floor of the cosine"):
        SFTParams(lr_scheduler_type="constant", min_learning_rate=1e-6)
    with pytest.raises(ValueError, match="exceeds learning_rate"):
        SFTParams(learning_rate=1e-6, min_learning_rate=1e-5)
    with pytest.raises(ValueError, match="temperatures"):
        SFTParams(temperatures=[])


def _pool(lengths: list[int]) -> list[dict]:
    return [{"id": f"p{i}", "prompt": "w " * n} for i, n in enumerate(lengths)]


def _words(rec: dict) -> int:
    return len(rec["prompt"].split())


def test_length_filters_come_before_the_subset_and_account_for_every_prompt() -> None:
    pool = _pool([5, 50, 500, 5000, 7, 6000, 70])
    records, dropped = choose_prompts(SFTParams(min_prompt_tokens=100, max_prompts=None), pool, _words)
    assert [r["id"] for r in records] == ["p2", "p3", "p5"]
    assert {d["id"]: d["reason"] for d in dropped} == {"p0": "prompt_too_short", "p1": "prompt_too_short",
                                                       "p4": "prompt_too_short", "p6": "prompt_too_short"}
    records, dropped = choose_prompts(SFTParams(max_prompt_tokens=100, max_prompts=None), pool, _words)
    assert [r["id"] for r in records] == ["p0", "p1", "p4", "p6"]
    assert all(d["reason"] == "prompt_too_long" for d in dropped) and len(dropped) == 3
    # a long-context stage gets max_prompts long prompts, not the long ones among a subset of the whole pool
    records, dropped = choose_prompts(SFTParams(min_prompt_tokens=100, max_prompts=2), pool, _words)
    assert len(records) == 2 and all(_words(r) >= 100 for r in records)
    assert len(records) + len(dropped) == len(pool) and {d["reason"] for d in dropped} == \
        {"prompt_too_short", "over_max_prompts"}
    assert set(DROP_REASONS) >= {"prompt_too_short", "prompt_too_long"}


def test_long_prompts_joining_the_pool_leave_a_short_stages_subset_unchanged() -> None:
    short = _pool([5, 50, 7, 70, 9, 90, 11, 30])
    long = [{"id": f"long{i}", "prompt": "w " * 5000} for i in range(20)]
    params = SFTParams(max_prompt_tokens=100, max_prompts=4)
    before, _ = choose_prompts(params, short, _words)
    after, dropped = choose_prompts(params, short + long, _words)
    assert [r["id"] for r in after] == [r["id"] for r in before]
    assert sum(d["reason"] == "prompt_too_long" for d in dropped) == 20


def test_difficulties_keep_prompts_by_their_tag_before_the_other_filters() -> None:
    pool = [{"id": f"p{i}", "prompt": "w " * n, "difficulty": d}
            for i, (n, d) in enumerate([(5, "easy"), (5000, "long"), (50, "hard"), (6000, "long"), (7, "medium")])]
    records, dropped = choose_prompts(SFTParams(difficulties=["long"], max_prompts=None), pool, _words)
    assert [r["id"] for r in records] == ["p1", "p3"]
    assert [(d["id"], d["reason"], d["detail"]) for d in dropped] == [
        ("p0", "other_difficulty", "easy"), ("p2", "other_difficulty", "hard"), ("p4", "other_difficulty", "medium")]
    records, dropped = choose_prompts(SFTParams(difficulties=["easy", "medium", "hard"], min_prompt_tokens=6,
                                                max_prompts=None), pool, _words)
    assert [r["id"] for r in records] == ["p2", "p4"]
    assert {d["id"]: d["reason"] for d in dropped} == {"p1": "other_difficulty", "p3": "other_difficulty",
                                                       "p0": "prompt_too_short"}


def test_no_length_filter_counts_no_prompt() -> None:
    def boom(rec: dict) -> int:
        raise AssertionError("counted without a filter")

    records, dropped = choose_prompts(SFTParams(max_prompts=None), _pool([1, 2, 3]), boom)
    assert len(records) == 3 and dropped == []


def test_prompt_length_bounds_must_leave_room() -> None:
    with pytest.raises(ValueError, match="below min_prompt_tokens"):
        SFTParams(min_prompt_tokens=100, max_prompt_tokens=50)


@pytest.mark.parametrize("bad", [[], [0.7, -0.5]], ids=["none", "negative"])
def test_the_sampling_stages_check_temperatures_in_one_place(bad) -> None:
    from posttrain.dpo import DPOParams

    for params in (SFTParams, DPOParams):  # posttrain.policy.Temperatures
        with pytest.raises(ValueError, match=r"give one or more temperatures >= 0"):
            params(temperatures=bad)
    assert DPOParams(temperatures=[0.0]).temperatures == [0.0]  # 0: one greedy response


@pytest.mark.slow
def test_sft_trainer_masks_all_but_the_assistant_tokens_and_their_end_marker(tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    from trl.chat_template_utils import is_chat_template_stop_token_trained

    from data.tokenizer import special_token_ids
    from model import HybridForCausalLM, config_for
    from tests.pretrain_fixtures import build_inputs

    inputs = build_inputs(tmp_path / "in", documents=20, vocab_size=512)
    tok = AutoTokenizer.from_pretrained(inputs.tokenizer.path)
    ids = special_token_ids(inputs.tokenizer.path)
    end = tok.convert_tokens_to_ids("<|end|>")
    model = HybridForCausalLM(config_for("tiny", vocab_size=ids["vocab_size"], bos_token_id=ids["bos"],
                                         pad_token_id=ids["pad"], eos_token_id=[ids["eos"], end]))
    assert is_chat_template_stop_token_trained(tok)  # TRL's own check: <|end|> falls inside {% generation %}
    conv = [{"role": "user", "content": "Compute 40 + 2."}, {"role": "assistant", "content": "Answer: 42"},
            {"role": "user", "content": "And 40 + 3?"}, {"role": "assistant", "content": "It is 43."}]
    trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=Dataset.from_dict({"messages": [conv]}),
                         args=SFTConfig(output_dir=str(tmp_path / "t"), assistant_only_loss=True, max_length=256,
                                        use_cpu=True, bf16=False, report_to="none", disable_tqdm=True))
    row = trainer.train_dataset[0]
    full = tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
    assert list(row["input_ids"]) == list(full)
    labelled = [i for i, lab in enumerate(row["labels"]) if lab != -100]
    assert all(row["labels"][i] == full[i] for i in labelled)
    # the labelled tokens are exactly each assistant turn's content + <|end|>, in two contiguous spans
    spans, cur = [], [labelled[0]]
    for i in labelled[1:]:
        if i == cur[-1] + 1:
            cur.append(i)
        else:
            spans.append(cur)
            cur = [i]
    spans.append(cur)
    assert [tok.decode([full[i] for i in s]) for s in spans] == ["Answer: 42<|end|>", "It is 43.<|end|>"]
    assert [full[s[-1]] for s in spans] == [end, end]
    first_turn = tok.apply_chat_template(conv[:1], tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
    assert spans[0][0] == len(first_turn)  # the loss starts right after '<|assistant|>\n'
    assert len(labelled) == len(tok("Answer: 42<|end|>It is 43.<|end|>", add_special_tokens=False).input_ids)


# --- the stage end to end ---------------------------------------------------------------------------------------
STAGE_I = {"temperatures": [0.7, 1.0], "samples_per_temperature": 2, "max_new_tokens": 16, "max_prompts": 14,
           "require_finished": False, "reference_fallback": True, "max_steps": 3, "batch_size": 4,
           "learning_rate": 1e-3, "min_learning_rate": 1e-4, "warmup_ratio": 0.0, "eval_prompts": 6,
           "eval_max_new_tokens": 12, "max_length": 128}
STAGE_II = dict(STAGE_I, learning_rate=3e-4, min_learning_rate=None, lr_scheduler_type="constant",
                max_length=512, max_steps=2, seed=1)


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory):
    from pipeline.stage import Artifact, StageContext
    from posttrain.sft import STAGE
    from tests.posttrain_fixtures import build_posttrain_inputs

    root = tmp_path_factory.mktemp("sft")
    tiny = build_posttrain_inputs(root, documents=40)
    (tiny.checkpoint / "packing.json").write_text(json.dumps({"seq_len": 256}))
    first = StageContext(root / "sft_short", {"checkpoint": tiny.checkpoint_artifact(),
                                              "prompts": tiny.prompts_artifact()}, stage_name="sft_short")
    STAGE.run(SFTParams(**STAGE_I), first)
    second = StageContext(root / "sft_long", {"checkpoint": Artifact(first.out_dir, {"type": "checkpoint"}),
                                              "prompts": tiny.prompts_artifact()}, stage_name="sft_long")
    STAGE.run(SFTParams(**STAGE_II), second)
    return tiny, first, second


def _stepped(ctx, name: str) -> list[tuple[int, float]]:
    return [(s, v) for k, v, s in ctx.sink.metrics if k == name and s is not None]


@pytest.mark.slow
def test_stage_logs_the_interface_metrics_and_runs_the_configured_steps(stages) -> None:
    _, first, second = stages
    for ctx, steps in ((first, 3), (second, 2)):
        assert [s for s, _ in _stepped(ctx, "eval_pass_rate")] == [0, steps]
        assert [s for s, _ in _stepped(ctx, "loss")] == list(range(1, steps + 1))
        assert all(math.isfinite(v) and v > 0 for _, v in _stepped(ctx, "loss"))
        for name in ("sft_examples", "rejection_acceptance", "response_length", "generation_tokens_per_second",
                     *(f"dropped.{r}" for r in DROP_REASONS)):
            assert name in ctx.summary, name
        assert ctx.summary["generation_tokens_per_second"] > 0 and ctx.summary["steps"] == steps
        assert 0.0 <= ctx.summary["rejection_acceptance"] <= 1.0
        assert (ctx.out_dir / "plots" / "loss.png").is_file()
        assert any(p.name == "loss.png" for p, _ in ctx.sink.artifacts)
    # Table 7 schedules: Stage I cosine from the peak to a floor, Stage II constant
    lr1 = [v for _, v in _stepped(first, "learning_rate")]
    assert lr1[0] == pytest.approx(1e-3) and lr1 == sorted(lr1, reverse=True) and lr1[-1] >= 1e-4 - 1e-12
    assert lr1[-1] < 1e-3
    assert [v for _, v in _stepped(second, "learning_rate")] == pytest.approx([3e-4, 3e-4])


@pytest.mark.slow
def test_stage_accounts_for_every_sft_prompt(stages) -> None:
    tiny, first, second = stages
    pool = [json.loads(x) for x in (tiny.prompts / "pools" / "sft.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r for r in pool}
    sources = set()
    for ctx, max_length in ((first, STAGE_I["max_length"]), (second, STAGE_II["max_length"])):
        data = [json.loads(x) for x in (ctx.out_dir / "sft_data.jsonl").read_text().splitlines()]
        dropped = [json.loads(x) for x in (ctx.out_dir / "dropped.jsonl").read_text().splitlines()]
        assert sorted(r["id"] for r in data + dropped) == sorted(r["id"] for r in pool)
        assert sum(r["reason"] == "over_max_prompts" for r in dropped) == len(pool) - 14
        assert all(r["reason"] in DROP_REASONS for r in dropped)
        for reason in DROP_REASONS:
            assert ctx.summary[f"dropped.{reason}"] == sum(r["reason"] == reason for r in dropped)
        assert all(int(r["detail"].split()[0]) > max_length for r in dropped if r["reason"] == "too_long")
        assert ctx.summary["sft_examples"] == len(data) > 0
        for row in data:
            assert row["source"] in SOURCES and set(row["reward"]) >= {"total", "correct", "constraints"}
            assert "<|end|>" not in row["response"]  # sampled text stops at the end of turn
            if row["source"] == "reference":
                assert row["response"] == reference_response(by_id[row["id"]]) and row["reward"]["correct"]
            elif by_id[row["id"]].get("checker"):
                assert row["reward"]["correct"]  # a verifiable prompt's sampled target is always a correct one
        sources |= {r["source"] for r in data}
        sampled = sum(r["source"] == "sampled" for r in data)
        assert ctx.summary["rejection_acceptance"] == pytest.approx(sampled / 14)
        assert ctx.summary["response_length"] == pytest.approx(sum(r["tokens"] for r in data) / len(data))
        report = json.loads((ctx.out_dir / "sft_report.json").read_text())
        assert report["prompts"] == len(pool) and report["kept"] == len(data)
    assert sources == set(SOURCES)  # both paths ran: references, and sampled targets of open-ended prompts
    # Stage I (§5.6: long prompts removed) drops the open-ended excerpts its 128 tokens cannot hold
    assert first.summary["dropped.too_long"] > 0


@pytest.mark.slow
def test_stage_writes_a_loadable_policy_that_stops_at_the_end_of_turn(stages) -> None:
    from posttrain.policy import chat_prompt, load_policy

    tiny, first, second = stages
    before, _ = load_policy(tiny.checkpoint)
    for ctx in (first, second):
        model, tok = load_policy(ctx.out_dir)
        end = tok.convert_tokens_to_ids("<|end|>")
        assert end in model.generation_config.eos_token_id
        assert json.loads((ctx.out_dir / "packing.json").read_text()) == {"seq_len": 256}
        assert (ctx.out_dir / "minimax" / "config.json").is_file()
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, before.get_parameter(n))]
        assert len(changed) > len(list(model.parameters())) // 2
    # generate with the saved generation config only: after the first <|end|> / eos a row holds nothing but pad
    prompts = [chat_prompt(tok, p) for p in ("Compute 3 + 4.", "Say hello.", "Name a river.", "Count to two.")]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=24,
                             num_return_sequences=8)[:, enc.input_ids.shape[1]:].tolist()
    stops = set(model.generation_config.eos_token_id)
    ended = [row for row in out if stops & set(row)]
    assert ended  # some of 32 samples end their turn
    for row in ended:
        cut = next(i for i, t in enumerate(row) if t in stops)
        assert set(row[cut + 1:]) <= {tok.pad_token_id}


@pytest.mark.parametrize("lead", ["\n", "\n\n", " ", "\n  "])
def test_a_target_with_leading_whitespace_labels_no_token_of_the_template(tmp_path: Path, lead: str) -> None:
    """The template ends the assistant header with a newline; a response starting with a newline or a space
    would merge with it into one labelled token. The labelled tokens are exactly the response and <|end|>."""
    from transformers import AutoTokenizer

    from posttrain.sft_selection import Target, example_messages
    from tests.pretrain_fixtures import build_inputs

    inputs = build_inputs(tmp_path / "in", documents=20, vocab_size=512)
    tok = AutoTokenizer.from_pretrained(inputs.tokenizer.path)
    target = Target(record={"prompt": "Compute 40 + 2."}, response=lead + "Answer: 42", source="reference",
                    components=None, temperature=None)  # type: ignore[arg-type]
    enc = tok.apply_chat_template(example_messages(target), tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    labelled = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(labelled) == "Answer: 42<|end|>"
    header = tok.apply_chat_template(example_messages(target)[:1], tokenize=True, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    assert ids[:len(header)] == header and not any(mask[:len(header)])  # the header is whole, and unlabelled
