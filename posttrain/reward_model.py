"""Stage ``reward_model``: a Bradley-Terry reward model (report §5.2, the helpfulness reward model) trained with TRL's
``RewardTrainer`` from a pretraining checkpoint's backbone (artifact type ``reward_model``).

Inputs: ``checkpoint`` (``model/``: HybridForCausalLM + tokenizer with its chat template), ``prompts`` (the prompts
stage's pools) and optionally ``documents`` (the corpus the prompts came from: real continuations for open-ended
``continuation`` prompts). Pairs: :mod:`posttrain.preference_pairs` (pipeline-built pairs from the ``pools`` named in
params, checked with the exact checkers, plus ``user_pair_files``), split into train / held out by prompt group.

Model: ``HybridForSequenceClassification`` (model/modeling.py) loaded from ``model/``: the backbone keeps the
pretrained weights, ``score`` (d -> 1) is new. Loss: TRL's ``-log sigmoid(r_chosen - r_rejected)`` (Bradley-Terry).
Plus ``router_aux_loss_coef`` × the backbone's own MoE balance loss (§2.1; :mod:`posttrain.moe_loss`), which
RewardTrainer alone would leave out.

Metrics (the stage's MLflow run): ``loss`` every step; ``eval_preference_accuracy`` = the share of held-out pairs
whose chosen response scores higher (ties count 1/2), at step 0 (before training: the random head), every
``eval_every`` steps and at the end — computed on every held-out pair by :func:`score_sequences`, the same scorer
:class:`RewardModelScorer` uses later. Beside it, ``eval_preference_accuracy_longer_wins``: the accuracy of "the
longer response (in tokens) is better", a trivial baseline the model must beat to have learned anything beyond length.

Output: ``reward_model/`` (HF format: ``import model`` then ``AutoModelForSequenceClassification.from_pretrained``;
tokenizer files beside it), ``pairs/{train,heldout}.jsonl``, ``reward_report.json`` (pair counts by split, source and
kind; skipped prompts by reason; accuracy overall / by source / by kind before and after training and of the
baseline; time).
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from data.documents import ANY_DOCUMENTS
from data.reward_scoring import REWARD_MODEL_DIR, chat_messages, score_sequences
from pipeline.artifacts import publish_dir, write_jsonl_atomic
from pipeline.stage import InputSpec, StageContext, StageKind, StageParams, file_fingerprint
from posttrain.policy import (
    CHECKPOINT_EVERY_HELP,
    NO_ACTIVATION_CHECKPOINTING,
    last_checkpoint,
    train_from_checkpoint,
    trainer_checkpointing,
    trainer_log_relay,
)
from posttrain.preference_pairs import PreferencePair, build_pairs, pair_file_problems
from posttrain.prompts import POOLS, PROMPTS_TYPE, is_long, read_pool
from posttrain.report import log_finite_summary, write_report
from posttrain.sandbox import containment_record
from pretrain.stage import CHECKPOINT_TYPE

REWARD_MODEL_TYPE = "reward_model"
PAIRS_DIR = "pairs"
REPORT_FILE = "reward_report.json"


class RewardModelParams(StageParams):
    seed: int = Field(0, description="Seed of the pairs, the held-out split, the score head and the data order.")
    pools: list[str] = Field(default_factory=lambda: ["sft", "rl"], description=(
        "Prompt pools that pairs are built from (never 'eval' by default: it stays unseen for evaluation)."))
    user_pair_files: list[str] = Field(default_factory=list, description=(
        "JSONL preference pairs, {\"prompt\", \"chosen\", \"rejected\"} strings a line (optional id)."))
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="Share of pair groups held out for evaluation.")
    continuation_words: int = Field(60, ge=20, description=(
        "Words of real document text used as the chosen answer of an open-ended continuation prompt."))
    max_length: int = Field(384, ge=16, description="Pairs with a side longer than this many tokens are dropped.")
    max_steps: int = Field(30, ge=1, description="Optimizer steps.")
    checkpoint_every: int = Field(10, ge=0, description=CHECKPOINT_EVERY_HELP)
    batch_pairs: int = Field(8, ge=1, description="Pairs per step (each gives a chosen and a rejected sequence).")
    learning_rate: float = Field(5e-4, gt=0, description="Peak AdamW learning rate (linear decay, 10% warmup).")
    weight_decay: float = Field(0.0, ge=0)
    center_rewards_coefficient: float | None = Field(0.01, description=(
        "Weight of mean(r_chosen + r_rejected)^2 (TRL's reward centering; None = off): keeps scores near 0."))
    eval_every: int = Field(10, ge=1, description="Steps between held-out accuracy evaluations.")
    eval_batch_sequences: int = Field(32, ge=1, description="Sequences per forward when scoring held-out pairs.")
    check_workers: int = Field(4, ge=1, description="Concurrent sandbox checks of code pairs.")

    @field_validator("pools")
    @classmethod
    def _known_pools(cls, v: list[str]) -> list[str]:
        bad = sorted(set(v) - set(POOLS))
        if bad or not v:
            raise ValueError(f"pools {v}: name one or more of {', '.join(POOLS)}")
        return v


def validate_external(params: RewardModelParams) -> list[tuple[str, str]]:
    return pair_file_problems(params.user_pair_files)


def fingerprint(params: RewardModelParams) -> list[dict[str, Any]]:
    return [file_fingerprint(p) for p in params.user_pair_files]


# --- scoring ------------------------------------------------------------------------------------------------------
def pairwise_accuracy(chosen: Sequence[float], rejected: Sequence[float]) -> float:
    """Share of pairs with chosen > rejected, ties counting 1/2 (NaN for no pairs)."""
    if not chosen:
        return math.nan
    return sum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen, rejected, strict=True)) / len(chosen)


# --- the stage ----------------------------------------------------------------------------------------------------
def _accuracies(pairs: list[PreferencePair], chosen: list[float], rejected: list[float],
                prefix: str) -> dict[str, float]:
    """Overall, by source and by kind: ``<prefix>``, ``<prefix>.source.<s>``, ``<prefix>.kind.<k>``."""
    out = {prefix: pairwise_accuracy(chosen, rejected)}
    for attr in ("source", "kind"):
        groups: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(pairs):
            groups[getattr(p, attr)].append(i)
        for name, idx in sorted(groups.items()):
            out[f"{prefix}.{attr}.{name}"] = pairwise_accuracy([chosen[i] for i in idx], [rejected[i] for i in idx])
    return out


def trainer_class() -> type:
    """The trainer this stage trains with: TRL's ``RewardTrainer`` with the model's own MoE balance loss (§2.1) in
    place of TRL's (:mod:`posttrain.moe_loss`)."""
    from trl import RewardTrainer  # heavy: trl

    from posttrain.moe_loss import model_balance_trainer  # heavy: torch

    return model_balance_trainer(RewardTrainer)


