"""GPU training-step benchmark of the pretrain stage, side by side with transformers' MiniMaxForCausalLM.

Run on one H100 (the device tool) from the repo root:

    python bench/bench_pretrain_gpu.py --out $OUT            # all sections
    python bench/bench_pretrain_gpu.py --sections moe        # the MoE layer alone

Sections:
  moe      one MoE layer alone (16K tokens, d 1024, 8 experts, FFN 1536, top-2, bf16, fwd+bwd): dense matmuls of the
           same FLOPs (the ceiling), model/moe.py (token drop / dropless), DeepSpeed's classic
           deepspeed.moe.layer.MoE (einsum dispatch), pretrain/moe.py's DeepSpeedMoEFeedForward (drop / dropless)
  step     the whole training step (fwd + bwd + optimizer) of `gpu-300m` at each T x B: hylight as the pretrain
           stage runs it (DeepSpeed engine, ZeRO-1, bf16, fused torch AdamW, packed documents with cu_seqlens)
           and transformers' MiniMaxForCausalLM built from the same config (bf16, fused torch AdamW, [B, T] rows),
           interleaved in one process; tokens/s and MFU (FLOPs from model/accounting.py, peak from a measured
           bf16 matmul)
  profile  torch.profiler of hylight's step at T=2048: GPU time by kernel, GPU busy fraction

Prints a table per section at the end; JSON and the profile table go to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _cuda_time(fn, reps: int, warmup: int) -> float:
    """Median ms per call of fn() (events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def peak_bf16() -> float:
    from pretrain.train import measured_peak_flops

    return max(measured_peak_flops(torch.device("cuda")) for _ in range(3))


# --- MoE layer alone -------------------------------------------------------------------------------------------


def bench_moe(tokens: int = 16384, d: int = 1024, E: int = 8, F: int = 1536, k: int = 2, reps: int = 20) -> list:
    from deepspeed.moe.layer import MoE

    from model.moe import MoEFeedForward
    from pretrain.moe import install_deepspeed_moe
    from pretrain.train import init_distributed

    init_distributed()  # DeepSpeed's classic MoE creates its expert groups on a process group
    dev, dt = torch.device("cuda"), torch.bfloat16
    flops = 6 * tokens * k * 3 * d * F  # fwd+bwd of the routed SwiGLU matmuls
    x0 = torch.randn(1, tokens, d, device=dev, dtype=dt)
    rows = []

    def run(name: str, module: torch.nn.Module, call) -> None:
        x = x0.clone().requires_grad_()

        def step():
            out = call(module, x)
            out.float().square().mean().backward()

        try:
            ms = _cuda_time(step, reps, 3)
            rows.append((name, ms, flops / ms / 1e9))
        except Exception as e:  # noqa: BLE001 (a path that does not run is reported, not fatal)
            rows.append((name, float("nan"), f"{type(e).__name__}: {str(e)[:80]}"))
        torch.cuda.empty_cache()

    # ceiling: the same matmul FLOPs, dense, grouped as the experts would be (k*tokens rows through one FFN)
    w13 = torch.randn(2 * F, d, device=dev, dtype=dt, requires_grad=True)
    w2 = torch.randn(d, F, device=dev, dtype=dt, requires_grad=True)

    def dense(_m, x):
        xx = x.reshape(-1, d).repeat(k, 1)
        g, u = (xx @ w13.t()).chunk(2, -1)
        return (torch.nn.functional.silu(g) * u) @ w2.t()

    run("dense matmuls, same FLOPs (ceiling)", None, dense)
    for drop in (True, False):
        ref = MoEFeedForward(d, F, E, k, capacity_factor=1.25, token_drop=drop).to(dev, dt)
        for p in ref.parameters():
            torch.nn.init.normal_(p, std=0.02)
        ref.train()
        run(f"model/moe.py ({'token drop' if drop else 'dropless'})", ref, lambda m, x: m(x).hidden)

        class Holder(torch.nn.Module):
            def __init__(self, moe):
                super().__init__()
                self.moe = moe

        h = Holder(ref)
        install_deepspeed_moe(h)
        h.train()
        run(f"pretrain/moe.py DeepSpeedMoEFeedForward ({'token drop' if drop else 'dropless'})", h.moe,
            lambda m, x: m(x).hidden)

    class Expert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w13 = torch.nn.Linear(d, 2 * F, bias=False)
            self.w2 = torch.nn.Linear(F, d, bias=False)

        def forward(self, x):
            g, u = self.w13(x).chunk(2, -1)
            return self.w2(torch.nn.functional.silu(g) * u)

    classic = MoE(d, Expert(), num_experts=E, ep_size=1, k=k, capacity_factor=1.25, min_capacity=0,
                  drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False).to(dev, dt)
    classic.set_deepspeed_parallelism()
    classic.train()
    run("deepspeed.moe.layer.MoE classic (einsum dispatch)", classic, lambda m, x: m(x)[0])
    return rows


# --- whole training step ---------------------------------------------------------------------------------------


def _packed_batch(rows: int, T: int, vocab: int, dev, mean_doc: int = 700):
    """Random tokens cut into documents of random length (exponential, mean ``mean_doc``), flattened."""
    g = torch.Generator().manual_seed(rows * T)
    n = rows * T
    cuts = []
    for r in range(rows):
        pos = r * T
        cuts.append(pos)
        while True:
            length = max(8, int(torch.empty(1).exponential_(1 / mean_doc, generator=g).item()))
            if pos + length >= (r + 1) * T:
                break
            pos += length
            cuts.append(pos)
    cuts.append(n)
    cu = torch.tensor(cuts, dtype=torch.int32)
    ids = torch.randint(8, vocab, (1, n), generator=g)
    doc = torch.bucketize(torch.arange(n), cu[1:].long(), right=True)
    pos = torch.arange(n) - cu.long()[doc]
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    return {k: v.to(dev) for k, v in dict(input_ids=ids, labels=labels, cu_seqlens=cu, position_ids=pos[None]).items()}


def hylight_step(size: str, T: int, B: int, compile_: bool):
    """(config, step function) of exactly the stage's step on one GPU: DeepSpeed ZeRO-1 bf16, fused AdamW,
    clip 1.0, DeepSpeed-MoE layers, a packed batch of random documents."""
    import deepspeed

    from model import HybridForCausalLM, config_for
    from pretrain.moe import install_deepspeed_moe
    from pretrain.train import compile_layers, optimizer_groups

    dev = torch.device("cuda")
    cfg = config_for(size, max_position_embeddings=max(8192, T), use_cache=False)
    torch.manual_seed(0)
    with torch.device(dev):  # initialise on the GPU (seconds, not a minute of CPU init)
        model = HybridForCausalLM(cfg)
    install_deepspeed_moe(model)
    opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), fused=True)
    ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "train_batch_size": B,
          "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
          "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    if compile_:
        compile_layers(engine.module)
    batch = _packed_batch(B, T, cfg.vocab_size, dev)

    def step():
        out = engine(**batch, output_router_logits=True)
        engine.backward(out.loss)
        engine.step()

    return cfg, step


