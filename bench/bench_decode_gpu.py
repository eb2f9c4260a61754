"""Generation speed (issue 21) in one command: every table of BENCHMARKS.md's "Fast generation" section.

Sections (``--sections``, in this order; each prints its table and appends JSON lines to ``$OUT/decode.jsonl``):
  check    the GPU paths against references on fresh random inputs: the split-K softmax decode kernel and the
           in-place lightning decode kernel against float64 PyTorch; the CUDA-graph decode against the same step
           run eagerly (logits of a bf16 model, and its greedy tokens)
  table    tokens/s of ``HybridForCausalLM.generate`` (this path), of our model through transformers' loop
           (``fast_decode=False``, what every stage ran before) and of transformers' ``MiniMaxForCausalLM.generate``
           on the same weights, same run; greedy, exactly ``new`` tokens per row (no eos); with the bound that
           reading the weights once per step puts on each workload
  profile  one decode step: kernel launches per step, GPU busy share of the wall time over replays, top kernels
  longctx  batch 1 at growing context, hybrid against all-softmax (bench/bench_longctx_inference.py's measure)

    python bench/bench_decode_gpu.py --size gpu-300m                     # all sections, on CUDA
    OMP_NUM_THREADS=1 python bench/bench_decode_gpu.py --device cpu --size tiny --workloads 4x32+32 \
        --sections table,profile --longctx-lengths 512      # CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)
    if OUT:
        OUT.mkdir(parents=True, exist_ok=True)
        with open(OUT / "decode.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


# --- check ------------------------------------------------------------------------------------------------------
def section_check(model, device: torch.device) -> None:
    from kernels.lightning import lightning_attention_decode, lightning_decay_rates
    from kernels.softmax_decode import softmax_decode_attention, softmax_decode_attention_reference
    from model.generation import DecodeEngine, GenerationSpec

    g = torch.Generator().manual_seed(1)
    for b, h, hkv, s, d in ((1, 8, 2, 70000, 128), (32, 8, 2, 512, 128), (256, 8, 2, 640, 128), (3, 4, 4, 100, 64)):
        q = torch.randn(b, h, 1, d, generator=g).to(device, torch.bfloat16)
        kc = torch.randn(b, hkv, s, d, generator=g).to(device, torch.bfloat16)
        vc = torch.randn(b, hkv, s, d, generator=g).to(device, torch.bfloat16)
        lengths = torch.randint(1, s + 1, (b,), generator=g).to(device)
        o = softmax_decode_attention(q, kc, vc, lengths, impl="triton")
        ref = softmax_decode_attention_reference(q.double(), kc.double(), vc.double(), lengths)
        emit({"kind": "check", "what": "softmax_decode split-K vs fp64", "shape": [b, h, hkv, s, d],
              "rel_err": rel(o, ref)})
    # split-K occupancy: achieved KV read bandwidth at batch 1 for several target program counts
    import triton.testing

    import kernels.softmax_decode_triton as sd

    default_programs = sd.MIN_PROGRAMS
    for s in (131072, 524288):
        q = torch.randn(1, 8, 1, 128, generator=g).to(device, torch.bfloat16)
        kc = torch.randn(1, 2, s, 128, generator=g).to(device, torch.bfloat16)
        vc = torch.randn(1, 2, s, 128, generator=g).to(device, torch.bfloat16)
        lengths = torch.tensor([s], device=device)
        for programs in (256, 512, 1024, 2048, 4096):
            sd.MIN_PROGRAMS = programs
            ms = triton.testing.do_bench(lambda: softmax_decode_attention(q, kc, vc, lengths, impl="triton"),
                                         return_mode="median")
            emit({"kind": "check", "what": "split-K batch-1 KV read", "keys": s, "min_programs": programs,
                  "ms": ms, "GBps": 2 * kc.numel() * 2 / ms / 1e6})
    sd.MIN_PROGRAMS = default_programs
    b, h, d = 32, 8, 128
    rates = lightning_decay_rates(h, 3, 16, device=device)
    q, k, v = (torch.randn(b, h, 1, d, generator=g).to(device, torch.bfloat16) for _ in range(3))
    state = torch.randn(b, h, d, d, generator=g).to(device)
    ref_o, ref_s = lightning_attention_decode(q.double(), k.double(), v.double(), rates, state.double(), impl="chunk")
    inplace = state.clone()
    o, _ = lightning_attention_decode(q, k, v, rates, inplace, impl="triton", out_state=inplace)
    emit({"kind": "check", "what": "lightning decode in place vs fp64", "rel_err_o": rel(o, ref_o),
          "rel_err_state": rel(inplace, ref_s)})

    # every variant's step against the eager step on the same cache: teacher-forced by the eager step's greedy
    # tokens (a bf16 model with random weights has near-ties, so free-running greedy paths part after any rounding
    # difference and their logits are no longer comparable)
    spec = GenerationSpec(max_new_tokens=64, pad=0)
    ids = torch.randint(8, model.config.vocab_size, (8, 100), generator=g)
    prompts = [ids[i, : 40 + 7 * i] for i in range(8)]
    compile_too = os.environ.get("HYLIGHT_DECODE_COMPILE", "1") != "0"
    with torch.inference_mode():
        outs = []  # the captured step (no compile) free-running against the eager step: the same kernels
        for graph in (False, True):
            engine = DecodeEngine(model, 8, 256, spec, cuda_graph=graph, compile=False)
            engine.prefill(prompts)
            engine.decode(31)
            outs.append(engine.out[:, :32].clone())
            del engine
        emit({"kind": "check", "what": "cuda-graph decode vs eager decode, 32 greedy tokens (bf16)",
              "tokens_equal_share": float((outs[0] == outs[1]).float().mean())})
        if compile_too:
            engine = DecodeEngine(model, 8, 256, spec, cuda_graph=False, compile=True)
            engine.prefill(prompts)
            errs, same = [], []
            for _ in range(12):
                saved = {i: s.clone() for i, s in engine.cache.lightning_states.items()}
                fast = engine._forward()  # compiled
                for i, s in saved.items():
                    engine.cache.lightning_states[i].copy_(s)
                ref = engine._logits()  # eager, from the same state; also advances it
                errs.append(rel(fast, ref))
                same.append(float((fast.argmax(-1) == ref.argmax(-1)).float().mean()))
                engine._choose(ref)
                engine.cache.lengths.add_(1)
            emit({"kind": "check", "what": "compiled decode step vs eager, teacher-forced 12 steps (bf16)",
                  "logits_rel_err_max": max(errs), "argmax_equal_share": sum(same) / len(same)})
            del engine


# --- table ------------------------------------------------------------------------------------------------------
def weight_bytes(model, batch: int) -> dict:
    """Bytes a decode step must read at least: every weight the batch uses once (the experts: the expected number
    of distinct experts top-k routing touches for ``batch`` tokens under uniform routing; the tied embedding in
    full, as the output projection), and the lightning states (read and written, fp32). KV reads are per workload."""
    cfg = model.config
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * model.dtype.itemsize
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    weights = total - cfg.num_hidden_layers * (e - touched) * expert
    lightning = sum(1 for p in cfg.attention_pattern if p == "lightning")
    state = 2 * batch * lightning * cfg.num_attention_heads * cfg.head_dim**2 * 4
    return {"weights": weights, "state": state}


def kv_bytes(model, batch: int, context: int) -> int:
    cfg = model.config
    softmax = sum(1 for p in cfg.attention_pattern if p == "softmax")
    return 2 * batch * softmax * cfg.num_key_value_heads * context * cfg.head_dim * model.dtype.itemsize


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bytes/s (read + write), the ceiling a bandwidth-bound step can reach."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up: compiles, graph capture, allocator
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def section_table(model, theirs, device: torch.device, workloads: list[tuple[int, int, int]], bw: float,
                  slow_new_cap: int) -> list[dict]:
    from model.generation import use_compile

    rows = []
    args = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    for batch, prompt, new in workloads:
        g = torch.Generator().manual_seed(batch * 7 + prompt)
        ids = torch.randint(8, model.config.vocab_size, (batch, prompt), generator=g).to(device)
        mask = torch.ones_like(ids)

        def ours(n=new, fast=True):
            with torch.inference_mode():
                return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      fast_decode=fast, **args)

        t_fast, out_fast = timed(ours, device, 3)
        st = model.last_generation_stats
        # the slow loops get fewer new tokens where they would take minutes; tok/s is per generated token
        slow_new = min(new, slow_new_cap)
        t_old, _ = timed(lambda: ours(slow_new, False), device, 1)
        row = {"kind": "table", "compile": use_compile(device),
               "stacked_projections": os.environ.get("HYLIGHT_DECODE_STACKED", "1") != "0",
               "router_reduction": os.environ.get("HYLIGHT_DECODE_ROUTER_REDUCE", "1") != "0", "batch": batch, "prompt": prompt, "new": new, "hylight_tok_s": batch * new / t_fast,
               "hylight_decode_tok_s": batch * (new - 1) / st.decode_seconds, "prefill_s": st.prefill_seconds,
               "cuda_graph": st.cuda_graph, "hylight_hf_loop_tok_s": batch * slow_new / t_old, "slow_new": slow_new}
        if theirs is not None:
            from model.hf_minimax import MiniMaxGenerationCache

            def hf(n=slow_new):
                with torch.inference_mode():
                    return theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                           past_key_values=MiniMaxGenerationCache(theirs.config), **args)

            t_hf, out_hf = timed(hf, device, 1)
            row["minimax_hf_tok_s"] = batch * slow_new / t_hf
            row["speedup_vs_minimax_hf"] = row["hylight_tok_s"] / row["minimax_hf_tok_s"]
            k = min(slow_new, new)
            row["greedy_agreement_vs_hf"] = float((out_fast[:, prompt:prompt + k] == out_hf[:, prompt:]).float().mean())
        b = weight_bytes(model, batch)
        step_bytes = b["weights"] + b["state"] + kv_bytes(model, batch, prompt + new // 2)
        row["bytes_per_step_min"] = step_bytes
        if bw == bw:  # not NaN
            row["bound_tok_s"] = batch * bw / step_bytes
            row["share_of_bound"] = row["hylight_decode_tok_s"] / row["bound_tok_s"]
        emit(row)
        rows.append(row)
    return rows


# --- profile ----------------------------------------------------------------------------------------------------
def section_profile(model, device: torch.device, batch: int, prompt: int, compile: bool = False) -> None:
    from torch.profiler import ProfilerActivity, profile

    from model.generation import DecodeEngine, GenerationSpec, use_cuda_graphs

    spec = GenerationSpec(max_new_tokens=64, pad=0)
    ids = torch.randint(8, model.config.vocab_size, (batch, prompt))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        engine = DecodeEngine(model, batch, prompt + 256, spec, cuda_graph=use_cuda_graphs(device), compile=compile)
        engine.prefill(list(ids))
        engine.decode(4)
        sync(device)
        steps = 32
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            engine.decode(steps)
            sync(device)
        wall = time.perf_counter() - t0
        sync(device)
        t0 = time.perf_counter()
        engine.decode(steps)  # the same steps without the profiler
        sync(device)
        step_ms = (time.perf_counter() - t0) / steps * 1e3
        prompts = list(ids)
        engine.prefill(prompts)  # warm: this shape's kernels compiled and tuned
        sync(device)
        t0 = time.perf_counter()
        engine.prefill(prompts)
        sync(device)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        with profile(activities=acts) as pprof:
            engine.prefill(prompts)
            sync(device)
    profile_prefill(pprof, device, batch, prompt, prefill_ms)
    busy, top, launches = None, [], None
    if OUT:
        (OUT / f"profile_b{batch}.txt").write_text(prof.key_averages().table(sort_by="self_device_time_total"
                                                                            if device.type == "cuda" else
                                                                            "self_cpu_time_total", row_limit=60))
    if device.type == "cuda":
        top, busy, n = kernel_summary(prof, steps)
        launches = n / steps
    emit({"kind": "profile", "batch": batch, "prompt": prompt, "compile": compile, "kernels_per_step": launches,
          "step_ms": step_ms, "profiled_wall_ms_per_step": wall / steps * 1e3, "gpu_busy_share": busy,
          "top_kernels_per_step_us": top})


def kernel_summary(prof, steps: int = 1) -> tuple[list, float | None, int]:
    """(top kernels [name, count, us] per step, GPU busy share of the kernels' span, kernels) of a CUDA profile."""
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in evs)
    covered, end = 0.0, -1.0
    for s, e in intervals:  # union of kernel intervals (us)
        if e > end:
            covered += e - max(s, end)
            end = e
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0
    by = {}
    for e in evs:
        by.setdefault(e.name, [0, 0.0])
        by[e.name][0] += 1
        by[e.name][1] += e.time_range.end - e.time_range.start
    top = sorted(([n[:80], c // steps, round(t / steps, 1)] for n, (c, t) in by.items()), key=lambda r: -r[2])[:12]
    return top, (covered / span if span else None), len(evs)


def profile_prefill(prof, device: torch.device, batch: int, prompt: int, prefill_ms: float) -> None:
    """Where a packed prefill's time goes: its kernels, the GPU's busy share, and the host ops that cost most."""
    if OUT:
        (OUT / f"profile_prefill_b{batch}.txt").write_text(prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=60))
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    row = {"kind": "profile_prefill", "batch": batch, "prompt": prompt, "prefill_ms": prefill_ms,
           "top_host_ops_us": [[e.key[:60], e.count, round(e.self_cpu_time_total, 1)] for e in host]}
    if device.type == "cuda":
        top, busy, n = kernel_summary(prof)
        row |= {"kernels": n, "gpu_busy_share": busy, "top_kernels_us": top}
    emit(row)


def print_tables() -> None:
    if not OUT or not (OUT / "decode.jsonl").exists():
        return
    rows = [json.loads(line) for line in (OUT / "decode.jsonl").read_text().splitlines()]
    print("\n| variant | batch x (prompt + new) | hylight tok/s | decode-only tok/s | hylight via HF loop | MiniMax HF | "
          "speedup vs MiniMax | bound tok/s | share of bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "table":
            variant = ",".join(k for k in ("compile", "stacked_projections", "router_reduction") if r.get(k)) or "-"
            print(f"| {variant} | {r['batch']} x ({r['prompt']} + {r['new']}) | {r['hylight_tok_s']:,.0f} | "
                  f"{r['hylight_decode_tok_s']:,.0f} | {r['hylight_hf_loop_tok_s']:,.0f} | "
                  f"{r.get('minimax_hf_tok_s', float('nan')):,.0f} | {r.get('speedup_vs_minimax_hf', float('nan')):.2f}x"
                  f" | {r.get('bound_tok_s', float('nan')):,.0f} | {r.get('share_of_bound', float('nan')):.2f} |")
    for r in rows:
        if r["kind"] in ("check", "profile", "profile_prefill", "longctx", "env"):
            print(json.dumps(r))


def main() -> None:
    from model import HybridForCausalLM, config_for

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="gpu-300m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sections", default="check,table,profile,longctx")
    p.add_argument("--workloads", default="32x256+256,256x128+512,1x4096+256",
                   help="comma-separated BATCHxPROMPT+NEW")
    p.add_argument("--slow-new-cap", type=int, default=64,
                   help="new tokens for the two slow loops (per-token rates are compared)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' MiniMax")
    p.add_argument("--profile-shapes", default="1x4096,32x256", help="comma-separated BATCHxPROMPT")
    p.add_argument("--longctx-lengths", default="4096,32768,131072,524288,1048576")
    p.add_argument("--longctx-patterns", default="hybrid,all-softmax")
    p.add_argument("--longctx-decode", type=int, default=128)
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sections = a.sections.split(",")
    env = {"kind": "env", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": str(dtype), "size": a.size}
    try:
        import transformers
        import triton

        env |= {"triton": triton.__version__, "transformers": transformers.__version__}
    except ImportError:
        pass
    emit(env)
    torch.manual_seed(0)
    if any(s in sections for s in ("check", "table", "profile")):
        base = HybridForCausalLM(config_for(a.size, moe_token_drop=False)).eval()
        theirs = None
        if "table" in sections and not a.no_hf:
            from model.hf_minimax import export_to_minimax

            theirs = export_to_minimax(base).to(device, dtype).eval()
        model = base.to(device, dtype)
        bw = copy_bandwidth(device)
        emit({"kind": "env", "copy_bandwidth_GBps": bw / 1e9})
        if "check" in sections and device.type == "cuda":
            section_check(model, device)
        if "table" in sections:
            workloads = []
            for w in a.workloads.split(","):
                b, rest = w.split("x")
                pr, nw = rest.split("+")
                workloads.append((int(b), int(pr), int(nw)))
            section_table(model, theirs, device, workloads, bw, a.slow_new_cap)
        del theirs
        if "profile" in sections:
            shapes = [tuple(int(v) for v in sh.split("x")) for sh in a.profile_shapes.split(",")]
            for batch, prompt in shapes:
                section_profile(model, device, batch, prompt,
                                compile=os.environ.get("HYLIGHT_DECODE_COMPILE", "1") != "0")
        del model, base
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if "longctx" in sections:
        import sys

        sys.path.insert(0, str(Path(__file__).parent))
        from bench_longctx_inference import run_lengths

        for row in run_lengths(a.size, device, dtype, [int(x) for x in a.longctx_lengths.split(",")],
                               a.longctx_patterns.split(","), a.longctx_decode, seed=0):
            emit(row | {"kind": "longctx"})
    print_tables()


if __name__ == "__main__":
    main()
