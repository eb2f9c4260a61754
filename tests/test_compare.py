"""The ``compare`` stage (evaluation/compare.py): the side-by-side table of pretrained-and-evaluated variants, its power
analysis, the fairness check and the errors, on hand-written eval reports and checkpoint manifests (with real model
configs) whose expected cells are written out here."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from evaluation.compare import (
    COMPARISON_JSON,
    COMPARISON_MD,
    CompareParams,
    compare,
    describe_pattern,
    fairness_problems,
    load_variant,
    pair_reports,
    run,
)
from pipeline.stage import Artifact, StageContext

PRETRAIN_PARAMS = {"size": "tiny", "model_overrides": {"attention_pattern": "hybrid"}, "seq_len": 256,
                   "train_tokens": 20480, "seed": 0, "peak_lr": 0.003, "lightning_impl": "auto", "log_every": 5}
EVAL_PARAMS = {"context_multiples": [1.0, 2.0], "niah_trials": 1, "cloze_items": 40, "mde": 0.05}
INPUTS = {"mixture": ["mix-digest"], "documents": ["docs-digest"], "tokenizer": ["tok-digest"]}


def _report(niah: float, cloze_acc_norm: float, cloze_lan2: float, eval_loss_256: float) -> dict[str, Any]:
    """An eval report.json as evaluation/eval.py writes it (the fields compare reads)."""
    return {
        "trained_length": 256, "context_lengths": [256, 512],
        "metrics": {"niah_accuracy": niah, "niah_accuracy_2x": 0.0, "multi_round_niah_recall": 0.0,
                    "multi_round_niah_recall_2x": 0.0, "eval_loss_at_256": eval_loss_256, "eval_loss_at_512": 6.5,
                    "mc_acc_norm": cloze_acc_norm, "mc_log_acc_norm2": cloze_lan2,
                    "mc_acc_norm.cloze": cloze_acc_norm, "mc_log_acc_norm2.cloze": cloze_lan2},
        "niah": {"trials": [{"length": 256, "correct": True}] * 4 + [{"length": 512, "correct": False}] * 4},
        "loss_by_position": {"loss_at": {"256": eval_loss_256, "512": 6.5},
                             "curve": [[32, 7.0], [256, eval_loss_256], [511, 6.5]]},
        "multiple_choice": {"cloze": {"items": 40, "acc": 0.3, "acc_norm": cloze_acc_norm,
                                      "log_acc_norm2": cloze_lan2, "log_acc_norm2_sd": 0.4}},
    }


def _variant(root: Path, name: str, pattern: str, report: dict[str, Any], *, params: dict[str, Any] | None = None,
             inputs: dict[str, Any] | None = None, tokens: int = 20480, eval_params: dict[str, Any] | None = None,
             ) -> tuple[Artifact, Artifact]:
    """A checkpoint artifact (manifest, model/config.json of the tiny size, loss_curve.json) and its eval artifact."""
    from model.sizes import config_for

    ckpt = root / name
    config_for("tiny", attention_pattern=pattern).save_pretrained(ckpt / "model")
    from pretrain.stage import LOSS_CURVE_FIELDS, LOSS_CURVE_FILE

    (ckpt / LOSS_CURVE_FILE).write_text(json.dumps({"fields": list(LOSS_CURVE_FIELDS), "rows": [
        {"step": s, "tokens": s * 2048, "loss": 9.0 - s / 10, "lr": 1e-3} for s in (5, 10)]}))
    pretrain_params = {**PRETRAIN_PARAMS, "model_overrides": {"attention_pattern": pattern}, **(params or {})}
    manifest = {"type": "checkpoint", "digest": f"ckpt-{name}", "stage": name,
                "key_material": {"params": pretrain_params, "inputs": inputs or INPUTS},
                "summary": {"eval_loss": 6.25, "tokens": float(tokens), "loss": 8.0,
                            "tokens_per_second": 1234.4}}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    ev = root / f"eval-{name}"
    ev.mkdir()
    (ev / "report.json").write_text(json.dumps(report))
    ev_manifest = {"type": "eval_report", "digest": f"eval-{name}", "stage": f"eval-{name}",
                   "key_material": {"params": eval_params or EVAL_PARAMS,
                                    "inputs": {"checkpoint": [manifest["digest"]], "mixture": ["mix-digest"],
                                               "documents": ["docs-digest"]}}}
    (ev / "manifest.json").write_text(json.dumps(ev_manifest))
    return Artifact.load(ev), Artifact.load(ckpt)


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> list[tuple[Artifact, Artifact]]:
    root = tmp_path_factory.mktemp("variants")
    return [_variant(root, "hybrid", "hybrid", _report(0.5, 0.25, -1.30, 6.0)),
            _variant(root, "all-softmax", "all-softmax", _report(0.25, 0.30, -1.25, 5.9)),
            _variant(root, "all-lightning", "all-lightning", _report(0.0, 0.25, -1.30, 6.1))]


def _unpair(pairs):
    return [r for r, _ in pairs], [c for _, c in pairs]


def test_pattern_is_described_by_its_lightning_to_softmax_ratio() -> None:
    from model.configuration import hybrid_attention_pattern

    assert describe_pattern(hybrid_attention_pattern(8)) == "hybrid 7:1"
    assert describe_pattern(hybrid_attention_pattern(16)) == "hybrid 7:1"
    assert describe_pattern(["softmax"] * 4) == "all-softmax"
    assert describe_pattern(["lightning"] * 4) == "all-lightning"
    assert describe_pattern(["lightning", "softmax", "lightning", "lightning", "softmax"]) == "hybrid 3:2"


def test_table_has_every_variant_side_by_side_with_the_exact_cells(three) -> None:
    from model.modeling import HybridForCausalLM
    from model.sizes import config_for

    variants = [load_variant(r, c) for r, c in pair_reports(*_unpair(three))]
    result = compare(variants, CompareParams())
    md = result["markdown"]
    lines = md.splitlines()
    assert "| | hybrid | all-softmax | all-lightning |" in lines
    assert "| attention pattern | hybrid 7:1 | all-softmax | all-lightning |" in lines
    assert "| layers (lightning / softmax) | 7 / 1 | 0 / 8 | 8 / 0 |" in lines
    assert "| tokens trained on | 20,480 | 20,480 | 20,480 |" in lines
    assert "| final train loss (last logged window) | 8.0000 | 8.0000 | 8.0000 |" in lines  # 9.0 - 10/10
    assert "| held-out eval loss (pretrain, trained length) | 6.2500 | 6.2500 | 6.2500 |" in lines
    assert ("| training tokens/s, last logged window (Figure 8's TGS; noisy on a shared CPU) | 1,234 | 1,234 | 1,234 |"
            in lines)
    assert "| loss at positions [1, 256) | 6.0000 | 5.9000 | 6.1000 |" in lines
    assert "| loss at positions [256, 512) (beyond trained length) | 6.5000 | 6.5000 | 6.5000 |" in lines
    assert "| NIAH accuracy at 256 | 0.5000 | 0.2500 | 0.0000 |" in lines
    assert "| NIAH accuracy at 512 | 0.0000 | 0.0000 | 0.0000 |" in lines
    assert "| MC cloze: acc_norm (40 items) | 0.2500 | 0.3000 | 0.2500 |" in lines
    assert "| MC cloze: log acc_norm² (§4.1.3.1) | -1.3000 | -1.2500 | -1.3000 |" in lines
    # parameter counts: those of the real models
    totals = []
    for pattern in ("hybrid", "all-softmax", "all-lightning"):
        model = HybridForCausalLM(config_for("tiny", attention_pattern=pattern))
        totals.append(sum(p.numel() for p in model.parameters()))
    assert [v["metrics"]["params_total"] for v in result["variants"]] == totals
    assert f"| parameters, total | {totals[0]:,} | {totals[1]:,} | {totals[2]:,} |" in lines
    assert result["fair"] and result["fairness_problems"] == []


def test_power_analysis_line_gives_the_items_a_gap_of_the_observed_size_needs(three) -> None:
    variants = [load_variant(r, c) for r, c in pair_reports(*_unpair(three))]
    result = compare(variants, CompareParams())
    # two-proportion z-test, pooled variance under H0 (Fleiss): 0.25 vs 0.30 at alpha 0.05, power 0.8
    z_a, z_b, p1, p2 = 1.959963985, 0.841621234, 0.25, 0.30
    n = (z_a * math.sqrt(2 * 0.275 * 0.725) + z_b * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2))) ** 2 / 0.05 ** 2
    assert math.ceil(n) == 1251
    assert ("- MC cloze acc_norm: all-softmax − hybrid = 0.0500 needs 1,251 items; this eval has 40 (not enough: the "
            "gap is within noise)") in result["markdown"]
    # NIAH at T: 0.0 vs 0.5 over the 4 trials at length 256
    niah = next(p for p in result["power_analysis"] if p["what"] == "NIAH accuracy at 256")
    n = (z_a * math.sqrt(2 * 0.25 * 0.75) + z_b * math.sqrt(0 + 0.25)) ** 2 / 0.5 ** 2
    assert (niah["low"], niah["high"], niah["items_used"], niah["items_needed"]) == ("all-lightning", "hybrid", 4,
                                                                                      math.ceil(n))
    # mean log acc_norm²: a gap of 0.05 with sd 0.4 is d = 0.125; the normal approximation 2 (z_a + z_b)² / d² gives
    # 1004.7 per group; the exact noncentral-t power needs 1006
    lan2 = next(p for p in result["power_analysis"] if p["what"] == "MC cloze log acc_norm²")
    assert lan2["gap"] == pytest.approx(0.05) and lan2["pooled_sd"] == pytest.approx(0.4)
    assert 2 * (z_a + z_b) ** 2 / 0.125 ** 2 == pytest.approx(1004.7, abs=0.05)
    assert lan2["items_needed"] == 1006 and not lan2["enough"]
    assert f"needs {lan2['items_needed']:,} items; this eval has 40" in result["markdown"]


def test_no_gap_is_said_plainly(tmp_path) -> None:
    pairs = [_variant(tmp_path, n, p, _report(0.0, 0.25, -1.3, 6.0))
             for n, p in (("a", "hybrid"), ("b", "all-softmax"))]
    variants = [load_variant(r, c) for r, c in pair_reports(*_unpair(pairs))]
    md = compare(variants, CompareParams())["markdown"]
    assert "- NIAH accuracy at 256: no gap between the variants (0.0000); 4 items" in md
    assert "- MC cloze acc_norm: no gap between the variants (0.0000); 40 items" in md


@pytest.mark.parametrize("change, message", [
    (dict(inputs={**INPUTS, "mixture": ["other-mix"]}), "pretrain input 'mixture' (artifact digest) differs"),
    (dict(params={"train_tokens": 40960}), "pretrain param train_tokens differs"),
    (dict(params={"seed": 1}), "pretrain param seed differs"),
    (dict(tokens=22528), "tokens trained on differs: a=20480, b=22528"),
    (dict(eval_params={**EVAL_PARAMS, "cloze_items": 50}), "eval params differs"),
])
def test_unfair_comparisons_are_refused_naming_the_difference(tmp_path, change, message) -> None:
    a = _variant(tmp_path, "a", "hybrid", _report(0.0, 0.25, -1.3, 6.0))
    b = _variant(tmp_path, "b", "all-softmax", _report(0.0, 0.25, -1.3, 6.0), **change)
    variants = [load_variant(r, c) for r, c in pair_reports(*_unpair([a, b]))]
    with pytest.raises(ValueError, match="would be unfair") as e:
        compare(variants, CompareParams())
    assert message in str(e.value) and "allow_unfair: true" in str(e.value)
    result = compare(variants, CompareParams(allow_unfair=True))
    assert not result["fair"] and any(message in p for p in result["fairness_problems"])
    assert "**WARNING: UNFAIR COMPARISON**" in result["markdown"]


def test_allowed_unfair_comparison_shows_a_task_one_variant_lacks_as_a_dash(tmp_path) -> None:
    a = _variant(tmp_path, "a", "hybrid", _report(0.0, 0.25, -1.3, 6.0))
    extra = _report(0.0, 0.25, -1.3, 6.0)
    extra["multiple_choice"]["arc"] = {"items": 100, "acc": 0.4, "acc_norm": 0.45, "log_acc_norm2": -1.1,
                                       "log_acc_norm2_sd": 0.3}
    b = _variant(tmp_path, "b", "all-softmax", extra)
    variants = [load_variant(r, c) for r, c in pair_reports(*_unpair([a, b]))]
    with pytest.raises(ValueError, match=r"multiple-choice tasks differs: a=\['cloze'\], b=\['arc', 'cloze'\]"):
        compare(variants, CompareParams())
    result = compare(variants, CompareParams(allow_unfair=True))
    assert "| MC arc: acc_norm (100 items) | — | 0.4500 |" in result["markdown"].splitlines()
    assert [p["what"] for p in result["power_analysis"]] == ["NIAH accuracy at 256", "MC cloze acc_norm",
                                                             "MC cloze log acc_norm²"]  # arc: only one variant has it


def test_only_the_varied_param_and_run_mechanics_may_differ(three, tmp_path) -> None:
    variants = [load_variant(r, c) for r, c in pair_reports(*_unpair(three))]
    assert fairness_problems(variants, ["model_overrides.attention_pattern"]) == []
    problems = fairness_problems(variants, [])
    assert problems == ["pretrain param model_overrides.attention_pattern differs: hybrid='hybrid', "
                        "all-softmax='all-softmax', all-lightning='all-lightning'"]
    a = _variant(tmp_path, "a", "hybrid", _report(0.0, 0.25, -1.3, 6.0))
    b = _variant(tmp_path, "b", "all-softmax", _report(0.0, 0.25, -1.3, 6.0),
                 params={"lightning_impl": "naive", "log_every": 10})
    assert fairness_problems([load_variant(*a), load_variant(*b)], ["model_overrides.attention_pattern"]) == []


def test_two_variants_of_one_stage_name_are_refused_even_when_unfairness_is_allowed(tmp_path) -> None:
    a = _variant(tmp_path / "1", "hybrid", "hybrid", _report(0.0, 0.25, -1.3, 6.0))
    b = _variant(tmp_path / "2", "hybrid", "all-softmax", _report(0.0, 0.25, -1.3, 6.0))
    b[1].manifest["digest"] = "ckpt-other"
    b[0].manifest["key_material"]["inputs"]["checkpoint"] = ["ckpt-other"]
    variants = [load_variant(r, c) for r, c in pair_reports(*_unpair([a, b]))]
    with pytest.raises(ValueError, match="pretrain stages of the same name"):
        compare(variants, CompareParams(allow_unfair=True))


def test_report_missing_a_metric_is_an_error_naming_it_and_the_file(tmp_path) -> None:
    report = _report(0.0, 0.25, -1.3, 6.0)
    del report["metrics"]["niah_accuracy_2x"]
    r, c = _variant(tmp_path, "a", "hybrid", report)
    with pytest.raises(ValueError, match=r"lacks metrics \['niah_accuracy_2x'\]") as e:
        load_variant(r, c)
    assert str(r.path / "report.json") in str(e.value) and "rerun that eval stage" in str(e.value)


def test_reports_and_checkpoints_must_pair_one_to_one(tmp_path) -> None:
    a = _variant(tmp_path, "a", "hybrid", _report(0.0, 0.25, -1.3, 6.0))
    b = _variant(tmp_path, "b", "all-softmax", _report(0.0, 0.25, -1.3, 6.0))
    with pytest.raises(ValueError, match="not among the compare stage's checkpoint inputs: add that pretrain stage"):
        pair_reports([a[0], b[0]], [a[1]])
    with pytest.raises(ValueError, match="no eval report for checkpoint"):
        pair_reports([a[0]], [a[1], b[1]])
    with pytest.raises(ValueError, match="both evaluate checkpoint"):
        pair_reports([a[0], a[0]], [a[1], b[1]])
    with pytest.raises(ValueError, match="a comparison needs at least two"):
        pair_reports([a[0]], [a[1]])
    foreign = Artifact(path=b[0].path, manifest={**copy.deepcopy(b[0].manifest), "key_material": {}})
    with pytest.raises(ValueError, match="does not record the one checkpoint it evaluated"):
        pair_reports([a[0], foreign], [a[1], b[1]])
    # the order of the variants is the order of the checkpoint inputs, whatever the order of the reports
    assert [c.manifest["stage"] for _, c in pair_reports([a[0], b[0]], [b[1], a[1]])] == ["b", "a"]


def test_stage_writes_table_json_and_plot_and_logs_variant_metrics(three, tmp_path) -> None:
    reports, checkpoints = _unpair(three)
    ctx = StageContext(tmp_path / "out", {"reports": reports, "checkpoints": checkpoints}, stage_name="compare")
    run(CompareParams(), ctx)
    result = json.loads((tmp_path / "out" / COMPARISON_JSON).read_text())
    assert [v["name"] for v in result["variants"]] == ["hybrid", "all-softmax", "all-lightning"]
    assert result["variants"][2]["attention_pattern"] == ["lightning"] * 8
    md = (tmp_path / "out" / COMPARISON_MD).read_text()
    assert "| NIAH accuracy at 256 | 0.5000 | 0.2500 | 0.0000 |" in md
    assert (tmp_path / "out" / "plots" / "comparison.png").stat().st_size > 10_000
    logged = {p.name for p, _ in ctx.sink.artifacts}
    assert {"comparison.json", "comparison.md", "comparison.png"} <= logged
    assert ctx.sink.last("hybrid.niah_accuracy") == 0.5
    assert ctx.sink.last("all-softmax.mc_acc_norm.cloze") == 0.30
    assert ctx.sink.last("all-lightning.eval_loss_at_256") == 6.1
    assert ctx.sink.last("hybrid.tokens") == 20480
    assert ctx.rows == {"variants": 3}


def test_each_varied_param_besides_the_pattern_is_a_row_with_its_value_per_variant(tmp_path) -> None:
    """Two hybrids that differ in head_init alone look alike in the pattern rows: the table names what differs."""
    a = _variant(tmp_path, "embed", "hybrid", _report(0.5, 0.25, -1.3, 6.0), params={"head_init": "embedding"})
    b = _variant(tmp_path, "xavier", "hybrid", _report(0.0, 0.25, -1.3, 6.0), params={"head_init": "xavier"})
    variants = [load_variant(*a), load_variant(*b)]
    with pytest.raises(ValueError, match="head_init differs"):
        compare(variants, CompareParams())
    result = compare(variants, CompareParams(varied=["model_overrides.attention_pattern", "head_init", "peak_lr"]))
    lines = result["markdown"].splitlines()
    assert "| pretrain param `head_init` (varied) | embedding | xavier |" in lines
    assert "| pretrain param `peak_lr` (varied) | 0.003 | 0.003 |" in lines
    assert not any("attention_pattern` (varied)" in line for line in lines)  # its own rows show it
    assert result["fair"]
