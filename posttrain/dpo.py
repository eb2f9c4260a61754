"""Stage ``dpo``: offline RL by Direct Preference Optimization (report §5.4.1) on TRL's ``DPOTrainer``; with a short
``max_length`` it is Table 7's stage III, with a long one (and long prompts) stage IV. Produces a checkpoint.

Pairs (§5.4.1: "generating responses with varying temperature parameters for each prompt, followed by systematic
evaluation using the reward models ... the best and the worst responses"): for each prompt of the ``dpo`` pool (SFT
prompts, which §5.4.1 found as good as unseen ones) the input policy samples ``samples_per_temperature`` responses
at each of ``temperatures`` (:func:`posttrain.policy.sample_responses`); :class:`posttrain.rewards.RewardHierarchy`
scores each (exact checker, optional reward model, rule checks); chosen = the best total, rejected = the worst
(:func:`select_pair`). Every prompt of the pool is accounted for: a pair, or skipped with one of
:data:`SKIP_REASONS`. Pairs are split train / held out by a hash of (seed, the prompt's group) (:func:`is_heldout`):
a prompt, and a group of prompts sharing a passage or code function, is on one side only.

Training: ``DPOTrainer`` with the policy and a frozen reference, both loaded by :func:`posttrain.policy.load_policy`,
so both run the MoE **dropless** — with capacity drop a sequence's log-probs would depend on the other sequences of
its batch (tests/test_dpo.py shows it) and π/π_ref would be compared on different routings. Loss ``loss_type``
(default TRL's ``sigmoid``: -log σ(β·((log π_c − log π_ref,c) − (log π_r − log π_ref,r)))) plus the config's
``router_aux_loss_coef`` × the policy's own MoE balance loss (§2.1; :mod:`posttrain.moe_loss`, in place of TRL's).
Schedule: Table 7 (stage III cosine 5e-7 → 5e-8, stage IV constant 5e-7; batch 64 pairs; one epoch).

Metrics: ``loss`` (every step), ``train_preference_accuracy`` / ``reward_margin`` (TRL's ``rewards/accuracies`` /
``rewards/margins`` on the training batch), ``eval_preference_accuracy`` on every held-out pair at step 0, every
``eval_every`` steps and at the last step: the share of pairs whose implicit reward β·(log π − log π_ref) is higher
for chosen, **ties counting 1/2** — at step 0 π = π_ref, every implicit reward is exactly 0 (the same function on
the same weights) and the accuracy is exactly 0.5. ``eval_pass_rate`` (the ``eval`` pool, greedy) before (step 0)
and after (last step), ``dpo_pairs``, ``generation_tokens_per_second``, ``generation_padding_waste``,
``skipped.<reason>``.

Output: the checkpoint (``model/``, ``minimax/``, tokenizer, the base ``packing.json``: :func:`save_policy`),
``pairs/{train,heldout}.jsonl`` (prompt, both responses, their temperatures and reward components),
``pairs/skipped.jsonl`` (id and reason of every prompt without a pair), ``dpo_report.json``, ``plots/loss.png``.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from data.reward_scoring import REWARD_MODEL_DIR
from pipeline.artifacts import write_jsonl_atomic
from pipeline.stage import InputSpec, StageContext, StageKind, StageParams
from posttrain.policy import (
    CHECKPOINT_EVERY_HELP,
    EVAL_BEFORE_HELP,
    MODEL_DIR,
    NO_ACTIVATION_CHECKPOINTING,
    EvalBefore,
    SamplingStats,
    Temperatures,
    chat_prompt,
    last_checkpoint,
    load_policy,
    pass_rate,
    pass_rate_before,
    publish_policy,
    sample_responses,
    train_from_checkpoint,
    trainer_checkpointing,
    trainer_log_relay,
    write_pass_rate,
)
from posttrain.prompts import PROMPTS_TYPE, read_pool, split_group
from posttrain.report import log_finite_summary, loss_figure, write_report
from posttrain.reward_model import REWARD_MODEL_TYPE, pairwise_accuracy
from posttrain.rewards import RewardComponents, RewardHierarchy
from posttrain.sandbox import containment_record
from pretrain.stage import CHECKPOINT_TYPE

PAIRS_DIR = "pairs"
REPORT_FILE = "dpo_report.json"
SKIP_REASONS = {
    "over_max_prompts": "beyond max_prompts prompts that pass the length filters (a seeded hash order)",
    "prompt_too_long": "the chat-formatted prompt alone has max_length tokens or more: no room for a response",
    "prompt_too_short": "fewer than min_prompt_tokens tokens (stage IV keeps long-context prompts only)",
    "identical_responses": "every sampled response has the same text: nothing to prefer",
    "margin_below_min": "best and worst reward totals differ by min_margin or less",
}


class DPOParams(StageParams):
    seed: int = Field(0, description="Seed of prompt order, sampling, the held-out split and the data order.")
    max_prompts: int = Field(24, ge=1, description=(
        "dpo-pool prompts sampled, of those that pass the length filters (min_prompt_tokens, max_length), in a seeded "
        "order; the rest are counted as skipped over_max_prompts. Sized for the tiny DAG."))
    temperatures: Temperatures = Field(default_factory=lambda: [0.3, 0.7, 1.1], description=(
        "Sampling temperatures (§5.4.1 'varying temperature parameters'); 0 = one greedy response."))
    samples_per_temperature: int = Field(2, ge=1, description="Responses per prompt at each temperature.")
    max_new_tokens: int = Field(24, ge=1, description="Response length cap when sampling. Sized for the tiny DAG.")
    sample_batch_size: int = Field(16, ge=1, description="Prompts per generate() batch.")
    min_margin: float = Field(0.0, ge=0, description=(
        "Prompts whose best and worst reward totals differ by this much or less make no pair."))
    min_prompt_tokens: int = Field(0, ge=0, description=(
        "Prompts shorter than this (chat-formatted tokens) are skipped: stage IV trains on long-context prompts."))
    heldout_fraction: float = Field(0.25, gt=0, lt=1, description="Share of prompt groups whose pairs are held out.")
    beta: float = Field(0.1, gt=0, description="DPO β (TRL's default; the report gives none).")
    loss_type: str = Field("sigmoid", description="TRL DPO loss_type (sigmoid = the DPO paper's loss).")
    learning_rate: float = Field(5e-7, gt=0, description="Peak learning rate (Table 7: 5e-7 for stages III and IV).")
    lr_schedule: Literal["cosine", "constant"] = Field("cosine", description=(
        "Table 7: stage III cosine, stage IV constant."))
    min_learning_rate: float = Field(5e-8, ge=0, description="Floor of the cosine schedule (Table 7 stage III: 5e-8).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    max_length: int = Field(256, ge=8, description=(
        "Tokens of prompt + response in training (Table 7: 8192 in stage III, 1032192 in stage IV); longer pairs "
        "are cut at the end (counted as truncated_pairs)."))
    max_steps: int = Field(8, ge=1, description="Optimizer steps (Table 7: one epoch of the pairs).")
    checkpoint_every: int = Field(10, ge=0, description=CHECKPOINT_EVERY_HELP)
    batch_pairs: int = Field(4, ge=1, description="Pairs per device per micro-batch.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per step (Table 7 batch: 64 pairs).")
    eval_every: int = Field(4, ge=1, description="Steps between held-out preference accuracy evaluations.")
    eval_batch_sequences: int = Field(16, ge=1, description="Sequences per forward when scoring held-out pairs.")
    eval_prompts: int | None = Field(None, ge=1, description=(
        "First N records of the eval pool for eval_pass_rate; None = all (the same set every stage scores)."))
    eval_max_new_tokens: int = Field(24, ge=1, description="Greedy response cap of eval_pass_rate.")
    eval_before: EvalBefore = Field("measure", description=EVAL_BEFORE_HELP)


# --- pairs --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairChoice:
    """The outcome for one prompt: the chosen and rejected sample indices, or the reason there is no pair."""

    chosen: int | None
    rejected: int | None
    skip: str | None = None


def select_pair(texts: Sequence[str], rewards: Sequence[RewardComponents], min_margin: float) -> PairChoice:
    """Best total = chosen, worst total = rejected (the first sample of each on ties); no pair when all texts are
    identical or ``best - worst <= min_margin`` (so equal totals never make a pair)."""
    if len(texts) != len(rewards) or not texts:
        raise ValueError(f"select_pair: {len(texts)} responses and {len(rewards)} rewards")
    if len(set(texts)) == 1:
        return PairChoice(None, None, "identical_responses")
    totals = [r.total for r in rewards]
    best = max(range(len(totals)), key=lambda i: (totals[i], -i))
    worst = min(range(len(totals)), key=lambda i: (totals[i], i))
    if totals[best] - totals[worst] <= min_margin:
        return PairChoice(None, None, "margin_below_min")
    return PairChoice(best, worst)


def _unit_hash(*parts: Any) -> float:
    h = hashlib.sha256("\0".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def is_heldout(record: dict[str, Any], seed: int, fraction: float) -> bool:
    """Deterministic held-out membership of a prompt, by its group (posttrain.prompts.split_group: the prompt id, or
    the passage / code function it shares with others), so no group has pairs on both sides."""
    return _unit_hash("dpo-heldout", seed, split_group(record)) < fraction


def prompt_order(records: Sequence[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """The pool in a seeded hash order (max_prompts takes a prefix: a uniform, reproducible subset)."""
    return sorted(records, key=lambda r: (_unit_hash("dpo-order", seed, r["id"]), r["id"]))


# --- sequence log-probs and the implicit reward -------------------------------------------------------------------
def encode_pair_side(tokenizer: Any, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) as TRL's DPOTrainer tokenizes a conversational example: the prompt with the
    assistant header, and the rest of the full conversation after their common prefix."""
    user = [{"role": "user", "content": prompt}]
    p = list(tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True, return_dict=True)
             ["input_ids"])
    full = list(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=True,
                                              return_dict=True)["input_ids"])
    n = 0
    while n < min(len(p), len(full)) and p[n] == full[n]:
        n += 1
    return p[:n], full[n:]


