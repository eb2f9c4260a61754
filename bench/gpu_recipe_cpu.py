"""The GPU recipe's CPU rehearsal: ``dags/gpu-recipe.yaml`` itself, every stage of it, run on this machine's CPUs
with its sizes cut (tiny model, 256-token rows, a 4K vocabulary, a few steps of each training stage, small evals).

What it catches before a GPU call: a param the spec's stages refuse, a stage graph that does not connect, an
override the spec loader rejects, a stage that fails on the spec's own combination of params (the copy
curriculum with retrieval rows and answers-only loss, the reward model from the pretrain checkpoint, the ablation's
``compare`` with two varied params, ...). What it cannot catch: a dtype, kernel, memory or timing problem that only
a GPU shows (bench/gpu_recipe_lease.sh is that run).

    python bench/gpu_recipe_cpu.py --root /tmp/rehearsal          # runs it; prints the stage table
    python bench/gpu_recipe_cpu.py --print                         # the --set overrides alone, one a line
    python bench/gpu_recipe_cpu.py --spec dags/lasp-gpu.yaml       # another GPU spec (sequence-parallel stages get
                                                                   # their ranks as CPU processes)

Only the sizes change: every stage's kind, inputs and every other param are the spec's. GPU stages get
``resources.gpus=0`` and one CPU (the stages themselves choose CPU or GPU from what they are given).
tests/test_gpu_recipe_rehearsal.py runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.spec import load_spec  # noqa: E402

SPEC = ROOT / "dags" / "gpu-recipe.yaml"

# by stage kind: the sizes that make a stage of that kind CPU-sized (params absent here stay the spec's)
PRETRAIN = {"size": "tiny", "seq_len": 256, "micro_batch_rows": 4, "batch_rows": 4, "max_batch_rows": 8,
            "double_batch_at_tokens": [40960], "train_tokens": 61440, "copy_until_tokens": 40960, "copy_span_tokens": [8, 48],
            "retrieval_min_tokens": 128, "log_every": 5, "probe_every": 10}
# 16 rows of 1,024 tokens in the last phase: a retrieval_share of 0.9 still leaves the 2 plain rows its samples need
LONG_CONTEXT = {"phases": [{"seq_len": 512, "rope_theta": 20000.0, "tokens": 16384, "short": 30, "medium": 70, "long": 0},
                           {"seq_len": 1024, "rope_theta": 40000.0, "tokens": 16384, "short": 35, "medium": 35, "long": 30}],
                "batch_tokens": 4096, "micro_batch_tokens": 2048, "retrieval_min_tokens": 128, "log_every": 1,
                "probe_every": 2}
EVAL = {"needle_depths": [0.5], "niah_trials": 1, "mr_niah_trials": 1, "loss_windows": 2, "cloze_items": 8,
        "next_sentence_items": 8, "generate_batch": 8, "pass_rate_prompts": 16}
BY_KIND = {
    "tokenizer": {"vocab_size": 4096},
    "quality": {"max_tokens": 64},
    "mix": {"token_budget": 1500000},
    "prompts": {"verifiable": {"arithmetic": 40, "string": 40, "retrieval": 20, "code": 20}, "open_ended": 60,
                "long_retrieval_words": 80},
    "pretrain": PRETRAIN,
    "long_context": LONG_CONTEXT,
    "reward_model": {"max_steps": 4, "batch_pairs": 4, "max_length": 256, "eval_every": 2},
    "sft": {"max_prompts": 12, "max_new_tokens": 16, "sampling_batch_size": 12, "max_length": 256, "epochs": 1,
            "batch_size": 4},
    "dpo": {"max_prompts": 12, "max_new_tokens": 16, "sample_batch_size": 12, "max_length": 512, "max_steps": 2,
            "batch_pairs": 2, "eval_every": 1},
    "grpo": {"max_prompts": 8, "min_prompts": 4, "num_generations": 4, "prompts_per_step": 2,
             "max_completion_length": 12, "max_steps": 2},
    "eval": EVAL,
}
# params of a kind that a given stage must not get (it does not have them, or the spec's value must stay)
SKIP = {("dpo", "min_prompt_tokens")}
NOT_WITH_SP = {"probe_every"}  # sizes a sequence-parallel stage refuses (the in-training probe runs on one rank)


def _scaled_min_tokens(params, floor: int) -> int:
    """A long_context stage's shortest retrieval sample at CPU size: the spec's, scaled from its shortest row to the
    rehearsal's, never under ``floor``; so a branch that differs from its twin in this param stays different (and
    rehearses its own data) instead of sharing its twin's cache key."""
    spec_row = min(p.seq_len for p in params.phases)
    cpu_row = min(p["seq_len"] for p in LONG_CONTEXT["phases"])
    return max(floor, min(cpu_row, round(params.retrieval_min_tokens * cpu_row / spec_row)))


def overrides(spec_path: Path = SPEC) -> list[str]:
    """The ``--set`` overrides of the rehearsal: each stage's sizes by its kind, and CPU resources."""
    spec = load_spec(spec_path)
    out: list[str] = []
    for name, st in spec.stages.items():
        fields = type(st.params).model_fields
        sp = getattr(st.params, "sequence_parallel", 1)
        for key, value in BY_KIND.get(st.kind.name, {}).items():
            if key in fields and (st.kind.name, key) not in SKIP and not (sp > 1 and key in NOT_WITH_SP):
                if (st.kind.name, key) == ("long_context", "retrieval_min_tokens"):
                    value = _scaled_min_tokens(st.params, value)
                out.append(f"{name}.{key}={json.dumps(value)}")
        if st.resources.gpus:
            out.append(f"{name}.resources.gpus=0")
            if sp > 1:  # a sequence-parallel group's ranks as CPU processes over gloo
                out.append(f"{name}.processes={sp}")
        out.append(f"{name}.resources.cpus=1")
    # dpo_long reads long prompts only: at 1K-token rows, the spec's 256-token floor leaves few; keep it near
    if "dpo_long" in spec.stages:
        out.append("dpo_long.min_prompt_tokens=96")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, default=SPEC, help="the GPU spec to rehearse (default dags/gpu-recipe.yaml)")
    ap.add_argument("--root", type=Path, help="artifact root (its MLflow store too); default runs/<spec name>-cpu")
    ap.add_argument("--print", action="store_true", help="print the overrides and exit")
    ap.add_argument("--json", type=Path, help="write `hylight run --json` here")
    ap.add_argument("run_args", nargs="*", help="more `hylight run` arguments, e.g. --stage pretrain")
    args = ap.parse_args()
    sets = overrides(args.spec)
    if args.print:
        print("\n".join(sets))
        return 0
    root = args.root or ROOT / "runs" / f"{args.spec.stem}-cpu"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(args.spec), "--set", f"artifact_root={root}"]
    for s in sets:
        cmd += ["--set", s]
    if args.json:
        cmd += ["--json", str(args.json)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.call(cmd + args.run_args, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
