"""Online RL (§5.4.2): the modified GRPO on TRL's ``GRPOTrainer``, and the moderate-pass-rate prompt selection.

TRL does the rollout (generation, rewards, group-normalised advantages, reference log-probs, batching, multi-
iteration reuse, logging). This module changes only:
  - ``_generate_and_score_completions``: §5.4.2 (c) balanced advantages on top of TRL's group advantages, and the
    interface metrics ``reward_mean`` / ``response_length``;
  - ``_generate_single_turn``: run in eval mode (dropless MoE routing), and timed, for the metric
    ``generation_tokens_per_second`` (generated tokens up to each completion's first EOS / wall seconds of TRL's
    rollout generation, this process);
  - ``_compute_loss``: the loss of ``posttrain.grpo_loss.grpo_loss`` — (a) the extra clip of large-ratio
    negative-advantage tokens, (b) the stop-gradient KL term, CISPO as ``loss_type="cispo"`` — and the metrics
    ``kl`` and ``clip_fraction``; the MoE balance term is the model's own (``posttrain.moe_loss``), not TRL's.
Entry points for a stage: ``select_prompts_by_pass_rate`` and ``train_grpo``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedModel, PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from posttrain.grpo_loss import balanced_advantages, grpo_loss
from posttrain.moe_loss import ModelBalanceLoss
from posttrain.policy import train_from_checkpoint

RewardFunc = Callable[..., list[float]]  # TRL's signature: f(prompts, completions, completion_ids, **columns)

# The interface metrics (issue 12): names a stage and MLflow read.
INTERFACE_METRICS = ("reward_mean", "kl", "clip_fraction", "response_length")
# Logged with the rollout metrics (steps that generate), by HylightGRPOTrainer._generate_single_turn.
GENERATION_THROUGHPUT_METRIC = "generation_tokens_per_second"


@dataclass
class HylightGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the §5.4.2 switches. Defaults are the report's recipe (all three on) with TRL's token-level
    "dapo" aggregation; ``loss_type="cispo"`` swaps the clipped objective for CISPO (cap ``epsilon_high``, as in TRL;
    TRL recommends 5.0 there)."""

    clip_large_ratio_negative_advantage: bool = field(default=True, metadata={
        "help": "§5.4.2 (a): drop tokens with a negative advantage and IS ratio > large_ratio_threshold."})
    large_ratio_threshold: float | None = field(default=None, metadata={
        "help": "The ratio above which (a) drops negative-advantage tokens; None: 1 + epsilon_high (the clip edge)."})
    kl_estimator: str = field(default="stop_gradient", metadata={
        "help": "§5.4.2 (b): 'stop_gradient' = sg(π_θ - π_ref)·log π_θ; 'k3' = TRL's estimator. Needs beta != 0."})
    balance_advantages: bool = field(default=True, metadata={
        "help": "§5.4.2 (c): equal total token-weighted advantage for positive and negative completions per group."})
    beta: float = field(default=0.04, metadata={"help": "KL coefficient (GRPO, Shao et al. 2024: 0.04)."})
    use_bias_correction_kl: bool = field(default=False, metadata={
        "help": "TRL's IS-weighted KL (on by default in TRL 1.x): not wired into this loss, so off, and refused on "
                "with beta != 0 (it was silently ignored before)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.loss_type not in ("dapo", "cispo"):
            problems.append(f"loss_type={self.loss_type!r} (use 'dapo' for the clipped objective or 'cispo')")
        if self.loss_type == "cispo" and (self.epsilon_high is None or self.epsilon_high <= 1.0):
            problems.append(f"loss_type='cispo' with epsilon_high={self.epsilon_high} (CISPO reads epsilon_high as the "
                            "absolute cap of the IS weight, as TRL does; set it above 1, e.g. 5.0)")
        if self.kl_estimator not in ("stop_gradient", "k3"):
            problems.append(f"kl_estimator={self.kl_estimator!r} (use 'stop_gradient' or 'k3')")
        if self.use_bias_correction_kl and self.beta != 0.0:
            problems.append(f"use_bias_correction_kl=True with beta={self.beta} (TRL's importance-weighted KL is not "
                            "wired into this loss: the KL term is kl_estimator's, unweighted)")
        if self.importance_sampling_level != "token":
            problems.append(f"importance_sampling_level={self.importance_sampling_level!r} (only 'token')")
        if self.use_vllm:
            problems.append("use_vllm=True (vLLM IS correction is not wired into this loss)")
        if self.delta is not None:
            problems.append(f"delta={self.delta} (TRL's two-sided clip; use large_ratio_threshold, which is (a))")
        if self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None:
            problems.append("top_entropy_quantile < 1 or off_policy_mask_threshold set (not wired into this loss)")
        if self.entropy_coef != 0.0 or self.use_adaptive_entropy:
            problems.append("an entropy bonus (entropy_coef / use_adaptive_entropy; not wired into this loss)")
        if problems:
            raise ValueError("HylightGRPOConfig: unsupported settings: " + "; ".join(problems))

    @property
    def negative_ratio_max(self) -> float | None:
        """The (a) threshold passed to ``grpo_loss`` (None: (a) off)."""
        if not self.clip_large_ratio_negative_advantage:
            return None
        eps_high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        return self.large_ratio_threshold if self.large_ratio_threshold is not None else 1 + eps_high


class HylightGRPOTrainer(ModelBalanceLoss, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with the §5.4.2 loss and the model's own MoE balance loss (§2.1; posttrain/moe_loss.py).
    Takes a ``HylightGRPOConfig``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("args")
        if not isinstance(config, HylightGRPOConfig):
            raise TypeError(f"HylightGRPOTrainer needs args=HylightGRPOConfig(...); got {type(config).__name__}")
        super().__init__(*args, **kwargs)

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        mode = "train" if self.model.training else "eval"
        # Generate in eval mode: the MoE routes without capacity drop there whatever the config, so a rollout's
        # tokens never depend on the other sequences of its batch (the decode cache works in either mode).
        self.model.eval()
        start = time.perf_counter()
        try:
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        finally:
            self.model.train(mode == "train")
        seconds = time.perf_counter() - start
        tokens = sum(len(ids) for ids in completion_ids)  # TRL cut each completion after its first EOS
        self._metrics[mode][GENERATION_THROUGHPUT_METRIC].append(tokens / seconds if seconds > 0 else 0.0)
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        metrics["reward_mean"].append(metrics["reward"][-1])
        metrics["response_length"].append(metrics["completions/mean_length"][-1])
        if self.args.balance_advantages:
            mask = output["completion_mask"]
            if "tool_mask" in output:
                mask = mask * output["tool_mask"]
            # Groups may span processes: balance on the gathered batch, then keep this process's slice (TRL's
            # process_slice in _generate_and_score_completions).
            local = output["advantages"]
            all_adv = self.accelerator.gather(local)
            all_tokens = self.accelerator.gather(mask.sum(dim=1))
            num_generations = self.num_generations if mode == "train" else self.num_generations_eval
            balanced = balanced_advantages(all_adv, all_tokens, num_generations)
            start = self.accelerator.process_index * local.shape[0]
            output["advantages"] = balanced[start : start + local.shape[0]]
            logged = self._logs["advantages"]  # TRL's completions table: show the advantages actually used
            for _ in range(min(len(logged), balanced.numel())):
                logged.pop()
            logged.extend(balanced.tolist())
        return output

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        # no aux loss here: ModelBalanceLoss.compute_loss adds the model's own MoE balance loss around this
        logp, entropies, _ = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], dim=1), torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1), compute_entropy=True)
        # Without a stale policy (num_iterations == 1, aligned steps) TRL leaves old log-probs out: r = 1.
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_logp is None else old_logp

        mode = "train" if self.model.training else "eval"
        # TRL's "dapo"/"cispo" normaliser: active tokens of the global accumulated batch, per optimizer step.
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        out = grpo_loss(
            logp, old_logp, inputs["advantages"], mask,
            objective="cispo" if self.loss_type == "cispo" else "clipped_is",
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            ratio_max_negative=self.args.negative_ratio_max, cispo_ratio_max=self.epsilon_high,
            ref_logp=inputs.get("ref_per_token_logps"), beta=self.beta, kl_estimator=self.args.kl_estimator,
            normalizer=normalizer)
        loss = out.loss

        def token_mean(x: torch.Tensor) -> float:  # over all processes' masked tokens
            totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().to(x.dtype)]), "sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        tokens = mask.sum().to(logp.dtype)
        metrics = self._metrics[mode]
        metrics["clip_fraction"].append(_reduce_mean(self, out.clip_fraction, tokens))
        metrics["kl"].append(_reduce_mean(self, out.kl, tokens))
        metrics["policy_loss"].append(self.accelerator.gather(out.policy_loss).mean().item())
        if self.beta != 0.0:
            metrics["kl_loss"].append(self.accelerator.gather(out.kl_loss).mean().item())
        metrics["entropy"].append(token_mean(entropies.detach()))
        return loss


