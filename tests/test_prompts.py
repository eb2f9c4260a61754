"""Verifiable prompts, their exact checkers and the ``prompts`` stage (report §5.1 prompt collection, §5.2
correctness, §5.4.1/§5.4.2 which prompts each phase sees)."""

from __future__ import annotations

import json
import time
from decimal import Decimal
from pathlib import Path

import pytest

from data.documents import DocumentWriter, read_jsonl_gz
from pipeline.registry import resolve
from pipeline.stage import Artifact, StageContext
from posttrain.prompt_records import heuristic_tags
from posttrain.prompts import (
    POOLS,
    REPORT_FILE,
    NearDuplicateIndex,
    PromptsParams,
    split_group,
    validate_external,
)
from posttrain.prompts import run as run_prompts
from posttrain.sandbox import SandboxLimits
from posttrain.verifiable import (
    CODE_TEMPLATES,
    check,
    check_python_tests,
    extract_code,
    extract_number,
    extract_text,
    generate_verifiable,
    long_retrieval_records,
)

CORPUS = Path(__file__).resolve().parents[1] / "data" / "sample_corpus" / "prose.jsonl.gz"
COUNTS = {"arithmetic": 9, "string": 12, "retrieval": 6, "code": 3}


def _passages(n: int = 20) -> list[tuple[str, str, str]]:
    out = []
    for rec in read_jsonl_gz(CORPUS):
        out.append((rec["id"], rec["domain"], rec["text"]))
        if len(out) == n:
            break
    return out


def _good(rec: dict) -> str:
    ref = rec["reference"]
    if rec["checker"] == "python_tests":
        return f"Here it is:\n```python\n{ref['solution']}```\n"
    return f"Working it out step by step.\nAnswer: {ref['answer']}"


# --- generators -----------------------------------------------------------------------------------------------
def test_generators_are_deterministic_in_the_seed():
    a = generate_verifiable(7, COUNTS, _passages())
    b = generate_verifiable(7, COUNTS, _passages())
    c = generate_verifiable(8, COUNTS, _passages())
    assert a == b
    assert [r["prompt"] for r in a] != [r["prompt"] for r in c]
    assert [sum(r["task_type"] == t for r in a) for t in COUNTS] == list(COUNTS.values())
    assert {r["difficulty"] for r in a} == {"easy", "medium", "hard"}
    assert len({r["id"] for r in a}) == len(a)


def test_arithmetic_reference_answers_are_the_python_value_of_the_expression():
    for rec in generate_verifiable(3, {"arithmetic": 30}):
        expr = rec["prompt"].removeprefix("Compute ").split(",")[0].split(". ")[0]
        assert int(rec["reference"]["answer"]) == eval(expr)  # noqa: S307 -- our own generated integer expression


def test_retrieval_answer_is_in_the_passage():
    for rec in generate_verifiable(0, {"retrieval": 10}, _passages()):
        passage = rec["prompt"].split("Passage:\n", 1)[1].split("\n\nQuestion:", 1)[0]
        assert rec["reference"]["answer"] in passage
        assert rec["passage_source"]["id"].startswith("prose/")


# --- extraction rules and checkers ----------------------------------------------------------------------------
def test_extraction_rules():
    assert extract_number("first 3, then 5\n**Answer:** 1,234 apples") == Decimal(1234)
    assert extract_number("it is 7, no wait, 8") == Decimal(8)  # no Answer line: the last number
    assert extract_number("Answer: -42.0") == Decimal(-42)
    assert extract_number("Answer: none\nbut 12 after it") is None  # an Answer line decides, even without a number
    assert extract_number("no digits here") is None
    assert extract_text("reasoning...\nAnswer: `olleh`.") == "olleh"
    assert extract_text("just the line\n\n  'final words'  \n") == "final words"
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


