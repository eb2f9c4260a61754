"""Fast generation for ``HybridForCausalLM``: a preallocated hybrid cache, a packed prefill, and a decode step with
no host work, replayed as a CUDA graph on GPUs (report §2.2 and §3.3: the lightning state is O(1) per layer, so a
decode step's cost should not grow with the context).

    generate(model, input_ids, prompts, spec)  what ``HybridForCausalLM.generate`` runs
    GenerationSpec.resolve(...)   the generation config transformers would use, or the reason only its own loop can
                                  serve the call (beam search, logits processors, returned scores, ...)
    DecodeEngine                  a ``StaticHybridCache`` for a batch bucket x capacity, the decode step over it and,
                                  on CUDA, that step captured once as a CUDA graph
    next_tokens                   greedy, temperature, top-k, top-p on the device (transformers' warper semantics)

One call: the prompts' real tokens (the attention mask's 1s, left or right padding) are packed along one row and run
once through the model with ``cu_seqlens`` - no compute on padding, no padded lightning state - and each prompt's
lightning states and softmax keys/values land in its cache rows (copies of a prompt for ``num_return_sequences``).
The logits at each prompt's last token give the first new token. Every later token is one replay of the step: the
model on one token per row at the row's own position, the choice of the next token, eos bookkeeping (a finished row
emits pad from then on, as transformers does), and the token's write into a device buffer. The host reads the device
only every ``CHECK_EVERY`` steps (have all rows finished?), so the GPU runs ahead of it.

Equal to transformers' loop: greedy tokens are the same as ``GenerationMixin.generate`` on the same model up to
float rounding (packing changes the order of some sums; tests/test_fast_generation.py checks token identity in fp32).
Sampling applies transformers' warpers' semantics and draws argmax(p / E), E ~ Exp(1), which is how
``torch.multinomial(p, 1)`` draws on CPU: under one seed the tokens match transformers' there when the batch fills
its bucket (rows of padding draw noise too); on CUDA the draws come in another order. The MoE runs dropless (no token
dropping) whatever the model's train/eval mode: a row's tokens must not depend on the rest of the batch.
"""

from __future__ import annotations

import copy
import functools
import gc
import os
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from model.cache import StaticHybridCache

CHECK_EVERY = 8  # decode steps between host reads of "every row finished"
CAPACITY_ROUND = 256  # cache capacity (prompt + new tokens) is rounded up to this, so calls can share a graph
ENGINES_KEPT = 2  # decode engines (cache + graph) kept per model, most recently used first


def _prefill_chunk(raw: str) -> int:
    """``HYLIGHT_PREFILL_CHUNK`` as a number of tokens (0: a prompt is always prefilled in one piece)."""
    if not raw.isdigit():
        raise ValueError(f"HYLIGHT_PREFILL_CHUNK={raw!r}: expected a whole number of tokens (0: one piece)")
    return int(raw)


# A prompt longer than this, alone in its call, is prefilled in pieces of this many tokens: each piece continues the
# lightning states and attends to the keys cached so far, so the prefill's activations are one piece's, not the
# whole prompt's (issue 34; a 1M-token gpu-300m prefill on an H200 peaked at 10.2 GiB in pieces, 70.4 GiB in one).
PREFILL_CHUNK = _prefill_chunk(os.environ.get("HYLIGHT_PREFILL_CHUNK", "65536"))
# What a generation config may set (beyond transformers' defaults) for this path to serve the call; anything else
# (beams, penalties, processors, streamers, returned scores ...) goes to transformers' own loop.
SERVED = frozenset({
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "num_return_sequences",
    "transformers_version", "_from_model_config", "cache_implementation", "disable_compile", "compile_config",
})  # fmt: skip
NEUTRAL = {"num_beams": 1, "num_beam_groups": 1, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
           "no_repeat_ngram_size": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "penalty_alpha": 0.0,
           "guidance_scale": 1.0}  # values that change nothing
BEAM_ONLY = frozenset({"length_penalty", "early_stopping", "diversity_penalty"})  # read only when num_beams > 1
SERVED_KWARGS = frozenset({"input_ids", "attention_mask", "use_cache", "disable_compile"})


