"""What every post-training stage does with a policy: load it from a checkpoint artifact, sample responses in
batches, measure the held-out pass rate, and write it back as a checkpoint artifact.

* :func:`load_policy` reads a checkpoint's ``model/`` (``pretrain/export.py``'s layout) as a ``HybridForCausalLM``
  with its tokenizer, MoE **dropless** (ROADMAP: with capacity drop a sequence's log-probs depend on the rest of
  the batch, which breaks policy/reference consistency in DPO and GRPO).
* :func:`sample_responses` decodes k responses per prompt at given temperatures in left-padded batches (the
  lightning layers' O(1) recurrent decode state; §5.4.2 generation), each stopping at the chat template's end of
  turn. It counts generated tokens and seconds, so stages report generation throughput.
* :func:`pass_rate` is ``eval_pass_rate``: greedy responses to held-out verifiable prompts, scored by the exact
  checkers of ``posttrain.verifiable``. :func:`write_pass_rate` records the one a stage measured at its end beside
  its checkpoint, and :func:`pass_rate_before` reads it back in the next stage (``eval_before: upstream``) where
  that stage would measure the same prompts with the same token budget, instead of decoding them again.
* :func:`save_policy` writes ``model/`` and ``minimax/`` (via ``pretrain.export.write_checkpoint_dirs``) and carries
  the base checkpoint's ``packing.json``, so the ``eval`` stage finds the pretraining run's held-out documents;
  :func:`publish_policy` writes them beside a stage's output and moves each into place whole.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator

from data.tokenizer import END_OF_TURN_TOKEN
from pipeline.artifacts import publish_dir, write_json_atomic
from posttrain.verifiable import CHECKERS, check

MODEL_DIR = "model"
PACKING_FILE = "packing.json"
PASS_RATE_FILE = "eval_pass_rate.json"  # the pass rate a post-training stage measured at its end, and on what
EvalBefore = Literal["measure", "upstream"]
EVAL_BEFORE_HELP = (
    "Where eval_pass_rate_before comes from: 'measure' decodes the eval prompts with the input checkpoint; "
    "'upstream' reads the pass rate the stage that made the checkpoint measured at its end, where it was measured "
    "on the same prompts (ids and prompts artifact) with the same eval_max_new_tokens, and measures otherwise "
    "(a pretrain or long_context checkpoint has none). Greedy decoding in another batch size can differ in the "
    "last bits, so the two can differ slightly; in the sixth GPU lease every 'before' equalled the upstream's "
    "'after'.")


def _checked_temperatures(v: list[float]) -> list[float]:
    if not v or any(t < 0 for t in v):
        raise ValueError(f"temperatures {v}: give one or more temperatures >= 0")
    return v


# a sampling stage's ``temperatures`` param (sft, dpo): one or more, each >= 0 (0: one greedy response)
Temperatures = Annotated[list[float], AfterValidator(_checked_temperatures)]


@dataclass
class Sample:
    """One sampled response."""

    text: str
    temperature: float
    tokens: int  # generated tokens, the end-of-turn marker included
    finished: bool  # ended with an eos / end-of-turn token (False: cut at max_new_tokens)


@dataclass
class SamplingStats:
    """Generated tokens and decode seconds over all :func:`sample_responses` calls that shared it."""

    tokens: int = 0
    seconds: float = 0.0
    sequences: int = 0
    finished: int = 0
    by_temperature: dict[float, int] = field(default_factory=dict)
    decoded_slots: int = 0  # rows x decode steps of the calls served by model/generation.py
    decoded_tokens: int = 0  # of those, tokens up to and including each row's eos

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def padding_waste(self) -> float:
        """Share of decoded row-steps spent on rows that had already finished (nan: no call was measured)."""
        return 1.0 - self.decoded_tokens / self.decoded_slots if self.decoded_slots else float("nan")

    def add_generation(self, model: Any) -> None:
        """Count the last generate call's decode slots (``model.last_generation_stats``; None: not served)."""
        g = getattr(model, "last_generation_stats", None)
        if g is not None:
            self.decoded_slots += g.rows * g.steps
            self.decoded_tokens += g.new_tokens




