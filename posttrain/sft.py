"""Stage ``sft``: supervised fine-tuning on rejection-sampled responses (report §5.3) with TRL's ``SFTTrainer``; one
stage kind serves Table 7's Stage I (short sequences, cosine LR) and Stage II (long sequences, constant LR) as two DAG
stages with their own params (produces a ``checkpoint``).

Inputs: ``checkpoint`` (pretrain, long_context or another sft stage: the policy that samples and is trained),
``prompts`` (the prompts stage; this stage reads ``pools/sft.jsonl`` and measures on ``pools/eval.jsonl``), optional
``reward_model`` (its ``reward_model/`` gives the hierarchy's helpfulness term).

0. **Which prompts** (:func:`choose_prompts`): ``difficulties`` keeps prompts by their difficulty tag and
   ``min_prompt_tokens`` / ``max_prompt_tokens`` by their chat-formatted length (a long-context stage keeps the long
   ones; a short one can leave them to it), then a seeded subset of ``max_prompts`` is sampled.
1. **Rejection sampling** (§5.3: "sampling multiple variations per prompt across different temperature settings to
   select optimal demonstrations measured by the reward hierarchy"): ``samples_per_temperature`` responses at each of
   ``temperatures`` per prompt (:func:`posttrain.policy.sample_responses`; the policy samples itself — the report's
   samplers are domain expert models, which this project does not have). Every sample is scored by
   :class:`posttrain.rewards.RewardHierarchy`. Per prompt (:func:`select_target`): a verifiable prompt takes its best
   *correct* sample; with none, the reference answer (``posttrain.preference_pairs.reference_response``) when
   ``reference_fallback`` is on, else the prompt is dropped. An open-ended prompt takes its best sample by total.
   Samples cut at ``max_new_tokens`` are no candidates when ``require_finished`` (a target must end its turn).
2. **Diversity** (§5.3: "both n-gram and semantic similarity filters"), over the selected set in pool order
   (:func:`diversity_filter`): a target whose word n-gram Jaccard with an already kept target exceeds
   ``ngram_jaccard_max`` is dropped, then one whose embedding cosine similarity with a kept one exceeds
   ``embedding_cosine_max``. Embeddings: the mean-pooled last hidden state of the POLICY ITSELF over the response
   tokens (the project loads no separate sentence encoder here). Targets shorter than ``diversity_min_words`` words
   (``Answer: 42``) are not compared: their diversity is their prompt's.
3. **Training**: conversational ``messages`` (user prompt, assistant target) in the tokenizer's chat template,
   ``assistant_only_loss=True``: the template's ``{% generation %}`` block spans the assistant content and its
   ``<|end|>``, so the loss covers exactly the target and the end-of-turn marker the policy must learn to stop at.
   Examples over ``max_length`` tokens are dropped (``too_long``), never truncated (a truncated target would lose its
   end-of-turn). The MoE balance term is ``router_aux_loss_coef`` × the model's own §2.1 loss
   (:mod:`posttrain.moe_loss`), not TRL's. The saved policy's generation config lists ``<|end|>`` as an eos
   (``save_policy``).

Every ``sft`` pool prompt is accounted for: kept, or dropped with a reason in :data:`DROP_REASONS` (counted, logged as
``dropped.<reason>``, each listed in ``dropped.jsonl``).

Metrics: ``eval_pass_rate`` (held-out eval pool, greedy) at step 0 for the input policy and at the last step for the
trained one; ``loss`` (and ``learning_rate``, ``grad_norm``) every step; ``sft_examples``, ``rejection_acceptance``
(share of sampled prompts whose target is a sampled response), ``response_length`` (mean target tokens, end marker
included), ``generation_tokens_per_second``, ``generation_padding_waste`` (share of decoded row-steps spent on rows
already finished, model/generation.py), ``dropped.<reason>``. ``plots/loss.png``: the loss curve.

Output: ``model/`` + ``minimax/`` + ``packing.json`` (``save_policy``: the checkpoint layout every training stage
writes), ``sft_data.jsonl`` (prompt, response, source, reward components), ``dropped.jsonl``, ``sft_report.json``.

Defaults are sized for the tiny CPU DAG (few prompts, short responses); docs/notes/sft.md gives GPU-size settings.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from data.documents import unit_hash
from data.reward_scoring import REWARD_MODEL_DIR
from pipeline.artifacts import write_jsonl_atomic
from pipeline.stage import InputSpec, StageContext, StageKind, StageParams, metric_key
from posttrain.policy import (
    CHECKPOINT_EVERY_HELP,
    EVAL_BEFORE_HELP,
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
from posttrain.preference_pairs import reference_response
from posttrain.prompts import PROMPTS_TYPE, read_pool
from posttrain.report import log_finite_summary, loss_figure, write_report
from posttrain.reward_model import REWARD_MODEL_TYPE
from posttrain.rewards import RewardComponents, RewardHierarchy
from posttrain.sandbox import containment_record
from posttrain.sft_selection import (
    Target,
    diversity_filter,
    example_messages,
    policy_embeddings,
    select_target,
)
from posttrain.verifiable import CHECKERS
from pretrain.stage import CHECKPOINT_TYPE

DATA_FILE = "sft_data.jsonl"
DROPPED_FILE = "dropped.jsonl"
REPORT_FILE = "sft_report.json"
SOURCES = ("sampled", "reference")
DROP_REASONS = {
    "other_difficulty": "its difficulty tag is not one of difficulties",
    "prompt_too_short": "fewer than min_prompt_tokens chat-formatted prompt tokens (a long-context stage)",
    "prompt_too_long": "more than max_prompt_tokens chat-formatted prompt tokens",
    "over_max_prompts": "not in the seeded subset of max_prompts prompts of the sft pool (not sampled)",
    "no_correct_sample": "verifiable prompt with no correct finished sample, and reference_fallback is off",
    "reference_incorrect": "verifiable prompt, no correct sample, and its reference fails its own checker",
    "no_finished_sample": "open-ended prompt whose samples were all cut at max_new_tokens (require_finished) or empty",
    "below_min_reward": "open-ended prompt whose best sample's total is below min_open_ended_reward",
    "too_long": "the chat-formatted example exceeds max_length tokens",
    "ngram_duplicate": "word n-gram Jaccard with an already kept target above ngram_jaccard_max",
    "embedding_duplicate": "embedding cosine similarity with an already kept target above embedding_cosine_max",
}


class SFTParams(StageParams):
    seed: int = Field(0, description="Seed of sampling and of the training data order.")
    # --- rejection sampling (§5.3)
    temperatures: Temperatures = Field(default_factory=lambda: [0.6, 1.0], description=(
        "Sampling temperatures (§5.3: 'different temperature settings'); 0 = one greedy response."))
    samples_per_temperature: int = Field(2, ge=1, description="Samples per prompt at each temperature (k = this x "
                                                              "the number of temperatures).")
    max_new_tokens: int = Field(24, ge=1, description="Token budget of a sampled response (tiny-sized default).")
    max_prompts: int | None = Field(24, ge=1, description=(
        "Sample a seeded subset of N prompts of the sft pool (the rest are dropped as over_max_prompts); None = all. "
        "Tiny-sized default."))
    difficulties: list[str] | None = Field(None, min_length=1, description=(
        "Keep only prompts whose difficulty tag is one of these, before the other filters (other_difficulty): "
        "[long] for a long-context stage on the prompts stage's long_retrieval prompts, [easy, medium, hard] to "
        "leave them out. None: every prompt."))
    min_prompt_tokens: int = Field(0, ge=0, description=(
        "Prompts shorter than this (chat-formatted tokens) are dropped before the max_prompts subset "
        "(prompt_too_short): a long-context SFT stage (Table 7 stage II) keeps long prompts only. 0: no floor."))
    max_prompt_tokens: int | None = Field(None, ge=1, description=(
        "Prompts longer than this are dropped before the max_prompts subset (prompt_too_long), so a stage can leave "
        "a pool's long-context prompts to another. None: no limit (max_length still drops long examples)."))
    sampling_batch_size: int = Field(16, ge=1, description="Prompts per generate call.")
    require_finished: bool = Field(True, description=(
        "Only samples that ended their turn (end-of-turn / eos before max_new_tokens) are candidates."))
    reference_fallback: bool = Field(False, description=(
        "A verifiable prompt with no correct sample takes its reference answer as target (source 'reference'); "
        "off: the prompt is dropped (no_correct_sample)."))
    min_open_ended_reward: float | None = Field(None, description=(
        "Open-ended prompts whose best sample's hierarchy total is below this are dropped; None = keep the best."))
    # --- diversity filters (§5.3)
    ngram_size: int = Field(3, ge=1, description="Word n-gram size of the n-gram diversity filter.")
    ngram_jaccard_max: float = Field(0.7, gt=0, le=1, description=(
        "Drop a target whose n-gram Jaccard with a kept one is above this (1.0: filter off)."))
    embedding_cosine_max: float = Field(0.98, gt=0, le=1, description=(
        "Drop a target whose embedding cosine with a kept one is above this (1.0: filter off). Embeddings: "
        "mean-pooled last hidden state of the policy itself."))
    diversity_min_words: int = Field(6, ge=1, description=(
        "Targets with fewer words are not compared by the diversity filters (short answers differ by their prompt)."))
    # --- training (Table 7)
    max_length: int = Field(256, ge=16, description=(
        "Longest chat-formatted example in tokens (Table 7: 8192 in Stage I, 1032192 in Stage II); longer "
        "examples are dropped."))
    learning_rate: float = Field(1e-4, gt=0, description="Peak LR (Table 7: 1e-5 Stage I, 3e-6 Stage II).")
    min_learning_rate: float | None = Field(None, gt=0, description=(
        "Floor of the cosine schedule (Table 7: 1e-6 in Stage I); None: cosine decays to 0."))
    lr_scheduler_type: str = Field("cosine", description=(
        "transformers scheduler name (Table 7: 'cosine' in Stage I, 'constant' in Stage II)."))
    warmup_ratio: float = Field(0.1, ge=0, lt=1, description="Share of the steps spent in linear warmup.")
    epochs: float = Field(2.0, gt=0, description="Passes over the SFT data (Table 7: 2 in Stages I and II).")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides epochs when set.")
    checkpoint_every: int = Field(10, ge=0, description=CHECKPOINT_EVERY_HELP)
    batch_size: int = Field(4, ge=1, description="Examples per device step (Table 7: 128 / 80 global).")
    gradient_accumulation_steps: int = Field(1, ge=1)
    weight_decay: float = Field(0.0, ge=0)
    # --- evaluation
    eval_max_new_tokens: int = Field(24, ge=1, description="Token budget of the greedy eval_pass_rate responses.")
    eval_prompts: int | None = Field(None, ge=1, description="First N records of the eval pool; None = all.")
    eval_before: EvalBefore = Field("measure", description=EVAL_BEFORE_HELP)

    @model_validator(mode="after")
    def _schedule(self) -> SFTParams:
        if self.min_learning_rate is not None and self.lr_scheduler_type != "cosine":
            raise ValueError(f"min_learning_rate is the floor of the cosine schedule; lr_scheduler_type is "
                             f"{self.lr_scheduler_type!r} (drop min_learning_rate or use 'cosine')")
        if self.min_learning_rate is not None and self.min_learning_rate > self.learning_rate:
            raise ValueError(f"min_learning_rate {self.min_learning_rate} exceeds learning_rate {self.learning_rate}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < self.min_prompt_tokens:
            raise ValueError(f"max_prompt_tokens {self.max_prompt_tokens} is below min_prompt_tokens "
                             f"{self.min_prompt_tokens}: no prompt could pass")
        return self


# --- the stage ------------------------------------------------------------------------------------------------------
def choose_prompts(params: SFTParams, records: list[dict[str, Any]], prompt_tokens: Any
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the prompts to sample, one dropped row for each other prompt): the filters first (``difficulties``, then
    ``min_prompt_tokens``, ``max_prompt_tokens``; ``prompt_tokens(record)`` counts a record's chat-formatted prompt,
    called only when a filter is set), then a seeded subset of ``max_prompts``, not the pool's head (the pool lists
    verifiable prompts before open-ended ones). Filtering first keeps the subset of a pool's other prompts the same
    when long prompts join the pool, and gives a long-context stage ``max_prompts`` long prompts."""
    dropped: list[dict[str, Any]] = []
    if params.difficulties is not None:
        wanted = set(params.difficulties)
        dropped += [{"id": r.get("id"), "reason": "other_difficulty", "detail": str(r.get("difficulty"))}
                    for r in records if r.get("difficulty") not in wanted]
        records = [r for r in records if r.get("difficulty") in wanted]
    if params.min_prompt_tokens or params.max_prompt_tokens is not None:
        kept = []
        for r in records:
            n = prompt_tokens(r)
            if n < params.min_prompt_tokens:
                dropped.append({"id": r.get("id"), "reason": "prompt_too_short", "detail": f"{n} tokens"})
            elif params.max_prompt_tokens is not None and n > params.max_prompt_tokens:
                dropped.append({"id": r.get("id"), "reason": "prompt_too_long", "detail": f"{n} tokens"})
            else:
                kept.append(r)
        records = kept
    if params.max_prompts is not None and params.max_prompts < len(records):
        order = sorted(range(len(records)),
                       key=lambda i: unit_hash(params.seed, "sft_prompts", str(records[i].get("id", i))))
        chosen = set(order[:params.max_prompts])
        dropped += [{"id": r.get("id"), "reason": "over_max_prompts"} for i, r in enumerate(records)
                    if i not in chosen]
        records = [r for i, r in enumerate(records) if i in chosen]
    return records, dropped


