"""The MoE feed-forward on DeepSpeed-MoE, with the report's global router (§2.1) and token drop.

``DeepSpeedMoEFeedForward`` replaces ``model.moe.MoEFeedForward`` inside a ``HybridForCausalLM`` for training
(:func:`install_deepspeed_moe`); it honours the same contract (``forward(hidden, token_mask) -> MoEOutput``), the
same router weights and the same routing function, so a trained model converts back to ``model/`` format and to
transformers' MiniMax format without loss (:func:`export_model_state`).

What is DeepSpeed's and what is ours:

* DeepSpeed's: the layer is a ``deepspeed.moe.layer.MoE`` (so the engine creates the expert-parallel and
  expert-data-parallel process groups, gives expert parameters their own ZeRO groups, reduces their gradients
  over the expert-data-parallel group only, and saves one checkpoint file per expert); the experts are held in
  ``deepspeed.moe.experts.Experts`` under DeepSpeed's names (``deepspeed_moe.experts.deepspeed_experts.0``, one stacked module per rank);
  the expert FFNs use ``deepspeed.moe.ep_experts``' packed SwiGLU kernel between two grouped GEMMs
  (``torch._grouped_mm``, called here on our fused gate/up weights) on CUDA, and its per-expert loop elsewhere.
* Ours: routing, capacity and dispatch. DeepSpeed's classic ``TopKGate``/``MOELayer`` builds dense
  [tokens, experts, capacity] dispatch and combine tensors with einsums (time and memory grow with tokens² per
  step; measured in BENCHMARKS.md), samples the second expert, selects tokens at random (RTS) and has a minimum
  capacity of 4 by default; none of that is in the paper or in ``model/moe.py``. AutoEP's layer is dropless.
  Here slots are sorted by expert (no one-hot cumsum), admitted GShard-style (every token's first choice before
  any second choice, token order within a choice), and run as one grouped GEMM.

Global router (§2.1): "an additional allgather communication step to synchronize the number of tokens awaiting
processing by each expert before dispatching tokens across different EP groups". Each rank all-gathers the
per-expert slot counts (and its token count) over the expert-parallel group; an expert's capacity is then
``ceil(capacity_factor * tokens_of_all_ranks * k / E)``, shared in rank order: rank r's slots for expert e are
admitted while ``(slots of e on ranks < r) + (position on rank r) < capacity``. Without it each rank caps its
own slots at ``ceil(capacity_factor * its_tokens * k / E)``. With one rank the two are the same.

Aux loss: the same (1/E) sum_i f_i m_i as ``model/moe.py`` (alpha_aux applied by the model). DeepSpeed's
``top2gating`` returns ``mean_i(m_i c_i) * E * E`` = E^2 x ours (c_i: the share of first choices), so an
``l_aux`` coefficient tuned for DeepSpeed's gate is E^2 times too small for this loss; we compute ours.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from deepspeed.moe.experts import Experts
from deepspeed.moe.layer import MoE
from torch import nn

from model.moe import MoEFeedForward, MoEOutput, TopKRouter, balance_loss, slot_positions, slots_per_expert


class GroupedSwiGLUExperts(nn.Module):
    """This rank's experts as stacked tensors: w13 (gate rows, then up rows) [E_l, 2F, d] and w2 (down)
    [E_l, d, F]. w13 is ``model/``'s ``gate_up_proj`` layout; ``deepspeed.moe.ep_experts.GroupedExperts`` keeps gate
    and up apart and concatenates them on every call of its fused gate/up GEMM (a copy of all expert weights per
    layer in the forward pass and a split of their gradients in the backward: ~7 ms of a gpu-300m step at 2K x 8,
    BENCHMARKS.md). Two parameters per layer instead of three per expert: DeepSpeed's per-parameter work (gradient
    copies, clipping, optimizer groups) does not grow with the number of experts, and the grouped GEMMs read the
    weights in place."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class _MoEInner(nn.Module):
    """Holds ``experts`` so parameter names are DeepSpeed's (``deepspeed_moe.experts.deepspeed_experts.<i>.*``),
    which its expert checkpointing matches on."""

    def __init__(self, experts: Experts):
        super().__init__()
        self.experts = experts


