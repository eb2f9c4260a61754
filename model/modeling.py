"""The hybrid lightning/softmax MoE decoder of MiniMax-Text-01 (report §2), as a transformers model.

Read top to bottom: RMSNorm and partial RoPE; ``LightningAttention`` (the layer around the kernel in
``kernels/lightning``); ``SoftmaxAttention`` (GQA + RoPE via torch SDPA); ``HybridDecoderLayer`` (DeepNorm
residuals around an attention and a ``MoEFeedForward``); ``SequenceLayout`` (padding, packing, positions, masks,
built once per call); ``HybridModel`` / ``HybridForCausalLM``. The decoding caches, ``HybridCache`` and
``StaticHybridCache``, are in ``model/cache.py``.

Where the report and the released architecture (transformers' ``MiniMaxForCausalLM``) differ, this follows
the released one, for checkpoint parity:

* the residual is taken AFTER the input RMSNorm: ``h = norm(x); x = alpha * h + beta * sublayer(h)``. That is
  DeepNorm's post-LN ``x_{l+1} = LN(alpha x_l + G(x_l))`` with the LN moved to the start of the next
  sublayer (plus one LN on the embeddings and a final LN);
* the lightning output RMSNorm spans all heads (H*D) with eps 1e-6, whatever ``rms_norm_eps`` says;
* the MoE router is softmax-over-all, top-k, renormalise (equal to eq. 1, see ``model/moe.py``).

RoPE: the report (§2) and the released checkpoint's ``rotary_dim`` rotate half of each head; transformers'
in-tree MiniMax has no partial RoPE (it rotates the full head). We rotate the first ``rotary_dim`` dims in
the GPT-NeoX layout (pairs (i, i + R/2), frequencies base^(-2i/R)); ``model/hf_minimax.py`` maps that onto
transformers' "proportional" RoPE with a per-head dim permutation, exactly.

Padding: q, k, v are zeroed at padding tokens before lightning attention (as transformers'
``apply_mask_to_padding_states``). With LEFT padding that is exact: the state is still zero when the first
real token arrives, so the decay over the pad positions multiplies zero and a left-padded row equals the
unpadded one. Right padding leaves real outputs untouched but decays the final state over the trailing pads;
``generate`` pads on the left, so caches are never built from right-padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    SequenceClassifierOutputWithPast,
)

from kernels.host_values import host_ints, remember_host_ints
from kernels.lightning import lightning_attention, lightning_attention_decode, lightning_decay_rates
from kernels.softmax_decode import softmax_decode_attention
from kernels.softmax_varlen import document_causal_attention
from model import generation
from model.cache import HybridCache, StaticHybridCache
from model.configuration import LIGHTNING, SOFTMAX, HybridConfig
from model.moe import MoEFeedForward, SwiGLUExperts, TopKRouter

LIGHTNING_NORM_EPS = (
    1e-6  # released MiniMaxLightningAttention.norm uses the RMSNorm default, not rms_norm_eps
)


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in fp32 or wider (the released MiniMaxRMSNorm's operations)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE on the first ``rotary_dim`` dims of a head (§2: half of them).

    The frequencies are recomputed in fp32 from (rotary_dim, base) rather than kept as a buffer, so casting the
    model to bf16 cannot round them (the same holds for the lightning decay rates).
    """

    def __init__(self, rotary_dim: int, base: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.base = base

    def inverse_frequencies(self, device: torch.device | None = None) -> torch.Tensor:
        exponent = (
            torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim
        )
        return 1.0 / (self.base**exponent)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inverse_frequencies(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # [B, T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)  # [B, T, R]


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; rotate pairs (i, i + R/2) of the first R = cos.shape[-1] dims, pass the rest."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    cos, sin = cos[:, None], sin[:, None]
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    # x's dtype back: under autocast an fp32 cos/sin would leave q and k fp32 beside a bf16 v, which the packed
    # attention kernels refuse (transformers' apply_rotary_pos_emb casts back the same way)
    return torch.cat((rotated, x_pass), dim=-1).to(x.dtype)


# --- padding, packing and positions of one forward call ---------------------------------------------------


@dataclass
class SequenceLayout:
    """What every layer needs to know about the tokens of one call, derived once in ``HybridModel``."""

    position_ids: torch.Tensor  # [B, T]
    token_mask: torch.Tensor | None  # [B, T] bool, False at padding; None = no padding
    softmax_mask: torch.Tensor | None  # [B, 1, T, past + T] bool (True = attend); None = no dense mask
    cu_seqlens: torch.Tensor | None  # [N + 1] int32 over the flattened B*T tokens; None = not packed

    @property
    def softmax_by_documents(self) -> bool:
        """Packed documents without padding (never with a cache): softmax layers attend within each document
        through ``cu_seqlens`` (kernels/softmax_varlen.py), and no O(T^2) mask exists. Otherwise they use
        ``softmax_mask``, or plain causal attention when it is None."""
        return self.cu_seqlens is not None and self.softmax_mask is None

    @classmethod
    def build(
        cls,
        batch: int,
        length: int,
        past: int,
        device: torch.device,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
    ) -> SequenceLayout:
        full_mask = None  # [B, past + T] bool over cached and new tokens
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"attention_mask must be 2-D [batch, past + new tokens] with 1 for real tokens, got shape "
                    f"{tuple(attention_mask.shape)}; packed sequences go in position_ids or cu_seqlens"
                )
            if attention_mask.shape[1] == past + length:
                full_mask = attention_mask.bool()
            elif past and attention_mask.shape[1] == length:
                full_mask = torch.cat(
                    [attention_mask.new_ones(batch, past).bool(), attention_mask.bool()], dim=1
                )
            else:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[1]} tokens but the cache holds {past} and "
                    f"{length} are new; pass a mask over all {past + length}"
                )
            if bool(full_mask.all()):
                full_mask = None
        token_mask = None if full_mask is None else full_mask[:, past:]

        doc_ids = None  # [B, T]: packed documents, numbered from 0 at each row start
        packed_cu = None
        if cu_seqlens is not None:
            if batch != 1 or past:
                raise ValueError("cu_seqlens packs documents along one row: needs batch size 1 and no cache")
            # the bounds on the host: free for a CPU tensor (the pretrain stage passes one), one read of a device
            # tensor; the layers' kernels then plan from the host copy without waiting for the GPU again
            host = host_ints(cu_seqlens)
            if host[0] != 0 or host[-1] != length:
                raise ValueError(f"cu_seqlens must start at 0 and end at the sequence length {length}")
            if any(b < a for a, b in zip(host[:-1], host[1:], strict=True)):
                raise ValueError(f"cu_seqlens must be non-decreasing (cumulative document lengths), got {host}")
            bounds = cu_seqlens.to(device=device, dtype=torch.long)
            doc_ids = torch.bucketize(torch.arange(length, device=device), bounds[1:], right=True)[None]
            if position_ids is None:  # each document counts from 0, as if run alone
                position_ids = torch.arange(length, device=device)[None] - bounds[doc_ids]
            starts = sorted({b for b in host[:-1] if b < length})  # non-empty documents' first tokens
            packed_cu = torch.tensor([*starts, length], dtype=torch.int32).to(device)
            remember_host_ints(packed_cu, [*starts, length])

        if position_ids is None:
            if full_mask is None:
                position_ids = torch.arange(past, past + length, device=device).expand(batch, length)
            else:  # count real tokens only, so a left-padded row is positioned like the unpadded one
                position_ids = (full_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        position_ids = position_ids.to(device).expand(batch, length)

        if doc_ids is None and length > 1:
            # A position that does not continue its predecessor starts a document (HF's padding-free
            # convention). Pairs involving padding do not count: left padding is not packing.
            breaks = position_ids[:, 1:] != position_ids[:, :-1] + 1
            if token_mask is not None:
                breaks &= token_mask[:, 1:] & token_mask[:, :-1]
            if bool(breaks.any()):
                if past:
                    raise ValueError(
                        "position_ids restart inside the new tokens (packed documents) while continuing a cache; "
                        "packed sequences can only be run from an empty cache"
                    )
                doc_ids = F.pad(breaks.long(), (1, 0)).cumsum(-1)

        if doc_ids is not None and packed_cu is None:  # flatten rows; every row and document start is a boundary
            starts = F.pad((doc_ids[:, 1:] != doc_ids[:, :-1]), (1, 0), value=True).reshape(-1)
            first = torch.nonzero(starts).squeeze(1)
            packed_cu = torch.cat([first, first.new_tensor([batch * length])]).to(torch.int32)

        # A dense softmax mask only where padding or a cache needs one. Packed rows without padding go to
        # document_causal_attention over packed_cu instead (memory linear in B*T, §3.2 data-packing); packed
        # rows WITH padding keep the mask: pads join a neighbouring document there and must stay unseen.
        softmax_mask = None
        if full_mask is not None or (past and length > 1):
            q_pos = torch.arange(past, past + length, device=device)[:, None]
            k_pos = torch.arange(past + length, device=device)[None, :]
            mask = (k_pos <= q_pos)[None].expand(batch, length, past + length)
            if full_mask is not None:
                mask = mask & full_mask[:, None, :]
            if doc_ids is not None:
                mask = mask & (doc_ids[:, :, None] == doc_ids[:, None, :])
            # a padding query still sees itself: some SDPA backends turn an all-masked row into NaN, and a NaN
            # at a pad position would survive the zeroing (NaN * 0) into the next lightning layer's state
            mask = mask | (k_pos == q_pos)[None]
            softmax_mask = mask[:, None]
        return cls(position_ids, token_mask, softmax_mask, packed_cu)


# --- attention layers ---------------------------------------------------------------------------------------


class LightningAttention(nn.Module):
    """MiniMax-Text-01 lightning attention (§2.2): fused QKV, SiLU on q, k, v, no 1/sqrt(d) scale, per-head
    decay, RMSNorm over all heads, sigmoid output gate from the layer input, output projection."""

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.block_size = config.lightning_block_size
        self.impl = config.lightning_impl
        inner = self.num_heads * self.head_dim
        # rows per head laid out [q_h | k_h | v_h], as in the released checkpoint
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * inner, bias=False)
        self.norm = RMSNorm(inner, eps=LIGHTNING_NORM_EPS)
        self.output_gate = nn.Linear(config.hidden_size, inner, bias=False)
        self.out_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self._decay_rates: dict[torch.device, torch.Tensor] = {}

    @property
    def decay_rates(self) -> torch.Tensor:
        """fp32 [H] rates s_h from kernels.lightning (the one source of truth), cached per device."""
        device = self.qkv_proj.weight.device
        if device not in self._decay_rates:
            # never an inference tensor: the first call may come from generate (inference mode), and the Triton
            # kernels save the rates for backward in a later training step (an H100 SFT run failed on exactly that)
            with torch.inference_mode(False), torch.no_grad():
                self._decay_rates[device] = lightning_decay_rates(
                    self.num_heads, self.layer_idx, self.num_layers, device=device
                )
        return self._decay_rates[device]

    def decode_projection_weights(self) -> list[torch.Tensor]:
        """The weights a decode step may read as one (``StaticHybridCache.load_decode_projections``)."""
        return [self.qkv_proj.weight, self.output_gate.weight]

    def forward(
        self, x: torch.Tensor, layout: SequenceLayout, cache: HybridCache | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        stacked = _decode_projection(cache, self.layer_idx, T)
        if stacked is not None:  # one product for qkv and the gate's input
            qkv, gate = F.linear(x, stacked).split([3 * H * D, H * D], dim=-1)
            qkv = F.silu(qkv)
        else:
            qkv, gate = F.silu(self.qkv_proj(x)), None
        if layout.token_mask is not None:  # padding must not enter the state
            qkv = qkv * layout.token_mask[..., None].to(qkv.dtype)
        q, k, v = qkv.view(B, T, H, 3 * D).transpose(1, 2).split(D, dim=-1)  # each [B, H, T, D]
        o = self.attend(q, k, v, layout, cache)
        o = o.transpose(1, 2).reshape(B, T, H * D)
        o = torch.sigmoid(self.output_gate(x) if gate is None else gate) * self.norm(o)
        return self.out_proj(o)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, cache: HybridCache | None
    ) -> torch.Tensor:
        """The token mixing alone: q, k, v [B, H, T, D] -> o [B, H, T, D]. The seam where parallelism applied
        from outside (``pretrain/sequence_parallel.py``, LASP+ §3.2.2) swaps in its own computation."""
        B, H, T, D = q.shape
        decay = self.decay_rates
        if isinstance(cache, StaticHybridCache):
            return self.attend_static(q, k, v, layout, cache)
        state = None if cache is None else cache.lightning_states.get(self.layer_idx)

        if layout.cu_seqlens is not None:  # packed documents: one varlen row, state reset at each boundary
            flat = [t.transpose(0, 1).reshape(1, H, B * T, D) for t in (q, k, v)]
            o, _ = lightning_attention(
                *flat, decay, block_size=self.block_size, cu_seqlens=layout.cu_seqlens, impl=self.impl
            )
            o = o.reshape(H, B, T, D).transpose(0, 1)
        elif T == 1 and state is not None:  # one generated token: O(D^2) per head whatever the context
            o, state = lightning_attention_decode(q, k, v, decay, state, impl=self.impl)
        else:
            o, state = lightning_attention(
                q, k, v, decay, block_size=self.block_size, initial_state=state,
                output_final_state=cache is not None, impl=self.impl,
            )  # fmt: skip
        if cache is not None:
            cache.lightning_states[self.layer_idx] = state
        return o

    def attend_static(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, cache: StaticHybridCache
    ) -> torch.Tensor:
        """Generation over a preallocated cache: a packed prefill (one prompt per document, its final state into
        its rows) or one decode token per row, the state updated in place."""
        B, H, T, D = q.shape
        if layout.cu_seqlens is not None and cache.prefill_start:  # a later piece of a chunked prefill
            state = cache.lightning_states[self.layer_idx][:1]
            o, final = lightning_attention(
                q, k, v, self.decay_rates, block_size=self.block_size, initial_state=state,
                output_final_state=True, impl=self.impl,
            )  # fmt: skip
            cache.store_prefill_state(self.layer_idx, final)
            return o
        if layout.cu_seqlens is not None:
            flat = [t.transpose(0, 1).reshape(1, H, B * T, D) for t in (q, k, v)]
            o, final = lightning_attention(
                *flat, self.decay_rates, block_size=self.block_size, cu_seqlens=layout.cu_seqlens,
                output_final_state=True, impl=self.impl,
            )  # fmt: skip
            cache.store_prefill_state(self.layer_idx, final)
            return o.reshape(H, B, T, D).transpose(0, 1)
        return _decode_in_place(q, k, v, self.decay_rates, cache.lightning_states[self.layer_idx], self.impl)


