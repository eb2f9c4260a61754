"""Dedup throughput, quality and memory: the ``dedup`` stage vs plain datatrove and datasketch.

1. Throughput on the shipped sample corpus (docs/s, MB/s, wall time of the whole dedup):
   - hylight ``dedup`` with its defaults (fast words, 20x6 bands x rows, exact dedup, ``verify: exact``),
     with ``verify: estimate`` at 11x11 (the previous default), with ``word_tokenizer: spacy``, and with
     decontamination against a set of eval passages;
   - datasketch: ``MinHashLSH(threshold=0.7, num_perm=128)`` over the same shingles, then the same
     longest-first exact-Jaccard resolution as ``verify: exact`` (near dedup only: no exact-dedup pass,
     no output written) -- the alternative to datatrove's LSH for the candidates;
   - plain datatrove: default ``MinhashConfig`` (14x8, 5-grams), default spaCy word tokenizer, the 4
     stages (signature, buckets, cluster, filter) through ``LocalPipelineExecutor`` with default
     executor settings (buckets: one task per bucket).
   And the signature step alone (the cost the word tokenizer drives): stock spaCy step, stock step
   with :class:`data.minhash.FastWordTokenizer` plugged in, and :class:`data.minhash.FastMinhashSignature`.
2. Quality on a planted set: real corpus documents + edited copies at a spread of Jaccard levels.
   Ground truth = every pair whose exact Jaccard (5-gram word shingles of datatrove's
   ``simplify_text``) is >= the threshold (0.8), over all pairs of the set. Reported: pair precision
   and recall of "in the same cluster"; "removed below threshold": removed documents whose reference
   Jaccard with their kept representative is under 0.8; and the share of planted copies clustered with
   their original per Jaccard bin (the empirical S-curve).
3. Memory on one long single-line document (``--long-words``): the stage in a fresh process per size,
   peak RSS of the process, and CPU seconds; ``--compare-module FILE`` runs an
   older ``data/dedup.py`` (``git show REV:data/dedup.py > FILE``) side by side.

Timings are the best of --repeats runs after a warm-up (the 2-core machine is shared, so wall time is
noisy; CPU seconds, including finished child processes, are the steadier measure). Run:

    OMP_NUM_THREADS=1 python bench/bench_dedup.py
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.documents import DocumentWriter, datatrove_reader  # noqa: E402
from data.ingest import SAMPLE_CORPUS_DIR  # noqa: E402

THRESHOLD = 0.8
REPLACEMENTS = ("lantern", "quokka", "marmalade", "zephyr", "harbour", "violin", "pebble", "orchard")
TARGETS = (0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
BINS = (0.0, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.01)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each fast config (best reported)")
    p.add_argument("--spacy-repeats", type=int, default=1, help="timed runs of each spaCy config")
    p.add_argument("--base-docs", type=int, default=300, help="real documents in the planted set")
    p.add_argument("--copies", type=int, default=240, help="edited copies planted")
    p.add_argument("--eval-items", type=int, default=500, help="eval passages for the decontamination row")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    p.add_argument("--sections", default="throughput,signature,quality,memory",
                   help="comma-separated subset of throughput, signature, quality, memory")
    p.add_argument("--no-spacy", action="store_true", help="skip the spaCy rows (the slowest, ~3 CPU-minutes)")
    p.add_argument("--long-words", type=int, nargs="*", default=[1_000_000, 4_000_000],
                   help="word counts of the long single-line document (memory section)")
    p.add_argument("--compare-module", default=None,
                   help="an older dedup module file to measure in the memory section too")
    return p.parse_args()


# --- inputs ------------------------------------------------------------------------------------------
def sample_records() -> list[dict]:
    records = []
    for path in sorted(SAMPLE_CORPUS_DIR.glob("*.jsonl.gz")):
        with gzip.open(path, "rb") as f:
            records += [orjson.loads(line) for line in f]
    return records


def write_documents(path: Path, records: list[dict]) -> Path:
    with DocumentWriter(path) as w:
        for r in records:
            w.write(r)
    return path


def _h(*parts: object) -> bytes:
    return hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()


def ref_words(text: str) -> list[str]:
    from datatrove.utils.text import TextNormConfig, simplify_text

    return simplify_text(text, TextNormConfig()).split()


def ref_shingles(words: list[str], n: int = 5) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def ref_jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def edited_copy(text: str, target: float) -> tuple[str, float]:
    """Substitute k evenly spaced words, k bisected so the copy's Jaccard is closest to ``target``."""
    words = text.split()
    base = ref_shingles(ref_words(text))

    def copy_with(k: int) -> tuple[str, float]:
        new = list(words)
        for j in range(k):
            new[int((j + 0.5) * len(words) / k)] = REPLACEMENTS[j % len(REPLACEMENTS)]
        copy = " ".join(new)
        return copy, ref_jaccard(base, ref_shingles(ref_words(copy)))

    if target >= 1.0:
        return " ".join(words), 1.0  # whitespace-normalized: same shingles, not byte-identical
    lo, hi = 1, max(2, len(words) // 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if copy_with(mid)[1] > target else (lo, mid)
    return min((copy_with(k) for k in (lo, hi)), key=lambda cj: abs(cj[1] - target))


def planted_set(records: list[dict], n_base: int, n_copies: int) -> tuple[list[dict], list[tuple[int, int, float]]]:
    """Real documents (80-3000 words, hash-sampled) + edited copies; (copy, original, J) per copy."""
    pool = sorted((r for r in records if 80 <= len(r["text"].split()) <= 3000), key=lambda r: _h("base", r["id"]))
    base = [dict(r) for r in pool[:n_base]]
    docs = list(base)
    planted = []
    for c in range(n_copies):
        orig = c % len(base)
        target = TARGETS[c % len(TARGETS)]
        text, j = edited_copy(base[orig]["text"], target)
        docs.append({**base[orig], "id": f"planted-{c:04d}/{base[orig]['id']}", "text": text})
        planted.append((len(docs) - 1, orig, j))
    return docs, planted


def true_pairs(docs: list[dict]) -> set[tuple[int, int]]:
    """All pairs with exact Jaccard >= THRESHOLD (sparse incidence product)."""
    from scipy import sparse

    vocab: dict[tuple[str, ...], int] = {}
    rows, cols = [], []
    for i, d in enumerate(docs):
        for s in ref_shingles(ref_words(d["text"])):
            rows.append(i)
            cols.append(vocab.setdefault(s, len(vocab)))
    x = sparse.csr_matrix((np.ones(len(rows), dtype=np.int32), (rows, cols)), shape=(len(docs), len(vocab)))
    sizes = np.asarray(x.sum(axis=1)).ravel()
    inter = (x @ x.T).tocoo()
    out = set()
    for i, j, v in zip(inter.row, inter.col, inter.data, strict=True):
        if i < j and v / (sizes[i] + sizes[j] - v) >= THRESHOLD:
            out.add((int(i), int(j)))
    return out


# --- the runs ----------------------------------------------------------------------------------------
def run_hylight(docs_dir: Path, out: Path, **params) -> tuple[float, dict[str, list[str]]]:
    """Wall time of the stage and its clusters (representative -> all member ids, itself included)."""
    from data.dedup import CLUSTERS_NAME, run
    from data.dedup_params import DedupParams
    from pipeline.stage import Artifact, StageContext

    shutil.rmtree(out, ignore_errors=True)
    ctx = StageContext(out, inputs={"documents": Artifact(path=docs_dir, manifest={"type": "documents"})},
                       stage_name="dedup")
    start = time.perf_counter()
    run(DedupParams(**params), ctx)
    wall = time.perf_counter() - start
    ctx.cleanup()
    clusters = {}
    with gzip.open(out / CLUSTERS_NAME, "rb") as f:
        for row in map(orjson.loads, f):
            clusters[row["representative"]] = [row["representative"], *(m["id"] for m in row["members"])]
    return wall, clusters


def run_datatrove(docs_dir: Path, work: Path) -> tuple[float, dict[int, list[int]]]:
    """The plain 4-stage datatrove MinHash pipeline with defaults; clusters as doc-index lists."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.binaryio import read_tuples_from_file

    shutil.rmtree(work, ignore_errors=True)
    config = MinhashConfig()
    start = time.perf_counter()
    LocalPipelineExecutor([datatrove_reader(docs_dir), MinhashDedupSignature(str(work / "sigs"), config=config)],
                          tasks=1, logging_dir=str(work / "logs/1")).run()
    LocalPipelineExecutor([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=config)],
                          tasks=config.num_buckets, logging_dir=str(work / "logs/2")).run()
    # save_cluster_id only adds an output file (to score the clusters); it changes no decision
    LocalPipelineExecutor([MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=config,
                                               save_cluster_id=True)],
                          tasks=1, logging_dir=str(work / "logs/3")).run()
    LocalPipelineExecutor([datatrove_reader(docs_dir),
                           MinhashDedupFilter(str(work / "remove"),
                                              exclusion_writer=JsonlWriter(str(work / "removed"))),
                           JsonlWriter(str(work / "output"))],
                          tasks=1, logging_dir=str(work / "logs/4")).run()
    wall = time.perf_counter() - start
    clusters: dict[int, list[int]] = defaultdict(list)
    cluster_file = work / "remove" / "000000.clusters"
    if cluster_file.exists():
        with open(cluster_file, "rb") as f:
            for doc, cid in read_tuples_from_file(f, "2I", lines_to_buffer=-1):
                clusters[cid].append(doc)
    return wall, dict(clusters)


def run_datasketch(docs_dir: Path, threshold: float = 0.8, lsh_threshold: float = 0.7,
                   num_perm: int = 128) -> tuple[float, dict[str, list[str]]]:
    """datasketch MinHashLSH candidates + the stage's longest-first exact resolution (in memory)."""
    from datasketch import MinHash, MinHashLSH

    from data.documents import iter_documents
    from data.minhash import Shingler, jaccard

    start = time.perf_counter()
    shingler, lsh = Shingler(), MinHashLSH(threshold=lsh_threshold, num_perm=num_perm)
    ids, lengths, sets, hashes = [], [], [], []
    for rec in iter_documents(docs_dir):
        sh = np.unique(shingler.shingles(rec["text"], 5))
        ids.append(rec["id"])
        lengths.append(len(" ".join(rec["text"].split())))
        sets.append(sh)
        m = MinHash(num_perm=num_perm, seed=1, scheme="affine64", hashfunc=int)
        if len(sh):
            m.update_batch(sh.tolist())
            lsh.insert(len(ids) - 1, m, check_duplication=False)
        hashes.append(m)
    placed: set[int] = set()
    clusters: dict[str, list[str]] = {}
    for r in sorted(range(len(ids)), key=lambda i: (-lengths[i], ids[i])):
        if r in placed or not len(sets[r]):
            continue
        placed.add(r)
        members = [c for c in sorted(set(lsh.query(hashes[r])) - placed) if jaccard(sets[r], sets[c]) >= threshold]
        placed.update(members)
        if members:
            clusters[ids[r]] = [ids[r], *(ids[c] for c in members)]
    return time.perf_counter() - start, clusters


def signature_only(texts: list[str], kind: str, work: Path) -> float:
    """Seconds to shingle + sign ``texts`` with one signature-step variant."""
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature

    from data.minhash import FastMinhashSignature, FastWordTokenizer

    config = MinhashConfig(num_buckets=20, hashes_per_bucket=6)
    if kind == "fast":
        step = FastMinhashSignature(str(work), config)
    else:
        step = MinhashDedupSignature(str(work), config=config)
        if kind == "plugged":
            step.word_tokenizer = FastWordTokenizer()
        else:
            step.word_tokenizer.word_tokenize("warm up spaCy")  # load the blank pipeline outside the timing
    start = time.perf_counter()
    for t in texts:
        sh = step.get_shingles(t)
        if sh.size:
            step.get_signature(sh)
    return time.perf_counter() - start


def pair_scores(pred_clusters: list[list[int]], truth: set[tuple[int, int]]) -> tuple[float, float, int]:
    pred = {(min(a, b), max(a, b)) for c in pred_clusters for i, a in enumerate(c) for b in c[i + 1:]}
    tp = len(pred & truth)
    return (tp / len(pred) if pred else float("nan")), (tp / len(truth) if truth else float("nan")), len(pred)


def kept_duplicate_pairs(clusters: list[list[int]], truth: set[tuple[int, int]]) -> int:
    """Pairs at or above THRESHOLD whose two documents are both kept (what dedup should leave none of).
    Clusters list the kept document first."""
    removed = {m for c in clusters for m in c[1:]}
    return sum(a not in removed and b not in removed for a, b in truth)


def removed_below(clusters: list[list[int]], docs: list[dict]) -> tuple[int, int]:
    """(removed documents whose reference Jaccard with the cluster's kept first member is < THRESHOLD,
    removed documents). Clusters list the kept document first (hylight, datasketch rows)."""
    below = removed = 0
    for c in clusters:
        kept = ref_shingles(ref_words(docs[c[0]]["text"]))
        for m in c[1:]:
            removed += 1
            below += ref_jaccard(kept, ref_shingles(ref_words(docs[m]["text"]))) < THRESHOLD
    return below, removed


_RSS_PROBE = """
import importlib.util, json, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
spec = importlib.util.spec_from_file_location("dedup_under_test", sys.argv[3])
mod = sys.modules["dedup_under_test"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(mod)
from pipeline.stage import Artifact, StageContext
ctx = StageContext(Path(sys.argv[2]), inputs={"documents": Artifact(path=Path(sys.argv[1]),
                   manifest={"type": "documents"})}, stage_name="dedup")
cpu = time.process_time()
mod.run(mod.DedupParams(), ctx)
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "cpu_s": time.process_time() - cpu}))
"""


def long_document_rss(module: Path, words: int, tmp: Path) -> dict[str, float]:
    """Peak RSS of a fresh process running the stage (imports included) and the stage's CPU seconds, on
    one ``words``-word single-line document (none for words=0) + 20 short documents."""
    import subprocess

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=k)) for k in rng.integers(2, 10, size=5000)]
    pick = rng.integers(0, len(vocab), size=words + 20 * 300)
    docs = [{"id": "long", "text": " ".join(vocab[i] for i in pick[:words]), "source": "bench",
             "domain": "prose", "metadata": {}}] if words else []
    docs += [{"id": f"short-{k}", "text": " ".join(vocab[i] for i in pick[words + 300 * k:words + 300 * (k + 1)]),
              "source": "bench", "domain": "prose", "metadata": {}} for k in range(20)]
    docs_dir = write_documents(tmp / f"long-{words}", docs)
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(docs_dir), str(tmp / f"long-out-{words}"),
                          str(module), str(repo)], capture_output=True, text=True, cwd=repo)
    if out.returncode:
        raise RuntimeError(f"the memory probe failed on {module} ({words} words):\n{out.stderr[-3000:]}")
    shutil.rmtree(docs_dir, ignore_errors=True)
    shutil.rmtree(tmp / f"long-out-{words}", ignore_errors=True)
    return {"chars": len(docs[0]["text"]) if words else 0} | orjson.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="bench_dedup_"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        _main(args, tmp)
    finally:
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)