def test_every_checker_accepts_the_reference_and_rejects_near_misses():
    recs = generate_verifiable(11, {"arithmetic": 12, "string": 24, "retrieval": 8}, _passages())
    for rec in recs:
        assert check(rec, _good(rec)).correct, rec
        ans = rec["reference"]["answer"]
        if rec["checker"] == "exact_number":
            for miss in (int(ans) + 1, int(ans) - 1, int(ans) * 10):
                r = check(rec, f"Answer: {miss}")
                assert (r.correct, r.score) == (False, 0.0), (rec["id"], miss)
        else:
            near = ans[:-1] + ("x" if ans[-1] != "x" else "y")
            assert not check(rec, f"Answer: {near}").correct
            assert not check(rec, f"Answer: {ans} {ans}").correct
            if not rec["reference"].get("casefold") and ans != ans.swapcase():
                assert not check(rec, f"Answer: {ans.swapcase()}").correct


def test_code_checker_scores_by_the_share_of_hidden_tests_passed():
    rec = next(r for seed in range(50) for r in generate_verifiable(seed, {"code": 1})
               if r["reference"]["function"] == "sum_of_squares")
    limits = SandboxLimits(wall_seconds=3)
    good = check_python_tests(rec, _good(rec), limits)
    assert (good.correct, good.score) == (True, 1.0)
    # right except for n < 1 (returns n instead of 0): passes exactly the tests with n >= 1
    half = "```python\ndef sum_of_squares(n):\n    return sum(k * k for k in range(1, n + 1)) if n >= 1 else n\n```"
    expected = sum(1 for t in rec["reference"]["tests"] if int(t.split("(")[1].split(")")[0]) >= 1
                   or int(t.split("(")[1].split(")")[0]) == 0) / len(rec["reference"]["tests"])
    r = check_python_tests(rec, half, limits)
    assert r.score == pytest.approx(expected) and r.correct == (expected == 1.0)
    hang = "```python\ndef sum_of_squares(n):\n    while True:\n        pass\n```"
    start = time.monotonic()
    r = check_python_tests(rec, hang, SandboxLimits(wall_seconds=1, cpu_seconds=5))
    assert (r.correct, r.score) == (False, 0.0) and "timeout" in r.reason
    assert time.monotonic() - start < 3


def test_every_code_template_solution_passes_its_own_tests():
    first: dict[str, dict] = {}
    for seed in range(200):
        for rec in generate_verifiable(seed, {"code": 3}):
            first.setdefault(rec["reference"]["function"], rec)
    assert sorted(first) == sorted(t.function for t in CODE_TEMPLATES)
    for rec in first.values():
        assert check_python_tests(rec, _good(rec), SandboxLimits(wall_seconds=3)).correct, rec["id"]


JUNK = [None, "", "   \n\n", "\x00\x01\x02" * 50, "Answer:", "Answer: ```", "```", "```python\n", "1" * 200_000,
        "Answer: " + "9" * 5000, "é€😀" * 1000, "Answer: inf", "\n".join(["Answer: x"] * 10_000), 42]


def test_junk_responses_never_crash_or_pass():
    recs = generate_verifiable(5, {"arithmetic": 3, "string": 6, "retrieval": 3}, _passages())
    for rec in recs:
        for junk in JUNK:
            r = check(rec, junk)
            assert isinstance(r.reason, str) and 0.0 <= r.score <= 1.0
            assert not r.correct, (rec["id"], str(junk)[:40])


def test_junk_code_responses_are_wrong_not_errors():
    rec = next(r for seed in range(50) for r in generate_verifiable(seed, {"code": 1})
               if r["reference"]["function"] == "sum_of_squares")
    limits = SandboxLimits(wall_seconds=2)
    for junk in (None, "", "```python\n```", "def sum_of_squares(", "def sum_of_squares(n): return 'x' * n",
                 "```python\nimport os\ndef sum_of_squares(n):\n    os._exit(0)\n```"):
        r = check_python_tests(rec, junk, limits)
        assert (r.correct, r.score) == (False, 0.0), (junk, r)


