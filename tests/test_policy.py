"""posttrain.policy: a checkpoint loads as a dropless policy; batched sampling equals one-at-a-time decoding and
stops at the end of the assistant turn; eval_pass_rate is the exact checkers' verdict on greedy responses; a saved
policy reloads with the same logits in both formats and keeps the base checkpoint's packing.json."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.policy import SamplingStats, chat_prompt, load_policy, pass_rate, sample_responses, save_policy
from tests.posttrain_fixtures import PosttrainInputs, build_posttrain_inputs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> PosttrainInputs:
    return build_posttrain_inputs(tmp_path_factory.mktemp("policy"), documents=40)


@pytest.fixture(scope="module")
def policy(tiny: PosttrainInputs):
    return load_policy(tiny.checkpoint)


def _eval_records(tiny: PosttrainInputs) -> list[dict]:
    return [json.loads(x) for x in (tiny.prompts / "pools" / "eval.jsonl").read_text().splitlines()]


def test_load_policy_is_dropless_and_left_pads(policy) -> None:
    model, tok = policy
    assert model.config.moe_token_drop is False and not model.training
    assert all(not m.token_drop for m in model.modules() if hasattr(m, "token_drop"))
    assert tok.padding_side == "left" and tok.pad_token_id is not None


def test_load_policy_explains_a_directory_without_a_model(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no model"):
        load_policy(tmp_path)


def test_batched_greedy_samples_equal_one_prompt_at_a_time(policy) -> None:
    model, tok = policy
    prompts = ["Compute 12 + 30.", "Reverse the word 'cat'.", "Write one sentence about rivers and the sea."]
    batched = sample_responses(model, tok, prompts, temperatures=[0.0], max_new_tokens=12, batch_size=3)
    alone = [sample_responses(model, tok, [p], temperatures=[0.0], max_new_tokens=12)[0] for p in prompts]
    assert [s[0].text for s in batched] == [s[0].text for s in alone]
    assert [s[0].tokens for s in batched] == [s[0].tokens for s in alone]
    # and equal to transformers' generate on the unpadded prompt
    ids = tok(chat_prompt(tok, prompts[1]), add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    new = ref[0, ids.shape[1]:].tolist()
    assert batched[1][0].tokens == len(new) or batched[1][0].finished  # cut at the first stop token
    assert batched[1][0].text == tok.decode(new[:batched[1][0].tokens], skip_special_tokens=True).strip()


def test_sampling_counts_temperatures_and_is_deterministic_for_a_seed(policy) -> None:
    model, tok = policy
    prompts = ["Name a colour.", "Count to three.", "Say yes."]
    stats = SamplingStats()
    a = sample_responses(model, tok, prompts, temperatures=[0.0, 0.7, 1.2], samples_per_temperature=2,
                         max_new_tokens=8, batch_size=2, seed=3, stats=stats)
    b = sample_responses(model, tok, prompts, temperatures=[0.0, 0.7, 1.2], samples_per_temperature=2,
                         max_new_tokens=8, batch_size=2, seed=3)
    assert [len(s) for s in a] == [5, 5, 5]  # greedy once + 2 x 2 sampled
    assert [[x.temperature for x in s] for s in a] == [[0.0, 0.7, 0.7, 1.2, 1.2]] * 3
    assert [[x.text for x in s] for s in a] == [[x.text for x in s] for s in b]
    assert stats.sequences == 15 and stats.by_temperature == {0.0: 3, 0.7: 6, 1.2: 6}
    assert stats.tokens == sum(x.tokens for s in a for x in s) and 0 < stats.tokens <= 15 * 8
    assert all(x.tokens <= 8 and (x.finished or x.tokens == 8) for s in a for x in s)


def test_pass_rate_is_the_checkers_verdict_on_greedy_responses(policy, tiny) -> None:
    model, tok = policy
    records = _eval_records(tiny)[:4]
    assert len(records) == 4
    greedy = sample_responses(model, tok, [r["prompt"] for r in records], temperatures=[0.0], max_new_tokens=16)
    # two records whose reference IS the model's greedy answer (exact_text checker): they pass; two keep their
    # own reference, which a random model does not produce
    made = [dict(r, checker="exact_text", reference={"answer": g[0].text.splitlines()[-1].strip()})
            for r, g in zip(records[:2], greedy[:2], strict=True) if g[0].text.strip()]
    assert made
    rate, rows = pass_rate(model, tok, made + records[2:], max_new_tokens=16)
    assert [r["correct"] for r in rows] == [True] * len(made) + [False, False]
    assert rate == pytest.approx(len(made) / (len(made) + 2))
    with pytest.raises(ValueError, match="no exact checker"):
        pass_rate(model, tok, [{"id": "x", "prompt": "hi"}])


def test_saved_policy_reloads_with_the_same_logits_and_keeps_packing(policy, tiny, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model, tok = policy
    (tiny.checkpoint / "packing.json").write_text(json.dumps({"seq_len": 256}))
    save_policy(model, tiny.inputs.tokenizer.path, tiny.checkpoint, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "packing.json").read_text()) == {"seq_len": 256}
    again, tok2 = load_policy(tmp_path / "out")
    minimax = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "minimax").eval()
    ids = torch.randint(8, 400, (2, 17))
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(again(ids).logits, ref)
        assert torch.allclose(minimax(ids).logits, ref, atol=1e-4)
    assert tok2.chat_template == tok.chat_template
    assert again.generation_config.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]


def _records(n: int, prefix: str = "verifiable/string/0/") -> list[dict]:
    return [{"id": f"{prefix}{i:06d}", "prompt": f"p{i}", "checker": "exact"} for i in range(n)]


def test_pass_rate_before_reads_the_upstream_measurement_only_where_it_measured_the_same_thing(tmp_path):
    from posttrain.policy import PASS_RATE_FILE, pass_rate_before, write_pass_rate

    said: list[str] = []
    calls: list[int] = []

    def measure() -> float:
        calls.append(1)
        return 0.25

    recs = _records(8)
    write_pass_rate(tmp_path, 0.625, recs, max_new_tokens=24, prompts_digest="d1", stage="sft_short",
                    before=(0.5, "measured"))
    written = json.loads((tmp_path / PASS_RATE_FILE).read_text())
    assert (written["prompts"], written["before"], written["before_from"]) == (8, 0.5, "measured")

    def before(mode="upstream", records=recs, max_new_tokens=24, digest="d1", where=tmp_path):
        rate, source = pass_rate_before(mode, where, records, max_new_tokens=max_new_tokens, prompts_digest=digest,
                                        measure=measure, progress=said.append)
        assert source == ("sft_short" if rate == 0.625 else "measured")
        return rate

    assert before() == 0.625 and not calls  # the same prompts, budget and prompts artifact: read, not decoded
    assert "as sft_short measured it at its end on the same 8 prompts" in said[-1]
    assert before(mode="measure") == 0.25 and len(calls) == 1  # 'measure' always decodes
    assert before(max_new_tokens=32) == 0.25 and "differs in max_new_tokens" in said[-1]
    assert before(records=_records(8, "verifiable/code/0/")) == 0.25 and "prompt_ids_sha256" in said[-1]
    assert before(records=recs[:7]) == 0.25 and "prompts" in said[-1]
    assert before(digest="d2") == 0.25 and "prompts_digest" in said[-1]
    assert before(where=tmp_path / "none") == 0.25 and "has no eval_pass_rate.json" in said[-1]
    (tmp_path / PASS_RATE_FILE).write_text("{not json")
    assert before() == 0.25 and "unreadable" in said[-1]
    assert len(calls) == 7
