"""Microseconds per ``SwiGLUExperts`` call for each path (model/moe.py: loop, dense, grouped) over token counts N:
the numbers behind ``DENSE_MAX_TOKENS`` and ``GROUPED_MM_DEVICES``. Random routing (top-k of random logits),
every slot kept; forward only (``--backward`` adds a backward through x and the weights).

    OMP_NUM_THREADS=1 python bench/bench_moe_experts.py --size tiny
    python bench/bench_moe_experts.py --device cuda --dtype bfloat16 --size gpu-300m
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def time_path(experts, path: str, x, top_i, top_w, keep, repeats: int, backward: bool) -> float:
    """Best microseconds per call over ``repeats`` batches of calls (after a warm-up)."""
    def once() -> None:
        xx = x.detach().requires_grad_(backward)
        y = experts(xx, top_i, top_w, keep, path=path)
        if backward:
            y.backward(torch.ones_like(y))

    calls = 10
    once()
    best = float("inf")
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            once()
        if x.is_cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    from model import config_for
    from model.moe import SwiGLUExperts, grouped_mm_supported

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", default="1,8,16,32,64,128,256,512,2048,4096")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backward", action="store_true")
    a = p.parse_args()
    cfg = config_for(a.size)
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    d, f, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    experts = SwiGLUExperts(e, d, f).to(a.device, dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, d**-0.5)
        experts.down_proj.normal_(0, f**-0.5)
    paths = ["loop", "dense"] + (["grouped"] if grouped_mm_supported(torch.device(a.device), dtype, d, f) else [])
    rows = []
    for n in map(int, a.tokens.split(",")):
        x = torch.randn(n, d, device=a.device, dtype=dtype)
        top_w, top_i = torch.randn(n, e, device=a.device).softmax(-1).topk(k, dim=-1)
        keep = torch.ones_like(top_i, dtype=torch.bool)
        row = {"tokens": n}
        for path in paths:
            row[f"{path}_us"] = round(time_path(experts, path, x, top_i, top_w, keep, a.repeats, a.backward), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"size": a.size, "device": a.device, "dtype": a.dtype, "backward": a.backward,
                      "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