def test_check_refuses_a_record_without_a_checker():
    with pytest.raises(ValueError, match="not a verifiable prompt"):
        check({"id": "open/1", "prompt": "Summarize this."}, "ok")


# --- dedup --------------------------------------------------------------------------------------------------------
def test_near_duplicate_index_numbers():
    words = [f"w{i}" for i in range(30)]  # 30 tokens -> 28 word 3-grams
    idx = NearDuplicateIndex(PromptsParams())
    assert idx.find_or_add("a", " ".join(words)) is None
    assert idx.find_or_add("b", "  " + " ".join(words).upper()) == ("a", "exact", 1.0)
    last = words[:-1] + ["zz"]  # one 3-gram differs: J = 27 / 29
    assert idx.find_or_add("c", " ".join(last)) == ("a", "near", round(27 / 29, 4))
    mid = words[:15] + ["zz"] + words[16:]  # three 3-grams differ: J = 25 / 31 = 0.806
    assert idx.find_or_add("d", " ".join(mid)) == ("a", "near", round(25 / 31, 4))
    two = words[:8] + ["zz"] + words[9:22] + ["yy"] + words[23:]  # six differ: J = 22 / 34 < 0.8, kept
    assert idx.find_or_add("e", " ".join(two)) is None


def test_numbers_make_prompts_different():
    idx = NearDuplicateIndex(PromptsParams())
    assert idx.find_or_add("a", "Compute 75 - 93.") is None
    assert idx.find_or_add("b", "Compute 31 - 15.") is None


def test_heuristic_tags():
    assert heuristic_tags("Write a python function that sorts a list")["task_type"] == "code"
    assert heuristic_tags("Solve 3x + 4 = 10")["domain"] == "math"
    assert heuristic_tags("Write a poem about rain")["task_type"] == "creative_writing"
    assert heuristic_tags("Why is the sky blue?") == {"task_type": "question_answering",
                                                      "domain": "general-knowledge", "difficulty": "easy"}
    assert heuristic_tags("word " * 250)["difficulty"] == "hard"


# --- the stage ----------------------------------------------------------------------------------------------------
def _documents(tmp: Path, n: int = 40) -> Artifact:
    d = tmp / "docs"
    with DocumentWriter(d) as w:
        for rec in read_jsonl_gz(CORPUS):
            if len(rec["text"].split()) >= 80:
                w.write(rec)
            if w.count == n:
                break
    return Artifact(d, {"type": "documents", "digest": "test"})


def _user_file(tmp: Path) -> Path:
    lines = [
        json.dumps({"id": "u1", "prompt": "Explain photosynthesis to a child.", "task_type": "explanation",
                    "domain": "science", "difficulty": "easy",
                    "response": "Plants use sunlight to turn water and air into sugar."}),
        json.dumps({"prompt": "Write a python function that reverses a linked list."}),
        json.dumps({"id": "u1-copy", "prompt": "  explain   PHOTOSYNTHESIS to a child. "}),  # duplicate of u1
        json.dumps({"id": "blank", "prompt": "   "}),  # empty
        json.dumps({"id": "long", "prompt": "word " * 1200}),  # too long at max_prompt_chars=5000
        json.dumps({"id": "bad", "prompt": 5}),  # invalid record
        "",
        json.dumps({"id": "u-check", "prompt": "What is 6 * 7?", "checker": "exact_number",
                    "reference": {"answer": "42"}}),
    ]
    p = tmp / "user.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _run(tmp: Path, **kw) -> tuple[StageContext, dict, dict[str, list[dict]]]:
    params = PromptsParams(verifiable={"arithmetic": 30, "string": 30, "retrieval": 9, "code": 12},
                           open_ended=12, user_files=[str(_user_file(tmp))], max_prompt_chars=5000, **kw)
    ctx = StageContext(tmp / "out", {"documents": _documents(tmp)}, stage_name="prompts")
    run_prompts(params, ctx)
    report = json.loads((ctx.out_dir / REPORT_FILE).read_text())
    pools = {p: [json.loads(x) for x in (ctx.out_dir / "pools" / f"{p}.jsonl").read_text().splitlines()]
             for p in POOLS}
    return ctx, report, pools


