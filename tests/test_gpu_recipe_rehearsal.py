"""dags/gpu-recipe.yaml before any GPU call: its CPU rehearsal's overrides validate on this machine and change only
sizes and resources (fast, in CI), the ablation's branches are the hybrid's pretraining but for the varied params,
and the whole DAG runs on the CPU with those sizes (`-m extended`, ~5.5 minutes on 2 cores: run it before a GPU
call; bench/gpu_recipe_cpu.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.orchestrator import local_capacity
from pipeline.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_recipe_cpu  # noqa: E402  (bench/ is scripts, not a package)


def test_the_rehearsal_overrides_validate_here_and_change_only_sizes_and_resources():
    sets = gpu_recipe_cpu.overrides()
    spec = load_spec(gpu_recipe_cpu.SPEC, overrides=sets, capacity=local_capacity())  # resources checked too
    base = load_spec(gpu_recipe_cpu.SPEC)
    sized = {k for kind in gpu_recipe_cpu.BY_KIND.values() for k in kind} | {"min_prompt_tokens"}
    for line in sets:
        stage, rest = line.split(".", 1)
        key = rest.split("=", 1)[0]
        assert key in sized or key.startswith("resources."), line
    assert set(spec.stages) == set(base.stages) and len(spec.stages) >= 27
    for name, st in spec.stages.items():
        assert st.resources.gpus == 0 and st.resources.cpus == 1, name
        b = base.stages[name]
        assert st.kind.name == b.kind.name and st.inputs == b.inputs, name  # the same graph
    assert base.stages["pretrain"].params.copy_share > 0  # the curriculum is rehearsed, not turned off
    # the shortest retrieval sample is scaled to the rehearsal's rows (256 of 8,192 -> 128 of 512, its floor)
    mins = {n: spec.stages[n].params.retrieval_min_tokens for n in ("long_context", "long_context_facts")}
    assert mins == {"long_context": 128, "long_context_facts": 128}
    assert spec.stages["pretrain"].params.copy_share == base.stages["pretrain"].params.copy_share


def test_the_ablation_branches_are_the_hybrids_pretraining_but_for_the_varied_params():
    spec = load_spec(gpu_recipe_cpu.SPEC)
    hybrid = spec.stages["pretrain"].params.model_dump()
    varied = spec.stages["compare"].params.varied
    assert set(varied) == {"model_overrides.attention_pattern", "peak_lr"}
    variants = {"pretrain_all_softmax": "all-softmax", "pretrain_all_softmax_lr25e5": "all-softmax",
                "pretrain_all_lightning": "all-lightning"}
    for name, pattern in variants.items():
        p = spec.stages[name].params.model_dump()
        assert p["model_overrides"] == {"attention_pattern": pattern}
        diff = {k for k in hybrid if hybrid[k] != p[k]}
        assert diff <= {"model_overrides", "peak_lr"}, (name, diff)
    assert set(spec.stages["compare"].inputs["checkpoints"]) == {"pretrain", *variants}
    assert hybrid["model_overrides"] == {"attention_pattern": "hybrid"}
    assert hybrid["head_init"] == "embedding"  # the fifth lease: the Xavier head left the hybrid on the plateau
    assert hybrid["capacity_factor"] == 2.0  # the sixth lease: 1.25 dropped 35% and trained to a worse loss
    # all-softmax at 2e-4 (its best so far) and 2.5e-4, below its plateau runs (3e-4); unigram_init off everywhere
    # (the tenth lease: it kept both all-softmax and the hybrid on the plateau)
    lrs = [spec.stages[n].params.peak_lr for n in ("pretrain", "pretrain_all_softmax", "pretrain_all_softmax_lr25e5")]
    assert lrs == [5e-4, 2e-4, 2.5e-4]
    assert all(st.params.unigram_init == 0.0 for st in spec.stages.values() if st.kind.name == "pretrain")
    # the facts branch: the spec's long_context from the same inputs but for its retrieval kinds, which add the
    # fact kind to the same list; its eval is long_context's (the same 40 needles a length)
    lc = spec.stages["long_context"].params.model_dump()
    facts = spec.stages["long_context_facts"].params.model_dump()
    assert {k for k in lc if lc[k] != facts[k]} == {"retrieval_kinds"}
    assert "fact" not in lc["retrieval_kinds"] and [k for k in facts["retrieval_kinds"] if k != "fact"] == \
        lc["retrieval_kinds"] and facts["retrieval_kinds"].count("fact") == 2
    assert spec.stages["long_context_facts"].inputs == spec.stages["long_context"].inputs
    ev, ev_f = (spec.stages[n] for n in ("eval_long_context", "eval_long_context_facts"))
    assert ev_f.params.model_dump() == ev.params.model_dump()
    assert ev_f.inputs == {**ev.inputs, "checkpoint": ["long_context_facts"]}
    # sft_long_ctx's eval asks long_context's needles (40 a length), so the two pair trial by trial
    assert spec.stages["eval_sft_long_ctx"].params.model_dump() == ev.params.model_dump()
    assert lc["capacity_factor"] == hybrid["capacity_factor"]
    # the post-training variants: each its twin but for the params it names, and from a chain checkpoint
    sft, sft_more = (spec.stages[n].params.model_dump() for n in ("sft_short", "sft_more"))
    assert {k for k in sft if sft[k] != sft_more[k]} == {"epochs"} and (sft["epochs"], sft_more["epochs"]) == (6, 10)
    grpo, g2 = (spec.stages[n].params.model_dump() for n in ("grpo", "grpo_from_sft_more"))
    # the chain's GRPO with four times the steps, from the best SFT checkpoint instead of dpo_long
    assert {k for k in grpo if grpo[k] != g2[k]} == {"max_steps"} and (grpo["max_steps"], g2["max_steps"]) == (80, 320)
    assert (spec.stages["grpo"].inputs["checkpoint"], spec.stages["grpo_from_sft_more"].inputs["checkpoint"]) == \
        (["dpo_long"], ["sft_more"])
    # long-context SFT: the prompts stage adds long look-ups to the sft pool; the chain's SFT stages leave them out
    # (so they see the pool they saw before), sft_long_ctx takes them alone, from sft_short
    assert spec.stages["prompts"].params.long_retrieval > 0
    for n in ("sft_short", "sft_more", "sft_long"):
        assert spec.stages[n].params.difficulties == ["easy", "medium", "hard"], n
    sl, sc = (spec.stages[n].params.model_dump() for n in ("sft_long", "sft_long_ctx"))
    assert {k for k in sl if sl[k] != sc[k]} == {"difficulties", "sampling_batch_size", "max_length", "batch_size",
                                                 "gradient_accumulation_steps", "epochs"}
    assert sc["difficulties"] == ["long"]  # the two prompt sets are disjoint
    assert sc["max_length"] == max(p.seq_len for p in spec.stages["long_context"].params.phases)
    assert spec.stages["sft_long_ctx"].inputs["checkpoint"] == ["sft_short"]
    gpu = [n for n, st in spec.stages.items() if st.resources.gpus]
    assert all(spec.stages[n].resources.gpus == 1 for n in gpu)  # one GPU each: Ray places them side by side


@pytest.mark.slow
@pytest.mark.extended
def test_the_gpu_recipe_runs_end_to_end_on_the_cpu_with_its_sizes_cut(tmp_path):
    report = tmp_path / "report.json"
    rc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_recipe_cpu.py"), "--root", str(tmp_path / "root"),
                         "--json", str(report)], cwd=ROOT, timeout=1500).returncode
    stages = json.loads(report.read_text())["stages"]
    # sft_more differs from sft_short only in its epochs, which the CPU sizes replace: one cache key, so it reads
    # its twin's artifact ("cached")
    twins = {"sft_more", "eval_sft_more"}
    assert rc == 0 and all(r["state"] == "done" or (n in twins and r["state"] == "cached")
                           for n, r in stages.items()), {n: r["error"] for n, r in stages.items() if r["state"] != "done"}
    assert len(stages) >= 27
    pre = stages["pretrain"]["summary"]
    assert pre["tokens"] == 61440 and pre["eval_loss"] < 9.0
    # the copy curriculum was built and read: its rows are in the packed data's record
    copy = json.loads((Path(stages["pretrain"]["artifact"]) / "copy_curriculum.json").read_text())
    share = load_spec(gpu_recipe_cpu.SPEC).stages["pretrain"].params.copy_share
    assert copy["rows"] == int(40960 // 256 * share) and copy["samples"] > copy["rows"]
    comparison = json.loads(next((tmp_path / "root" / "artifacts" / "compare").glob("*/comparison.json")).read_text())
    assert comparison["fair"] is True
    for name in ("sft_short", "dpo_short", "grpo", "eval_grpo"):
        assert "eval_pass_rate" in stages[name]["summary"], name
    for name in ("eval_long_context", "eval_sft_short", "eval_grpo"):  # niah_chat: on in these evals
        assert 0.0 <= stages[name]["summary"]["niah_chat_accuracy"] <= 1.0, name
    # long-context SFT: the prompts stage made long look-ups, sft_long_ctx trained on them alone and the chain's SFT
    # stages on none of them
    n_long = stages["prompts"]["summary"]["pool.sft.long_retrieval"]
    lctx, short = stages["sft_long_ctx"]["summary"], stages["sft_short"]["summary"]
    assert n_long > 0 and lctx["sft_examples"] > 0 and short["dropped.other_difficulty"] == n_long
    pool = stages["prompts"]["summary"]["pool.sft"]
    assert lctx["dropped.other_difficulty"] == pool - n_long  # every other prompt of the pool left out
    ret = json.loads((Path(stages["long_context"]["artifact"]) / "phases" / "1" / "retrieval.json").read_text())
    assert set(ret["by_kind"]) == {"lookup", "multi_lookup", "repeat", "continue"}
    ret_f = json.loads((Path(stages["long_context_facts"]["artifact"]) / "phases" / "1" / "retrieval.json").read_text())
    assert set(ret_f["by_kind"]) == {"lookup", "multi_lookup", "repeat", "continue", "fact"}
    assert "niah_accuracy" in stages["eval_long_context_facts"]["summary"]


@pytest.mark.slow
def test_the_gpu_runs_preflight_passes_against_this_machines_packages(tmp_path):
    """bench/run_gpu_dag.sh checks, before a GPU run, that every stage's imports resolve (its preflight names
    modules of this repo: a split or a move must not leave it behind, as it once did unnoticed)."""
    import sysconfig

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SITE": sysconfig.get_paths()["purelib"], "SITE_READY": "1",
           "PYTHON": sys.executable, "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), "PREFLIGHT_ONLY": "1",
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu_dag.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    log = (tmp_path / "out" / "run.log").read_text()
    assert r.returncode == 0, log[-3000:] + r.stderr[-2000:]
    assert log.count(": ok") >= 8 and "FAILED" not in log


LASP = ROOT / "dags" / "lasp-gpu.yaml"


def test_the_lasp_spec_rehearses_with_cpu_ranks_for_its_sequence_parallel_stages():
    """dags/lasp-gpu.yaml (issue 34 item 4): its rehearsal overrides validate here, resources included; each
    sequence-parallel stage gets its ranks as CPU processes and no in-training probe (which SP refuses); the one-GPU
    and two-GPU runs differ only in sequence_parallel, so their losses can be compared step by step."""
    sets = gpu_recipe_cpu.overrides(LASP)
    spec = load_spec(LASP, overrides=sets, capacity=local_capacity())
    base = load_spec(LASP)
    for name in ("lc_two_gpus", "lc_128k"):
        st = spec.stages[name]
        assert st.params.sequence_parallel == 2 and st.params.processes == 2 and st.params.probe_every == 0, name
        assert base.stages[name].resources.gpus == 2 and st.resources.gpus == 0
    one, two = (base.stages[n].params.model_dump() for n in ("lc_one_gpu", "lc_two_gpus"))
    assert {k for k in one if one[k] != two[k]} == {"sequence_parallel"}
    assert base.stages["lc_128k"].params.phases[0].seq_len == 131072
    assert all(not base.stages[n].params.token_drop for n in ("lc_one_gpu", "lc_two_gpus", "lc_128k"))


@pytest.mark.slow
@pytest.mark.extended
def test_the_lasp_spec_runs_on_the_cpu_and_two_ranks_train_like_one(tmp_path):
    report = tmp_path / "report.json"
    rc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_recipe_cpu.py"), "--spec", str(LASP),
                         "--root", str(tmp_path / "root"), "--json", str(report)], cwd=ROOT, timeout=1500).returncode
    stages = json.loads(report.read_text())["stages"]
    assert rc == 0 and all(r["state"] in ("done", "cached") for r in stages.values()), {
        n: r["error"] for n, r in stages.items() if r["state"] not in ("done", "cached")}
    # cut to the rehearsal's sizes, lc_128k is lc_two_gpus (one cache key): it waits for it and reads its artifact
    assert stages["lc_128k"]["state"] == "cached" and stages["lc_two_gpus"]["state"] == "done"

    def losses(name: str) -> list[float]:
        log = Path(stages[name]["artifact"]) / "train_log.jsonl"
        return [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    one, two = losses("lc_one_gpu"), losses("lc_two_gpus")
    assert len(one) == len(two) >= 4
    assert two == pytest.approx(one, rel=1e-5)  # fp32 on the CPU; on GPUs, bf16 noise