def completion_logps(model: Any, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
                     batch_size: int = 16, max_length: int | None = None) -> list[float]:
    """Σ log π(completion token | prefix) of each (prompt ids, completion ids), cut to ``max_length`` tokens as TRL
    cuts (keep the start). Right-padded batches of similar length, no gradient, the model's current mode."""
    import torch  # heavy: torch

    seqs = [(list(p) + list(c), len(p)) for p, c in sequences]
    if max_length is not None:
        seqs = [(ids[:max_length], n) for ids, n in seqs]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    out = [0.0] * len(seqs)
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            width = max(len(seqs[i][0]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, :len(seqs[i][0])] = torch.tensor(seqs[i][0])
                mask[row, :len(seqs[i][0])] = 1
            ids, mask = ids.to(device), mask.to(device)
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            for row, i in enumerate(idx):
                n_prompt, n = seqs[i][1], len(seqs[i][0])
                out[i] = float(logp[row, n_prompt - 1:n - 1].sum()) if n > n_prompt else 0.0
    return out


def implicit_rewards(beta: float, policy_logps: Sequence[float], ref_logps: Sequence[float]) -> list[float]:
    """β·(log π − log π_ref) of each sequence (the DPO implicit reward)."""
    return [beta * (p - r) for p, r in zip(policy_logps, ref_logps, strict=True)]


def preference_accuracy(beta: float, chosen_logps: Sequence[float], rejected_logps: Sequence[float],
                        ref_chosen_logps: Sequence[float], ref_rejected_logps: Sequence[float]) -> float:
    """``eval_preference_accuracy``: the share of pairs whose implicit reward ranks chosen above rejected, ties 1/2
    (so π = π_ref gives exactly 0.5; TRL's training ``rewards/accuracies`` counts ties as 0)."""
    return pairwise_accuracy(implicit_rewards(beta, chosen_logps, ref_chosen_logps),
                             implicit_rewards(beta, rejected_logps, ref_rejected_logps))


# --- the stage ----------------------------------------------------------------------------------------------------
FEW_HELDOUT_PAIRS = 10  # fewer held-out pairs than this: the stage warns that its accuracy says little


def sample_by_length(records: Sequence[dict[str, Any]], prompt_tokens: Callable[[dict[str, Any]], int],
                     max_prompts: int, min_tokens: int, max_length: int
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(candidates, skipped): the first ``max_prompts`` records, in their given order, whose prompt has at least
    ``min_tokens`` and fewer than ``max_length`` tokens; every other record once in ``skipped`` with its reason.

    The length filter comes before the sample, so a stage that keeps long prompts only (stage IV) still gets
    ``max_prompts`` of them: sampling first, the sixth and seventh leases' dpo_long kept 19 of 96 and had one
    held-out pair."""
    candidates: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for rec in records:
        if len(candidates) >= max_prompts:
            skipped.append({"id": rec["id"], "reason": "over_max_prompts"})
            continue
        n = prompt_tokens(rec)
        if n >= max_length:
            skipped.append({"id": rec["id"], "reason": "prompt_too_long", "prompt_tokens": n})
        elif n < min_tokens:
            skipped.append({"id": rec["id"], "reason": "prompt_too_short", "prompt_tokens": n})
        else:
            candidates.append(rec)
    return candidates, skipped


def build_pairs(params: DPOParams, ctx: StageContext, model: Any, tokenizer: Any, scorer: Any,
                stats: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pairs, skipped): one pair row or one skipped row for every dpo-pool prompt."""
    records = prompt_order(read_pool(ctx.input("prompts").path, "dpo", "dpo"), params.seed)
    candidates, skipped = sample_by_length(
        records, lambda rec: len(tokenizer(chat_prompt(tokenizer, rec["prompt"]), add_special_tokens=False).input_ids),
        params.max_prompts, params.min_prompt_tokens, params.max_length)
    ctx.progress(f"sampling {len(candidates)} prompts x {len(params.temperatures)} temperatures x "
                 f"{params.samples_per_temperature} (max {params.max_new_tokens} new tokens)")
    samples = sample_responses(model, tokenizer, [r["prompt"] for r in candidates], temperatures=params.temperatures,
                               samples_per_temperature=params.samples_per_temperature,
                               max_new_tokens=params.max_new_tokens, batch_size=params.sample_batch_size,
                               seed=params.seed, stats=stats, progress=ctx.progress)
    flat_records = [rec for rec, ss in zip(candidates, samples, strict=True) for _ in ss]
    rewards = scorer.score(flat_records, [s.text for ss in samples for s in ss])
    ctx.progress(f"scored {len(flat_records)} samples: {scorer.timing()}")
    pairs, at = [], 0
    for rec, ss in zip(candidates, samples, strict=True):
        rw, at = rewards[at:at + len(ss)], at + len(ss)
        choice = select_pair([s.text for s in ss], rw, params.min_margin)
        if choice.skip:
            skipped.append({"id": rec["id"], "reason": choice.skip, "totals": [r.total for r in rw]})
            continue
        c, r = ss[choice.chosen], ss[choice.rejected]
        pairs.append({
            "id": rec["id"], "prompt": rec["prompt"], "task_type": rec.get("task_type"),
            "split": "heldout" if is_heldout(rec, params.seed, params.heldout_fraction) else "train",
            "chosen": c.text, "rejected": r.text, "chosen_temperature": c.temperature,
            "rejected_temperature": r.temperature, "chosen_finished": c.finished, "rejected_finished": r.finished,
            "chosen_reward": rw[choice.chosen].as_json(), "rejected_reward": rw[choice.rejected].as_json(),
            "margin": rw[choice.chosen].total - rw[choice.rejected].total, "samples": len(ss)})
    if len(pairs) + len(skipped) != len(records):  # every prompt is a pair or a counted skip
        raise AssertionError(f"dpo: {len(records)} prompts but {len(pairs)} pairs + {len(skipped)} skipped")
    return pairs, skipped


def save_pairs(params: DPOParams, ctx: StageContext, pairs: list[dict[str, Any]], skipped: list[dict[str, Any]],
               stats: SamplingStats) -> tuple[dict[str, list[dict[str, Any]]], Counter]:
    """``pairs/{train,heldout,skipped}.jsonl`` and the pair counts as metrics; (pairs by split, skips by reason).
    Both splits must hold a pair."""
    split = {s: [p for p in pairs if p["split"] == s] for s in ("train", "heldout")}
    (ctx.out_dir / PAIRS_DIR).mkdir(exist_ok=True)
    for s, rows in split.items():
        write_jsonl_atomic(ctx.out_dir / PAIRS_DIR / f"{s}.jsonl", rows)
        ctx.set_rows(f"{s}_pairs", len(rows))
    write_jsonl_atomic(ctx.out_dir / PAIRS_DIR / "skipped.jsonl", skipped)
    skip_counts = Counter(s["reason"] for s in skipped)
    ctx.log_metrics({"dpo_pairs": len(pairs), "dpo_pairs_train": len(split["train"]),
                     "dpo_pairs_heldout": len(split["heldout"]),
                     "generation_tokens_per_second": stats.tokens_per_second,
                     **({} if math.isnan(stats.padding_waste) else
                        {"generation_padding_waste": stats.padding_waste}),
                     **{f"skipped.{k}": skip_counts.get(k, 0) for k in SKIP_REASONS}})
    ctx.progress(f"pairs: {len(split['train'])} train, {len(split['heldout'])} held out; skipped {dict(skip_counts)}; "
                 f"{stats.tokens} tokens sampled at {stats.tokens_per_second:.0f} tokens/s")
    if not split["train"] or not split["heldout"]:
        raise ValueError(f"dpo: {len(split['train'])} train and {len(split['heldout'])} held-out pairs from "
                         f"{len(pairs) + len(skipped)} dpo-pool prompts (skipped: {dict(skip_counts)}); both must be "
                         "non-empty: raise max_prompts or samples_per_temperature, lower min_margin, or change "
                         "heldout_fraction")
    if len(split["heldout"]) < FEW_HELDOUT_PAIRS:
        ctx.progress(f"warning: only {len(split['heldout'])} held-out pairs: eval_preference_accuracy moves in steps "
                     f"of {1 / len(split['heldout']):.2f} and says little; raise max_prompts for a measurement")
    return split, skip_counts


class HeldoutPreference:
    """``eval_preference_accuracy`` and ``eval_reward_margin`` of a policy on the held-out pairs (encoded as TRL
    encodes them), against the log-probs of the reference: the policy given at construction, as it is then."""

    def __init__(self, params: DPOParams, reference: Any, pad_id: int,
                 chosen: list[tuple[list[int], list[int]]], rejected: list[tuple[list[int], list[int]]]) -> None:
        self.params, self.pad_id, self.chosen, self.rejected = params, pad_id, chosen, rejected
        self.ref_c, self.ref_r = self.logps(reference)

    def logps(self, m: Any) -> tuple[list[float], list[float]]:
        lp = completion_logps(m, self.chosen + self.rejected, self.pad_id, self.params.eval_batch_sequences,
                              self.params.max_length)
        return lp[:len(self.chosen)], lp[len(self.chosen):]

    def __call__(self, m: Any) -> tuple[float, float]:
        """(accuracy, mean implicit reward margin) of ``m``, scored in eval mode (its mode is restored)."""
        beta = self.params.beta
        was_training = m.training
        m.eval()
        c, r = self.logps(m)
        m.train(was_training)
        margins = [a - b for a, b in zip(implicit_rewards(beta, c, self.ref_c),
                                         implicit_rewards(beta, r, self.ref_r), strict=True)]
        return preference_accuracy(beta, c, r, self.ref_c, self.ref_r), sum(margins) / len(margins)


def trainer_class() -> type:
    """The trainer this stage trains with: TRL's ``DPOTrainer`` with the model's own MoE balance loss (§2.1) in
    place of TRL's (:mod:`posttrain.moe_loss`)."""
    from trl import DPOTrainer  # heavy: trl

    from posttrain.moe_loss import model_balance_trainer  # heavy: torch

    return model_balance_trainer(DPOTrainer)


def train_dpo(params: DPOParams, ctx: StageContext, model: Any, tokenizer: Any, checkpoint: Path,
              train_pairs: list[dict[str, Any]], encoded: dict[str, Any],
              heldout: HeldoutPreference) -> tuple[Any, list[tuple[int, float]], float]:
    """TRL's DPOTrainer against a frozen reference copy of ``checkpoint``, dropless like the policy (load_policy),
    with the held-out preference accuracy every ``eval_every`` steps; resumes from the last mid-training checkpoint
    of a killed attempt. (trainer, (step, loss) history, training seconds)."""
    import torch  # heavy: torch
    from datasets import Dataset  # heavy: datasets
    from transformers import PrinterCallback  # heavy: transformers
    from trl import DPOConfig  # heavy: trl

    ref_model, _ = load_policy(checkpoint)
    relayed = {"loss": "loss", "rewards/accuracies": "train_preference_accuracy", "rewards/margins": "reward_margin",
               "grad_norm": "grad_norm", "learning_rate": "learning_rate"}
    def heldout_every(state: Any, trained: Any) -> None:  # the held-out preference accuracy every eval_every steps
        if state.global_step % params.eval_every == 0 and state.global_step != state.max_steps:
            acc, margin = heldout(trained)
            ctx.log_metrics({"eval_preference_accuracy": acc, "eval_reward_margin": margin}, step=state.global_step)

    relay = trainer_log_relay(ctx, relayed, on_step_end=heldout_every)

    schedule = ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": params.min_learning_rate}}
                if params.lr_schedule == "cosine" else
                {"lr_scheduler_type": "constant_with_warmup" if params.warmup_steps else "constant"})
    config = DPOConfig(
        max_steps=params.max_steps, beta=params.beta, **trainer_checkpointing(ctx, params.checkpoint_every),
        loss_type=[params.loss_type], learning_rate=params.learning_rate, warmup_steps=params.warmup_steps, **schedule,
        per_device_train_batch_size=params.batch_pairs, gradient_accumulation_steps=params.gradient_accumulation_steps,
        max_length=params.max_length, logging_steps=1, eval_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),  # the stage's GPU when it has one
        seed=params.seed, disable_tqdm=True, dataloader_num_workers=0,
        gradient_checkpointing=NO_ACTIVATION_CHECKPOINTING)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p["prompt"]}],
                                  "chosen": [{"role": "assistant", "content": p["chosen"]}],
                                  "rejected": [{"role": "assistant", "content": p["rejected"]}]}
                                 for p in train_pairs])
    model.train()
    trainer = trainer_class()(model=model, ref_model=ref_model, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[relay])
    trainer.remove_callback(PrinterCallback)  # the relay reports
    trl_rows = trainer.train_dataset
    if len(trl_rows) != len(train_pairs):
        raise RuntimeError(f"dpo: TRL kept {len(trl_rows)} of {len(train_pairs)} train pairs (prompts that fill "
                           "max_length should have been skipped as prompt_too_long)")
    for p, row in zip(train_pairs, trl_rows, strict=True):  # the held-out metric scores what TRL trains on
        (cp, cc), (_, rc) = encoded[p["id"]]
        if (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) != (cp, cc, rc):
            raise RuntimeError(f"dpo: pair {p['id']!r} tokenizes differently in TRL than in encode_pair_side; the "
                               "held-out preference accuracy would score other sequences than training uses")
    train_start = time.monotonic()
    train_from_checkpoint(trainer, last_checkpoint(ctx, config))
    return trainer, relay.losses, time.monotonic() - train_start


