"""GPU training-step benchmark of the pretrain stage, side by side with transformers' MiniMaxForCausalLM.

Run on one H100 (the device tool) from the repo root:

    python bench/bench_pretrain_gpu.py --out $OUT            # all sections
    python bench/bench_pretrain_gpu.py --sections moe        # the MoE layer alone

Sections:
  moe      one MoE layer alone (16K tokens, d 1024, 8 experts, FFN 1536, top-2, bf16, fwd+bwd): dense matmuls of the
           same FLOPs (the ceiling), model/moe.py (token drop / dropless), pretrain/moe.py's DeepSpeedMoEFeedForward
           (drop / dropless; with --compile both also compiled), transformers' MiniMaxSparseMoeBlock, DeepSpeed's
           classic deepspeed.moe.layer.MoE (einsum dispatch)
  step     the whole training step (fwd + bwd + optimizer) of `gpu-300m` at each T x B: hylight as the pretrain
           stage runs it (DeepSpeed engine, ZeRO-1, bf16, fused torch AdamW, packed documents with cu_seqlens),
           the library's step (HybridForCausalLM with model/moe.py, no DeepSpeed: what post-training trains with)
           and transformers' MiniMaxForCausalLM built from the same config (bf16, fused torch AdamW, [B, T] rows),
           interleaved in one process; tokens/s and MFU (FLOPs from model/accounting.py, peak from a measured
           bf16 matmul)
  ceiling  the step's FLOPs at the speed of its kernels alone (plain matmuls, attention kernels; no routing, optimizer
           or launch gaps): the attainable MFU bound at each T x B
  profile  torch.profiler of hylight's step at T=2048: GPU time by kernel, GPU busy fraction
  accum    the stage's compiled step with --accum micro-batches of the first --shapes entry a step, with and
           without moving the CUDA-graph-written gradients out between micro-batches (issue 34 item 2)

Prints a table per section at the end; JSON and the profile table go to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


ZERO_STAGE = 1  # --zero
DOC_LEN = 0  # --doc-len: mean document length of hylight's packed rows (0: one document per row)
COMPILE_MODE = "auto"  # --compile-mode: "auto" = what the stage picks (pretrain.train.compile_mode)
COMPILE_MOE = False  # --compile: the moe section also times the compiled layers


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


class _Holder(torch.nn.Module):
    """A module whose ``moe`` child install_deepspeed_moe swaps for the DeepSpeed layer."""

    def __init__(self, moe: torch.nn.Module) -> None:
        super().__init__()
        self.moe = moe


class _Expert(torch.nn.Module):
    """One SwiGLU expert (d -> 2F -> d) for DeepSpeed's classic MoE layer."""

    def __init__(self, d: int, F: int) -> None:
        super().__init__()
        self.w13 = torch.nn.Linear(d, 2 * F, bias=False)
        self.w2 = torch.nn.Linear(F, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.w13(x).chunk(2, -1)
        return self.w2(torch.nn.functional.silu(g) * u)


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

        ref32 = copy.deepcopy(ref).float()
        h = _Holder(ref)
        install_deepspeed_moe(h)
        h.train()
        if not drop:  # correctness on this GPU: bf16 DeepSpeed layer against model/moe.py in fp32, same weights
            x, xr = x0.clone().requires_grad_(), x0.float().clone().requires_grad_()
            y = h.moe(x).hidden
            y.float().square().mean().backward()
            yr = ref32(xr).hidden
            yr.square().mean().backward()
            check = {"moe_check": "DeepSpeedMoEFeedForward (bf16) vs model/moe.py (fp32), dropless",
                     "rel_err_out": float((y.float() - yr).norm() / yr.norm()),
                     "rel_err_x_grad": float((x.grad.float() - xr.grad).norm() / xr.grad.norm())}
            print(json.dumps(check), flush=True)
            del ref32, x, xr, y, yr
        run(f"pretrain/moe.py DeepSpeedMoEFeedForward ({'token drop' if drop else 'dropless'})", h.moe,
            lambda m, x: m(x).hidden)

    if COMPILE_MOE:  # as the stage runs its MoE layers (pretrain.train.compile_layers), library and stage alike
        for drop in (True, False):
            lib = MoEFeedForward(d, F, E, k, capacity_factor=1.25, token_drop=drop).to(dev, dt)
            for p in lib.parameters():
                torch.nn.init.normal_(p, std=0.02)
            lib.train()
            holder = _Holder(copy.deepcopy(lib))
            install_deepspeed_moe(holder)
            holder.train()
            tag = "token drop" if drop else "dropless"
            for name, module in ((f"model/moe.py, compiled ({tag})", lib),
                                 (f"pretrain/moe.py DeepSpeedMoEFeedForward, compiled ({tag})", holder.moe)):
                module.compile(dynamic=False)
                run(name, module, lambda m, x: m(x).hidden)

    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxSparseMoeBlock

    hf_cfg = MiniMaxConfig(hidden_size=d, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k,
                           router_jitter_noise=0.0)
    hf_cfg._experts_implementation = "grouped_mm"  # what MiniMaxForCausalLM picks (a lone block gets none)
    hf_block = MiniMaxSparseMoeBlock(hf_cfg).to(dev, dt)
    for p in hf_block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hf_block.train()
    run("transformers MiniMaxSparseMoeBlock (dropless, grouped_mm)", hf_block, lambda m, x: m(x))

    classic = MoE(d, _Expert(d, F), num_experts=E, ep_size=1, k=k, capacity_factor=1.25, min_capacity=0,
                  drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False).to(dev, dt)
    classic.set_deepspeed_parallelism()
    classic.train()
    run("deepspeed.moe.layer.MoE classic (einsum dispatch)", classic, lambda m, x: m(x)[0])
    return rows


# --- whole training step ---------------------------------------------------------------------------------------


def _packed_batch(rows: int, T: int, vocab: int, dev, mean_doc: int | None = None):
    """Random tokens cut into documents of random length (exponential, mean ``mean_doc``; default ``DOC_LEN``;
    0: one document per row, the anchor's work), flattened."""
    mean_doc = DOC_LEN if mean_doc is None else mean_doc
    g = torch.Generator().manual_seed(rows * T)
    n = rows * T
    cuts = []
    for r in range(rows):
        pos = r * T
        cuts.append(pos)
        while mean_doc > 0:
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
    # cu_seqlens stays on the host, as the stage passes it (the model reads the bounds without a device sync)
    return {"cu_seqlens": cu} | {k: v.to(dev) for k, v in dict(input_ids=ids, labels=labels,
                                                                position_ids=pos[None]).items()}


def hylight_step(size: str, T: int, B: int, compile_: bool, zero: int = 1, accum: int = 1, release: bool = True):
    """(config, step function) of exactly the stage's step on one GPU: DeepSpeed ZeRO-1 bf16, fused AdamW,
    clip 1.0, DeepSpeed-MoE layers, a packed batch of random documents; ``accum`` micro-batches a step, the
    graph-written gradients moved out of the CUDA graphs' memory between them as the trainer does (``release``;
    False: as the code before issue 34's fix)."""
    import deepspeed

    from model import HybridForCausalLM, config_for
    from model.accounting import packed_flops
    from pretrain.loss import install_loss
    from pretrain.moe import install_deepspeed_moe
    from pretrain.train import (
        TrainConfig,
        compile_layers,
        compile_mode,
        deepspeed_config,
        install_foreach_grad_norm,
        optimizer_groups,
    )
    from pretrain.trainer import release_graph_grads

    dev = torch.device("cuda")
    cfg = config_for(size, max_position_embeddings=max(8192, T), use_cache=False)
    torch.manual_seed(0)
    with torch.device(dev):  # initialise on the GPU (seconds, not a minute of CPU init)
        model = HybridForCausalLM(cfg)
    install_deepspeed_moe(model)
    opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), fused=True)
    tc = TrainConfig(data_dir="", tokenizer_dir="", resume_dir="", export_dir="", size=size, seq_len=T,
                     micro_batch_rows=B, batch_rows=B * accum, zero_stage=zero, compile=compile_)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(tc, 1, dev))
    # the stage's gradient norm; its divergence guard (one host read of that norm per step, as DeepSpeed's clipping
    # does anyway) is left out so that a random batch judged a spike cannot skip an optimizer step of the benchmark
    install_foreach_grad_norm(engine.optimizer)
    install_loss(engine.module, compile_)
    graph_params = []
    if compile_:
        graph_params = compile_layers(engine.module,
                                      mode=COMPILE_MODE if COMPILE_MODE != "auto" else compile_mode(tc, dev))
    batch = _packed_batch(B, T, cfg.vocab_size, dev)
    flops = packed_flops(cfg, batch["cu_seqlens"].diff().tolist()) * accum

    def step():
        for i in range(accum):
            out = engine(**batch, output_router_logits=True)
            engine.backward(out.loss)
            engine.step()
            if i + 1 < accum and release:
                release_graph_grads(graph_params)
        return out.loss.detach()

    return cfg, step, flops


