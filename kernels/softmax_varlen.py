"""Document-causal softmax attention over packed rows, with memory linear in the number of tokens.

Pretraining concatenates documents end to end along one row ("data-packing", MiniMax-01 §3.2); softmax layers
must then attend causally within each document and never across one (the varlen causal compute of §3.2.1).
A dense [N, N] mask makes that O(N²) in memory (a bool mask alone is 268 MB at N = 16K); the paths here never
build one.

    document_causal_attention            the one public entry point, dispatching by device:
        CUDA    FlexAttention (compiled) over a document-causal BlockMask; blocks that no query of a block may
                see are skipped, so work and memory follow the documents' own lengths. The BlockMask's tiles
                come from the documents' bounds (``document_block_structure``), with nothing to compile
        CPU     a loop of per-document ``F.scaled_dot_product_attention(is_causal=True)`` on slices (torch's
                CPU flash kernel keeps each document's memory linear); also the fallback anywhere
    document_causal_attention_reference  the dense masked form, plain PyTorch in the input dtype (fp64 works);
                tests compare every path against it

Why Flex on CUDA (H100, torch 2.11, bf16, H=16/H_kv=2, D=128, N=32K; bench/check_softmax_varlen_gpu.py):
forward+backward 9.1 ms with documents of 64..4096 tokens and 3.5 ms with 16..512, against 114 ms and 3.2 GiB
for dense-mask SDPA; the SDPA loop is as fast for long documents but launches per document (45 ms for 130
short ones); torch 2.11's flash ``varlen_attn`` has no fp32 and no GQA (k/v repeated: 1.3 GiB at 32K).

Shapes: q [1, H, N, D]; k, v [1, H_kv, N, D] (H_kv = H, or a divisor of H with ``enable_gqa``); cu_seqlens
[n + 1] int32/int64, 0 = cu_seqlens[0] <= ... <= cu_seqlens[n] = N (an empty document is allowed and adds
nothing, as in ``kernels.lightning``). Scale 1/sqrt(D), as SDPA's default.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.host_values import host_ints

__all__ = [
    "IMPLS",
    "document_block_structure",
    "document_causal_attention",
    "document_causal_attention_reference",
]

IMPLS = ("auto", "flex", "sdpa_loop")
FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the compiled Flex kernels take
FLEX_BLOCK = 128  # the BlockMask's tile, Flex's default BLOCK_SIZE
BLOCK_MASK_SOURCES = ("tiles", "create")  # HYLIGHT_FLEX_BLOCK_MASK: see block_mask_source


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, enable_gqa: bool, caller: str
) -> None:
    """Shapes, dtypes and cu_seqlens' form; its values are checked by ``_document_bounds`` (a host read)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4 or x.shape[0] != 1:
            raise ValueError(
                f"{caller}: {name} must be [1, heads, tokens, head_dim] (documents packed along one row), got "
                f"shape {tuple(x.shape)}; flatten a batch to one row and give every row start in cu_seqlens"
            )
        if not x.is_floating_point():
            raise TypeError(f"{caller}: {name} must be a floating tensor, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise TypeError(
            f"{caller}: q, k, v must share dtype and device, got {q.dtype}/{q.device}, {k.dtype}/{k.device}, "
            f"{v.dtype}/{v.device}"
        )
    heads, n, d = q.shape[1:]
    if k.shape[2:] != (n, d) or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{caller}: k must be [1, H_kv, {n}, {d}] and v [1, H_kv, {n}, D_v], got k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    kv_heads = k.shape[1]
    if kv_heads != heads and not (enable_gqa and heads % kv_heads == 0):
        raise ValueError(
            f"{caller}: q has {heads} heads and k/v {kv_heads}; that needs enable_gqa=True and H divisible by "
            f"H_kv (got enable_gqa={enable_gqa})"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{caller}: cu_seqlens must be a 1-D int32/int64 tensor [n_documents + 1] of cumulative lengths "
            f"starting at 0, got dtype {cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}"
        )


def _document_bounds(cu_seqlens: torch.Tensor, n: int, caller: str) -> list[int]:
    """cu_seqlens as host ints, checked: starts at 0, ends at N, never decreases."""
    bounds = host_ints(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(
            f"{caller}: cu_seqlens must start at 0 and end at the number of tokens N={n}, got "
            f"{bounds[0]} ... {bounds[-1]}"
        )
    steps = [(i, a, b) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)) if b < a]
    if steps:
        i, a, b = steps[0]
        raise ValueError(
            f"{caller}: cu_seqlens must be non-decreasing (cumulative document lengths), but entry {i + 1} "
            f"({b}) is below entry {i} ({a})"
        )
    return bounds


