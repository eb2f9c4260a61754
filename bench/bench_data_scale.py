"""Data stages at scale: ingest -> clean -> dedup -> quality -> mix's tokenization, with 1 and 2 Ray tasks.

1. ``--scale K`` builds a synthetic corpus of K x the sample corpus's documents (``data/sample_corpus``),
   reproducibly (seed 0): copy 0 is the corpus itself; in every further copy each document becomes, by a hash of
   (copy, id), an exact duplicate (10%), a near duplicate (40%: 2% of its words replaced, Jaccard ~0.9 with the
   original) or a new document (50%: its paragraphs in another order and 35% of its words replaced), so dedup
   has exact, near and no-duplicate work in known shares and clean sees the sample corpus's mix of domains.
2. Each stage runs in a fresh Ray worker process (``max_calls=1``) holding 1 CPU of a local 2-CPU Ray, through
   its real entry point, with ``resources.tasks`` = each of ``--tasks`` (its shards are then 1-CPU Ray tasks,
   pipeline/shards.py); stage k+1 reads stage k's output of the same task count. Reported per stage and task
   count: wall seconds, documents/s (documents in / wall), the peak RSS of the stage's process and of each shard
   task (``ru_maxrss`` of fresh processes), and the sha256 over the output's files (equal for every task count).
   The mixture's tokenization is ``data.mix.read_scored_documents`` (token counts of every document with the
   trained tokenizer); the tokenizer is trained once, on copy 0's deduplicated documents, and not timed.

    OMP_NUM_THREADS=1 python bench/bench_data_scale.py --scale 1 --tasks 1 2
    OMP_NUM_THREADS=1 python bench/bench_data_scale.py --scale 100 --tasks 2 --stages ingest dedup mix

The 2-core machine is shared: wall times are noisy (compare the CPU-bound stages' docs/s only between runs
taken together).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STAGES = ("ingest", "clean", "dedup", "quality", "mix")
FILLER = ("system data value file process user table option default current network memory output report "
          "library module version record sample change support return format service error access").split()


# --- the synthetic corpus ---------------------------------------------------------------------------
def _unit(*parts: Any) -> float:
    h = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def _replace_words(text: str, share: float, rng: random.Random) -> str:
    words = text.split(" ")
    for i in range(len(words)):
        if rng.random() < share:
            words[i] = rng.choice(FILLER)
    return " ".join(words)


def variant(doc: dict[str, Any], copy: int) -> tuple[dict[str, Any], str]:
    """Copy ``copy`` (>= 1) of a sample document: (record, kind) with kind exact / near / new."""
    u = _unit("kind", copy, doc["id"])
    rng = random.Random(f"{copy}\0{doc['id']}")
    text = doc["text"]
    if u < 0.10:
        kind = "exact"
    elif u < 0.50:
        kind, text = "near", _replace_words(text, 0.02, rng)
    else:
        paragraphs = text.split("\n\n")
        rng.shuffle(paragraphs)
        kind, text = "new", _replace_words("\n\n".join(paragraphs), 0.35, rng)
    return {**doc, "id": f"{doc['id']}#{copy}", "text": text}, kind


def build_corpus(out: Path, scale: int) -> dict[str, int]:
    """K x the sample corpus as JSONL.gz files under ``out`` (one per domain file and copy); returns counts."""
    from data.ingest import SAMPLE_CORPUS_DIR

    out.mkdir(parents=True, exist_ok=True)
    done = out / "corpus.json"
    if done.exists() and json.loads(done.read_text())["scale"] == scale:
        return json.loads(done.read_text())["counts"]
    counts: dict[str, int] = {"documents": 0, "original": 0, "exact": 0, "near": 0, "new": 0}
    for path in sorted(SAMPLE_CORPUS_DIR.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            docs = [json.loads(line) for line in f]
        for copy in range(scale):
            name = out / f"{path.name.removesuffix('.jsonl.gz')}-{copy:04d}.jsonl.gz"
            with gzip.open(name, "wt", encoding="utf-8", compresslevel=1) as f:
                for doc in docs:
                    rec, kind = (doc, "original") if copy == 0 else variant(doc, copy)
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    counts[kind] += 1
                    counts["documents"] += 1
    done.write_text(json.dumps({"scale": scale, "counts": counts}))
    return counts


# --- running a stage in a fresh process -------------------------------------------------------------
def run_stage(kind_name: str, params: dict[str, Any], inputs: dict[str, str], out: str, tasks: int,
              cwd: str) -> dict[str, Any]:
    """Body of a fresh 1-CPU Ray worker: the stage's entry point with resources.tasks = ``tasks``."""
    import shutil

    from pipeline.registry import resolve
    from pipeline.shards import RayShardRunner
    from pipeline.stage import Artifact, Resources, StageContext, peak_rss_mib
    from pipeline.worker_env import apply_env_defaults

    os.chdir(cwd)
    apply_env_defaults(gpus=0)
    kind = resolve(kind_name)
    arts = {role: Artifact(Path(p), {"type": t, "digest": f"bench-{Path(p).name}"})
            for role, (p, t) in ((r, v.split("|")) for r, v in inputs.items())}
    if kind_name == "quality":  # mix reads scored documents; quality's input is plain documents
        arts = {r: Artifact(a.path, {**a.manifest, "type": "documents"}) for r, a in arts.items()}
    shutil.rmtree(out, ignore_errors=True)
    ctx = StageContext(out, arts, stage_name=kind_name, resources=Resources(cpus=1, tasks=tasks))
    if tasks > 1:
        ctx.shard_runner = RayShardRunner(tasks)
    start = time.perf_counter()
    kind.run(kind.params.model_validate(params), ctx)
    seconds = time.perf_counter() - start
    ctx.cleanup()
    return {"seconds": seconds, "peak_rss_mib": peak_rss_mib(), "rows": ctx.rows, "summary": ctx.summary,
            "shards": [{"what": i, "seconds": round(s.seconds, 1), "peak_rss_mib": round(s.peak_rss_mib)}
                       for i, s in enumerate(ctx.shard_stats)]}


