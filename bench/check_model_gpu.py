"""The hybrid model on a GPU: Triton lightning path vs the PyTorch chunk path, and training throughput.

Usage (GPU): python bench/check_model_gpu.py [--size gpu-300m] [--lengths 2048 8192 32768]
1. Correctness: a small hybrid config in bf16 on CUDA, impl="triton" vs impl="chunk": logits and
   gradients (relative error), and greedy generate with cache equal to generate without.
2. Throughput: forward+backward+AdamW step of a named size at B*T = 16K tokens, tokens/s and MFU
   (model/accounting.py Table 1 FLOPs against the measured bf16 matmul rate).
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import model  # noqa: F401  (registers the Auto classes)
from model import HybridForCausalLM, config_for
from model.accounting import flops_per_token, mfu, parameter_counts


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def correctness(device: str = "cuda", dtype: torch.dtype = torch.float32) -> None:
    """fp32 makes the comparison sharp (Triton fp32 dots are tf32x3, ~5e-7); in bf16 a random model's
    near-tied logits let greedy decoding diverge on rounding alone."""
    torch.manual_seed(0)
    cfg = config_for("tiny", vocab_size=512, lightning_block_size=64)
    ref, fast = ("chunk", "triton") if device == "cuda" else ("naive", "chunk")  # CPU: a self-check
    base = HybridForCausalLM(cfg).to(device=device, dtype=dtype)
    ids = torch.randint(0, 512, (2, 1000 if device == "cuda" else 100), device=device)
    rows = []
    outs = {}
    for impl in (ref, fast):
        m = copy.deepcopy(base)
        for layer in m.modules():
            if hasattr(layer, "impl"):
                layer.impl = impl
        out = m(ids, labels=ids)
        out.loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])
        outs[impl] = (out.logits.detach(), grads, m)
    rows.append(("logits", rel(outs[fast][0], outs[ref][0])))
    rows.append(("all parameter grads", rel(outs[fast][1], outs[ref][1])))
    m = outs[fast][2].eval()
    prompt = ids[:, :50]
    with torch.no_grad():
        a = m.generate(prompt, max_new_tokens=32, do_sample=False, use_cache=True)
        b = m.generate(prompt, max_new_tokens=32, do_sample=False, use_cache=False)
    print(f"| check ({dtype}, {fast} vs {ref}) | relative error |\n|---|---|")
    for name, e in rows:
        print(f"| {name} | {e:.2e} |")
    print(f"| greedy generate with cache == without | {bool(torch.equal(a, b))} "
          f"({(a != b).sum().item()} differing tokens of {a.numel()}) |\n")


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t)


def throughput(size: str, lengths: list[int], tokens: int) -> None:
    peak = matmul_peak()
    cfg = config_for(size)
    counts = parameter_counts(cfg)
    print(f"{size}: {counts.total / 1e6:.1f}M total, {counts.activated / 1e6:.1f}M activated params; "
          f"bf16 matmul peak measured {peak / 1e12:.0f} TFLOP/s\n")
    print("| T | B | s/step | tokens/s | MFU | peak GB |\n|---|---|---|---|---|---|")
    for T in lengths:
        B = max(1, tokens // T)
        torch.manual_seed(0)
        m = HybridForCausalLM(config_for(size, max_position_embeddings=max(T, 8192))).cuda().to(torch.bfloat16)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(6):
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= 1:
                times.append(time.perf_counter() - t)
        s = statistics.median(times)
        fpt = flops_per_token(m.config, T).total
        print(f"| {T} | {B} | {s:.3f} | {B * T / s:,.0f} | {mfu(B * T / s, fpt, peak):.1%} | "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} |")
        del m, opt
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="gpu-300m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--cpu-selfcheck", action="store_true", help="run part 1 on CPU (naive vs chunk)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-throughput", action="store_true")
    args = ap.parse_args()
    if args.cpu_selfcheck:
        correctness("cpu")
        return
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}\n")
    correctness("cuda", getattr(torch, args.dtype))
    if not args.no_throughput:
        throughput(args.size, args.lengths, args.tokens)


if __name__ == "__main__":
    main()
