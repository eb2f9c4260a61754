"""Lightning attention (MiniMax-01 §2.2.1): the public entry points and the one dispatch point.

Layout (as in fla's ``ops/<op>/``):
    decay.py   lightning_decay_rates: the per-head decay rates, the one source of truth
    naive.py   references: token recurrence and the O(T²) masked form (tests compare against these)
    chunk.py   Algorithm 1 in PyTorch (any device; autograd backward) + the shared input checks
    decode.py  one generation step from a cached state
    triton_chunk.py   Triton forward/backward (+ varlen) behind one autograd.Function, used on CUDA
    triton_decode.py  Triton single-token state update for batched generation

Shapes: q, k [B, H, T, d_k]; v [B, H, T, d_v]; decay_rates [H]; states [B, H, d_k, d_v]
(or [N, H, d_k, d_v] per packed sequence with ``cu_seqlens``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from kernels.lightning.chunk import lightning_attn_chunk
from kernels.lightning.decay import lightning_decay_rates
from kernels.lightning.decode import lightning_attn_decode
from kernels.lightning.naive import lightning_attn_parallel, lightning_attn_recurrent

__all__ = [
    "IMPLS",
    "lightning_attention",
    "lightning_attention_decode",
    "lightning_attn_chunk",
    "lightning_attn_decode",
    "lightning_attn_parallel",
    "lightning_attn_recurrent",
    "lightning_decay_rates",
]

IMPLS = ("auto", "naive", "chunk", "triton")

# ---- Triton hook ---------------------------------------------------------------------------------
# Filled lazily, the first time a Triton path is wanted, by importing
#   kernels/lightning/triton_chunk.py   -> lightning_attn_triton_chunk  (signature of lightning_attn_chunk)
#   kernels/lightning/triton_decode.py  -> lightning_attn_triton_decode (signature of lightning_attn_decode)
# A module that does not exist yet (or a missing `triton` package) means "unavailable"; any other
# import error is a bug in that module and is raised. Tests may set these directly.
_TRITON_IMPL: Callable | None = None
_TRITON_DECODE_IMPL: Callable | None = None
_TRITON_SOURCES = {
    "chunk": ("triton_chunk", "lightning_attn_triton_chunk"),
    "decode": ("triton_decode", "lightning_attn_triton_decode"),
}
_triton_unavailable: dict[str, str] = {}  # kind -> why it could not be loaded (cached)


def _triton_impl(kind: str) -> tuple[Callable | None, str | None]:
    """(function, None) when the Triton `kind` ("chunk"/"decode") is available, else (None, reason)."""
    global _TRITON_IMPL, _TRITON_DECODE_IMPL
    loaded = _TRITON_IMPL if kind == "chunk" else _TRITON_DECODE_IMPL
    if loaded is not None:
        return loaded, None
    if kind in _triton_unavailable:
        return None, _triton_unavailable[kind]
    module_name, attr = _TRITON_SOURCES[kind]
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ModuleNotFoundError as err:
        if err.name not in (f"{__name__}.{module_name}", "triton"):
            raise
        _triton_unavailable[kind] = f"{__name__}.{module_name} could not be imported ({err})"
        return None, _triton_unavailable[kind]
    fn = getattr(module, attr)
    if kind == "chunk":
        _TRITON_IMPL = fn
    else:
        _TRITON_DECODE_IMPL = fn
    return fn, None


def _resolve(impl: str, kind: str, x: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"lightning attention: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if x.is_cuda and _triton_impl(kind)[0] is not None else "torch"
    if impl == "triton":
        fn, reason = _triton_impl(kind)
        if fn is None:
            raise RuntimeError(
                f"lightning attention: impl='triton' was requested but the Triton {kind} kernel is unavailable: "
                f"{reason}. Use impl='auto' (falls back to the PyTorch chunk path) or impl='chunk'."
            )
    return impl


def lightning_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    *,
    block_size: int = 256,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal lightning attention over a sequence: o_t = q_t S_t with S_t = λ S_{t-1} + k_tᵀ v_t.

    Returns (o [B, H, T, d_v] in q's dtype, final state or None). ``impl``: "auto" (Triton on CUDA
    when its kernel is present, else the PyTorch chunk path), "chunk", "naive" (the token recurrence;
    ``block_size`` unused), or "triton" (error if unavailable). See ``lightning_attn_chunk`` for
    ``initial_state``/``cu_seqlens``/dtype rules.
    """
    which = _resolve(impl, "chunk", q)
    if which == "naive":
        return lightning_attn_recurrent(q, k, v, decay_rates, initial_state, output_final_state, cu_seqlens)
    fn = _triton_impl("chunk")[0] if which == "triton" else lightning_attn_chunk
    return fn(
        q,
        k,
        v,
        decay_rates,
        block_size=block_size,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


def lightning_attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    state: torch.Tensor,
    *,
    impl: str = "auto",
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step (q, k, v [B, H, 1, d]; state [B, H, d_k, d_v]) -> (o, new state).

    Takes the same ``impl`` names as ``lightning_attention`` so one model setting drives both;
    "naive" and "chunk" both mean the PyTorch step (a single token has only one form). ``out_state`` (may be
    ``state``) receives the new state in place: a preallocated generation cache keeps its address.
    """
    which = _resolve(impl, "decode", q)
    fn = _triton_impl("decode")[0] if which == "triton" else lightning_attn_decode
    return fn(q, k, v, decay_rates, state, out_state)
