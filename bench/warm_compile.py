"""Compile a model size's GPU kernels ahead of a run, into the compile caches its stages then read.

Usage (GPU): python bench/warm_compile.py [--size gpu-300m] [--rows 8] [--seq-len 2048] [--docs 8]

On a bare lent machine every pretrain with softmax layers spent 260 s in its first 10 steps, against 18 s
without them (4 x H200, BENCHMARKS.md, issue 33). Those layers compile FlexAttention (kernels/softmax_varlen.py)
on first use; a new process that finds the compiled kernels in TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR takes
seconds (long_context's phases paid ~10 s each after pretraining had compiled the same shapes).
bench/run_gpu_dag.sh runs this on the host's last GPU while the CPU data stages run, so the pretrains can find
the kernels compiled; and it measures what the cold compile costs alone, which the lease's numbers could not
separate from three concurrent pretrains. HYLIGHT_FLEX_BLOCK_MASK=create compiles torch's create_block_mask as the
softmax layers did before the tile-bound BlockMask (bench/run_gpu_dag.sh's COMPILE_AB=1 runs both at once).

It builds a two-layer model of the size (one lightning, one softmax layer: the kernels do not depend on the
depth) in bf16, as DeepSpeed trains it, and runs the pretrain step's calls on a packed batch of ``rows`` x
``seq_len`` tokens in ``docs`` documents a row: forward and backward, then a no-grad forward (the probe and the
held-out loss), each twice. The second call of each shows the compiled speed. Prints one line per call and the
compile counters (pretrain/callbacks.compile_stats).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.softmax_varlen import block_mask_source  # noqa: E402
from model import HybridForCausalLM  # noqa: E402
from model.sizes import config_for  # noqa: E402
from pretrain.callbacks import compile_stats  # noqa: E402


def packed_batch(rows: int, seq_len: int, docs: int, vocab: int, device: torch.device, seed: int = 0) -> dict:
    """input_ids, labels, position_ids [1, rows x seq_len] and cu_seqlens over them: ``docs`` documents of random
    lengths a row, positions restarting at each, as pretrain/packed_data.make_batch lays a micro-batch out."""
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    positions = []
    for r in range(rows):
        cuts = sorted(set(torch.randint(1, seq_len, (docs - 1,), generator=g).tolist()))
        starts = [0, *cuts]
        ends = [*cuts, seq_len]
        for a, e in zip(starts, ends, strict=True):
            positions.append(torch.arange(e - a))
            bounds.append(r * seq_len + e)
    ids = torch.randint(0, vocab, (1, rows * seq_len), generator=g)  # one row of all tokens, as make_batch
    return {"input_ids": ids.to(device), "labels": ids.to(device),
            "position_ids": torch.cat(positions)[None].to(device),
            "cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpu-300m")
    ap.add_argument("--rows", type=int, default=8, help="rows of a micro-batch (the recipe's micro_batch_rows)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=8, help="documents a row")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("warm_compile: no CUDA device here; nothing to compile", file=sys.stderr)
        return 2
    cfg = config_for(args.size, num_hidden_layers=2, attention_pattern=["lightning", "softmax"])
    model = HybridForCausalLM(cfg).to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    batch = packed_batch(args.rows, args.seq_len, args.docs, cfg.vocab_size, device)
    t0 = time.perf_counter()

    def timed(label: str, fn) -> None:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        graphs, frames, backward = compile_stats()
        print(f"warm_compile: {label}: {time.perf_counter() - start:.1f} s ({graphs} graph(s), {frames:.1f} s in "
              f"Dynamo frames, {backward:.1f} s compiling backward graphs)", flush=True)

    def train_step() -> None:
        model.train()
        out = model(**batch, output_router_logits=True)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    def no_grad_forward() -> None:
        model.eval()
        with torch.no_grad():
            model(**batch)

    for i in (1, 2):
        timed(f"forward+backward #{i}", train_step)
    for i in (1, 2):
        timed(f"no-grad forward #{i}", no_grad_forward)
    print(f"warm_compile: {args.size} softmax + lightning layers, {args.rows} x {args.seq_len} tokens, BlockMask from "
          f"{block_mask_source()}: {time.perf_counter() - t0:.1f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
