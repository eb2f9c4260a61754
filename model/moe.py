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

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEOutput:
    """``aux_loss``, ``routed`` and ``dropped`` are None when the caller asked for no statistics (decode)."""

    hidden: torch.Tensor  # [B, T, d]
    aux_loss: torch.Tensor | None  # scalar, (1/E) sum_i f_i m_i (unscaled by alpha_aux)
    router_logits: torch.Tensor  # [N, E] for the tokens of this call (padding included)
    routed: torch.Tensor | None  # int64 [E]: token slots that chose each expert (padding excluded)
    dropped: torch.Tensor | None  # int64 [E]: of those, slots over capacity (0 in eval / dropless)


def top_k_by_argmax(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(probs, k)`` for small k as k argmax passes: the same values and indices, largest first (a tie
    goes to the lower index, where topk leaves the order unspecified)."""
    rest, picks = probs, []
    for _ in range(k):
        i = rest.argmax(-1, keepdim=True)
        picks.append(i)
        rest = rest.scatter(-1, i, float("-inf"))
    top_i = torch.cat(picks, dim=-1)
    return probs.gather(-1, top_i), top_i


# A compiled step with at most this many tokens (a small decode batch) computes the router logits as a reduction
# torch.compile generates (one small Triton kernel), not a cuBLAS matrix-vector product: for E = 8 rows of the gate
# the product's launch and latency (~3.7 us on an H100, 16 a step for gpu-300m) is most of its cost.
REDUCE_ROUTER_MAX_TOKENS = 4 if os.environ.get("HYLIGHT_DECODE_ROUTER_REDUCE", "1") != "0" else 0


def router_logits_by_reduction(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, d] @ weight[E, d]^T as a multiply and a sum in fp32 or wider (what a GEMM accumulates in), rounded to
    x's dtype as the GEMM's output is."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return (x[:, None, :].to(acc) * weight.to(acc)).sum(-1).to(x.dtype)


class TopKRouter(nn.Module):
    """Linear gate W_g and the top-k selection of eq. 1."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> logits [N, E], probs [N, E] (fp32 or wider), top-k weights [N, k] (sum 1), indices."""
        if x.shape[0] <= REDUCE_ROUTER_MAX_TOKENS and torch.compiler.is_compiling() and not torch.is_grad_enabled():
            logits = router_logits_by_reduction(x, self.weight)
        else:
            logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        if torch.is_grad_enabled() or self.top_k > 4:
            top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        else:  # decode: k argmax passes, which torch.compile fuses into the softmax (torch.topk is two kernels)
            top_w, top_i = top_k_by_argmax(probs, self.top_k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)  # == softmax over the selected logits (eq. 1)
        return logits, probs, top_w, top_i


# The dense path computes every expert for every token (E/k times the routed FLOPs) with fixed shapes and no
# host sync; the loop pays one device->host sync per expert (``torch.where`` on a mask). In a decode step
# (N = batch tokens) on a GPU the expert weights are read once either way and the GEMMs stay memory-bound
# (bf16 on an H100/H200: ~200 rows per weight read before compute dominates), so the extra FLOPs are ~free.
DENSE_MAX_TOKENS = 64
# On CPU the dense path is compute-bound much earlier; it wins while its N*E*3*d*F multiply-adds stay under
# ~2^24 (fp32, 1 thread, bench/bench_moe_experts.py: crossover near N=128 for tiny, N=16 for cpu-small).
DENSE_MAX_MACS_CPU = 2**24
# Devices where the grouped GEMM (``torch._grouped_mm``: all experts in one kernel, no sync) replaces the loop
# above the dense sizes. Not CPU: there the loop has no sync to save, and measured it is as fast or faster
# (fp32, N = 512..4096, tiny and cpu-small).
GROUPED_MM_DEVICES = frozenset({"cuda"})
# Devices where a decode step with fewer routed slots than experts (N * top_k < E, e.g. batch 1) runs the Triton
# matrix-vector kernels of kernels/moe_decode.py, which read only the chosen experts' weights, once.
GEMV_DEVICES = frozenset({"cuda"})


# answers of grouped_mm_supported, read by path_for: under torch.compile (a decode step) a dict lookup is traced as a
# constant, where the probe itself (autograd on inside) would break the graph
_GROUPED_MM_KNOWN: dict[tuple, bool] = {}


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here (decided once per device, dtype, shapes).

    It needs rows whose byte strides are multiples of 16 and, depending on the build, a dtype and a GPU
    architecture (e.g. bf16 on Hopper); anything it refuses falls back to the loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any(n * dtype.itemsize % 16 for n in (hidden, 2 * intermediate, intermediate)):
        return False
    try:
        # the first call may come from generate (inference mode): probe with autograd on, in plain tensors
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            x = torch.ones(16, hidden, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(1, hidden, 2 * intermediate, device=device, dtype=dtype, requires_grad=True)
            offs = torch.tensor([16], device=device, dtype=torch.int32)
            y = torch._grouped_mm(x, w, offs=offs)
            y.backward(torch.ones_like(y))
        ok = True
    except (RuntimeError, NotImplementedError):
        ok = False
    _GROUPED_MM_KNOWN[(device, dtype, hidden, intermediate)] = ok
    return ok


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (always False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SwiGLUExperts(nn.Module):
    """E SwiGLU FFNs stored as stacked weights (the released layout): gate_up [E, 2F, d], down [E, d, F].

    ``forward`` has four interchangeable paths, equal up to float rounding (tests/test_model_moe.py):
    ``gemv`` (a few tokens: Triton matrix-vector kernels over the chosen experts only), ``dense`` (small N, every
    expert on every token), ``grouped`` (slots sorted by expert, two grouped GEMMs) and ``loop`` (one expert at a
    time, the reference); :meth:`path_for` picks one."""

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
        path = self.path_for(x, top_i.shape[1])
        if path == "gemv":
            from kernels.moe_decode import moe_decode_ffn

            return moe_decode_ffn(x, self.gate_up_proj, self.down_proj, top_i, top_w.masked_fill(~keep, 0))
        if path == "dense":
            return self.forward_dense(x, top_i, top_w, keep)
        if path == "grouped":
            return self.forward_grouped(x, top_i, top_w, keep)
        return self.forward_loop(x, top_i, top_w, keep)

    def path_for(self, x: torch.Tensor, top_k: int = 2) -> str:
        """The path for N = len(x) tokens when no gradient is taken (decode): "gemv" where fewer slots than experts
        are routed (N * top_k < E, batch-1 decode; GEMV_DEVICES), else "dense" for small N (DENSE_MAX_TOKENS,
        DENSE_MAX_MACS_CPU); with gradients, or above those sizes, "grouped" where the grouped GEMM runs
        (GROUPED_MM_DEVICES), else "loop". Not dense with gradients: an expert a token did not choose is computed
        and masked, and an inf in its activations would turn the masked zero gradient into NaN (0 * inf) in the
        weights' gradients."""
        n = x.shape[0]
        d, f = self.down_proj.shape[1:]
        dense_macs = n * self.num_experts * 3 * d * f
        grad = torch.is_grad_enabled() and (x.requires_grad or self.gate_up_proj.requires_grad)
        if not grad and n * top_k < self.num_experts and x.device.type in GEMV_DEVICES:
            return "gemv"
        if not grad and n <= DENSE_MAX_TOKENS and (x.device.type != "cpu" or dense_macs <= DENSE_MAX_MACS_CPU):
            return "dense"
        if x.device.type in GROUPED_MM_DEVICES:
            key = (x.device, _compute_dtype(x), d, f)
            # torch 2.11's grouped_mm is sync-free only in bf16: in fp32 (post-training's policy) eager copies the
            # offsets to the host and the compile-time kernel refuses it. So a decode step that is traced or
            # captured into a CUDA graph runs fp32 through "dense" (no sync; the loop syncs per expert).
            tracing = torch.compiler.is_compiling() or _capturing(x.device)
            known = _GROUPED_MM_KNOWN.get(key)
            if known is None and not tracing:  # the probe runs kernels and a backward: never inside a capture
                known = grouped_mm_supported(*key)
            if known and (key[1] == torch.bfloat16 or not tracing):
                return "grouped"
            if tracing and not grad:
                return "dense"
        return "loop"

    def forward_loop(
        self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """The reference: one expert at a time over the slots that chose it (a host sync per expert)."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where((top_i == e) & keep)
            if token.numel() == 0:
                continue
            y = self.expert(e, x[token]) * top_w[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out

    def forward_dense(
        self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every token, combined with a dense [N, E] weight matrix: fixed shapes, no sync."""
        n, e = x.shape[0], self.num_experts
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(-2, -1)).chunk(2, dim=-1)  # [E, N, F] each
        y = torch.matmul(F.silu(gate) * up, self.down_proj.transpose(-2, -1))  # [E, N, d]
        # top-k indices are distinct per token, so scatter (not scatter_add) places each slot once
        selected = torch.zeros(n, e, dtype=torch.bool, device=x.device).scatter(1, top_i, keep)
        weight = torch.zeros(n, e, dtype=x.dtype, device=x.device).scatter(1, top_i, top_w.to(x.dtype))
        # where, not a multiply by 0: an unselected expert's inf/NaN must not reach the output (0 * inf = NaN)
        y = torch.where(selected.t()[..., None], y, 0) * weight.t()[..., None]
        return y.sum(0)

    def forward_grouped(
        self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """Kept slots sorted by expert through two grouped GEMMs (``torch._grouped_mm``): no sync.

        Slots not kept sort into a trailing group past the last offset; the grouped GEMM leaves those rows
        undefined, so they are masked with ``where`` on the way in and out."""
        k, e = top_i.shape[1], self.num_experts
        key = torch.where(keep, top_i, e).reshape(-1)  # [N*k], token-major; not kept -> group E
        order = torch.sort(key, stable=True).indices  # by expert, token order within an expert
        token = order // k
        offs = slots_per_expert(key, e).cumsum(0).to(torch.int32)
        kept = keep.reshape(-1)[order][:, None]
        dtype = _compute_dtype(x)
        rows = torch.where(kept, x[token], 0).to(dtype)
        h = torch._grouped_mm(rows, self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offs)  # [N*k, 2F]
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.to(dtype).transpose(-2, -1), offs=offs)
        y = torch.where(kept, y, 0) * top_w.reshape(-1)[order][:, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


def slots_per_expert(key: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: how many entries of ``key`` (expert ids; ``num_experts`` = not counted) name each expert.

    A scatter-add, not ``bincount(top_i[mask])``: boolean indexing and CUDA's bincount both wait on the host."""
    key = key.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=key.device)
    return counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on (as F.linear in the loop), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def capacity_keep_mask(
    top_i: torch.Tensor, valid: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Which routed slots fit in their expert's capacity; [N, k] bool.

    Admission order is choice-rank major (all first choices, then all second choices), token order within a
    rank, as in GShard. ``valid`` [N, k] marks the slots that compete at all (padding excluded).
    """
    n, k = top_i.shape
    competing = valid.t().reshape(-1)
    key = torch.where(competing, top_i.t().reshape(-1), num_experts)  # [k*N] rank-major; not competing -> E
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=key.device).scatter_add_(
        0, key, torch.ones_like(key))
    keep = competing & (slot_positions(key, counts) < capacity)
    return keep.view(k, n).t()


def slot_positions(key: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each slot's place among the slots of its expert, in slot order: key [M] expert ids (E: no expert),
    counts [E + 1] their counts. One stable sort, not a one-hot [M, E] cumsum: on an H100 that int64 cumsum took
    37% of the library's training step at 2K tokens (issue 24). pretrain/moe.py admits with the same function."""
    order = torch.sort(key, stable=True).indices
    starts = counts.cumsum(0) - counts
    pos = torch.empty_like(key)
    pos[order] = torch.arange(key.numel(), device=key.device) - starts[key[order]]
    return pos


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

    def forward(self, hidden: torch.Tensor, token_mask: torch.Tensor | None = None, stats: bool = True) -> MoEOutput:
        """``stats=False``: no balance loss and no counters (None), dropless; the decode step's few kernels."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        mask = None if token_mask is None else token_mask.reshape(-1).bool()
        logits, probs, top_w, top_i = self.router(x)
        valid = torch.ones_like(top_i, dtype=torch.bool) if mask is None else mask[:, None].expand_as(top_i)
        if not stats:
            out = self.experts(x, top_i, top_w, valid)
            return MoEOutput(hidden=out.view(shape), aux_loss=None, router_logits=logits, routed=None, dropped=None)
        routed = slots_per_expert(torch.where(valid, top_i, self.num_experts), self.num_experts)
        if self.training and self.token_drop:
            n_real = x.shape[0] if mask is None else int(mask.sum())
            capacity = expert_capacity(n_real, self.top_k, self.num_experts, self.capacity_factor)
            keep = capacity_keep_mask(top_i, valid, self.num_experts, capacity)
            dropped = routed - slots_per_expert(torch.where(keep, top_i, self.num_experts), self.num_experts)
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


def make_dropless(model: nn.Module) -> nn.Module:
    """``model`` with MoE token dropping off, in place: post-training's log-probs and rewards must not depend on
    what else is in the batch (a capacity drop does). The config flag is read by each MoE layer at construction,
    so the built layers are switched too."""
    model.config.moe_token_drop = False
    for m in model.modules():
        if hasattr(m, "token_drop"):
            m.token_drop = False
    return model