def run(params: DPOParams, ctx: StageContext) -> None:
    containment_record()  # this stage's sandbox runs only (a Ray worker may have run another)
    start = time.monotonic()
    import torch  # heavy: torch

    torch.manual_seed(params.seed)
    ckpt = ctx.input("checkpoint").path
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, tok = load_policy(ckpt, device=device)
    rm = ctx.inputs.get("reward_model")
    scorer = RewardHierarchy(reward_model_dir=rm.path / REWARD_MODEL_DIR if rm is not None else None, device=device)

    # 1. pairs (§5.4.1): sample at several temperatures, score, best vs worst
    stats = SamplingStats()
    pairs, skipped = build_pairs(params, ctx, model, tok, scorer, stats)
    split, skip_counts = save_pairs(params, ctx, pairs, skipped, stats)

    # every pair tokenized as TRL tokenizes it (checked against TRL's own in train_dpo); held-out reference
    # log-probs once
    encoded = {p["id"]: (encode_pair_side(tok, p["prompt"], p["chosen"]), encode_pair_side(tok, p["prompt"], p["rejected"]))
               for p in pairs}
    truncated = sum(len(c[0]) + max(len(c[1]), len(r[1])) > params.max_length for c, r in encoded.values())
    model.eval()
    heldout = HeldoutPreference(params, model, tok.pad_token_id, [encoded[p["id"]][0] for p in split["heldout"]],
                                [encoded[p["id"]][1] for p in split["heldout"]])
    eval_records = read_pool(ctx.input("prompts").path, "eval", "dpo")[:params.eval_prompts]
    eval_id = {"max_new_tokens": params.eval_max_new_tokens, "prompts_digest": ctx.input("prompts").digest}
    pass_before, before_from = pass_rate_before(
        params.eval_before, ckpt, eval_records, **eval_id, progress=ctx.progress, measure=lambda: pass_rate(
            model, tok, eval_records, batch_size=params.sample_batch_size, max_new_tokens=params.eval_max_new_tokens)[0])
    acc0, margin0 = heldout(model)
    ctx.log_metrics({"eval_preference_accuracy": acc0, "eval_reward_margin": margin0,
                     "eval_pass_rate": pass_before}, step=0)

    # 2. DPO with TRL
    trainer, losses, train_seconds = train_dpo(params, ctx, model, tok, ckpt, split["train"], encoded, heldout)
    steps = trainer.state.global_step

    # 3. after: held-out preference accuracy and pass rate at the last step, the checkpoint, the report
    policy = trainer.model.eval()
    acc1, margin1 = heldout(policy)
    pass_after, _ = pass_rate(policy, tok, eval_records, max_new_tokens=params.eval_max_new_tokens,
                              batch_size=params.sample_batch_size)
    ctx.log_metrics({"eval_preference_accuracy": acc1, "eval_reward_margin": margin1, "eval_pass_rate": pass_after},
                    step=steps)
    publish_policy(policy, ckpt / MODEL_DIR, ckpt, ctx.out_dir)
    write_pass_rate(ctx.out_dir, pass_after, eval_records, **eval_id, stage=ctx.stage_name,
                    before=(pass_before, before_from))
    ctx.log_figure(loss_figure(losses, xlabel="step", ylabel="DPO loss", marker="o",
                               title=f"{ctx.stage_name}: DPO loss (β={params.beta})"), "loss.png")
    _report(params, ctx, pairs, skipped, split, skip_counts, truncated=truncated, stats=stats,
            accuracy=(acc0, acc1), margin=(margin0, margin1), eval_pass=(pass_before, pass_after),
            eval_records=len(eval_records), losses=losses, steps=steps, train_seconds=train_seconds, start=start)