def build_sft_data(params: SFTParams, ctx: StageContext, model: Any, tokenizer: Any, hierarchy: RewardHierarchy,
                   records: list[dict[str, Any]], stats: SamplingStats
                   ) -> tuple[list[Target], list[dict[str, Any]], Counter]:
    """Rejection sampling + length and diversity filters over the sft pool: (kept targets in pool order, one
    dropped row per dropped prompt, candidate-level counts)."""
    records, dropped = choose_prompts(
        params, records, lambda r: len(tokenizer(chat_prompt(tokenizer, r["prompt"]), add_special_tokens=False)
                                       .input_ids))
    samples = sample_responses(model, tokenizer, [r["prompt"] for r in records], temperatures=params.temperatures,
                               samples_per_temperature=params.samples_per_temperature,
                               max_new_tokens=params.max_new_tokens, batch_size=params.sampling_batch_size,
                               seed=params.seed, stats=stats, progress=ctx.progress)
    cand: Counter = Counter()
    flat_rec, flat_text, owner = [], [], []
    for i, (rec, ss) in enumerate(zip(records, samples, strict=True)):
        for s in ss:
            cand["samples"] += 1
            if params.require_finished and not s.finished:
                cand["unfinished"] += 1
            elif not s.text.strip():
                cand["empty"] += 1
            else:
                flat_rec.append(rec)
                flat_text.append(s.text)
                owner.append((i, s.temperature))
    # references are scored too: the fallback's reward components, and a check that the reference is correct
    refs = [i for i, r in enumerate(records) if params.reference_fallback and r.get("checker") in CHECKERS]
    ref_texts = [reference_response(records[i]) for i in refs]
    ctx.progress(f"scoring {len(flat_text)} candidate samples and {len(ref_texts)} references with the reward "
                 "hierarchy")
    scored = hierarchy.score(flat_rec + [records[i] for i in refs], flat_text + ref_texts)
    ctx.progress(f"scored: {hierarchy.timing()}")
    per_prompt: list[tuple[list[str], list[RewardComponents], list[float]]] = [([], [], []) for _ in records]
    for (i, temp), text, comp in zip(owner, flat_text, scored[:len(flat_text)], strict=True):
        per_prompt[i][0].append(text)
        per_prompt[i][1].append(comp)
        per_prompt[i][2].append(temp)
    ref_comp = dict(zip(refs, scored[len(flat_text):], strict=True))
    cand["correct"] = sum(1 for c in scored[:len(flat_text)] if c.correct)

    selected: list[Target] = []
    for i, rec in enumerate(records):
        texts, comps, temps = per_prompt[i]
        target, reason = select_target(rec, texts, comps, reference_fallback=params.reference_fallback,
                                       reference_components=ref_comp.get(i),
                                       min_open_ended_reward=params.min_open_ended_reward, temperatures=temps)
        if target is None:
            dropped.append({"id": rec.get("id"), "reason": reason})
            continue
        n_tokens = len(tokenizer.apply_chat_template(example_messages(target), tokenize=True, return_dict=True)
                       ["input_ids"])
        if n_tokens > params.max_length:
            dropped.append({"id": rec.get("id"), "reason": "too_long", "detail": f"{n_tokens} tokens"})
            continue
        selected.append(target)

    verdicts, compared = diversity_verdicts(params, model, tokenizer, [t.response for t in selected])
    kept = []
    for target, verdict in zip(selected, verdicts, strict=True):
        if verdict:
            dropped.append({"id": target.record.get("id"), "reason": verdict})
        else:
            kept.append(target)
    cand["diversity_compared"] = compared
    return kept, dropped, cand


