"""The MoE feed-forward on DeepSpeed-MoE, with the report's global router (§2.1) and token drop.

``DeepSpeedMoEFeedForward`` replaces ``model.moe.MoEFeedForward`` inside a ``HybridForCausalLM`` for training
(:func:`install_deepspeed_moe`); it honours the same contract (``forward(hidden, token_mask) -> MoEOutput``), the
same router weights and the same routing function, so a trained model converts back to ``model/`` format and to
transformers' MiniMax format without loss (:func:`export_model_state`).

What is DeepSpeed's and what is the library's:

* DeepSpeed's: the layer is a ``deepspeed.moe.layer.MoE`` (so the engine creates the expert-parallel and
  expert-data-parallel process groups, gives expert parameters their own ZeRO groups, reduces their gradients
  over the expert-data-parallel group only, and saves one checkpoint file per expert); this rank's experts are held
  in ``deepspeed.moe.experts.Experts`` under DeepSpeed's names (``deepspeed_moe.experts.deepspeed_experts.0``, one
  stacked ``model.moe.SwiGLUExperts`` per rank, with the library's weight names ``gate_up_proj``/``down_proj``).
* The library's (``model/moe.py``, the one MoE): routing, capacity admission (slots sorted by expert, no one-hot
  cumsum; GShard order: every token's first choice before any second choice, token order within a choice),
  dispatch and combine, and the experts' grouped GEMMs. This module overrides two hooks of
  ``model.moe.MoEFeedForward``: the capacity (the global router below) and where the sorted rows run (the
  expert-parallel all-to-all). DeepSpeed's classic ``TopKGate``/``MOELayer`` builds dense [tokens, experts,
  capacity] dispatch and combine tensors with einsums (time and memory grow with tokens² per step; measured in
  BENCHMARKS.md), samples the second expert, selects tokens at random (RTS) and has a minimum capacity of 4 by
  default; none of that is in the paper. AutoEP's layer is dropless.

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

from collections.abc import Iterator

import torch
import torch.distributed as dist
from deepspeed.moe import ep_experts
from deepspeed.moe.experts import Experts
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups
from torch import nn

from model.moe import MoEFeedForward, SwiGLUExperts, TopKRouter, expert_capacity


class DeepSpeedSwiGLUExperts(SwiGLUExperts):
    """The library's experts (same weights, same names) with DeepSpeed's packed SwiGLU Triton kernel on CUDA: one
    kernel each way where the library's eager ``silu(gate) * up`` is three (the layer alone, eager, on an H100:
    5.81 ms with the library's activation, BENCHMARKS.md "One MoE")."""

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_cuda:
            return ep_experts.apply_packed_expert_activation(gate_up, "swiglu")
        return super().activation(gate_up)


class _MoEInner(nn.Module):
    """Holds ``experts`` so parameter names are DeepSpeed's (``deepspeed_moe.experts.deepspeed_experts.0.*``), which
    its expert checkpointing matches on."""

    def __init__(self, experts: Experts):
        super().__init__()
        self.experts = experts


class DeepSpeedMoEFeedForward(MoEFeedForward, MoE):
    """``model.moe.MoEFeedForward`` as a DeepSpeed-MoE layer, with global-router capacity (module docstring).

    Routing, admission, dispatch and combine are the library's; this class holds this rank's experts where DeepSpeed
    looks for them and overrides two hooks: :meth:`capacity` (the global router) and :meth:`run_experts` (expert
    parallelism). DeepSpeed sees one local "expert" module per layer: this rank's experts, stacked (a
    ``model.moe.SwiGLUExperts``, same weight names as the library's), so its per-parameter work (gradient copies,
    clipping, optimizer groups) does not grow with the number of experts."""

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
        # the library layer's
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.token_drop = token_drop
        self.min_capacity = min_capacity
        self.router = TopKRouter(hidden_size, num_experts, top_k)
        # ours
        self.global_router = global_router
        self.ep_group: dist.ProcessGroup | None = None
        self.deepspeed_moe = _MoEInner(Experts(
            DeepSpeedSwiGLUExperts(self.local_expert_count, hidden_size, intermediate_size), 1, self.expert_group_name))

    # --- DeepSpeed hooks ----------------------------------------------------------------------------
    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.ep_group = groups._get_expert_parallel_group(self.expert_group_name)

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group) if self.ep_group is not None and self.ep_size > 1 else 0

    @property
    def experts(self) -> SwiGLUExperts:  # type: ignore[override]
        """This rank's experts: gate_up_proj [E_l, 2F, d], down_proj [E_l, d, F]."""
        return self.deepspeed_moe.experts.deepspeed_experts[0]

    # --- the library layer's hooks ------------------------------------------------------------------
    def expert_path(self, x: torch.Tensor) -> str:
        """Only the sorted paths: a rank may hold only some experts (and this layer trains; inference runs the
        exported library model)."""
        return self.experts.path_for(x, self.top_k, tokens_paths=False)

    def capacity(self, routed: torch.Tensor, tokens: int | torch.Tensor) -> tuple[torch.Tensor | None, int | torch.Tensor]:
        """Without the global router (or with one rank): the library's, this rank's tokens alone. With it (§2.1):
        one all-gather of [per-expert slots, tokens] over the expert-parallel group; the capacity counts every
        rank's tokens and rank r's slots queue behind those of ranks < r."""
        if not (self.global_router and self.ep_size > 1 and self.ep_group is not None):
            return super().capacity(routed, tokens)
        n_dev = torch.full((1,), tokens, device=routed.device) if isinstance(tokens, int) else tokens.reshape(1)
        mine = torch.cat([routed, n_dev.to(routed.dtype)])
        every = torch.empty(self.ep_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        _all_gather_flat(every, mine, group=self.ep_group)  # flat output: gloo wants [R * n]
        every = every.view(self.ep_size, -1)
        before = every[: self.ep_rank, :-1].sum(0)
        return before, expert_capacity(every[:, -1].sum(), self.top_k, self.num_experts, self.capacity_factor,
                                       self.min_capacity)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, path: str) -> torch.Tensor:
        """Rows grouped by global expert -> expert outputs, through the owners of the experts."""
        if self.ep_size == 1:
            return super().run_experts(rows, counts, path)
        return _expert_parallel_ffn(rows, counts, self.experts, path, self.ep_size, self.local_expert_count,
                                    self.ep_group)


def _expert_parallel_ffn(x_sorted: torch.Tensor, kept: torch.Tensor, experts: SwiGLUExperts, path: str,
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
    y[by_expert] = experts.forward_sorted(arrived[by_expert], recv.sum(0), path).to(y.dtype)
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
            if not isinstance(child, MoEFeedForward) or isinstance(child, DeepSpeedMoEFeedForward):
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
                new.experts.gate_up_proj.copy_(gate_up[mine])
                new.experts.down_proj.copy_(down[mine])
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
        for name, w in layer.experts.named_parameters():  # gate_up_proj, down_proj: the library's names
            w = w.detach()
            if layer.ep_size > 1:
                w = _all_gather_cat(w, layer.ep_group, layer.ep_size)
            state[f"{prefix}.experts.{name}"] = w.contiguous()
    return state


def _all_gather_cat(t: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def expert_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    for module in model.modules():
        if isinstance(module, DeepSpeedMoEFeedForward):
            yield from module.experts.parameters()