def _eval_items(records: list[dict], tmp: Path, n: int) -> tuple[list[dict], Path]:
    """Eval passages for the decontamination row: 60-word windows of prose documents, hash-sampled."""
    prose = sorted((r for r in records if r["domain"] == "prose" and len(r["text"].split()) > 200),
                   key=lambda r: _h("eval", r["id"]))
    items = []
    for k in range(n):
        words = prose[k % len(prose)]["text"].split()
        start = (k * 37) % max(1, len(words) - 60)
        items.append({"id": f"item-{k}", "text": " ".join(words[start:start + 60])})
    eval_path = tmp / "eval.jsonl.gz"
    with gzip.open(eval_path, "wb") as f:
        f.writelines(orjson.dumps(i) + b"\n" for i in items)
    return items, eval_path


def _best(fn, repeats: int) -> tuple[float, float]:
    """Best wall seconds and best CPU seconds (this process + finished child processes)."""
    walls, cpus = [], []
    for _ in range(repeats):
        cpu0 = _cpu_seconds()
        walls.append(fn()[0])
        cpus.append(_cpu_seconds() - cpu0)
    return min(walls), min(cpus)


def _throughput(args: argparse.Namespace, tmp: Path, records: list[dict], corpus: Path) -> list[tuple]:
    items, eval_path = _eval_items(records, tmp, args.eval_items)
    rows = []
    # warm-up first (imports, datatrove's dependency checks, page cache)
    run_hylight(write_documents(tmp / "warmup", records[:200]), tmp / "out")
    configs = [
        ("hylight dedup, defaults (fast words, 20x6, verify: exact)", {}, args.repeats),
        ("hylight dedup, verify: estimate, 11x11 (the previous default)",
         {"verify": "estimate", "bands": 11, "rows": 11}, args.repeats),
        (f"hylight dedup, defaults + decontamination ({len(items)} items)",
         {"decontaminate_paths": [str(eval_path)]}, args.repeats),
    ]
    if not args.no_spacy:
        configs.insert(2, ("hylight dedup, spaCy words, 20x6", {"word_tokenizer": "spacy"}, args.spacy_repeats))
    for name, params, repeats in configs:
        wall, cpu = _best(lambda p=params: run_hylight(corpus, tmp / "out", **p), repeats)
        rows.append((name, wall, cpu))
        print(f"{name}: {wall:.1f}s wall, {cpu:.1f}s CPU", file=sys.stderr)
    wall, cpu = _best(lambda: run_datasketch(corpus), args.repeats)
    rows.append(("datasketch MinHashLSH(0.7, 128 perms) + exact Jaccard (near dedup only, no output)", wall, cpu))
    print(f"datasketch: {wall:.1f}s wall, {cpu:.1f}s CPU", file=sys.stderr)
    if not args.no_spacy:
        wall, cpu = _best(lambda: run_datatrove(corpus, tmp / "dt"), args.spacy_repeats)
        rows.append(("plain datatrove: MinhashConfig() 14x8, spaCy, 4 stages, LocalPipelineExecutor", wall, cpu))
        print(f"datatrove: {wall:.1f}s wall, {cpu:.1f}s CPU", file=sys.stderr)
    return rows