def pair_prompts(prompts_dir: Path, pools: list[str]) -> list[dict[str, Any]]:
    """The prompt records pairs are built from: ``pools`` of the prompts artifact, without its long-context
    retrieval prompts (``long_retrieval``: thousands of tokens, beyond any pair length this stage trains at), so the
    pairs are those of a prompts artifact made without them."""
    return [r for pool in pools for r in read_pool(prompts_dir, pool, "reward_model") if not is_long(r)]


EncodedPairs = tuple[list[PreferencePair], list[list[int]], list[list[int]]]  # pairs, chosen ids, rejected ids


def encode_splits(params: RewardModelParams, ctx: StageContext, tokenizer: Any,
                  pair_set: Any) -> tuple[dict[str, EncodedPairs], dict[str, int]]:
    """Each split's pairs tokenized in the chat template, those with a side over ``max_length`` tokens dropped (and
    counted), the kept ones written to ``pairs/<split>.jsonl``; both splits must keep a pair."""

    def encode(prompt: str, response: str) -> list[int]:
        enc = tokenizer.apply_chat_template(chat_messages(prompt, response), tokenize=True, return_dict=True)
        return list(enc["input_ids"])

    splits: dict[str, EncodedPairs] = {}
    too_long: dict[str, int] = {}
    for split in ("train", "heldout"):
        kept, c_ids, r_ids = [], [], []
        for p in pair_set.split(split):
            c, r = encode(p.prompt, p.chosen), encode(p.prompt, p.rejected)
            if max(len(c), len(r)) <= params.max_length:
                kept.append(p)
                c_ids.append(c)
                r_ids.append(r)
        too_long[split] = len(pair_set.split(split)) - len(kept)
        splits[split] = (kept, c_ids, r_ids)
        (ctx.out_dir / PAIRS_DIR).mkdir(exist_ok=True)
        write_jsonl_atomic(ctx.out_dir / PAIRS_DIR / f"{split}.jsonl", [p.as_json() for p in kept])
        ctx.set_rows(f"{split}_pairs", len(kept))
    train, heldout = splits["train"], splits["heldout"]
    if not train[0] or not heldout[0]:
        raise ValueError(f"reward_model: {len(train[0])} train and {len(heldout[0])} held-out pairs within "
                         f"max_length={params.max_length} tokens (skipped prompts: {dict(pair_set.skipped)}; too "
                         f"long: {too_long}); both must be non-empty: give more prompts or pair files, raise "
                         "max_length, or change heldout_fraction")
    ctx.progress(f"pairs: {len(train[0])} train, {len(heldout[0])} held out ({dict(pair_set.skipped)} prompts "
                 f"without a pair, {too_long} over {params.max_length} tokens)")
    return splits, too_long