def _decode_projection(cache: HybridCache | StaticHybridCache | None, layer_idx: int, T: int) -> torch.Tensor | None:
    """The layer's stacked input projections when this is a decode step over a cache that holds them."""
    if T != 1 or not isinstance(cache, StaticHybridCache):
        return None
    return cache.decode_proj.get(layer_idx)


@torch.compiler.disable  # the state is updated in place, never copied (see StaticHybridCache.append_kv)
def _decode_in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, state: torch.Tensor,
                     impl: str) -> torch.Tensor:
    o, _ = lightning_attention_decode(q, k, v, decay, state, impl=impl, out_state=state)
    return o


class SoftmaxAttention(nn.Module):
    """Causal softmax attention with GQA and RoPE on the first ``rotary_dim`` dims of each head (§2); packed
    documents attend only within themselves, through ``kernels.softmax_varlen`` (no [T, T] mask)."""

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d, D = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, d, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        layout: SequenceLayout,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: HybridCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        stacked = _decode_projection(cache, self.layer_idx, T)
        if stacked is not None:  # one product for q, k and v
            q, k, v = F.linear(x, stacked).split([self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.num_heads, D).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, D).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, D).transpose(1, 2)
        q, k = apply_partial_rotary(q, *rope), apply_partial_rotary(k, *rope)
        o = self.attend(q, k, v, layout, cache)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.num_heads * D))

    def decode_projection_weights(self) -> list[torch.Tensor]:
        """The weights a decode step may read as one (``StaticHybridCache.load_decode_projections``)."""
        return [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, cache: HybridCache | None
    ) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, H_kv, T, D] (RoPE applied) -> o [B, H, T, D]; the seam sequence parallelism
        replaces from outside (``pretrain/sequence_parallel.py``), as in ``LightningAttention.attend``."""
        B, _, T, D = q.shape
        gqa = self.num_kv_heads != self.num_heads
        static = isinstance(cache, StaticHybridCache)
        if layout.softmax_by_documents:  # packed: one row of all B*T tokens, as in LightningAttention
            if cache is not None and not static:
                raise ValueError(
                    "packed documents (cu_seqlens, restarting position_ids) cannot use a KV cache"
                )
            flat = [t.transpose(0, 1).reshape(1, t.shape[1], B * T, D) for t in (q, k, v)]
            if static and cache.prefill_start:  # a later piece of a chunked prefill: the earlier pieces' keys too
                cache.store_prefill_kv(self.layer_idx, flat[1], flat[2])
                return _continued_prefill_attention(q, *cache.prefill_keys(self.layer_idx, cache.prefill_start + T))
            # a generation prefill packs a different number of tokens each call: the SDPA loop (one flash call per
            # prompt) needs no compilation per shape, as the compiled Flex path would
            if static:  # packed prefill of a generation cache: each prompt's keys/values into its rows
                o = document_causal_attention(*flat, layout.cu_seqlens, enable_gqa=gqa, impl="sdpa_loop")
                cache.store_prefill_kv(self.layer_idx, flat[1], flat[2])
            else:
                o = document_causal_attention(*flat, layout.cu_seqlens, enable_gqa=gqa)
            return o.reshape(self.num_heads, B, T, D).transpose(0, 1)
        if static:  # one decode token per row against the row's own cached keys
            cache.append_kv(self.layer_idx, k, v)
            return softmax_decode_attention(q, cache.keys[self.layer_idx], cache.values[self.layer_idx],
                                            cache.lengths + 1)
        if cache is not None:
            k, v = cache.update_kv(self.layer_idx, k, v)
        mask = layout.softmax_mask
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and T > 1,
            enable_gqa=gqa,
        )
        return o


def _continued_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, H, T, D] of a prefill piece, k/v [1, H_kv, S, D] of the prompt so far (S >= T, the piece's own keys
    last): causal attention aligned at the bottom right (query i sees keys 0 .. S - T + i). The keys are repeated
    to H heads first: SDPA's memory-efficient kernel takes a lower-right causal bias, but not with GQA, and the
    math fallback would build the [T, S] scores (64K x 1M) instead. At gpu-300m and S = 1M the repeat is 4 GiB."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))


# --- decoder layer ------------------------------------------------------------------------------------------


class HybridDecoderLayer(GradientCheckpointingLayer):
    """norm -> attention -> DeepNorm residual -> norm -> MoE -> DeepNorm residual (released layout)."""

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.kind = config.attention_pattern[layer_idx]
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.kind == LIGHTNING:
            self.attn = LightningAttention(config, layer_idx)
            self.attn_alpha, self.attn_beta = config.lightning_attn_alpha, config.lightning_attn_beta
        else:
            self.attn = SoftmaxAttention(config, layer_idx)
            self.attn_alpha, self.attn_beta = config.softmax_attn_alpha, config.softmax_attn_beta
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.moe = MoEFeedForward.from_config(config)  # swappable: see the contract in model/moe.py
        self.mlp_alpha, self.mlp_beta = config.mlp_alpha, config.mlp_beta

    def forward(
        self,
        x: torch.Tensor,
        layout: SequenceLayout,
        rope: tuple[torch.Tensor, torch.Tensor],
        past_key_values: HybridCache | StaticHybridCache | None = None,
        moe_stats: bool = True,
    ):
        h = self.attn_norm(x)
        if self.kind == SOFTMAX:
            a = self.attn(h, layout, rope, past_key_values)
        else:
            a = self.attn(h, layout, past_key_values)
        x = h * self.attn_alpha + a * self.attn_beta  # residual after the norm, as released
        h = self.ffn_norm(x)
        moe = self.moe(h, layout.token_mask) if moe_stats else self.moe(h, layout.token_mask, stats=False)
        return h * self.mlp_alpha + moe.hidden * self.mlp_beta, moe


# --- transformers models ------------------------------------------------------------------------------------


@dataclass
class HybridModelOutput(MoeModelOutputWithPast):
    """``aux_loss``: mean over layers of (1/E) sum f_i m_i; ``moe_routed``/``moe_dropped``: [L, E] token slots."""

    aux_loss: torch.Tensor | None = None
    moe_routed: torch.Tensor | None = None
    moe_dropped: torch.Tensor | None = None


@dataclass
class HybridCausalLMOutput(MoeCausalLMOutputWithPast):
    moe_routed: torch.Tensor | None = None
    moe_dropped: torch.Tensor | None = None


def _xavier_normal_(w: torch.Tensor, gain: float, fan_in: int, fan_out: int) -> None:
    if not getattr(w, "_is_hf_initialized", False):  # keep weights that from_pretrained loaded
        with torch.no_grad():
            w.normal_(0.0, gain * (2.0 / (fan_in + fan_out)) ** 0.5)


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    config: HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _is_stateful = True  # a lightning state cannot rewind: no assisted decoding

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate must not hand us a DynamicCache; HybridModel creates a HybridCache

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # transformers skips custom modules without direct parameters (is_custom_code shortcut); every branch
        # of _init_weights checks each tensor's _is_hf_initialized flag itself, so always dispatch.
        if not getattr(module, "_is_hf_initialized", False):
            self._init_weights(module)
            module._is_hf_initialized = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Xavier-normal everywhere (§4.1); DeepNorm's beta = (8N)^-1/4 as gain on the value and output
        projections and the experts, gain 1 on queries, keys, gates and the router (Wang et al.)."""
        cfg = self.config
        beta, d = cfg.init_beta, cfg.hidden_size
        if isinstance(module, LightningAttention):
            inner = module.num_heads * module.head_dim
            w = module.qkv_proj.weight
            if not getattr(w, "_is_hf_initialized", False):
                per_head = w.view(module.num_heads, 3, module.head_dim, d)
                for j, gain in enumerate((1.0, 1.0, beta)):  # q, k, v
                    per_head[:, j].normal_(0.0, gain * (2.0 / (d + inner)) ** 0.5)
            _xavier_normal_(module.output_gate.weight, 1.0, d, inner)
            _xavier_normal_(module.out_proj.weight, beta, inner, d)
        elif isinstance(module, SoftmaxAttention):
            q_out, kv_out = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
            _xavier_normal_(module.q_proj.weight, 1.0, d, q_out)
            _xavier_normal_(module.k_proj.weight, 1.0, d, kv_out)
            _xavier_normal_(module.v_proj.weight, beta, d, kv_out)
            _xavier_normal_(module.o_proj.weight, beta, q_out, d)
        elif isinstance(module, TopKRouter):
            _xavier_normal_(module.weight, 1.0, d, module.weight.shape[0])
        elif isinstance(module, SwiGLUExperts):
            f = module.down_proj.shape[-1]
            _xavier_normal_(module.gate_up_proj, beta, d, f)  # each of gate, up: d -> F
            _xavier_normal_(module.down_proj, beta, f, d)
        elif isinstance(module, RMSNorm):
            if not getattr(module.weight, "_is_hf_initialized", False):
                module.weight.fill_(1.0)
        elif isinstance(module, nn.Embedding):
            _xavier_normal_(module.weight, 1.0, module.embedding_dim, module.num_embeddings)
        elif module is getattr(self, "lm_head", None):
            _xavier_normal_(module.weight, 1.0, d, cfg.vocab_size)
        elif module is getattr(self, "score", None):
            _xavier_normal_(module.weight, 1.0, d, module.out_features)