@dataclass(frozen=True)
class GenerationSpec:
    """What one generate call asks for, in the terms the decode step needs (hashable: it keys the graphs)."""

    max_new_tokens: int
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    eos: tuple[int, ...] = ()
    pad: int = 0
    copies: int = 1  # num_return_sequences

    @classmethod
    def resolve(cls, model: Any, input_ids: torch.Tensor | None, generation_config: Any,
                kwargs: dict[str, Any]) -> tuple[GenerationSpec | None, str | None]:
        """(spec, None), or (None, why transformers' loop must serve it). Merges ``generation_config`` (or the
        model's) with ``kwargs`` the way ``GenerationMixin.generate`` does."""
        if input_ids is None or input_ids.dim() != 2:
            return None, "no 2-D input_ids (inputs_embeds or other inputs)"
        base = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
        unused = base.update(**{k: v for k, v in kwargs.items() if k not in SERVED_KWARGS})
        if unused:  # model inputs or arguments of transformers' loop (logits_processor, streamer, ...)
            return None, f"arguments only transformers' loop takes: {sorted(unused)}"
        diff = sorted(k for k, v in base.to_diff_dict().items()
                      if k not in SERVED and v not in (None, False) and NEUTRAL.get(k, object()) != v
                      and k not in BEAM_ONLY)
        if diff:
            return None, f"generation settings only transformers' loop implements: {diff}"
        if kwargs.get("use_cache") is False or base.use_cache is False:
            return None, "use_cache=False"
        width = input_ids.shape[1]
        new = base.max_new_tokens if base.max_new_tokens is not None else base.max_length - width
        if new is None or new < 1:
            return None, f"no new tokens to generate (max_new_tokens={base.max_new_tokens}, max_length=" \
                         f"{base.max_length}, prompt width {width})"
        min_new = base.min_new_tokens or max(0, (base.min_length or 0) - width)
        eos = base.eos_token_id
        eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        pad = base.pad_token_id if base.pad_token_id is not None else (eos[0] if eos else 0)
        sample = bool(base.do_sample)
        return cls(
            max_new_tokens=int(new), min_new_tokens=int(min_new), do_sample=sample,
            temperature=float(base.temperature if sample and base.temperature is not None else 1.0),
            top_k=int(base.top_k or 0) if sample else 0,
            top_p=float(base.top_p if sample and base.top_p is not None else 1.0),
            eos=eos, pad=int(pad), copies=int(base.num_return_sequences or 1),
        ), None  # fmt: skip