def pair_accuracy(m: Any, pairs: EncodedPairs, pad: int, batch_sequences: int) -> tuple[float, list[float],
                                                                                        list[float]]:
    """(accuracy, chosen scores, rejected scores) of the reward model ``m`` on encoded pairs (score_sequences: the
    scorer :class:`RewardModelScorer` uses later)."""
    n = len(pairs[0])
    scores = score_sequences(m, pairs[1] + pairs[2], pad, batch_sequences)
    return pairwise_accuracy(scores[:n], scores[n:]), scores[:n], scores[n:]


def train_reward_model(params: RewardModelParams, ctx: StageContext, rm: Any, tokenizer: Any, train: EncodedPairs,
                       heldout_accuracy: Callable[[Any], tuple[float, Any, Any]]) -> tuple[Any, float]:
    """TRL's RewardTrainer on the train pairs, the held-out accuracy every ``eval_every`` steps and at the last;
    resumes from the last mid-training checkpoint of a killed attempt. (trainer, training seconds)."""
    import torch  # heavy: torch
    from datasets import Dataset  # heavy: datasets
    from transformers import PrinterCallback  # heavy: transformers
    from trl import RewardConfig  # heavy: trl

    relayed = {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "learning_rate",
               "accuracy": "train_preference_accuracy", "margin": "train_reward_margin"}

    def heldout_every(state: Any, trained: Any) -> None:  # the exact held-out accuracy every eval_every steps
        if state.global_step % params.eval_every == 0 or state.global_step == state.max_steps:
            accuracy = heldout_accuracy(trained)[0]
            ctx.log_metrics({"eval_preference_accuracy": accuracy}, step=state.global_step)
            ctx.progress(f"step {state.global_step}/{state.max_steps}: held-out preference accuracy {accuracy:.3f}")

    config = RewardConfig(
        max_steps=params.max_steps, **trainer_checkpointing(ctx, params.checkpoint_every),
        per_device_train_batch_size=params.batch_pairs, learning_rate=params.learning_rate,
        weight_decay=params.weight_decay, warmup_steps=max(1, params.max_steps // 10), lr_scheduler_type="linear",
        logging_steps=1, eval_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),  # the stage's GPU when it has one
        seed=params.seed, max_length=None, disable_tqdm=True, gradient_checkpointing=NO_ACTIVATION_CHECKPOINTING,
        center_rewards_coefficient=params.center_rewards_coefficient, dataloader_num_workers=0)
    dataset = Dataset.from_dict({"chosen_ids": train[1], "rejected_ids": train[2]})
    trainer = trainer_class()(model=rm, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[trainer_log_relay(ctx, relayed, shown=("loss", "train_preference_accuracy"),
                                                         on_step_end=heldout_every)])
    trainer.remove_callback(PrinterCallback)  # the relay reports; no log dict printed every step
    train_start = time.monotonic()
    train_from_checkpoint(trainer, last_checkpoint(ctx, config))
    return trainer, time.monotonic() - train_start


