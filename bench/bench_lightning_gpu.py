"""Triton lightning attention on one GPU: correctness, speed against fla and softmax attention, decode.

Issue 5's measurements in one script, each a task (``--tasks``, comma-separated):
  meta      versions, GPU, clocks
  ceilings  device-to-device copy bandwidth (bytes read + written): the byte floor's denominator
  correct   bf16/fp16/fp32 at realistic sizes vs the float64 PyTorch chunk form: ‖x−ref‖/‖ref‖ of
            o, final state, dq, dk, dv, dS0 (dense, split into segments, varlen, d=64), fla alongside
  tune      kernel configs side by side (KernelConfig variants) at a few N, with registers/spills
  profile   Nsight Compute on this script's --profile-run (our kernels at N=8K and 128K)
  breakdown GPU time per kernel (torch.profiler) of ours, fwd and fwd+bwd, at the tune lengths
  main      fwd and fwd+bwd, bf16, H=16, d=128, B·N = 128K tokens, N = 512 .. 128K:
            ours, fla chunk_simple_gla (g_gamma = −s, scale 1), torch SDPA cuDNN and flash;
            Mtok/s, speedup over fla, fraction of the byte floor, crossover with cuDNN
  layout    ours on [B, T, H, d] memory (the model's and fla's layout) through a transposed view
  decode    one-token step: ours vs the PyTorch step vs SDPA over a KV cache, B = 1..64, context 1K..128K

Timing: triton.testing.do_bench median (L2 flushed before each run), after an untimed call that
compiles; calls of 30 ms or more: median of 3 CUDA-event runs. Decode steps are captured in a CUDA
graph (64 chained steps) and the replay is timed. Byte floor: fwd moves q, k, v, o (4 tensors),
fwd+bwd 11 (q, k, v, o; q, k, v, dO; dq, dk, dv); "BW frac" = floor bytes / time / copy bandwidth.

    python bench/bench_lightning_gpu.py                       # on the GPU: all tasks but tune/profile
    python bench/bench_lightning_gpu.py --tasks correct,tune  # a subset
    python bench/bench_lightning_gpu.py --smoke               # tiny sizes; on CPU under TRITON_INTERPRET=1

Writes OUT/results.json and OUT/tables.md (OUT = $OUT, else --out) and prints the tables last.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import glob
import io
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import zlib

ALL_TASKS = ["meta", "ceilings", "correct", "tune", "profile", "breakdown", "main", "layout", "decode"]
DEFAULT_TASKS = ["meta", "ceilings", "correct", "main", "layout", "decode"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help=f"comma-separated, of {ALL_TASKS}")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: sets TRITON_INTERPRET=1)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds; later measurements are skipped")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else /tmp/bench_lightning)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="N values of the main task")
    p.add_argument("--tune-lengths", type=int, nargs="+", default=[2048, 16384, 131072])
    p.add_argument("--variants", default="all", help="tune: comma-separated variant names, or all")
    p.add_argument(
        "--rate-layers",
        type=int,
        nargs="+",
        default=[0],
        help="decay rates of these layers (of 32) in tune/breakdown; main uses the first (0: fastest decay)",
    )
    p.add_argument("--no-fla", action="store_true", help="skip fla even if importable")
    p.add_argument(
        "--ops", default="all", help="main: comma-separated op names (ours, fla_chunk_simple_gla, ...)"
    )
    p.add_argument(
        "--config", default="", help="KernelConfig overrides for 'ours', e.g. fwd_block_v=64,fwd_warps=4"
    )
    p.add_argument("--profile-run", action="store_true", help="internal: the workload ncu profiles")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    import torch as _t

    if not _t.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.lightning import lightning_attn_chunk, lightning_attn_decode, lightning_decay_rates  # noqa: E402
from kernels.lightning import triton_chunk as tc  # noqa: E402
from kernels.lightning.triton_chunk import KernelConfig, lightning_attn_triton  # noqa: E402
from kernels.lightning.triton_decode import lightning_attn_triton_decode  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BF16 = torch.bfloat16 if CUDA else torch.float16  # interpreter: bf16 arithmetic is wrong there
T0 = time.time()
OUT = ARGS.out or os.environ.get("OUT") or "/tmp/bench_lightning"
os.makedirs(OUT, exist_ok=True)
RES: dict = {
    "meta": {},
    "ceilings": {},
    "correctness": [],
    "tune": [],
    "profile": [],
    "timings": [],
    "decode": [],
    "errors": [],
    "skipped": [],
}

if ARGS.smoke:
    H, D, TOTAL = 2, 32, 256
    MAIN_N = ARGS.lengths or [64, 128]
    TUNE_N = [64, 256]
    DECODE_B, DECODE_CTX = [1, 2], [64, 128]
else:
    H, D, TOTAL = 16, 128, 128 * 1024
    MAIN_N = ARGS.lengths or [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    TUNE_N = ARGS.tune_lengths
    DECODE_B, DECODE_CTX = [1, 2, 4, 8, 16, 32, 64], [1024, 8192, 32768, 131072]

VARIANTS = {
    "default": KernelConfig(),
    "s3": KernelConfig(stages=3),
    "s1": KernelConfig(stages=1),
    "bv32": KernelConfig(block_v=32),
    "bv128_w8": KernelConfig(block_v=128, warps=8),
    "mask_loop": KernelConfig(mask_in_loop=True),
    "pps4": KernelConfig(programs_per_sm=4.0),
    "fuse": KernelConfig(fuse_dq_state=True),
    "fuse_dq32": KernelConfig(fuse_dq_state=True, dq_block_v=32),
    "state_bv32": KernelConfig(state_block_v=32),
    "state_bv128_w8": KernelConfig(state_block_v=128, state_warps=8),
    "fuse_dq32_state_bv32": KernelConfig(fuse_dq_state=True, dq_block_v=32, state_block_v=32),
    "state_recurrent": KernelConfig(state_direct_weights=False),
    "state_split1": KernelConfig(state_split=1),
    "state_nohorizon": KernelConfig(state_horizon_bits=None),
    "state_min4": KernelConfig(state_min_part_chunks=4),
    "state_min16": KernelConfig(state_min_part_chunks=16),
}


def log(*a) -> None:
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    with open(os.path.join(OUT, "log.txt"), "a") as f:
        f.write(s + "\n")


def save() -> None:
    tmp = os.path.join(OUT, "results.json.tmp")
    with open(tmp, "w") as f:
        json.dump(RES, f, indent=1, default=str)
    os.replace(tmp, os.path.join(OUT, "results.json"))


def elapsed() -> float:
    return time.time() - T0


def over_budget(what: str) -> bool:
    if elapsed() > ARGS.budget:
        RES["skipped"].append(f"{what}: over budget")
        return True
    return False


def rates_for(heads: int, layer: int | None = None) -> torch.Tensor:
    """Decay rates of one layer of 32 (default the first of --rate-layers; layer 0 decays fastest, as
    the anchors' MiniMax slopes). Only the segment state passes' reads depend on them (their horizon:
    tokens weighing < 2^-40 are skipped), so at long N with few heads the time does too."""
    return lightning_decay_rates(heads, ARGS.rate_layers[0] if layer is None else layer, 32, device=DEV)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def bench(fn, grads=()) -> tuple[float, str]:
    """Median ms of fn after one untimed call (compiles/autotunes)."""
    fn()
    sync()
    if not CUDA:
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts), "perf_counter_median_of_3"
    for x in grads:
        x.grad = None
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    fn()
    en.record()
    torch.cuda.synchronize()
    if st.elapsed_time(en) < 30.0:
        ms = triton.testing.do_bench(
            fn, warmup=25, rep=100, grad_to_none=list(grads) or None, return_mode="median"
        )
        return ms, "do_bench_median"
    ts = []
    for _ in range(3):
        for x in grads:
            x.grad = None
        st.record()
        fn()
        en.record()
        torch.cuda.synchronize()
        ts.append(st.elapsed_time(en))
    return statistics.median(ts), "events_median_of_3"


# ---- ops -----------------------------------------------------------------------------------------

FLA_ERR = None
try:
    if ARGS.no_fla or not CUDA:
        raise ImportError("disabled (--no-fla or no CUDA)")
    import fla  # noqa: F401
    from fla.ops.simple_gla import chunk_simple_gla
except Exception as err:  # noqa: BLE001
    chunk_simple_gla = None
    FLA_ERR = repr(err)[:300]


def ours_op(cfg: KernelConfig, layout: str = "bhnd"):
    def fn(q, k, v, rates):
        if layout == "bnhd":  # [B, N, H, d] memory seen as [B, H, N, d]
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        o, _ = lightning_attn_triton(q, k, v, rates, 64, config=cfg)
        return o

    return fn


def fla_op(q, k, v, rates):
    o, _ = chunk_simple_gla(q, k, v, g_gamma=-rates, scale=1.0)
    return o


def sdpa_op(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "math": SDPBackend.MATH,
    }

    def fn(q, k, v, rates):
        with sdpa_kernel([chosen[backend]]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return fn


def config_from_args() -> KernelConfig:
    fields = {f.name: f.type for f in dataclasses.fields(KernelConfig)}
    overrides = {}
    for item in filter(None, ARGS.config.split(",") if ARGS.config != "auto" else []):
        key, value = item.split("=")
        kind = fields[key]
        overrides[key] = None if value == "None" else (float if "float" in kind else int)(value)
        if "bool" in kind:
            overrides[key] = bool(int(value))
    return dataclasses.replace(KernelConfig(), **overrides)


OURS_CONFIG = config_from_args()


def ops() -> dict:
    table = {"ours": (ours_op(OURS_CONFIG), "bhnd", "linear")}
    if chunk_simple_gla is not None:
        table["fla_chunk_simple_gla"] = (fla_op, "bnhd", "linear")
    if CUDA:
        table["sdpa_cudnn"] = (sdpa_op("cudnn"), "bhnd", "softmax")
        table["sdpa_flash"] = (sdpa_op("flash"), "bhnd", "softmax")
    else:
        table["sdpa_math"] = (sdpa_op("math"), "bhnd", "softmax")
    if ARGS.ops != "all":
        table = {name: op for name, op in table.items() if name in ARGS.ops.split(",")}
    return table


def inputs(batch, n, heads, d, layout, requires_grad, seed, dtype=None):
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    shape = (batch, heads, n, d) if layout == "bhnd" else (batch, n, heads, d)
    xs = [torch.randn(shape, device=DEV, dtype=dtype or BF16, generator=g) for _ in range(3)]
    for x in xs:
        x.requires_grad_(requires_grad)
    return xs


def floor_bytes(batch, n, heads, d, elem=2):
    one = batch * n * heads * d * elem
    return 4 * one, 11 * one


def _time_fwd(fn, batch, n, heads, d, layout, rates):
    q, k, v = inputs(batch, n, heads, d, layout, False, seed=n + 1)
    with torch.no_grad():
        return bench(lambda: fn(q, k, v, rates))


def _time_fwd_bwd(fn, batch, n, heads, d, layout, rates):
    q, k, v = inputs(batch, n, heads, d, layout, True, seed=n + 2)
    with torch.no_grad():
        do = torch.randn_like(fn(q, k, v, rates))  # in the op's own output layout

    def fwd_bwd():
        fn(q, k, v, rates).backward(do)

    return bench(fwd_bwd, grads=(q, k, v))


def measure(name, fn, layout, family, n, heads=None, d=None, tag="", cfg_name=None, layer=None):
    heads, d = heads or H, d or D
    batch = TOTAL // n
    layer = ARGS.rate_layers[0] if layer is None else layer
    rec = dict(op=name, family=family, N=n, B=batch, H=heads, d=d, tag=tag, config=cfg_name, rate_layer=layer)
    if over_budget(f"{name} N={n} {tag}"):
        return None
    rates = rates_for(heads, layer)
    try:
        rec["fwd_ms"], rec["fwd_mode"] = _time_fwd(fn, batch, n, heads, d, layout, rates)
        if CUDA:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        rec["fwdbwd_ms"], rec["fwdbwd_mode"] = _time_fwd_bwd(fn, batch, n, heads, d, layout, rates)
        if CUDA:
            rec["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
    except Exception as err:  # noqa: BLE001
        rec["error"] = repr(err)[:400]
        RES["errors"].append(f"{name} N={n} {tag}: {traceback.format_exc()[-2000:]}")
    if CUDA:
        torch.cuda.empty_cache()
    fb_f, fb_fb = floor_bytes(batch, n, heads, d)
    bw = RES["ceilings"].get("copy_GBps")
    for key, nbytes in (("fwd", fb_f), ("fwdbwd", fb_fb)):
        ms = rec.get(f"{key}_ms")
        if ms:
            rec[f"{key}_Mtok_s"] = batch * n / (ms * 1e-3) / 1e6
            if family == "linear" and bw:
                rec[f"{key}_bw_frac"] = nbytes / (ms * 1e-3) / 1e9 / bw
    log(
        f"[{elapsed():6.1f}s] {name:24s} {tag:10s} N={n:6d} B={batch:3d} fwd {rec.get('fwd_ms', float('nan')):8.3f} ms"
        f"  fwd+bwd {rec.get('fwdbwd_ms', float('nan')):8.3f} ms {rec.get('error', '')[:120]}"
    )
    return rec


# ---- tasks ---------------------------------------------------------------------------------------


def t_meta():
    m = RES["meta"]
    m["date_utc"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    m["python"] = sys.version.split()[0]
    m["torch"] = torch.__version__
    m["triton"] = triton.__version__
    m["cuda"] = torch.version.cuda
    m["fla_import_error"] = FLA_ERR
    m["command"] = " ".join(sys.argv)
    m["ours_config"] = str(OURS_CONFIG)
    if chunk_simple_gla is not None:
        import importlib.metadata as md

        m["fla_core"] = md.version("fla-core")
    if CUDA:
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, sms=p.multi_processor_count, cudnn=torch.backends.cudnn.version())
        try:
            m["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit",
                    "--format=csv",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except Exception as err:  # noqa: BLE001
            m["nvidia_smi"] = repr(err)
    log(json.dumps(m, indent=1))


def _time_copy(n_bytes: int) -> float:
    src = torch.randn(n_bytes // 2, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src))[0]


def t_ceilings():
    c = RES["ceilings"]
    n_bytes = (2 * 2**30) if CUDA else 2**22
    ms = _time_copy(n_bytes)
    c.update(copy_bytes_moved=2 * n_bytes, copy_ms=ms, copy_GBps=2 * n_bytes / (ms * 1e-3) / 1e9)
    log("ceilings", json.dumps(c))


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def check_case(name, batch, heads, length, d, dtype, with_state, lengths=None, cfg=None, with_fla=False):
    """Relative errors of ours (and fla) vs the float64 chunk form on the same rounded inputs."""
    if over_budget(f"correct {name}"):
        return
    rec = dict(
        case=name, B=batch, H=heads, T=length, d=d, dtype=str(dtype).replace("torch.", ""), lengths=lengths
    )
    try:
        g = torch.Generator(device=DEV)
        g.manual_seed(zlib.crc32(name.encode()))
        q, k, v = (
            F.silu(torch.randn(batch, heads, length, d, device=DEV, generator=g)).to(dtype) for _ in range(3)
        )
        s = lightning_decay_rates(heads, 3, 8, device=DEV, dtype=torch.float64)
        cu = None
        rows = batch
        if lengths is not None:
            cu = torch.tensor([0, *itertools.accumulate(lengths)], device=DEV, dtype=torch.int32)
            rows = len(lengths)
        s0 = F.silu(torch.randn(rows, heads, d, d, device=DEV, generator=g)) if with_state else None
        go = torch.randn(batch, heads, length, d, device=DEV, generator=g, dtype=torch.float64)
        gf = torch.randn(rows, heads, d, d, device=DEV, generator=g, dtype=torch.float64)

        def run(fn, cast):
            ins = [x.detach().to(cast).requires_grad_(True) for x in (q, k, v)]
            st = (
                s0.detach().to(torch.float64 if cast == torch.float64 else torch.float32)
                if with_state
                else None
            )
            if st is not None:
                st.requires_grad_(True)
            o, final = fn(*ins, st)
            ((o.double() * go).sum() + (final.double() * gf).sum()).backward()
            out = dict(o=o.detach(), final=final.detach(), dq=ins[0].grad, dk=ins[1].grad, dv=ins[2].grad)
            if st is not None:
                out["ds0"] = st.grad
            return out

        ref = run(lambda a, b, c, st: lightning_attn_chunk(a, b, c, s, 256, st, True, cu), torch.float64)
        cfg = cfg or OURS_CONFIG
        t = time.time()
        ours = run(lambda a, b, c, st: lightning_attn_triton(a, b, c, s, 64, st, True, cu, config=cfg), dtype)
        rec["ours_s"] = time.time() - t
        rec["ours"] = {key: _rel(ours[key], ref[key]) for key in ref}
        seqs = None if lengths is None else list(itertools.pairwise(cu.tolist()))
        plan = tc.make_plan(batch, length, seqs, heads, d, cfg.chunk_for(64), torch.device(DEV), cfg)
        rec["segments"] = plan.n_slots
        if with_fla and chunk_simple_gla is not None:

            def fla_fn(a, b, c, st):
                o, final = chunk_simple_gla(
                    *(x.transpose(1, 2) for x in (a, b, c)),
                    g_gamma=-s.float(),
                    scale=1.0,
                    initial_state=st,
                    output_final_state=True,
                    cu_seqlens=cu.long() if cu is not None else None,
                )
                return o.transpose(1, 2), final

            fl = run(fla_fn, dtype)
            rec["fla"] = {key: _rel(fl[key], ref[key]) for key in ref}
    except Exception as err:  # noqa: BLE001
        rec["error"] = repr(err)[:400]
        RES["errors"].append(f"correct {name}: {traceback.format_exc()[-2000:]}")
    RES["correctness"].append(rec)
    save()
    log(
        f"[{elapsed():6.1f}s] CHECK {json.dumps(rec, default=lambda x: f'{x:.2e}' if isinstance(x, float) else str(x))}"
    )
    if CUDA:
        torch.cuda.empty_cache()


def t_correct():
    if ARGS.smoke:
        check_case("dense", 2, 2, 37, 32, BF16, True)
        check_case("segmented", 1, 2, 130, 32, BF16, True, cfg=KernelConfig(segment_chunks=2))
        check_case("varlen", 1, 2, 70, 32, BF16, True, lengths=[1, 17, 1, 0, 40, 11])
        return
    check_case("dense_d128", 2, 16, 4096, 128, torch.bfloat16, True, with_fla=True)
    check_case("segmented_32K", 1, 16, 32768, 128, torch.bfloat16, True, with_fla=True)
    lengths = [1, 3000, 1, 0, 8191, 64, 1, 5000, 777]
    check_case("varlen", 1, 16, sum(lengths), 128, torch.bfloat16, True, lengths=lengths)
    check_case("varlen_segmented", 1, 16, sum(lengths), 128, torch.bfloat16, True, lengths=lengths,
               cfg=KernelConfig(segment_chunks=16))  # fmt: skip
    check_case("dense_d64_odd", 4, 8, 2047, 64, torch.bfloat16, True)
    check_case("fp16", 2, 4, 2049, 128, torch.float16, True)
    check_case("fp32", 2, 4, 2049, 128, torch.float32, True)


def _kernel_info(compiled) -> dict:
    try:
        return dict(regs=compiled.n_regs, spills=compiled.n_spills, smem=compiled.metadata.shared)
    except Exception:  # noqa: BLE001
        return {}


def t_tune():
    names = list(VARIANTS) if ARGS.variants == "all" else ARGS.variants.split(",")
    for name in names:
        cfg = VARIANTS[name]
        info = {}
        try:  # compile each kernel once on a small problem to read registers / spills / shared memory
            n_info = 128 if ARGS.smoke else 4096
            q, k, v = inputs(1, n_info, H, D, "bhnd", False, seed=5)
            rates = rates_for(H)
            chunk = cfg.chunk_for(64)
            seg = dataclasses.replace(cfg, segment_chunks=1 if ARGS.smoke else 16)
            plan = tc.make_plan(1, n_info, None, H, D, chunk, q.device, seg)
            out = torch.empty_like(v)
            starts = torch.zeros(plan.n_slots, H, D, D, device=DEV)  # a split plan reads its segments' starts
            local = torch.empty_like(starts)
            info["fwd"] = _kernel_info(tc.chunk_pass(q, k, v, out, rates, plan, chunk, cfg, slot_init=starts))
            info["rev"] = _kernel_info(
                tc.chunk_pass(k, q, v, out, rates, plan, chunk, cfg, reverse=True, slot_init=starts)
            )
            info["state"] = _kernel_info(tc.segment_local_states(k, v, rates, plan, chunk, cfg, False)[2])
            info["dq_fused"] = _kernel_info(
                tc.chunk_pass(q, v, k, out, rates, plan, chunk, cfg, slot_init=starts, rev=(q, local))
            )
            sync()
        except Exception as err:  # noqa: BLE001
            info["error"] = repr(err)[:300]
        log(f"variant {name}: {cfg} kernels {info}")
        for n, layer in itertools.product(TUNE_N, ARGS.rate_layers):
            tag = f"tune:{name}" + (f":L{layer}" if len(ARGS.rate_layers) > 1 else "")
            rec = measure("ours", ours_op(cfg), "bhnd", "linear", n, tag=tag, cfg_name=name, layer=layer)
            if rec is not None:
                rec["kernels"] = info
                RES["tune"].append(rec)
        save()
    if ARGS.config == "auto":  # the variant with the least total fwd+bwd time over TUNE_N
        global OURS_CONFIG
        totals = {}
        for name in names:
            times = [r.get("fwdbwd_ms") for r in RES["tune"] if r["config"] == name]
            if len(times) == len(TUNE_N) * len(ARGS.rate_layers) and all(times):
                totals[name] = sum(times)
        if totals:
            best = min(totals, key=totals.get)
            OURS_CONFIG = VARIANTS[best]
            RES["meta"]["ours_config"] = f"auto: {best} = {OURS_CONFIG}"
            log(
                f"auto config: {best} (fwd+bwd totals {json.dumps({k: round(v, 3) for k, v in totals.items()})})"
            )


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in (
        "/usr/local/cuda*/bin/ncu",
        "/opt/nvidia/nsight-compute/*/ncu",
        "/usr/local/NVIDIA-Nsight-Compute*/ncu",
    ):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


PROFILE_METRICS = (
    "Duration",
    "DRAM Throughput",
    "Memory Throughput",
    "Compute (SM) Throughput",
    "Registers Per Thread",
    "Dynamic Shared Memory Per Block",
    "Achieved Occupancy",
    "Theoretical Occupancy",
    "L2 Hit Rate",
    "Grid Size",
)


def t_profile():
    ncu = find_ncu()
    if ncu is None or not CUDA:
        RES["skipped"].append("profile: ncu not found or no CUDA")
        return
    cmd = [
        ncu, "--clock-control", "none", "--kernel-name", "regex:_chunk|_segment", "--launch-count", "16",
        "--section", "SpeedOfLight", "--section", "LaunchStats", "--section", "Occupancy",
        "--section", "MemoryWorkloadAnalysis", "--csv", "--page", "details", "--launch-skip", "3",
        sys.executable, os.path.abspath(__file__), "--profile-run", "--no-fla", "--out", os.path.join(OUT, "prof"),
    ]  # fmt: skip
    log("profile:", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, ARGS.budget - elapsed()))
    except subprocess.TimeoutExpired:
        RES["skipped"].append("profile: timed out")
        return
    with open(os.path.join(OUT, "ncu.csv"), "w") as f:
        f.write(proc.stdout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('"')]
    kernels: dict = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        key = (row.get("ID"), row.get("Kernel Name", "")[:40], row.get("Grid Size"))
        if row.get("Metric Name") in PROFILE_METRICS:
            kernels.setdefault(key, {})[row["Metric Name"]] = (
                f"{row.get('Metric Value')} {row.get('Metric Unit')}"
            )
    for (kid, kname, grid), metrics in kernels.items():
        RES["profile"].append(dict(id=kid, kernel=kname, grid=grid, **metrics))
    if not kernels:
        RES["errors"].append(f"profile: no metrics; ncu rc={proc.returncode} stderr={proc.stderr[-1500:]}")
    log(f"profile: {len(kernels)} kernels; rc={proc.returncode}")


def profile_run():
    """fwd+bwd twice at N=8K (B=16, whole sequences) and at N=128K (B=1, split into segments)."""
    for n in (8192, 131072) if not ARGS.smoke else (64,):
        batch = TOTAL // n
        q, k, v = inputs(batch, n, H, D, "bhnd", True, seed=3)
        do = torch.randn_like(q)
        rates = rates_for(H)
        for _ in range(2):
            o, _ = lightning_attn_triton(q, k, v, rates, 64)
            o.backward(do)
        sync()


def _kernel_times(fn, iters: int) -> tuple[dict, float]:
    """({kernel name: GPU µs per call of fn}, wall ms per call) over ``iters`` profiled calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        wall = (time.perf_counter() - t) * 1e3 / iters
    out: dict = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if us > 0:
            out[ev.key[:60]] = out.get(ev.key[:60], 0.0) + us / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1])), wall