def diversity_verdicts(params: SFTParams, model: Any, tokenizer: Any, texts: list[str]) -> tuple[list[str], int]:
    """:func:`diversity_filter`'s verdict on each selected target, with the policy's own embeddings of the texts long
    enough to be compared (none when the embedding filter is off); (verdicts, texts compared)."""
    use_embeddings = params.embedding_cosine_max < 1.0
    long_idx = [i for i, t in enumerate(texts) if len(t.split()) >= params.diversity_min_words]
    embeddings = None
    if use_embeddings and long_idx:
        vecs = policy_embeddings(model, tokenizer, [texts[i] for i in long_idx], params.sampling_batch_size)
        embeddings = [[0.0] for _ in texts]
        for i, v in zip(long_idx, vecs, strict=True):
            embeddings[i] = v
    verdicts = diversity_filter(texts, embeddings, ngram_size=params.ngram_size,
                                ngram_jaccard_max=params.ngram_jaccard_max,
                                embedding_cosine_max=params.embedding_cosine_max,
                                min_words=params.diversity_min_words)
    return verdicts, len(long_idx)


@dataclass
class SFTData:
    """What rejection sampling kept (:func:`build_sft_data`), with the account of every sft-pool prompt."""

    targets: list[Target]
    dropped: list[dict[str, Any]]
    candidates: Counter
    example_tokens: list[int]  # the whole chat-formatted example
    target_tokens: list[int]  # what the loss covers: the response and its <|end|>

    @property
    def reasons(self) -> Counter:
        return Counter(d["reason"] for d in self.dropped)

    @property
    def sources(self) -> Counter:
        return Counter(t.source for t in self.targets)