def _signatures(args: argparse.Namespace, tmp: Path, records: list[dict]) -> list[tuple]:
    texts = [r["text"] for r in records]
    kinds = [("plugged", "same step, FastWordTokenizer plugged in", args.repeats),
             ("fast", "FastMinhashSignature (hylight default)", args.repeats)]
    if not args.no_spacy:
        kinds.insert(0, ("spacy", "datatrove MinhashDedupSignature (spaCy)", args.spacy_repeats))
    sig_rows = []
    for kind, label, repeats in kinds:
        secs = min(signature_only(texts, kind, tmp / f"sig-{kind}") for _ in range(repeats))
        sig_rows.append((label, secs))
        print(f"signature {kind}: {secs:.1f}s", file=sys.stderr)
    return sig_rows


def _quality(args: argparse.Namespace, tmp: Path, records: list[dict]) -> tuple[list[tuple], list, list, set]:
    docs, planted = planted_set(records, args.base_docs, args.copies)
    planted_dir = write_documents(tmp / "planted", docs)
    truth = true_pairs(docs)
    index_of = {d["id"]: i for i, d in enumerate(docs)}
    quality = []
    for name, params in (("hylight default (20x6, verify: exact)", {}),
                         ("hylight verify: estimate, 11x11 (the previous default)",
                          {"verify": "estimate", "bands": 11, "rows": 11})):
        _, clusters = run_hylight(planted_dir, tmp / "pout", **params)
        quality.append((name, [[index_of[i] for i in c] for c in clusters.values()], True))
    _, ds_clusters = run_datasketch(planted_dir)
    quality.append(("datasketch MinHashLSH(0.7) + exact Jaccard",
                    [[index_of[i] for i in c] for c in ds_clusters.values()], True))
    if not args.no_spacy:
        _, dt_clusters = run_datatrove(planted_dir, tmp / "pdt")
        quality.append(("plain datatrove (14x8, spaCy)", list(dt_clusters.values()), False))
    return quality, docs, planted, truth