def _fwd_and_fwd_bwd(fn, batch, n, rates):
    """Two closures over fresh inputs: one fwd without grad, one fwd+bwd."""
    q, k, v = inputs(batch, n, H, D, "bhnd", True, seed=n + 5)
    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            fn(q, k, v, rates)

    def fwd_bwd():
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v, rates).backward(do)

    return fwd, fwd_bwd


def t_breakdown():
    """Where the time goes: GPU time per kernel of one fwd and one fwd+bwd, at each tune length and
    rate layer, for the variants named by --variants (default: the chosen config)."""
    names = ["default"] if ARGS.variants == "all" else ARGS.variants.split(",")
    for name, n, layer in itertools.product(names, TUNE_N, ARGS.rate_layers):
        if over_budget(f"breakdown {name} N={n} L{layer}"):
            return
        cfg = VARIANTS[name]
        batch = TOTAL // n
        rates = rates_for(H, layer)
        rec = dict(variant=name, N=n, B=batch, rate_layer=layer)
        try:
            fwd, fwd_bwd = _fwd_and_fwd_bwd(ours_op(cfg), batch, n, rates)
            rec["fwd_kernels_us"], rec["fwd_wall_ms"] = _kernel_times(fwd, 5)
            rec["fwdbwd_kernels_us"], rec["fwdbwd_wall_ms"] = _kernel_times(fwd_bwd, 5)
        except Exception as err:  # noqa: BLE001
            rec["error"] = repr(err)[:400]
            RES["errors"].append(f"breakdown {name} N={n}: {traceback.format_exc()[-2000:]}")
        RES.setdefault("breakdown", []).append(rec)
        log(f"[{elapsed():6.1f}s] BREAKDOWN {json.dumps(rec, default=lambda x: round(x, 1))}")
        save()
        if CUDA:
            torch.cuda.empty_cache()


