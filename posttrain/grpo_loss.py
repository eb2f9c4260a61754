"""The per-token terms of the modified GRPO of §5.4.2, as pure functions of log-probabilities (no TRL).

Notation (per token t of completion i): logp = log π_θ(a_t|s_t) (carries the gradient), old = log π_old (the
sampling policy, no gradient), ref = log π_ref, r = exp(logp - old) the importance-sampling (IS) ratio, A_i the
advantage of completion i, m the mask (1 = a completion token that counts, 0 = padding / after EOS).

Terms and switches:
  group_normalized_advantages  GRPO (Shao et al. 2024): A_i = (R_i - mean_g R) / (std_g R + eps), per prompt group.
  balanced_advantages          §5.4.2 (c): per group, rescale the positive and the negative advantages so both sides
                               carry the same total weight Σ|A_i|·n_i (n_i = tokens of completion i).
  clipped_is_objective         PPO/GRPO clip, plus §5.4.2 (a): a token with A < 0 and r > ratio_max is dropped.
  cispo_objective              CISPO (MiniMax-M1): -sg(clip(r)) · A · logp.
  stop_gradient_kl             §5.4.2 (b): sg(π_θ - π_ref) · log π_θ.
  k3_kl                        the usual estimator exp(ref - logp) - (ref - logp) - 1 (TRL's, and the `kl` metric).
  grpo_loss                    the sum of the switched terms, normalised over tokens, with diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Objective = Literal["clipped_is", "cispo"]
KLEstimator = Literal["stop_gradient", "k3"]


def group_normalized_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True,
                                eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: A_i = R_i - mean of its group, divided by (std of the group + eps) when ``scale``.

    ``rewards``: [N], N = groups * group_size, the completions of one prompt consecutive. The std is the unbiased
    (N-1) one, as TRL's ``nanstd`` computes it, so this matches TRL's ``scale_rewards="group"``."""
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries; got shape "
                         f"{tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size)
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (grouped.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def balanced_advantages(advantages: torch.Tensor, token_counts: torch.Tensor, group_size: int) -> torch.Tensor:
    """§5.4.2 (c), balanced advantage estimation: equal total weight for the positive and negative examples.

    With a token-level loss (sum over tokens / token count, TRL's "dapo"), completion i moves the policy with weight
    |A_i|·n_i. Group-centred advantages have Σ A_i = 0, but the token-weighted sums do not balance when, say, the
    failures are long and the successes short (a skewed distribution). Per group, with
    S+ = Σ_{A_i>0} A_i·n_i and S- = Σ_{A_i<0} |A_i|·n_i, positives are scaled by (S+ + S-)/(2 S+) and negatives by
    (S+ + S-)/(2 S-): afterwards both sides weigh (S+ + S-)/2 and the group's total weight is unchanged.
    A group with only one sign (or all zeros: every completion scored the same) has nothing to balance against and
    is returned unchanged. ``token_counts`` of ones balance per sequence instead of per token."""
    if advantages.shape != token_counts.shape or advantages.dim() != 1 or advantages.numel() % group_size != 0:
        raise ValueError(f"advantages and token_counts must be 1-D, of equal shape, a multiple of group_size="
                         f"{group_size}; got {tuple(advantages.shape)} and {tuple(token_counts.shape)}")
    adv = advantages.view(-1, group_size)
    weight = adv.abs() * token_counts.view(-1, group_size).to(adv.dtype)
    pos, neg = adv > 0, adv < 0
    s_pos = (weight * pos).sum(dim=1, keepdim=True)
    s_neg = (weight * neg).sum(dim=1, keepdim=True)
    both = (s_pos > 0) & (s_neg > 0)
    half = (s_pos + s_neg) / 2
    pos_scale = torch.where(both, half / s_pos.clamp(min=torch.finfo(adv.dtype).tiny), 1.0)
    neg_scale = torch.where(both, half / s_neg.clamp(min=torch.finfo(adv.dtype).tiny), 1.0)
    return torch.where(pos, adv * pos_scale, torch.where(neg, adv * neg_scale, adv)).reshape(-1)


# The largest log-ratio log π_θ - log π_old fed to exp: past ~88 float32's exp overflows to inf, and an inf ratio
# makes the loss inf and its gradient NaN even where the token is masked or dropped (0 · inf). Ratios beyond e^20
# (~4.9e8) are far outside any clip range: the cap changes no clipped value, and the gradient through it is 0.
LOG_RATIO_MAX = 20.0


def clipped_is_objective(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                         epsilon_low: float, epsilon_high: float,
                         ratio_max_negative: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of the clipped IS objective and the mask of tokens whose gradient clipping changed.

    Standard one-sided clip (Schulman et al. 2017): loss = -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A). Its gradient
    is zero when A > 0 and r > 1+ε_high, or A < 0 and r < 1-ε_low; but for A < 0 and r > 1+ε_high the min picks the
    unclipped r·A, whose gradient r·A·∇logp grows without bound in r: the instability §5.4.2 (a) names.
    §5.4.2 (a) "abandons this case": with ``ratio_max_negative`` = c (None: off), a token with A < 0 and r > c
    is dropped from the policy term (value 0, gradient 0). It still counts in the token normaliser.
    ``advantages``: [B, 1] (per sequence) or [B, T]."""
    ratio = torch.exp((logp - old_logp).clamp(max=LOG_RATIO_MAX))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages
    loss = -torch.min(unclipped, clipped)
    changed = ((advantages > 0) & (ratio > 1 + epsilon_high)) | ((advantages < 0) & (ratio < 1 - epsilon_low))
    if ratio_max_negative is not None:
        dropped = (advantages < 0) & (ratio > ratio_max_negative)
        loss = torch.where(dropped, torch.zeros_like(loss), loss)
        changed = changed | dropped
    return loss, changed


def cispo_objective(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                    ratio_max: float, ratio_min: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): loss = -sg(clip(r, ratio_min, ratio_max)) · A · logp. The IS weight is clipped and
    detached, so every token keeps a gradient A·w·∇logp with w bounded. Returns the per-token loss and the mask of
    tokens whose weight was clipped (and A ≠ 0, so the gradient changed)."""
    ratio = torch.exp((logp - old_logp).clamp(max=LOG_RATIO_MAX)).detach()
    weight = torch.clamp(ratio, min=ratio_min, max=ratio_max)
    changed = (weight != ratio) & (advantages != 0)
    return -weight * advantages * logp, changed


def stop_gradient_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """§5.4.2 (b): D_KL(θ) per token = sg(π_θ - π_ref) · log π_θ, probabilities of the sampled token. Its gradient
    is (π_θ - π_ref)·∇log π_θ: it lowers log π_θ where π_θ > π_ref and raises it where π_θ < π_ref, with a weight
    bounded by 1 (no exp(ref - logp) factor as in k3's gradient, whence the lower variance)."""
    return (torch.exp(logp) - torch.exp(ref_logp)).detach() * logp


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(π_θ || π_ref) per token: exp(ref - logp) - (ref - logp) - 1 (≥ 0). TRL's KL penalty
    and the logged ``kl`` metric."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass
class GRPOLossOutput:
    loss: torch.Tensor  # scalar, differentiable: (Σ_t m·(policy + β·kl_term)) / normalizer
    policy_loss: torch.Tensor  # scalar, detached: the policy part of ``loss``
    kl_loss: torch.Tensor  # scalar, detached: the KL term's part of ``loss`` before β (0 without a reference)
    kl: torch.Tensor  # scalar, detached: masked mean of k3 (an estimate of KL(π_θ||π_ref)); 0 without a reference
    clip_fraction: torch.Tensor  # scalar, detached: fraction of masked tokens whose gradient clipping changed
    per_token_loss: torch.Tensor  # [B, T]: policy + β·kl_term, not masked


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              objective: Objective = "clipped_is", epsilon_low: float = 0.2, epsilon_high: float = 0.2,
              ratio_max_negative: float | None = None, cispo_ratio_max: float = 5.0,
              ref_logp: torch.Tensor | None = None, beta: float = 0.0,
              kl_estimator: KLEstimator = "stop_gradient",
              normalizer: torch.Tensor | float | None = None) -> GRPOLossOutput:
    """The modified GRPO loss of §5.4.2 with each modification switchable.

    ``logp``, ``old_logp``, ``ref_logp``, ``mask``: [B, T]; ``advantages``: [B] or [B, T] (already normalised and,
    for (c), balanced). (a) is on when ``ratio_max_negative`` is set (clipped_is; CISPO's weights are bounded by
    ``cispo_ratio_max`` already). (b) is ``kl_estimator="stop_gradient"`` (``"k3"``: TRL's penalty), active when
    ``beta`` ≠ 0 and ``ref_logp`` is given. The loss is Σ over masked tokens / ``normalizer`` (default: the number
    of masked tokens, the token-level "dapo" aggregation); padding never enters any sum or count."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if objective == "clipped_is":
        policy, changed = clipped_is_objective(logp, old_logp, advantages, epsilon_low=epsilon_low,
                                               epsilon_high=epsilon_high, ratio_max_negative=ratio_max_negative)
    elif objective == "cispo":
        policy, changed = cispo_objective(logp, old_logp, advantages, ratio_max=cispo_ratio_max)
    else:
        raise ValueError(f"unknown GRPO objective {objective!r}; use 'clipped_is' or 'cispo'")
    m = mask.to(logp.dtype)
    keep = mask.bool()  # sums select with where(), not a product: a masked token's inf never reaches them (0 · inf)
    tokens = m.sum().clamp(min=1.0)
    norm = tokens if normalizer is None else normalizer
    per_token = policy
    zero = logp.new_zeros(())
    kl_loss, kl = zero, zero
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("grpo_loss: beta != 0 needs ref_logp (log-probs of the reference policy)")
        if kl_estimator == "stop_gradient":
            kl_term = stop_gradient_kl(logp, ref_logp)
        elif kl_estimator == "k3":
            kl_term = k3_kl(logp, ref_logp)
        else:
            raise ValueError(f"unknown kl_estimator {kl_estimator!r}; use 'stop_gradient' (§5.4.2 b) or 'k3'")
        per_token = policy + beta * kl_term
        kl_loss = (torch.where(keep, kl_term, 0.0).sum() / norm).detach()
        kl = (torch.where(keep, k3_kl(logp, ref_logp), 0.0).sum() / tokens).detach()
    loss = torch.where(keep, per_token, 0.0).sum() / norm
    return GRPOLossOutput(
        loss=loss, policy_loss=(torch.where(keep, policy, 0.0).sum() / norm).detach(), kl_loss=kl_loss, kl=kl,
        clip_fraction=((changed.expand_as(m) * m).sum() / tokens).detach(), per_token_loss=per_token)