def _reduce_mean(trainer: GRPOTrainer, value: torch.Tensor, weight: torch.Tensor) -> float:
    """A per-process token mean combined over processes, weighted by each process's token count."""
    totals = trainer.accelerator.reduce(torch.stack([value * weight, weight]), "sum")
    return (totals[0] / totals[1].clamp(min=1.0)).item()


@dataclass
class PromptSelection:
    """What ``select_prompts_by_pass_rate`` kept and dropped, with every prompt's measured pass rate."""

    kept: list[Any]
    pass_rates: list[float]  # one per input prompt, in input order
    dropped_too_easy: int  # pass rate > hi
    dropped_too_hard: int  # pass rate < lo
    generate_seconds: float = 0.0  # wall seconds in model.generate (sampling), synchronised
    reward_seconds: float = 0.0  # wall seconds in the reward functions (reward model, checkers, sandbox)


def _prompt_text(tokenizer: Any, prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def select_prompts_by_pass_rate(model: Any, tokenizer: Any, prompts: Sequence[Any], reward_funcs: Sequence[RewardFunc],
                                *, k: int = 8, lo: float = 0.1, hi: float = 0.9, pass_threshold: float = 1.0,
                                max_new_tokens: int = 256, temperature: float = 1.0, batch_size: int = 8,
                                seed: int = 0) -> PromptSelection:
    """§5.4.2: "prioritizes prompts with moderate success rates": sample ``k`` completions per prompt, score them
    with the summed ``reward_funcs`` (TRL's signature), count a pass when the reward ≥ ``pass_threshold``, and keep
    the prompts whose pass rate lies in [lo, hi]. A prompt every sample solves (or none does) gives GRPO a group of
    equal rewards, hence zero advantages and no gradient."""
    if not 0.0 <= lo <= hi <= 1.0 or k < 1:
        raise ValueError(f"select_prompts_by_pass_rate: need 0 <= lo <= hi <= 1 and k >= 1; got lo={lo}, hi={hi}, "
                         f"k={k}")
    if tokenizer.pad_token_id is None:
        raise ValueError("select_prompts_by_pass_rate: the tokenizer has no pad token (batched sampling pads left)")
    # stop where TRL's rollout stops: the tokenizer's eos and the generation config's (e.g. a chat end-of-turn)
    eos_cfg = getattr(model.generation_config, "eos_token_id", None)
    stops = [tokenizer.eos_token_id] + [t for t in ([eos_cfg] if isinstance(eos_cfg, int) else eos_cfg or [])
                                        if t != tokenizer.eos_token_id]
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    rates: list[float] = []
    generate_seconds = reward_seconds = 0.0
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                chunk = list(prompts[start : start + batch_size])
                texts = [_prompt_text(tokenizer, p) for p in chunk]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
                t0 = time.perf_counter()
                out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                     max_new_tokens=max_new_tokens, num_return_sequences=k,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=stops)
                completions = out[:, enc["input_ids"].shape[1] :].tolist()  # a host copy: the GPU work is done
                t1 = time.perf_counter()
                generate_seconds += t1 - t0
                # one reward call per chunk (as TRL scores a whole batch): the reward model scores the chunk's
                # completions in one batch rather than k at a time
                ids = []
                for row in completions:  # up to and including the first EOS
                    end = next((j for j, t in enumerate(row) if t in stops), None)
                    ids.append(row[: end + 1] if end is not None else row)
                texts_all = tokenizer.batch_decode(ids, skip_special_tokens=True)
                flat_prompts = [p for p in chunk for _ in range(k)]
                # a chat prompt's completion is conversational, as TRL hands completions of chat prompts
                texts_all = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                             for p, t in zip(flat_prompts, texts_all, strict=True)]
                total = [0.0] * len(ids)
                for f in reward_funcs:
                    values = f(prompts=flat_prompts, completions=texts_all, completion_ids=ids)
                    total = [t + (0.0 if v is None else float(v)) for t, v in zip(total, values, strict=True)]
                for i in range(len(chunk)):
                    rates.append(sum(t >= pass_threshold for t in total[i * k : (i + 1) * k]) / k)
                reward_seconds += time.perf_counter() - t1
    finally:
        model.train(was_training)
        tokenizer.padding_side = side
    kept = [p for p, r in zip(prompts, rates, strict=True) if lo <= r <= hi]
    return PromptSelection(kept=kept, pass_rates=rates, dropped_too_easy=sum(r > hi for r in rates),
                           generate_seconds=generate_seconds, reward_seconds=reward_seconds,
                           dropped_too_hard=sum(r < lo for r in rates))


