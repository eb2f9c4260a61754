"""Document-causal softmax attention on a GPU (kernels/softmax_varlen.py): correctness, speed, memory.

Usage (GPU): python bench/check_softmax_varlen_gpu.py [--lengths 2048 8192 32768] [--heads 16 2] [--dim 128]
1. Correctness, fp32 and bf16, several document layouts, MHA and GQA: the CUDA path (compiled FlexAttention)
   and the per-document SDPA loop against the dense fp64 reference, outputs and dq/dk/dv. A bf16 path passes
   when its error is within 2x (+1e-3) of dense-mask SDPA's own bf16 error on the same inputs; fp32 within
   1e-5 relative (max abs error / max abs reference). Then the model: a packed fp32 forward on CUDA equals each
   document run alone.
2. Speed and memory at each N (bf16, GQA), for documents of random lengths 64..4096 and 16..512: forward and
   forward+backward median ms (CUDA events) and peak memory over the inputs (torch.cuda.max_memory_allocated)
   for flex (ours), the SDPA loop, torch's flash ``varlen_attn`` where it exists, dense-mask SDPA as the model
   called it before (enable_gqa + [N, N] bool mask), dense-mask SDPA with k/v repeated, and causal flash SDPA
   over the whole row (ignores documents: a speed-of-light reference, not a correct answer); and the cost of
   building the flex BlockMask, paid once per forward call.
Prints markdown tables; exits 1 on any correctness failure.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.softmax_varlen import document_causal_attention, document_causal_attention_reference

# A compiled flex_attention that falls back to eager (e.g. past the recompile limit) silently materialises the
# [N, N] scores; here that is an error.
warnings.filterwarnings("error", "flex_attention called without torch.compile")
for _name in ("recompile_limit", "cache_size_limit"):  # the bench compiles many (dtype, GQA, N) variants
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, 64)

FAILURES: list[str] = []


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, absolute where max |b| < 1 (dq and dk vanish when every document has length 1)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


def cu_from_lengths(lengths: list[int], device: str = "cuda") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def random_lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < n:
        out.append(min(int(torch.randint(low, high + 1, (1,), generator=g)), n - sum(out)))
    return out


def dense_mask(cu: torch.Tensor, n: int) -> torch.Tensor:
    doc = torch.bucketize(torch.arange(n, device=cu.device), cu[1:].long(), right=True)
    pos = torch.arange(n, device=cu.device)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def dense_sdpa(q, k, v, cu, enable_gqa):  # what SoftmaxAttention did for packed rows before
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(cu, q.shape[2]), enable_gqa=enable_gqa
    )


def dense_sdpa_repeat_kv(q, k, v, cu, enable_gqa):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(cu, q.shape[2]))


def reference(q, k, v, cu, enable_gqa):
    return document_causal_attention_reference(q, k, v, cu, enable_gqa=enable_gqa)


def flex(q, k, v, cu, enable_gqa):
    return document_causal_attention(q, k, v, cu, enable_gqa=enable_gqa, impl="flex")


def sdpa_loop(q, k, v, cu, enable_gqa):
    return document_causal_attention(q, k, v, cu, enable_gqa=enable_gqa, impl="sdpa_loop")


def causal_flash_whole_row(q, k, v, cu, enable_gqa):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)


def varlen_flash(q, k, v, cu, enable_gqa):
    """torch.nn.attention.varlen.varlen_attn (flash varlen, fp16/bf16 only), feature-detected: torch 2.11 has
    neither is_causal nor enable_gqa (causal is window_size=(-1, 0); k/v are repeated for GQA)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    longest = int((cu[1:] - cu[:-1]).max())  # a host read, once per call
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [N, H, D]
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kw).transpose(0, 1)[None]


def forward_backward(fn: Callable, q, k, v, cu, gqa, do):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves, cu, gqa)
    o.backward(do)
    return o.detach(), [t.grad for t in leaves]


# ---- 1. correctness -------------------------------------------------------------------------------------------


