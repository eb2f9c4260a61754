"""The decoding caches of ``HybridForCausalLM`` (model/modeling.py): ``HybridCache`` (one d x d state per lightning
head, a KV cache for softmax layers only; what transformers' ``generate`` loop grows) and ``StaticHybridCache`` (the
same, preallocated, for ``model/generation.py``)."""

from __future__ import annotations

import torch
from torch import nn

from model.configuration import LIGHTNING, HybridConfig


class HybridCache:
    """Decoding state: per lightning layer one [B, H, D, D] state (O(1) in context length), per softmax
    layer the keys/values [B, H_kv, S, D]. ``generate`` sees ``get_seq_length`` and the batch reorderings."""

    is_compileable = False
    is_croppable = False  # a lightning state cannot be rolled back

    def __init__(self) -> None:
        self.lightning_states: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def update_kv(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.keys:
            k = torch.cat([self.keys[layer_idx], k], dim=2)
            v = torch.cat([self.values[layer_idx], v], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def _map(self, fn) -> None:
        for store in (self.lightning_states, self.keys, self.values):
            for i in store:
                store[i] = fn(store[i])

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the lightning states and by the softmax KV cache."""
        return _cache_nbytes(self)


def _cache_nbytes(cache: HybridCache | StaticHybridCache) -> dict[str, int]:
    lightning = sum(t.numel() * t.element_size() for t in cache.lightning_states.values())
    kv = sum(t.numel() * t.element_size() for store in (cache.keys, cache.values) for t in store.values())
    return {"lightning": lightning, "softmax_kv": kv}


class StaticHybridCache:
    """Preallocated decoding state for ``model/generation.py``: per lightning layer one [B, H, D, D] fp32 state,
    per softmax layer keys/values stored [B, capacity, H_kv, D] (so one ``index_copy_`` over the flattened
    (row, position) axis writes a step's keys; ``keys``/``values`` hold [B, H_kv, capacity, D] views), and ``lengths`` [B] (tokens cached per row, on the
    device). Nothing is reallocated while decoding, so a decode step keeps every address and can be replayed as
    a CUDA graph; the lightning state is the same exact O(1) recurrence as ``HybridCache``'s.

    Filled by a packed prefill: the prompts along one row with ``cu_seqlens`` (no padding computed, no padded
    state), prompt i going to rows ``i * copies ... i * copies + copies - 1`` (``num_return_sequences``); see
    :meth:`begin_prefill`. Then one token per row per decode step, at position ``lengths[b]``; the caller
    advances ``lengths`` after the step (``generation.DecodeEngine``), so every layer of a step sees the same
    positions. Rows differ in length; a softmax layer reads only each row's own keys
    (``kernels.softmax_decode``)."""

    def __init__(self, config: HybridConfig, batch: int, capacity: int, device: torch.device | str,
                 dtype: torch.dtype):
        self.batch, self.capacity = batch, capacity
        H, D, kv = config.num_attention_heads, config.head_dim, config.num_key_value_heads
        self.lightning_states: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        for i, kind in enumerate(config.attention_pattern):
            if kind == LIGHTNING:  # fp32 at least whatever the activations, as HybridCache's states under bf16
                state_dtype = torch.promote_types(dtype, torch.float32)
                self.lightning_states[i] = torch.zeros(batch, H, D, D, device=device, dtype=state_dtype)
            else:
                for store in (self.keys, self.values):
                    store[i] = torch.zeros(batch, capacity, kv, D, device=device, dtype=dtype).transpose(1, 2)
        self.lengths = torch.zeros(batch, device=device, dtype=torch.long)
        # per attention layer, its input projections stacked into one weight (``load_decode_projections``)
        self.decode_proj: dict[int, torch.Tensor] = {}
        self.prefill_rows: torch.Tensor | None = None  # [N] first cache row of each packed prompt
        self.prefill_token_rows: torch.Tensor | None = None  # [T_total] that row, per packed token
        self.prefill_token_pos: torch.Tensor | None = None  # [T_total] the token's position in its row
        self.prefill_start = 0  # a chunked prefill's piece: its first token's position (0: a whole prefill)
        self.copies = 1

    @torch.no_grad()
    def load_decode_projections(self, model: nn.Module) -> None:
        """Stack each attention layer's input projections (lightning: qkv and the output gate; softmax: q, k, v;
        each reads the same normed input) into one weight, so a decode step runs one matrix-vector product per
        layer where it ran two or three: at batch 1 each is a launch- and latency-bound ~4 us kernel (an H100
        profile: 46 of them, 22% of the step). Copied in place (a captured graph keeps the addresses) before every
        call, since the model may have trained since the last one; the layers' own parameters stay the truth."""
        for layer in model.model.layers:
            attn = layer.attn
            parts = attn.decode_projection_weights()
            held = self.decode_proj.get(attn.layer_idx)
            if held is None or held.dtype != parts[0].dtype or held.device != parts[0].device:
                self.decode_proj[attn.layer_idx] = torch.cat(parts)
            else:
                torch.cat(parts, out=held)

    def begin_prefill(self, prompt_lengths: list[int], copies: int = 1) -> None:
        """Plan a packed prefill of ``len(prompt_lengths)`` prompts (each >= 1 token, copies of each fill
        consecutive rows). Rows past them are emptied (zero state, length 0); ``lengths`` is set for after it."""
        n = len(prompt_lengths)
        if n * copies > self.batch:
            raise ValueError(f"StaticHybridCache: {n} prompts x {copies} copies need more than {self.batch} rows")
        if min(prompt_lengths, default=1) < 1 or max(prompt_lengths, default=0) > self.capacity:
            raise ValueError(f"StaticHybridCache: prompt lengths must lie in [1, {self.capacity}], got "
                             f"{min(prompt_lengths)}..{max(prompt_lengths)}")
        device = self.lengths.device
        lengths = torch.tensor(prompt_lengths, dtype=torch.long)
        first_row = torch.arange(n, dtype=torch.long) * copies
        self.prefill_rows = first_row.to(device)
        self.prefill_token_rows = first_row.repeat_interleave(lengths).to(device)
        self.prefill_token_pos = torch.cat([torch.arange(int(n_i)) for n_i in lengths]).to(device)
        self.copies = copies
        self.prefill_start = 0
        for state in self.lightning_states.values():
            state.zero_()
        row_lengths = torch.zeros(self.batch, dtype=torch.long)
        row_lengths[: n * copies] = lengths.repeat_interleave(copies)
        self.lengths.copy_(row_lengths.to(device))

    def begin_prefill_chunk(self, start: int, length: int) -> None:
        """Plan the piece ``start .. start + length - 1`` of a chunked prefill of one prompt (after
        :meth:`begin_prefill` of that one prompt): its keys and values go to those positions of the prompt's rows,
        and a piece after the first continues the state and attends to the keys the earlier pieces left."""
        if self.prefill_rows is None or self.prefill_rows.numel() != 1:
            raise ValueError("StaticHybridCache: a chunked prefill is of one prompt; call begin_prefill([n]) first")
        if start < 0 or length < 1 or start + length > int(self.lengths[0]):
            raise ValueError(f"StaticHybridCache: piece {start}..{start + length - 1} lies outside the prompt's "
                             f"{int(self.lengths[0])} tokens")
        device = self.lengths.device
        self.prefill_token_rows = torch.zeros(length, dtype=torch.long, device=device)
        self.prefill_token_pos = torch.arange(start, start + length, device=device)
        self.prefill_start = start

    def prefill_keys(self, layer_idx: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's cached keys and values at positions 0 .. end - 1 (row 0; [1, H_kv, end, D] views)."""
        return self.keys[layer_idx][:1, :, :end], self.values[layer_idx][:1, :, :end]

    def store_prefill_state(self, layer_idx: int, final: torch.Tensor) -> None:
        """final [N, H, D, D]: each prompt's state after its last token, into its rows."""
        state = self.lightning_states[layer_idx]
        for c in range(self.copies):
            state.index_copy_(0, self.prefill_rows + c, final.to(state.dtype))

    @staticmethod
    def _slots(layer_idx: int, store: dict[int, torch.Tensor]) -> torch.Tensor:
        """[B * capacity, H_kv, D]: the layer's buffer with (row, position) flattened (a view)."""
        return store[layer_idx].transpose(1, 2).flatten(0, 1)

    def store_prefill_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [1, H_kv, T_total, D] of the packed prompts, into their rows at positions 0..len - 1."""
        for store, x in ((self.keys, k), (self.values, v)):
            rows = x[0].transpose(0, 1).to(store[layer_idx].dtype)  # [T_total, H_kv, D]
            for c in range(self.copies):
                slot = (self.prefill_token_rows + c) * self.capacity + self.prefill_token_pos
                self._slots(layer_idx, store).index_copy_(0, slot, rows)

    # outside torch.compile's graph (a compiled decode step): traced, a write into a view of a graph input became
    # a copy of the whole buffer every step (1 GB per layer at 512K context); eager, it is one in-place kernel, and
    # the CUDA graph around the step captures it all the same
    @torch.compiler.disable
    def append_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, H_kv, 1, D] of a decode step, at each row's position ``lengths[b]`` (no host read)."""
        buffer = self.keys[layer_idx]  # sizes from the tensor: a compiled step may treat the capacity as dynamic
        slot = torch.arange(buffer.shape[0], device=k.device) * buffer.shape[2] + self.lengths
        for store, x in ((self.keys, k), (self.values, v)):
            self._slots(layer_idx, store).index_copy_(0, slot, x[:, :, 0].to(store[layer_idx].dtype))

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the lightning states and by the softmax KV buffers (their whole capacity)."""
        return _cache_nbytes(self)