def t_main():
    table = ops()
    for n in MAIN_N:
        for name, (fn, layout, family) in table.items():
            rec = measure(name, fn, layout, family, n)
            if rec is not None:
                RES["timings"].append(rec)
        save()


def t_layout():
    for n in MAIN_N[:: max(1, len(MAIN_N) // 3)]:
        rec = measure("ours_bnhd_view", ours_op(OURS_CONFIG, "bnhd"), "bnhd", "linear", n, tag="layout")
        if rec is not None:
            RES["timings"].append(rec)
    save()


def t_decode():
    heads, d = H, D
    rates = rates_for(heads)
    steps = 64 if CUDA else 4
    for batch, ctx in itertools.product(DECODE_B, DECODE_CTX):
        if over_budget(f"decode B={batch} ctx={ctx}"):
            break
        rec = dict(B=batch, context=ctx, H=heads, d=d)
        try:
            g = torch.Generator(device=DEV)
            g.manual_seed(batch * 7 + ctx)
            if batch * ctx <= (1 << 20):  # a real prefill of the context gives the state
                q, k, v = (
                    F.silu(torch.randn(batch, heads, ctx, d, device=DEV, generator=g)).to(BF16)
                    for _ in range(3)
                )
                with torch.no_grad():
                    _, state = lightning_attn_triton(q, k, v, rates, 64, None, True)
                del q, k, v
                rec["state_from"] = "prefill"
            else:  # the step's cost does not depend on how the state was made
                state = torch.randn(batch, heads, d, d, device=DEV, generator=g)
                rec["state_from"] = "random"
            toks = [
                F.silu(torch.randn(batch, heads, 1, d, device=DEV, generator=g)).to(BF16) for _ in range(3)
            ]
            for name, step in (("ours", lightning_attn_triton_decode), ("torch", lightning_attn_decode)):
                rec[f"{name}_us"] = _decode_step_us(step, toks, rates, state, steps)
            _, n1 = lightning_attn_triton_decode(*toks, rates, state)
            _, n2 = lightning_attn_decode(*toks, rates, state)
            rec["ours_vs_torch_state_rel"] = _rel(n1, n2.double())
            if batch * ctx <= (1 << 20) and CUDA:  # softmax attention over a KV cache of the context
                rec["sdpa_us"] = _sdpa_decode_us(toks[0], ctx, g)
            step_bytes = 2 * batch * heads * d * d * 4  # read + write the fp32 state
            rec["ours_tok_s"] = batch / (rec["ours_us"] * 1e-6)
            bw = RES["ceilings"].get("copy_GBps")
            if bw:
                rec["ours_bw_frac"] = step_bytes / (rec["ours_us"] * 1e-6) / 1e9 / bw
        except Exception as err:  # noqa: BLE001
            rec["error"] = repr(err)[:400]
            RES["errors"].append(f"decode B={batch} ctx={ctx}: {traceback.format_exc()[-2000:]}")
        RES["decode"].append(rec)
        log(f"[{elapsed():6.1f}s] decode {json.dumps(rec, default=str)}")
        save()


def _decode_step_us(step, toks, rates, state, steps: int) -> float:
    def chain():
        st = state
        for _ in range(steps):
            _, st = step(*toks, rates, st)
        return st

    return _graph_time(chain, steps) * 1e3


def _sdpa_decode_us(q, ctx: int, g) -> float:
    batch, heads, _, d = q.shape
    kc, vc = (torch.randn(batch, heads, ctx, d, device=DEV, dtype=BF16, generator=g) for _ in range(2))
    return _graph_time(lambda: F.scaled_dot_product_attention(q, kc, vc), 1) * 1e3


def _graph_time(fn, steps: int) -> float:
    """ms per step: fn (``steps`` chained steps) captured once in a CUDA graph, replays timed."""
    if not CUDA:
        ms, _ = bench(fn)
        return ms / steps
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    return ms / steps


# ---- tables --------------------------------------------------------------------------------------


def _fmt(x, p=3):
    return "-" if x is None else f"{x:.{p}f}"


def _human(n):
    return f"{n // 1024}K" if n >= 1024 else str(n)


def _correctness_table(out: list[str]) -> None:
    """Errors against float64, per case and implementation."""
    if RES["correctness"]:
        out += [
            "",
            "### Correctness: ‖x − ref‖/‖ref‖ vs float64 (PyTorch chunk form, same rounded inputs)",
            "",
        ]
        keys = ["o", "final", "dq", "dk", "dv", "ds0"]
        out.append("| case | B | H | T | d | dtype | segments | impl | " + " | ".join(keys) + " |")
        out.append("|" + "---|" * (8 + len(keys)))
        for r in RES["correctness"]:
            for impl in ("ours", "fla"):
                if impl in r:
                    errs = " | ".join(f"{r[impl].get(k2, float('nan')):.2e}" for k2 in keys)
                    out.append(
                        f"| {r['case']} | {r['B']} | {r['H']} | {r['T']} | {r['d']} | {r['dtype']} | "
                        f"{r.get('segments', '-')} | {impl} | {errs} |"
                    )
            if "error" in r:
                out.append(f"| {r['case']} | | | | | | | ERROR | {r['error'][:100]} |")


def _timing_tables(out: list[str]) -> None:
    """fwd / fwd+bwd timings, and ours against fla, the byte floor and flatness."""
    timings = [r for r in RES["timings"] if not r.get("tag")]
    if timings:
        by = {(r["op"], r["N"]): r for r in timings}
        names = list(dict.fromkeys(r["op"] for r in timings))
        out += ["", "### fwd / fwd+bwd, bf16, median ms (Mtok/s)", ""]
        out.append("| N | B | " + " | ".join(f"{n} fwd | {n} fwd+bwd" for n in names) + " |")
        out.append("|---|---|" + "---|---|" * len(names))
        for n in MAIN_N:
            cells = []
            for name in names:
                r = by.get((name, n), {})
                for key in ("fwd", "fwdbwd"):
                    ms, mt = r.get(f"{key}_ms"), r.get(f"{key}_Mtok_s")
                    cells.append("-" if ms is None else f"{ms:.3f} ({mt:.1f})")
            out.append(f"| {_human(n)} | {TOTAL // n} | " + " | ".join(cells) + " |")
        fla_name = "fla_chunk_simple_gla"
        out += ["", "### ours: speedup over fla, fraction of the byte floor, flatness", ""]
        out.append(
            "| N | fwd ×fla | fwd+bwd ×fla | fwd BW frac | fwd+bwd BW frac | fwd Mtok/s / max | fwd+bwd Mtok/s / max |"
        )
        out.append("|---|---|---|---|---|---|---|")
        best = {
            key: max(
                [by[("ours", n)].get(f"{key}_Mtok_s") or 0.0 for n in MAIN_N if ("ours", n) in by] or [1.0]
            )
            for key in ("fwd", "fwdbwd")
        }
        for n in MAIN_N:
            r, f = by.get(("ours", n), {}), by.get((fla_name, n), {})

            def ratio(key, r=r, f=f):
                return f[f"{key}_ms"] / r[f"{key}_ms"] if r.get(f"{key}_ms") and f.get(f"{key}_ms") else None

            out.append(
                f"| {_human(n)} | {_fmt(ratio('fwd'), 2)} | {_fmt(ratio('fwdbwd'), 2)} | "
                f"{_fmt(r.get('fwd_bw_frac'), 2)} | {_fmt(r.get('fwdbwd_bw_frac'), 2)} | "
                f"{_fmt((r.get('fwd_Mtok_s') or 0) / (best['fwd'] or 1), 2)} | "
                f"{_fmt((r.get('fwdbwd_Mtok_s') or 0) / (best['fwdbwd'] or 1), 2)} |"
            )
        for key in ("fwd", "fwdbwd"):
            cross = crossover(by, key)
            out.append(f"\nCrossover ours vs sdpa_cudnn ({key}): {cross}")


def _tune_table(out: list[str]) -> None:
    """Ours by tuning config, with registers and spills."""
    tune = RES["tune"]
    if tune:
        out += ["", "### tune: ours by config, median ms", ""]
        out.append(
            "| config | N | rate layer | fwd ms | fwd+bwd ms | fwd regs/spills | reverse regs/spills "
            "| state regs/spills |"
        )
        out.append("|---|---|---|---|---|---|---|---|")
        for r in tune:
            kern = r.get("kernels", {})

            def rs(name, kern=kern):
                x = kern.get(name, {})
                return f"{x.get('regs', '-')}/{x.get('spills', '-')}"

            out.append(
                f"| {r['config']} | {_human(r['N'])} | {r.get('rate_layer')} | {_fmt(r.get('fwd_ms'))} | "
                f"{_fmt(r.get('fwdbwd_ms'))} | {rs('fwd')} | {rs('rev')} | {rs('state')} |"
            )


def _layout_and_decode_tables(out: list[str]) -> None:
    """Ours on the transposed layout, and the decode step."""
    layout = [r for r in RES["timings"] if r.get("tag") == "layout"]
    if layout:
        out += ["", "### ours on [B, N, H, d] memory (transposed view, no copy)", ""]
        out.append("| N | fwd ms | fwd+bwd ms |")
        out.append("|---|---|---|")
        for r in layout:
            out.append(f"| {_human(r['N'])} | {_fmt(r.get('fwd_ms'))} | {_fmt(r.get('fwdbwd_ms'))} |")
    if RES["decode"]:
        out += [
            "",
            f"### decode: one token per sequence, one layer (H={H}, d={D}), µs per step in a CUDA graph",
            "",
        ]
        out.append(
            "| B | context | ours µs | ours tok/s | ours BW frac | torch step µs | SDPA over KV cache µs |"
        )
        out.append("|---|---|---|---|---|---|---|")
        for r in RES["decode"]:
            out.append(
                f"| {r['B']} | {_human(r['context'])} | {_fmt(r.get('ours_us'), 1)} | {_fmt(r.get('ours_tok_s'), 0)} | "
                f"{_fmt(r.get('ours_bw_frac'), 2)} | {_fmt(r.get('torch_us'), 1)} | {_fmt(r.get('sdpa_us'), 1)} |"
            )


def _profile_table(out: list[str]) -> None:
    """Nsight Compute metrics of our kernels."""
    if RES["profile"]:
        out += ["", "### Nsight Compute (our kernels)", ""]
        cols = ["kernel", "grid", *PROFILE_METRICS[:-1]]
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        for r in RES["profile"]:
            out.append("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")


def tables() -> str:
    out = []
    bw = RES["ceilings"].get("copy_GBps")
    meta = RES["meta"]
    out.append(
        f"Device: {meta.get('gpu', DEV)}; torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"fla-core {meta.get('fla_core', 'n/a')}; copy bandwidth {_fmt(bw, 0)} GB/s; H={H}, d={D}, B·N={TOTAL}."
    )
    for table in (_correctness_table, _timing_tables, _tune_table, _layout_and_decode_tables, _profile_table):
        table(out)
    if RES["errors"]:
        out += ["", f"{len(RES['errors'])} errors (results.json has them)"]
    return "\n".join(out)


def crossover(by: dict, key: str) -> str:
    """First N (interpolated in log N) from which ours is faster than cuDNN softmax attention."""
    pts = [
        (n, by.get(("ours", n), {}).get(f"{key}_ms"), by.get(("sdpa_cudnn", n), {}).get(f"{key}_ms"))
        for n in MAIN_N
    ]
    pts = [(n, a, b) for n, a, b in pts if a and b]
    if not pts:
        return "n/a"
    if pts[0][1] <= pts[0][2]:
        return f"ours already faster at the smallest N measured ({_human(pts[0][0])})"
    for (n0, a0, b0), (n1, a1, b1) in itertools.pairwise(pts):
        if a1 <= b1:
            r0, r1 = math.log(a0 / b0), math.log(a1 / b1)
            x = math.log(n0) + (math.log(n1) - math.log(n0)) * r0 / (r0 - r1)
            return f"N ≈ {math.exp(x):.0f}"
    return "never in the measured range"


def main() -> None:
    if ARGS.profile_run:
        profile_run()
        return
    tasks = [t for t in ARGS.tasks.split(",") if t]
    unknown = set(tasks) - set(ALL_TASKS)
    if unknown:
        raise SystemExit(f"unknown tasks {sorted(unknown)}; choose from {ALL_TASKS}")
    if "meta" not in tasks:
        tasks.insert(0, "meta")
    if "ceilings" not in tasks and {"main", "decode", "tune"} & set(tasks):
        tasks.insert(1, "ceilings")
    for name in tasks:
        log(f"=== {name} at {elapsed():.1f}s")
        try:
            globals()[f"t_{name}"]()
        except Exception:  # noqa: BLE001
            RES["errors"].append(f"task {name}: {traceback.format_exc()[-2000:]}")
            log(traceback.format_exc())
        save()
    RES["meta"]["seconds"] = elapsed()
    save()
    text = tables()
    with open(os.path.join(OUT, "tables.md"), "w") as f:
        f.write(text + "\n")
    for e in RES["errors"]:
        log("ERROR", e[-800:])
    log(text)


if __name__ == "__main__":
    main()