def _target_row(t: Target, tokens: int) -> dict[str, Any]:
    return {"id": t.record.get("id"), "task_type": t.record.get("task_type"), "prompt": t.record["prompt"],
            "response": t.response, "source": t.source, "temperature": t.temperature, "tokens": tokens,
            "reward": t.components.as_json()}


def save_sft_data(params: SFTParams, ctx: StageContext, tokenizer: Any, pool: list[dict[str, Any]],
                  built: tuple[list[Target], list[dict[str, Any]], Counter], stats: SamplingStats) -> SFTData:
    """Checks that every prompt is kept or dropped and that some example survived, then writes ``sft_data.jsonl``
    (with each target's loss tokens) and ``dropped.jsonl``."""
    targets, dropped, cand = built
    reasons = Counter(d["reason"] for d in dropped)
    if len(targets) + len(dropped) != len(pool):  # every prompt is accounted for
        raise RuntimeError(f"sft: {len(pool)} prompts but {len(targets)} kept + {len(dropped)} dropped")
    if not targets:
        raise ValueError(f"sft: no SFT example survived selection ({dict(reasons)} of {len(pool)} prompts; "
                         f"samples: {dict(cand)}). A policy that never ends its turn within max_new_tokens has no "
                         "finished samples: raise max_new_tokens, set require_finished: false, or allow "
                         "reference_fallback for verifiable prompts")
    masks = [tokenizer.apply_chat_template(example_messages(t), tokenize=True, return_assistant_tokens_mask=True,
                                           return_dict=True)["assistant_masks"] for t in targets]
    data = SFTData(targets, dropped, cand, example_tokens=[len(m) for m in masks],
                   target_tokens=[sum(m) for m in masks])
    write_jsonl_atomic(ctx.out_dir / DATA_FILE,
                       [_target_row(t, n) for t, n in zip(targets, data.target_tokens, strict=True)])
    write_jsonl_atomic(ctx.out_dir / DROPPED_FILE, dropped)
    ctx.set_rows("sft_examples", len(targets))
    ctx.progress(f"{len(targets)} SFT examples from {len(pool)} prompts ({dict(data.sources)}); dropped "
                 f"{dict(reasons)}; {stats.tokens} tokens sampled at {stats.tokens_per_second:.0f} tokens/s")
    return data


