"""Stage ``grpo``: online reinforcement learning (report §5.4.2; Table 7 stage V) with the modified GRPO of
:mod:`posttrain.grpo_trainer` on TRL's ``GRPOTrainer`` (artifact type ``checkpoint``).

Inputs: ``checkpoint`` (the policy: a DPO, SFT or pretraining checkpoint with ``model/``), ``prompts`` (the prompts
stage's ``rl`` pool: verifiable prompts SFT never saw; its ``eval`` pool gives ``eval_pass_rate``), optionally
``reward_model`` (the helpfulness RM of §5.2).

1. **Rewards** (§5.2 hierarchy, :class:`posttrain.rewards.RewardHierarchy`): one TRL reward function returning each
   completion's ``total`` — the exact checker's correctness first (a correct answer always outranks a wrong one),
   then the constraint rules and the RM's score. The components' batch means are logged as ``reward_correctness``,
   ``reward_constraints`` and (with an RM) ``reward_rm``.
2. **Prompt selection** (§5.4.2 "prioritizes prompts with moderate success rates"): ``selection_k`` samples per
   prompt; a pass is a total ≥ the correctness weight C, i.e. a correct response; prompts with a pass rate in
   ``[pass_rate_lo, pass_rate_hi]`` are kept, the others counted as too easy / too hard. A weak policy (the tiny
   random model passes nothing) would leave no prompt: below ``min_prompts`` kept the stage fails with the counts,
   unless ``keep_unsolved`` is set, which fills up to ``min_prompts`` with too-hard prompts (logged as
   ``prompts_kept_unsolved``).
   On those, every group's correctness is 0 and only the secondary terms (constraint rules, RM) vary: GRPO then
   learns format and length, not correctness — said in the report file.
3. **Training**: :func:`posttrain.grpo_trainer.train_grpo` with the §5.4.2 switches as params. TRL's logs are relayed per
   optimizer step as ``loss``, ``kl``, ``clip_fraction`` (every step) and ``reward_mean``, ``response_length``,
   ``generation_tokens_per_second`` and the reward components (the steps that generate a rollout: every
   ``num_iterations`` steps; TRL reuses a rollout for ``num_iterations`` optimizer steps, the off-policy steps
   where the IS-ratio clipping (a) acts).
4. ``eval_pass_rate``: greedy responses to the held-out ``eval`` pool, exact checkers, at step 0 (the input
   policy), every ``eval_every`` steps and at the last step. Plot ``plots/rl_curves.png``: reward and pass rate.

Output: ``model/`` + ``minimax/`` + ``packing.json`` (:func:`posttrain.policy.save_policy`, the layout of every
training stage), ``rl_report.json`` (prompt accounting, selection pass rates, metrics by step, times, params).

Defaults are sized for the tiny CPU DAG (a few prompts, 4 generations of 16 tokens, 4 steps); docs/notes/rl.md gives
GPU-size settings.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from data.reward_scoring import REWARD_MODEL_DIR
from pipeline.stage import InputSpec, StageContext, StageKind, StageParams
from posttrain.grpo_trainer import (
    GENERATION_THROUGHPUT_METRIC,
    INTERFACE_METRICS,
    HylightGRPOConfig,
    select_prompts_by_pass_rate,
    train_grpo,
)
from posttrain.policy import (
    CHECKPOINT_EVERY_HELP,
    EVAL_BEFORE_HELP,
    MODEL_DIR,
    NO_ACTIVATION_CHECKPOINTING,
    EvalBefore,
    SamplingStats,
    last_checkpoint,
    load_policy,
    pass_rate,
    pass_rate_before,
    publish_policy,
    trainer_checkpointing,
    trainer_log_relay,
    write_pass_rate,
)
from posttrain.prompts import POOLS_DIR, PROMPTS_TYPE, read_pool
from posttrain.report import log_finite_summary, write_report
from posttrain.reward_model import REWARD_MODEL_TYPE
from posttrain.rewards import RewardHierarchy, RewardWeights
from posttrain.sandbox import containment_record
from pretrain.stage import CHECKPOINT_TYPE

REPORT_FILE = "rl_report.json"
COMPONENT_METRICS = {"correctness": "reward_correctness", "constraints": "reward_constraints",
                     "helpfulness_rm": "reward_rm"}
# TRL log key -> the stage's metric name (issue 12's interface names)
RELAYED = {"loss": "loss", **{m: m for m in INTERFACE_METRICS}, GENERATION_THROUGHPUT_METRIC:
           GENERATION_THROUGHPUT_METRIC, **{m: m for m in COMPONENT_METRICS.values()}, "entropy": "entropy",
           "policy_loss": "policy_loss", "kl_loss": "kl_loss", "grad_norm": "grad_norm",
           "learning_rate": "learning_rate"}


class GRPOParams(StageParams):
    seed: int = Field(0, description="Seed of prompt subsampling, selection sampling and training.")
    max_prompts: int = Field(16, ge=1, description=(
        "RL-pool prompts considered (a seeded sample; the rest are counted as over_max_prompts). Tiny-DAG size."))
    eval_prompts: int | None = Field(None, ge=1, description=(
        "First N records of the eval pool for eval_pass_rate; None = all (the same set every stage scores)."))
    eval_max_new_tokens: int = Field(24, ge=1, description="Token budget of the greedy eval_pass_rate responses.")
    eval_every: int = Field(0, ge=0, description="Steps between eval_pass_rate measurements (0: first and last only).")
    eval_before: EvalBefore = Field("measure", description=EVAL_BEFORE_HELP)
    # prompt selection (§5.4.2: moderate success rates)
    selection_k: int = Field(4, ge=1, description="Samples per prompt in the selection pass.")
    pass_rate_lo: float = Field(0.1, ge=0, le=1, description="Keep prompts whose pass rate is at least this...")
    pass_rate_hi: float = Field(0.9, ge=0, le=1, description="...and at most this.")
    min_prompts: int = Field(1, ge=1, description="Fewer prompts selected than this: fail, or see keep_unsolved.")
    keep_unsolved: bool = Field(False, description=(
        "Below min_prompts, fill up to min_prompts with too-hard prompts, in pool order (logged; only the "
        "constraint/RM terms then vary within their groups). Set for a random tiny policy, which solves nothing."))
    # rollout and optimisation
    num_generations: int = Field(4, ge=2, description="Completions per prompt (the GRPO group).")
    prompts_per_step: int = Field(2, ge=1, description="Prompts per rollout batch (x num_generations completions).")
    max_completion_length: int = Field(16, ge=1, description="Generated tokens per completion (tiny-DAG size).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of rollouts and the selection pass.")
    num_iterations: int = Field(2, ge=1, description=(
        "Optimizer steps per rollout (GRPO's mu): steps after the first are off-policy, where (a) acts."))
    max_steps: int = Field(4, ge=1, description="Optimizer steps.")
    checkpoint_every: int = Field(10, ge=0, description=CHECKPOINT_EVERY_HELP)
    learning_rate: float = Field(1e-5, gt=0, description="Peak AdamW learning rate (TRL's default schedule).")
    # the §5.4.2 switches (posttrain/grpo_trainer.py, docs/notes/grpo.md)
    loss_type: Literal["dapo", "cispo"] = Field("dapo", description=(
        "'dapo': the clipped IS objective, token-level; 'cispo': clipped IS-weight policy optimisation."))
    epsilon: float = Field(0.2, gt=0, description="Lower clip edge 1 - epsilon (and upper, unless epsilon_high).")
    epsilon_high: float | None = Field(None, description=(
        "Upper clip edge 1 + epsilon_high (dapo); CISPO's absolute IS-weight cap (None: 5.0 with cispo)."))
    clip_large_ratio_negative_advantage: bool = Field(True, description=(
        "§5.4.2 (a): drop tokens with a negative advantage and an IS ratio above the clip edge."))
    kl_estimator: Literal["stop_gradient", "k3"] = Field("stop_gradient", description="§5.4.2 (b): the KL term.")
    beta: float = Field(0.04, ge=0, description="KL coefficient (0: no reference model, no KL term).")
    balance_advantages: bool = Field(True, description="§5.4.2 (c): balance positive and negative advantages.")
    # reward weights (§5.2 hierarchy; correctness/2 must exceed 2*rm + constraints)
    weight_correctness: float = Field(8.0, gt=0)
    weight_rm: float = Field(1.0, ge=0)
    weight_constraints: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> GRPOParams:
        if self.pass_rate_lo > self.pass_rate_hi:
            raise ValueError(f"pass_rate_lo={self.pass_rate_lo} > pass_rate_hi={self.pass_rate_hi}")
        if self.loss_type == "cispo" and self.epsilon_high is not None and self.epsilon_high <= 1:
            raise ValueError(f"loss_type cispo reads epsilon_high as the absolute cap of the IS weight; "
                             f"{self.epsilon_high} <= 1 (use e.g. 5.0, or leave it unset)")
        RewardWeights(self.weight_correctness, self.weight_rm, self.weight_constraints)  # the hierarchy holds
        return self


# --- rewards for TRL ----------------------------------------------------------------------------------------------
def _text(x: Any) -> str:
    """A prompt or completion as TRL hands it: a string, or (conversational) a list of messages -> the last one's
    content."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and isinstance(x[-1], dict):
        return str(x[-1].get("content", ""))
    raise TypeError(f"grpo reward: cannot read a prompt/completion of type {type(x).__name__}")