def _memory(args: argparse.Namespace, tmp: Path) -> list[tuple]:
    from data import dedup

    modules = [("hylight dedup (this tree)", Path(dedup.__file__))]
    if args.compare_module:
        modules.append((f"{args.compare_module}", Path(args.compare_module)))
    memory = []
    for label, module in modules:
        for words in [0, *args.long_words]:
            m = long_document_rss(module, words, tmp)
            memory.append((label, words, m))
            print(f"memory {label} {words} words: {m}", file=sys.stderr)
    return memory


def _print_quality(args: argparse.Namespace, quality: list[tuple], docs: list, planted: list, truth: set) -> None:
    print(f"\n**Quality** on a planted set: {args.base_docs} corpus documents + {len(planted)} edited copies "
          f"(targets {', '.join(map(str, TARGETS))}); ground truth: {len(truth)} pairs with exact "
          f"Jaccard >= {THRESHOLD} over all pairs of the {len(docs)} documents.\n")
    print("| config | predicted pairs | pair precision | pair recall | removed below threshold | "
          "kept pairs >= threshold |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, clusters, rep_first in quality:
        p, r, n = pair_scores(clusters, truth)
        below = "{} of {}".format(*removed_below(clusters, docs)) if rep_first else "-"
        kept = kept_duplicate_pairs(clusters, truth) if rep_first else "-"
        print(f"| {name} | {n} | {p:.3f} | {r:.3f} | {below} | {kept} |")
    print("\nShare of planted copies put in the same cluster as their original, by exact Jaccard:\n")
    header = [f"[{lo:.2f}, {min(hi, 1.0):.2f}{']' if hi > 1 else ')'}" for lo, hi in zip(BINS, BINS[1:], strict=False)]
    print("| config | " + " | ".join(header) + " |\n| --- |" + " ---: |" * len(header))
    counts = [sum(lo <= j < hi for _, _, j in planted) for lo, hi in zip(BINS, BINS[1:], strict=False)]
    print("| copies in bin | " + " | ".join(map(str, counts)) + " |")
    for name, clusters, _ in quality:
        cluster_of = {i: k for k, c in enumerate(clusters) for i in c}
        cells = []
        for lo, hi in zip(BINS, BINS[1:], strict=False):
            inbin = [(c, o) for c, o, j in planted if lo <= j < hi]
            hit = sum(c in cluster_of and cluster_of.get(o) == cluster_of[c] for c, o in inbin)
            cells.append(f"{hit / len(inbin):.2f}" if inbin else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")


def _main(args: argparse.Namespace, tmp: Path) -> None:
    import datatrove
    import spacy

    sections = set(args.sections.split(","))
    records = sample_records()
    corpus = write_documents(tmp / "corpus", records)
    n_docs = len(records)
    mb = sum(len(r["text"].encode()) for r in records) / 1e6
    print(f"sample corpus: {n_docs} documents, {mb:.1f} MB of text", file=sys.stderr)
    rows = _throughput(args, tmp, records, corpus) if "throughput" in sections else []
    sig_rows = _signatures(args, tmp, records) if "signature" in sections else []
    quality = _quality(args, tmp, records) if "quality" in sections else None
    memory = _memory(args, tmp) if "memory" in sections else []

    # -- print ------------------------------------------------------------------------------------
    cmd = "OMP_NUM_THREADS=1 python " + " ".join(sys.argv)
    print(f"\n### dedup benchmark\n\n`{cmd}`  \n"
          f"python {platform.python_version()}, datatrove {getattr(datatrove, '__version__', None) or _v('datatrove')}, "
          f"datasketch {_v('datasketch')}, spacy {spacy.__version__}, numpy {np.__version__}; "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}); best of "
          f"{args.repeats} (spaCy rows: {args.spacy_repeats}) runs on a shared machine.\n")
    if rows:
        print(f"**Throughput**, sample corpus ({n_docs} documents, {mb:.1f} MB):\n")
        print("| pipeline | wall s | CPU s | docs/s (wall) | MB/s (wall) |\n| --- | ---: | ---: | ---: | ---: |")
        for name, wall, cpu in rows:
            print(f"| {name} | {wall:.1f} | {cpu:.1f} | {n_docs / wall:,.0f} | {mb / wall:.2f} |")
    if sig_rows:
        print("\n**Signature step alone** (shingling + MinHash signature, 20x6, same corpus):\n")
        print("| signature step | s | docs/s | MB/s |\n| --- | ---: | ---: | ---: |")
        for name, secs in sig_rows:
            print(f"| {name} | {secs:.1f} | {n_docs / secs:,.0f} | {mb / secs:.2f} |")
    if quality:
        _print_quality(args, *quality)
    if memory:
        print("\n**Memory**: one single-line document of N words + 20 short ones (N = 0: the short ones only), "
              "the stage with its defaults in a fresh process; peak RSS of the process, imports included:\n")
        print("| module | words | MB of text | peak RSS MB | stage CPU s |\n| --- | ---: | ---: | ---: | ---: |")
        for label, words, m in memory:
            print(f"| {label} | {words:,} | {m['chars'] / 1e6:.1f} | {m['peak_rss_mb']:,.0f} | {m['cpu_s']:.1f} |")


def _cpu_seconds() -> float:
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _v(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
