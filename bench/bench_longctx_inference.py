"""Long-context inference (issue 11 item 6, the report's headline): prefill seconds, decode tokens/s and peak memory
of the hybrid (7 lightning : 1 softmax) against the same model with all-softmax layers, at context lengths up to 1M.

One sequence per length through ``model.generate`` (model/generation.py): a single-shot prefill of N random tokens
(softmax layers by SDPA's causal kernel, flash on CUDA; lightning layers by our kernels) into a preallocated cache,
keeping only the last position's logits (the [N, vocab] logits of a 1M-token prefill would be 64 GiB), then
``--decode-tokens`` greedy steps, each one replay of the captured decode step on CUDA (lightning layers: an O(1)
d x d state per head; softmax layers: split-K attention over the KV cache, O(N)). Random weights: speed and memory do not depend on them. A length
that runs out of memory is recorded as ``oom`` and the next one is still tried.

    CPU check:  OMP_NUM_THREADS=1 python bench/bench_longctx_inference.py --device cpu --size tiny --lengths 512,2048
    H200:       python bench/bench_longctx_inference.py --device cuda --size gpu-300m \
                    --lengths 131072,524288,1048576 --patterns hybrid,all-softmax

Prints one JSON line per (pattern, length) and, with ``$OUT`` set, writes them to ``$OUT/longctx_inference.jsonl`` and
a plot ``$OUT/longctx_inference.png`` (prefill seconds and decode tokens/s against length, one line per pattern).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # process peak RSS (never resets)


def measure(model, length: int, decode_tokens: int, device: torch.device, vocab: int, seed: int) -> dict:
    """One prompt of ``length`` random tokens through ``model.generate`` (model/generation.py: packed prefill into a
    preallocated cache, then the decode step, a CUDA graph on GPUs): its prefill seconds and decode tokens/s."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, vocab, (1, length), generator=g).to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    from model.generation import engines_of

    st = model.last_generation_stats
    engine = next(iter(engines_of(model).values()))
    sizes = engine.cache.nbytes()
    return {"prefill_seconds": round(st.prefill_seconds, 4), "prefill_tokens_per_second": round(length / st.prefill_seconds, 1),
            "decode_tokens_per_second": round((decode_tokens - 1) / st.decode_seconds, 2) if decode_tokens > 1 else None,
            "decode_ms_per_token": round(st.decode_seconds / max(1, decode_tokens - 1) * 1e3, 3),
            "cuda_graph": st.cuda_graph,
            "peak_memory_gib": round(_peak_bytes(device) / 2**30, 3),
            "cache_lightning_mib": round(sizes["lightning"] / 2**20, 3),
            "cache_softmax_kv_mib": round(sizes["softmax_kv"] / 2**20, 3)}


def run_lengths(size: str, device: torch.device, dtype: torch.dtype, lengths: list[int], patterns: list[str],
                decode_tokens: int, seed: int = 0):
    """Yield one row per (pattern, length); a warm-up generate per pattern first (kernel compilation, autotuning)."""
    from model import HybridForCausalLM, config_for
    from model.generation import release_engines

    for pattern in patterns:
        torch.manual_seed(seed)
        cfg = config_for(size, attention_pattern=pattern, max_position_embeddings=max(lengths) + decode_tokens,
                         moe_token_drop=False)
        model = HybridForCausalLM(cfg).to(device=device, dtype=dtype).eval()
        measure(model, min(lengths), 4, device, cfg.vocab_size, seed)  # warm-up, not reported
        release_engines(model)
        for length in lengths:
            row = {"kind": "result", "pattern": pattern, "length": length}
            try:
                row |= measure(model, length, decode_tokens, device, cfg.vocab_size, seed)
            except torch.OutOfMemoryError as e:
                row |= {"oom": True, "error": str(e).splitlines()[0][:200]}
            release_engines(model)  # free this length's cache before the next
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            yield row
        del model
        gc.collect()


def main() -> None:

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) or float32 (CPU default)")
    p.add_argument("--lengths", default="131072,524288,1048576")
    p.add_argument("--patterns", default="hybrid,all-softmax")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    lengths = [int(x) for x in a.lengths.split(",")]
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    rows = []
    env = {"kind": "env", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": str(dtype), "size": a.size}
    print(json.dumps(env), flush=True)
    for row in run_lengths(a.size, device, dtype, lengths, a.patterns.split(","), a.decode_tokens, a.seed):
        print(json.dumps(row), flush=True)
        rows.append(row)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "longctx_inference.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [env, *rows]))
        _plot(rows, out_dir / "longctx_inference.png")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for pattern in sorted({r["pattern"] for r in rows}):
        ok = [r for r in rows if r["pattern"] == pattern and not r.get("oom")]
        xs = [r["length"] for r in ok]
        ax[0].plot(xs, [r["prefill_seconds"] for r in ok], "o-", label=pattern)
        ax[1].plot(xs, [r["decode_tokens_per_second"] for r in ok], "o-", label=pattern)
        ax[2].plot(xs, [r["peak_memory_gib"] for r in ok], "o-", label=pattern)
    for a, title in zip(ax, ("prefill seconds", "decode tokens/s (batch 1)", "peak memory GiB"), strict=True):
        a.set_xscale("log", base=2)
        a.set_xlabel("context length (tokens)")
        a.set_title(title)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