class HierarchyReward:
    """A TRL reward function (``f(prompts, completions, completion_ids, **kw) -> list[float]``) scoring each
    completion with the §5.2 hierarchy's ``total``. Prompts are looked up by text in the records given (their
    checker and reference); the components' means go to TRL's ``log_metric`` when TRL passes it."""

    __name__ = "hierarchy"  # TRL names the per-function reward metric after it: rewards/hierarchy/mean

    def __init__(self, records: Sequence[dict[str, Any]], hierarchy: RewardHierarchy) -> None:
        self.by_prompt: dict[str, dict[str, Any]] = {}
        for r in records:
            if r["prompt"] in self.by_prompt and self.by_prompt[r["prompt"]] is not r:
                raise ValueError(f"grpo: two prompt records share one prompt text (ids {self.by_prompt[r['prompt']].get('id')}"
                                 f", {r.get('id')}); the prompts stage deduplicates: is the pool edited by hand?")
            self.by_prompt[r["prompt"]] = r
        self.hierarchy = hierarchy
        self.last: list[Any] = []  # the components of the last call (tests, debugging)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None,
                 log_metric: Any = None, **_: Any) -> list[float]:
        texts = [_text(p) for p in prompts]
        missing = sorted({t for t in texts if t not in self.by_prompt})
        if missing:
            raise KeyError(f"grpo reward: {len(missing)} prompts have no record (first: {missing[0][:80]!r})")
        comps = self.hierarchy.score([self.by_prompt[t] for t in texts], [_text(c) for c in completions])
        self.last = comps
        if log_metric is not None:
            for attr, name in COMPONENT_METRICS.items():
                values = [getattr(c, attr) for c in comps if getattr(c, attr) is not None]
                if values:
                    log_metric(name, sum(values) / len(values))
        return [c.total for c in comps]