def _grouped_experts(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts`` per expert, rows past their sum ignored) -> SwiGLU outputs."""
    from deepspeed.moe import ep_experts

    if x.is_cuda:  # one grouped GEMM for gate+up, DeepSpeed's packed SwiGLU kernel, one for down; no host sync
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate_up = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offsets)
        h = ep_experts.apply_packed_expert_activation(gate_up, "swiglu")
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x)
    # CPU: DeepSpeed's reference loop over experts (reads the counts on the host; fine off the GPU), on views of
    # the gate and up halves
    f = w2.shape[-1]
    return ep_experts._run_experts_for_loop(w13[:, :f], w2, w13[:, f:], x, counts)


class _RowsToSlots(torch.autograd.Function):
    """Dispatch: ``x[slot_token_sorted]`` ([k*n, d] from [n, d]), where the sorted slots are a permutation of the
    k copies of each token. Its backward is a gather too: slot gradients back in slot order (``inverse``), summed
    over the k copies. ``x[index]``'s own backward is an index_put with accumulation (a scatter-add of 2n rows into
    n), and :class:`_SlotsToRows`'s would be an index_add_: on bf16 rows that is an atomic-add kernel that inductor
    leaves to ATen (~0.3 ms per MoE layer at 16K tokens on an H100, BENCHMARKS.md)."""

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


def _ceil_capacity(tokens: torch.Tensor, capacity_factor: float, top_k: int, num_experts: int,
                   min_capacity: int) -> torch.Tensor:
    """ceil(capacity_factor * tokens * k / E) on the device, in float64 like ``model.moe.expert_capacity``."""
    cap = torch.ceil(tokens.to(torch.float64) * capacity_factor * top_k / num_experts).to(torch.int64)
    return cap.clamp(min=min_capacity)


class DeepSpeedMoEFeedForward(MoE):
    """A top-k SwiGLU MoE on DeepSpeed-MoE with global-router capacity (module docstring)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 capacity_factor: float = 1.25, token_drop: bool = True, ep_size: int = 1,
                 global_router: bool = True, min_capacity: int = 0):
        nn.Module.__init__(self)  # not MoE.__init__: that builds DeepSpeed's einsum TopKGate/MOELayer path
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by expert_parallel_size={ep_size}")
        # attributes the DeepSpeed engine reads from a native MoE layer
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.local_expert_count = num_experts // ep_size
        # DeepSpeed's expert checkpointing writes one file per (layer, rank-local expert module) and reads as many
        # back; here one module holds all of this rank's experts, stacked, so DeepSpeed sees one local "expert"
        self.num_local_experts = 1
        self.enable_expert_tensor_parallelism = False
        self.use_residual = False
        # ours
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.token_drop = token_drop
        self.global_router = global_router
        self.min_capacity = min_capacity
        self.ep_group: dist.ProcessGroup | None = None
        self.router = TopKRouter(hidden_size, num_experts, top_k)
        self.deepspeed_moe = _MoEInner(Experts(
            GroupedSwiGLUExperts(self.local_expert_count, hidden_size, intermediate_size), 1, self.expert_group_name))

    # --- DeepSpeed hooks ----------------------------------------------------------------------------
    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        from deepspeed.utils import groups

        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.ep_group = groups._get_expert_parallel_group(self.expert_group_name)

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group) if self.ep_group is not None and self.ep_size > 1 else 0

    @property
    def experts(self) -> GroupedSwiGLUExperts:
        return self.deepspeed_moe.experts.deepspeed_experts[0]

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 (gate rows, then up rows) [E_l, 2F, d] and w2 [E_l, d, F] of the local experts."""
        e = self.experts
        return e.w13, e.w2

    # --- forward ------------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, token_mask: torch.Tensor | None = None,  # type: ignore[override]
                stats: bool = True) -> MoEOutput:
        """``stats`` is accepted for the model's contract and ignored: the counters are part of the dispatch."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        n, k, E = x.shape[0], self.top_k, self.num_experts
        mask = None if token_mask is None else token_mask.reshape(-1).bool()
        logits, probs, top_w, top_i = self.router(x)

        # slots in admission order: rank-major (all first choices, then all second), token order within
        slot_expert = top_i.t().reshape(-1)  # [k*n]
        slot_weight = top_w.t().reshape(-1)
        slot_token = torch.arange(k * n, device=x.device) % n
        valid = torch.ones_like(slot_expert, dtype=torch.bool) if mask is None else mask.repeat(k)
        key = torch.where(valid, slot_expert, E)  # padding -> bucket E (never dispatched)
        ones = torch.ones_like(key)
        counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, ones)
        routed = counts[:E]

        if self.training and self.token_drop:
            pos = slot_positions(key, counts)
            offset, capacity = self._capacity(routed, n if mask is None else mask.sum())
            if isinstance(offset, torch.Tensor):
                pos = pos + offset[slot_expert]
            keep = valid & (pos < capacity)
        else:
            keep = valid
        kept_key = torch.where(keep, slot_expert, E)
        kept = slots_per_expert(kept_key, E)

        # one stable sort groups the kept slots by expert (dropped and padding last); dispatch and combine are
        # gathers by this permutation and its inverse, forward and backward (no scatter-add)
        order = torch.sort(kept_key, stable=True).indices
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        src = slot_token[order]
        keep_sorted = keep[order][:, None]
        x_sorted = torch.where(keep_sorted, _RowsToSlots.apply(x, src, inverse, k), 0)  # no gradient into dropped
        y_sorted = self._experts(x_sorted, kept)
        y_sorted = torch.where(keep_sorted, y_sorted, 0) * slot_weight[order, None].to(y_sorted.dtype)
        out = _SlotsToRows.apply(y_sorted.to(x.dtype), src, inverse, k)
        return MoEOutput(hidden=out.view(shape), aux_loss=balance_loss(probs, routed, mask),
                         router_logits=logits, routed=routed, dropped=routed - kept)

    def _capacity(self, routed: torch.Tensor, n_real: int | torch.Tensor) -> tuple[torch.Tensor | int, torch.Tensor | int]:
        """(slots of each expert already admitted on earlier ranks [E] or 0, the capacity per expert).

        ``n_real`` is a host int when every token is real (no device round trip), else a device count."""
        cap_args = (self.capacity_factor, self.top_k, self.num_experts, self.min_capacity)
        if not (self.global_router and self.ep_size > 1 and self.ep_group is not None):
            if isinstance(n_real, int):
                return 0, capacity_for(n_real, *cap_args)
            return 0, _ceil_capacity(n_real, *cap_args)
        # §2.1 global router: one all-gather of [per-expert slots, tokens] over the expert-parallel group
        n_dev = torch.full((1,), n_real, device=routed.device) if isinstance(n_real, int) else n_real.reshape(1)
        mine = torch.cat([routed, n_dev.to(routed.dtype)])
        every = torch.empty(self.ep_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        _all_gather_flat(every, mine, group=self.ep_group)  # flat output: gloo wants [R * n]
        every = every.view(self.ep_size, -1)
        before = every[: self.ep_rank, :-1].sum(0)
        return before, _ceil_capacity(every[:, -1].sum(), *cap_args)

    def _experts(self, x_sorted: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Rows grouped by global expert -> expert outputs, through the owners of the experts."""
        w13, w2 = self.stacked_weights()
        if self.ep_size == 1:
            return _grouped_experts(w13, w2, x_sorted, kept)
        return _expert_parallel_ffn(x_sorted, kept, (w13, w2), self.ep_size, self.local_expert_count,
                                    self.ep_group)


def _expert_parallel_ffn(x_sorted: torch.Tensor, kept: torch.Tensor, weights: tuple[torch.Tensor, ...],
                         ep_size: int, local: int, group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all the kept rows to the ranks that own their experts, run them, and bring the outputs back.

    Rows arrive grouped by source rank then local expert; they are regrouped by local expert for the grouped
    GEMM and put back in arrival order before the return trip. Split sizes come to the host once per layer
    (all_to_all needs them), the one sync of the expert-parallel path.
    """
    total = int(kept.sum())
    send = kept.view(ep_size, local)  # [dest rank, its local expert]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[src, local expert]
    send_splits = send.sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    rows = x_sorted[:total]
    arrived = _AllToAll.apply(rows, recv_splits, send_splits, group)
    # regroup by local expert (stable: source order within an expert)
    local_id = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep_size), recv.reshape(-1))
    by_expert = torch.sort(local_id, stable=True).indices
    y = torch.empty_like(arrived)
    y[by_expert] = _grouped_experts(*weights, arrived[by_expert], recv.sum(0))
    back = _AllToAll.apply(y, send_splits, recv_splits, group)
    return torch.cat([back, x_sorted.new_zeros(x_sorted.shape[0] - total, x_sorted.shape[1])])