def correctness(heads: int, kv_heads: int, dim: int) -> None:
    layouts = {
        "one document": [2048],
        "many short": random_lengths(2048, 1, 64, seed=1),
        "all length 1": [1] * 300,
        "long + short + empty": [1500, 1, 0, 130, 417],
        "random 64..1024": random_lengths(4096, 64, 1024, seed=2),
    }
    print("| dtype | layout | heads | path | out err | dq err | dk err | dv err | dense SDPA out err | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for name, lengths in layouts.items():
            for h_kv in (heads, kv_heads):
                n, gqa = sum(lengths), h_kv != heads
                cu = cu_from_lengths(lengths)
                g = torch.Generator(device="cuda").manual_seed(n + h_kv)
                q = torch.randn(1, heads, n, dim, device="cuda", generator=g)
                k = torch.randn(1, h_kv, n, dim, device="cuda", generator=g)
                v = torch.randn(1, h_kv, n, dim, device="cuda", generator=g)
                do = torch.randn(1, heads, n, dim, device="cuda", generator=g)
                ref_o, ref_g = forward_backward(
                    reference,
                    *(t.double() for t in (q, k, v)),
                    cu,
                    gqa,
                    do.double(),
                )
                low = [t.to(dtype) for t in (q, k, v, do)]
                base_o, base_g = forward_backward(dense_sdpa, *low[:3], cu, gqa, low[3])
                base = max(
                    [rel_err(base_o, ref_o)] + [rel_err(a, b) for a, b in zip(base_g, ref_g, strict=True)]
                )
                for path, fn in (("flex", flex), ("sdpa_loop", sdpa_loop)):
                    o, grads = forward_backward(fn, *low[:3], cu, gqa, low[3])
                    errs = [rel_err(o, ref_o)] + [rel_err(a, b) for a, b in zip(grads, ref_g, strict=True)]
                    bound = 1e-5 if dtype == torch.float32 else 2 * base + 1e-3
                    ok = o.dtype == dtype and max(errs) <= bound
                    if not ok:
                        FAILURES.append(
                            f"{path} {dtype} {name} H={heads}/{h_kv}: errors {errs} > {bound:.1e}"
                        )
                    print(f"| {str(dtype)[6:]} | {name} (N={n}) | {heads}/{h_kv} | {path} | "
                          + " | ".join(f"{e:.1e}" for e in errs) + f" | {base:.1e} | {'yes' if ok else 'NO'} |")  # fmt: skip
    print()


def model_check() -> None:
    """The model's packed forward and gradients on CUDA (flattened B > 1 rows, Flex in the softmax layers)
    equal each document run alone."""
    try:
        from model.modeling import HybridForCausalLM
        from model.sizes import config_for
    except ImportError as err:  # the GPU image may lack transformers
        print(f"model check skipped: {err}\n")
        return
    torch.manual_seed(0)
    cfg = config_for("tiny", num_hidden_layers=4, attention_pattern=["lightning", "softmax"] * 2)
    model = HybridForCausalLM(cfg).cuda().eval()  # eval: no MoE capacity drops that depend on the batch
    g = torch.Generator().manual_seed(0)
    rows = [
        [torch.randint(0, 512, (n,), generator=g).cuda() for n in lens] for lens in ([200, 1, 311], [512])
    ]
    ids = torch.stack([torch.cat(r) for r in rows])
    pos = torch.stack([torch.cat([torch.arange(len(d), device="cuda") for d in r]) for r in rows])
    packed = model(ids, position_ids=pos).logits
    packed.square().mean().backward()
    packed_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    alone = torch.stack([torch.cat([model(d[None], use_cache=False).logits[0] for d in r]) for r in rows])
    alone.square().mean().backward()
    alone_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    errs = [((a - b).norm() / b.norm()).item() for a, b in ((packed, alone), (packed_grads, alone_grads))]
    ok = max(errs) < 1e-4  # fp32; lightning's Triton path in packed vs single rows differs by ~1e-6
    if not ok:
        FAILURES.append(f"model packed vs documents alone: logits/grads relative errors {errs}")
    print(f"model: packed fp32 forward+backward (2 rows, 4 documents) vs each document alone: logits "
          f"{errs[0]:.1e} (relative L2), all parameter grads {errs[1]:.1e} ({'ok' if ok else 'FAIL'})\n")  # fmt: skip


# ---- 2. speed and memory -------------------------------------------------------------------------------------


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(fn: Callable, leaves: list[torch.Tensor], cu: torch.Tensor, do: torch.Tensor, reps: int) -> tuple:
    """(fwd ms, fwd+bwd ms, peak MiB over the inputs, first-call s) of one path, or OOM marks."""

    def run() -> torch.Tensor:
        return fn(*leaves, cu, True)

    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run().backward(do)  # first call: compiles (flex)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for t in leaves:
            t.grad = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run().backward(do)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        with torch.no_grad():
            fwd = median_ms(run, reps)
        fwd_bwd = median_ms(lambda: run().backward(do), reps)
        return f"{fwd:.2f}", f"{fwd_bwd:.2f}", f"{peak:,.0f}", f"{first:.1f}"
    except torch.OutOfMemoryError:
        return "OOM", "OOM", "OOM", "-"
    finally:
        for t in leaves:
            t.grad = None
        torch.cuda.empty_cache()


def block_mask_ms(cu: torch.Tensor, n: int, reps: int) -> str:
    """The flex path builds its BlockMask once per forward call (cached across layers): its cost."""
    from kernels.softmax_varlen import _document_block_mask, _flex_functions

    block_mask_cls = _flex_functions(True)[1]
    return f"{median_ms(lambda: _document_block_mask(cu.clone(), n, cu.device, block_mask_cls, True), reps):.2f}"


def speed(lengths: list[int], heads: int, kv_heads: int, dim: int, reps: int) -> list[tuple]:
    paths = {
        "flex (ours, CUDA default)": flex,
        "sdpa_loop (ours, fallback)": sdpa_loop,
        "varlen_attn (torch flash varlen)": varlen_flash,
        "dense mask SDPA, enable_gqa (old path)": dense_sdpa,
        "dense mask SDPA, k/v repeated": dense_sdpa_repeat_kv,
        "causal flash, whole row (no doc mask)": causal_flash_whole_row,
    }
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        del paths["varlen_attn (torch flash varlen)"]
    rows = []
    for low, high in ((64, 4096), (16, 512)):
        for n in lengths:
            docs = random_lengths(n, low, high, seed=n)
            cu = cu_from_lengths(docs)
            g = torch.Generator(device="cuda").manual_seed(n)
            q, k, v, do = (
                torch.randn(1, h, n, dim, device="cuda", dtype=torch.bfloat16, generator=g)
                for h in (heads, kv_heads, kv_heads, heads)
            )
            leaves = [t.requires_grad_() for t in (q, k, v)]
            what = (n, f"{len(docs)} ({low}..{high})")
            for name, fn in paths.items():
                rows.append((*what, name, *measure(fn, leaves, cu, do, reps)))
            rows.append(
                (*what, "flex BlockMask build (once per forward)", block_mask_ms(cu, n, reps), "-", "-", "-")
            )
            del q, k, v, do, leaves
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 2], metavar=("H", "H_KV"))
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-speed", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    heads, kv_heads = args.heads
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}; H={heads}, H_kv={kv_heads}, D={args.dim}\n"
    )
    correctness(heads, kv_heads, args.dim)
    model_check()
    if not args.no_speed:
        rows = speed(args.lengths, heads, kv_heads, args.dim, args.reps)
        print(
            "| N | documents (lengths) | path | fwd ms | fwd+bwd ms | peak MiB over inputs | first call s |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(str(c) for c in row) + " |")
    if FAILURES:
        print("\nCORRECTNESS FAILURES:\n  " + "\n  ".join(FAILURES))
        return 1
    print("\nall correctness checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