def bench_step(shapes: list[tuple[int, int]], steps: int, warmup: int, size: str, compile_: bool) -> list:
    from pretrain.train import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed()
    peak = peak_bf16()
    print(f"measured bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s", flush=True)
    results = []
    for T, B in shapes:
        results += _step_pair(T, B, steps, warmup, size, compile_, peak)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return results


def _step_pair(T: int, B: int, steps: int, warmup: int, size: str, compile_: bool, peak: float) -> list:
    from transformers import MiniMaxForCausalLM

    from model.accounting import flops_per_token
    from model.hf_minimax import to_minimax_config

    dev = torch.device("cuda")
    results = []
    cfg, ours_step = hylight_step(size, T, B, compile_)

    hf_cfg = to_minimax_config(cfg)
    hf_cfg.output_router_logits = False  # the anchor trains without computing the balance loss: its fastest
    with torch.device(dev):
        hf = MiniMaxForCausalLM(hf_cfg).to(torch.bfloat16)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    g = torch.Generator().manual_seed(1)
    hf_ids = torch.randint(8, cfg.vocab_size, (B, T), generator=g).to(dev)

    def hf_step():
        out = hf(input_ids=hf_ids, labels=hf_ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)

    times = {"hylight": [], "transformers MiniMax": []}
    for _round in range(2):  # interleaved: ours, theirs, ours, theirs
        for name, fn in (("hylight", ours_step), ("transformers MiniMax", hf_step)):
            try:
                times[name].append(_cuda_time(fn, steps, warmup))
            except torch.OutOfMemoryError as e:
                times[name].append(float("nan"))
                print(f"{name} T={T} B={B}: out of memory: {str(e)[:100]}", flush=True)
                torch.cuda.empty_cache()
    fpt = flops_per_token(cfg, T).total
    mem = torch.cuda.max_memory_allocated() / 2**30
    for name, ts in times.items():
        ms = min(ts)
        tps = B * T / (ms / 1e3)
        results.append({"T": T, "B": B, "model": name, "ms": ms, "tokens_per_s": tps,
                        "mfu": tps * fpt / peak, "peak_mem_gb": mem})
        print(json.dumps(results[-1]), flush=True)
    return results