def save_reward_model(rm: Any, tokenizer: Any, dest: Path) -> None:
    """The reward model and its tokenizer in HF format, written beside ``dest`` and moved onto it whole."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    rm.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish_dir(tmp, dest)


def run(params: RewardModelParams, ctx: StageContext) -> None:
    containment_record()  # this stage's sandbox runs only (a Ray worker may have run another)
    start = time.monotonic()
    import torch  # heavy: torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer  # heavy: transformers

    import model  # noqa: F401  (registers hylight_hybrid with the Auto classes)
    from model.moe import make_dropless  # heavy: transformers, torch

    model_dir = ctx.input("checkpoint").path / "model"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"reward_model: {model_dir} holds no model: the checkpoint input must be a pretrain "
                                "or long_context stage's artifact (with model/)")
    docs = ctx.inputs.get("documents")
    pair_set = build_pairs(pair_prompts(ctx.input("prompts").path, params.pools), seed=params.seed,
                           heldout_fraction=params.heldout_fraction,
                           documents=docs.path if docs is not None and not isinstance(docs, list) else None,
                           continuation_words=params.continuation_words, user_files=params.user_pair_files,
                           check_workers=params.check_workers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None or not tokenizer.chat_template:
        raise ValueError(f"reward_model: the tokenizer in {model_dir} needs a pad token and a chat template (the "
                         "project's tokenizer stage, data/tokenizer.py, saves both)")
    splits, too_long = encode_splits(params, ctx, tokenizer, pair_set)
    train, heldout = splits["train"], splits["heldout"]

    torch.manual_seed(params.seed)  # the new score head
    # dropless like every post-training model: a pair's scores must not depend on the rest of its batch
    rm = make_dropless(AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1,
                                                                           dtype=torch.float32))
    rm.config.pad_token_id = tokenizer.pad_token_id
    # on the stage's GPU from the start: the trainer moves it there only to train, so the untrained held-out scores
    # ran on the CPU (on 4 x H200 the stage took 351 s, 123 s of it training; the rest not yet broken down)
    if torch.cuda.is_available():
        rm = rm.to("cuda")
    heldout_accuracy = functools.partial(pair_accuracy, pairs=heldout, pad=tokenizer.pad_token_id,
                                         batch_sequences=params.eval_batch_sequences)
    t0 = time.monotonic()
    before, c0, r0 = heldout_accuracy(rm)
    ctx.log_metrics({"eval_preference_accuracy": before}, step=0)
    ctx.progress(f"held-out preference accuracy before training {before:.3f} ({len(heldout[0])} pairs scored on "
                 f"{next(rm.parameters()).device.type} in {time.monotonic() - t0:.1f} s)")
    trainer, train_seconds = train_reward_model(params, ctx, rm, tokenizer, train, heldout_accuracy)

    after, c1, r1 = heldout_accuracy(rm)
    lengths_c = [float(len(x)) for x in heldout[1]]
    lengths_r = [float(len(x)) for x in heldout[2]]
    acc = {**_accuracies(heldout[0], c1, r1, "eval_preference_accuracy"),
           **_accuracies(heldout[0], c0, r0, "eval_preference_accuracy_untrained"),
           **_accuracies(heldout[0], lengths_c, lengths_r, "eval_preference_accuracy_longer_wins")}
    save_reward_model(rm, tokenizer, ctx.out_dir / REWARD_MODEL_DIR)
    _report(params, ctx, splits, pair_set, too_long, acc, accuracy=(before, after), trainer=trainer,
            train_seconds=train_seconds, start=start)


def _report(params: RewardModelParams, ctx: StageContext, splits: dict[str, EncodedPairs], pair_set: Any,
            too_long: dict[str, int], acc: dict[str, float], *, accuracy: tuple[float, float], trainer: Any,
            train_seconds: float, start: float) -> None:
    """The summary metrics and ``reward_report.json``: pair counts by split, source and kind, the accuracies."""
    before, after = accuracy
    counts = {s: {"total": len(splits[s][0])} for s in splits}
    for s, (kept, _, _) in splits.items():
        for attr in ("source", "kind"):
            for p in kept:
                key = f"{attr}.{getattr(p, attr)}"
                counts[s][key] = counts[s].get(key, 0) + 1
    final_loss = next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), math.nan)
    seconds = time.monotonic() - start
    summary = {"eval_preference_accuracy": after, "eval_preference_accuracy_untrained": before,
               "eval_preference_accuracy_longer_wins": acc["eval_preference_accuracy_longer_wins"],
               "loss": final_loss, "pairs_train": len(splits["train"][0]), "pairs_heldout": len(splits["heldout"][0]),
               "train_seconds": train_seconds, "stage_seconds": seconds}
    summary |= {f"pairs_heldout.{k}": v for k, v in counts["heldout"].items() if k != "total"}
    summary |= {k: v for k, v in acc.items() if k.startswith("eval_preference_accuracy.")}
    log_finite_summary(ctx, summary)
    report = {"params": params.model_dump(), "pairs": counts, "skipped_prompts": dict(pair_set.skipped),
              "too_long_pairs": too_long, "accuracy": {k: (None if math.isnan(v) else v) for k, v in acc.items()},
              "final_loss": final_loss, "steps": trainer.state.global_step, "train_seconds": round(train_seconds, 2),
              "stage_seconds": round(seconds, 2),
              "notes": {"eval_preference_accuracy": "held-out pairs with chosen scored above rejected (ties 1/2)",
                        "eval_preference_accuracy_untrained": "the same before training (pretrained backbone, "
                                                              "random score head)",
                        "eval_preference_accuracy_longer_wins": "trivial baseline: the longer response (tokens) wins"}}
    write_report(ctx, ctx.out_dir / REPORT_FILE, report, "reward_model")
    ctx.progress(f"held-out preference accuracy {after:.3f} (untrained {before:.3f}, longer-wins baseline "
                 f"{acc['eval_preference_accuracy_longer_wins']:.3f}) on {len(splits['heldout'][0])} pairs; "
                 f"{seconds:.1f} s")


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("reward_report.json",),
    name="reward_model",
    params=RewardModelParams,
    run=run,
    produces=REWARD_MODEL_TYPE,
    inputs={
        "checkpoint": InputSpec(CHECKPOINT_TYPE, doc="the pretrained model whose backbone the reward model starts from"),
        "prompts": InputSpec(PROMPTS_TYPE, doc="the prompts stage's pools: verifiable and open-ended prompts"),
        "documents": InputSpec(ANY_DOCUMENTS, required=False,
                               doc="the corpus the prompts came from: real continuations for open-ended prompts"),
    },
    fingerprint=fingerprint,
    validate_external=validate_external,
    doc="§5.2 reward model: Bradley-Terry with TRL's RewardTrainer from the checkpoint's backbone "
        "(HybridForSequenceClassification), on pairs built from the prompt pools (reference vs checker-verified wrong "
        "answers and failing code; real corpus continuations vs synthetic degradations) and user pair files; logs "
        "loss and held-out eval_preference_accuracy beside a longer-wins baseline.",
)
