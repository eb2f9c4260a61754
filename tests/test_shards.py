"""resources.tasks: clean, dedup, quality and mix split their work into shards (pipeline/shards.py).

The number of tasks is not in the cache key, so these tests pin what makes that right: for tasks = 1, 2, 3 each
stage writes the same artifact, file for file and byte for byte (dedup with duplicates planted across the shard
boundaries), and a stage holding every CPU of a 2-CPU Ray still gets its 1-CPU shard tasks run.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

import pytest

from data.documents import DocumentWriter, count_documents, iter_document_range, iter_documents
from data.ingest import SAMPLE_CORPUS_DIR
from pipeline.shards import split_ranges
from pipeline.stage import Artifact, Resources, StageContext

REPO = Path(__file__).resolve().parent.parent


def _digests(out: Path) -> dict[str, str]:
    """sha256 of every file of an artifact directory, by relative path."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def _artifact(path: Path, docs: list[dict], type_: str = "documents", shard_docs: int = 25) -> Artifact:
    with DocumentWriter(path, shard_docs=shard_docs) as w:  # several input files: ranges cross files
        for d in docs:
            w.write(d)
    return Artifact(path=path, manifest={"type": type_, "digest": "test-" + path.name})


def _run(kind, params, inputs: dict, out: Path, tasks: int, cpus: float = 1) -> StageContext:
    ctx = StageContext(out, inputs, stage_name=kind.name, resources=Resources(cpus=cpus, tasks=tasks))
    kind.run(params, ctx)
    return ctx


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    """96 sample-corpus documents, 24 per domain of code/legal/manual/prose (first of each, in corpus order)."""
    docs = []
    for name in ("code", "legal", "manual", "prose"):
        with gzip.open(SAMPLE_CORPUS_DIR / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for _, line in zip(range(24), f, strict=False)]
        docs += [{"id": r["id"], "text": r["text"], "source": r.get("source", name), "domain": name,
                  "metadata": {}} for r in rows]
    return docs


def _near_copy(doc: dict, new_id: str) -> dict:
    """The same text with one word changed in the middle (Jaccard with the original well above 0.8)."""
    words = doc["text"].split(" ")
    words[len(words) // 2] = "zyzzyva"
    return {**doc, "id": new_id, "text": " ".join(words)}


@pytest.fixture(scope="module")
def planted(corpus) -> tuple[list[dict], dict[str, str]]:
    """The corpus with duplicates whose originals sit in another shard for tasks = 2 and 3: an exact copy and a
    near copy of early documents at the end, and a near copy of a late one at the start. Returns the documents
    and {copy id: original id}."""
    long_docs = [d for d in corpus if len(d["text"].split()) > 300 and d["domain"] != "code"]
    first, second, last = long_docs[0], long_docs[1], long_docs[-1]
    copies = {"copy-exact": first["id"], "copy-near-early": second["id"], "copy-near-late": last["id"]}
    docs = [_near_copy(last, "copy-near-late"), *corpus, {**first, "id": "copy-exact"},
            _near_copy(second, "copy-near-early")]
    return docs, copies


# --- splitting --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, parts, align, expected", [
    (10, 1, 1, [(0, 10)]),
    (10, 3, 1, [(0, 3), (3, 6), (6, 10)]),
    (10, 20, 1, [(i, i + 1) for i in range(10)]),  # never an empty shard
    (0, 3, 1, [(0, 0)]),  # one empty shard: the stage still runs its merge
    (1100, 2, 512, [(0, 512), (512, 1100)]),  # inner boundaries on multiples of align
    (1100, 3, 512, [(0, 512), (512, 1024), (1024, 1100)]),
    (300, 2, 512, [(0, 300)]),
])
def test_split_ranges_cover_the_input_contiguously_with_aligned_boundaries(n, parts, align, expected):
    assert split_ranges(n, parts, align) == expected