def test_stage_accounts_for_every_prompt_and_keeps_rl_and_eval_apart_from_sft(tmp_path):
    ctx, report, pools = _run(tmp_path)
    # 7 user lines (blank line skipped) + 81 generated + 12 open-ended
    assert report["inputs"] == {"user": 7, "verifiable": 81, "corpus": 12}
    dropped = [json.loads(x) for x in (ctx.out_dir / "dropped.jsonl").read_text().splitlines()]
    by_id = {d["id"]: d for d in dropped}
    assert by_id["u1-copy"]["reason"] == "duplicate" and by_id["u1-copy"]["kept_id"] == "u1"
    assert by_id["blank"]["reason"] == "empty" and by_id["long"]["reason"] == "too_long"
    assert by_id[f"{tmp_path / 'user.jsonl'}:6"]["reason"] == "invalid_record"
    assert report["dropped"]["empty"] == 1 and report["dropped"]["too_long"] == 1
    assert report["dropped"]["invalid_record"] == 1
    assert sum(report["dropped"].values()) == len(dropped)
    assert 100 == report["kept"] + len(dropped)
    ids = {p: [r["id"] for r in rows] for p, rows in pools.items()}
    assert len(ids["sft"]) + len(ids["rl"]) + len(ids["eval"]) == report["kept"]
    assert set(ids["sft"]).isdisjoint(ids["rl"]) and set(ids["sft"]).isdisjoint(ids["eval"])
    assert set(ids["rl"]).isdisjoint(ids["eval"])
    assert set(ids["dpo"]) <= set(ids["sft"])
    assert set(ids["sft"] + ids["rl"] + ids["eval"]).isdisjoint(by_id)
    assert all(r.get("checker") for r in pools["eval"] + pools["rl"])  # rl_verifiable_only, eval: verifiable
    groups = {p: {split_group(r) for r in rows} for p, rows in pools.items() if p != "dpo"}
    assert groups["sft"].isdisjoint(groups["rl"]) and groups["sft"].isdisjoint(groups["eval"])
    assert groups["rl"].isdisjoint(groups["eval"])
    assert all(ctx.rows[p] == len(pools[p]) for p in POOLS)
    assert ctx.summary["prompts_in"] == 100 and ctx.summary["pool.eval"] == len(pools["eval"]) > 0
    for rows in pools.values():
        for r in rows:
            assert all(isinstance(r[t], str) and r[t] for t in ("task_type", "domain", "difficulty"))
    user = {r["id"]: r for rows in pools.values() for r in rows if r["source"] == "user"}
    assert user["u1"]["tag_source"] == "given" and user["u1"]["domain"] == "science"
    # a user's real answer travels with its prompt (the reward model's corpus pairs use it as chosen)
    assert user["u1"]["response"].startswith("Plants use sunlight") and "response" not in user["u-check"]
    assert (ctx.out_dir / "plots" / "tags.png").is_file()


