"""bench/recipe_results.py: the GPU recipe's results file from a run's report and its artifacts' manifests (the
stage table, GPUs busy when, pass rates with Wilson intervals), on hand-made artifacts whose numbers are known."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import recipe_results  # noqa: E402  (bench/ is scripts, not a package)


def _artifact(root: Path, kind: str, name: str, start: float, seconds: float, gpus: str, summary: dict) -> str:
    d = root / "artifacts" / kind / name
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"stage": name, "started_unix": start, "seconds": seconds,
                                                 "gpus": gpus, "summary": summary}))
    return str(d)


def test_wilson_interval_matches_hand_computed_values():
    lo, hi = recipe_results.wilson(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-4)
    lo, hi = recipe_results.wilson(10, 20)
    assert (lo, hi) == (pytest.approx(0.2993, abs=1e-4), pytest.approx(0.7007, abs=1e-4))


def test_the_stage_table_and_busy_gpus_follow_the_manifests(tmp_path):
    root = tmp_path / "root"
    t = 1_000_000.0
    stages = {
        "mix": {"state": "done", "seconds": 5.0, "summary": {"tokens": 6e6},
                "artifact": _artifact(root, "mix", "mix", t, 5.0, "", {})},
        "pretrain": {"state": "done", "seconds": 100.0, "summary": {"eval_loss": 4.2},
                     "artifact": _artifact(root, "pretrain", "pretrain", t + 10, 100.0, "0", {})},
        "pretrain_all_softmax": {"state": "done", "seconds": 80.0, "summary": {},
                                 "artifact": _artifact(root, "pretrain", "pretrain_all_softmax", t + 12, 80.0, "1", {})},
        "long_context": {"state": "done", "seconds": 30.0, "summary": {},
                         "artifact": _artifact(root, "long_context", "long_context", t + 110, 30.0, "0", {})},
        "grpo": {"state": "failed", "seconds": None, "summary": {}, "error": "CUDA out of memory", "artifact": None,
                 "attempts": 2, "attempt_errors": ["CUDA out of memory", "CUDA out of memory"]},
        "sft": {"state": "done", "seconds": 20.0, "summary": {"eval_pass_rate": 0.25}, "attempts": 2,
                "attempt_errors": ["AcceleratorError: capture"], "artifact": None},
    }
    lines, spans = recipe_results.stage_table(stages)
    assert lines[2].startswith("| mix | done | 0 | 5.0 |") and "tokens=6,000,000" in lines[2]
    assert "| pretrain | done | 10 | 100.0 | 0 | eval_loss=4.2 |" in lines
    assert "| grpo | failed (attempt 2) | - | - | - | CUDA out of memory |" in lines
    assert "| sft | done (attempt 2) | - | 20.0 | - | eval_pass_rate=0.25 · retried after: AcceleratorError: capture |" in lines
    busy = recipe_results.gpu_busy(spans)
    assert busy[0] == "At most 2 GPU(s) busy at once (finished stages only)."
    assert "- 12–92 s: 2 GPU(s) busy" in busy and "- 92–110 s: 1 GPU(s) busy" in busy
    # from the root alone (a run stopped before its report): the same finished stages
    again = recipe_results.report_from_root(root)["stages"]
    assert set(again) == {"mix", "pretrain", "pretrain_all_softmax", "long_context"}


def test_pass_rates_carry_their_interval_and_tasks():
    stages = {"eval_long_context": {"summary": {"eval_pass_rate": 0.0, "eval_pass_prompts": 20.0,
                                                "eval_pass_rate.arithmetic": 0.0}},
              "eval_grpo": {"summary": {"eval_pass_rate": 0.5, "eval_pass_prompts": 20.0,
                                        "eval_pass_rate.arithmetic": 0.6, "eval_pass_rate.string": 0.4}},
              "dpo_short": {"summary": {"eval_preference_accuracy": 0.7, "eval_preference_accuracy_untrained": 0.5}},
              "dpo_long": {"summary": {"eval_preference_accuracy": 0.0, "eval_preference_accuracy_untrained": 0.5,
                                       "dpo_pairs_heldout": 1}}}
    # a post-training branch beside the chain (sft_more) has its eval listed after the chain's, by name
    stages["sft_more"] = {"summary": {"eval_pass_rate": 0.25, "eval_pass_rate_before": 0.0}}
    stages["eval_sft_more"] = {"summary": {"eval_pass_rate": 0.25, "eval_pass_prompts": 20.0}}
    stages["eval_all_softmax"] = {"summary": {"eval_pass_rate": 0.0, "eval_pass_prompts": 20.0}}  # a pretrain's
    assert recipe_results.post_training_evals(stages)[-2:] == ["eval_grpo", "eval_sft_more"]
    text = "\n".join(recipe_results.pass_rates(stages))
    assert text.index("| eval_grpo |") < text.index("| eval_sft_more | 0.250 |") and "eval_all_softmax" not in text
    assert "| eval_long_context | 0.000 | [0.000, 0.161] | 20 | arithmetic=0.000 |" in text
    assert "| eval_grpo | 0.500 | [0.299, 0.701] | 20 | arithmetic=0.600 string=0.400 |" in text
    assert "`dpo_short` held-out preference accuracy 0.700 (untrained 0.500)" in text  # an old run: no count
    assert "`dpo_long` held-out preference accuracy 0.000 on 1 held-out pairs (untrained 0.500)" in text


def test_every_pretrain_gets_its_probe_curve_and_every_ablation_eval_its_niah_row(tmp_path):
    """Each pretrain branch (the hybrid's and the ablation's) has its own probe table; the NIAH table lists the
    hybrid's evals first, then each branch's eval, and no post-training eval."""
    root = tmp_path / "root"
    stages = {}
    for i, name in enumerate(("pretrain", "pretrain_xavier_head")):
        art = _artifact(root, "pretrain", name, 1e6 + i, 10.0, str(i), {"eval_loss": 5.0 + i})
        rows = [{"step": 50, "loss": 9.0 + i, "copy_accuracy": 0.25 * (i + 1), "copy_loss_gain": 1.0,
                 "niah_choice_accuracy": 0.5, "drop_rate": 0.1}, {"step": 60, "loss": 8.0}]
        (Path(art) / "train_log.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        stages[name] = {"state": "done", "seconds": 10.0, "summary": {"eval_loss": 5.0 + i}, "artifact": art}
    stages["sft_more"] = {"state": "done", "summary": {"eval_pass_rate_before": 0.0}}
    for name, acc in (("eval", 0.1), ("eval_xavier_head", 0.2), ("eval_grpo", 0.9), ("eval_long_context", 0.3),
                      ("eval_sft_more", 0.0)):
        stages[name] = {"state": "done", "summary": {"niah_accuracy": acc}}
    text = recipe_results.results({"stages": stages})
    assert "### pretrain\n" in text and "### pretrain_xavier_head\n" in text
    assert "| 50 | 0 | 9.000 | 0.250 |" in text and "| 50 | 0 | 10.000 | 0.500 |" in text
    niah = [line.split(" | ")[0] for line in recipe_results.niah(stages)[2:]]
    assert niah == ["| eval", "| eval_long_context", "| eval_xavier_head"]
    # the post-training evals' NIAH, plain and in the chat template, in a table of their own
    stages["eval_grpo"]["summary"]["niah_chat_accuracy"] = 0.5
    post = recipe_results.post_training_niah(stages)
    assert [line.split(" | ")[0] for line in post[2:]] == ["| eval", "| eval_long_context", "| eval_grpo",
                                                             "| eval_sft_more"]
    assert post[4].startswith("| eval_grpo | 0.9 | 0.5 | nan |") and "### NIAH after each stage" in text


def test_niah_by_depth_reads_each_eval_reports_grid(tmp_path):
    """One row per eval and length, the accuracy at each needle depth, from the eval artifact's report.json; a
    stage without a NIAH grid (or a non-eval stage) gives no row."""
    root = tmp_path / "root"
    grid = {"lengths": [8192, 16384], "depths": [0.0, 0.5, 1.0], "accuracy": [[0.75, 0.25], [1.0, 0.5], [0.5, 1.0]]}
    ev = _artifact(root, "eval", "eval_long_context", 1e6, 10.0, "0", {})
    (Path(ev) / "report.json").write_text(json.dumps({"niah": grid}))
    other = _artifact(root, "eval", "eval_broken", 1e6, 10.0, "0", {})
    (Path(other) / "report.json").write_text(json.dumps({"metrics": {}}))
    pre = _artifact(root, "pretrain", "pretrain", 1e6, 10.0, "0", {})
    (Path(pre) / "report.json").write_text(json.dumps({"niah": grid}))
    stages = {n: {"state": "done", "artifact": a, "summary": {}}
              for n, a in (("eval_long_context", ev), ("eval_broken", other), ("pretrain", pre))}
    rows = recipe_results.niah_by_depth(stages)[2:]
    assert rows == ["| eval_long_context | 8,192 | 0: 0.75 · 0.5: 1.00 · 1: 0.50 |",
                    "| eval_long_context | 16,384 | 0: 0.25 · 0.5: 0.50 · 1: 1.00 |"]
    # answer kinds where the report has them (a report from before them gives no row)
    assert recipe_results.niah_answer_kinds(stages)[2:] == []
    kinds = {"8192": {"correct": 30, "near_copy": 1, "other_number": 0, "text": 9}}
    (Path(ev) / "report.json").write_text(json.dumps({"niah": grid | {"answer_kinds_by_length": kinds}}))
    assert recipe_results.niah_answer_kinds(stages)[2:] == ["| eval_long_context | 8,192 | 30 | 1 | 0 | 9 |"]
    from evaluation.metrics import NIAH_ANSWER_KINDS  # the script's own copy of the kinds stays the eval's

    assert recipe_results.niah_answer_kinds({})[0] == "| eval | length | " + " | ".join(NIAH_ANSWER_KINDS) + " |"
    assert "### NIAH by needle depth" in recipe_results.results({"stages": stages})


def test_pass_rate_plot_draws_every_post_training_eval_per_task(tmp_path):
    stages = {"eval_sft_short": {"summary": {"eval_pass_rate": 0.12, "eval_pass_prompts": 440.0,
                                             "eval_pass_rate.string": 0.17, "eval_pass_rate.retrieval": 0.43}},
              "sft_more": {"summary": {"eval_pass_rate_before": 0.0}},
              "eval_sft_more": {"summary": {"eval_pass_rate": 0.175, "eval_pass_prompts": 440.0,
                                            "eval_pass_rate.string": 0.31}},
              "eval_all_softmax": {"summary": {"eval_pass_rate": 0.0, "eval_pass_prompts": 440.0}}}
    drawn = recipe_results.pass_rate_plot(stages, tmp_path / "p.png")
    assert drawn == {"eval_sft_short": {"all": 0.12, "string": 0.17, "retrieval": 0.43},
                     "eval_sft_more": {"all": 0.175, "string": 0.31}}
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    # a rate of 0 or 1, whose Wilson bound can miss it by a rounding error (0 of 22, 21 of 21), still draws
    zero = {"eval": {"summary": {"eval_pass_rate": 0.0, "eval_pass_prompts": 22.0}},
            "eval_sft_short": {"summary": {"eval_pass_rate": 1.0, "eval_pass_prompts": 21.0}}}
    assert recipe_results.pass_rate_plot(zero, tmp_path / "z.png") == {"eval": {"all": 0.0},
                                                                         "eval_sft_short": {"all": 1.0}}
    with pytest.raises(ValueError, match="no post-training eval"):
        recipe_results.pass_rate_plot({"eval_all_softmax": stages["eval_all_softmax"]}, tmp_path / "q.png")


def _graded_eval(root: Path, name: str, checkpoint_digest: str, verdicts: list[bool]) -> dict:
    d = root / "artifacts" / "eval" / name
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"stage": name, "digest": f"d-{name}", "key_material": {
        "inputs": {"checkpoint": [checkpoint_digest]}}}))
    (d / "pass_rate.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "correct": c}) + "\n"
                                               for i, c in enumerate(verdicts)))
    return {"state": "done", "artifact": str(d), "summary": {}}


def test_a_post_training_eval_is_paired_with_its_starting_checkpoints_eval_prompt_by_prompt(tmp_path):
    """grpo started from dpo_long: eval_grpo against eval_dpo_long on the same prompts, 4 gained and 1 lost of 10:
    net +30 points, exact McNemar p = 2 (C(5,0) + C(5,1)) / 2^5 = 0.375. Stages found by digest, not by name."""
    root = tmp_path / "root"
    stages = {
        "dpo_long": {"digest": "D1", "artifact": _artifact(root, "dpo", "dpo_long", 0, 1, "0", {}),
                     "summary": {"eval_pass_rate": 0.3, "eval_pass_rate_before": 0.2}},
        "grpo": {"digest": "G1", "summary": {"eval_pass_rate": 0.6, "eval_pass_rate_before": 0.3}},
    }
    grpo_dir = root / "artifacts" / "grpo" / "grpo"
    grpo_dir.mkdir(parents=True)
    (grpo_dir / "manifest.json").write_text(json.dumps({"stage": "grpo", "key_material": {"inputs": {
        "checkpoint": ["D1"]}}}))
    stages["grpo"]["artifact"] = str(grpo_dir)
    before = [True, True, True, False, False, False, False, False, False, False]
    after = [True, True, False, True, True, True, True, False, False, False]
    stages["eval_dpo_long"] = _graded_eval(root, "eval_dpo_long", "D1", before)
    stages["eval_grpo"] = _graded_eval(root, "eval_grpo", "G1", after)
    assert recipe_results.mcnemar_p(4, 1) == pytest.approx(0.375) and recipe_results.mcnemar_p(0, 0) == 1.0
    assert recipe_results.mcnemar_p(10, 0) == pytest.approx(2 / 1024)
    # another eval of dpo_long, first in the run's order, without verdicts: not the one paired
    ungraded = _graded_eval(root, "eval_a_dpo_long", "D1", [])
    (Path(ungraded["artifact"]) / "pass_rate.jsonl").unlink()
    stages = {"eval_a_dpo_long": ungraded, **stages}
    lines = recipe_results.paired_gains(stages)
    assert "| eval_grpo | eval_dpo_long | 10 | 4 | 1 | +30.0 | 0.375 |" in lines
    assert not any(line.startswith("| eval_dpo_long |") for line in lines)  # dpo_long's start has no eval here
    del stages["eval_dpo_long"]
    assert recipe_results.paired_gains(stages)[0].startswith("(no post-training eval")


def test_niah_misses_and_the_paired_table_read_each_evals_trials(tmp_path):
    """The wrong answers whose forced choice was right (found, not answered), the needle's log-likelihood medians,
    and an eval against eval_long_context needle by needle: only where both asked the same needles."""
    root = tmp_path / "root"

    def trial(length, depth, number, correct, ll, choice=True, mass=None):
        return {"length": length, "depth": depth, "city": "Oslo", "number": number, "correct": correct,
                "answer_loglik": ll, "choice_correct": choice} | ({} if mass is None else {"number_start_prob": mass})

    base = [trial(8192, 0.0, "1", True, -1.0), trial(8192, 0.5, "2", True, -0.5), trial(8192, 1.0, "3", False, -4.0),
            trial(8192, 1.0, "4", False, -6.0, choice=False)]
    mine = [trial(8192, 0.0, "1", False, -3.0, mass=0.25), trial(8192, 0.5, "2", True, -0.2, mass=0.5),
            trial(8192, 1.0, "3", True, -0.1, mass=0.75), trial(8192, 1.0, "4", True, -0.3, mass=1.0)]
    other = [trial(8192, 0.0, "9", True, -1.0)]  # different needles: no paired row
    stages = {}
    for name, trials in (("eval_long_context", base), ("eval_facts", mine), ("eval_other", other)):
        art = _artifact(root, "eval", name, 1e6, 10.0, "0", {})
        (Path(art) / "report.json").write_text(json.dumps({"niah": {"trials": trials}}))
        stages[name] = {"state": "done", "artifact": art, "summary": {}}
    assert recipe_results.niah_misses(stages)[2:] == [
        "| eval_long_context | 8,192 | 2 of 4 | 1 | -0.75 / -5.00 | - / - |",
        "| eval_facts | 8,192 | 1 of 4 | 1 | -0.20 / -3.00 | 0.75 / 0.25 |",
        "| eval_other | 8,192 | 0 of 1 | 0 | -1.00 / - | - / - |"]
    # facts against long_context: needles 3 and 4 gained, needle 1 lost; p = 2 * (1 + 3) / 8 = 1
    assert recipe_results.niah_paired(stages)[2:] == ["| eval_facts | eval_long_context | 8,192 | 4 | 2 | 1 | 1 |"]
    assert recipe_results.niah_paired({k: v for k, v in stages.items() if k != "eval_long_context"})[2:] == []
    text = recipe_results.results({"stages": stages})
    assert "### NIAH's wrong answers: found and not answered?" in text and "| eval_facts | eval_long_context |" in text
