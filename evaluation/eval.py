"""Stage ``eval``: what a trained checkpoint can do, on text it was not trained on (artifact ``eval_report``).

Inputs: the ``checkpoint`` (``model/`` + tokenizer + ``packing.json`` from ``pretrain``), and the ``mixture`` and
``scored_documents`` it was trained from. The held-out text is exactly the pretrain stage's held-out set: the
documents ``pretrain/packed_data.py`` chose for ``eval_loss`` (documents the mixture never samples first, else ones it took
out of training), recomputed from the mixture with the seed and count in ``packing.json`` and checked against the
document and token counts recorded there. Every haystack, filler turn, loss window and built multiple-choice item comes
from those documents only.

What it measures (T = the checkpoint's trained length, ``packing.json``'s ``seq_len``):

* vanilla NIAH over context lengths (``context_multiples`` x T) x needle depths, greedy decoding through the model's
  recurrent cache (HF ``generate`` with ``HybridCache``), exact match of the number: ``niah_accuracy`` (at T),
  ``niah_accuracy_2x`` (at 2T), ``niah_accuracy_at_<L>``, heat map ``plots/niah.png``; and, graded where that exact
  match is all-or-nothing, a forced choice on the same prompts between the needle's number and ``niah_distractors``
  numbers the prompt never held (teacher-forced log-likelihood of each as the answer): ``niah_choice_accuracy`` /
  ``_2x`` (chance is 1 / (1 + niah_distractors)) and ``niah_answer_margin`` / ``_2x`` (nats: the needle's number's
  log-likelihood minus the distractors' mean; 0 means the model ignores the needle) and ``niah_number_start_prob`` /
  ``_2x`` (the probability at the cue that the answer begins with a number at all); each answer's kind (correct, a
  near copy, another number, text: ``report.json``'s ``answer_kinds_by_length``); with ``niah_chat`` the same
  trials again as one user turn in the chat template (``niah_chat_accuracy`` / ``_2x``: post-trained checkpoints);
* the copy probe: ``[BOS] R R`` with ``R`` ``copy_tokens`` random token ids (``copy_pool``: drawn from the distinct
  ordinary tokens of the held-out text, as the in-training probe draws them, or from the whole ordinary vocabulary,
  many of whose tokens a small run never trains on); ``copy_accuracy`` is the top-1 accuracy
  on the second copy (its first token excepted), ``copy_loss_gain`` the first copy's mean loss minus the second's
  (Olsson et al.'s in-context signature of induction heads). NIAH's answer is a copy of the needle's number, so a
  model that cannot copy a repeated sequence cannot pass NIAH: the two together say whether a NIAH failure is the
  mechanism (no copying yet) or the retrieval (copying, but not from the needle);
* multi-round NIAH (needle rounds in a chat history at 25/50/75% depth, the last round asks for the numbers again):
  ``multi_round_niah_recall`` (at T), ``multi_round_niah_recall_2x``, ``multi_round_niah_recall_at_<L>``;
* extrapolation: next-token loss by position on held-out windows of the longest context (``[BOS]`` + held-out
  tokens), ``eval_loss_at_<L>`` = mean loss of the tokens at positions [previous length, L) (the first from 1), so
  ``eval_loss_at_<2T>`` is the loss on positions the model never trained on; plot ``plots/loss_by_position.png``;
* multiple choice (``data/eval_tasks.py``): cloze and next-sentence tasks built from the held-out text and every
  lm-eval JSONL file in ``task_files``; per task ``mc_acc.<task>``, ``mc_acc_norm.<task>``, ``mc_log_acc_norm2.<task>``
  (§4.1.3.1), ``mc_items.<task>`` and the power analysis (``mc_min_items.<task>``: test size that detects an accuracy
  gain of ``mde``; ``mc_mde.<task>``: the gain this task's size detects); ``mc_acc_norm`` / ``mc_log_acc_norm2`` are
  the means over tasks.

Output: ``report.json`` (every number above, the grids, each NIAH trial and answer), ``mc_items.jsonl`` (per item:
log-likelihoods and scores), ``plots/``.

The held-out set is read in :mod:`evaluation.heldout`, the model asked through :class:`evaluation.scorer.Scorer`, the
measurements are here, and :mod:`evaluation.report` turns them into the summary metrics, plots and JSON.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from data.documents import SCORED_DOCUMENTS_TYPE
from data.eval_tasks import (
    MCTask,
    TokenStream,
    build_cloze_task,
    build_copy_trials,
    build_multi_round_trial,
    build_next_sentence_task,
    build_niah_trials,
    held_out_token_pool,
    lm_eval_item_problem,
    needle_rounds,
    niah_chat_prompt,
    niah_distractors,
    read_lm_eval_jsonl,
)
from data.mix import MIXTURE_TYPE
from evaluation.heldout import HeldOut, heldout_documents
from evaluation.metrics import (
    NIAH_ANSWER_KINDS,
    choice_scores,
    min_detectable_accuracy_difference,
    min_samples_for_accuracy_difference,
    niah_answer_kind,
    niah_correct,
    niah_prefix_digits,
    recall,
)
from evaluation.report import plot_results, summary_metrics, write_strict_json
from evaluation.scorer import Scorer
from pipeline.artifacts import write_jsonl_atomic, write_text_atomic
from pipeline.stage import InputSpec, StageContext, StageKind, StageParams, file_fingerprint, metric_key
from pipeline.user_jsonl import jsonl_file_problems
from posttrain.policy import SamplingStats, load_policy, pass_rate
from posttrain.prompts import PROMPTS_TYPE, read_pool
from posttrain.sandbox import containment_record, record_sandbox
from pretrain.stage import CHECKPOINT_TYPE

EVAL_REPORT_TYPE = "eval_report"
REPORT_FILE = "report.json"
TIMING_FILE = "timing.json"  # wall-clock seconds and generation speed (a record: not in the digest)
MC_ITEMS_FILE = "mc_items.jsonl"
PASS_RATE_FILE = "pass_rate.jsonl"
HAYSTACK_SEPARATOR = "\n\n"  # between held-out documents in the haystack / loss stream


class EvalParams(StageParams):
    context_multiples: list[float] = Field(default_factory=lambda: [1.0, 2.0], description=(
        "NIAH, multi-round NIAH and loss lengths as multiples of the checkpoint's trained length T; must hold 1 and 2 "
        "(niah_accuracy is at T, niah_accuracy_2x at 2T)."))
    needle_depths: list[float] = Field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0], description=(
        "Vanilla NIAH needle depths: share of the haystack tokens before the needle."))
    niah_trials: int = Field(2, ge=1, description="Vanilla NIAH prompts per (length, depth) cell.")
    niah_max_new_tokens: int = Field(12, ge=1, description="Greedy tokens generated for a NIAH answer.")
    niah_chat: bool = Field(False, description=(
        "Also ask every vanilla NIAH prompt as one user turn in the tokenizer's chat template (the same haystack and "
        "needle, the question without the completion cue): niah_chat_accuracy / _2x. For post-trained checkpoints, "
        "which answer in that format; on the plain prompt they may answer with an EOS."))
    niah_chat_max_new_tokens: int = Field(24, ge=1, description=(
        "Greedy tokens generated for a NIAH answer in the chat template (an answer may restate the question before "
        "the number)."))
    mr_niah_round_tokens: int = Field(96, ge=8, description=(
        "Multi-round NIAH: one history round per this many context tokens (at least one round per needle plus one "
        "filler round)."))
    mr_niah_depths: list[float] = Field(default_factory=lambda: [0.25, 0.5, 0.75], description=(
        "Multi-round NIAH: depths of the needle rounds in the history (§5.7.2: 25%, 50%, 75%)."))
    mr_niah_trials: int = Field(2, ge=1, description="Multi-round NIAH dialogues per context length.")
    mr_niah_max_new_tokens: int = Field(48, ge=1, description="Greedy tokens generated for a multi-round answer.")
    loss_windows: int = Field(8, ge=1, description="Held-out windows of the longest length for the loss by position.")
    loss_bin: int = Field(32, ge=1, description="Positions per point of the loss-by-position curve.")
    cloze_items: int = Field(50, ge=0, description="Cloze items built from the held-out text (0: no cloze task).")
    next_sentence_items: int = Field(50, ge=0, description="Next-sentence items built from the held-out text (0: none).")
    mc_choices: int = Field(4, ge=2, description="Choices per built multiple-choice item.")
    mc_context_chars: int = Field(600, ge=20, description="Characters of context before a built item's choices.")
    task_files: list[str] = Field(default_factory=list, description=(
        "Multiple-choice task files in lm-eval's JSONL shape ({\"query\" or \"context\", \"choices\", \"gold\"} a line; "
        ".jsonl or .jsonl.gz), each scored as a task named after its file."))
    mde: float = Field(0.05, gt=0, lt=1, description=(
        "Power analysis: the accuracy gain to detect (minimal detectable effect), at significance alpha and power."))
    alpha: float = Field(0.05, gt=0, lt=1, description="Power analysis: two-sided significance level (95% confidence).")
    power: float = Field(0.8, gt=0, lt=1, description="Power analysis: probability of detecting the effect.")
    niah_distractors: int = Field(3, ge=1, description=(
        "NIAH forced choice: wrong 7-digit numbers scored against the needle's on every NIAH prompt "
        "(niah_choice_accuracy, niah_answer_margin)."))
    copy_trials: int = Field(8, ge=0, description="Copy probe sequences (0: no copy probe).")
    copy_tokens: int = Field(64, ge=4, description="Copy probe: random tokens per copy ([BOS] R R).")
    copy_pool: Literal["seen", "vocab"] = Field("seen", description=(
        "Where the copy probe's tokens come from: 'seen', the distinct ordinary tokens of the held-out text (as the "
        "in-training probe of pretrain and long_context); 'vocab', the whole ordinary vocabulary (on a small corpus "
        "many of a 32K vocabulary's tokens are never a training target, and a model that copies every token it has "
        "met can still score 0 there)."))
    generate_batch: int = Field(8, ge=1, description="NIAH and multi-round NIAH prompts decoded together (one "
                                "generate call; prompts of different lengths are packed, no compute on padding).")
    pass_rate_prompts: int = Field(0, ge=0, description=(
        "With a `prompts` input: how many of its held-out `eval` pool prompts eval_pass_rate uses (0: all)."))
    pass_rate_max_new_tokens: int = Field(24, ge=1, description=(
        "Greedy tokens generated for an eval_pass_rate answer (24, as the post-training stages' default)."))
    seed: int = Field(0, ge=0, description="Needles, haystack offsets, item choice and order.")

    @model_validator(mode="after")
    def _grids(self) -> EvalParams:
        if any(m <= 0 for m in self.context_multiples) or not {1.0, 2.0} <= set(self.context_multiples):
            raise ValueError(f"context_multiples={self.context_multiples}: need positive multiples including 1 and 2 "
                             "(niah_accuracy is measured at the trained length, niah_accuracy_2x at twice it)")
        if not self.needle_depths or any(not 0 <= d <= 1 for d in self.needle_depths):
            raise ValueError(f"needle_depths={self.needle_depths}: need at least one depth, each in [0, 1]")
        if not self.mr_niah_depths or any(not 0 <= d <= 1 for d in self.mr_niah_depths):
            raise ValueError(f"mr_niah_depths={self.mr_niah_depths}: need at least one depth, each in [0, 1]")
        return self


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for s in range(0, len(items), size):
        yield items[s:s + size]


# --- the parts ----------------------------------------------------------------------------------------------------
def _niah(scorer: Scorer, stream: TokenStream, lengths: list[int], params: EvalParams,
          ctx: StageContext) -> dict[str, Any]:
    trials = build_niah_trials(stream, scorer.encode, scorer.bos, lengths, params.needle_depths, params.niah_trials,
                               params.seed)
    distractors = niah_distractors(trials, params.niah_distractors, params.seed)
    rows = []
    done = 0
    number_ids = scorer.number_start_ids()
    for length in lengths:
        mine = [(t, d) for t, d in zip(trials, distractors, strict=True) if t.length == length]
        for batch in _batches(mine, params.generate_batch):
            answers = scorer.generate([t.ids for t, _ in batch], params.niah_max_new_tokens)
            chats: list[Any] = [None] * len(batch)  # niah_chat: the same trials as a chat's user turn
            chat_answers: list[Any] = [None] * len(batch)
            if params.niah_chat:
                chats = [niah_chat_prompt(t, scorer.encode, scorer.decode, scorer.render_chat) for t, _ in batch]
                chat_answers = scorer.generate(chats, params.niah_chat_max_new_tokens)
            for (t, wrong), a, ca, cp in zip(batch, answers, chat_answers, chats, strict=True):
                # the forced choice: each number as the answer, spelt as the needle spells it (" 1234567")
                # and the probability that the answer begins with a number at all (any digit-led token)
                ll, number_mass = scorer.continuation_logliks(
                    t.ids, [scorer.encode(f" {x}") for x in [t.number, *wrong]], mass_ids=number_ids)
                rows.append({"length": t.length, "depth": t.depth, "city": t.city, "number": t.number, "answer": a,
                             "correct": niah_correct(a, t.number),
                             "prefix_digits": niah_prefix_digits(a, t.number), "kind": niah_answer_kind(a, t.number),
                             "needle_start": t.needle_start,
                             "distractors": wrong, "answer_loglik": ll[0], "distractor_logliks": ll[1:],
                             "choice_correct": bool(ll[0] > max(ll[1:])),
                             "margin": float(ll[0] - np.mean(ll[1:])), "number_start_prob": number_mass})
                if ca is not None:
                    rows[-1] |= {"chat_answer": ca, "chat_correct": niah_correct(ca, t.number),
                                 "chat_prompt_tokens": len(cp)}
            done += len(batch)
            ctx.progress(f"NIAH: {done}/{len(trials)} prompts (length {length})")

    def mean(key: str, **where: Any) -> float:
        return float(np.mean([r[key] for r in rows if all(r[k] == v for k, v in where.items())]))

    grid = [[mean("correct", length=L, depth=d) for L in lengths] for d in params.needle_depths]
    out = {"lengths": lengths, "depths": params.needle_depths, "accuracy": grid,
           "accuracy_by_length": {L: mean("correct", length=L) for L in lengths},
           "prefix_digits_by_length": {L: mean("prefix_digits", length=L) for L in lengths},
           "answer_kinds_by_length": {L: {k: sum(r["kind"] == k for r in rows if r["length"] == L)
                                          for k in NIAH_ANSWER_KINDS} for L in lengths},
           "choice_chance": 1.0 / (1 + params.niah_distractors),
           "choice_accuracy_by_length": {L: mean("choice_correct", length=L) for L in lengths},
           "margin_by_length": {L: mean("margin", length=L) for L in lengths},
           "number_start_prob_by_length": {L: mean("number_start_prob", length=L) for L in lengths},
           "trials": rows}
    if params.niah_chat:
        out["chat_accuracy_by_length"] = {L: mean("chat_correct", length=L) for L in lengths}
        ctx.progress("NIAH in the chat template: " + ", ".join(
            f"{L}: {out['chat_accuracy_by_length'][L]:.2f}" for L in lengths))
    ctx.progress("NIAH answers by kind: " + "; ".join(
        f"{L}: " + ", ".join(f"{k} {n}" for k, n in out["answer_kinds_by_length"][L].items()) for L in lengths))
    ctx.progress("NIAH forced choice (chance {:.2f}): ".format(out["choice_chance"]) + ", ".join(
        f"{L}: {out['choice_accuracy_by_length'][L]:.2f} (margin {out['margin_by_length'][L]:+.2f} nats; "
        f"p(the answer starts with a number) {out['number_start_prob_by_length'][L]:.2f})" for L in lengths))
    return out


def _copy_probe(scorer: Scorer, params: EvalParams, ctx: StageContext,
                stream: TokenStream | None = None) -> dict[str, Any] | None:
    """The copy probe (module docstring): per trial, the first copy's and the second copy's mean loss and the second
    copy's top-1 accuracy. ``copy_pool="seen"`` draws from ``stream``'s distinct ordinary tokens."""
    if not params.copy_trials:
        return None
    torch = scorer.torch
    pool = scorer.ordinary_token_ids()
    if params.copy_pool == "seen":
        if stream is None:
            raise ValueError("copy_pool='seen' needs the held-out text")
        pool = held_out_token_pool(stream.tokens, pool)
    trials = build_copy_trials(pool, scorer.bos, params.copy_trials, params.copy_tokens, params.seed)
    ids = torch.tensor([t.ids for t in trials], device=scorer.device)
    logp, hits = scorer.token_logprobs(ids, hits=True)
    logp, hits = logp.double().cpu().numpy(), hits.cpu().numpy()
    rows = []
    for b, t in enumerate(trials):  # the log-prob of the token at position p sits at index p - 1
        first = np.asarray(t.first_copy_targets()) - 1
        second = np.asarray(t.second_copy_targets()) - 1
        rows.append({"first_copy_loss": float(-logp[b, first].mean()), "second_copy_loss": float(-logp[b, second].mean()),
                     "second_copy_accuracy": float(hits[b, second].mean()),
                     "first_copy_accuracy": float(hits[b, first].mean())})
    out = {"trials": len(trials), "tokens_per_copy": params.copy_tokens, "pool": params.copy_pool,
           "pool_size": len(pool), "uniform_loss": math.log(len(pool)),
           "accuracy": float(np.mean([r["second_copy_accuracy"] for r in rows])),
           "first_copy_loss": float(np.mean([r["first_copy_loss"] for r in rows])),
           "second_copy_loss": float(np.mean([r["second_copy_loss"] for r in rows])), "rows": rows}
    out["loss_gain"] = out["first_copy_loss"] - out["second_copy_loss"]
    ctx.progress(f"copy probe ({len(trials)} x {params.copy_tokens} random tokens of {len(pool):,} "
                 f"({params.copy_pool}), repeated): second-copy accuracy "
                 f"{out['accuracy']:.3f}, loss {out['first_copy_loss']:.3f} -> {out['second_copy_loss']:.3f} "
                 f"(uniform {out['uniform_loss']:.3f})")
    return out


def mr_rounds(length: int, params: EvalParams) -> int:
    """History rounds of a multi-round NIAH dialogue of ``length`` tokens."""
    return max(len(params.mr_niah_depths) + 1, length // params.mr_niah_round_tokens)


def _multi_round(scorer: Scorer, stream: TokenStream, lengths: list[int], params: EvalParams,
                 ctx: StageContext) -> dict[str, Any]:
    rng = np.random.default_rng([params.seed, 21])
    rows = []
    for length in lengths:
        trials = [build_multi_round_trial(stream, scorer.encode, scorer.decode, scorer.render_chat, length,
                                          mr_rounds(length, params), params.mr_niah_depths, rng)
                  for _ in range(params.mr_niah_trials)]
        answers = [a for batch in _batches(trials, params.generate_batch)  # dialogues differ in length: packed
                   for a in scorer.generate([t.ids for t in batch], params.mr_niah_max_new_tokens)]
        for t, answer in zip(trials, answers, strict=True):
            found = recall(answer, t.numbers)
            rows.append({"length": length, "prompt_tokens": len(t.ids), "rounds": t.rounds, "cities": t.cities, "numbers": t.numbers,
                         "depths": t.depths, "needle_rounds": t.needle_rounds, "answer": answer, "found": found,
                         "recall": float(np.mean(found))})
        ctx.progress(f"multi-round NIAH: length {length} done ({params.mr_niah_trials} dialogues)")
    by_length = {L: float(np.mean([r["recall"] for r in rows if r["length"] == L])) for L in lengths}
    by_depth = [[float(np.mean([r["found"][k] for r in rows if r["length"] == L])) for L in lengths]
                for k in range(len(params.mr_niah_depths))]
    return {"lengths": lengths, "depths": params.mr_niah_depths, "recall_by_length": by_length,
            "recall_by_depth": by_depth, "trials": rows}


def _loss_by_position(scorer: Scorer, stream: TokenStream, lengths: list[int], params: EvalParams,
                      ctx: StageContext) -> dict[str, Any]:
    torch = scorer.torch
    longest = max(lengths)
    total = np.zeros(longest - 1)
    n = params.loss_windows
    for w in range(n):  # windows spread evenly over the stream (they overlap only when the stream is short)
        offset = (w * len(stream)) // n
        ids = torch.tensor([[scorer.bos, *stream.take(offset, longest - 1).tolist()]], device=scorer.device)
        total -= scorer.token_logprobs(ids)[0].double().cpu().numpy()
    nll = total / n  # nll[p - 1]: loss of predicting the token at position p (1-based, after BOS at 0)
    bounds = [0, *lengths]
    at = {L: float(nll[max(a, 1) - 1:L - 1].mean()) for a, L in zip(bounds, lengths, strict=False)}
    edges = list(range(0, longest - 1, params.loss_bin)) + [longest - 1]
    curve = [(int(e), float(nll[s:e].mean())) for s, e in zip(edges, edges[1:], strict=False)]
    ctx.progress(f"loss by position over {n} windows of {longest} tokens: " +
                 ", ".join(f"{L}: {v:.3f}" for L, v in at.items()))
    return {"windows": n, "window_tokens": longest, "loss_at": at, "curve": curve,
            "stream_tokens": len(stream), "stream_repeats": longest > len(stream)}


def _mc(scorer: Scorer, tasks: list[MCTask], max_len: int, params: EvalParams, ctx: StageContext,
        items_file: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    rows: list[str] = []  # mc_items.jsonl, one JSON line an item
    for task in tasks:
        if not task.items:
            ctx.progress(f"multiple choice: task {task.name!r} has no items, skipped")
            continue
        scores = []
        for k, item in enumerate(ctx.track(task.items, total=len(task.items), what=f"{task.name} items")):
            ll = scorer.choice_logliks(item, max_len)
            s = choice_scores(ll, item.choices, item.gold)
            scores.append(s)
            rows.append(json.dumps({"task": task.name, "index": k, "source": item.source, "choices": item.choices,
                                    "gold": item.gold, "logliks": ll, "acc": s.acc, "acc_norm": s.acc_norm,
                                    "log_acc_norm2": s.log_acc_norm2}) + "\n")
        n = len(scores)
        acc_norm = float(np.mean([s.acc_norm for s in scores]))
        lan2 = np.asarray([s.log_acc_norm2 for s in scores])
        target = min(acc_norm + params.mde, 1.0)
        need = (min_samples_for_accuracy_difference(acc_norm, target, params.alpha, params.power)
                if target > acc_norm else math.inf)
        results[task.name] = {
            "items": n, "acc": float(np.mean([s.acc for s in scores])), "acc_norm": acc_norm,
            "log_acc_norm2": float(lan2.mean()), "log_acc_norm2_sd": float(lan2.std(ddof=1)) if n > 1 else 0.0,
            "chance_log_acc_norm2": float(np.mean([-math.log(len(i.choices)) for i in task.items])),
            "power": {"mde": params.mde, "alpha": params.alpha, "power": params.power, "min_items": need,
                      "enough_items": n >= need,
                      "detectable_gain": min_detectable_accuracy_difference(acc_norm, n, params.alpha,
                                                                            params.power)},
        }
        ctx.progress(f"multiple choice {task.name}: {n} items, acc_norm {acc_norm:.3f}, log acc_norm² "
                     f"{lan2.mean():.3f}; {need} items detect a gain of {params.mde}")
    write_text_atomic(items_file, "".join(rows))
    return results


def _pass_rate(checkpoint: Path, params: EvalParams, ctx: StageContext) -> dict[str, Any]:
    """``eval_pass_rate`` (issue 12): greedy responses of the checkpoint to the prompts stage's held-out `eval` pool,
    scored by the exact checkers; one row per prompt in ``pass_rate.jsonl``."""
    records = read_pool(ctx.input("prompts").path, "eval", "eval")
    if params.pass_rate_prompts:
        records = records[:params.pass_rate_prompts]
    if not records:
        raise ValueError("eval: the prompts input's eval pool holds no prompts, so eval_pass_rate cannot be measured")
    import torch  # heavy: torch

    # on the GPU when there is one (the first H100 run of dags/gpu-recipe.yaml generated these on the CPU, at
    # 99 tokens/s: BENCHMARKS.md), in bf16 there like the Scorer
    cuda = torch.cuda.is_available()
    model, tok = load_policy(checkpoint, dtype=torch.bfloat16 if cuda else None,
                             device=torch.device("cuda") if cuda else None)
    stats = SamplingStats()
    ctx.progress(f"eval_pass_rate: greedy answers to {len(records)} held-out verifiable prompts")
    rate, rows = pass_rate(model, tok, records, max_new_tokens=params.pass_rate_max_new_tokens,
                           batch_size=params.generate_batch, stats=stats)
    write_jsonl_atomic(ctx.out_dir / PASS_RATE_FILE, rows)
    by_type: dict[str, list[bool]] = {}
    for r in rows:
        by_type.setdefault(str(r["task_type"]), []).append(r["correct"])
    metrics = {"eval_pass_rate": rate, "eval_pass_prompts": float(len(rows))}
    metrics |= {f"eval_pass_rate.{metric_key(t)}": sum(v) / len(v) for t, v in sorted(by_type.items())}
    ctx.progress(f"eval_pass_rate {rate:.3f} over {len(rows)} prompts ({stats.tokens_per_second:.0f} tokens/s)")
    return {"metrics": metrics, "prompts": len(rows), "tokens_per_second": stats.tokens_per_second}


def mc_tasks(held: HeldOut, task_files: list[MCTask], params: EvalParams, ctx: StageContext) -> list[MCTask]:
    """The multiple-choice tasks scored: cloze and next-sentence items built from the held-out text (those that gave
    any), then the task files; two tasks of one name are an error."""
    built = [build_cloze_task(held.docs, params.cloze_items, params.mc_choices, params.mc_context_chars, params.seed),
             build_next_sentence_task(held.docs, params.next_sentence_items, params.mc_choices,
                                      params.mc_context_chars, params.seed)]
    for task, want in zip(built, (params.cloze_items, params.next_sentence_items), strict=True):
        if want and len(task.items) < want:
            ctx.progress(f"WARNING: the held-out text gave {len(task.items)} {task.name} items of {want} asked for")
    names = [t.name for t in built if t.items] + [t.name for t in task_files]
    if len(set(names)) != len(names):
        raise ValueError(f"eval: two multiple-choice tasks share a name ({names}); rename the task files")
    return [t for t in built if t.items] + task_files


# --- the stage ----------------------------------------------------------------------------------------------------
def run(params: EvalParams, ctx: StageContext) -> None:
    containment_record()  # this stage's sandbox runs only (a Ray worker may have run another)
    start = time.monotonic()
    checkpoint = ctx.input("checkpoint").path
    held = heldout_documents(checkpoint, ctx.input("mixture").path, ctx.input("documents").path)
    T = held.seq_len
    lengths = sorted({max(2, round(m * T)) for m in params.context_multiples})  # holds T and 2T (validated)
    ctx.progress(f"held-out text: {len(held.docs)} documents; trained length {T}; context lengths {lengths}")
    for length in lengths:  # bad settings and task files fail before the model loads
        needle_rounds(mr_rounds(length, params), params.mr_niah_depths)
    task_files = [read_lm_eval_jsonl(p) for p in params.task_files]

    scorer = Scorer(checkpoint)
    sep = scorer.encode(HAYSTACK_SEPARATOR)
    stream = TokenStream(np.concatenate([np.asarray(scorer.encode(text) + sep, np.int64) for _, text in held.docs]))
    if len(stream) < max(lengths):
        ctx.progress(f"WARNING: the held-out text has {len(stream)} tokens, fewer than the longest context "
                     f"{max(lengths)}: haystacks repeat it")

    niah = _niah(scorer, stream, lengths, params, ctx)
    copy = _copy_probe(scorer, params, ctx, stream)
    mr = _multi_round(scorer, stream, lengths, params, ctx)
    loss = _loss_by_position(scorer, stream, lengths, params, ctx)
    mc = _mc(scorer, mc_tasks(held, task_files, params, ctx), T, params, ctx, ctx.out_dir / MC_ITEMS_FILE)
    passes = _pass_rate(checkpoint, params, ctx) if "prompts" in ctx.inputs else None

    plot_results(ctx, niah, mr, loss, T)
    summary = summary_metrics(T, niah, copy, mr, loss, mc, passes)
    ctx.log_summary(summary)
    for pos, v in loss["curve"]:
        ctx.log_metrics({"loss_by_position": v}, step=pos)

    # wall-clock figures go to timing.json, a record (StageKind.records): report.json, which the compare stage
    # reads, holds only what the same inputs reproduce, so a rerun keeps the artifact's digest
    timing = {"seconds": round(time.monotonic() - start, 2)}
    if passes is not None:
        timing["pass_rate_tokens_per_second"] = passes.pop("tokens_per_second")
    report = {"trained_length": T, "context_lengths": lengths, "held_out": held.info, "params": params.model_dump(),
              "metrics": summary, "niah": niah, "copy_probe": copy, "multi_round_niah": mr, "loss_by_position": loss,
              "multiple_choice": mc, "pass_rate": passes}
    timing["sandbox"] = record_sandbox(ctx)
    write_strict_json(ctx.out_dir / REPORT_FILE, report)
    write_strict_json(ctx.out_dir / TIMING_FILE, timing)
    ctx.log_artifact(ctx.out_dir / REPORT_FILE, "eval")
    ctx.set_rows("niah_prompts", len(niah["trials"]))
    ctx.set_rows("mc_items", sum(r["items"] for r in mc.values()))
    ctx.progress(f"niah_accuracy {summary['niah_accuracy']:.3f} (2x {summary['niah_accuracy_2x']:.3f}), "
                 f"multi_round_niah_recall {summary['multi_round_niah_recall']:.3f}, "
                 f"mc_acc_norm {summary.get('mc_acc_norm', float('nan')):.3f}")


def fingerprint(params: EvalParams) -> list[dict[str, Any]]:
    """Content of the task files, for the cache key: edit one and the stage reruns."""
    return [file_fingerprint(p) for p in params.task_files]


def validate_external(params: EvalParams) -> list[tuple[str, str]]:
    """At spec validation: every ``task_files`` entry is a file of multiple-choice items (first 5 bad lines a file)."""
    return jsonl_file_problems(params.task_files, "task_files", "task file", lm_eval_item_problem)


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=(TIMING_FILE, "plots/*"),
    name="eval",
    params=EvalParams,
    run=run,
    produces=EVAL_REPORT_TYPE,
    inputs={
        "checkpoint": InputSpec(CHECKPOINT_TYPE, doc="the trained model (pretrain's model/ + packing.json)"),
        "mixture": InputSpec(MIXTURE_TYPE, doc="the mixture the checkpoint was trained on (which documents it held out)"),
        "documents": InputSpec(SCORED_DOCUMENTS_TYPE, doc="the scored documents the mixture was planned from (texts)"),
        "prompts": InputSpec(PROMPTS_TYPE, required=False,
                             doc="a prompts stage's pools: eval_pass_rate on its held-out `eval` pool"),
    },
    fingerprint=fingerprint,
    validate_external=validate_external,
    doc="Evaluation on held-out text (the pretrain stage's held-out documents): vanilla NIAH over context length x "
        "needle depth with greedy recurrent decoding (niah_accuracy at the trained length, niah_accuracy_2x at twice "
        "it, heat map), multi-round NIAH in a chat history (multi_round_niah_recall), loss by position beyond the "
        "trained length (eval_loss_at_<L>, plot), multiple choice on cloze / next-sentence tasks built from the "
        "held-out text and lm-eval JSONL task files (acc, acc_norm and the §4.1.3.1 log acc_norm²), with the power "
        "analysis of each task's size.",
)
