"""LASP+ sequence parallelism on two devices of one host (MiniMax-01 §3.2.2; pretrain/sequence_parallel.py).

Results, one JSON line each (stdout, and ``$OUT/lasp_gpu.jsonl`` when ``OUT`` is set):

  equal       one packed row of ``--equal-len`` tokens (documents crossing the rank boundary): loss and every
              parameter gradient of SP on 2 ranks (grads all-reduced) against the same model on one device;
  bytes       the collective payload bytes one rank moved in that SP forward+backward, against the formula
              (lightning: 2·P·B·H·d²·4 per layer, O(d²); softmax: 4·N·H_kv·D·2 per layer, O(N); MoE aux 2·(2E+1)·4);
  throughput  tokens/s of forward+backward (+ gradient all-reduce for SP) at ``--equal-len``, 1 device vs 2;
  probe       per length of ``--probe-lens`` (one document spanning the whole row): does a forward+backward
              step run on 1 device / on 2 (ok, oom, error), each in its own process so an OOM cannot hang a
              collective; ``longest`` sums it up.

Run (GPU host with 2 GPUs; each phase starts its own torchrun):

    python bench/bench_lasp_gpu.py --device cuda --size gpu-300m
    python bench/bench_lasp_gpu.py --device cpu --size tiny --equal-len 512 --probe-lens 256,512   # gloo, CPU

No gradient checkpointing (its recompute would run outside the SP context); dropless MoE (token-drop capacity is
per rank under SP); the loss is an fp32 cross-entropy over all logits on each rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _emit(result: dict[str, Any], sink: Path | None) -> None:
    line = json.dumps(result, sort_keys=True)
    print(line, flush=True)
    if sink is not None:
        with sink.open("a") as f:
            f.write(line + "\n")


# --- worker side (under torchrun) ---------------------------------------------------------------------------


def _setup(args: argparse.Namespace):  # noqa: ANN202
    import torch
    import torch.distributed as dist

    from model import HybridForCausalLM, config_for

    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    if not cuda:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    # a rank that died (OOM) must not leave its peer waiting in a collective for NCCL's default 10 minutes
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    torch.manual_seed(0)
    config = config_for(args.size, moe_token_drop=False)
    with torch.device(device):  # initialise on the device: ~750M parameters initialise slowly on a CPU
        model = HybridForCausalLM(config)
    model = model.to(dtype=dtype).train()
    return model, device, dtype


def _row(total: int, vocab: int, doc_lens: list[int] | None, device):  # noqa: ANN001, ANN202
    import torch

    g = torch.Generator().manual_seed(total)
    ids = torch.randint(3, vocab, (1, total), generator=g)
    bounds = [0]
    for n in doc_lens or [total]:
        bounds.append(min(total, bounds[-1] + n))
        if bounds[-1] == total:
            break
    if bounds[-1] != total:
        bounds.append(total)
    return ids.to(device), torch.tensor(bounds, dtype=torch.int32, device=device)


def _full_loss(model, ids, cu):  # noqa: ANN001, ANN202
    """The single-device loss, the same arithmetic as sequence_parallel_loss on one rank."""
    import torch
    import torch.nn.functional as F

    out = model(input_ids=ids, cu_seqlens=cu, use_cache=False)
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
    logits = out.logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    return loss + model.config.router_aux_loss_coef * out.aux_loss.to(torch.float32)


def _sync(device) -> None:  # noqa: ANN001
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker_equal(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from pretrain.sequence_parallel import (
        apply_sequence_parallel,
        expected_step_bytes,
        sequence_parallel_loss,
        shard_batch,
    )

    model, device, dtype = _setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    total = args.equal_len
    ids, cu = _row(total, model.config.vocab_size, [total // 3, total // 2], device)  # crosses the boundary

    # one device: the whole row (every rank computes it; rank 0 reports)
    def one_step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = _full_loss(model, ids, cu)
        loss.backward()
        return loss.detach()

    ref_loss = one_step()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    times_1 = []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        one_step()
        _sync(device)
        times_1.append(time.perf_counter() - t0)

    sp = apply_sequence_parallel(model)
    shard = shard_batch(ids, ids, None, cu, rank, world)

    def sp_step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = sequence_parallel_loss(model, sp, shard)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        total_loss = loss.detach().float().clone()
        dist.all_reduce(total_loss)
        return total_loss

    sp.counter.reset()
    sp_loss = sp_step()
    by_what = {w: sp.counter.total(w) for w in ("lightning_state", "softmax_kv", "moe_aux")}
    formula = expected_step_bytes(model.config, shard.layout, 1, dtype)
    errs = []
    for n, p in model.named_parameters():
        if n in ref_grads:
            ref = ref_grads[n].float()
            errs.append((float((p.grad.float() - ref).norm() / ref.norm().clamp(min=1e-30)), n))
    errs.sort()
    times_2 = []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        sp_step()
        _sync(device)
        times_2.append(time.perf_counter() - t0)
    if rank == 0:
        common = {"size": args.size, "device": args.device, "dtype": str(dtype), "tokens": total, "world": world}
        loss_rel = abs(float(sp_loss) - float(ref_loss)) / abs(float(ref_loss))
        worst = errs[-1]
        print("RESULT " + json.dumps({
            **common, "result": "equal", "loss_1": float(ref_loss), "loss_sp": float(sp_loss), "loss_rel": loss_rel,
            "grad_rel_l2_median": errs[len(errs) // 2][0], "grad_rel_l2_max": worst[0], "grad_rel_l2_max_param": worst[1],
            "pass": loss_rel < 1e-2 and errs[len(errs) // 2][0] < 2e-2,
        }), flush=True)  # fmt: skip
        print("RESULT " + json.dumps({
            **common, "result": "bytes", "measured": by_what, "formula": formula, "equal": by_what == formula,
            "lightning_per_layer": formula["lightning_state"] // max(1, sum(
                k == "lightning" for k in model.config.attention_pattern)),
        }), flush=True)  # fmt: skip
        best_1, best_2 = min(times_1), min(times_2)
        print("RESULT " + json.dumps({
            **common, "result": "throughput", "step_s_1": best_1, "step_s_sp": best_2,
            "tokens_per_s_1": total / best_1, "tokens_per_s_sp": total / best_2,
        }), flush=True)  # fmt: skip
    dist.destroy_process_group()


def worker_probe(args: argparse.Namespace) -> None:
    """One forward+backward at --probe-len: plain on one device (world 1) or SP (world > 1)."""
    import torch
    import torch.distributed as dist

    from pretrain.sequence_parallel import apply_sequence_parallel, sequence_parallel_loss, shard_batch

    model, device, _ = _setup(args)
    world = dist.get_world_size()
    ids, cu = _row(args.probe_len, model.config.vocab_size, None, device)  # one document spanning the row
    try:
        if world == 1:
            _full_loss(model, ids, cu).backward()
        else:
            sp = apply_sequence_parallel(model)
            loss = sequence_parallel_loss(model, sp, shard_batch(ids, ids, None, cu, dist.get_rank(), world))
            loss.backward()
        _sync(device)
        status = "ok"
    except torch.OutOfMemoryError:
        status = "oom"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"status": status, "peak_gib_rank0": peak}), flush=True)
    if status == "oom":  # the peer may be inside a collective: leave without one
        os._exit(3)
    dist.destroy_process_group()


# --- driver side --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, extra: list[str], args: argparse.Namespace, timeout: int) -> tuple[str, list[dict]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(Path(__file__).resolve()),
           "--device", args.device, "--size", args.size, *(["--dtype", args.dtype] if args.dtype else []), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "timeout", []
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 and not results:
        tail = (proc.stderr or "")[-2000:]
        status = "oom" if "OutOfMemoryError" in tail or "out of memory" in tail else "error"
        return status, [{"stderr_tail": tail}]
    return ("ok" if proc.returncode == 0 else "error"), results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--size", default="gpu-300m")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--equal-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up)")
    ap.add_argument("--probe-lens", default="16384,32768,65536,98304,131072,196608,262144")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per torchrun")
    ap.add_argument("--worker", choices=["equal", "probe"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-len", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "equal":
        worker_equal(args)
        return 0
    if args.worker == "probe":
        worker_probe(args)
        return 0

    sink = Path(os.environ["OUT"]) / "lasp_gpu.jsonl" if os.environ.get("OUT") else None
    import torch

    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if args.device == "cuda":
        versions["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    _emit({"result": "env", **versions, "size": args.size, "world": args.world}, sink)
    status, results = _torchrun(args.world, ["--worker", "equal", "--equal-len", str(args.equal_len),
                                             "--steps", str(args.steps)], args, args.timeout)  # fmt: skip
    for r in results:
        _emit(r if "result" in r else {"result": "equal", "status": status, **r}, sink)
    longest = {1: 0, args.world: 0}
    for n in [int(x) for x in args.probe_lens.split(",") if x]:
        for nproc in (1, args.world):
            if n % nproc:
                continue
            status, res = _torchrun(nproc, ["--worker", "probe", "--probe-len", str(n)], args, args.timeout)
            row = {"result": "probe", "tokens": n, "devices": nproc, "status": status}
            if res and "status" in res[0]:
                row.update(status=res[0]["status"], peak_gib_rank0=res[0]["peak_gib_rank0"])
            _emit(row, sink)
            if row["status"] == "ok":
                longest[nproc] = max(longest[nproc], n)
    _emit({"result": "longest", "size": args.size, "tokens_1_device": longest[1],
           f"tokens_{args.world}_devices": longest[args.world]}, sink)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
