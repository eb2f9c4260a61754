"""Sequence parallelism for the hybrid model: LASP+ for lightning layers (MiniMax-01 §3.2.2), a K/V all-gather for
softmax layers, applied to a ``HybridForCausalLM`` from outside (``model/`` knows nothing of it).

Each rank of a sequence-parallel group of P holds one contiguous slice of L tokens of a row of N = P·L tokens.

Lightning layers, LASP+ (§3.2.2, Figure 12 b). The layer is linear in its state: the state entering rank r is a
sum of the other ranks' block states, so no rank waits for another:
    1. each rank computes its slice's KV state from zero, decayed to the slice end, S_r = Σ_t λ^(L-1-t) k_tᵀ v_t
       (one O(L·d²) matmul; only the slice's last document counts, an earlier one ends inside the slice);
    2. ONE all-gather of the [B, H, d_k, d_v] states (autograd-aware: its backward sums the gradients of all
       ranks' uses, a reduce-scatter);
    3. a local prefix sum: the state entering rank r is Σ_{j<r} λ^(L(r-1-j)) S_j, cut at the last rank j whose
       slice contains a document start (varlen, §3.2.2 last paragraphs), zero when rank r's own first token
       starts a document;
    4. the existing kernel (``kernels.lightning.lightning_attention``, any impl) runs on the local slice from that
       initial state.
Communication is O(B·H·d²) per rank and layer, independent of L: P·B·H·d_k·d_v elements gathered forward and
reduced backward.

Softmax layers: all-gather K and V along the sequence (autograd-aware), then the local queries attend causally
within their documents with their global offsets, one SDPA call per document (the square part with
``is_causal``; a document that began on an earlier rank with a lower-right causal mask,
``torch.nn.attention.bias.causal_lower_right``, which CUDA runs in its memory-efficient/flash kernels without a
mask and CPU materialises per document). No [T, T] mask over the row. This is O(N·H_kv·D) per rank (the
all-gather form of §3.2.1's context parallelism, not its ring).

MoE layers are per token, but the §2.1 balance loss (1/E)·Σ f_i·m_i is a product of means over ALL tokens:
the applied plan all-reduces each layer's per-expert probability sums, slot counts and token count (2E+1
numbers), so every rank gets the single-process aux loss. Token-drop capacity stays per rank (as on
data-parallel ranks); train dropless (``moe_token_drop=False``) where SP must equal one process exactly. Both
``model.moe.MoEFeedForward`` and the pretrain stage's ``pretrain.moe.DeepSpeedMoEFeedForward`` are handled.

Use (every rank):
    sp = apply_sequence_parallel(model, group)
    shard = shard_batch(input_ids, labels, position_ids, cu_seqlens, rank, world)     # labels shifted globally
    loss = sequence_parallel_loss(model, sp, shard)   # Σ over ranks = the single-process loss
    loss.backward()                                   # then all-reduce (SUM) grads over the SP group

The pretrain stage (``pretrain/train.py``, param ``sequence_parallel``) calls the DeepSpeed engine through
:func:`sequence_parallel_output` and :func:`loss_share`, and scales the share by P instead of the SUM: DeepSpeed
averages gradients over every rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels.lightning import lightning_attention
from kernels.lightning.chunk import compute_dtype

IGNORE_INDEX = -100

__all__ = [
    "CommCounter",
    "SequenceParallel",
    "SequenceShard",
    "ShardLayout",
    "apply_sequence_parallel",
    "expected_step_bytes",
    "lasp_lightning_attention",
    "loss_share",
    "sequence_parallel_loss",
    "sequence_parallel_output",
    "sequence_parallel_softmax_attention",
    "shard_batch",
    "shard_cross_entropy_sum",
]


# --- communication accounting -------------------------------------------------------------------------------


@dataclass
class CommCounter:
    """Collective calls and their payload bytes: the size of the whole buffer the collective produces or reduces
    (an all-gather's gathered output, a reduce-scatter's full input, an all-reduce's tensor). A ring moves
    (P-1)/P of an all-gather/reduce-scatter payload out of each rank, 2(P-1)/P of an all-reduce's."""

    calls: list[tuple[str, str, int]] = field(default_factory=list)  # (what, collective, payload bytes)

    def add(self, what: str, collective: str, nbytes: int) -> None:
        self.calls.append((what, collective, int(nbytes)))

    def total(self, what: str | None = None) -> int:
        return sum(n for w, _, n in self.calls if what is None or w == what)

    def reset(self) -> None:
        self.calls.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` (ranks' slices in rank order); backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, group, counter, what):  # noqa: ANN001, ANN205
        world = dist.get_world_size(group)
        ctx.dim, ctx.group, ctx.counter, ctx.what = dim, group, counter, what
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        out = torch.cat(parts, dim=dim)
        if counter is not None:
            counter.add(what, "all_gather", _nbytes(out))
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        grad = grad.contiguous()
        if ctx.counter is not None:
            ctx.counter.add(ctx.what, "reduce_scatter", _nbytes(grad))
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            chunks = [c.contiguous() for c in grad.chunk(world, dim=ctx.dim)]
            out = torch.empty_like(chunks[rank])
            dist.reduce_scatter(out, chunks, group=ctx.group)
        else:  # gloo has no reduce-scatter: an all-reduce, then this rank's part (same payload, twice the wire)
            dist.all_reduce(grad, group=ctx.group)
            out = grad.chunk(world, dim=ctx.dim)[rank].contiguous()
        return out, None, None, None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of a sum that every rank uses is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x, group, counter, what):  # noqa: ANN001, ANN205
        ctx.group, ctx.counter, ctx.what = group, counter, what
        out = x.clone().contiguous()
        dist.all_reduce(out, group=group)
        if counter is not None:
            counter.add(what, "all_reduce", _nbytes(out))
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad = grad.clone().contiguous()
        dist.all_reduce(grad, group=ctx.group)
        if ctx.counter is not None:
            ctx.counter.add(ctx.what, "all_reduce", _nbytes(grad))
        return grad, None, None, None


def gather_sequence(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None, counter: CommCounter | None = None, what: str = ""
) -> torch.Tensor:
    """Autograd-aware all-gather of every rank's ``x`` concatenated along ``dim`` in rank order."""
    return _GatherSequence.apply(x, dim, group, counter, what)


def all_reduce_sum(
    x: torch.Tensor, group: dist.ProcessGroup | None, counter: CommCounter | None = None, what: str = ""
) -> torch.Tensor:
    """Autograd-aware all-reduce (sum)."""
    return _AllReduceSum.apply(x, group, counter, what)


# --- which tokens a rank holds ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardLayout:
    """Rank ``rank`` of ``world`` holds tokens [rank·length, (rank+1)·length) of a row of world·length tokens.

    ``doc_starts``: global offsets where a packed document starts (0 included), for B = 1 packed rows; empty
    means one sequence per row whose start is where an ``initial_state`` enters (no document starts inside)."""

    rank: int
    world: int
    length: int
    doc_starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world or self.length < 1:
            raise ValueError(f"ShardLayout: need 0 <= rank < world and length >= 1, got {self}")
        if list(self.doc_starts) != sorted(set(self.doc_starts)) or any(
            not 0 <= s < self.total for s in self.doc_starts
        ):
            raise ValueError(
                f"ShardLayout: doc_starts must be strictly increasing offsets in [0, {self.total}), got "
                f"{self.doc_starts}"
            )
        if self.doc_starts and self.doc_starts[0] != 0:
            raise ValueError(f"ShardLayout: packed documents must start at 0, got doc_starts {self.doc_starts}")

    @property
    def total(self) -> int:
        return self.world * self.length

    @property
    def offset(self) -> int:
        return self.rank * self.length

    @property
    def packed(self) -> bool:
        return bool(self.doc_starts)

    def starts_inside(self, j: int) -> list[int]:
        """Global document starts inside rank j's slice."""
        return [s for s in self.doc_starts if j * self.length <= s < (j + 1) * self.length]

    def passes_through(self, j: int) -> bool:
        """Rank j's slice is one document that continues: a state entering it leaves it (decayed by λ^L)."""
        return not self.starts_inside(j)

    def local_bounds(self) -> list[int]:
        """This rank's local document boundaries [0, ..., L] (a document begun earlier is cut at 0)."""
        inner = [s - self.offset for s in self.starts_inside(self.rank) if s != self.offset]
        return [0, *inner, self.length]

    def global_documents(self) -> list[tuple[int, int]]:
        bounds = [*(self.doc_starts or (0,)), self.total]
        return list(zip(bounds[:-1], bounds[1:], strict=True))


# --- the lightning op: LASP+ ---------------------------------------------------------------------------------


def lasp_lightning_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    shard: ShardLayout,
    group: dist.ProcessGroup | None = None,
    *,
    block_size: int = 256,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    impl: str = "auto",
    counter: CommCounter | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's part of causal lightning attention over the whole row (§3.2.2 LASP+).

    q, k [B, H, L, d_k], v [B, H, L, d_v]: this rank's slice (B = 1 when ``shard.packed``). ``initial_state``
    [B, H, d_k, d_v]: the state before the row's first token (not with packed documents; only rank 0's copy
    is used, every rank may pass it). Returns (o [B, H, L, d_v], the state after this slice or None; on the last
    rank that is the row's final state). Every rank of ``group`` must call it (one all-gather, forward and
    backward).
    """
    caller = "lasp_lightning_attention"
    batch, heads, length, d_k = q.shape
    if length != shard.length or q.dim() != 4:
        raise ValueError(f"{caller}: q must be [B, H, L={shard.length}, d_k] (this rank's slice), got {tuple(q.shape)}")
    if shard.packed and batch != 1:
        raise ValueError(f"{caller}: packed documents (shard.doc_starts) need B == 1, got B={batch}")
    if shard.packed and initial_state is not None:
        raise ValueError(
            f"{caller}: initial_state with packed documents is not supported; packed training rows start from zero"
        )
    if dist.get_world_size(group) != shard.world or dist.get_rank(group) != shard.rank:
        raise ValueError(
            f"{caller}: shard says rank {shard.rank} of {shard.world} but the group has this process as rank "
            f"{dist.get_rank(group)} of {dist.get_world_size(group)}"
        )
    cdtype = compute_dtype(q.dtype)
    rates = decay_rates.to(device=q.device, dtype=cdtype)
    bounds = shard.local_bounds()

    # 1. this slice's state from zero, decayed to its end; only its last document reaches the next rank
    last = bounds[-2]
    t = torch.arange(last, length, device=q.device, dtype=cdtype)
    k_end = k[:, :, last:].to(cdtype) * torch.exp(-rates.view(heads, 1) * (length - 1 - t)).unsqueeze(-1)
    local_state = k_end.transpose(-1, -2) @ v[:, :, last:].to(cdtype)  # [B, H, d_k, d_v]

    # 2. one all-gather of the block states
    states = gather_sequence(local_state.unsqueeze(0), 0, group, counter, "lightning_state")  # [P, B, H, dk, dv]

    # 3. local prefix sum over the ranks before this one, cut at a document start: entering = Σ_j c_j S_j with
    # c_j = λ^(L(r-1-j)) while every rank between j and r passes a state through, else 0. Written as one weighted
    # sum over ALL gathered states so every rank's result depends on the gather and every rank joins its backward.
    hops = _prefix_hops(shard)  # [P]: r-1-j for the ranks that feed this one, -1 for the others
    hop_t = torch.tensor(hops, device=q.device, dtype=cdtype)
    coeff = torch.exp(-rates.view(1, heads) * length * hop_t.clamp(min=0).view(-1, 1)) * (hop_t >= 0).view(-1, 1)
    entering = (coeff.view(shard.world, 1, heads, 1, 1) * states).sum(0)  # [B, H, d_k, d_v]
    if initial_state is not None:  # unpacked rows: it crosses every slice before this one
        s0 = initial_state.to(device=q.device, dtype=cdtype)
        entering = entering + torch.exp(-rates * length * shard.rank).view(1, heads, 1, 1) * s0
    slice_decay = torch.exp(-rates * length).view(1, heads, 1, 1)  # λ^L

    # 4. the kernel on the local slice from that state
    if shard.packed:
        cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
        # the first local document carries the entering state, the others start from zero
        init = torch.cat([entering, entering.new_zeros(len(bounds) - 2, heads, d_k, v.shape[-1])])
        o, _ = lightning_attention(q, k, v, decay_rates, block_size=block_size, initial_state=init,
                                   cu_seqlens=cu, impl=impl)  # fmt: skip
    else:
        o, _ = lightning_attention(q, k, v, decay_rates, block_size=block_size, initial_state=entering, impl=impl)
    final = None
    if output_final_state:  # a document start inside the slice cuts the entering state off from its end
        final = local_state if len(bounds) > 2 else slice_decay * entering + local_state
    return o, final


def _prefix_hops(shard: ShardLayout) -> list[int]:
    """Per gathered rank j: r-1-j (the slices its state crosses) when its state reaches rank r, else -1."""
    hops = [-1] * shard.world
    if shard.offset in shard.doc_starts:  # this rank's first token starts a document: nothing enters
        return hops
    for j in range(shard.rank - 1, -1, -1):
        hops[j] = shard.rank - 1 - j
        if not shard.passes_through(j):
            break
    return hops


# --- the softmax op: K/V all-gather, document-causal with global offsets ------------------------------------


def sequence_parallel_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shard: ShardLayout,
    group: dist.ProcessGroup | None = None,
    *,
    enable_gqa: bool = False,
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """This rank's queries (q [B, H, L, D]) attend causally within their documents to all ranks' keys and
    values (k, v [B, H_kv, L, D], all-gathered along the sequence). Returns o [B, H, L, D]. Scale 1/sqrt(D)."""
    if q.shape[2] != shard.length or k.shape[2] != shard.length:
        raise ValueError(
            f"sequence_parallel_softmax_attention: q, k, v must hold this rank's {shard.length} tokens on dim 2, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if shard.packed and q.shape[0] != 1:
        raise ValueError(f"sequence_parallel_softmax_attention: packed documents need B == 1, got {q.shape[0]}")
    keys = gather_sequence(k, 2, group, counter, "softmax_kv")  # [B, H_kv, N, D]
    values = gather_sequence(v, 2, group, counter, "softmax_kv")
    group_size = q.shape[1] // k.shape[1]
    lo, hi = shard.offset, shard.offset + shard.length
    outs = []
    for a, e in shard.global_documents():
        qa, qe = max(a, lo), min(e, hi)
        if qe <= qa:
            continue
        qs, ks, vs = q[:, :, qa - lo : qe - lo], keys[:, :, a:qe], values[:, :, a:qe]
        if qa == a:  # the document starts on this rank: a square causal block
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=enable_gqa))
        else:  # its earlier tokens sit on earlier ranks: causal aligned at the lower right
            if group_size > 1:  # CausalBias' CUDA kernels take no GQA: repeat this document's K/V
                ks, vs = ks.repeat_interleave(group_size, 1), vs.repeat_interleave(group_size, 1)
            mask = causal_lower_right(qs.shape[2], ks.shape[2])
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask))
    return torch.cat(outs, dim=2)


# --- sharding a batch ---------------------------------------------------------------------------------------


@dataclass
class SequenceShard:
    """One rank's part of a batch: model inputs, labels ALREADY shifted (the label of token t is token t+1 of
    the whole row, so a slice's last token is labelled by the next rank's first), and the global label count
    that makes per-rank losses sum to the single-process mean."""

    input_ids: torch.Tensor  # [B, L]
    shifted_labels: torch.Tensor  # [B, L], IGNORE_INDEX where no loss
    position_ids: torch.Tensor  # [B, L], global (document-relative) positions
    cu_seqlens: torch.Tensor | None  # [n + 1] int32, local document boundaries; None for unpacked rows
    layout: ShardLayout
    num_label_tokens: int  # labelled tokens of the whole batch

    def to(self, device: torch.device | str) -> SequenceShard:
        """The token tensors on ``device``; ``cu_seqlens`` stays where it is (host bounds cost no device sync)."""
        return replace(self, input_ids=self.input_ids.to(device), shifted_labels=self.shifted_labels.to(device),
                       position_ids=self.position_ids.to(device))  # fmt: skip


def shard_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    rank: int,
    world: int,
) -> SequenceShard:
    """Rank ``rank``'s contiguous slice of a batch laid out as ``pretrain.packed_data.make_batch`` makes it (labels
    unshifted, as for ``HybridForCausalLM``; packed rows [1, N] with ``cu_seqlens``, or B rows without)."""
    batch, total = input_ids.shape
    if total % world:
        raise ValueError(
            f"shard_batch: the row has {total} tokens, not divisible by the {world} sequence-parallel ranks; make "
            f"seq_len (x rows per batch) a multiple of {world}"
        )
    if labels.shape != input_ids.shape:
        raise ValueError(f"shard_batch: labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}")
    length = total // world
    doc_starts: tuple[int, ...] = ()
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"shard_batch: cu_seqlens packs documents along one row; got B={batch}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"shard_batch: cu_seqlens must rise from 0 to {total}, got {bounds}")
        doc_starts = tuple(sorted(set(bounds[:-1]) - {total}))
        if position_ids is None:  # each document counts from 0, as SequenceLayout does
            starts = torch.tensor(bounds, device=input_ids.device)
            doc = torch.bucketize(torch.arange(total, device=input_ids.device), starts[1:], right=True)
            position_ids = (torch.arange(total, device=input_ids.device) - starts[doc])[None]
    if position_ids is None:
        position_ids = torch.arange(total, device=input_ids.device).expand(batch, total)
    layout = ShardLayout(rank, world, length, doc_starts)
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    lo, hi = layout.offset, layout.offset + length
    local_cu = None
    if cu_seqlens is not None:
        local_cu = torch.tensor(layout.local_bounds(), dtype=torch.int32, device=input_ids.device)
    return SequenceShard(
        input_ids=input_ids[:, lo:hi],
        shifted_labels=shifted[:, lo:hi],
        position_ids=position_ids.expand(batch, total)[:, lo:hi],
        cu_seqlens=local_cu,
        layout=layout,
        num_label_tokens=int((shifted != IGNORE_INDEX).sum()),
    )


# --- applying it to a model ---------------------------------------------------------------------------------


class SequenceParallel:
    """The plan ``apply_sequence_parallel`` installed: the group, the communication counter, and the shard of
    the forward call in flight (set by :meth:`batch`)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.counter = CommCounter()
        self._shard: ShardLayout | None = None

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @contextlib.contextmanager
    def batch(self, layout: ShardLayout) -> Iterator[None]:
        """Forward calls inside run sequence-parallel over ``layout`` (backward needs no context)."""
        previous, self._shard = self._shard, layout
        try:
            yield
        finally:
            self._shard = previous

    def shard(self, where: str) -> ShardLayout:
        if self._shard is None:
            raise RuntimeError(
                f"{where}: the model is sequence-parallel (apply_sequence_parallel) but was called outside "
                "`with sp.batch(shard.layout):`; use sequence_parallel_loss(model, sp, shard) or that context"
            )
        return self._shard


def _lightning_attend(sp: SequenceParallel, attn, q, k, v, layout, cache):  # noqa: ANN001, ANN202
    if cache is not None:
        raise ValueError("sequence parallelism is for training: a lightning layer got a generation cache")
    shard = sp.shard(f"layer {attn.layer_idx} (lightning)")
    o, _ = lasp_lightning_attention(q, k, v, attn.decay_rates, shard, sp.group, block_size=attn.block_size,
                                    impl=attn.impl, counter=sp.counter)  # fmt: skip
    return o


def _softmax_attend(sp: SequenceParallel, attn, q, k, v, layout, cache):  # noqa: ANN001, ANN202
    if cache is not None:
        raise ValueError("sequence parallelism is for training: a softmax layer got a KV cache")
    shard = sp.shard(f"layer {attn.layer_idx} (softmax)")
    return sequence_parallel_softmax_attention(q, k, v, shard, sp.group, enable_gqa=attn.num_kv_heads != attn.num_heads,
                                               counter=sp.counter)  # fmt: skip


def _global_aux_moe(sp: SequenceParallel, moe, forward, hidden, token_mask=None):  # noqa: ANN001, ANN202
    """The local MoE forward, with the §2.1 balance loss recomputed over all ranks' tokens (f_i and m_i are
    means over every token of the row: one all-reduce of the per-expert probability sums and slot counts)."""
    out = forward(hidden, token_mask)
    probs = torch.softmax(out.router_logits.to(torch.promote_types(out.router_logits.dtype, torch.float32)), -1)
    if token_mask is None:
        weight = probs.new_ones(probs.shape[0])
    else:
        weight = token_mask.reshape(-1).to(probs.dtype)
    local = torch.cat([(probs * weight[:, None]).sum(0), out.routed.to(probs.dtype), weight.sum()[None]])
    summed = all_reduce_sum(local, sp.group, sp.counter, "moe_aux")
    experts = probs.shape[-1]
    m = summed[:experts] / summed[-1].clamp(min=1.0)
    routed = summed[experts : 2 * experts].detach()
    f = routed / routed.sum().clamp(min=1.0)
    return replace(out, aux_loss=(f * m).sum() / experts)


def _is_moe_feed_forward(module: torch.nn.Module) -> bool:
    """The library's MoE layer and the stage's DeepSpeed one (its subclass) honour ``forward(hidden, token_mask) ->
    MoEOutput`` with router logits and slot counts, which is all the global balance loss reads."""
    from model.moe import MoEFeedForward  # heavy: transformers (the model package)

    return isinstance(module, MoEFeedForward)


def apply_sequence_parallel(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> SequenceParallel:
    """Make every attention layer of a ``HybridForCausalLM`` (or ``HybridModel``) run sequence-parallel over
    ``group`` (default: the world): lightning layers LASP+, softmax layers the K/V all-gather, MoE layers a
    global balance loss. Replaces the attention modules' ``attend`` seam and the MoE ``forward`` on the
    instances; the model's classes are untouched."""
    from model.modeling import LightningAttention, SoftmaxAttention  # heavy: transformers

    if not dist.is_initialized():
        raise RuntimeError("apply_sequence_parallel: torch.distributed is not initialised (init_process_group first)")
    backbone = getattr(model, "model", model)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise TypeError(f"apply_sequence_parallel: expected a HybridForCausalLM/HybridModel, got {type(model).__name__}")
    sp = SequenceParallel(group)
    for i, layer in enumerate(layers):
        if isinstance(layer.attn, LightningAttention):
            layer.attn.attend = functools.partial(_lightning_attend, sp, layer.attn)
        elif isinstance(layer.attn, SoftmaxAttention):
            layer.attn.attend = functools.partial(_softmax_attend, sp, layer.attn)
        else:
            raise TypeError(f"apply_sequence_parallel: layer {i} has an unknown attention {type(layer.attn).__name__}")
        if not _is_moe_feed_forward(layer.moe):
            raise TypeError(
                f"apply_sequence_parallel: layer {i}'s feed-forward is {type(layer.moe).__name__}; only "
                "model.moe.MoEFeedForward and pretrain.moe.DeepSpeedMoEFeedForward get the global balance loss"
            )
        layer.moe.forward = functools.partial(_global_aux_moe, sp, layer.moe, layer.moe.forward)
    return sp


def sequence_parallel_output(model: Any, sp: SequenceParallel, shard: SequenceShard, **kwargs: Any) -> Any:
    """The model's output on this rank's slice: logits [B, L, V] of its tokens, the (global) aux loss, the MoE
    slot counts of its tokens. ``model`` is the model or anything that calls it (a DeepSpeed engine); ``kwargs``
    go to its forward (no ``labels``: the loss needs the globally shifted ones, :func:`loss_share`)."""
    with sp.batch(shard.layout):
        return model(input_ids=shard.input_ids, position_ids=shard.position_ids, cu_seqlens=shard.cu_seqlens,
                     use_cache=False, **kwargs)  # fmt: skip


def shard_cross_entropy_sum(logits: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Cross-entropy summed over this rank's labelled tokens (float32 or wider)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shard.shifted_labels.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip


def loss_share(out: Any, shard: SequenceShard, aux_loss_coef: float) -> torch.Tensor:
    """This rank's share of the loss: CE summed over its labels / the batch's label count, plus 1/P of
    ``aux_loss_coef`` × the (global) aux loss. Summed over the ranks it is the single-process loss."""
    loss = shard_cross_entropy_sum(out.logits, shard) / max(shard.num_label_tokens, 1)
    if aux_loss_coef:
        loss = loss + aux_loss_coef * out.aux_loss / shard.layout.world
    return loss


def sequence_parallel_loss(model: torch.nn.Module, sp: SequenceParallel, shard: SequenceShard) -> torch.Tensor:
    """This rank's share of the loss (:func:`loss_share`, the aux term when the model adds it). Summed over the
    ranks it is the single-process loss; so are the parameter gradients (all-reduce them with SUM over the SP
    group, or scale the share by P where a data-parallel engine averages over all ranks: pretrain/train.py)."""
    out = sequence_parallel_output(model, sp, shard)
    coef = model.config.router_aux_loss_coef if model.config.output_router_logits else 0.0
    return loss_share(out, shard, coef)


def expected_step_bytes(config, layout: ShardLayout, batch: int, dtype: torch.dtype) -> dict[str, int]:  # noqa: ANN001
    """Payload bytes per rank for one forward + backward (the formula ``CommCounter`` is checked against).

    lightning (§3.2.2): per layer 2 · P·B·H·d²·e (gather forward, reduce backward), e the state's element size
    (float32 for bf16 models): O(d²) per rank, independent of the sequence length. softmax: per layer K and V,
    forward and backward, 4 · N·B·H_kv·D·e_model: O(N). moe_aux: per layer 2 · (2E+1)·e_f32+.
    """
    from model.configuration import LIGHTNING, SOFTMAX  # heavy: transformers

    state_e = torch.empty((), dtype=compute_dtype(dtype)).element_size()
    model_e = torch.empty((), dtype=dtype).element_size()
    aux_e = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    n_lightning = sum(kind == LIGHTNING for kind in config.attention_pattern)
    n_softmax = sum(kind == SOFTMAX for kind in config.attention_pattern)
    d = config.head_dim
    p = layout.world
    return {
        "lightning_state": n_lightning * 2 * p * batch * config.num_attention_heads * d * d * state_e,
        "softmax_kv": n_softmax * 4 * layout.total * batch * config.num_key_value_heads * d * model_e,
        "moe_aux": config.num_hidden_layers * 2 * (2 * config.num_experts + 1) * aux_e,
    }