def train_grpo(model: Any, tokenizer: Any, prompts: Sequence[Any], reward_funcs: Sequence[RewardFunc],
               config: HylightGRPOConfig, output_dir: str | Path,
               callbacks: Sequence[Any] = (), resume_from_checkpoint: str | None = None) -> dict[str, Any]:
    """Run the §5.4.2 GRPO on ``prompts`` and save the policy to ``output_dir/policy``.

    ``model``: a saved model directory or a ``PreTrainedModel``; with beta != 0 TRL builds the reference policy
    from the model's directory, so an in-memory model is first saved to ``output_dir/initial_policy`` (the
    trainer then trains the copy loaded from there). Returns the policy path, step count, training loss, the last
    logged value of each interface metric and its per-log history. ``callbacks`` (transformers
    ``TrainerCallback``s, e.g. MLflow's) see every TRL log, the interface metrics among them."""
    import model as _hylight_model  # noqa: F401  (registers HybridForCausalLM with the Auto classes)

    output_dir = Path(output_dir)
    if isinstance(model, PreTrainedModel) and config.beta != 0.0:
        init_dir = output_dir / "initial_policy"
        model.save_pretrained(init_dir)
        model = str(init_dir)
    trainer = HylightGRPOTrainer(model=model, reward_funcs=list(reward_funcs), args=config,
                                 train_dataset=Dataset.from_dict({"prompt": list(prompts)}),
                                 processing_class=tokenizer, callbacks=list(callbacks) or None)
    if config.disable_tqdm:  # no bar and no printed log dicts: the caller relays logs through its callbacks
        trainer.remove_callback(PrinterCallback)
    result = train_from_checkpoint(trainer, resume_from_checkpoint)
    policy_dir = output_dir / "policy"
    trainer.save_model(str(policy_dir))
    history = [h for h in trainer.state.log_history if "reward_mean" in h or "clip_fraction" in h]
    series = {name: [h[name] for h in history if h.get(name) is not None] for name in INTERFACE_METRICS}
    missing = [name for name, values in series.items() if not values]
    if missing:
        raise RuntimeError(f"train_grpo: metrics {missing} were never logged (logging_steps={config.logging_steps}, "
                           f"steps={trainer.state.global_step}); set logging_steps <= max_steps")
    return {
        "policy_dir": str(policy_dir),
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "metrics": {name: values[-1] for name, values in series.items()},
        "history": series,
    }
