"""The pretrain stage on real GPUs, one and two ranks: loss curves, tokens/s scaling, global-router drop rates.

Run on a machine with 2 GPUs (the device tool's `nvidia-h200-x2`) from the repo root:

    python bench/run_pretrain_gpus.py --runs 1gpu,2gpu,2gpu-local --out $OUT

Inputs are built from the shipped sample corpus (prose, manual, misc; a BPE tokenizer trained on them, every
document sampled twice, every 10th held out), then ``pretrain.stage.run`` trains `gpu-300m` (vocabulary from the
tokenizer) exactly as `hylight run` would, with the same global batch in every run:

    1gpu        one rank, micro-batch 4 rows x 2 gradient-accumulation steps
    2gpu        two ranks, expert parallelism over both (ZeRO-2, expert_parallel_size 2), global router
    2gpu-local  the same without the global router (each rank caps its own slots)
    4gpu        four ranks, expert parallelism over all four (two of gpu-300m's 8 experts a rank), global router
    4gpu-local  the same without the global router

On four GPUs pass ``--batch-rows 16``: the global batch must be a whole number of micro-batches on every rank
(16 rows = 4 ranks x 4 rows, and 4 / 2 accumulation steps on 1 / 2 GPUs), so every run trains the same batches.

    python bench/run_pretrain_gpus.py --runs 1gpu,2gpu,4gpu,4gpu-local --batch-rows 16 --out $OUT

Prints a table (final loss, eval_loss, tokens/s, drop rate per run) and writes each run's train_log.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUNS = {
    "1gpu": dict(processes=1, expert_parallel_size=1, global_router=True, gpus=1),
    "2gpu": dict(processes=2, expert_parallel_size=2, global_router=True, gpus=2),
    "2gpu-local": dict(processes=2, expert_parallel_size=2, global_router=False, gpus=2),
    "4gpu": dict(processes=4, expert_parallel_size=4, global_router=True, gpus=4),
    "4gpu-local": dict(processes=4, expert_parallel_size=4, global_router=False, gpus=4),
}


def main() -> int:
    from pipeline.stage import Resources, StageContext
    from pretrain.stage import PretrainParams, run
    from tests.pretrain_fixtures import build_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="1gpu,2gpu,2gpu-local")
    ap.add_argument("--tokens", type=int, default=1_200_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--work", default="/tmp/hylight-gpus")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpus_out"))
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--size", default="gpu-300m")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--inject-nan", default="", help="comma-separated optimizer steps whose loss is made NaN")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--batch-rows", type=int, default=8, help="global batch in rows (16 for the 4-GPU runs)")
    ap.add_argument("--micro-rows", type=int, default=4, help="rows per forward call on each rank")
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (work / "in" / "mixture").exists():
        t = time.time()
        shutil.rmtree(work / "in", ignore_errors=True)
        build_inputs(work / "in", documents=10_000, max_chars=200_000, vocab_size=8192, sample_count=2,
                     domains=("prose", "manual", "misc"))
        print(f"inputs built in {time.time() - t:.0f}s", flush=True)
    from pipeline.stage import Artifact

    inputs = {k: Artifact.load(work / "in" / d) for k, d in
              (("documents", "documents"), ("tokenizer", "tokenizer"), ("mixture", "mixture"))}
    rows = []
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"unknown run(s) {unknown}; known: {', '.join(RUNS)}")
    for name in names:
        if args.batch_rows % (args.micro_rows * RUNS[name]["gpus"]):
            ap.error(f"--batch-rows {args.batch_rows} is not a whole number of {args.micro_rows}-row micro-batches "
                     f"on each of {name}'s {RUNS[name]['gpus']} ranks")
    for name in names:
        spec = dict(RUNS[name])
        gpus = spec.pop("gpus")
        shutil.rmtree(work / name, ignore_errors=True)
        ctx = StageContext(work / name / "out", inputs, stage_name=name, resume_dir=work / name / "resume",
                           resources=Resources(cpus=8 * gpus, gpus=gpus))
        params = PretrainParams(size=args.size, seq_len=args.seq_len, micro_batch_rows=args.micro_rows,
                                batch_rows=args.batch_rows, max_batch_rows=args.batch_rows, train_tokens=args.tokens,
                                peak_lr=args.lr, log_every=args.log_every,
                                checkpoint_every=1000, eval_documents=32, eval_max_rows=16, zero_stage=args.zero,
                                inject_nan_at_steps=[int(v) for v in args.inject_nan.split(",") if v],
                                compile=args.compile, **spec)
        t = time.time()
        try:
            run(params, ctx)
        except Exception as e:  # keep the other runs and this run's log: a diverged run is a result too
            print(f"{name}: FAILED after {time.time() - t:.0f}s: {e}", flush=True)
            log_path = ctx.out_dir / "train_log.jsonl"
            if log_path.exists():
                shutil.copy2(log_path, out / f"train_log_{name}.jsonl")
                print(log_path.read_text()[-3000:], flush=True)
            shutil.rmtree(work / name, ignore_errors=True)
            continue
        wall = time.time() - t
        log = [json.loads(line) for line in (ctx.out_dir / "train_log.jsonl").read_text().splitlines()]
        shutil.copy2(ctx.out_dir / "train_log.jsonl", out / f"train_log_{name}.jsonl")
        steady = [h["tokens_per_second"] for h in log[2:]] or [log[-1]["tokens_per_second"]]
        rows.append({"run": name, **{k: ctx.summary[k] for k in ("eval_loss", "unigram_loss", "loss", "drop_rate",
                                                                "steps", "tokens")},
                     "tokens_per_second_median": sorted(steady)[len(steady) // 2], "wall_s": wall,
                     "losses": [h["loss"] for h in log]})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(work / name, ignore_errors=True)  # gpu-300m exports are GBs
    (out / "runs.json").write_text(json.dumps(rows, indent=2))
    print("\n| run | final train loss | eval_loss | unigram | drop rate | tokens/s (median) | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['loss']:.4f} | {r['eval_loss']:.4f} | {r['unigram_loss']:.4f} | "
              f"{r['drop_rate']:.4%} | {r['tokens_per_second_median']:,.0f} | {r['wall_s']:.0f} |")
    if len(rows) > 1:
        a = rows[0]["losses"]
        for r in rows[1:]:
            b = r["losses"]
            n = min(len(a), len(b))
            diff = max(abs(x - y) for x, y in zip(a[:n], b[:n], strict=True))
            print(f"max |loss {rows[0]['run']} - loss {r['run']}| over {n} logged steps: {diff:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