def test_stage_output_is_deterministic(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _run(tmp_path / "a")
    _run(tmp_path / "b")
    for p in POOLS:
        assert (tmp_path / "a/out/pools" / f"{p}.jsonl").read_bytes() == \
               (tmp_path / "b/out/pools" / f"{p}.jsonl").read_bytes()


def test_stage_without_documents_makes_no_retrieval_or_open_ended_prompts(tmp_path):
    ctx = StageContext(tmp_path / "out", {}, stage_name="prompts")
    run_prompts(PromptsParams(verifiable={"arithmetic": 6, "retrieval": 5}, open_ended=5), ctx)
    report = json.loads((ctx.out_dir / REPORT_FILE).read_text())
    assert report["inputs"] == {"verifiable": 6} and report["kept"] == 6


def test_long_retrieval_windows_are_consecutive_and_carry_one_checkable_code():
    texts = _passages(20)
    words = [w for _, _, t in texts for w in t.split()]
    recs = long_retrieval_records(0, 3, texts, 150)
    assert len(recs) == 3 and len({r["id"] for r in recs}) == 3
    for k, r in enumerate(recs):
        assert r["id"] == f"verifiable/retrieval-long/0/{k:06d}" and r["difficulty"] == "long"
        assert r["task_type"] == "retrieval" and r["checker"] == "exact_number"
        passage = r["prompt"].split("Passage:\n", 1)[1].split("\n\nQuestion:", 1)[0]
        code = r["reference"]["answer"]
        planted = next(p for p in [f"The code of the {i} is {code}." for i in
                                   ("blue vault", "north gate", "copper locker", "east archive", "silver cabinet",
                                    "harbor shed", "red safe")] if p in passage)
        # the window is the next 150 words of the joined texts, with the code's sentence planted in it
        assert passage.replace(planted, " ").split() == words[150 * k:150 * (k + 1)]
        assert check(r, f"Answer: {code}").correct and not check(r, "Answer: 12").correct
        assert r["long_sources"][0] in {i for i, _, _ in texts}
    assert long_retrieval_records(0, 3, texts, 150) == recs  # deterministic in the seed
    assert len(long_retrieval_records(0, 10_000, texts, 150)) == len(words) // 150  # fewer when the texts run out


def test_long_retrieval_prompts_go_to_sft_alone_and_change_no_other_pool(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, _, base = _run(tmp_path / "a")
    ctx, report, pools = _run(tmp_path / "b", long_retrieval=3, long_retrieval_words=100)
    long = [r for r in pools["sft"] if r["difficulty"] == "long"]
    assert len(long) == 3 and ctx.summary["pool.sft.long_retrieval"] == 3
    assert report["inputs"]["verifiable"] == 81 + 3
    for p in ("dpo", "rl", "eval"):
        assert pools[p] == base[p], p  # DPO, RL and the eval keep exactly their prompts
    assert [r for r in pools["sft"] if r["difficulty"] != "long"] == base["sft"]
    # the reward model's pairs come from the pools without them, as from an artifact made without them
    from posttrain.reward_model import pair_prompts

    assert pair_prompts(ctx.out_dir, ["sft", "rl"]) == base["sft"] + base["rl"]
    # a user prompt tagged like them is pooled like any other prompt
    from posttrain.prompts import is_long

    assert is_long(long[0]) and not is_long({**long[0], "source": "user", "id": "u9"})
    with pytest.raises(ValueError, match="raise max_prompt_chars"):
        PromptsParams(long_retrieval=5, long_retrieval_words=5000, max_prompt_chars=8000)
    PromptsParams(long_retrieval=0, long_retrieval_words=5000, max_prompt_chars=8000)  # off: no check


def test_bad_user_jsonl_is_refused_at_validation_with_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "fine"}\n{"prompt": \n\n[1, 2]\n{"prompt": "x", "checker": "vibes"}\n'
                 '{"prompt": "x", "checker": "python_tests", "reference": {"function": "f"}}\n')
    problems = validate_external(PromptsParams(user_files=[str(p), str(tmp_path / "missing.jsonl")]))
    msgs = [m for _, m in problems]
    assert [f for f, _ in problems] == ["user_files.0"] * 4 + ["user_files.1"]
    assert msgs[0].startswith(f"{p}:2: not valid JSON")
    assert msgs[1] == f"{p}:4: expected a JSON object, got list"
    assert msgs[2].startswith(f"{p}:5: checker 'vibes' is unknown")
    assert msgs[3] == f"{p}:6: checker 'python_tests' needs a 'reference' object with function, tests"
    assert "does not exist" in msgs[4]


def test_stage_is_registered_and_params_are_checked():
    kind = resolve("prompts")
    assert kind.produces == "prompts" and not kind.inputs["documents"].required
    with pytest.raises(ValueError, match="unknown verifiable task types"):
        PromptsParams(verifiable={"algebra": 3})