def profile_step(out_dir: Path, T: int = 2048, B: int = 8, size: str = "gpu-300m", compile_: bool = False) -> str:
    from torch.profiler import ProfilerActivity, profile

    from pretrain.train import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed()
    _, step = hylight_step(size, T, B, compile_)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 3
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in events) / 3  # kernel time per step (overlaps not merged)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    (out_dir / "profile_T2048.txt").write_text(table)
    summary = (f"step wall {wall * 1e3:.1f} ms; GPU kernel time {gpu_us / 1e3:.1f} ms per step "
               f"({gpu_us / 1e3 / (wall * 1e3):.0%} of the wall time)")
    return summary + "\n" + table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="moe,step,profile")
    ap.add_argument("--shapes", default="2048x8,8192x2,32768x1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--size", default="gpu-300m")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import transformers
    import triton

    report |= {"triton": triton.__version__, "transformers": transformers.__version__}
    try:
        import deepspeed

        report["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    print(json.dumps(report), flush=True)
    lines = []
    if "moe" in sections:
        rows = bench_moe()
        report["moe"] = rows
        lines += ["", "| MoE layer alone (16K tok, d1024, E8, F1536, top-2, bf16, fwd+bwd) | ms | TFLOP/s |",
                  "|---|---|---|"]
        lines += [f"| {n} | {ms:.2f} | {tf if isinstance(tf, str) else f'{tf:.0f}'} |" for n, ms, tf in rows]
    if "step" in sections:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        res = bench_step(shapes, args.steps, args.warmup, args.size, args.compile)
        report["step"] = res
        lines += ["", f"| {args.size} T x B | model | ms/step | tokens/s | MFU | ratio |", "|---|---|---|---|---|---|"]
        by = {(r["T"], r["B"], r["model"]): r for r in res}
        for r in res:
            other = by.get((r["T"], r["B"], "transformers MiniMax"))
            ratio = r["tokens_per_s"] / other["tokens_per_s"] if other and other["tokens_per_s"] else math.nan
            lines.append(f"| {r['T']} x {r['B']} | {r['model']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['mfu']:.1%} | {ratio:.2f}x |")
    if "profile" in sections:
        text = profile_step(out, compile_=args.compile)
        report["profile_summary"] = text.splitlines()[0]
        lines += ["", text]
    (out / "bench_pretrain_gpu.json").write_text(json.dumps(report, indent=2, default=str))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
