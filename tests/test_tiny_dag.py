"""End to end: `hylight run dags/tiny.yaml` through the real CLI, Ray and MLflow, then the UI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline import tracking
from tests.conftest import hylight

# the `tiny` fixture (tests/conftest.py) is shared with tests/test_faults.py: one worker runs the group
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiny_dag")]
REPO = Path(__file__).resolve().parent.parent


def test_tiny_dag_runs_every_stage_then_is_all_cache_hits(tiny):
    first, second = tiny["first"], tiny["second"]
    assert first["ok"] and {s["state"] for s in first["stages"].values()} == {"done"}
    assert {s["state"] for s in second["stages"].values()} == {"cached"}
    for name, s in second["stages"].items():
        assert s["digest"] == first["stages"][name]["digest"]
        assert s["produced_by"] == first["stages"][name]["run_id"]
    ingest = first["stages"]["ingest"]["summary"]
    assert ingest["read"] == ingest["ingested"] + ingest["quarantined"] and ingest["ingested"] > 1000
    assert first["stages"]["tokenizer"]["summary"]["vocab_size"] == 8192
    clean, dedup = first["stages"]["clean"]["summary"], first["stages"]["dedup"]["summary"]
    assert clean["in"] == ingest["ingested"] and clean["in"] == clean["kept"] + clean["dropped"]
    assert dedup["in"] == clean["kept"] and 0 < dedup["kept"] < dedup["in"]
    quality = first["stages"]["quality"]["summary"]
    assert quality["documents"] == dedup["kept"]
    mix = first["stages"]["mix"]["summary"]
    assert 0 < mix["tokens"] <= 6_000_000 and mix["documents"] == dedup["kept"]
    pretrain = first["stages"]["pretrain"]["summary"]
    assert pretrain["tokens"] >= 400_000 and pretrain["skipped_steps"] == 0
    # the model learned more than token frequencies: clearly below the unigram baseline on held-out rows
    assert pretrain["eval_loss"] < pretrain["unigram_loss"] - 0.5, pretrain
    assert "✓ tokenizer done" in tiny["stderr"] and "stage" in tiny["stderr"]  # progress + summary table


def test_tiny_dag_quality_scores_documentation_above_code_and_fortunes(tiny):
    """The quality stage on the whole cleaned sample corpus (reference labeler, the spec's params).

    (This replaces a standalone whole-corpus quality run in tests/test_quality.py: the DAG already does that work.)
    """
    q = tiny["first"]["stages"]["quality"]["summary"]
    assert q["labeled"] == q["documents"] == tiny["first"]["stages"]["dedup"]["summary"]["kept"]
    for dim in ("knowledge_depth", "helpfulness"):
        assert q[f"heldout_mae_{dim}"] < 0.8 * q[f"baseline_mae_{dim}"], (dim, q)
    assert q["heldout_category_accuracy"] > q["baseline_category_accuracy"] + 0.3, q
    report = json.loads((Path(tiny["first"]["stages"]["quality"]["artifact"]) / "quality_report.json").read_text())
    dom = report["per_domain"]
    for dim in ("knowledge_depth", "helpfulness"):
        assert dom["prose"][f"mean_{dim}"] > dom["code"][f"mean_{dim}"] + 0.5, (dim, dom)
        assert dom["prose"][f"mean_{dim}"] > dom["misc"][f"mean_{dim}"] + 0.5, (dim, dom)
    assert report["labels"]["rejected"] == 0 and report["labels"]["accepted"] == q["documents"]


def test_tiny_dag_long_context_extends_the_pretrained_checkpoint_phase_by_phase(tiny):
    first = tiny["first"]
    lc = first["stages"]["long_context"]["summary"]
    assert (lc["tokens"], lc["steps"], lc["skipped_steps"], lc["final_seq_len"]) == (65536, 16, 0, 1024)
    assert lc["eval_loss"] < lc["unigram_loss"] - 0.5, lc  # at 1024 tokens, on held-out long documents
    art = Path(first["stages"]["long_context"]["artifact"])
    for sub, (rope, length) in (("phases/0/model", (20_000.0, 512)), ("phases/1/model", (40_000.0, 1024)),
                                ("model", (40_000.0, 1024))):
        config = json.loads((art / sub / "config.json").read_text())
        assert (config["rope_theta"], config["max_position_embeddings"]) == (rope, length), sub
    c = tracking.client(f"sqlite:///{tiny['root'] / 'mlflow.db'}")
    run_id = first["stages"]["long_context"]["run_id"]
    assert [m.step for m in c.get_metric_history(run_id, "eval_loss")] == [8, 16]
    assert [m.step for m in c.get_metric_history(run_id, "loss")] == list(range(2, 17, 2))


def test_tiny_dag_trains_on_retrieval_rows_and_probes_retrieval_while_training(tiny):
    from data.retrieval import DEFAULT_KINDS  # the tiny DAG sets no retrieval_kinds: the params' default
    from pretrain.probe import PROBE_METRICS

    first = tiny["first"]
    c = tracking.client(f"sqlite:///{tiny['root'] / 'mlflow.db'}")
    pre, lc = first["stages"]["pretrain"], first["stages"]["long_context"]
    m = c.get_run(pre["run_id"]).data.metrics
    assert m["retrieval.rows"] > 0 and m["retrieval.share_of_rows"] == pytest.approx(0.1, abs=0.002)
    assert sum(m[f"retrieval.{k}.samples"] for k in DEFAULT_KINDS) == m["retrieval.samples"] >= m["retrieval.rows"]
    assert "retrieval.fact.samples" not in m
    assert 0 < m["retrieval.answer_tokens"] < m["retrieval.tokens"]
    # a probe every 40 steps and one at the last (147) step, each metric in range; the last one in the summary
    assert [x.step for x in c.get_metric_history(pre["run_id"], "copy_accuracy")] == [40, 80, 120, 147]
    for key in PROBE_METRICS:
        assert key in pre["summary"], key
    for key in ("copy_accuracy", "niah_choice_accuracy"):
        assert all(0.0 <= x.value <= 1.0 for x in c.get_metric_history(pre["run_id"], key)), key
    lm = c.get_run(lc["run_id"]).data.metrics
    assert (lm["phase0.retrieval.rows"], lm["phase1.retrieval.rows"]) == (16, 8)  # a quarter of 64 and 32 rows
    assert [x.step for x in c.get_metric_history(lc["run_id"], "niah_choice_accuracy")] == [4, 8, 12, 16]
    for stage in (pre, lc):
        assert (Path(stage["artifact"]) / "plots" / "retrieval_probe.png").stat().st_size > 10_000


def test_tiny_dag_eval_reports_every_metric_in_range_with_its_plots(tiny):
    """The tiny model finds no needles; what is checked is that every metric is a real number in its range."""
    ev, pretrain = tiny["first"]["stages"]["eval"]["summary"], tiny["first"]["stages"]["pretrain"]["summary"]
    for name in ("niah_accuracy", "niah_accuracy_2x", "multi_round_niah_recall", "multi_round_niah_recall_2x",
                 "mc_acc_norm", "mc_acc_norm.cloze", "mc_acc_norm.next_sentence", "mc_acc.cloze"):
        assert 0.0 <= ev[name] <= 1.0, name
    for name in ("mc_log_acc_norm2", "mc_log_acc_norm2.cloze", "mc_log_acc_norm2.next_sentence"):
        assert -20 < ev[name] < 0, name  # log of a probability
    assert ev["mc_items.cloze"] == 40 and ev["mc_items.next_sentence"] == 40
    # trained length 256: the held-out loss there is a real model loss, and 512 (never trained on) is measured
    assert ev["eval_loss_at_256"] < pretrain["unigram_loss"] - 0.5, (ev, pretrain)
    assert 0 < ev["eval_loss_at_512"] < 20
    c = tracking.client(f"sqlite:///{tiny['root'] / 'mlflow.db'}")
    run = c.get_run(tiny["first"]["stages"]["eval"]["run_id"])
    assert {"niah_accuracy", "niah_accuracy_2x", "multi_round_niah_recall", "mc_log_acc_norm2"} <= set(run.data.metrics)
    plots = {Path(f.path).name for f in c.list_artifacts(run.info.run_id, "plots")}
    assert {"niah.png", "loss_by_position.png"} <= plots
    report = json.loads((Path(tiny["first"]["stages"]["eval"]["artifact"]) / "report.json").read_text())
    assert report["trained_length"] == 256 and report["context_lengths"] == [256, 512]
    assert report["held_out"]["documents"] == 64  # pretrain's eval_documents: taken out of training


POLICY_STAGES = ("sft_short", "sft_long", "dpo_short", "dpo_long", "grpo")


def test_tiny_dag_post_training_chain_logs_its_interface_metrics(tiny):
    """prompts -> reward_model -> sft I/II -> dpo III/IV -> grpo, each policy a loadable checkpoint evaluated by its
    own eval stage. The ~1M-parameter policy learns nothing the pass rate can see; the checks are that every stage
    ran, accounted for its inputs and logged its metrics under the interface names, with values in range."""
    from posttrain.policy import load_policy

    first = tiny["first"]
    st = first["stages"]
    prompts = st["prompts"]["summary"]
    assert prompts["prompts_in"] == prompts["prompts_kept"] + prompts["prompts_dropped"] and prompts["prompts_kept"] > 300
    rm = st["reward_model"]["summary"]
    assert 0.0 <= rm["eval_preference_accuracy"] <= 1.0 and rm["pairs_train"] > 100
    c = tracking.client(f"sqlite:///{tiny['root'] / 'mlflow.db'}")
    for name in POLICY_STAGES:
        summary, run_id = st[name]["summary"], st[name]["run_id"]
        assert 0.0 <= summary["eval_pass_rate"] <= 1.0, name
        steps = [m.step for m in c.get_metric_history(run_id, "eval_pass_rate")]
        assert steps[0] == 0 and len(steps) >= 2, (name, steps)  # the input policy, then the trained one
        losses = c.get_metric_history(run_id, "loss")
        assert losses and all(m.value == m.value for m in losses), name
        art = Path(st[name]["artifact"])
        for sub in ("model/config.json", "minimax/config.json", "packing.json"):
            assert (art / sub).is_file(), (name, sub)
        ev = st[f"eval_{name}"]["summary"]
        assert 0.0 <= ev["eval_pass_rate"] <= 1.0 and ev["eval_pass_prompts"] > 20, name
        assert 0 < ev["eval_loss_at_1024"] < 20, name  # trained length: long_context's 1024
    # eval_before: upstream (the tiny spec sets it after sft_short): each stage's "before" is the pass rate its
    # input's stage measured at its end, read from that checkpoint's eval_pass_rate.json, not decoded again
    for up, name in zip(POLICY_STAGES, POLICY_STAGES[1:], strict=False):
        rec = json.loads((Path(st[up]["artifact"]) / "eval_pass_rate.json").read_text())
        assert rec["eval_pass_rate"] == st[up]["summary"]["eval_pass_rate"] and rec["stage"] == up
        assert st[name]["summary"]["eval_pass_rate_before"] == rec["eval_pass_rate"], name
        mine = json.loads((Path(st[name]["artifact"]) / "eval_pass_rate.json").read_text())
        assert (mine["before"], mine["before_from"]) == (rec["eval_pass_rate"], up), name  # read, not decoded
    for name in ("dpo_short", "dpo_long"):
        assert 0.0 <= st[name]["summary"]["eval_preference_accuracy"] <= 1.0 and st[name]["summary"]["dpo_pairs"] > 0
    grpo_run = st["grpo"]["run_id"]
    for metric in ("reward_mean", "kl", "clip_fraction", "response_length"):
        history = c.get_metric_history(grpo_run, metric)
        steps = [m.step for m in history]
        # kl and clip_fraction every step of max_steps 4; reward and length on the steps that generate (TRL reuses
        # a rollout for num_iterations steps)
        assert steps == [1, 2, 3, 4] if metric in ("kl", "clip_fraction") else steps[0] == 1 and set(steps) <= {1, 2, 3, 4}
        assert all(m.value == m.value for m in history), metric
    model, tok = load_policy(st["grpo"]["artifact"])
    assert tok.convert_tokens_to_ids("<|end|>") in model.generation_config.eos_token_id


def test_tiny_dag_tokenizer_loads_with_autotokenizer(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["first"]["stages"]["tokenizer"]["artifact"])
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓"
    assert tok.decode(tok.encode(text)) == text


def test_tiny_dag_mlflow_records_parent_nested_runs_and_artifacts(tiny):
    first = tiny["first"]
    c = tracking.client(f"sqlite:///{tiny['root'] / 'mlflow.db'}")
    parent = c.get_run(first["run_id"])
    kids = c.search_runs([parent.info.experiment_id],
                         filter_string=f"tags.`mlflow.parentRunId` = '{first['run_id']}'")
    assert {r.data.tags[tracking.TAG_STAGE] for r in kids} == set(first["stages"])
    tok_run = c.get_run(first["stages"]["tokenizer"]["run_id"])
    assert tok_run.data.params["params.vocab_size"] == "8192"
    names = {f.path for f in c.list_artifacts(tok_run.info.run_id)}
    assert {"manifest.json", "plots", "tokenizer"} <= names
    assert any(k.startswith("bytes_per_token.") for k in tok_run.data.metrics)


def test_status_prints_the_last_run(tiny):
    out = hylight("status", env=tiny["env"])
    assert out.returncode == 0, out.stderr
    assert tiny["second"]["run_id"] in out.stdout
    assert "tokenizer" in out.stdout and "hit" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ui_serves_parent_and_nested_runs_on_loopback(tiny):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "ui", "--port", str(port)], cwd=REPO,
                            env=tiny["env"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(90):
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("MLflow UI did not come up in 90 s")
        page = urllib.request.urlopen(base, timeout=5).read().decode()
        assert "<html" in page.lower()
        req = urllib.request.Request(f"{base}/api/2.0/mlflow/runs/search", method="POST",
                                     data=json.dumps({"experiment_ids": ["1"], "max_results": 100}).encode(),
                                     headers={"Content-Type": "application/json"})
        runs = json.loads(urllib.request.urlopen(req, timeout=10).read())["runs"]
        ids = {r["info"]["run_id"] for r in runs}
        assert tiny["first"]["run_id"] in ids and tiny["second"]["run_id"] in ids
        tok = tiny["first"]["stages"]["tokenizer"]["run_id"]
        listing = json.loads(urllib.request.urlopen(
            f"{base}/api/2.0/mlflow/artifacts/list?run_id={tok}&path=plots", timeout=10).read())
        assert any(f["path"].endswith(".png") for f in listing["files"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_local_ray_listens_on_loopback_only(tmp_path):
    import psutil
    import ray

    from pipeline.orchestrator import Orchestrator, RunOptions
    from pipeline.spec import load_spec

    spec = load_spec(REPO / "dags/tiny.yaml", overrides=[f"artifact_root={tmp_path}"])
    orch = Orchestrator(spec, RunOptions(), out=open(os.devnull, "w"))
    orch._ensure_ray()
    try:
        ray_pids = {p.pid for p in psutil.Process().children(recursive=True)}
        listening = [c for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in ray_pids]
        assert listening, "found no Ray listeners"
        assert {c.laddr.ip for c in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening
    finally:
        ray.shutdown()


def test_tiny_dag_marks_each_kinds_records_and_leaves_them_out_of_the_digest(tiny):
    """Every stage's manifest flags exactly the files its kind declares as records (reports, logs, plots), each
    declared pattern matches a file, and the digest is the identity of the other files alone."""
    import fnmatch

    from pipeline.artifacts import artifact_digest
    from pipeline.registry import resolve

    for name, s in tiny["first"]["stages"].items():
        manifest = json.loads((Path(s["artifact"]) / "manifest.json").read_text())
        kind = resolve(manifest["kind"])
        files = manifest["files"]
        declared = {f["path"] for f in files if any(fnmatch.fnmatchcase(f["path"], p) for p in kind.records)}
        assert {f["path"] for f in files if f.get("record")} == declared, name
        for pattern in kind.records:
            assert any(fnmatch.fnmatchcase(f["path"], pattern) for f in files), (name, pattern)
        payload = [f for f in files if not f.get("record")]
        assert payload and manifest["digest"] == artifact_digest(manifest["type"], manifest["schema_version"],
                                                                 payload), name


def test_a_forced_rerun_that_reproduces_its_payload_keeps_its_digest_and_its_dependents_cached(tiny, tmp_path):
    """`--stage prompts` reruns the stage; its report's wall-clock fields differ, its pools do not: same digest, so
    reward_model, sft, dpo, grpo and their evals stay cache hits (before records, all of them reran)."""
    root, env = tiny["root"], tiny["env"]
    before = tiny["second"]["stages"]["prompts"]["digest"]
    forced = hylight("run", "dags/tiny.yaml", "--set", f"artifact_root={root}", "--stage", "prompts", "--json",
                     str(tmp_path / "forced.json"), env=env)
    assert forced.returncode == 0, forced.stderr[-3000:]
    prompts = json.loads((tmp_path / "forced.json").read_text())["stages"]["prompts"]
    assert prompts["state"] == "done" and prompts["digest"] == before
    plan = hylight("run", "dags/tiny.yaml", "--set", f"artifact_root={root}", "--dry-run", "--json",
                   str(tmp_path / "plan.json"), env=env)
    assert plan.returncode == 0, plan.stderr[-3000:]
    states = {n: s["state"] for n, s in json.loads((tmp_path / "plan.json").read_text())["stages"].items()}
    assert set(states.values()) == {"cached"}, states


def test_tiny_dag_records_the_sandbox_containment_of_every_stage_that_checked_code(tiny):
    """Stages that may run model-written code in the sandbox say, in MLflow and in their report, what contained it
    (issue 23: a best_effort run must be visible beside its numbers). reward_model runs every code prompt's
    reference solution, so its record has runs and their fields; the tiny policy's responses hold no code block,
    so sft_short, grpo and eval_grpo may record none."""
    first = tiny["first"]
    c = tracking.client(f"sqlite:///{tiny['root'] / 'mlflow.db'}")
    for stage, record in (("reward_model", "reward_report.json"), ("sft_short", "sft_report.json"),
                          ("grpo", "rl_report.json"), ("eval_grpo", "timing.json")):
        tags = c.get_run(first["stages"][stage]["run_id"]).data.tags
        ours = {k.removeprefix("hylight.sandbox."): v for k, v in tags.items() if k.startswith("hylight.sandbox.")}
        assert ours["containment"] == "require" and int(ours["runs"]) >= 0, (stage, ours)
        if int(ours["runs"]) > 0 or stage == "reward_model":
            assert int(ours["runs"]) > 0, (stage, ours)
            assert (ours["filesystem"], ours["pid_namespace"], ours["memory_limit"]) == ("private", "true", "cgroup")
        saved = json.loads((Path(first["stages"][stage]["artifact"]) / record).read_text())["sandbox"]
        assert saved == ours, (stage, saved, ours)