class HybridModel(HybridPreTrainedModel):
    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: HybridCache | StaticHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        output_hidden_states: bool | None = None,
        output_moe_stats: bool = True,
        **kwargs,
    ) -> HybridModelOutput:
        """``output_moe_stats=False`` skips the balance loss and the routing counters (``aux_loss``,
        ``moe_routed``, ``moe_dropped`` are None): a decode step has no use for them.

        With a ``StaticHybridCache`` (model/generation.py) a call is either its packed prefill (``cu_seqlens``,
        after ``begin_prefill``) or one decode token per row at the positions ``cache.lengths``."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions is not supported: lightning layers never form attention maps")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        static = isinstance(past_key_values, StaticHybridCache)
        if past_key_values is not None and not (static or isinstance(past_key_values, HybridCache)):
            raise TypeError(
                f"past_key_values must be a model.modeling.HybridCache or StaticHybridCache, got "
                f"{type(past_key_values).__name__}"
            )
        if static:
            if attention_mask is not None or (cu_seqlens is None and T != 1):
                raise ValueError(
                    "a StaticHybridCache takes a packed prefill (cu_seqlens, no attention_mask) or one token per "
                    "row (no attention_mask: positions come from cache.lengths)"
                )
            if cu_seqlens is None:
                position_ids = past_key_values.lengths[:, None]
        # training forwards build no cache unless the caller asks for one (generate does, e.g. GRPO rollouts with the
        # policy in training mode: without the cache each decode step would see only its newest token)
        asked = use_cache is True or past_key_values is not None
        use_cache = self.config.use_cache if use_cache is None else use_cache
        past = 0 if past_key_values is None or static else past_key_values.get_seq_length()
        layout = SequenceLayout.build(B, T, past, x.device, attention_mask, position_ids, cu_seqlens)
        if static:
            use_cache = True
        elif (self.training and not asked) or layout.cu_seqlens is not None:
            use_cache = False  # packed documents have no single state to continue
        if use_cache and past_key_values is None:
            past_key_values = HybridCache()
        cache = past_key_values if use_cache else None

        rope = self.rotary(layout.position_ids, x.dtype)
        all_hidden = [] if output_hidden_states else None
        moe_outputs = []
        for layer in self.layers:
            if all_hidden is not None:
                all_hidden.append(x)
            x, moe = layer(x, layout, rope, past_key_values=cache, moe_stats=output_moe_stats)
            moe_outputs.append(moe)
        x = self.norm(x)
        if all_hidden is not None:
            all_hidden.append(x)
        if cache is not None and not static:
            cache.seen_tokens += T

        want_logits = (
            self.config.output_router_logits if output_router_logits is None else output_router_logits
        )
        return HybridModelOutput(
            last_hidden_state=x,
            past_key_values=cache,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            router_logits=tuple(m.router_logits for m in moe_outputs) if want_logits else None,
            aux_loss=torch.stack([m.aux_loss for m in moe_outputs]).mean() if output_moe_stats else None,
            moe_routed=torch.stack([m.routed for m in moe_outputs]) if output_moe_stats else None,
            moe_dropped=torch.stack([m.dropped for m in moe_outputs]) if output_moe_stats else None,
        )


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.model = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.vocab_size = config.vocab_size
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, fast_decode: bool = True,
                 **kwargs):
        """``GenerationMixin.generate``, served by ``model/generation.py`` (preallocated cache, packed prefill,
        CUDA-graph decode) whenever the call asks only for what that path implements: greedy or sampled
        (temperature, top-k, top-p), eos and pad, min/max new tokens, ``num_return_sequences``. Anything else
        (beam search, penalties, logits processors, returned scores, ...) or ``fast_decode=False`` runs
        transformers' own loop over ``HybridCache``; ``model.last_generation_refusal`` says why it did."""
        input_ids = kwargs.pop("input_ids", inputs)
        spec, why = (None, "fast_decode=False") if not fast_decode else generation.GenerationSpec.resolve(
            self, input_ids, generation_config, kwargs)
        if spec is not None:
            mask = kwargs.get("attention_mask")
            if mask is None and spec.pad not in spec.eos and bool((input_ids == spec.pad).any()):
                mask = input_ids != spec.pad  # transformers infers the mask from pad tokens the same way
            prompts = generation.prompt_tokens(input_ids, mask)
            if isinstance(prompts, str):
                spec, why = None, prompts
        self.last_generation_refusal = why
        if spec is None:
            self.last_generation_stats = None
            return super().generate(input_ids, generation_config=generation_config, **kwargs)
        return generation.generate(self, input_ids, prompts, spec)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: HybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        output_moe_stats: bool = True,
        **kwargs,
    ) -> HybridCausalLMOutput | tuple:
        """Next-token logits; with ``labels``, the shifted cross-entropy plus, when router logits are
        output (``config.output_router_logits``, default on), ``router_aux_loss_coef * aux_loss``."""
        want_router = (
            self.config.output_router_logits if output_router_logits is None else output_router_logits
        )
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
            output_router_logits=want_router,
            output_hidden_states=output_hidden_states,
            output_moe_stats=output_moe_stats,
            output_attentions=kwargs.pop("output_attentions", None),
        )
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        else:
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
            if want_router:
                loss = loss + self.config.router_aux_loss_coef * out.aux_loss.to(loss.device)
        result = HybridCausalLMOutput(
            loss=loss,
            aux_loss=out.aux_loss,
            logits=logits,
            past_key_values=out.past_key_values,
            hidden_states=out.hidden_states,
            router_logits=out.router_logits,
            moe_routed=out.moe_routed,
            moe_dropped=out.moe_dropped,
        )
        return result if return_dict is not False else result.to_tuple()