def _all_gather_flat(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, t, group=group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward sends the gradients the opposite way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # noqa: ANN001
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


# --- installing into a model and converting back ----------------------------------------------------------


def install_deepspeed_moe(model: nn.Module, *, ep_size: int = 1, ep_rank: int = 0, global_router: bool = True,
                          min_capacity: int = 0) -> list[DeepSpeedMoEFeedForward]:
    """Replace every ``MoEFeedForward`` of a ``HybridForCausalLM`` by a ``DeepSpeedMoEFeedForward`` carrying the same
    router and (this expert-parallel rank's share of the) expert weights. Returns the new layers."""
    layers = []
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if not isinstance(child, MoEFeedForward):
                continue
            gate_up, down = child.experts.gate_up_proj, child.experts.down_proj  # [E, 2F, d], [E, d, F]
            f = down.shape[-1]
            new = DeepSpeedMoEFeedForward(gate_up.shape[-1], f, child.num_experts, child.top_k,
                                          capacity_factor=child.capacity_factor, token_drop=child.token_drop,
                                          ep_size=ep_size, global_router=global_router, min_capacity=min_capacity)
            new.to(device=gate_up.device, dtype=gate_up.dtype)
            with torch.no_grad():
                new.router.weight.copy_(child.router.weight)
                mine = slice(ep_rank * new.local_expert_count, (ep_rank + 1) * new.local_expert_count)
                new.experts.w13.copy_(gate_up[mine])
                new.experts.w2.copy_(down[mine])
            new.train(child.training)
            setattr(parent, name, new)
            layers.append(new)
    if not layers:
        raise ValueError("install_deepspeed_moe: the model has no model.moe.MoEFeedForward layers to replace")
    return layers


def export_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The ``model/``-format state dict of a model whose MoE layers are ``DeepSpeedMoEFeedForward``.

    Experts are gathered over the expert-parallel group (a collective: call it on every rank). The result loads
    into a fresh ``HybridForCausalLM`` with ``load_state_dict(strict=True)``.
    """
    state: dict[str, torch.Tensor] = {}
    moe_prefixes = {}
    for name, module in model.named_modules():
        if isinstance(module, DeepSpeedMoEFeedForward):
            moe_prefixes[name] = module
    for key, value in model.state_dict().items():
        if not any(key.startswith(p + ".deepspeed_moe.") for p in moe_prefixes):
            state[key] = value.detach()
    for prefix, layer in moe_prefixes.items():
        w13, w2 = (w.detach() for w in layer.stacked_weights())
        if layer.ep_size > 1:
            w13, w2 = (_all_gather_cat(w, layer.ep_group, layer.ep_size) for w in (w13, w2))
        state[f"{prefix}.experts.gate_up_proj"] = w13.contiguous()
        state[f"{prefix}.experts.down_proj"] = w2.contiguous()
    return state


def _all_gather_cat(t: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    for module in model.modules():
        if isinstance(module, DeepSpeedMoEFeedForward):
            yield from module.experts.parameters()


def capacity_for(tokens: int, capacity_factor: float, top_k: int, num_experts: int, min_capacity: int = 0) -> int:
    """Host-side twin of the device capacity formula (tests, logging)."""
    return max(math.ceil(capacity_factor * tokens * top_k / num_experts), min_capacity)