def trainer_class() -> type:
    """The trainer this stage trains with: TRL's ``SFTTrainer`` with the model's own MoE balance loss (§2.1) in
    place of TRL's (:mod:`posttrain.moe_loss`)."""
    from trl import SFTTrainer  # heavy: trl

    from posttrain.moe_loss import model_balance_trainer  # heavy: torch

    return model_balance_trainer(SFTTrainer)


def train_sft(params: SFTParams, ctx: StageContext, model: Any, tokenizer: Any,
              targets: list[Target]) -> tuple[Any, list[tuple[int, float]], float]:
    """TRL's SFTTrainer on the targets, assistant-only loss in the chat template, Table 7's schedule; resumes from
    the last mid-training checkpoint of a killed attempt. (trainer, (step, loss) history, training seconds)."""
    import torch  # heavy: torch
    from datasets import Dataset  # heavy: datasets
    from transformers import PrinterCallback  # heavy: transformers
    from trl import SFTConfig  # heavy: trl

    relay = trainer_log_relay(ctx, {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "learning_rate"})
    scheduler, scheduler_kwargs = params.lr_scheduler_type, {}
    if params.min_learning_rate is not None:  # Table 7's Min LR: cosine to a floor
        scheduler, scheduler_kwargs = "cosine_with_min_lr", {"min_lr": params.min_learning_rate}
    config = SFTConfig(
        assistant_only_loss=True, max_length=params.max_length,
        packing=False, learning_rate=params.learning_rate, lr_scheduler_type=scheduler,
        lr_scheduler_kwargs=scheduler_kwargs, warmup_steps=params.warmup_ratio, num_train_epochs=params.epochs,
        max_steps=params.max_steps or -1, per_device_train_batch_size=params.batch_size,
        gradient_accumulation_steps=params.gradient_accumulation_steps, weight_decay=params.weight_decay,
        logging_steps=1, eval_strategy="no", report_to="none", **trainer_checkpointing(ctx, params.checkpoint_every),
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),  # the stage's GPU when it has one
        gradient_checkpointing=NO_ACTIVATION_CHECKPOINTING, seed=params.seed, disable_tqdm=True, dataloader_num_workers=0)
    dataset = Dataset.from_dict({"messages": [example_messages(t) for t in targets]})
    model.train()
    trainer = trainer_class()(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[relay])
    trainer.remove_callback(PrinterCallback)
    train_start = time.monotonic()
    train_from_checkpoint(trainer, last_checkpoint(ctx, config))
    return trainer, relay.losses, time.monotonic() - train_start


