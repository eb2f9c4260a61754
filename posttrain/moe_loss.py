"""The MoE balance loss every post-training trainer optimises: the model's own (report §2.1), once.

Left to themselves, TRL's trainers (1.16) get this wrong. SFT, DPO and GRPO add ``router_aux_loss_coef`` times
the loss their fused LM head computes from the router logits, Mixtral's ``E · Σ_i (Σ_slots f_i) · P_i``. That
is k·E² times the model's own ``(1/E) Σ_i f_i m_i`` (model/moe.py ``balance_loss``): ×32 at tiny's E = 4, k = 2
(31.8 measured), ×128 at gpu-300m's E = 8. Post-training then mostly optimised expert balance. The reward
model adds no balance loss at all: the classification head drops what the backbone returns.

:class:`ModelBalanceLoss` turns TRL's term off and adds ``router_aux_loss_coef`` times the ``aux_loss`` that the
backbone (``model.modeling.HybridModel``) itself returns in the trainer's forward. That is what
``HybridForCausalLM`` adds to its own loss, so every stage optimises the balance loss of pretraining.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def recorded_balance_losses(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, the list of ``aux_loss`` values (§2.1, before ``router_aux_loss_coef``) that the
    ``HybridModel`` backbone in ``model`` returned, one per forward. The backbone is found inside any wrapper
    (DDP, PEFT). A forward without statistics (a decode step) returns none and adds nothing. Every forward of
    that backbone counts, so a reference computed on the same backbone (PEFT DPO with adapters off) would count
    too. The stages' DPO reference is a separate model."""
    from model.modeling import HybridModel  # heavy: transformers

    backbones = [m for m in model.modules() if isinstance(m, HybridModel)]
    if len(backbones) != 1:
        raise TypeError(f"MoE balance loss: expected one model.modeling.HybridModel backbone in "
                        f"{type(model).__name__}, found {len(backbones)}; post-training trains hylight models only")
    losses: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: Any, output: Any) -> None:
        if output.aux_loss is not None:
            losses.append(output.aux_loss)

    handle = backbones[0].register_forward_hook(record)
    try:
        yield losses
    finally:
        handle.remove()


class ModelBalanceLoss:
    """A mixin for a TRL trainer (put it first among the bases). It replaces TRL's MoE balance term with
    ``router_aux_loss_coef × the model's own §2.1 loss``.

    The coefficient is the one TRL resolves: its args' ``router_aux_loss_coef``, else the model config's. The
    reward trainer has no such field, so there it is the model config's. If ``compute_loss`` runs the backbone
    several times (GRPO's chunks), the term is the mean of the per-forward losses, as TRL averages its own.
    Each forward's loss is a mean over its micro-batch. Where the trainer's loss is already scaled for gradient
    accumulation, the term is divided by the accumulation steps; otherwise ``Trainer`` divides the whole loss.
    This is the same rule TRL applies to its own term.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        coef = getattr(self, "router_aux_loss_coef", None)
        if coef is None:
            coef = getattr(self.accelerator.unwrap_model(self.model).config, "router_aux_loss_coef", 0.0)
        self.balance_loss_coef = float(coef)
        # TRL's own Mixtral-formula term off. The fused head may still compute it into `outputs.loss`, but no
        # trainer here reads that.
        self.aux_loss_enabled = False

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        with recorded_balance_losses(model) as losses:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
        if self.balance_loss_coef == 0.0:
            return result
        if not losses:
            raise RuntimeError(f"{type(self).__name__}: the model's backbone returned no MoE balance loss in "
                               "compute_loss (was it called with output_moe_stats=False?)")
        loss, outputs = result if return_outputs else (result, None)
        balance = torch.stack(losses).mean()
        loss = loss + self.balance_loss_coef * balance.to(loss.device) / self._balance_loss_divisor(num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather(balance.detach()).mean().item())
        return (loss, outputs) if return_outputs else loss

    def _balance_loss_divisor(self, num_items_in_batch: Any) -> int:
        """The gradient-accumulation steps if ``Trainer.training_step`` will not divide the loss by them, else 1.
        This mirrors the loss scaling that ``training_step`` itself decides."""
        if not self.model.training:
            return 1
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        return self.current_gradient_accumulation_steps if scaled else 1


@functools.cache
def model_balance_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (a TRL trainer class) with :class:`ModelBalanceLoss`. The stages import TRL lazily, so
    the subclass is made on demand, once per class."""
    return type(f"ModelBalance{trainer_cls.__name__}", (ModelBalanceLoss, trainer_cls),
                {"__doc__": f"{trainer_cls.__name__} optimising the model's own MoE balance loss (§2.1)."})
