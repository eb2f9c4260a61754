"""Why did the all-softmax gpu-300m variant of dags/ablation-attention-gpu.yaml stay at the unigram loss on an H100
while the hybrid and all-lightning ones learned (BENCHMARKS.md, "Attention ablation ... H100")? Two checks, one call:

1. forward: the tiny all-softmax model on CUDA, one packed row of documents (cu_seqlens) against each document run
   alone, eager and with ``compile_layers`` (reduce-overhead: CUDA graphs), fp32 and bf16, forward + backward twice;
2. training: the pretrain stage on the test fixtures' corpus (tiny size, 512-token rows) for all-softmax with and
   without ``compile``, and the hybrid with it: eval_loss against unigram_loss.

    python bench/check_softmax_train_gpu.py [--tokens 131072] [--skip-train]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def forward_check() -> None:
    import torch

    from model.modeling import HybridForCausalLM
    from model.sizes import config_for
    from pretrain.train import compile_layers

    for dtype in (torch.float32, torch.bfloat16):
        for compiled in (False, True):
            torch.manual_seed(0)
            m = HybridForCausalLM(config_for("tiny", attention_pattern="all-softmax")).cuda().to(dtype)
            if compiled:
                compile_layers(m, mode="reduce-overhead")
            lens = [100, 37, 250, 125]
            n = sum(lens)
            ids = torch.randint(0, m.config.vocab_size, (1, n), device="cuda")
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            pos = torch.cat([torch.arange(L) for L in lens])[None].cuda()
            for _rep in range(3):
                out = m(input_ids=ids, cu_seqlens=cu, position_ids=pos, labels=ids)
                out.loss.backward()
                packed = out.logits.detach().float()
            with torch.no_grad():
                alone = torch.cat([m(input_ids=ids[:, a:b]).logits.float()
                                   for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)], dim=1)
            err = (packed - alone).abs().max().item() / alone.abs().max().item()
            print(json.dumps({"check": "forward", "dtype": str(dtype), "compiled": compiled,
                              "packed_vs_alone_rel_max": err, "logit_std_over_positions":
                              packed[0].std(0).mean().item()}), flush=True)


def train_check(tokens: int) -> None:
    from pipeline.stage import Resources, StageContext
    from pretrain.stage import PretrainParams
    from pretrain.stage import run as pretrain
    from tests.pretrain_fixtures import build_inputs

    root = Path(tempfile.mkdtemp(prefix="softmax-train-"))
    inputs = build_inputs(root / "inputs")
    for pattern, compile_ in (("all-softmax", True), ("all-softmax", False), ("hybrid", True)):
        t0 = time.monotonic()
        name = f"{pattern}-{'compiled' if compile_ else 'eager'}"
        ctx = StageContext(root / name, inputs.as_inputs(), stage_name="pretrain",
                           resources=Resources(cpus=4, gpus=1), resume_dir=root / f"{name}-resume")
        try:
            pretrain(PretrainParams(seq_len=512, micro_batch_rows=8, batch_rows=8, max_batch_rows=8,
                                    train_tokens=tokens, peak_lr=3e-3, log_every=4, checkpoint_every=1000,
                                    eval_documents=12, compile=compile_,
                                    model_overrides={"attention_pattern": pattern}), ctx)
            s = ctx.summary
            print(json.dumps({"check": "train", "run": name, "eval_loss": s.get("eval_loss"),
                              "unigram_loss": s.get("unigram_loss"), "loss": s.get("loss"),
                              "seconds": round(time.monotonic() - t0, 1)}), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"check": "train", "run": name, "error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--skip-train", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    forward_check()
    if not a.skip_train:
        train_check(a.tokens)


if __name__ == "__main__":
    main()