def library_step(size: str, T: int, B: int, compile_: bool):
    """(step function, FLOPs) of the library's training step, what post-training and a user importing ``model/``
    train with: ``HybridForCausalLM`` with ``model/moe.py``'s MoE (token drop), bf16 weights, fused torch AdamW,
    clip 1.0, no DeepSpeed, the model's own loss; the same packed batch as the stage's step. With ``compile_`` the
    same modules the stage compiles (RMSNorms, MoE layers), in the stage's mode."""
    from model import HybridForCausalLM, config_for
    from model.accounting import packed_flops
    from model.modeling import RMSNorm
    from model.moe import MoEFeedForward
    from pretrain.train import optimizer_groups

    dev = torch.device("cuda")
    cfg = config_for(size, max_position_embeddings=max(8192, T), use_cache=False)
    torch.manual_seed(0)
    with torch.device(dev):
        model = HybridForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), fused=True)
    if compile_:
        mode = COMPILE_MODE if COMPILE_MODE != "auto" else "reduce-overhead"  # the stage's pick on one GPU
        for module in model.modules():
            if isinstance(module, RMSNorm | MoEFeedForward):
                module.compile(dynamic=False, mode=mode)
    batch = _packed_batch(B, T, cfg.vocab_size, dev)
    flops = packed_flops(cfg, batch["cu_seqlens"].diff().tolist())

    def step():
        out = model(**batch, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    return step, flops


def accum_check(size: str, T: int, B: int, accum: int, steps: int) -> list[dict]:
    """Issue 34 item 2: the stage's compiled step with ``accum`` micro-batches of B x T a step, with and without
    the trainer's move of graph-written gradients out of the CUDA graphs' memory (``release_graph_grads``). Each
    row: the losses of ``steps`` steps, ms per step after the first, or the error that stopped it."""
    from pretrain.train import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed()
    rows = []
    for release in (True, False):
        row: dict = {"T": T, "B": B, "accum": accum, "release": release}
        try:
            _, step, _ = hylight_step(size, T, B, True, ZERO_STAGE, accum, release)
            losses, times = [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                losses.append(float(step()))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            row |= {"losses": [round(x, 4) for x in losses],
                    "ms": round(1e3 * statistics.median(times[1:] or times), 1),
                    "tokens_per_s": round(T * B * accum / statistics.median(times[1:] or times))}
        except RuntimeError as e:
            row["error"] = str(e).splitlines()[0][:200]
        print(json.dumps(row), flush=True)
        rows.append(row)
        step = None
        torch.cuda.empty_cache()
    return rows


def mode_check(size: str, T: int = 2048, B: int = 8, steps: int = 4) -> dict:
    """The same model, batch and seed trained a few steps with each torch.compile mode of the compiled modules:
    the losses must agree (bf16, atomics in the MoE combine: not bit-equal)."""
    global COMPILE_MODE
    from pretrain.train import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed()
    saved, losses = COMPILE_MODE, {}
    for mode in ("default", "reduce-overhead"):
        COMPILE_MODE = mode
        _, step, _ = hylight_step(size, T, B, True, ZERO_STAGE)
        losses[mode] = [float(step()) for _ in range(steps)]
        del step
        torch.cuda.empty_cache()
    COMPILE_MODE = saved
    diff = max(abs(a - b) for a, b in zip(*losses.values(), strict=True))
    print(json.dumps({"mode_check": losses, "max_abs_diff": diff}), flush=True)
    return {"losses": losses, "max_abs_diff": diff}


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
    cfg, ours_step, ours_flops = hylight_step(size, T, B, compile_, ZERO_STAGE)

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

    lib_step, lib_flops = library_step(size, T, B, compile_)
    lib_name = "hylight library (model/, no DeepSpeed)"
    times = {"hylight": [], lib_name: [], "transformers MiniMax": []}
    for _round in range(2):  # interleaved: ours, the library's, theirs, ours, ...
        for name, fn in (("hylight", ours_step), (lib_name, lib_step), ("transformers MiniMax", hf_step)):
            try:
                times[name].append(_cuda_time(fn, steps, warmup))
            except torch.OutOfMemoryError as e:
                times[name].append(float("nan"))
                print(f"{name} T={T} B={B}: out of memory: {str(e)[:100]}", flush=True)
                torch.cuda.empty_cache()
    # FLOPs of each model's own batch: MiniMax's [B, T] rows are one causal sequence each; hylight's packed rows
    # count softmax attention within their documents (model.accounting.packed_flops; equal with --doc-len 0)
    step_flops = {"hylight": ours_flops, lib_name: lib_flops, "transformers MiniMax": B * T * flops_per_token(cfg, T).total}
    mem = torch.cuda.max_memory_allocated() / 2**30
    for name, ts in times.items():
        ms = min(ts)
        tps = B * T / (ms / 1e3)
        results.append({"T": T, "B": B, "model": name, "doc_len": 0 if name == "transformers MiniMax" else DOC_LEN, "ms": ms,
                        "tokens_per_s": tps, "mfu": step_flops[name] / (ms / 1e3) / peak, "peak_mem_gb": mem})
        print(json.dumps(results[-1]), flush=True)
    return results


# --- the attainable ceiling ------------------------------------------------------------------------------------


def _attention_ms(cfg, T: int, B: int) -> tuple[float, float]:
    """ms of one lightning and one document-softmax attention call, fwd+bwd, on a packed batch of B x T tokens."""
    from kernels.lightning import lightning_attention, lightning_decay_rates
    from kernels.softmax_varlen import document_causal_attention

    dev, dt = torch.device("cuda"), torch.bfloat16
    n, H, D, hkv = B * T, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    cu = _packed_batch(B, T, cfg.vocab_size, dev)["cu_seqlens"].to(dev)
    q, k, v = (torch.randn(1, H, n, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    ks, vs = (torch.randn(1, hkv, n, D, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
    go = torch.randn(1, H, n, D, device=dev, dtype=dt)
    rates = lightning_decay_rates(H, 1, cfg.num_hidden_layers, device=dev)

    def lightning():
        o, _ = lightning_attention(q, k, v, rates, block_size=cfg.lightning_block_size, cu_seqlens=cu)
        o.backward(go)

    def softmax():
        document_causal_attention(q, ks, vs, cu, enable_gqa=hkv != H).backward(go)

    return _cuda_time(lightning, 10, 3), _cuda_time(softmax, 10, 3)


def bench_ceiling(shapes: list[tuple[int, int]], size: str, peak: float) -> list:
    """The step's FLOPs at the speed of its kernels run alone, back to back: every matmul of the step as a plain bf16
    ``torch.mm`` (forward, input-gradient and weight-gradient products), the MoE experts as dense matmuls over the
    k x N routed rows (perfect balance, no routing), the lightning and document-softmax attention kernels fwd+bwd
    on the packed batch. No optimizer, routing, norms, elementwise work or launches between kernels: an upper
    bound on the MFU of any implementation of this model at this shape on this GPU (FLOPs from
    model/accounting.py, as the step rows)."""
    from model import config_for
    from model.accounting import packed_flops

    dev, dt = torch.device("cuda"), torch.bfloat16
    cache: dict[tuple[int, int, int], float] = {}

    def mm(m: int, k: int, n: int) -> float:
        if (m, k, n) not in cache:
            x, w, g = (torch.randn(a, b, device=dev, dtype=dt) for a, b in ((m, k), (k, n), (m, n)))
            cache[(m, k, n)] = _cuda_time(lambda: (x @ w, g @ w.T, x.T @ g), 10, 3)
        return cache[(m, k, n)]

    rows = []
    for T, B in shapes:
        cfg = config_for(size, max_position_embeddings=max(8192, T))
        n, d, H, D = B * T, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        hkv, F, k, V = cfg.num_key_value_heads, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.vocab_size
        nl, ns = len(cfg.lightning_layers), len(cfg.softmax_layers)
        t_mm = (nl * (mm(n, d, 3 * H * D) + mm(n, d, H * D) + mm(n, H * D, d))
                + ns * (mm(n, d, H * D) + 2 * mm(n, d, hkv * D) + mm(n, H * D, d))
                + (nl + ns) * (mm(k * n, d, 2 * F) + mm(k * n, F, d)) + mm(n, d, V))
        t_lightning, t_softmax = _attention_ms(cfg, T, B)
        t_attn = nl * t_lightning + ns * t_softmax
        ms = t_mm + t_attn
        tps = n / (ms / 1e3)
        rows.append({"T": T, "B": B, "matmul_ms": t_mm, "attention_ms": t_attn, "ms": ms, "tokens_per_s": tps,
                     "mfu": packed_flops(cfg, _packed_batch(B, T, V, "cpu")["cu_seqlens"].diff().tolist())
                     / (ms / 1e3) / peak})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def profile_step(out_dir: Path, T: int = 2048, B: int = 8, size: str = "gpu-300m", compile_: bool = False) -> str:
    from torch.profiler import ProfilerActivity, profile

    from pretrain.train import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed()
    _, step, _ = hylight_step(size, T, B, compile_, ZERO_STAGE)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 record_shapes=True) as prof:
        t = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 3
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in events) / 3  # kernel time per step (overlaps not merged)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    launches = sum(1 for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC")) / 3
    syncs = sum(1 for e in prof.events() if "Synchronize" in e.name or e.name == "cudaMemcpyAsync") / 3
    # where the host time goes: self CPU time by op, and by Python call site (5 frames)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    stack_table = prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=25,
                                                              max_name_column_width=60, max_src_column_width=140)
    # where the GPU time goes by Python call site, and the shapes of the largest GPU ops (copies, norms)
    gpu_stack = prof.key_averages(group_by_stack_n=8).table(sort_by="self_cuda_time_total", row_limit=40,
                                                            max_name_column_width=60, max_src_column_width=160)
    gpu_shapes = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=40,
                                                                    max_name_column_width=50,
                                                                    max_shapes_column_width=120)
    (out_dir / "profile_T2048.txt").write_text(table + "\n\nCPU\n" + cpu_table + "\n\nBY STACK\n" + stack_table
                                               + "\n\nGPU BY STACK\n" + gpu_stack + "\n\nGPU BY SHAPE\n" + gpu_shapes)
    summary = (f"step wall {wall * 1e3:.1f} ms; GPU kernel time {gpu_us / 1e3:.1f} ms per step "
               f"({gpu_us / 1e3 / (wall * 1e3):.0%} of the wall time); {launches:.0f} kernel launches and "
               f"{syncs:.0f} sync/memcpy calls per step")
    return summary + "\n" + table + "\n\nCPU\n" + cpu_table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="moe,step,profile")
    ap.add_argument("--shapes", default="2048x8,8192x2,32768x1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--size", default="gpu-300m")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--doc-len", type=int, default=0,
                    help="mean document length of hylight's packed rows (0: one document per row, as the anchor)")
    ap.add_argument("--compile-mode", default="auto",
                    help="torch.compile mode of the compiled modules (auto: the stage's choice)")
    ap.add_argument("--accum", type=int, default=2,
                    help="accum section: micro-batches a step (the first --shapes entry is the micro-batch)")
    ap.add_argument("--zero", type=int, default=1, help="DeepSpeed ZeRO stage of hylight's engine (the stage uses 1|2)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    global ZERO_STAGE, DOC_LEN, COMPILE_MODE, COMPILE_MOE
    ZERO_STAGE, DOC_LEN, COMPILE_MODE, COMPILE_MOE = args.zero, args.doc_len, args.compile_mode, args.compile
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
        lines += ["", f"| {args.size} T x B (hylight doc-len {DOC_LEN or 'T'}) | model | ms/step | tokens/s | MFU | ratio |", "|---|---|---|---|---|---|"]
        by = {(r["T"], r["B"], r["model"]): r for r in res}
        for r in res:
            other = by.get((r["T"], r["B"], "transformers MiniMax"))
            ratio = r["tokens_per_s"] / other["tokens_per_s"] if other and other["tokens_per_s"] else math.nan
            lines.append(f"| {r['T']} x {r['B']} | {r['model']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['mfu']:.1%} | {ratio:.2f}x |")
    if "accum" in sections:
        T, B = (int(v) for v in args.shapes.split(",")[0].split("x"))
        report["accum_check"] = rows = accum_check(args.size, T, B, args.accum, args.steps)
        lines += ["", f"| {args.size} compiled, {args.accum} micro-batches of {T} x {B} | release | losses | ms/step "
                  "| tokens/s |", "|---|---|---|---|---|"]
        lines += [f"| {T} x {B} x {r['accum']} | {r['release']} | {r.get('losses', r.get('error'))} | "
                  f"{r.get('ms', '')} | {r.get('tokens_per_s', '')} |" for r in rows]
    if "modecheck" in sections:
        report["mode_check"] = mode_check(args.size)
        lines += ["", f"compile modes, losses of 4 steps: {report['mode_check']}"]
    if "ceiling" in sections:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        rows = bench_ceiling(shapes, args.size, peak_bf16())
        report["ceiling"] = rows
        lines += ["", f"| {args.size} T x B: kernels alone (ceiling) | matmul ms | attention ms | ms | tokens/s | MFU |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['T']} x {r['B']} | {r['matmul_ms']:.1f} | {r['attention_ms']:.1f} | {r['ms']:.1f} | "
                  f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} |" for r in rows]
    if "profile" in sections:
        text = profile_step(out, compile_=args.compile)
        report["profile_summary"] = text.splitlines()[0]
        lines += ["", text]
    (out / "bench_pretrain_gpu.json").write_text(json.dumps(report, indent=2, default=str))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