def tokenize_only(docs: str, tokenizer: str, tasks: int, cwd: str, scratch: str) -> dict[str, Any]:
    """mix's tokenization alone (data.mix.read_scored_documents), in a fresh 1-CPU Ray worker."""
    import numpy as np

    from data.mix import read_scored_documents
    from pipeline.shards import RayShardRunner
    from pipeline.stage import Resources, StageContext, peak_rss_mib
    from pipeline.worker_env import apply_env_defaults

    os.chdir(cwd)
    apply_env_defaults(gpus=0)
    ctx = StageContext(scratch, stage_name="mix", resources=Resources(1, tasks=tasks))
    if tasks > 1:
        ctx.shard_runner = RayShardRunner(tasks)
    start = time.perf_counter()
    table = read_scored_documents(Path(docs), Path(tokenizer) / "tokenizer.json", ctx)
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(np.asarray(table.tokens, dtype=np.int64).tobytes()
                            + "\n".join(table.ids).encode()).hexdigest()
    return {"seconds": seconds, "peak_rss_mib": peak_rss_mib(), "rows": {"documents": len(table),
            "tokens": int(np.asarray(table.tokens).sum())}, "digest": digest,
            "shards": [{"seconds": round(s.seconds, 1), "peak_rss_mib": round(s.peak_rss_mib)}
                       for s in ctx.shard_stats]}


def output_digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(out)).encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=1, help="copies of the sample corpus (100: the issue's 100x)")
    ap.add_argument("--tasks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hylight-bench-scale"))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    import ray

    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(k, v)
    work = args.work / f"x{args.scale}"
    t0 = time.perf_counter()
    counts = build_corpus(work / "corpus", args.scale)
    print(f"corpus x{args.scale}: {counts} ({time.perf_counter() - t0:.0f}s)", flush=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=True)
    stage_task = ray.remote(max_calls=1)(run_stage).options(num_cpus=1, max_retries=0)
    tok_task = ray.remote(max_calls=1)(tokenize_only).options(num_cpus=1, max_retries=0)
    cwd = str(REPO)
    results: list[dict[str, Any]] = []
    plan: dict[str, tuple[dict[str, Any], str | None]] = {  # params, upstream stage
        "ingest": ({"paths": [str(work / "corpus" / "*.jsonl.gz")], "sample_corpus": False}, None),
        "clean": ({}, "ingest"),
        "dedup": ({}, "clean"),
        "quality": ({"max_tokens": 64}, "dedup"),  # as dags/tiny.yaml
    }
    for tasks in args.tasks:
        runs = work / f"tasks{tasks}"
        for name in args.stages:
            if name == "mix":
                docs = runs / "quality" if "quality" in args.stages else runs / "dedup"
                tokenizer = work / "tokenizer"
                if not tokenizer.exists():
                    ray.get(stage_task.remote("tokenizer", {"vocab_size": 8192}, {
                        "documents": f"{docs}|documents"}, str(tokenizer), 1, cwd))
                res = ray.get(tok_task.remote(str(docs), str(tokenizer), tasks, cwd, str(work / "tok-scratch")))
                n_in = res["rows"]["documents"]
            else:
                params, upstream = plan[name]
                if name == "ingest":  # ingest does not split its work: once, for every task count
                    if tasks != args.tasks[0]:
                        continue
                    out, stage_tasks = work / "ingest", 1
                else:
                    out, stage_tasks = runs / name, tasks
                inputs = {}
                if upstream:
                    src = work / "ingest" if upstream == "ingest" else runs / upstream
                    inputs = {"documents": f"{src}|documents"}
                res = ray.get(stage_task.remote(name, params, inputs, str(out), stage_tasks, cwd))
                res["digest"] = output_digest(out)
                summary = res["summary"]
                n_in = int(summary.get("in", summary.get("documents", res["rows"].get("documents", 0))))
            row = {"stage": name, "tasks": tasks, "documents_in": n_in, "seconds": round(res["seconds"], 1),
                   "docs_per_s": round(n_in / res["seconds"], 1), "stage_peak_rss_mib": round(res["peak_rss_mib"]),
                   "shards": res["shards"], "rows": res["rows"], "digest": res["digest"][:16]}
            results.append(row)
            print(json.dumps(row), flush=True)
    ray.shutdown()
    print("\n| stage | tasks | documents in | wall s | docs/s | stage peak RSS MiB | shard tasks: s, peak RSS MiB | "
          "output sha256 |\n| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in results:
        shards = "; ".join(f"{s['seconds']}s {s['peak_rss_mib']}" for s in r["shards"]) if r["tasks"] > 1 else "-"
        print(f"| {r['stage']} | {r['tasks']} | {r['documents_in']} | {r['seconds']} | {r['docs_per_s']} | "
              f"{r['stage_peak_rss_mib']} | {shards} | {r['digest']} |")
    if args.json:
        args.json.write_text(json.dumps({"scale": args.scale, "corpus": counts, "results": results}, indent=2))


if __name__ == "__main__":
    main()