def run(params: SFTParams, ctx: StageContext) -> None:
    containment_record()  # this stage's sandbox runs only (a Ray worker may have run another)
    start = time.monotonic()
    import torch  # heavy: torch

    ckpt = ctx.input("checkpoint").path
    rm = ctx.inputs.get("reward_model")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    hierarchy = RewardHierarchy(reward_model_dir=rm.path / REWARD_MODEL_DIR if rm is not None else None,
                                device=device)
    sft_pool = read_pool(ctx.input("prompts").path, "sft", "sft")
    eval_pool = read_pool(ctx.input("prompts").path, "eval", "sft")[:params.eval_prompts]
    if not sft_pool:
        raise ValueError(f"sft: the sft pool of {ctx.input('prompts').path} is empty; give the prompts stage more "
                         "prompts or a larger sft share")
    model, tok = load_policy(ckpt, device=device)
    if not tok.chat_template or "generation" not in tok.chat_template:
        raise ValueError(f"sft: the tokenizer of {ckpt} has no chat template with {{% generation %}} markers, which "
                         "assistant_only_loss needs (the project's tokenizer stage, data/tokenizer.py, writes one)")

    stats = SamplingStats()
    eval_stats = SamplingStats()
    eval_start = time.monotonic()
    eval_id = {"max_new_tokens": params.eval_max_new_tokens, "prompts_digest": ctx.input("prompts").digest}
    before, before_from = pass_rate_before(params.eval_before, ckpt, eval_pool, **eval_id, progress=ctx.progress, measure=lambda: (
        pass_rate(model, tok, eval_pool, max_new_tokens=params.eval_max_new_tokens,
                  batch_size=params.sampling_batch_size, stats=eval_stats)[0]))
    ctx.log_metrics({"eval_pass_rate": before}, step=0)
    eval_seconds = time.monotonic() - eval_start
    if before_from == "measured":  # pass_rate_before said where a read one came from
        ctx.progress(f"eval_pass_rate before SFT: {before:.3f} on {len(eval_pool)} held-out prompts")

    # 1-2. rejection sampling, selection and diversity filters (§5.3)
    t0 = time.monotonic()
    built = build_sft_data(params, ctx, model, tok, hierarchy, sft_pool, stats)
    sampling_seconds = time.monotonic() - t0
    data = save_sft_data(params, ctx, tok, sft_pool, built, stats)

    # 3. training (Table 7)
    trainer, history, train_seconds = train_sft(params, ctx, model, tok, data.targets)
    steps = trainer.state.global_step
    model = trainer.model.eval()
    tok.padding_side = "left"  # sampling pads left (the collator may have changed it)

    eval_start = time.monotonic()
    after, eval_rows = pass_rate(model, tok, eval_pool, max_new_tokens=params.eval_max_new_tokens,
                                 batch_size=params.sampling_batch_size, stats=eval_stats)
    ctx.log_metrics({"eval_pass_rate": after}, step=steps)
    eval_seconds += time.monotonic() - eval_start
    ctx.progress(f"eval_pass_rate after SFT: {after:.3f} (before {before:.3f}) after {steps} steps")

    publish_policy(model, ckpt / "model", ckpt, ctx.out_dir)
    write_pass_rate(ctx.out_dir, after, eval_pool, **eval_id, stage=ctx.stage_name, before=(before, before_from))
    if history:
        ctx.log_figure(loss_figure(history, xlabel="optimizer step", ylabel="loss (assistant tokens)",
                                   title=f"SFT loss: {ctx.stage_name}", marker=".", grid=True), "loss.png")
    _report(params, ctx, data, prompts=len(sft_pool), stats=stats, eval_pass=(before, after),
            eval_records=len(eval_pool), eval_rows=eval_rows, history=history, steps=steps,
            seconds=(sampling_seconds, train_seconds, eval_seconds, time.monotonic() - start))


