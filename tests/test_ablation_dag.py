"""The attention ablation DAG (dags/ablation-attention.yaml, §2.2.2.3 / Figure 7): the pretrain stage's attention-pattern
choice, the spec's three variants differing in nothing else, and the whole DAG through the real CLI, Ray and MLflow."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.spec import SpecError, load_spec
from pretrain.stage import ATTENTION_KINDS, ATTENTION_PATTERNS, PretrainParams

REPO = Path(__file__).resolve().parent.parent
DAG = REPO / "dags" / "ablation-attention.yaml"
VARIANTS = {"hybrid": "hybrid", "all-softmax": "all-softmax", "all-lightning": "all-lightning"}  # stage -> pattern


def test_attention_pattern_names_checked_at_validation_are_the_model_configs() -> None:
    from model import configuration

    assert ATTENTION_PATTERNS == configuration.PATTERN_SHORTHANDS
    assert ATTENTION_KINDS == configuration.ATTENTION_KINDS


@pytest.mark.parametrize("pattern", ["hybrid", "all-softmax", "all-lightning", ["lightning", "softmax"]])
def test_pretrain_accepts_the_attention_patterns(pattern) -> None:
    assert PretrainParams(model_overrides={"attention_pattern": pattern}).model_overrides["attention_pattern"] == pattern


@pytest.mark.parametrize("pattern, message", [
    ("all-softmx", "expected one of hybrid, all-lightning, all-softmax"),
    (["lightning", "linear"], "a per-layer pattern is a non-empty list of lightning and softmax"),
    ([], "a per-layer pattern is a non-empty list"),
])
def test_pretrain_refuses_an_unknown_attention_pattern(pattern, message) -> None:
    with pytest.raises(ValidationError, match=message):
        PretrainParams(model_overrides={"attention_pattern": pattern})


def test_a_misspelt_pattern_fails_spec_validation_naming_the_stage() -> None:
    with pytest.raises(SpecError) as e:
        load_spec(DAG, overrides=["all-softmax.model_overrides.attention_pattern=all-softmx"])
    assert "all-softmax" in str(e.value) and "all-softmx" in str(e.value)


@pytest.mark.parametrize("dag", [DAG, DAG.with_name("ablation-attention-gpu.yaml")], ids=["cpu", "gpu"])
def test_ablation_spec_variants_differ_only_in_attention_pattern_and_share_data_and_eval(dag: Path) -> None:
    spec = load_spec(dag)
    pretrain = {n: s.params.model_dump() for n, s in spec.stages.items() if s.uses == "pretrain"}
    assert set(pretrain) == set(VARIANTS)
    for name, pattern in VARIANTS.items():
        assert pretrain[name].pop("model_overrides") == {"attention_pattern": pattern}
        assert spec.stages[name].inputs == {"mixture": ["mix"], "documents": ["quality"], "tokenizer": ["tokenizer"]}
    first = pretrain["hybrid"]
    assert all(p == first for p in pretrain.values())
    evals = {n: s for n, s in spec.stages.items() if s.uses == "eval"}
    assert {n: s.inputs["checkpoint"] for n, s in evals.items()} == {f"eval-{v}": [v] for v in VARIANTS}
    assert len({json.dumps(s.params.model_dump(), sort_keys=True) for s in evals.values()}) == 1
    compare = spec.stages["compare"]
    assert compare.inputs == {"reports": [f"eval-{v}" for v in VARIANTS], "checkpoints": list(VARIANTS)}
    # the data stages are those of the DAG of the same size, params included: the same cache keys, so they reuse its
    # artifacts under the same artifact_root
    twin = load_spec(REPO / "dags" / ("tiny.yaml" if dag == DAG else "gpu-recipe.yaml"))
    for name in ("ingest", "clean", "dedup", "tokenizer", "quality", "mix"):
        assert spec.stages[name].params.model_dump() == twin.stages[name].params.model_dump(), name
        assert spec.stages[name].inputs == twin.stages[name].inputs, name


# --- end to end -------------------------------------------------------------------------------------------------
# Sized for the 2-core CPU: 100 documents per corpus file, 10,240 tokens (5 steps) per variant, small eval grids.
E2E_OVERRIDES = ["ingest.limit=100"]
for _v in VARIANTS:
    E2E_OVERRIDES += [f"{_v}.train_tokens=10240", f"{_v}.checkpoint_every=5", f"{_v}.eval_documents=32"]
for _v in VARIANTS:
    E2E_OVERRIDES += [f"eval-{_v}.{k}" for k in ("cloze_items=12", "next_sentence_items=12", "niah_trials=1",
                                                  "needle_depths=[0.0,1.0]", "mr_niah_trials=1", "loss_windows=2")]


@pytest.mark.slow
@pytest.mark.extended
def test_ablation_dag_compares_three_variants_trained_on_the_same_data(tmp_path) -> None:
    from pipeline import tracking

    env = {**os.environ, "HYLIGHT_STATE_DIR": str(tmp_path / "state")}
    root = tmp_path / "runs"
    sets = [a for o in [f"artifact_root={root}", *E2E_OVERRIDES] for a in ("--set", o)]
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(DAG), *sets, "--json",
                          str(tmp_path / "run.json")], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["ok"] and {s["state"] for s in run["stages"].values()} == {"done"}

    art = Path(run["stages"]["compare"]["artifact"])
    result = json.loads((art / "comparison.json").read_text())
    assert result["fair"] and result["fairness_problems"] == []
    assert [v["name"] for v in result["variants"]] == list(VARIANTS)
    assert [v["pattern"] for v in result["variants"]] == ["hybrid 7:1", "all-softmax", "all-lightning"]
    for v in result["variants"]:
        m = v["metrics"]
        assert m["tokens"] == run["stages"]["hybrid"]["summary"]["tokens"] >= 10240
        for name in ("train_loss", "eval_loss", "eval_loss_at_256", "eval_loss_at_512", "params_total"):
            assert math.isfinite(m[name]) and m[name] > 0, (v["name"], name)
        for name in ("niah_accuracy", "niah_accuracy_2x", "multi_round_niah_recall", "mc_acc_norm.cloze",
                     "mc_acc_norm.next_sentence"):
            assert 0 <= m[name] <= 1, (v["name"], name)
        assert m["mc_log_acc_norm2.cloze"] < 0
        # the same numbers as the variant's own eval and pretrain runs
        assert m["niah_accuracy"] == run["stages"][f"eval-{v['name']}"]["summary"]["niah_accuracy"]
        assert m["eval_loss"] == run["stages"][v["name"]]["summary"]["eval_loss"]
    md = (art / "comparison.md").read_text()
    assert "| | hybrid | all-softmax | all-lightning |" in md and "Power analysis" in md

    # each variant exported in transformers' MiniMax format with its own layer types
    for name, kinds in (("all-softmax", {"full_attention"}), ("all-lightning", {"linear_attention"}),
                        ("hybrid", {"full_attention", "linear_attention"})):
        config = json.loads((Path(run["stages"][name]["artifact"]) / "minimax" / "config.json").read_text())
        assert set(config["layer_types"]) == kinds, name

    c = tracking.client(f"sqlite:///{root / 'mlflow.db'}")
    mlrun = c.get_run(run["stages"]["compare"]["run_id"])
    for v in VARIANTS:
        assert math.isfinite(mlrun.data.metrics[f"{v}.niah_accuracy"])
        assert mlrun.data.metrics[f"{v}.eval_loss_at_256"] == pytest.approx(
            result["variants"][list(VARIANTS).index(v)]["metrics"]["eval_loss_at_256"])
    assert {Path(f.path).name for f in c.list_artifacts(mlrun.info.run_id, "comparison")} == {"comparison.json",
                                                                                             "comparison.md"}
    assert "plots/comparison.png" in {f.path for f in c.list_artifacts(mlrun.info.run_id, "plots")}
    print(f"\nablation DAG: {run['stages']['compare']['summary'].get('hybrid.tokens')} tokens per variant\n{md}")
