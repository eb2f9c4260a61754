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
        "grpo": {"state": "failed", "seconds": None, "summary": {}, "error": "CUDA out of memory", "artifact": None},
    }
    lines, spans = recipe_results.stage_table(stages)
    assert lines[2].startswith("| mix | done | 0 | 5.0 |") and "tokens=6,000,000" in lines[2]
    assert "| pretrain | done | 10 | 100.0 | 0 | eval_loss=4.2 |" in lines
    assert lines[-1].startswith("| grpo | failed | - | - | - | CUDA out of memory")
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
              "dpo_short": {"summary": {"eval_preference_accuracy": 0.7, "eval_preference_accuracy_untrained": 0.5}}}
    text = "\n".join(recipe_results.pass_rates(stages))
    assert "| eval_long_context | 0.000 | [0.000, 0.161] | 20 | arithmetic=0.000 |" in text
    assert "| eval_grpo | 0.500 | [0.299, 0.701] | 20 | arithmetic=0.600 string=0.400 |" in text
    assert "`dpo_short` held-out preference accuracy 0.700 (untrained 0.500)" in text
