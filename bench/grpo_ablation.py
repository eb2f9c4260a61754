"""Ablation of the §5.4.2 GRPO modifications: the ``grpo`` stage (posttrain/grpo.py) run once with the report's recipe
and once with each modification switched off in turn (plus CISPO and no KL), on the same policy, prompts, reward and
seed. Writes a markdown table: final reward_mean, kl, clip_fraction, eval_pass_rate before/after, seconds.

    OMP_NUM_THREADS=1 python bench/grpo_ablation.py --out /tmp/ablation          # tiny fixture, CPU
    python bench/grpo_ablation.py --checkpoint ART --prompts ART [--reward-model ART] --set max_prompts=256 ...

Without --checkpoint it builds the tests' tiny fixture (random 1M-parameter policy, prompts from the sample corpus)
and a reward model with the reward_model stage (a few steps): the random policy solves nothing, so without the RM
every group's rewards would be equal and every variant would have zero advantages. At this size differences between
variants are mostly noise — read the table as "each switch runs and changes its term", not as evidence for the report.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

VARIANTS: dict[str, dict] = {
    "report (a+b+c)": {},
    "no (a) IS clip of neg. adv.": {"clip_large_ratio_negative_advantage": False},
    "(b) k3 KL instead of sg": {"kl_estimator": "k3"},
    "no (c) balancing": {"balance_advantages": False},
    "no KL (beta=0)": {"beta": 0.0},
    "CISPO (cap 5)": {"loss_type": "cispo"},
}


def _value(text: str):  # noqa: ANN202
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    from pipeline.stage import Artifact, StageContext
    from posttrain.grpo import GRPOParams, run

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--prompts", type=Path)
    p.add_argument("--reward-model", type=Path)
    p.add_argument("--no-reward-model", action="store_true", help="tiny fixture without an RM")
    p.add_argument("--set", action="append", default=[], help="stage param NAME=VALUE (JSON), for every variant")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.checkpoint is None:
        from posttrain.reward_model import RewardModelParams
        from posttrain.reward_model import run as run_rm
        from tests.posttrain_fixtures import build_posttrain_inputs

        tiny = build_posttrain_inputs(a.out / "fixture", documents=40)
        a.checkpoint, a.prompts = tiny.checkpoint, tiny.prompts
        if not a.no_reward_model:
            rm_ctx = StageContext(a.out / "rm", {"checkpoint": tiny.checkpoint_artifact(),
                                                 "prompts": tiny.prompts_artifact()}, stage_name="reward_model")
            run_rm(RewardModelParams(max_steps=8, batch_pairs=8, max_length=192, eval_every=8), rm_ctx)
            a.reward_model = rm_ctx.out_dir
    base = {"keep_unsolved": True, "min_prompts": 8, "max_steps": 8, "learning_rate": 1e-3, "max_prompts": 8,
            "eval_prompts": 16}
    base |= {k: _value(v) for k, v in (s.split("=", 1) for s in a.set)}
    inputs = {"checkpoint": Artifact(a.checkpoint, {"type": "checkpoint", "digest": "c"}),
              "prompts": Artifact(a.prompts, {"type": "prompts", "digest": "p"})}
    if a.reward_model:
        inputs["reward_model"] = Artifact(a.reward_model, {"type": "reward_model", "digest": "r"})
    rows = []
    for name, switches in VARIANTS.items():
        ctx = StageContext(a.out / name.replace(" ", "_").replace("/", "_"), inputs, stage_name="grpo")
        t0 = time.monotonic()
        run(GRPOParams(**(base | switches)), ctx)
        s = ctx.summary
        rew = [v for k, v, _ in ctx.sink.metrics if k == "reward_mean"]
        clip = [v for k, v, _ in ctx.sink.metrics if k == "clip_fraction"]
        rows.append({"variant": name, "reward_mean_first": rew[0], "reward_mean_last": rew[-1],
                     "kl_last": s["kl"], "clip_fraction_max": max(clip), "loss_last": s["loss"],
                     "eval_pass_rate_before": s["eval_pass_rate_before"], "eval_pass_rate": s["eval_pass_rate"],
                     "gen_tokens_per_s": s.get("generation_tokens_per_second_mean", float("nan")),
                     "seconds": time.monotonic() - t0})
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    table = "\n".join(lines)
    (a.out / "ablation.md").write_text(f"params (every variant): {json.dumps(base)}\n\n{table}\n")
    (a.out / "ablation.json").write_text(json.dumps({"params": base, "rows": rows}, indent=2))
    print(table)


if __name__ == "__main__":
    main()
