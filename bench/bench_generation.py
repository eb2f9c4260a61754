"""Batched generation throughput (tokens/s): our ``HybridForCausalLM.generate`` (lightning layers decode with an O(1)
recurrent state, model/cache.py HybridCache) vs transformers' ``MiniMaxForCausalLM.generate`` on the same weights
(model/hf_minimax.py ``export_to_minimax``) — issue 12's "generation throughput during RL" target, the decode that
GRPO rollouts (§5.4.2) spend their time in.

Random prompt ids (no padding), greedy, exactly ``--new-tokens`` per sequence (``min_new_tokens`` = max, no eos), so
both sides generate ``batch x new_tokens`` tokens; the share of generated tokens on which the two agree is printed as
a sanity check (fp32: expect 1.0; bf16 may diverge after a near-tie).

    CPU, tiny:  OMP_NUM_THREADS=1 python bench/bench_generation.py
    a checkpoint:  python bench/bench_generation.py --checkpoint runs/tiny/<pretrain artifact>
    GPU:  python bench/bench_generation.py --device cuda --size gpu-300m --batch 32 --new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed_generate(model, ids: torch.Tensor, new_tokens: int, repeats: int, **kw) -> tuple[float, torch.Tensor]:
    """Best wall seconds over ``repeats`` (after one warm-up) and the output of the last run."""
    args = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                pad_token_id=0)
    best, out = float("inf"), None
    for i in range(repeats + 1):
        extra = kw.get("cache_factory", lambda: {})()
        if ids.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **args, **extra)
        if ids.is_cuda:
            torch.cuda.synchronize()
        if i:  # the first run warms up (allocator, kernels)
            best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    from model import HybridForCausalLM, config_for
    from model.hf_minimax import MiniMaxGenerationCache, export_to_minimax

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a checkpoint artifact (model/); default: a random model of --size")
    p.add_argument("--size", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the numbers here")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    torch.manual_seed(0)
    if a.checkpoint:
        from posttrain.policy import load_policy

        ours, _ = load_policy(a.checkpoint)
    else:
        ours = HybridForCausalLM(config_for(a.size)).eval()
    theirs = export_to_minimax(ours)  # same weights, transformers' MiniMax (CPU, fp32 here)
    ours, theirs = ours.to(a.device, dtype), theirs.to(a.device, dtype).eval()
    ids = torch.randint(8, ours.config.vocab_size, (a.batch, a.prompt_tokens), device=a.device)
    tokens = a.batch * a.new_tokens
    t_ours, out_ours = timed_generate(ours, ids, a.new_tokens, a.repeats)
    t_hf, out_hf = timed_generate(theirs, ids, a.new_tokens, a.repeats,
                                  cache_factory=lambda: {"past_key_values": MiniMaxGenerationCache(theirs.config)})
    agree = (out_ours[:, a.prompt_tokens:] == out_hf[:, a.prompt_tokens:]).float().mean().item()
    result = {"size": a.checkpoint or a.size, "device": a.device, "dtype": str(dtype).replace("torch.", ""),
              "batch": a.batch, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
              "threads": torch.get_num_threads(),
              "hylight_tokens_per_s": tokens / t_ours, "minimax_hf_tokens_per_s": tokens / t_hf,
              "speedup": t_hf / t_ours, "greedy_token_agreement": agree}
    print(json.dumps(result, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