def _document_ids(cu_seqlens: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """[N] long: the document of each token (empty documents take no id's tokens)."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    return torch.bucketize(torch.arange(n, device=device), bounds[1:], right=True)


# ---- reference ---------------------------------------------------------------------------------------------


def document_causal_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *, enable_gqa: bool
) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(D) + M) v with M = 0 where key j <= query i in the same document, else -inf.

    Dense [H, N, N] scores in the input dtype: for tests only.
    """
    caller = "document_causal_attention_reference"
    _check_inputs(q, k, v, cu_seqlens, enable_gqa, caller)
    n = q.shape[2]
    _document_bounds(cu_seqlens, n, caller)
    doc = _document_ids(cu_seqlens, n, q.device)
    pos = torch.arange(n, device=q.device)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # [N, N], True = attend
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))  # every query sees itself: no all -inf row
    return scores.softmax(dim=-1) @ v


# ---- CPU / fallback: one SDPA call per document -----------------------------------------------------------


def _sdpa_document_loop(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, enable_gqa: bool
) -> torch.Tensor:
    bounds = _document_bounds(cu_seqlens, q.shape[2], "document_causal_attention")
    outs = [
        F.scaled_dot_product_attention(
            q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], is_causal=True, enable_gqa=enable_gqa
        )
        for a, e in zip(bounds[:-1], bounds[1:], strict=True)
        if e > a
    ]
    if not outs:  # N = 0
        return q.new_empty(*q.shape[:3], v.shape[-1])
    return torch.cat(outs, dim=2)


# ---- CUDA: FlexAttention over a document-causal BlockMask --------------------------------------------------

_FLEX: dict[str, Callable] = {}  # "attention" (/ "block_mask"): torch.compile'd once, on first use
_flex_unavailable: str | None = None
# The BlockMask of the last cu_seqlens seen: every softmax layer of one forward call passes the same tensor
# object (SequenceLayout builds it once), so the mask (and the bounds check's host read) happens once per call.
_last_block_mask: tuple[weakref.ref, int, int, torch.device, bool, str, object] | None = None


def _flex_functions(compiled: bool) -> tuple[Callable, type] | None:
    """(flex_attention, BlockMask): flex_attention compiled (CUDA) or eager (tests on CPU), or None if absent."""
    global _flex_unavailable
    if _flex_unavailable is not None:
        return None
    try:
        from torch.nn.attention.flex_attention import (  # optional: absent in older torch
            BlockMask,
            flex_attention,
        )
    except ImportError as err:  # older torch: the SDPA loop serves
        _flex_unavailable = f"torch.nn.attention.flex_attention is not in torch {torch.__version__} ({err})"
        return None
    if not compiled:
        return flex_attention, BlockMask
    if "attention" not in _FLEX:
        # Uncompiled, flex_attention materialises the full [N, N] scores; compiled it is a fused kernel.
        _FLEX["attention"] = torch.compile(flex_attention)
    return _FLEX["attention"], BlockMask