def next_tokens(logits: torch.Tensor, spec: GenerationSpec, generated: torch.Tensor,
                eos: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] (fp32) -> [B] token ids, on the device, with no host read.

    In transformers' order: eos masked while fewer than ``min_new_tokens`` are generated (``generated`` [1], the
    count so far), then temperature, top-k, top-p (its ``TopPLogitsWarper``: drop the tokens whose ascending
    cumulative probability is <= 1 - top_p, keep at least one), then argmax or one categorical draw."""
    if spec.min_new_tokens and eos is not None:
        early = generated < spec.min_new_tokens  # [1]
        logits = logits.index_fill(1, eos, float("-inf")).where(early[:, None], logits)
    if not spec.do_sample:
        return logits.argmax(-1)
    if spec.temperature != 1.0:
        logits = logits / spec.temperature
    if 0 < spec.top_k < logits.shape[-1]:
        kth = torch.topk(logits, spec.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)
        remove = sorted_logits.softmax(-1).cumsum(-1) <= 1 - spec.top_p
        remove[:, -1] = False
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    probs = logits.softmax(-1)
    # argmax(p / E) with E ~ Exp(1) i.i.d. draws index i with probability p_i (one kernel, no host sync)
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


@dataclass
class GenerationStats:
    """One generate call: rows x steps decoded, of which ``new_tokens`` were real (up to and including eos)."""

    rows: int = 0
    steps: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cuda_graph: bool = False

    @property
    def padding_waste(self) -> float:
        """Share of decoded row-steps spent on rows that had already finished (held by the batch's longest)."""
        slots = self.rows * self.steps
        return 0.0 if slots == 0 else 1.0 - self.new_tokens / slots


def _step_logits(engine: DecodeEngine) -> torch.Tensor:
    return engine._logits()


@functools.cache
def compiled_step_logits() -> Any:
    """``torch.compile`` of one decode step's logits, shared by every engine (the engine is its argument, so the
    compiled function keeps none alive; a bound method kept on each engine was a reference cycle that left dead
    engines, CUDA graphs included, to the cyclic collector: see ``DecodeEngine._capture``). Dynamo's cache is per
    code object either way: engines of one model and bucket share entries as before."""
    return torch.compile(_step_logits, dynamic=False)


def batch_bucket(rows: int) -> int:
    """Rows are padded to a power of two, so calls of nearby sizes share one cache and graph."""
    return 1 << max(0, (rows - 1).bit_length())


class DecodeEngine:
    """One preallocated cache (``batch`` rows x ``capacity`` tokens) and the decode step over it; on CUDA the step
    is captured once as a CUDA graph and each later token is one replay. Reused across calls of one spec."""

    def __init__(self, model: Any, batch: int, capacity: int, spec: GenerationSpec, cuda_graph: bool,
                 compile: bool = False):
        param = next(model.parameters())
        self._model = weakref.ref(model)  # the model owns its engines (engines_of), not the other way round
        self.spec, self.batch, self.capacity = spec, batch, capacity
        self.device = param.device
        self.cache = StaticHybridCache(model.config, batch, capacity, self.device, param.dtype)
        # one matrix-vector product per attention layer for its input projections (HYLIGHT_DECODE_STACKED=0: the
        # layers' own two or three, for comparison)
        self.stacked = os.environ.get("HYLIGHT_DECODE_STACKED", "1") != "0"
        if self.stacked:
            self.cache.load_decode_projections(model)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.out = torch.full((batch, capacity), spec.pad, dtype=torch.long, device=self.device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        self.finish_step = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.step_idx = torch.zeros(1, dtype=torch.long, device=self.device)  # column of the next token
        self.all_done = torch.zeros((), dtype=torch.bool, device=self.device)
        self.eos = torch.tensor(spec.eos, dtype=torch.long, device=self.device) if spec.eos else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compiled = compile  # the step's logits through compiled_step_logits (which holds no engine)
        self.released = False
        if compile:  # fuse the step's small elementwise kernels (norms, gates, residuals, routing) into few
            self._logits()  # once eagerly first: lazy imports and one-time probes stay out of the trace
            for store in (self.cache.keys, self.cache.values):
                for buffer in store.values():  # one compiled step serves every capacity (prompt + new tokens)
                    torch._dynamo.mark_dynamic(buffer, 2)
            # a layer's step guards on its layer index, and each batch bucket is its own shape: one entry per
            # layer and bucket (32 was hit on an H100 by gpu-300m's second bucket, then dynamo ran eager)
            layers = model.config.num_hidden_layers
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16 * layers)
        if cuda_graph:
            self._capture()

    @property
    def model(self) -> Any:
        return self._model()

    # --- the step ---------------------------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor) -> None:
        """Pick, record and feed back the next token of every row (logits [batch, V] fp32)."""
        tok = next_tokens(logits, self.spec, self.step_idx, self.eos)
        tok = torch.where(self.finished, self.spec.pad, tok)
        self.out.index_copy_(1, self.step_idx, tok[:, None])
        if self.eos is not None:
            hit = torch.isin(tok, self.eos) & ~self.finished
            self.finish_step.copy_(torch.where(hit, self.step_idx, self.finish_step))
            self.finished.logical_or_(hit)
        self.all_done.copy_(self.finished.all())
        self.tokens.copy_(tok)
        self.step_idx.add_(1)

    def _logits(self) -> torch.Tensor:
        """The model on each row's last token at its own position: next-token logits [batch, V] in fp32."""
        out = self.model(input_ids=self.tokens[:, None], past_key_values=self.cache, use_cache=True,
                         output_router_logits=False, output_moe_stats=False, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _step(self) -> None:
        if self.released:
            raise RuntimeError("DecodeEngine: this engine was released (evicted or release_engines); build a new one")
        self._choose(compiled_step_logits()(self) if self.compiled else self._logits())
        self.cache.lengths.add_(1)

    def _capture(self) -> None:
        """Warm up (Triton compiles, cuBLAS handles) on a side stream, then capture one step. The warm-up writes
        the cache, which is fine: every prefill rewrites what a step reads.

        Python's cyclic garbage collector is run before the capture and kept off during it: a collection that
        frees a dead CUDA graph mid-capture (an engine no longer referenced, or one of a deleted model, waiting in
        a reference cycle) destroys a graph while a stream captures, which CUDA forbids in the capture's global
        mode and answers by invalidating the capture. A two-GPU lease's GRPO failed so ("operation failed due to
        a previous error during capture", after three "operation not permitted when stream is capturing
        (function reset)" warnings); torch 2.11's ``torch.cuda.graph`` no longer collects on entry."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        gc.collect()
        self.graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(self.graph):
            self._step()

    def release(self) -> None:
        """Free the graph now (outside any capture); the engine cannot step after. An engine holds no reference
        to itself (its compiled step is one module-level function, ``compiled_step_logits``), so dropping it frees
        its cache and graph by reference count, also when its model is deleted."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None
        self.released = True

    # --- one call ---------------------------------------------------------------------------------------------
    def prefill(self, prompts: list[torch.Tensor]) -> None:
        """Pack the prompts (1-D token tensors, each >= 1 token) along one row, fill the cache, choose token 0."""
        copies, lengths = self.spec.copies, [int(p.numel()) for p in prompts]
        if self.stacked:  # the weights as they are now (a policy trains between calls)
            self.cache.load_decode_projections(self.model)
        self.cache.begin_prefill(lengths, copies)
        if len(prompts) == 1 and 0 < PREFILL_CHUNK < lengths[0]:
            logits = self._prefill_pieces(prompts[0], PREFILL_CHUNK).repeat_interleave(copies, 0)
            self._first_token(logits)
            return
        ends = torch.tensor(lengths).cumsum(0)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32)  # host bounds: no device read
        ids = torch.cat(prompts).to(self.device)[None]
        out = self.model(input_ids=ids, cu_seqlens=cu, past_key_values=self.cache, use_cache=True,
                         output_router_logits=False, output_moe_stats=False,
                         logits_to_keep=(ends - 1).to(self.device))
        self._first_token(out.logits[0].float().repeat_interleave(copies, 0))

    def _prefill_pieces(self, prompt: torch.Tensor, chunk: int) -> torch.Tensor:
        """One prompt through the model ``chunk`` tokens at a time (``StaticHybridCache.begin_prefill_chunk``):
        the next-token logits [1, V] after its last token."""
        ids = prompt.to(self.device)
        n = int(ids.numel())
        for start in range(0, n, chunk):
            piece = min(chunk, n - start)
            self.cache.begin_prefill_chunk(start, piece)
            out = self.model(input_ids=ids[start:start + piece][None],
                             cu_seqlens=torch.tensor([0, piece], dtype=torch.int32),  # host bounds: no device read
                             position_ids=torch.arange(start, start + piece, device=self.device)[None],
                             past_key_values=self.cache, use_cache=True, output_router_logits=False,
                             output_moe_stats=False, logits_to_keep=1)
        return out.logits[0, -1:].float()

    def _first_token(self, logits: torch.Tensor) -> None:
        """Reset the rows' bookkeeping and choose token 0 from the prompts' last logits [rows, V]."""
        rows = logits.shape[0]
        if rows < self.batch:  # rows past the prompts: start finished, stay pad
            logits = torch.cat([logits, logits.new_zeros(self.batch - rows, logits.shape[1])])
        self.finished.copy_(torch.arange(self.batch, device=self.device) >= rows)
        self.finish_step.fill_(self.spec.max_new_tokens - 1)
        self.step_idx.zero_()
        self._choose(logits)

    def decode(self, steps: int) -> int:
        """Up to ``steps`` more tokens per row; stops early once every row finished. Returns steps taken."""
        taken = 0
        while taken < steps:
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            taken += 1
            if taken % CHECK_EVERY == 0 and self.eos is not None and bool(self.all_done):
                break
        return taken


def _fingerprint(model: Any) -> tuple:
    """The parameters' storage (a graph reads them by address: a moved or recast model needs new graphs)."""
    return tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters())


