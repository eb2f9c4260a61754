"""The ingest stage: every record read is either a normalized document or quarantined with a reason."""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from pydantic import ValidationError

from data.documents import DOCUMENTS_TYPE, datatrove_reader, iter_documents, record_from_datatrove
from data.ingest import (
    QUARANTINE_NAME,
    QUARANTINE_REASONS,
    REPORT_NAME,
    SAMPLE_CORPUS_DIR,
    SAMPLE_CORPUS_GLOB,
    STAGE,
    IngestParams,
    run,
)
from pipeline.stage import StageContext


def _jsonl(*records: object) -> bytes:
    return b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in records)


# messy.jsonl, line by line: (content, expected reason or None when ingested)
MESSY = [
    ({"id": "a", "text": "Hello world", "domain": "web", "source": "crawl-1",
      "metadata": {"lang": "en"}, "url": "http://x.test"}, None),
    (b'{"id": "b", "text": "unterminated', "bad_json"),
    (b'{"id": "c", "text": "caf\xe9 au lait"}', "invalid_utf8"),
    ({"id": "d", "body": "no text field"}, "missing_text"),
    ({"id": "e", "text": ""}, "empty_text"),
    ({"id": "f", "text": 42}, "text_not_string"),
    ([1, 2, 3], "not_an_object"),
    ({"id": "a", "text": "same id as line 1"}, "duplicate_id"),
    ({"text": "  keeps   its spacing \n"}, None),
    ({"id": [1], "text": "list id"}, "bad_id_type"),
    ({"id": "m", "text": "bad metadata", "metadata": [1]}, "bad_metadata_type"),
    (b"", "blank_line"),
    ({"id": 7, "text": "integer id", "domain": "code"}, None),
    ({"id": "w", "text": " \t\n"}, "empty_text"),
    ({"id": "g", "text": "bad domain", "domain": 3}, "bad_domain_type"),
]


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """messy.jsonl (one record of each malformed kind), clean.jsonl.gz and table.parquet."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "messy.jsonl").write_bytes(_jsonl(*(c for c, _ in MESSY)))
    (src / "clean.jsonl.gz").write_bytes(gzip.compress(_jsonl(
        {"text": "first", "domain": "books"}, {"text": "second", "domain": "books"}, {"text": "third"}),
        mtime=0))
    pq.write_table(pa.table({
        "id": ["p0", "p1", "p2"],
        "text": ["parquet zero", None, "parquet two"],
        "domain": ["web", "web", None],
        "score": [0.5, 0.1, 0.9],
    }), src / "table.parquet")
    return src


def _ingest(tmp_path: Path, out: str = "out", **params: object) -> StageContext:
    ctx = StageContext(tmp_path / out, stage_name="ingest")
    run(IngestParams(sample_corpus=False, **params), ctx)
    return ctx


def _quarantine(out_dir: Path) -> list[dict]:
    with gzip.open(out_dir / QUARANTINE_NAME, "rb") as f:
        return [orjson.loads(line) for line in f]


EXPECTED_REASONS = Counter(r for _, r in MESSY if r) + Counter({"missing_text": 1})  # + parquet null
EXPECTED_READ = len(MESSY) + 3 + 3
EXPECTED_INGESTED = EXPECTED_READ - sum(EXPECTED_REASONS.values())


def test_every_record_is_ingested_or_quarantined_with_its_reason(tmp_path, inputs):
    ctx = _ingest(tmp_path, paths=[str(inputs)])
    report = json.loads((ctx.out_dir / REPORT_NAME).read_text())
    assert report["read"] == EXPECTED_READ == report["ingested"] + report["quarantined"]
    assert report["ingested"] == EXPECTED_INGESTED == len(list(iter_documents(ctx.out_dir)))
    assert report["quarantined_by_reason"] == dict(EXPECTED_REASONS)
    assert ctx.rows == {"documents": EXPECTED_INGESTED, "quarantined": sum(EXPECTED_REASONS.values())}
    per_file = {f["file"].rsplit("/", 1)[1]: (f["read"], f["ingested"], f["quarantined"])
                for f in report["files"]}
    assert per_file == {"clean.jsonl.gz": (3, 3, 0), "messy.jsonl": (15, 3, 12), "table.parquet": (3, 2, 1)}


def test_quarantine_file_names_the_reason_of_each_bad_line(tmp_path, inputs):
    ctx = _ingest(tmp_path, paths=[str(inputs / "messy.jsonl"), str(inputs / "table.parquet")])
    rows = _quarantine(ctx.out_dir)
    got = {(Path(r["file"]).name, r["line"]): r["reason"] for r in rows}
    want = {("messy.jsonl", i): r for i, (_, r) in enumerate(MESSY, 1) if r}
    want[("table.parquet", 2)] = "missing_text"
    assert got == want
    assert all(set(r) == {"file", "line", "reason", "detail", "raw"} and r["detail"] for r in rows)
    by_line = {r["line"]: r for r in rows if r["file"].endswith("messy.jsonl")}
    assert by_line[3]["raw"] == '{"id": "c", "text": "caf\ufffd au lait"}'  # bytes kept, decoded leniently
    assert by_line[2]["raw"] == '{"id": "b", "text": "unterminated'
    assert "'a'" in by_line[8]["detail"]
    assert json.loads(by_line[7]["raw"]) == [1, 2, 3]


def test_long_bad_lines_are_truncated_in_quarantine(tmp_path):
    (tmp_path / "long.jsonl").write_bytes(b'{"text": "' + b"x" * 10_000 + b"\n")
    ctx = _ingest(tmp_path, paths=[str(tmp_path / "long.jsonl")])
    [row] = _quarantine(ctx.out_dir)
    assert row["reason"] == "bad_json" and len(row["raw"]) == 2048


def test_documents_are_normalized(tmp_path, inputs):
    ctx = _ingest(tmp_path, paths=[str(inputs / "messy.jsonl"), str(inputs / "table.parquet")],
                  default_domain="misc")
    docs = {d["id"]: d for d in iter_documents(ctx.out_dir)}
    messy = str(inputs / "messy.jsonl")
    assert docs["a"] == {"id": "a", "text": "Hello world", "source": "crawl-1", "domain": "web",
                         "metadata": {"lang": "en", "url": "http://x.test"}}
    assert docs["messy/9"] == {"id": "messy/9", "text": "  keeps   its spacing \n",  # text kept as is
                               "source": f"{messy}:9", "domain": "misc", "metadata": {}}
    assert docs["7"]["domain"] == "code"
    assert docs["p0"] == {"id": "p0", "text": "parquet zero", "source": f"{inputs / 'table.parquet'}:1",
                          "domain": "web", "metadata": {"score": 0.5}}
    assert docs["p2"]["domain"] == "misc"
    assert list(docs) == ["a", "messy/9", "7", "p0", "p2"]  # input order, then line order


def test_output_reads_back_through_datatrove(tmp_path, inputs):
    ctx = _ingest(tmp_path, paths=[str(inputs)])
    via_datatrove = [record_from_datatrove(d) for d in datatrove_reader(ctx.out_dir).run()]
    assert via_datatrove == list(iter_documents(ctx.out_dir))


def test_metrics_and_summary_reach_the_sink(tmp_path, inputs):
    ctx = _ingest(tmp_path, paths=[str(inputs)])
    sink = ctx.sink
    assert sink.last("read") == EXPECTED_READ
    assert sink.last("ingested") == EXPECTED_INGESTED
    assert sink.last("quarantined") == sum(EXPECTED_REASONS.values())
    assert ctx.summary == {"read": EXPECTED_READ, "ingested": EXPECTED_INGESTED,
                           "quarantined": sum(EXPECTED_REASONS.values())}
    for reason in QUARANTINE_REASONS:
        assert sink.last(f"quarantined.{reason}") == EXPECTED_REASONS[reason]
    # web: "Hello world" + "parquet zero"; books: first + second; unknown: 3 docs
    assert sink.last("docs.web") == 2 and sink.last("bytes.web") == len("Hello world") + len("parquet zero")
    assert sink.last("docs.books") == 2 and sink.last("docs.code") == 1 and sink.last("docs.unknown") == 3
    assert sink.last("files") == 3
    assert [p.name for p, _ in sink.artifacts] == [REPORT_NAME]


def test_quarantines_are_logged_as_a_warning(tmp_path, inputs, caplog):
    with caplog.at_level("WARNING", logger="hylight.stage.ingest"):
        _ingest(tmp_path, paths=[str(inputs / "messy.jsonl")])
    [msg] = [r.getMessage() for r in caplog.records if r.name == "hylight.stage.ingest"]
    assert "quarantined 12 of 15" in msg and "bad_json=1" in msg and "duplicate_id=1" in msg
    # the stage writes into a temp dir that is renamed on commit: the log names the file in the artifact
    assert "see quarantine.jsonl.gz in this stage's artifact" in msg
    assert str(tmp_path) not in msg


def test_two_runs_write_identical_bytes(tmp_path, inputs):
    a = _ingest(tmp_path, "a", paths=[str(inputs)]).out_dir
    b = _ingest(tmp_path, "b", paths=[str(inputs)]).out_dir
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert {str(f) for f in files} >= {"documents/part-00000.jsonl.gz", QUARANTINE_NAME, REPORT_NAME}
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_first_occurrence_of_an_id_wins_across_files(tmp_path):
    (tmp_path / "one.jsonl").write_bytes(_jsonl({"id": "x", "text": "from one"}))
    (tmp_path / "two.jsonl").write_bytes(_jsonl({"id": "x", "text": "from two"}, {"id": "y", "text": "y"}))
    ctx = _ingest(tmp_path, paths=[str(tmp_path / "two.jsonl"), str(tmp_path / "one.jsonl")])
    assert [(d["id"], d["text"]) for d in iter_documents(ctx.out_dir)] == [("x", "from two"), ("y", "y")]
    [q] = _quarantine(ctx.out_dir)
    assert (Path(q["file"]).name, q["line"], q["reason"]) == ("one.jsonl", 1, "duplicate_id")


def test_files_sharing_a_stem_get_distinct_generated_ids(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "part.jsonl").write_bytes(_jsonl({"text": f"from {sub}"}))
    (tmp_path / "other.jsonl").write_bytes(_jsonl({"text": "other"}))
    ctx = _ingest(tmp_path, paths=[str(tmp_path / "*" / "part.jsonl"), str(tmp_path / "other.jsonl")])
    ids = [d["id"] for d in iter_documents(ctx.out_dir)]
    assert ids == [f"{tmp_path}/a/part/1", f"{tmp_path}/b/part/1", "other/1"]


def test_relative_paths_and_globs_resolve_against_cwd_and_stay_relative(tmp_path, inputs, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ctx = _ingest(tmp_path, paths=["in/*.jsonl", "in/clean.jsonl.gz"])
    docs = list(iter_documents(ctx.out_dir))
    assert {d["source"] for d in docs if d["id"] == "messy/9"} == {"in/messy.jsonl:9"}
    assert [f["file"] for f in json.loads((ctx.out_dir / REPORT_NAME).read_text())["files"]] == [
        "in/messy.jsonl", "in/clean.jsonl.gz"]


def test_home_is_expanded(tmp_path, inputs, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    ctx = _ingest(tmp_path, paths=["~/in/clean.jsonl.gz"])
    assert ctx.summary["ingested"] == 3


def test_a_file_matched_twice_is_read_once(tmp_path, inputs):
    ctx = _ingest(tmp_path, paths=[str(inputs / "*.gz"), str(inputs / "clean.jsonl.gz"), str(inputs)])
    assert ctx.summary["read"] == EXPECTED_READ and ctx.summary["quarantined"] == sum(EXPECTED_REASONS.values())


def test_zstd_jsonl_is_read(tmp_path):
    (tmp_path / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        _jsonl({"text": "zstd one"}, b"not json", {"text": "zstd two"})))
    ctx = _ingest(tmp_path, paths=[str(tmp_path / "z.jsonl.zst")])
    assert ctx.summary == {"read": 3, "ingested": 2, "quarantined": 1}


def test_truncated_gzip_keeps_what_was_read_and_quarantines_the_rest(tmp_path):
    rng = random.Random(0)  # incompressible-ish text, so half the gzip holds many lines
    body = _jsonl(*({"text": " ".join(f"{rng.random():.6f}" for _ in range(30))} for _ in range(2000)))
    compressed = gzip.compress(body, mtime=0)
    (tmp_path / "cut.jsonl.gz").write_bytes(compressed[: len(compressed) // 2])
    ctx = _ingest(tmp_path, paths=[str(tmp_path / "cut.jsonl.gz")])
    [q] = _quarantine(ctx.out_dir)
    assert q["reason"] == "corrupt_file" and q["line"] == ctx.summary["ingested"] + 1
    assert 0 < ctx.summary["ingested"] < 2000
    assert ctx.summary["read"] == ctx.summary["ingested"] + 1


def test_unreadable_parquet_is_quarantined_as_corrupt(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    ctx = _ingest(tmp_path, paths=[str(tmp_path / "bad.parquet")])
    assert [(q["line"], q["reason"]) for q in _quarantine(ctx.out_dir)] == [(1, "corrupt_file")]
    assert ctx.summary == {"read": 1, "ingested": 0, "quarantined": 1}


def test_limit_caps_records_read_per_file(tmp_path, inputs):
    ctx = _ingest(tmp_path, paths=[str(inputs)], limit=2)
    report = json.loads((ctx.out_dir / REPORT_NAME).read_text())
    assert [(Path(f["file"]).name, f["read"], f["ingested"]) for f in report["files"]] == [
        ("clean.jsonl.gz", 2, 2), ("messy.jsonl", 2, 1), ("table.parquet", 2, 1)]


def test_min_chars_quarantines_short_text(tmp_path):
    (tmp_path / "s.jsonl").write_bytes(_jsonl({"text": "tiny"}, {"text": "long enough"}))
    ctx = _ingest(tmp_path, paths=[str(tmp_path / "s.jsonl")], min_chars=5)
    assert [q["reason"] for q in _quarantine(ctx.out_dir)] == ["too_short"]


def test_custom_keys_and_metadata_given_as_json_text(tmp_path):
    (tmp_path / "k.jsonl").write_bytes(_jsonl(
        {"doc_id": "k1", "content": "custom keys", "subset": "wiki", "origin": "dump", "metadata": '{"a": 1}'}))
    ctx = _ingest(tmp_path, paths=[str(tmp_path / "k.jsonl")], text_key="content", id_key="doc_id",
                  domain_key="subset", source_key="origin")
    assert list(iter_documents(ctx.out_dir)) == [
        {"id": "k1", "text": "custom keys", "source": "dump", "domain": "wiki", "metadata": {"a": 1}}]


def test_explicit_format_reads_unknown_extensions(tmp_path):
    (tmp_path / "data.txt").write_bytes(_jsonl({"text": "jsonl in a .txt"}))
    with pytest.raises(ValueError, match=r"cannot tell the format of .*data\.txt.*set format"):
        _ingest(tmp_path, paths=[str(tmp_path / "data.txt")])
    ctx = _ingest(tmp_path, "out2", paths=[str(tmp_path / "data.txt")], format="jsonl")
    assert [d["id"] for d in iter_documents(ctx.out_dir)] == ["data/1"]


def test_glob_matching_nothing_is_an_error_naming_the_pattern(tmp_path):
    pattern = str(tmp_path / "nowhere" / "*.jsonl")
    with pytest.raises(FileNotFoundError, match=r"matches no file") as e:
        _ingest(tmp_path, paths=[pattern])
    assert pattern in str(e.value)


def test_missing_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'missing\.jsonl' does not exist \(resolved against"):
        _ingest(tmp_path, paths=["missing.jsonl"])


def test_directory_without_known_files_is_an_error(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"matches no readable file"):
        _ingest(tmp_path, paths=[str(tmp_path / "d")])


@pytest.mark.parametrize(("params", "message"), [
    ({"sample_corpus": False, "unknown_field": 1}, "Extra inputs are not permitted"),
    ({"sample_corpus": False}, "ingest has no inputs"),
    ({"paths": ["x.jsonl"], "limit": 0}, "limit must be >= 1"),
    ({"paths": ["x.jsonl"], "min_chars": 0}, "min_chars must be >= 1"),
    ({"paths": [" "]}, r"paths\[0\] is empty"),
    ({"paths": ["x.jsonl"], "format": "csv"}, "'auto', 'jsonl' or 'parquet'"),
    ({"paths": ["x.jsonl"], "id_key": "text"}, "id_key and text_key are both 'text'"),
    ({"paths": ["x.jsonl"], "domain_key": "metadata"}, "reserved"),
])
def test_bad_params_are_rejected_with_a_clear_message(params, message):
    with pytest.raises(ValidationError, match=message):
        IngestParams(**params)


def test_missing_sample_corpus_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr("data.ingest_inputs.SAMPLE_CORPUS_DIR", tmp_path / "no_corpus")
    with pytest.raises(FileNotFoundError, match="sample corpus is missing"):
        run(IngestParams(), StageContext(tmp_path / "out"))


def test_sample_corpus_is_read_first_and_shown_package_relative(tmp_path, inputs, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "web.jsonl.gz").write_bytes(gzip.compress(_jsonl(
        {"id": "s1", "text": "sample", "source": "shipped", "domain": "web", "metadata": {}}), mtime=0))
    monkeypatch.setattr("data.ingest_inputs.SAMPLE_CORPUS_DIR", corpus)
    ctx = StageContext(tmp_path / "out")
    run(IngestParams(paths=[str(inputs / "clean.jsonl.gz")]), ctx)
    report = json.loads((ctx.out_dir / REPORT_NAME).read_text())
    assert [f["file"] for f in report["files"]] == ["data/sample_corpus/web.jsonl.gz", str(inputs / "clean.jsonl.gz")]
    assert next(iter_documents(ctx.out_dir))["id"] == "s1"


def test_glob_skips_files_of_unknown_format_with_a_warning(tmp_path, inputs, caplog):
    (inputs / "README.md").write_text("not data")
    with caplog.at_level("WARNING", logger="data.ingest"):
        ctx = _ingest(tmp_path, paths=[str(inputs / "*")])
    assert ctx.summary["read"] == EXPECTED_READ
    assert any("README.md" in r.getMessage() for r in caplog.records)


def test_stage_declaration():
    assert STAGE.name == "ingest" and STAGE.produces == DOCUMENTS_TYPE and STAGE.inputs == {}
    assert STAGE.params is IngestParams and STAGE.run is run and STAGE.doc


@pytest.mark.skipif(not any(SAMPLE_CORPUS_DIR.glob(SAMPLE_CORPUS_GLOB)),
                    reason=f"no sample corpus at {SAMPLE_CORPUS_DIR}/{SAMPLE_CORPUS_GLOB} yet")
def test_sample_corpus_ingests_cleanly(tmp_path):
    ctx = StageContext(tmp_path / "out", stage_name="ingest")
    run(IngestParams(), ctx)
    report = json.loads((ctx.out_dir / REPORT_NAME).read_text())
    assert report["quarantined"] == 0, report["quarantined_by_reason"]
    assert report["ingested"] == report["read"] > 0
    assert report["domains"] and all(d["docs"] > 0 and d["bytes"] > 0 for d in report["domains"].values())
    assert all(f["file"].startswith("data/sample_corpus/") for f in report["files"])


# --- spec validation (before anything runs) ------------------------------------------------------------
def test_validate_external_names_each_missing_path_entry(tmp_path, inputs):
    from data.ingest import STAGE

    params = IngestParams(paths=[str(inputs), str(tmp_path / "nope.jsonl"), str(tmp_path / "*.parquet")])
    problems = STAGE.validate_external(params)
    assert [f for f, _ in problems] == ["paths.1", "paths.2"]
    assert "'" + str(tmp_path / "nope.jsonl") + "' does not exist" in problems[0][1]
    assert "matches no file" in problems[1][1]
    assert STAGE.validate_external(IngestParams()) == []  # the shipped sample corpus is there


def test_spec_with_a_missing_ingest_path_fails_validation_and_creates_nothing(tmp_path):
    from pipeline.spec import SpecError, load_spec

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: t\nartifact_root: {tmp_path / 'runs'}\nstages:\n  ingest:\n    uses: ingest\n"
                    f"    params:\n      paths: [{tmp_path / 'missing.jsonl'}]\n")
    with pytest.raises(SpecError, match=r"spec.yaml:7: stage 'ingest', field params.paths.0: .*does not exist"):
        load_spec(spec)
    assert not (tmp_path / "runs").exists()