def _report(params: DPOParams, ctx: StageContext, pairs: list[dict[str, Any]], skipped: list[dict[str, Any]],
            split: dict[str, list[dict[str, Any]]], skip_counts: Counter, *, truncated: int, stats: SamplingStats,
            accuracy: tuple[float, float], margin: tuple[float, float], eval_pass: tuple[float, float],
            eval_records: int, losses: list[tuple[int, float]], steps: int, train_seconds: float,
            start: float) -> None:
    """The summary metrics and ``dpo_report.json``; (before, after) pairs for the held-out figures."""
    (acc0, acc1), (margin0, margin1), (pass_before, pass_after) = accuracy, margin, eval_pass
    seconds = time.monotonic() - start
    final_loss = losses[-1][1] if losses else math.nan
    summary = {"eval_preference_accuracy": acc1, "eval_preference_accuracy_untrained": acc0,
               "eval_pass_rate": pass_after, "eval_pass_rate_before": pass_before, "loss": final_loss,
               "dpo_pairs": len(pairs), "dpo_pairs_heldout": len(split["heldout"]), "truncated_pairs": truncated,
               "generation_tokens_per_second": stats.tokens_per_second, "train_seconds": train_seconds,
               "stage_seconds": seconds, "steps": steps}
    log_finite_summary(ctx, summary)
    report = {"params": params.model_dump(), "prompts": len(pairs) + len(skipped),
              "pairs": {s: len(v) for s, v in split.items()}, "truncated_pairs": truncated,
              "skipped": {k: skip_counts.get(k, 0) for k in SKIP_REASONS}, "skip_reasons": SKIP_REASONS,
              "generation": {"tokens": stats.tokens, "seconds": round(stats.seconds, 3), "sequences": stats.sequences,
                             "finished": stats.finished, "tokens_per_second": stats.tokens_per_second},
              "eval_preference_accuracy": {"before": acc0, "after": acc1},
              "eval_reward_margin": {"before": margin0, "after": margin1},
              "eval_pass_rate": {"before": pass_before, "after": pass_after, "prompts": eval_records},
              "final_loss": None if math.isnan(final_loss) else final_loss, "steps": steps,
              "train_seconds": round(train_seconds, 2), "stage_seconds": round(seconds, 2),
              "notes": {"eval_preference_accuracy": "held-out pairs whose implicit reward beta*(log pi - log pi_ref) "
                                                    "is higher for chosen; ties 1/2 (0.5 at step 0, pi = pi_ref)"}}
    write_report(ctx, ctx.out_dir / REPORT_FILE, report, "dpo")
    ctx.progress(f"held-out preference accuracy {acc0:.3f} -> {acc1:.3f}, pass rate {pass_before:.3f} -> "
                 f"{pass_after:.3f}, {steps} steps in {train_seconds:.1f} s; stage {seconds:.1f} s")


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("dpo_report.json", "plots/*"),
    name="dpo",
    params=DPOParams,
    run=run,
    produces=CHECKPOINT_TYPE,
    inputs={
        "checkpoint": InputSpec(CHECKPOINT_TYPE, doc="the policy to optimize (an SFT stage's, or any checkpoint)"),
        "prompts": InputSpec(PROMPTS_TYPE, doc="the prompts stage's pools: 'dpo' makes pairs, 'eval' the pass rate"),
        "reward_model": InputSpec(REWARD_MODEL_TYPE, required=False,
                                  doc="a reward_model stage's model: the helpfulness term of the reward hierarchy"),
    },
    doc="§5.4.1 offline RL (Table 7 stages III/IV): responses sampled at several temperatures, scored by the reward "
        "hierarchy, best vs worst as pairs; TRL DPOTrainer with a frozen dropless reference; logs loss, "
        "train_preference_accuracy, reward_margin, held-out eval_preference_accuracy (implicit reward, ties 1/2) and "
        "eval_pass_rate before and after.",
)
