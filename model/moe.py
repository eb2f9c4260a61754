"""The MoE feed-forward (report §2.1, eq. 1): a top-k softmax router over SwiGLU experts.

Contract for a swappable feed-forward (the pretraining stage replaces this module with DeepSpeed-MoE layers
and a global router; the decoder layer only relies on this): ``forward(hidden [B, T, d], token_mask [B, T]
bool or None) -> MoEOutput`` whose ``hidden`` has the input's shape, ``aux_loss`` is the unscaled balance
loss (the model multiplies by ``router_aux_loss_coef``) and the counters say how many token slots were
routed and dropped.

Routing. Eq. 1 takes the softmax over the top-k logits. The released MiniMax (transformers'
``MiniMaxTopKRouter``) takes the softmax over all E logits, keeps the top k and renormalises them. The two are
the same function: p_i / sum_{j in top-k} p_j = exp(l_i) / sum_{j in top-k} exp(l_j), and top-k of the
probabilities is top-k of the logits. We compute it the released way (fp32 softmax, top-k, renormalise)
for bit-level parity, and because the full softmax is needed for the aux loss anyway.

Aux loss (§2.1): L_aux = alpha_aux * (1/E) * sum_i f_i * m_i, with f_i the fraction of routed token slots
that chose expert i (sum_i f_i = 1) and m_i the mean router probability of expert i over tokens; padding
tokens are excluded. ``aux_loss`` here is (1/E) * sum_i f_i * m_i; alpha_aux is applied by the model.

Token drop (§2.1, training only): each expert accepts at most ``capacity = ceil(capacity_factor * N * k / E)``
token slots; slots are admitted GShard-style, every token's first choice before any second choice, in token
order within a choice rank. A dropped slot contributes nothing (the other slot keeps its weight; the
token still has the residual path). Eval is dropless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEOutput:
    hidden: torch.Tensor  # [B, T, d]
    aux_loss: torch.Tensor  # scalar, (1/E) sum_i f_i m_i (unscaled by alpha_aux)
    router_logits: torch.Tensor  # [N, E] for the tokens of this call (padding included)
    routed: torch.Tensor  # int64 [E]: token slots that chose each expert (padding excluded)
    dropped: torch.Tensor  # int64 [E]: of those, slots over capacity (0 in eval / dropless)


class TopKRouter(nn.Module):
    """Linear gate W_g and the top-k selection of eq. 1."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> logits [N, E], probs [N, E] (fp32 or wider), top-k weights [N, k] (sum 1), indices."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)  # == softmax over the selected logits (eq. 1)
        return logits, probs, top_w, top_i


class SwiGLUExperts(nn.Module):
    """E SwiGLU FFNs stored as stacked weights (the released layout): gate_up [E, 2F, d], down [E, d, F]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(
        self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """x [N, d]; top_i/top_w/keep [N, k] -> sum over kept slots of w * FFN_e(x) [N, d]."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where((top_i == e) & keep)
            if token.numel() == 0:
                continue
            y = self.expert(e, x[token]) * top_w[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out


def capacity_keep_mask(
    top_i: torch.Tensor, valid: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Which routed slots fit in their expert's capacity; [N, k] bool.

    Admission order is choice-rank major (all first choices, then all second choices), token order within a
    rank, as in GShard. ``valid`` [N, k] marks the slots that compete at all (padding excluded).
    """
    n, k = top_i.shape
    rank_major = top_i.t().reshape(-1)  # [k*N]
    competing = valid.t().reshape(-1)
    one_hot = F.one_hot(rank_major, num_experts) * competing[:, None].long()
    position = (
        one_hot.cumsum(dim=0).gather(1, rank_major[:, None]).squeeze(1) - 1
    )  # slot's place in its expert
    keep = competing & (position < capacity)
    return keep.view(k, n).t()


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def balance_loss(probs: torch.Tensor, routed: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """(1/E) * sum_i f_i * m_i over the non-padding tokens (§2.1, before alpha_aux).

    ``routed`` [E]: token slots per expert (padding excluded); f_i = routed_i / sum(routed) carries no gradient,
    as in GShard; the gradient reaches the router through m_i, the mean routing probability.
    """
    num_experts = probs.shape[-1]
    if token_mask is None:
        m = probs.mean(0)
    else:
        weight = token_mask.to(probs.dtype)
        m = (probs * weight[:, None]).sum(0) / weight.sum().clamp(min=1.0)
    f = routed.to(probs.dtype) / routed.sum().clamp(min=1)
    return (f * m).sum() / num_experts


class MoEFeedForward(nn.Module):
    """h_t = sum_i softmax_i(TopK(x_t W_g)) FFN_i(x_t) (eq. 1), with capacity drop in training."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float = 1.25,
        token_drop: bool = True,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.token_drop = token_drop
        self.router = TopKRouter(hidden_size, num_experts, top_k)
        self.experts = SwiGLUExperts(num_experts, hidden_size, intermediate_size)

    @classmethod
    def from_config(cls, config) -> MoEFeedForward:
        return cls(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.capacity_factor,
            config.moe_token_drop,
        )

    def forward(self, hidden: torch.Tensor, token_mask: torch.Tensor | None = None) -> MoEOutput:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        mask = None if token_mask is None else token_mask.reshape(-1).bool()
        logits, probs, top_w, top_i = self.router(x)
        valid = torch.ones_like(top_i, dtype=torch.bool) if mask is None else mask[:, None].expand_as(top_i)
        routed = torch.bincount(top_i[valid], minlength=self.num_experts)
        if self.training and self.token_drop:
            n_real = x.shape[0] if mask is None else int(mask.sum())
            capacity = expert_capacity(n_real, self.top_k, self.num_experts, self.capacity_factor)
            keep = capacity_keep_mask(top_i, valid, self.num_experts, capacity)
            dropped = routed - torch.bincount(top_i[keep], minlength=self.num_experts)
        else:
            keep = valid  # dropless (padding still skipped: its output is never used)
            dropped = torch.zeros_like(routed)
        out = self.experts(x, top_i, top_w, keep)
        return MoEOutput(
            hidden=out.view(shape),
            aux_loss=balance_loss(probs, routed, mask),
            router_logits=logits,
            routed=routed,
            dropped=dropped,
        )