def chat(prompt: str) -> list[dict[str, str]]:
    """A prompt as TRL's conversational format (TRL applies the tokenizer's chat template)."""
    return [{"role": "user", "content": prompt}]


# --- selection ----------------------------------------------------------------------------------------------------
def resolve_selection(records: Sequence[dict[str, Any]], pass_rates: Sequence[float], lo: float, hi: float,
                      min_prompts: int, keep_unsolved: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The records to train on and the count of each outcome (``selected``, ``too_easy``, ``too_hard``,
    ``kept_unsolved``; they sum to ``len(records)``). Fewer than ``min_prompts`` selected: ``keep_unsolved`` adds
    too-hard ones, in pool order, up to ``min_prompts`` and no more (the solvable ones stay most of what GRPO trains
    on: an unsolved group teaches format, not correctness); else a ValueError says what happened and what to change."""
    selected = [r for r, p in zip(records, pass_rates, strict=True) if lo <= p <= hi]
    too_hard = [r for r, p in zip(records, pass_rates, strict=True) if p < lo]
    counts = {"selected": len(selected), "too_easy": sum(p > hi for p in pass_rates), "too_hard": len(too_hard),
              "kept_unsolved": 0}
    if len(selected) >= min_prompts:
        return selected, counts
    if keep_unsolved and len(selected) + len(too_hard) >= min_prompts:
        extra = too_hard[:min_prompts - len(selected)]
        counts["kept_unsolved"], counts["too_hard"] = len(extra), len(too_hard) - len(extra)
        return selected + extra, counts
    raise ValueError(
        f"grpo: {len(selected)} of {len(records)} prompts have a pass rate in [{lo}, {hi}] (too easy: "
        f"{counts['too_easy']}, too hard: {counts['too_hard']}), fewer than min_prompts={min_prompts}. Give a "
        "stronger policy or more rl prompts (max_prompts), widen [pass_rate_lo, pass_rate_hi], or set "
        "keep_unsolved: true to train on unsolved prompts (then only the constraint/RM reward terms vary)")


# --- the stage ----------------------------------------------------------------------------------------------------
@dataclass
class RLPrompts:
    """The rl pool, the verifiable records selection considers, what was dropped before selection (by reason), and
    the eval pool with the records ``eval_pass_rate`` scores."""

    pool: list[dict[str, Any]]
    records: list[dict[str, Any]]
    dropped: dict[str, int]
    eval_pool: list[dict[str, Any]]
    eval_records: list[dict[str, Any]]


def rl_prompts(params: GRPOParams, ctx: StageContext) -> RLPrompts:
    """Every rl-pool record is used, or dropped with a counted reason (no checker; beyond a seeded sample of
    ``max_prompts``)."""
    prompts_dir = ctx.input("prompts").path
    pool = read_pool(prompts_dir, "rl", "grpo")
    dropped: dict[str, int] = defaultdict(int)
    verifiable = [r for r in pool if r.get("checker")]
    dropped["no_checker"] = len(pool) - len(verifiable)
    rng = random.Random(params.seed)
    considered = sorted(rng.sample(range(len(verifiable)), min(params.max_prompts, len(verifiable))))
    records = [verifiable[i] for i in considered]
    dropped["over_max_prompts"] = len(verifiable) - len(records)
    eval_pool = read_pool(prompts_dir, "eval", "grpo")
    eval_records = eval_pool[:params.eval_prompts]
    if not records or not eval_records:
        raise ValueError(f"grpo: {len(records)} verifiable rl prompts and {len(eval_records)} eval prompts in "
                         f"{prompts_dir / POOLS_DIR}; both must be non-empty (prompts stage: verifiable counts, "
                         "rl_fraction, eval_fraction)")
    ctx.set_rows("rl_pool_prompts", len(pool))
    ctx.set_rows("eval_prompts", len(eval_records))
    return RLPrompts(pool, records, dropped, eval_pool, eval_records)


class MetricSeries:
    """The stage's metrics as it logs them, kept by name as (step, value) series for the plot and the report."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.ctx.log_metrics(metrics, step=step)
        for k, v in metrics.items():
            self.series[k].append((step, float(v)))

    def restore(self, metrics: dict[str, float], step: int) -> None:  # a resumed attempt's earlier steps, not re-logged
        for k, v in metrics.items():
            self.series[k].append((step, v))

    def last(self, name: str) -> float:
        return self.series[name][-1][1] if self.series.get(name) else math.nan


def eval_pass_rate(model: Any, tokenizer: Any, records: list[dict[str, Any]], max_new_tokens: int,
                   stats: SamplingStats, batch_size: int = 16) -> float:
    """``eval_pass_rate`` of ``model``, decoded in eval mode (its mode is restored), ``batch_size`` prompts a call."""
    was = model.training
    model.eval()
    try:
        rate, _ = pass_rate(model, tokenizer, records, max_new_tokens=max_new_tokens, stats=stats,
                            batch_size=batch_size)
    finally:
        model.train(was)
    return rate


def train(params: GRPOParams, ctx: StageContext, policy: Any, tokenizer: Any, records: list[dict[str, Any]],
          reward: HierarchyReward, series: MetricSeries, measure: Callable[[Any], float]) -> tuple[dict[str, Any],
                                                                                                float]:
    """:func:`posttrain.grpo_trainer.train_grpo` with the §5.4.2 switches, TRL's logs relayed into ``series``,
    ``measure`` (the eval pass rate) every ``eval_every`` steps; resumes from the last mid-training checkpoint of a
    killed attempt. (train_grpo's result, training seconds)."""
    on_gpu = torch.cuda.is_available()

    def pass_rate_every(state: Any, model: Any) -> None:
        if params.eval_every and state.global_step % params.eval_every == 0 and state.global_step < state.max_steps:
            series.log({"eval_pass_rate": measure(model)}, state.global_step)

    relay = trainer_log_relay(ctx, RELAYED, log=series.log, shown=("loss", "reward_mean", "kl", "clip_fraction"),
                              on_step_end=pass_rate_every, restore=series.restore)

    eps_high = params.epsilon_high if params.epsilon_high is not None else (5.0 if params.loss_type == "cispo"
                                                                              else params.epsilon)
    config = HylightGRPOConfig(
        max_steps=params.max_steps, learning_rate=params.learning_rate, **trainer_checkpointing(ctx, params.checkpoint_every),
        per_device_train_batch_size=params.prompts_per_step * params.num_generations,
        num_generations=params.num_generations, max_completion_length=params.max_completion_length,
        temperature=params.temperature, num_iterations=params.num_iterations, loss_type=params.loss_type,
        epsilon=params.epsilon, epsilon_high=eps_high, beta=params.beta, kl_estimator=params.kl_estimator,
        clip_large_ratio_negative_advantage=params.clip_large_ratio_negative_advantage,
        balance_advantages=params.balance_advantages, seed=params.seed, logging_steps=1,
        report_to="none", disable_tqdm=True, use_cpu=not on_gpu, bf16=on_gpu,  # the stage's GPU when it has one
        gradient_checkpointing=NO_ACTIVATION_CHECKPOINTING, dataloader_num_workers=0)
    t0 = time.monotonic()
    result = train_grpo(policy, tokenizer, [chat(r["prompt"]) for r in records], [reward], config,
                        ctx.work_dir / "grpo", callbacks=[relay],
                        resume_from_checkpoint=last_checkpoint(ctx, config))
    return result, time.monotonic() - t0


def _plot(ctx: StageContext, series: dict[str, list[tuple[int, float]]]) -> None:
    import matplotlib  # heavy: matplotlib (a plot at the end of a run)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name in ("reward_mean", "reward_correctness", "reward_constraints", "reward_rm"):
        if series.get(name):
            a.plot(*zip(*series[name], strict=True), marker="o", label=name)
    a.set(xlabel="step", ylabel="reward", title="rollout rewards")
    a.legend(fontsize=8)
    if series.get("eval_pass_rate"):
        b.plot(*zip(*series["eval_pass_rate"], strict=True), marker="o")
    b.set(xlabel="step", ylabel="eval_pass_rate", ylim=(-0.05, 1.05), title="held-out pass rate (greedy)")
    ctx.log_figure(fig, "rl_curves.png")


def run(params: GRPOParams, ctx: StageContext) -> None:
    containment_record()  # this stage's sandbox runs only (a Ray worker may have run another)
    start = time.monotonic()
    checkpoint = ctx.input("checkpoint").path
    rm_art = ctx.inputs.get("reward_model")
    rm_dir = rm_art.path / REWARD_MODEL_DIR if rm_art is not None and not isinstance(rm_art, list) else None
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    prompts = rl_prompts(params, ctx)

    policy, tok = load_policy(checkpoint, device=device)  # fp32 master weights; bf16 autocast on GPU (TRL)
    weights = RewardWeights(params.weight_correctness, params.weight_rm, params.weight_constraints)
    reward = HierarchyReward(prompts.records, RewardHierarchy(weights, reward_model_dir=rm_dir, device=device))
    eval_stats = SamplingStats()
    # the eval decodes as many rows a call as a rollout does (prompts_per_step x num_generations): on a GPU the fast
    # path's decode step is compiled per batch size, so one size serves both (as SFT and DPO use their sampling one)
    measure = functools.partial(eval_pass_rate, tokenizer=tok, records=prompts.eval_records,
                                max_new_tokens=params.eval_max_new_tokens, stats=eval_stats,
                                batch_size=params.prompts_per_step * params.num_generations)
    series = MetricSeries(ctx)
    eval_id = {"max_new_tokens": params.eval_max_new_tokens, "prompts_digest": ctx.input("prompts").digest}
    before, before_from = pass_rate_before(params.eval_before, checkpoint, prompts.eval_records, **eval_id,
                                           progress=ctx.progress, measure=lambda: measure(policy))
    series.log({"eval_pass_rate": before}, 0)
    if before_from == "measured":  # pass_rate_before said where a read one came from
        ctx.progress(f"eval_pass_rate before: {before:.3f} on {len(prompts.eval_records)} held-out prompts")

    # §5.4.2 prompt selection by a sampling pass
    t0 = time.monotonic()
    sel = select_prompts_by_pass_rate(policy, tok, [chat(r["prompt"]) for r in prompts.records], [reward],
                                      k=params.selection_k, lo=params.pass_rate_lo, hi=params.pass_rate_hi,
                                      pass_threshold=weights.correctness, max_new_tokens=params.max_completion_length,
                                      temperature=params.temperature, seed=params.seed)
    selection_seconds = time.monotonic() - t0
    train_records, counts = resolve_selection(prompts.records, sel.pass_rates, params.pass_rate_lo,
                                              params.pass_rate_hi, params.min_prompts, params.keep_unsolved)
    counts_log = {f"prompts_{k}": v for k, v in counts.items()} | {f"prompts_dropped_{k}": v
                                                                   for k, v in prompts.dropped.items()}
    ctx.log_metrics(counts_log | {"selection_generate_seconds": sel.generate_seconds,
                                  "selection_reward_seconds": sel.reward_seconds})
    for k, v in counts_log.items():
        ctx.set_rows(k, v)
    assert sum(counts.values()) + sum(prompts.dropped.values()) == len(prompts.pool), (counts, prompts.dropped,
                                                                                       len(prompts.pool))
    ctx.progress(f"selection ({params.selection_k} samples/prompt, {selection_seconds:.1f} s: sampling "
                 f"{sel.generate_seconds:.1f} s, rewards {sel.reward_seconds:.1f} s): {counts}; "
                 f"dropped before selection: {dict(prompts.dropped)}")

    result, train_seconds = train(params, ctx, policy, tok, train_records, reward, series, measure)
    steps = result["steps"]
    trained, _ = load_policy(result["policy_dir"], device=device)
    after = measure(trained)
    series.log({"eval_pass_rate": after}, steps)
    ctx.progress(f"eval_pass_rate after {steps} steps: {after:.3f} (before {before:.3f})")

    publish_policy(trained, checkpoint / MODEL_DIR, checkpoint, ctx.out_dir)
    write_pass_rate(ctx.out_dir, after, prompts.eval_records, **eval_id, stage=ctx.stage_name,
                    before=(before, before_from))
    _plot(ctx, series.series)
    _report(params, ctx, prompts, counts, sel.pass_rates, train_records, series, weights, rm_dir, eval_stats,
            eval_pass=(before, after), steps=steps, seconds=(selection_seconds, train_seconds), start=start)


def _report(params: GRPOParams, ctx: StageContext, prompts: RLPrompts, counts: dict[str, int],
            pass_rates: Sequence[float], train_records: list[dict[str, Any]], series: MetricSeries,
            weights: RewardWeights, rm_dir: Path | None, eval_stats: SamplingStats, *, eval_pass: tuple[float, float],
            steps: int, seconds: tuple[float, float], start: float) -> None:
    """The summary metrics and ``rl_report.json``. ``seconds``: (selection, training)."""
    before, after = eval_pass
    selection_seconds, train_seconds = seconds
    last = series.last
    gen = [v for _, v in series.series.get(GENERATION_THROUGHPUT_METRIC, [])]
    stage_seconds = time.monotonic() - start
    summary = {"eval_pass_rate": after, "eval_pass_rate_before": before, "loss": last("loss"),
               "reward_mean": last("reward_mean"), "kl": last("kl"), "clip_fraction": last("clip_fraction"),
               "response_length": last("response_length"),
               "generation_tokens_per_second_mean": sum(gen) / len(gen) if gen else math.nan,
               "eval_tokens_per_second": eval_stats.tokens_per_second, "train_prompts": len(train_records),
               "steps": steps, "selection_seconds": selection_seconds, "train_seconds": train_seconds,
               "stage_seconds": stage_seconds}
    log_finite_summary(ctx, summary)
    report = {
        "params": params.model_dump(), "steps": steps, "summary": summary,
        "prompts": {"rl_pool": len(prompts.pool), "dropped_before_selection": dict(prompts.dropped),
                    "selection": counts,
                    "pass_rates": {r.get("id", str(i)): p for i, (r, p) in enumerate(zip(prompts.records, pass_rates,
                                                                                          strict=True))},
                    "trained_on": [r.get("id") for r in train_records], "eval_scored": len(prompts.eval_records),
                    "eval_not_scored": len(prompts.eval_pool) - len(prompts.eval_records)},
        "metrics_by_step": {k: v for k, v in series.series.items()},
        "reward_weights": {"correctness": weights.correctness, "rm": weights.helpfulness_rm,
                           "constraints": weights.constraints, "pass_threshold": weights.correctness},
        "reward_model": str(rm_dir) if rm_dir else None,
        "notes": {
            "kept_unsolved": "prompts no selection sample solved, trained on because keep_unsolved is set: their "
                             "groups' correctness is all 0, so only the constraint/RM terms give advantages",
            "generation_tokens_per_second": "generated tokens (to each completion's first EOS) / wall seconds of "
                                            "TRL's rollout generate (HylightGRPOTrainer._generate_single_turn)",
            "eval_pass_rate": "greedy responses to the first eval_prompts eval-pool prompts, exact checkers"},
    }
    write_report(ctx, ctx.out_dir / REPORT_FILE, report, "grpo", default=float)
    ctx.progress(f"done in {stage_seconds:.1f} s (selection {selection_seconds:.1f} s, training {train_seconds:.1f} s)")


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("rl_report.json", "plots/*"),
    name="grpo",
    params=GRPOParams,
    run=run,
    produces=CHECKPOINT_TYPE,
    inputs={
        "checkpoint": InputSpec(CHECKPOINT_TYPE, doc="the policy to train (DPO, SFT or pretraining checkpoint)"),
        "prompts": InputSpec(PROMPTS_TYPE, doc="the prompts stage: rl pool (training) and eval pool (pass rate)"),
        "reward_model": InputSpec(REWARD_MODEL_TYPE, required=False,
                                  doc="the §5.2 helpfulness reward model (the reward_rm term)"),
    },
    doc="§5.4.2 online RL (Table 7 stage V): the modified GRPO on TRL (IS-ratio clipping of negative-advantage "
        "tokens, stop-gradient KL, balanced advantages; CISPO as loss_type) on rl-pool prompts of moderate pass "
        "rate, rewarded by the §5.2 hierarchy (exact checkers first, constraint rules, optional RM); logs loss, "
        "reward_mean, kl, clip_fraction, response_length, generation_tokens_per_second and eval_pass_rate.",
)
