"""CPU forward+backward time of lightning attention: PyTorch chunk (Algorithm 1) vs the token recurrence.

Shape of a tiny hylight config's lightning layer: B=2, H=4, D=64, T from 256 to 2048, float32.
Prints a markdown table (median of --repeats timed runs after one warm-up) with versions and the
command. Threads are pinned: OMP_NUM_THREADS is set from --threads before torch is imported.

    python bench/bench_lightning_cpu.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS / torch threads (default 1)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[64, 256], help="chunk block sizes to time")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per cell (median reported)")
    p.add_argument("--naive-repeats", type=int, default=2, help="timed runs for the slow recurrence")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # must precede the torch import
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import torch
    import torch.nn.functional as F

    from kernels.lightning import lightning_attn_chunk, lightning_attn_recurrent, lightning_decay_rates

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, h, d = args.batch, args.heads, args.head_dim
    rates = lightning_decay_rates(h, 1, 4)  # layer 1 of a 4-layer tiny config

    def fwd_bwd(fn, q, k, v, grad_out) -> tuple[float, float, torch.Tensor]:
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        t0 = time.perf_counter()
        o, _ = fn(*leaves)
        t1 = time.perf_counter()
        torch.autograd.backward(o, grad_out)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, o.detach()

    def timed(fn, q, k, v, grad_out, repeats):
        fwd_bwd(fn, q, k, v, grad_out)  # warm-up
        runs = [fwd_bwd(fn, q, k, v, grad_out) for _ in range(repeats)]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), runs[-1][2]

    rows = []
    for length in args.lengths:
        q, k, v = (F.silu(torch.randn(b, h, length, d)) for _ in range(3))
        grad_out = torch.randn(b, h, length, d)
        naive_fn = lambda q, k, v: lightning_attn_recurrent(q, k, v, rates)  # noqa: E731
        n_fwd, n_total, n_out = timed(naive_fn, q, k, v, grad_out, args.naive_repeats)
        rows.append((length, "naive recurrence", "-", n_fwd, n_total, 1.0, 0.0))
        for block in args.block_sizes:
            chunk_fn = lambda q, k, v, block=block: lightning_attn_chunk(q, k, v, rates, block)  # noqa: E731
            c_fwd, c_total, c_out = timed(chunk_fn, q, k, v, grad_out, args.repeats)
            rel_err = ((c_out - n_out).abs().max() / n_out.abs().max()).item()
            rows.append((length, "chunk", str(block), c_fwd, c_total, n_total / c_total, rel_err))

    print(
        f"Lightning attention, CPU forward+backward, B={b} H={h} D={d}, float32, "
        f"median of {args.repeats} (naive: {args.naive_repeats}) runs after 1 warm-up\n"
    )
    print(
        "| T | impl | block | fwd ms | fwd+bwd ms | fwd+bwd tokens/s | speedup vs naive | max rel diff vs naive |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for length, impl, block, fwd, total, speedup, err in rows:
        tokens = b * length / total
        print(
            f"| {length} | {impl} | {block} | {fwd * 1e3:.1f} | {total * 1e3:.1f} | {tokens:,.0f} | "
            f"{speedup:.1f}x | {err:.1e} |"
        )
    print()
    print(
        f"- command: `OMP_NUM_THREADS={args.threads} python {' '.join(sys.argv)}` "
        f"(the script sets OMP_NUM_THREADS={args.threads} and torch.set_num_threads({args.threads}) itself)"
    )
    print(
        f"- python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} logical CPUs, {platform.processor() or platform.platform()}"
    )


if __name__ == "__main__":
    main()