class HybridForSequenceClassification(HybridPreTrainedModel):
    """A score per sequence: ``score(h_last)``, h_last the final hidden state of the last real token (report §5.2's
    reward models are this shape with ``num_labels=1``). Loaded from a ``HybridForCausalLM`` directory, the
    backbone (``model.*``) comes from the checkpoint and ``score`` is new (``lm_head`` is not used).

    The last real token is the last position where ``attention_mask`` is 1, so left and right padding both
    work: left padding is exact (see the module docstring), and right padding leaves every real position's
    hidden state untouched. Without a mask it is the last token that is not ``config.pad_token_id``, else the
    last position.
    """

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = HybridModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def last_token_index(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                         batch: int, length: int, device: torch.device) -> torch.Tensor:
        """[B] index of each row's last real token."""
        positions = torch.arange(length, device=device)
        if attention_mask is not None:
            real = attention_mask[:, -length:].to(device).bool()
        elif input_ids is not None and self.config.pad_token_id is not None:
            real = input_ids != self.config.pad_token_id
        else:
            return torch.full((batch,), length - 1, device=device, dtype=torch.long)
        # a row with no real token scores its last position (an empty row has no meaning to give it)
        return torch.where(real, positions, -1).amax(-1).clamp(min=0)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast | tuple:
        """``logits`` [B, num_labels]. With ``labels``: MSE for ``num_labels == 1`` (a regression score), else
        cross-entropy. Reward training (Bradley-Terry) computes its own loss from the logits."""
        kwargs.pop("use_cache", None)  # scoring never keeps a cache
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            output_router_logits=False,
            output_hidden_states=kwargs.pop("output_hidden_states", None),
            output_attentions=kwargs.pop("output_attentions", None),
        )
        h = out.last_hidden_state  # [B, T, d]
        B, T = h.shape[:2]
        idx = self.last_token_index(input_ids, attention_mask, B, T, h.device)
        logits = self.score(h[torch.arange(B, device=h.device), idx])  # [B, num_labels]
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).view(-1))
            else:
                loss = F.cross_entropy(logits, labels.view(-1))
        result = SequenceClassifierOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states)
        return result if return_dict is not False else result.to_tuple()