def load_policy(checkpoint: str | Path, dtype: Any = None, device: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) of a checkpoint artifact (or a ``model/`` directory itself), dropless MoE, eval mode."""
    import torch  # heavy: torch
    from transformers import AutoTokenizer  # heavy: transformers

    import model as _registers  # noqa: F401  (hylight_hybrid with the Auto classes)
    from model import HybridForCausalLM  # heavy: transformers, torch
    from model.moe import make_dropless  # heavy: transformers, torch

    path = Path(checkpoint)
    model_dir = path / MODEL_DIR if (path / MODEL_DIR / "config.json").is_file() else path
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"post-training: {path} holds no model (no {MODEL_DIR}/config.json): give a "
                                "checkpoint artifact of pretrain, long_context or a post-training stage")
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tok.pad_token_id is None:
        raise ValueError(f"post-training: the tokenizer in {model_dir} has no pad token; train it with the project's "
                         "tokenizer stage (data/tokenizer.py)")
    tok.padding_side = "left"
    policy = make_dropless(HybridForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32))
    if device is not None:
        policy = policy.to(device)
    return policy.eval(), tok


def chat_prompt(tokenizer: Any, prompt: str) -> str:
    """The prompt as one user turn followed by the assistant's header (the chat template)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """eos ids generation stops at: the generation config's (export puts eos and end-of-turn there), else the
    tokenizer's eos and the chat template's end-of-turn marker."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
    for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)):
        if t is not None and t not in ids and t != tokenizer.unk_token_id:
            ids.append(t)
    return ids


