"""CPU benchmark of the hybrid model: training throughput and decode speed against context length.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_model_cpu.py            # ~5 min on the 2-core box
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_model_cpu.py --quick    # smaller, for a smoke run

Prints markdown tables (paste into BENCHMARKS.md):

1. forward+backward tokens/s of the ``tiny`` size with the chunked lightning kernel vs the naive token
   recurrence, and one AdamW step at the ``cpu-small`` size (the shape of the transformers MiniMax CPU anchor,
   /work/shared/anchors/cpu) for ours and for transformers' MiniMaxForCausalLM with the same weights;
2. decode tokens/s (batch 1, greedy, after a real prefill of the context) and cache size against context
   length for the hybrid, all-lightning and all-softmax variants of ``tiny``. Lightning decode touches one
   d x d state per head whatever the context, so its rate must stay flat; softmax layers read a KV cache that
   grows with the context.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.accounting import flops_per_token, parameter_counts  # noqa: E402
from model.hf_minimax import export_to_minimax  # noqa: E402
from model.modeling import HybridForCausalLM  # noqa: E402
from model.sizes import config_for  # noqa: E402


def _timed(steps: dict[str, callable], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall s, CPU s) per step of each named step function, run interleaved after one warm-up each,
    so a load change on a shared box hits all of them alike."""
    for fn in steps.values():
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            t, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - t, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts))
        for name, ts in times.items()
    }


def train_table(quick: bool) -> str:
    rows = [
        "| model | lightning path | batch x seq | s/step wall (CPU) | tokens/s wall (per CPU-s) |",
        "|---|---|---|---|---|",
    ]

    def row(label, impl, B, T, wall, cpu):
        return f"| {label} | {impl} | {B}x{T} | {wall:.3f} ({cpu:.3f}) | {B * T / wall:,.0f} ({B * T / cpu:,.0f}) |"

    B, T = (2, 256) if quick else (4, 512)
    steps = {}
    for impl in ("chunk", "naive"):
        torch.manual_seed(0)
        model = HybridForCausalLM(config_for("tiny", lightning_impl=impl)).train()
        ids = torch.randint(0, model.config.vocab_size, (B, T))

        def step(model=model, ids=ids):
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        steps[impl] = step
    for impl, (wall, cpu) in _timed(steps, repeats=2 if quick else 3).items():
        rows.append(row("tiny (1.0M, 8 layers 7:1), fwd+bwd", impl, B, T, wall, cpu))

    # the shape of the CPU anchor: ours vs transformers' MiniMax, one AdamW step each, same weights
    B, T = (2, 256) if quick else (8, 512)
    torch.manual_seed(0)
    ours = HybridForCausalLM(config_for("cpu-small", moe_token_drop=False)).train()
    theirs = export_to_minimax(ours).train()
    ids = torch.randint(0, ours.config.vocab_size, (B, T))
    steps = {}
    for name, model in (("ours (hylight)", ours), ("transformers MiniMaxForCausalLM", theirs)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt, ids=ids):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[name] = step
    paths = {"ours (hylight)": "kernels chunk", "transformers MiniMaxForCausalLM": "its block loop"}
    for name, (wall, cpu) in _timed(steps, repeats=1 if quick else 3).items():
        rows.append(row(f"cpu-small (19.3M) + AdamW: {name}", paths[name], B, T, wall, cpu))
    return "\n".join(rows)


@torch.inference_mode()
def decode_rate(
    model: HybridForCausalLM, context: int, new_tokens: int
) -> tuple[float, float, float, dict[str, int]]:
    """(prefill s, decode tokens per wall second, per CPU second, cache bytes) for a greedy continuation."""
    ids = torch.randint(0, model.config.vocab_size, (1, context))
    t = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(2):  # warm-up steps
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(new_tokens):
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    return prefill, new_tokens / wall, new_tokens / cpu, cache.nbytes()


def decode_table(contexts: list[int], new_tokens: int) -> str:
    variants = {"hybrid": "hybrid", "all-lightning": "all-lightning", "all-softmax": "all-softmax"}
    header = "| variant: tokens/s (per CPU-second) | " + " | ".join(f"ctx {c:,}" for c in contexts) + " |"
    rows = [header, "|---|" + "---|" * len(contexts)]
    cache_rows = [
        "| variant (cache KiB: lightning state + softmax KV) | "
        + " | ".join(f"ctx {c:,}" for c in contexts)
        + " |",
        "|---|" + "---|" * len(contexts),
    ]
    prefill_rows = [
        "| variant (prefill seconds) | " + " | ".join(f"ctx {c:,}" for c in contexts) + " |",
        "|---|" + "---|" * len(contexts),
    ]
    for name, pattern in variants.items():
        torch.manual_seed(0)
        model = HybridForCausalLM(
            config_for("tiny", attention_pattern=pattern, max_position_embeddings=max(contexts))
        )
        model.eval()
        rates, sizes, prefills = [], [], []
        for c in contexts:
            prefill, rate, cpu_rate, nbytes = decode_rate(model, c, new_tokens)
            rates.append(f"{rate:,.0f} ({cpu_rate:,.0f})")
            sizes.append(f"{nbytes['lightning'] / 1024:.0f} + {nbytes['softmax_kv'] / 1024:,.0f}")
            prefills.append(f"{prefill:.2f}")
            print(
                f"  {name} ctx {c}: prefill {prefill:.2f}s, decode {rate:,.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )
        rows.append(f"| {name} | " + " | ".join(rates) + " |")
        cache_rows.append(f"| {name} | " + " | ".join(sizes) + " |")
        prefill_rows.append(f"| {name} | " + " | ".join(prefills) + " |")
    return "\n".join(rows + [""] + cache_rows + [""] + prefill_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, a smoke run")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = args.contexts or ([128, 1024] if args.quick else [128, 512, 2048, 8192, 16384])

    tiny, small = config_for("tiny"), config_for("cpu-small")
    print("## hylight model on CPU\n")
    print(
        f"- command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python {' '.join(sys.argv)}`"
    )
    print(f"- torch {torch.__version__}, threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, float32, "
          f"load average at start {os.getloadavg()[0]:.1f}")  # fmt: skip
    for name, cfg in (("tiny", tiny), ("cpu-small", small)):
        p = parameter_counts(cfg)
        print(f"- {name}: {p.total / 1e6:.2f}M params ({p.activated / 1e6:.2f}M activated), "
              f"{flops_per_token(cfg, 512).total / 1e6:.1f} MFLOP/token train @512 (Table 1 terms)")  # fmt: skip
    t0 = time.perf_counter()
    print("\n### Training step (forward + backward)\n")
    print(train_table(args.quick), flush=True)
    print(
        f"\n### Decode, batch 1, greedy, {args.new_tokens} new tokens after a prefill of the context (tiny size)\n"
    )
    print(decode_table(contexts, args.new_tokens))
    print(f"\n_total benchmark time {time.perf_counter() - t0:.0f} s_")


if __name__ == "__main__":
    main()