# model -> its engines, most recently used first. Kept beside the model, not in it: a deepcopy or pickle of the model
# (TRL copies policies) must not try to copy CUDA graphs, and an engine must not keep a deleted model alive.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engines_of(model: Any) -> OrderedDict:
    """The decode engines (cache + graph) kept for ``model``, most recently used first."""
    return _ENGINES.setdefault(model, OrderedDict())


def release_engines(model: Any) -> None:
    """Drop ``model``'s engines and their caches (memory back to the allocator)."""
    for engine in _ENGINES.pop(model, {}).values():
        engine.release()


class collector_paused:
    """Python's automatic cyclic garbage collection off inside the block, restored to its state after: no
    finalizer of a collected cycle runs in the middle of a CUDA graph capture (an explicit ``gc.collect()`` still
    would; the capture's caller collects just before)."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


# Batch buckets whose decode step has been compiled for a model (its weights' storage): a compile costs
# tens of seconds per bucket, a larger bucket's step about as much as a small one's (the step reads every weight
# once, whatever the rows), so a smaller batch reuses a compiled bucket up to COMPILED_REUSE_FACTOR times its own.
_COMPILED_BUCKETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
COMPILED_REUSE_FACTOR = 16


def choose_bucket(rows: int, compiled: set[int] | frozenset[int] = frozenset()) -> int:
    """The batch bucket for ``rows``: the smallest already-compiled bucket that holds them and is at most
    COMPILED_REUSE_FACTOR times their own power-of-two bucket, else that bucket (a new compile). Without compile
    (``compiled`` empty) it is :func:`batch_bucket`. The ninth GPU lease: sft_long's last batch of 8 prompts, after
    batches of 64 (the first 24 s, the next two 1 s), took 18 s to decode 32 tokens: read as a bucket-8 compile (not
    profiled)."""
    own = batch_bucket(rows)
    fits = [b for b in compiled if own <= b <= own * COMPILED_REUSE_FACTOR]
    return min(fits) if fits else own


def _engine(model: Any, rows: int, capacity: int, spec: GenerationSpec, cuda_graph: bool,
            compile: bool = False) -> DecodeEngine:
    engines = engines_of(model)
    compiled = _COMPILED_BUCKETS.setdefault(model, {}) if compile else None
    kind = _fingerprint(model)  # the compiled step is the logits alone: no spec or graph setting in it
    bucket = choose_bucket(rows, compiled.get(kind, set()) if compiled is not None else set())
    capacity = -(-capacity // CAPACITY_ROUND) * CAPACITY_ROUND
    key = (bucket, capacity, spec, cuda_graph, compile, kind)
    if key in engines:
        engines.move_to_end(key, last=False)
        return engines[key]
    while len(engines) >= ENGINES_KEPT:
        engines.popitem()[1].release()
    engine = DecodeEngine(model, bucket, capacity, spec, cuda_graph, compile)
    if compiled is not None:
        compiled.setdefault(kind, set()).add(bucket)
    engines[key] = engine
    engines.move_to_end(key, last=False)
    return engine


def use_cuda_graphs(device: torch.device) -> bool:
    """CUDA graphs on CUDA devices unless HYLIGHT_CUDA_GRAPHS=0 (then the same step runs eagerly)."""
    return device.type == "cuda" and os.environ.get("HYLIGHT_CUDA_GRAPHS", "1") != "0"


def use_compile(device: torch.device) -> bool:
    """torch.compile of the decode step on CUDA unless HYLIGHT_DECODE_COMPILE=0 (not on CPU: there it costs more than
    it saves). The first call of each batch bucket compiles (tens of seconds); later capacities reuse it."""
    return device.type == "cuda" and os.environ.get("HYLIGHT_DECODE_COMPILE", "1") != "0"


def prompt_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor] | str:
    """Each row's real tokens (the mask's 1s), or the reason the mask cannot be read as padding of a prompt."""
    if attention_mask is None:
        return list(input_ids)
    mask = attention_mask.to("cpu", torch.bool)  # one host read per call
    ids = input_ids.to("cpu")
    rows = []
    for i in range(ids.shape[0]):
        real = torch.nonzero(mask[i]).squeeze(1)
        if real.numel() == 0:
            return f"row {i} of attention_mask has no real token"
        if int(real[-1] - real[0]) + 1 != real.numel():
            return f"row {i} of attention_mask is not one contiguous block (only left/right padding is packed)"
        rows.append(ids[i, real])
    return rows


@torch.no_grad()
def generate(model: Any, input_ids: torch.Tensor, prompts: list[torch.Tensor], spec: GenerationSpec) -> torch.Tensor:
    """Generate per ``spec``; returns what ``GenerationMixin.generate`` returns: the input ids (each repeated
    ``copies`` times) followed by the new tokens, pad after a row's eos, as many columns as the longest row took.
    ``prompts``: each row's real tokens (``prompt_tokens``). Statistics of the call are left in
    ``model.last_generation_stats``."""
    rows = len(prompts) * spec.copies
    capacity = max(int(p.numel()) for p in prompts) + spec.max_new_tokens
    device = next(model.parameters()).device
    stats = GenerationStats(rows=rows)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            engine = _engine(model, rows, capacity, spec, use_cuda_graphs(device), use_compile(device))
            stats.cuda_graph = engine.graph is not None
            _sync(device)
            t0 = time.perf_counter()
            engine.prefill(prompts)
            _sync(device)
            t1 = time.perf_counter()
            steps = 1 + engine.decode(spec.max_new_tokens - 1)
            finish = engine.finish_step[:rows].clamp(max=steps - 1)
            width = int(finish.max()) + 1 if engine.eos is not None else steps  # a host read: the call's end
            new = engine.out[:rows, :width]
            _sync(device)
            stats.decode_seconds = time.perf_counter() - t1
            stats.prefill_seconds = t1 - t0
            stats.steps = width
            stats.new_tokens = int((finish + 1).clamp(max=width).sum())
    finally:
        model.train(was_training)
    model.last_generation_stats = stats
    prompt_ids = input_ids.repeat_interleave(spec.copies, 0) if spec.copies > 1 else input_ids
    return torch.cat([prompt_ids, new.to(prompt_ids.device)], dim=1)  # a normal tensor (callers may train on it)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