def document_block_structure(
    cu_seqlens: torch.Tensor, n: int, block: int = FLEX_BLOCK, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full), each [ceil(N / block)]² bool: which (query block, key block) tiles of the document-causal
    mask hold some allowed pair but not only those (``partial``: the kernel applies the mask_mod there) and which
    hold only allowed pairs (``full``: no mask_mod). Tiles in neither are skipped.

    Computed from the documents' first and last ids of each tile, in O(blocks²) memory: documents are contiguous,
    so key tile j < query tile i shares a document with it iff the last document of j is at least the first of i,
    and every pair is allowed iff one document covers both tiles whole. A diagonal tile is never full (its keys
    after a query are masked); a tile that runs past N is never full. This replaces ``create_block_mask``, which
    evaluates the mask_mod on every pair and, compiled, cost a cold compile of its own (a sort kernel of ~5 MB of
    machine code on an H200)."""
    _document_bounds(cu_seqlens, n, "document_block_structure")
    return _block_structure(cu_seqlens, n, block, cu_seqlens.device if device is None else device)


def _block_structure(
    cu_seqlens: torch.Tensor, n: int, block: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``document_block_structure`` for bounds already checked."""
    nb = -(-n // block)
    doc = _document_ids(cu_seqlens, n, device)
    starts = torch.arange(nb, device=device) * block
    first = doc[starts]                                    # [nb] document of each tile's first token
    last = doc[torch.clamp(starts + block, max=n) - 1]     # [nb] document of each tile's last token
    i = torch.arange(nb, device=device)
    below = i[None, :] < i[:, None]                         # key tile j strictly before query tile i
    diagonal = torch.eye(nb, dtype=torch.bool, device=device)
    shares = below & (last[None, :] >= first[:, None])
    whole = (starts + block <= n)
    full = below & (first[None, :] == last[:, None]) & whole[None, :] & whole[:, None]
    partial = (shares | diagonal) & ~full
    return partial, full


def _kv_blocks(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's kv form of a [nb, nb] bool tile map: counts [1, 1, nb] and indices [1, 1, nb, nb] (each row's
    tiles first, in key order), int32."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


def block_mask_source() -> str:
    """How the BlockMask is built: "tiles" (default; ``document_block_structure``, no compile) or "create" (torch's
    ``create_block_mask``, compiled on CUDA: the path before, kept to measure the cold compile it costs beside the
    new one and as a way back), from the environment variable HYLIGHT_FLEX_BLOCK_MASK."""
    source = os.environ.get("HYLIGHT_FLEX_BLOCK_MASK", "tiles")
    if source not in BLOCK_MASK_SOURCES:
        raise ValueError(f"HYLIGHT_FLEX_BLOCK_MASK must be one of {BLOCK_MASK_SOURCES}, got {source!r}")
    return source


def _create_block_mask(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask  # optional: absent in older torch

    if not compiled:
        return create_block_mask
    if "block_mask" not in _FLEX:
        _FLEX["block_mask"] = torch.compile(create_block_mask)
    return _FLEX["block_mask"]


def _tensor_version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors keep no version counter: do not cache
        return None


def _document_block_mask(
    cu_seqlens: torch.Tensor, n: int, device: torch.device, block_mask_cls: type, compiled: bool
):
    global _last_block_mask
    version = _tensor_version(cu_seqlens)
    source = block_mask_source()
    hit = _last_block_mask
    if (
        version is not None
        and hit is not None
        and hit[0]() is cu_seqlens
        and hit[1:6] == (version, n, device, compiled, source)
    ):
        return hit[6]
    _document_bounds(cu_seqlens, n, "document_causal_attention")
    doc = _document_ids(cu_seqlens, n, device)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    if source == "create":  # torch's create_block_mask, compiled on CUDA: the earlier path
        create = _create_block_mask(compiled)
        block_mask = create(document_causal, 1, None, n, n, device=device)
    else:
        partial, full = _block_structure(cu_seqlens, n, FLEX_BLOCK, device)
        block_mask = block_mask_cls.from_kv_blocks(
            *_kv_blocks(partial), *_kv_blocks(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=document_causal,
            seq_lengths=(n, n),
        )
    if version is not None:
        _last_block_mask = (weakref.ref(cu_seqlens), version, n, device, compiled, source, block_mask)
    return block_mask


def _flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    enable_gqa: bool,
    compiled: bool,
) -> torch.Tensor:
    """FlexAttention path; ``compiled=False`` runs the same masks through flex's eager (dense, forward-only
    on CPU) implementation, which checks the mask_mod on a CPU. The eager form applies the mask_mod to every pair
    and ignores the BlockMask's tiles, so tests check those against the dense mask directly."""
    flex_attention, block_mask_cls = _flex_functions(compiled)
    block_mask = _document_block_mask(cu_seqlens, q.shape[2], q.device, block_mask_cls, compiled)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def document_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    enable_gqa: bool,
    impl: str = "auto",
) -> torch.Tensor:
    """Causal softmax attention within each packed document, none across them: o [1, H, N, D_v] in q's dtype.

    ``impl``: "auto" (compiled FlexAttention on CUDA for fp16/bf16/fp32 when torch has it, else the SDPA
    loop), "flex" (compiled FlexAttention; error if unavailable) or "sdpa_loop". The first CUDA call compiles
    the Flex kernels (tens of seconds); later calls with the same dtype and head layout reuse them.
    """
    caller = "document_causal_attention"
    _check_inputs(q, k, v, cu_seqlens, enable_gqa, caller)
    if impl not in IMPLS:
        raise ValueError(f"{caller}: impl must be one of {IMPLS}, got {impl!r}")
    use_flex = impl == "flex" or (
        impl == "auto" and q.is_cuda and q.dtype in FLEX_DTYPES and _flex_functions(True) is not None
    )
    if use_flex:
        if _flex_functions(True) is None:
            raise RuntimeError(
                f"{caller}: impl='flex' was requested but {_flex_unavailable}; use impl='auto'"
            )
        return _flex_document_attention(q, k, v, cu_seqlens, enable_gqa, compiled=True)
    return _sdpa_document_loop(q, k, v, cu_seqlens, enable_gqa)
