"""The MoE feed-forward (report §2.1, eq. 1): a top-k softmax router over SwiGLU experts.

The one MoE of hylight. The decoder layer relies only on ``forward(hidden [B, T, d], token_mask [B, T] bool or
None) -> MoEOutput`` whose ``hidden`` has the input's shape, ``aux_loss`` is the unscaled balance loss (the model
multiplies by ``router_aux_loss_coef``) and the counters say how many token slots were routed and dropped. The
pretraining stage swaps in ``pretrain.moe.DeepSpeedMoEFeedForward``: this class on DeepSpeed-MoE, overriding two
hooks (the global router's capacity, expert parallelism); routing, admission, dispatch and the experts are here.

Layout of one call: N tokens, k slots each, slots numbered choice-rank major (slot s = choice s // N of token
s % N). Admission (:func:`admit`) and dispatch (:func:`dispatch_combine`) both work on that slot order: one stable
sort groups the kept slots by expert, the experts run on contiguous rows (two grouped GEMMs on a GPU), and the
outputs come back by the inverse permutation. A few tokens (decode) skip the sort (the ``gemv``/``dense`` paths).

Routing. Eq. 1 takes the softmax over the top-k logits. The released MiniMax (transformers'
``MiniMaxTopKRouter``) takes the softmax over all E logits, keeps the top k and renormalises them. The two are
the same function: p_i / sum_{j in top-k} p_j = exp(l_i) / sum_{j in top-k} exp(l_j), and top-k of the
probabilities is top-k of the logits. We compute it the released way (fp32 softmax, top-k, renormalise)
for bit-level parity, and because the full softmax is needed for the aux loss anyway.

Aux loss (§2.1): L_aux = alpha_aux * (1/E) * sum_i f_i * m_i, with f_i the fraction of routed token slots
that chose expert i (sum_i f_i = 1) and m_i the mean router probability of expert i over tokens; padding
tokens are excluded. ``aux_loss`` here is (1/E) * sum_i f_i * m_i; alpha_aux is applied by the model. The released
code's loss (transformers' ``load_balancing_loss_func``, as Mixtral's) is E * sum_i (k f_i) * P_i, k E^2 times this
one (x128 at E = 8, k = 2): we follow the report's formula, so the same alpha_aux weighs k E^2 times less here.

Token drop (§2.1, training only): each expert accepts at most ``capacity = ceil(capacity_factor * N * k / E)``
token slots; slots are admitted GShard-style, every token's first choice before any second choice, in token
order within a choice rank. A dropped slot contributes nothing (the other slot keeps its weight; the
token still has the residual path). Eval is dropless.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
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
# Devices where a step traced before the probe ever ran (a compiled training step's first call) takes the grouped GEMM
# in bf16 without probing (the probe runs kernels, which a trace cannot).
GROUPED_MM_UNPROBED_DEVICES = frozenset({"cuda"})
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
    if not _grouped_mm_strides_ok(dtype, hidden, intermediate):
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


def _grouped_mm_strides_ok(dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """``torch._grouped_mm`` exists here and every weight and activation row is a multiple of 16 bytes."""
    return hasattr(torch, "_grouped_mm") and not any(
        n * dtype.itemsize % 16 for n in (hidden, 2 * intermediate, intermediate))


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (always False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SwiGLUExperts(nn.Module):
    """E SwiGLU FFNs stored as stacked weights (the released layout): gate_up [E, 2F, d], down [E, d, F].

    Four interchangeable paths, equal up to float rounding (tests/test_model_moe.py), which :meth:`path_for` picks
    among: ``gemv`` (a few tokens: Triton matrix-vector kernels over the chosen experts only) and ``dense`` (small N,
    every expert on every token) work on the tokens as they are; ``grouped`` (two grouped GEMMs) and ``loop`` (one
    expert at a time) work on slots sorted by expert (:func:`dispatch_combine`, the MoE layer's dispatch).
    :meth:`forward_reference` is the plain per-expert reference the tests compare them with."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """FFN_e(x), the gate and up halves as two matmuls (the loop's and the reference's expert): on a CPU this is
        bit for bit what the pretrain stage's per-expert loop computed before the two MoEs became one (issue 24), so
        its artifacts kept their bytes."""
        f = self.down_proj.shape[-1]
        w = self.gate_up_proj[e]
        return F.linear(swiglu(F.linear(x, w[:f]), F.linear(x, w[f:])), self.down_proj[e])

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The grouped path's SwiGLU: [..., 2F] (gate, then up) -> silu(gate) * up [..., F]. A hook: the stage's layer
        swaps in a one-kernel version on CUDA (pretrain/moe.py)."""
        return swiglu(*gate_up.chunk(2, dim=-1))

    def forward(
        self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, keep: torch.Tensor, path: str | None = None
    ) -> torch.Tensor:
        """x [N, d]; top_i/top_w/keep [N, k] -> sum over kept slots of w * FFN_e(x) [N, d] (``path``: forced)."""
        path = path or self.path_for(x, top_i.shape[1])
        if path in TOKEN_PATHS:
            return self.forward_tokens(path, x, top_i, top_w, keep)
        kept_key = torch.where(keep.t().reshape(-1), top_i.t().reshape(-1), self.num_experts)
        return dispatch_combine(x, kept_key, top_w.t().reshape(-1), slots_per_expert(kept_key, self.num_experts),
                                top_i.shape[1], lambda rows, counts: self.forward_sorted(rows, counts, path))

    def forward_tokens(
        self, path: str, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """The paths that need no sort: ``gemv`` and ``dense``."""
        if path == "gemv":
            from kernels.moe_decode import moe_decode_ffn  # imports Triton: only where a decode step runs it

            return moe_decode_ffn(x, self.gate_up_proj, self.down_proj, top_i, top_w.masked_fill(~keep, 0))
        return self.forward_dense(x, top_i, top_w, keep)

    def forward_sorted(self, rows: torch.Tensor, counts: torch.Tensor, path: str) -> torch.Tensor:
        """rows [M, d] grouped by expert (``counts`` [E] rows each, in expert order; rows past their sum are
        ignored and their outputs undefined) -> each row's expert output [M, d], in the experts' compute dtype."""
        if path == "grouped":
            return self.forward_grouped(rows, counts)
        return self.forward_loop(rows, counts)

    def path_for(self, x: torch.Tensor, top_k: int = 2, tokens_paths: bool = True) -> str:
        """The path for N = len(x) tokens when no gradient is taken (decode): "gemv" where fewer slots than experts
        are routed (N * top_k < E, batch-1 decode; GEMV_DEVICES), else "dense" for small N (DENSE_MAX_TOKENS,
        DENSE_MAX_MACS_CPU); with gradients, or above those sizes, "grouped" where the grouped GEMM runs
        (GROUPED_MM_DEVICES), else "loop". Not dense with gradients: an expert a token did not choose is computed
        and masked, and an inf in its activations would turn the masked zero gradient into NaN (0 * inf) in the
        weights' gradients. ``tokens_paths=False``: only "grouped" or "loop" (a rank that holds only some experts)."""
        n = x.shape[0]
        d, f = self.down_proj.shape[1:]
        dense_macs = n * self.num_experts * 3 * d * f
        grad = torch.is_grad_enabled() and (x.requires_grad or self.gate_up_proj.requires_grad)
        small = tokens_paths and not grad
        if small and n * top_k < self.num_experts and x.device.type in GEMV_DEVICES:
            return "gemv"
        if small and n <= DENSE_MAX_TOKENS and (x.device.type != "cpu" or dense_macs <= DENSE_MAX_MACS_CPU):
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
            elif known is None:  # traced before any eager call (a compiled training step): bf16 on CUDA, as the
                # stage's layers always ran it; else the loop, which a trace unrolls per expert (slow, but it runs)
                known = (key[1] == torch.bfloat16 and x.device.type in GROUPED_MM_UNPROBED_DEVICES
                         and _grouped_mm_strides_ok(key[1], d, f))
            if known and (key[1] == torch.bfloat16 or not tracing):
                return "grouped"
            if tracing and small:
                return "dense"
        return "loop"

    def forward_reference(
        self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """The reference: one expert at a time over the (token, slot) pairs that chose it, no sort."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where((top_i == e) & keep)
            if token.numel() == 0:
                continue
            y = self.expert(e, x[token]) * top_w[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out

    def forward_loop(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Sorted rows through one expert at a time: reads the group bounds on the host (a sync per expert on a
        GPU; none to save on a CPU)."""
        out = torch.zeros_like(rows)
        ends = counts.cumsum(0)
        start = 0
        for e in range(self.num_experts):
            end = int(ends[e])
            if end > start:
                out[start:end] = self.expert(e, rows[start:end]).to(rows.dtype)
            start = end
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

    def forward_grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Sorted rows through two grouped GEMMs (``torch._grouped_mm``, all experts in one kernel each): no sync."""
        dtype = _compute_dtype(rows)
        offs = counts.cumsum(0, dtype=torch.int32)
        h = torch._grouped_mm(rows.to(dtype), self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offs)  # [M, 2F]
        return torch._grouped_mm(self.activation(h), self.down_proj.to(dtype).transpose(-2, -1), offs=offs)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# the paths of SwiGLUExperts that take the tokens as they are (no dispatch); the others take sorted slots
TOKEN_PATHS = frozenset({"gemv", "dense"})


# --- dispatch and combine: slots sorted by expert, in and out by one permutation -------------------------------


def dispatch_combine(
    x: torch.Tensor,
    kept_key: torch.Tensor,
    slot_weight: torch.Tensor,
    kept: torch.Tensor,
    top_k: int,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """out[t] = sum over token t's kept slots of weight * FFN_expert(x[t]) [N, d].

    Slots are choice-rank major (slot s = choice s // N of token s % N): ``kept_key`` [k*N] is each slot's expert,
    E for a slot not kept (dropped or padding), ``slot_weight`` [k*N] its weight, ``kept`` [E] =
    ``slots_per_expert(kept_key, E)``. One stable sort groups the kept slots by
    expert (dropped and padding last, token order within an expert); ``experts(rows, kept)`` maps the sorted rows to
    their outputs (one device's experts, or an all-to-all to their owners). Dispatch and combine are gathers by the
    sort's permutation and its inverse, forward and backward (no scatter-add, see :class:`_RowsToSlots`)."""
    n = x.shape[0]
    num_experts = kept.shape[0]
    order = torch.sort(kept_key, stable=True).indices
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    src = order % n  # the token of each sorted slot
    keep_sorted = (kept_key[order] < num_experts)[:, None]
    if torch.is_grad_enabled():
        rows = _RowsToSlots.apply(x, src, inverse, top_k)
    else:  # inference (a compiled decode step): the plain gathers, nothing for autograd to trace
        rows = x.index_select(0, src)
    rows = torch.where(keep_sorted, rows, 0)  # no gradient into dropped slots
    y = experts(rows, kept)
    y = torch.where(keep_sorted, y, 0) * slot_weight[order, None].to(y.dtype)
    if torch.is_grad_enabled():
        return _SlotsToRows.apply(y.to(x.dtype), src, inverse, top_k)
    return _slots_to_rows(y.to(x.dtype), inverse, top_k)


class _RowsToSlots(torch.autograd.Function):
    """Dispatch: ``x[src]`` ([k*n, d] from [n, d]), where the sorted slots are a permutation of the k copies of each
    token. Its backward is a gather too: slot gradients back in slot order (``inverse``), summed over the k copies.
    ``x[index]``'s own backward is an index_put with accumulation (a scatter-add of 2n rows into n), and
    :class:`_SlotsToRows`'s would be an index_add_: on bf16 rows that is an atomic-add kernel that inductor leaves to
    ATen (~0.3 ms per MoE layer at 16K tokens on an H100, BENCHMARKS.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (inverse,) = ctx.saved_tensors
        return _slots_to_rows(grad, inverse, ctx.k), None, None, None


class _SlotsToRows(torch.autograd.Function):
    """Combine, the transpose of :class:`_RowsToSlots`: y_sorted [k*n, d] -> out[t] = sum of its k slots' rows."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, src: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(src)
        return _slots_to_rows(y, inverse, k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (src,) = ctx.saved_tensors
        return grad.index_select(0, src), None, None, None


def _slots_to_rows(y: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """sum over the k slots of each token; slot s = (choice s // n, token s % n) sits at row inverse[s] of y."""
    return y.index_select(0, inverse).view(k, y.shape[0] // k, y.shape[-1]).sum(0)


def slots_per_expert(key: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: how many entries of ``key`` (expert ids; ``num_experts`` = not counted) name each expert.

    A scatter-add, not ``bincount(top_i[mask])``: boolean indexing and CUDA's bincount both wait on the host."""
    return slot_counts(key.reshape(-1), num_experts)[:num_experts]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on (as F.linear in the loop), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def capacity_keep_mask(
    top_i: torch.Tensor, valid: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Which routed slots fit in their expert's capacity; [N, k] bool (the [N, k] view of :func:`admit`).

    Admission order is choice-rank major (all first choices, then all second choices), token order within a
    rank, as in GShard. ``valid`` [N, k] marks the slots that compete at all (padding excluded).
    """
    n, k = top_i.shape
    slot_expert, competing = top_i.t().reshape(-1), valid.t().reshape(-1)
    key = torch.where(competing, slot_expert, num_experts)
    keep = admit(key, slot_counts(key, num_experts), slot_expert, competing, capacity)
    return keep.view(k, n).t()


def slot_counts(key: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E + 1]: entries of ``key`` per expert id, the last one counting ``num_experts`` (not competing)."""
    return torch.zeros(num_experts + 1, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))


def admit(
    key: torch.Tensor,
    counts: torch.Tensor,
    slot_expert: torch.Tensor,
    competing: torch.Tensor,
    capacity: int | torch.Tensor,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """[k*N] bool: the competing slots admitted, in slot order, while ``offset[e]`` (slots of expert e admitted
    before this call's: the global router's earlier ranks) + their place among expert e's slots < ``capacity``.

    ``key`` [k*N]: each slot's expert, ``num_experts`` for slots not competing; ``counts`` = :func:`slot_counts`."""
    pos = slot_positions(key, counts)
    if offset is not None:
        pos = pos + offset[slot_expert]
    return competing & (pos < capacity)


def slot_positions(key: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each slot's place among the slots of its expert, in slot order: key [M] expert ids (E: no expert),
    counts [E + 1] their counts. One stable sort, not a one-hot [M, E] cumsum: on an H100 that int64 cumsum took
    37% of the library's training step at 2K tokens (issue 24)."""
    order = torch.sort(key, stable=True).indices
    starts = counts.cumsum(0) - counts
    pos = torch.empty_like(key)
    pos[order] = torch.arange(key.numel(), device=key.device) - starts[key[order]]
    return pos


def expert_capacity(
    num_tokens: int | torch.Tensor, top_k: int, num_experts: int, capacity_factor: float, min_capacity: int = 0
) -> int | torch.Tensor:
    """ceil(capacity_factor * tokens * k / E), at least ``min_capacity`` (§2.1's token drop): in float64 on the host
    for an int, on the device (no sync) for a tensor, the same value either way."""
    if isinstance(num_tokens, torch.Tensor):
        cap = torch.ceil(num_tokens.to(torch.float64) * capacity_factor * top_k / num_experts).to(torch.int64)
        return cap.clamp(min=min_capacity)
    return max(math.ceil(capacity_factor * num_tokens * top_k / num_experts), min_capacity)


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
    """h_t = sum_i softmax_i(TopK(x_t W_g)) FFN_i(x_t) (eq. 1), with capacity drop in training.

    The one MoE of hylight: routing, capacity admission, dispatch and combine live here. The pretrain stage's
    DeepSpeed layer (pretrain/moe.py) is this class with two hooks overridden: :meth:`capacity` (the §2.1 global
    router: capacity shared over the expert-parallel ranks) and :meth:`run_experts` (the all-to-all to the ranks
    that own the experts)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float = 1.25,
        token_drop: bool = True,
        min_capacity: int = 0,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.token_drop = token_drop
        self.min_capacity = min_capacity
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
        n, k, num_experts = x.shape[0], self.top_k, self.num_experts
        mask = None if token_mask is None else token_mask.reshape(-1).bool()
        logits, probs, top_w, top_i = self.router(x)
        # slots in admission order: choice-rank major (all first choices, then all second), token order within
        slot_expert = top_i.t().reshape(-1)  # [k*n]
        valid = torch.ones_like(slot_expert, dtype=torch.bool) if mask is None else mask.repeat(k)
        routed = dropped = None
        if stats:
            key = torch.where(valid, slot_expert, num_experts)  # padding -> E (never dispatched)
            counts = slot_counts(key, num_experts)
            routed = counts[:num_experts]
            keep = valid
            if self.training and self.token_drop:
                offset, capacity = self.capacity(routed, n if mask is None else mask.sum())
                keep = admit(key, counts, slot_expert, valid, capacity, offset)
            kept_key = torch.where(keep, slot_expert, num_experts)
            kept = slots_per_expert(kept_key, num_experts)
            dropped = routed - kept
        else:
            keep, kept = valid, None
        path = self.expert_path(x)
        if path in TOKEN_PATHS:
            out = self.experts.forward_tokens(path, x, top_i, top_w, keep.view(k, n).t())
        else:
            if kept is None:
                kept_key = torch.where(keep, slot_expert, num_experts)
                kept = slots_per_expert(kept_key, num_experts)
            out = dispatch_combine(x, kept_key, top_w.t().reshape(-1), kept, k,
                                   lambda rows, counts: self.run_experts(rows, counts, path))
        return MoEOutput(
            hidden=out.view(shape),
            aux_loss=balance_loss(probs, routed, mask) if stats else None,
            router_logits=logits,
            routed=routed,
            dropped=dropped,
        )

    def capacity(self, routed: torch.Tensor, tokens: int | torch.Tensor) -> tuple[torch.Tensor | None, int | torch.Tensor]:
        """(slots of each expert [E] admitted before this call's, or None; the capacity of each expert): here this
        call's ``tokens`` alone (a host int when every token is real, else a device count: no sync)."""
        return None, expert_capacity(tokens, self.top_k, self.num_experts, self.capacity_factor, self.min_capacity)

    def expert_path(self, x: torch.Tensor) -> str:
        """:meth:`SwiGLUExperts.path_for` this call's tokens."""
        return self.experts.path_for(x, self.top_k)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, path: str) -> torch.Tensor:
        """Rows sorted by expert -> their experts' outputs, on this device."""
        return self.experts.forward_sorted(rows, counts, path)


def make_dropless(model: nn.Module) -> nn.Module:
    """``model`` with MoE token dropping off, in place: post-training's log-probs and rewards must not depend on
    what else is in the batch (a capacity drop does). The config flag is read by each MoE layer at construction,
    so the built layers are switched too."""
    model.config.moe_token_drop = False
    for m in model.modules():
        if hasattr(m, "token_drop"):
            m.token_drop = False
    return model