def _report(params: SFTParams, ctx: StageContext, data: SFTData, *, prompts: int, stats: SamplingStats,
            eval_pass: tuple[float, float], eval_records: int, eval_rows: list[dict[str, Any]],
            history: list[tuple[int, float]], steps: int, seconds: tuple[float, float, float, float]) -> None:
    """The summary metrics and ``sft_report.json``. ``seconds``: (sampling, training, eval, the whole stage)."""
    before, after = eval_pass
    sampling_seconds, train_seconds, eval_seconds, stage_seconds = seconds
    sources, reasons = data.sources, data.reasons
    sampled_prompts = min(prompts, params.max_prompts or prompts)
    final_loss = history[-1][1] if history else math.nan
    summary = {"eval_pass_rate": after, "eval_pass_rate_before": before, "loss": final_loss,
               "sft_examples": len(data.targets), "rejection_acceptance": sources["sampled"] / sampled_prompts,
               "response_length": sum(data.target_tokens) / len(data.target_tokens),
               "example_length": sum(data.example_tokens) / len(data.example_tokens),
               "generation_tokens_per_second": stats.tokens_per_second,
               "generation_padding_waste": stats.padding_waste,
               "samples_finished_share": stats.finished / stats.sequences if stats.sequences else 0.0,
               "steps": steps, "sampling_seconds": sampling_seconds, "train_seconds": train_seconds,
               "eval_seconds": eval_seconds, "stage_seconds": stage_seconds}
    summary |= {f"sft_source.{s}": sources[s] for s in SOURCES}
    summary |= {f"dropped.{metric_key(r)}": reasons[r] for r in DROP_REASONS}
    log_finite_summary(ctx, summary)
    report = {"params": params.model_dump(), "prompts": prompts, "kept": len(data.targets),
              "sources": dict(sources), "dropped": {r: reasons[r] for r in DROP_REASONS},
              "drop_reasons": DROP_REASONS, "candidates": dict(data.candidates),
              "sampling": {"tokens": stats.tokens, "seconds": round(stats.seconds, 3), "sequences": stats.sequences,
                           "finished": stats.finished, "tokens_per_second": stats.tokens_per_second},
              "eval": {"before": before, "after": after, "records": eval_records,
                       "after_rows": eval_rows[:20]},
              "training": {"steps": steps, "final_loss": final_loss, "loss_history": history,
                           "seconds": round(train_seconds, 2)},
              "stage_seconds": round(stage_seconds, 2),
              "embeddings": "mean-pooled last hidden state of the policy itself (no separate encoder)"}
    write_report(ctx, ctx.out_dir / REPORT_FILE, report, "sft")
    ctx.progress(f"done in {stage_seconds:.1f} s: {steps} steps, loss {final_loss:.4f}, eval_pass_rate "
                 f"{before:.3f} -> {after:.3f}")


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("sft_report.json", "plots/*"),
    name="sft",
    params=SFTParams,
    run=run,
    produces=CHECKPOINT_TYPE,
    inputs={
        "checkpoint": InputSpec(CHECKPOINT_TYPE, doc="the policy: pretrain, long_context or an earlier sft stage"),
        "prompts": InputSpec(PROMPTS_TYPE, doc="the prompts stage's pools (sft: training prompts; eval: held out)"),
        "reward_model": InputSpec(REWARD_MODEL_TYPE, required=False,
                                  doc="the helpfulness reward model of the reward hierarchy (§5.2)"),
    },
    doc="§5.3 SFT with rejection sampling: k samples per sft-pool prompt at several temperatures, the best by the "
        "reward hierarchy (correct first), n-gram and policy-embedding diversity filters, then TRL SFTTrainer with "
        "assistant-only loss in the chat template; one kind for Table 7's Stage I (short, cosine) and Stage II "
        "(long, constant LR). Logs loss, eval_pass_rate before/after, sft_examples, rejection_acceptance, "
        "response_length, generation_tokens_per_second and drops by reason.",
)