def sample_responses(model: Any, tokenizer: Any, prompts: Sequence[str], *, temperatures: Sequence[float],
                     samples_per_temperature: int = 1, max_new_tokens: int = 64, batch_size: int = 16,
                     seed: int = 0, stats: SamplingStats | None = None,
                     progress: Callable[[str], None] | None = None) -> list[list[Sample]]:
    """``len(temperatures) * samples_per_temperature`` responses for each prompt (temperature 0 = greedy, one
    sample whatever ``samples_per_temperature``). Prompts are sorted by length so a batch pads little; the result
    is in prompt order. Deterministic for a seed (each batch reseeds from ``seed`` and its position)."""
    import torch  # heavy: torch

    if not prompts:
        return []
    stats = stats if stats is not None else SamplingStats()
    stops = stop_token_ids(tokenizer, model)
    texts = [chat_prompt(tokenizer, p) for p in prompts]
    encoded = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    out: list[list[Sample]] = [[] for _ in prompts]
    device = next(model.parameters()).device
    jobs = [(t, 1 if t == 0 else samples_per_temperature) for t in temperatures]
    done_prompts = 0
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = max(len(encoded[i]) for i in idx)
        ids = torch.full((len(idx), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding: the lightning state stays exact (model/modeling.py)
            ids[row, width - len(encoded[i]):] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]):] = 1
        ids, mask = ids.to(device), mask.to(device)
        for j, (temp, n) in enumerate(jobs):
            torch.manual_seed(seed * 1_000_003 + start * 101 + j)
            kwargs = {"do_sample": False} if temp == 0 else {"do_sample": True, "temperature": float(temp),
                                                              "top_k": 0, "top_p": 1.0}
            t0 = time.perf_counter()
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     num_return_sequences=n, eos_token_id=stops,
                                     pad_token_id=tokenizer.pad_token_id, **kwargs)
            stats.seconds += time.perf_counter() - t0
            stats.add_generation(model)
            new = gen[:, width:].cpu()
            for k in range(new.shape[0]):
                row = new[k].tolist()
                end = next((p for p, t in enumerate(row) if t in stops), None)
                kept = row[:end + 1] if end is not None else [t for t in row if t != tokenizer.pad_token_id]
                text = tokenizer.decode(kept, skip_special_tokens=True).strip()
                out[idx[k // n]].append(Sample(text, float(temp), len(kept), end is not None))
                stats.tokens += len(kept)
                stats.sequences += 1
                stats.finished += end is not None
                stats.by_temperature[float(temp)] = stats.by_temperature.get(float(temp), 0) + 1
        done_prompts += len(idx)
        if progress:
            progress(f"sampled {done_prompts}/{len(prompts)} prompts ({stats.tokens_per_second:.0f} tokens/s)")
    return out


def pass_rate(model: Any, tokenizer: Any, records: Sequence[dict[str, Any]], *, max_new_tokens: int = 64,
              batch_size: int = 16, stats: SamplingStats | None = None) -> tuple[float, list[dict[str, Any]]]:
    """``eval_pass_rate``: the share of verifiable records whose greedy response the exact checker accepts, and
    one row per record (id, task type, response, correct, reason). Records without a checker are an error."""
    bad = [r.get("id") for r in records if r.get("checker") not in CHECKERS]
    if bad:
        raise ValueError(f"pass rate: {len(bad)} records have no exact checker (first ids: {bad[:5]}); the eval pool "
                         "of the prompts stage holds only verifiable prompts")
    if not records:
        return float("nan"), []
    responses = sample_responses(model, tokenizer, [r["prompt"] for r in records], temperatures=[0.0],
                                 max_new_tokens=max_new_tokens, batch_size=batch_size, stats=stats)
    rows = []
    for rec, (sample,) in zip(records, responses, strict=True):
        res = check(rec, sample.text)
        rows.append({"id": rec.get("id"), "task_type": rec.get("task_type"), "response": sample.text,
                     "correct": bool(res.correct), "reason": res.reason})
    return sum(r["correct"] for r in rows) / len(rows), rows


def _eval_identity(records: Sequence[dict[str, Any]], max_new_tokens: int, prompts_digest: str) -> dict[str, Any]:
    ids = "\n".join(str(r.get("id")) for r in records)
    return {"prompts_digest": prompts_digest, "prompt_ids_sha256": hashlib.sha256(ids.encode()).hexdigest(),
            "prompts": len(records), "max_new_tokens": int(max_new_tokens)}


def write_pass_rate(out_dir: str | Path, rate: float, records: Sequence[dict[str, Any]], *, max_new_tokens: int,
                    prompts_digest: str, stage: str, before: tuple[float, str]) -> None:
    """``eval_pass_rate.json`` in a stage's output: ``rate`` and what it was measured on; ``before``: the stage's
    pass rate before training and where it came from (:func:`pass_rate_before`'s answer)."""
    write_json_atomic(Path(out_dir) / PASS_RATE_FILE, {
        "eval_pass_rate": rate, "stage": stage, **_eval_identity(records, max_new_tokens, prompts_digest),
        "before": before[0], "before_from": before[1]})


def pass_rate_before(mode: EvalBefore, checkpoint_dir: str | Path, records: Sequence[dict[str, Any]], *,
                     max_new_tokens: int, prompts_digest: str, measure: Callable[[], float],
                     progress: Callable[[str], None]) -> tuple[float, str]:
    """``eval_pass_rate`` of the input checkpoint and where it came from: read from its :data:`PASS_RATE_FILE`
    (``mode`` 'upstream', when it was measured on these records with this token budget; the stage that measured
    it), else ``measure()`` ('measured'). Says which it did."""
    path = Path(checkpoint_dir) / PASS_RATE_FILE
    if mode == "upstream":
        if not path.is_file():
            why = f"the input checkpoint has no {PASS_RATE_FILE} (not a post-training stage's)"
        else:
            try:
                rec = json.loads(path.read_text())
                want = _eval_identity(records, max_new_tokens, prompts_digest)
                differs = [k for k, v in want.items() if rec.get(k) != v]
                rate = float(rec["eval_pass_rate"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                differs, rate = [f"unreadable ({type(e).__name__}: {e})"], math.nan
            if not differs and math.isfinite(rate):
                progress(f"eval_pass_rate before: {rate:.3f}, as {rec.get('stage')} measured it at its end on the same "
                         f"{len(records)} prompts (eval_before: upstream)")
                return rate, str(rec.get("stage"))
            why = f"{path.name} differs in {', '.join(differs) or 'its value'}"
        progress(f"eval_before: upstream, but {why}: measuring")
    return measure(), "measured"


CHECKPOINT_EVERY_HELP = ("Save a mid-training checkpoint (weights, optimizer, scheduler, RNG and data position) every "
                         "this many optimizer steps in the stage's resume directory, so a rerun after a crash or kill "
                         "continues from the last one; the directory is removed when the stage commits. 0: never.")


# TRL's configs (1.x) turn activation checkpointing on by default. Post-training keeps it off in every stage (SFT,
# reward model, DPO, GRPO): its recomputation must save the same tensors as the forward, and the MoE saves one set
# per expert that received tokens, so where routing is not bit-reproducible (bf16 on a GPU) the recomputed forward
# can route differently and torch refuses it. On an H100 the reward model stage failed so ("A different number of
# tensors was saved during the original forward and recomputation": 62 vs 59; BENCHMARKS.md). The models trained
# here fit without it.
NO_ACTIVATION_CHECKPOINTING = False


def trainer_checkpointing(ctx: Any, every: int) -> dict[str, Any]:
    """``TrainingArguments`` fields for a post-training stage's mid-training checkpoints.

    With ``every`` > 0 the trainer saves every ``every`` steps under ``ctx.resume_dir/trainer`` (the runner keeps
    that directory across a killed attempt of the same cache key and removes it once the stage commits), keeping
    the last two; with 0 nothing is saved and the trainer's scratch directory is the work dir."""
    if every <= 0:
        return {"output_dir": str(Path(ctx.work_dir) / "trainer"), "save_strategy": "no"}
    return {"output_dir": str(Path(ctx.resume_dir) / "trainer"), "save_strategy": "steps", "save_steps": every,
            "save_total_limit": 2}


def last_checkpoint(ctx: Any, args: Any) -> str | None:
    """The newest *complete* checkpoint of a previous attempt under ``args.output_dir``, or None.

    transformers writes ``checkpoint-N/`` in place and its ``trainer_state.json`` last, so a directory without a
    readable one is an attempt killed mid-save: it is skipped (and overwritten when step N is saved again)."""
    if getattr(args, "save_strategy", "no") in ("no", None) or not Path(args.output_dir).is_dir():
        return None
    found: list[tuple[int, Path]] = []
    for d in Path(args.output_dir).glob("checkpoint-*"):
        try:
            step = int(d.name.split("-", 1)[1])
            json.loads((d / "trainer_state.json").read_text())
        except (ValueError, OSError):
            continue
        found.append((step, d))
    if not found:
        return None
    step, path = max(found)
    ctx.progress(f"resuming training from {path.name} (step {step}), left by an attempt that did not finish")
    return str(path)


def train_from_checkpoint(trainer: Any, checkpoint: str | None) -> Any:
    """``trainer.train(resume_from_checkpoint=checkpoint)``, except that a checkpoint at ``max_steps`` (an attempt
    killed after its last step, before the stage committed) is loaded and not trained from.

    transformers fast-forwards to the checkpoint's step within its epoch and checks ``max_steps`` only after a
    step, so when the last epoch is unfinished (``max_steps`` not a multiple of the steps per epoch) it would train
    step ``max_steps + 1``. Here the trainer loads the weights as ``train`` does, takes the checkpoint's state, and
    its callbacks see a training that began and ended (the log relay takes back the steps the attempt logged)."""
    from transformers import TrainerState  # heavy: transformers
    from transformers.trainer_utils import TrainOutput  # heavy: transformers (the trainer stack)

    if checkpoint is None:
        return trainer.train()
    state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))
    if state.global_step < trainer.args.max_steps:
        return trainer.train(resume_from_checkpoint=checkpoint)
    trainer._load_from_checkpoint(checkpoint)
    trainer.state = state
    trainer.control = trainer.callback_handler.on_train_begin(trainer.args, state, trainer.control)
    trainer.control = trainer.callback_handler.on_train_end(trainer.args, state, trainer.control)
    # transformers' training_loss is the mean over the steps this call trained: here none
    return TrainOutput(state.global_step, float("nan"), {})


def trainer_log_relay(ctx: Any, renames: dict[str, str], *, log: Callable[[dict[str, float], int], None] | None = None,
                      shown: Sequence[str] = ("loss",),
                      on_step_end: Callable[[Any, Any], None] | None = None,
                      restore: Callable[[dict[str, float], int], None] | None = None) -> Any:
    """A ``TrainerCallback`` for the TRL trainers of the post-training stages: every logged value named in
    ``renames`` goes to the stage's metrics under its interface name (``log(metrics, step)``, default
    ``ctx.log_metrics``), with a progress line of the ``shown`` ones; ``on_step_end(state, model)`` runs after each
    step (a stage's held-out evaluations). The relay keeps ``losses``: (step, loss) of every logged step.

    When training resumes from a checkpoint, the steps before it were logged to MLflow by the attempt that ran
    them; the relay takes them back from the checkpoint's log history into ``losses`` (and passes them to
    ``restore(metrics, step)``, for a stage's own series) without logging them again."""
    from transformers import TrainerCallback  # heavy: transformers

    emit = log or (lambda metrics, step: ctx.log_metrics(metrics, step=step))

    class TrainerLogRelay(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[tuple[int, float]] = []

        def _relayed(self, logs: dict | None) -> dict[str, float]:
            return {renames[k]: float(v) for k, v in (logs or {}).items()
                    if k in renames and isinstance(v, int | float)}

        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001 -- transformers' callback signature
            # transformers has loaded a resumed checkpoint's state by now; not on a step, since a checkpoint at
            # max_steps trains none (train_from_checkpoint)
            if state.global_step <= 0:
                return
            for entry in state.log_history:
                out, step = self._relayed(entry), entry.get("step")
                if out and isinstance(step, int) and step <= state.global_step:
                    if "loss" in out:
                        self.losses.append((step, out["loss"]))
                    if restore is not None:
                        restore(out, step)

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001 -- transformers' callback signature
            out = self._relayed(logs)
            if not out:
                return
            emit(out, state.global_step)
            if "loss" in out:
                self.losses.append((state.global_step, out["loss"]))
            text = ", ".join(f"{k} {out[k]:.4g}" for k in shown if k in out)
            if text:
                ctx.progress(f"step {state.global_step}/{state.max_steps}: {text}")

        def on_step_end(self, args, state, control, model=None, **kw):  # noqa: ANN001
            if on_step_end is not None:
                on_step_end(state, model)

    return TrainerLogRelay()


def save_policy(model: Any, tokenizer_dir: str | Path, base_checkpoint: str | Path, out: str | Path) -> None:
    """``out/model`` + ``out/minimax`` (pretrain/export.py's layout, tokenizer included) and the base checkpoint's
    ``packing.json`` (the eval stage's held-out documents are the pretraining run's)."""
    from pretrain.export import write_checkpoint_dirs  # heavy: torch

    out = Path(out)
    write_checkpoint_dirs(model, tokenizer_dir, out)
    packing = Path(base_checkpoint) / PACKING_FILE
    if packing.is_file():
        shutil.copy2(packing, out / PACKING_FILE)


def publish_policy(model: Any, tokenizer_dir: str | Path, base_checkpoint: str | Path, out_dir: str | Path) -> None:
    """:func:`save_policy` into ``out_dir/.policy.tmp``, then each entry it wrote (``model/``, ``minimax/``,
    ``packing.json``) moved onto ``out_dir/<entry>`` by ``publish_dir`` (fsynced, one rename each), so a crash leaves
    every one of them whole or absent."""
    out_dir = Path(out_dir)
    tmp = out_dir / ".policy.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_policy(model, tokenizer_dir, base_checkpoint, tmp)
    for entry in sorted(tmp.iterdir()):
        publish_dir(entry, out_dir / entry.name)  # packing.json is a file: publish_dir fsyncs and renames it alike
    tmp.rmdir()