def test_document_ranges_read_exactly_their_documents_across_files(planted, tmp_path):
    docs, _ = planted
    art = _artifact(tmp_path / "docs", docs, shard_docs=7)
    counts = count_documents(art.path)
    assert sum(counts) == len(docs) and len(counts) == -(-len(docs) // 7)
    ids = [d["id"] for d in docs]
    for a, b in [(0, 0), (0, 7), (5, 16), (13, len(docs)), (len(docs) - 1, len(docs) + 5)]:
        assert [r["id"] for r in iter_document_range(art.path, a, b, counts)] == ids[a:b]
        assert [r["id"] for r in iter_document_range(art.path, a, b)] == ids[a:b]


# --- each stage: the same artifact whatever the number of tasks ---------------------------------------
def test_clean_writes_the_same_artifact_for_1_2_and_3_tasks(planted, tmp_path):
    from data.clean import STAGE, CleanParams

    docs = [d for d in planted[0] if len(d["text"]) < 6000][:45]  # short ones: the filters cost ~1 s/100 kB here
    art = _artifact(tmp_path / "docs", docs, shard_docs=10)
    outs = {t: _run(STAGE, CleanParams(), {"documents": art}, tmp_path / f"clean{t}", tasks=t) for t in (1, 2, 3)}
    report = json.loads((outs[1].out_dir / "clean_report.json").read_text())
    assert report["in"] == len(docs) and 0 < report["kept"] < report["in"]  # the filters did work
    assert len(report["dropped_by_reason"]) >= 2
    digests = {t: _digests(ctx.out_dir) for t, ctx in outs.items()}
    assert any(k.startswith("documents/") for k in digests[1]) and "clean_report.json" in digests[1]
    assert digests[2] == digests[1] and digests[3] == digests[1]
    assert [len(ctx.shard_stats) for ctx in outs.values()] == [1, 2, 3]


def test_dedup_removes_duplicates_across_shards_and_writes_the_same_artifact_for_1_2_and_3_tasks(planted, tmp_path):
    from data.dedup import STAGE
    from data.dedup_params import DedupParams

    docs, copies = planted
    art = _artifact(tmp_path / "docs", docs)
    outs = {t: _run(STAGE, DedupParams(), {"documents": art}, tmp_path / f"dedup{t}", tasks=t) for t in (1, 2, 3)}
    kept = {t: [r["id"] for r in iter_documents(ctx.out_dir)] for t, ctx in outs.items()}
    by_id = {r["id"]: r for r in iter_documents(outs[1].out_dir)}
    for copy, original in copies.items():  # one of each pair is kept (the longer) with the other in its cluster
        assert (copy in by_id) != (original in by_id)
        rep, member = (copy, original) if copy in by_id else (original, copy)
        assert member in by_id[rep]["metadata"]["dup_members"]
    rows = outs[1].rows
    assert rows["exact_duplicate"] >= 1 and rows["near_duplicate"] >= 2
    assert len(kept[1]) + rows["exact_duplicate"] + rows["near_duplicate"] == len(docs)
    # the planted pairs straddle the shard boundaries of 2 and 3 tasks (signature docs split by position)
    for t in (2, 3):
        bounds = split_ranges(len(docs), t)
        pos = {d["id"]: i for i, d in enumerate(docs)}
        shard = {d: next(k for k, (a, b) in enumerate(bounds) if a <= pos[d] < b) for d in pos}
        assert all(shard[c] != shard[o] for c, o in copies.items())
        assert kept[t] == kept[1]
        assert _digests(outs[t].out_dir) == _digests(outs[1].out_dir)
    assert [len(ctx.shard_stats) for ctx in outs.values()] == [2, 4, 6]  # signatures + LSH bands


def test_dedup_estimate_mode_writes_the_same_artifact_for_1_and_2_tasks(planted, tmp_path):
    from data.dedup import STAGE
    from data.dedup_params import DedupParams

    art = _artifact(tmp_path / "docs", planted[0])
    params = DedupParams(verify="estimate", bands=11, rows=11)
    outs = {t: _run(STAGE, params, {"documents": art}, tmp_path / f"dedup{t}", tasks=t) for t in (1, 2)}
    assert outs[1].rows["near_duplicate"] >= 2
    assert _digests(outs[2].out_dir) == _digests(outs[1].out_dir)


def test_mix_tokenization_gives_the_same_mixture_for_1_2_and_3_tasks(tmp_path):
    from data.mix import STAGE, MixParams
    from data.tokenizer import TokenizerParams
    from data.tokenizer import run as train_tokenizer
    from tests.test_mix import _records

    records = _records(n=120)
    art = _artifact(tmp_path / "scored", records, type_="scored_documents")
    tctx = StageContext(tmp_path / "tok", inputs={"documents": art}, stage_name="tokenizer")
    train_tokenizer(TokenizerParams(vocab_size=300, eval_fraction=0.1), tctx)
    tok = Artifact(path=tctx.out_dir, manifest={"type": "tokenizer", "digest": "test-tokenizer"})
    params = MixParams(token_budget=20_000, on_budget_shortfall="shrink")
    outs = {t: _run(STAGE, params, {"documents": art, "tokenizer": tok}, tmp_path / f"mix{t}", tasks=t)
            for t in (1, 2, 3)}
    assert outs[1].rows["documents"] == len(records) and outs[1].rows["tokens"] > 0
    assert _digests(outs[2].out_dir) == _digests(outs[1].out_dir)
    assert _digests(outs[3].out_dir) == _digests(outs[1].out_dir)


@pytest.mark.slow  # loads the sentence encoder, labels and embeds 80 documents twice
def test_quality_writes_the_same_artifact_for_1_and_2_tasks(monkeypatch, tmp_path):
    import data.quality as quality
    import data.quality_embeddings as quality_embeddings
    from tests.test_quality import SMALL, _sample_corpus, _subset

    monkeypatch.setattr(quality_embeddings, "EMBED_CHUNK_DOCS", 20)  # 80 documents: 4 chunks, 2 per task
    docs = _subset(_sample_corpus(), 16)
    art = _artifact(tmp_path / "docs", docs)
    params = quality.QualityParams(**SMALL)
    outs = {t: _run(quality.STAGE, params, {"documents": art}, tmp_path / f"q{t}", tasks=t) for t in (1, 2)}
    assert outs[1].rows["documents"] == len(docs)
    assert [len(ctx.shard_stats) for ctx in outs.values()] == [1, 2]
    assert _digests(outs[2].out_dir) == _digests(outs[1].out_dir)


# --- under Ray --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_2cpus():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def _stage_task(tmp_path: Path, uses: str, params: dict, cpus: float, tasks: int, inputs: dict | None = None):
    from pipeline.runner import StageTask

    return StageTask(stage="s", uses=uses, params=params, inputs=inputs or {}, root=str(tmp_path / "runs"),
                     resources={"cpus": cpus, "tasks": tasks, "reserved_for_task": True},
                     key=os.urandom(32).hex(), key_material={}, cwd=str(REPO), env={})


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stage_holding_every_cpu_runs_its_shard_tasks_without_deadlock(ray_2cpus, tmp_path):
    from pipeline.runner import execute_stage

    ray = ray_2cpus
    stage = ray.remote(execute_stage).options(num_cpus=2, max_retries=0)  # holds both CPUs of the node
    task = _stage_task(tmp_path, "tests.stage_fixtures:SHARDS", {"shards": 3}, cpus=2, tasks=2)
    out = ray.get(stage.remote(task), timeout=180)
    seen = json.loads(Path(out.path, "shards.json").read_text())
    shards = seen["shards"]
    assert [s["shard"] for s in shards] == [0, 1, 2]  # results in shard order
    pids = {s["pid"] for s in shards}
    assert len(pids) == 3 and seen["stage_pid"] not in pids  # a fresh process per shard (max_calls=1)
    assert {s["omp"] for s in shards} == {"1"} and {s["cuda"] for s in shards} == {""}
    assert {s["cwd"] for s in shards} == {str(REPO)}

    failing = _stage_task(tmp_path, "tests.stage_fixtures:SHARDS", {"shards": 3, "fail": True}, cpus=2, tasks=2)
    with pytest.raises(ray.exceptions.RayTaskError, match=r"probe shard 2/3 failed: ValueError: shard 1 was told"):
        ray.get(stage.remote(failing), timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dedup_as_a_ray_stage_with_2_tasks_equals_the_one_task_artifact(ray_2cpus, planted, tmp_path):
    from data.dedup import STAGE
    from data.dedup_params import DedupParams
    from pipeline.runner import execute_stage

    ray = ray_2cpus
    art = _artifact(tmp_path / "docs", planted[0])
    (art.path / "manifest.json").write_text(json.dumps(art.manifest))
    one = _run(STAGE, DedupParams(), {"documents": art}, tmp_path / "one", tasks=1)
    stage = ray.remote(execute_stage).options(num_cpus=2, max_retries=0)
    task = _stage_task(tmp_path, "dedup", {}, cpus=2, tasks=2, inputs={"documents": [str(art.path)]})
    out = ray.get(stage.remote(task), timeout=240)
    got = {k: v for k, v in _digests(Path(out.path)).items() if k != "manifest.json"}
    assert got == _digests(one.out_dir)


# --- the spec -----------------------------------------------------------------------------------------
def test_spec_takes_tasks_only_for_kinds_that_split_work_and_refuses_an_artifact_root_url():
    from pipeline.spec import SpecError, build_spec

    stages = {"ing": {"uses": "ingest", "resources": {"tasks": 2}},
              "cl": {"uses": "clean", "needs": ["ing"], "resources": {"tasks": 3}}}
    with pytest.raises(SpecError) as e:
        build_spec({"name": "t", "artifact_root": "s3://bucket/runs", "stages": stages}, check_external=False)
    problems = e.value.problems
    assert len(problems) == 2, problems
    assert any("stage 'ing', field resources.tasks: asks for 2 tasks but kind 'ingest' does not split" in p
               for p in problems)
    assert any("field artifact_root: 's3://bucket/runs' is a URL" in p and "shared filesystem" in p for p in problems)
    stages["ing"]["resources"] = {}
    spec = build_spec({"name": "t", "artifact_root": "/shared/runs", "stages": stages}, check_external=False)
    assert spec.stages["cl"].resources.tasks == 3 and spec.stages["ing"].resources.tasks == 1
