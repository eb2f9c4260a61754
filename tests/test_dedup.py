"""Stage ``dedup``: planted near duplicates at measured Jaccard levels, exact duplicates, cluster
metadata on the representative, verification, decontamination, accounting and determinism.

Documents are real prose from the shipped sample corpus; copies are made by word substitutions and
their Jaccard (5-gram word shingles of datatrove's ``simplify_text``) is computed here, independently of
the stage's hashed shingles.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import orjson
import pytest
from datatrove.utils.text import TextNormConfig, simplify_text
from pydantic import ValidationError

from data.dedup import (
    CLUSTERS_NAME,
    CONTAMINATION,
    DROP_REASONS,
    DROPPED_SAMPLES_NAME,
    REPORT_NAME,
    STAGE,
    run,
)
from data.dedup_near import estimate_margin
from data.dedup_params import DedupParams
from data.documents import DUP_COUNT, DUP_MEMBERS, DocumentWriter, iter_documents
from data.ingest import SAMPLE_CORPUS_DIR
from data.minhash import FastWordTokenizer, Shingler, jaccard, simplify
from pipeline.stage import Artifact, Resources, StageContext

# small MinHash for tests: 16 bands x 4 rows (S-curve 0.5) pairs J >= 0.8 with probability > 0.999
SMALL = {"bands": 16, "rows": 4}
REPLACEMENTS = ("lantern", "quokka", "marmalade", "zephyr", "harbour", "violin", "pebble", "orchard")


# --- reference shingles (independent of the stage's hashing) ---------------------------------------
def ref_shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = simplify_text(text, TextNormConfig()).split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def ref_jaccard(a: str, b: str, n: int = 5) -> float:
    sa, sb = ref_shingles(a, n), ref_shingles(b, n)
    return len(sa & sb) / len(sa | sb)


def ref_containment(item: str, doc: str, n: int) -> float:
    si, sd = ref_shingles(item, n), ref_shingles(doc, n)
    return len(si & sd) / len(si)


def edit_to_jaccard(text: str, target: float) -> tuple[str, float]:
    """Substitute k evenly spaced words, k chosen (bisection) so the copy's Jaccard with ``text`` is
    closest to ``target``; returns the copy and its measured Jaccard."""
    words = text.split()

    def copy_with(k: int) -> tuple[str, float]:
        new = list(words)
        for j in range(k):
            new[int((j + 0.5) * len(words) / k)] = REPLACEMENTS[j % len(REPLACEMENTS)]
        copy = " ".join(new)
        return copy, ref_jaccard(text, copy)

    lo, hi = 1, len(words) // 2  # Jaccard falls as k grows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if copy_with(mid)[1] > target else (lo, mid)
    return min((copy_with(k) for k in (lo, hi)), key=lambda cj: abs(cj[1] - target))


@pytest.fixture(scope="module")
def prose() -> list[dict]:
    """Mutually distinct real prose documents of 150-1000 words from the sample corpus."""
    with gzip.open(SAMPLE_CORPUS_DIR / "prose.jsonl.gz", "rb") as f:
        records = [orjson.loads(line) for line in f]
    # prefer the Python docs and the Debian reference (plain prose) over package READMEs
    records.sort(key=lambda r: (not r["id"].startswith(("prose/python-docs", "prose/debian-reference")), r["id"]))
    picked: list[dict] = []
    shingles: list[set] = []
    for rec in records:
        if not 150 <= len(rec["text"].split()) <= 1000:
            continue
        s = ref_shingles(rec["text"])
        if all(len(s & t) / len(s | t) < 0.05 for t in shingles):
            picked.append(rec)
            shingles.append(s)
        if len(picked) == 16:
            break
    assert len(picked) == 16, "the sample corpus has too few distinct prose documents for these tests"
    return picked


def _doc(doc_id: str, text: str, domain: str = "prose", **metadata) -> dict:
    return {"id": doc_id, "text": text, "source": "test", "domain": domain, "metadata": metadata}


def _artifact(path: Path, records: list[dict]) -> Artifact:
    with DocumentWriter(path, shard_docs=7) as w:  # several shards
        for rec in records:
            w.write(rec)
    return Artifact(path=path, manifest={"type": "documents", "digest": path.name})


class Result:
    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.out = ctx.out_dir
        self.docs = {r["id"]: r for r in iter_documents(ctx.out_dir)}
        self.report = json.loads((ctx.out_dir / REPORT_NAME).read_text())
        with gzip.open(ctx.out_dir / CLUSTERS_NAME, "rb") as f:
            self.clusters = {row["representative"]: row for row in map(orjson.loads, f)}
        with gzip.open(ctx.out_dir / DROPPED_SAMPLES_NAME, "rb") as f:
            self.dropped = [orjson.loads(line) for line in f]

    def reason(self, doc_id: str) -> str:
        """kept, or the drop reason recorded for ``doc_id`` (clusters.jsonl or the dropped samples)."""
        if doc_id in self.docs:
            return "kept"
        for row in self.clusters.values():
            for m in row["members"]:
                if m["id"] == doc_id:
                    return m["reason"]
        for s in self.dropped:
            if s["id"] == doc_id:
                return s["reason"]
        raise AssertionError(f"{doc_id} is neither kept nor recorded as dropped")


def _run(tmp_path: Path, records: list[dict], name: str = "run", eval_sets: list[Artifact] | None = None,
         **params) -> Result:
    inputs: dict = {"documents": _artifact(tmp_path / f"{name}-in", records)}
    if eval_sets:
        inputs["eval_sets"] = eval_sets
    ctx = StageContext(tmp_path / name, inputs=inputs, stage_name="dedup")
    run(DedupParams(**params), ctx)
    return Result(ctx)


# --- planted near duplicates -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def planted(prose) -> dict:
    # the two longest first: copies of long documents reach the target Jaccard levels closely
    texts = sorted((r["text"] for r in prose[:10]), key=lambda t: -len(t.split()))
    base = [_doc(f"base-{i:02d}", t, domain=("prose" if i % 2 else "manual")) for i, t in enumerate(texts)]
    c95, j95 = edit_to_jaccard(base[0]["text"], 0.95)
    c90, j90 = edit_to_jaccard(base[0]["text"], 0.90)
    c50, j50 = edit_to_jaccard(base[1]["text"], 0.50)
    c20, j20 = edit_to_jaccard(base[1]["text"], 0.20)
    copies = [
        _doc("base-00.j95", c95), _doc("base-00.j90", c90), _doc("base-01.j50", c50), _doc("base-01.j20", c20),
        # same text with other whitespace: an exact duplicate
        _doc("base-02.ws", "  " + base[2]["text"].replace(" ", "   ").replace("\n", "\n\n") + "\n"),
        # upper-cased: not an exact duplicate (case kept), but the same shingles (J = 1)
        _doc("base-03.upper", base[3]["text"].upper()),
    ]
    return {"records": base + copies, "jaccard": {"base-00.j95": j95, "base-00.j90": j90,
                                                   "base-01.j50": j50, "base-01.j20": j20}}


@pytest.fixture(scope="module")
def planted_run(planted, tmp_path_factory) -> Result:
    return _run(tmp_path_factory.mktemp("planted"), planted["records"])  # the defaults: verify: exact


def test_planted_copies_are_at_the_intended_jaccard_levels(planted):
    j = planted["jaccard"]
    assert j["base-00.j95"] == pytest.approx(0.95, abs=0.02)
    assert j["base-00.j90"] == pytest.approx(0.90, abs=0.02)
    assert j["base-01.j50"] == pytest.approx(0.50, abs=0.03)
    assert j["base-01.j20"] == pytest.approx(0.20, abs=0.03)


def test_high_similarity_copies_removed_with_cluster_metadata_on_the_representative(planted, planted_run):
    r = planted_run
    texts = {d["id"]: d["text"] for d in planted["records"]}
    cluster = ["base-00", "base-00.j95", "base-00.j90"]
    # the documented rule: longest whitespace-collapsed text, ties by the smaller id
    rep = min(cluster, key=lambda i: (-len(" ".join(texts[i].split())), i))
    assert set(cluster) & set(r.docs) == {rep}
    meta = r.docs[rep]["metadata"]
    assert meta[DUP_COUNT] == 3
    assert sorted(meta[DUP_MEMBERS]) == sorted(set(cluster) - {rep})
    for member in set(cluster) - {rep}:
        assert r.reason(member) == "near_duplicate"
    # the verified Jaccard recorded for each member is the exact Jaccard with the representative
    for m in r.clusters[rep]["members"]:
        assert m["duplicate_of"] == rep
        assert m["jaccard"] == pytest.approx(ref_jaccard(texts[rep], texts[m["id"]]), abs=1e-4)
        assert m["jaccard"] >= 0.8


def test_low_similarity_copies_and_distinct_documents_are_kept_alone(planted_run):
    r = planted_run
    for doc_id in ["base-01", "base-01.j50", "base-01.j20", *[f"base-{i:02d}" for i in range(4, 10)]]:
        assert doc_id in r.docs, doc_id
        assert r.docs[doc_id]["metadata"][DUP_COUNT] == 1
        assert r.docs[doc_id]["metadata"][DUP_MEMBERS] == []
    v = r.report["verification"]
    assert v["mode"] == "exact" and v["precision"] == 1.0 and v["min_member_jaccard"] >= 0.8
    assert r.ctx.summary["near_precision"] == 1.0


def test_exact_duplicate_dropped_with_reason_exact_and_counted_on_the_kept_copy(planted_run):
    r = planted_run
    assert r.reason("base-02.ws") == "exact_duplicate"
    assert r.docs["base-02"]["metadata"][DUP_COUNT] == 2
    assert r.docs["base-02"]["metadata"][DUP_MEMBERS] == ["base-02.ws"]


def test_case_variant_is_a_near_duplicate_unless_exact_casefold(planted, planted_run, tmp_path):
    assert planted_run.reason("base-03.upper") == "near_duplicate"
    folded = _run(tmp_path, planted["records"], exact_casefold=True)
    assert folded.reason("base-03.upper") == "exact_duplicate"
    assert folded.docs["base-03"]["metadata"][DUP_COUNT] == 2


def test_every_document_is_kept_or_dropped_with_a_counted_reason(planted, planted_run):
    r = planted_run
    rep = r.report["documents"]
    n_in = len(planted["records"])
    assert rep["in"] == n_in == rep["kept"] + sum(rep["dropped"].values())
    assert rep["kept"] == len(r.docs)
    assert rep["dropped"] == {"exact_duplicate": 1, "near_duplicate": 3, "eval_contamination": 0}
    assert r.ctx.summary["in"] == n_in and r.ctx.summary["kept"] == len(r.docs)
    assert r.ctx.summary["exact_duplicates"] == 1 and r.ctx.summary["near_duplicates"] == 3
    assert r.ctx.rows["documents"] == len(r.docs)
    # dup_count is the repetition signal: over kept documents it sums to every document deduplicated
    assert sum(d["metadata"][DUP_COUNT] for d in r.docs.values()) == n_in
    # per-domain counts add up, and the per-domain rate metric is their ratio
    domains = r.report["domains"]
    assert sum(c["in"] for c in domains.values()) == n_in
    for name, c in domains.items():
        assert c["in"] == c["kept"] + sum(c[k] for k in DROP_REASONS)
        rate = (c["exact_duplicate"] + c["near_duplicate"]) / c["in"]
        assert r.ctx.sink.last(f"dup_rate.{name}") == pytest.approx(rate)
    assert {s["reason"] for s in r.dropped} == {"exact_duplicate", "near_duplicate"}
    assert (r.out / "plots" / "cluster_sizes.png").exists()
    assert (r.out / "plots" / "dup_rates_by_domain.png").exists()


def test_kept_documents_keep_their_fields_and_input_order(planted, planted_run):
    order = [d["id"] for d in planted["records"] if d["id"] in planted_run.docs]
    assert list(planted_run.docs) == order
    src = {d["id"]: d for d in planted["records"]}
    for doc_id, d in planted_run.docs.items():
        assert d["text"] == src[doc_id]["text"] and d["domain"] == src[doc_id]["domain"]


def test_same_input_and_params_give_identical_output_bytes(planted, tmp_path):
    a = _run(tmp_path, planted["records"], name="a", **SMALL)
    b = _run(tmp_path, planted["records"], name="b", **SMALL)
    files = sorted(p.relative_to(a.out) for p in a.out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b.out) for p in b.out.rglob("*") if p.is_file())
    for f in files:
        if f.suffix != ".png":  # matplotlib's PNG bytes are not part of the contract
            assert (a.out / f).read_bytes() == (b.out / f).read_bytes(), f


def test_precision_estimate_is_the_share_of_verified_pairs_at_the_threshold(planted, tmp_path):
    # a loose LSH (S-curve 0.35) also pairs the J ~ 0.5 copy: the estimate must count it as a miss
    r = _run(tmp_path, planted["records"], bands=32, rows=3, verify="estimate")
    verified = [m["jaccard"] for row in r.clusters.values() for m in row["members"] if "jaccard" in m]
    v = r.report["verification"]
    assert v["pairs_checked"] == len(verified) == v["near_pairs"]
    assert v["precision_estimate"] == pytest.approx(np.mean([j >= 0.8 for j in verified]))
    assert min(verified) < 0.8  # the J ~ 0.5 copy was paired and, in estimate mode, dropped
    assert r.reason("base-01.j50") == "near_duplicate"
    assert r.ctx.summary["near_precision"] == pytest.approx(v["precision_estimate"])


def test_exact_verify_keeps_lsh_candidates_below_the_threshold(planted, tmp_path):
    # the same loose LSH pairs the J ~ 0.5 copy; the exact check keeps it
    r = _run(tmp_path, planted["records"], bands=32, rows=3)
    v = r.report["verification"]
    # LSH paired it (and the J ~ 0.2 copy, maybe); their MinHash estimates are far below 0.8 - margin
    assert v["skipped_by_estimate"] + v["checked_below_threshold"] >= 1 and v["precision"] == 1.0
    assert v["candidate_pairs"] == v["pairs_checked"] + v["skipped_by_estimate"]
    assert {"base-01", "base-01.j50", "base-01.j20"} <= set(r.docs)
    assert all(m["jaccard"] >= 0.8 for row in r.clusters.values() for m in row["members"] if "jaccard" in m)
    assert r.report["documents"]["dropped"]["near_duplicate"] == 3


def _chain(text: str, k: int, offset: int) -> str:
    """``text`` with k evenly spaced words replaced, starting ``offset`` words in."""
    words = text.split()
    step = len(words) // k
    for j in range(k):
        words[offset + j * step] = REPLACEMENTS[j % len(REPLACEMENTS)]
    return " ".join(words)


def test_default_drops_nothing_below_the_jaccard_threshold(prose, tmp_path):
    """Chains A ~ B ~ C with J(A, B), J(B, C) >= 0.8 > J(A, C): LSH clusters put C with A; the default
    must not drop C as A's near duplicate. Every dropped document is checked against its
    representative with the independent reference Jaccard."""
    records, expected_below = [], []
    for n, base in enumerate(sorted(prose, key=lambda r: -len(r["text"].split()))[:6]):
        a = base["text"]
        b = _chain(a, max(2, len(a.split()) // 60), 3)
        c = _chain(b, max(2, len(a.split()) // 60), 11)
        jab, jbc, jac = ref_jaccard(a, b), ref_jaccard(b, c), ref_jaccard(a, c)
        assert jab >= 0.8 and jbc >= 0.8 and jac < 0.8, (jab, jbc, jac)
        records += [_doc(f"chain{n}-a", a), _doc(f"chain{n}-b", b), _doc(f"chain{n}-c", c)]
        expected_below.append(jac)
    r = _run(tmp_path, records)
    texts = {d["id"]: d["text"] for d in records}
    dropped = {m["id"]: rep for rep, row in r.clusters.items() for m in row["members"]}
    assert dropped, "the near duplicates at J >= 0.8 were found"
    for member, rep in dropped.items():
        assert ref_jaccard(texts[rep], texts[member]) >= 0.8, (member, rep)
    for n in range(6):  # the longest of a chain is its representative: the middle one takes both ends
        ids = [f"chain{n}-{x}" for x in "abc"]
        rep = min(ids, key=lambda i: (-len(" ".join(texts[i].split())), i))
        assert sum(i in r.docs for i in ids) == (1 if rep.endswith("-b") else 2), n


def test_verify_pairs_caps_the_sample(planted, tmp_path):
    r = _run(tmp_path, planted["records"], verify_pairs=1, verify="estimate", **SMALL)
    assert r.report["verification"]["pairs_checked"] == 1 < r.report["verification"]["near_pairs"]


def test_dedup_of_deduped_documents_adds_up_dup_counts(planted, planted_run, tmp_path):
    # a copy that was itself the representative of 2 documents in an earlier dedup
    late = _doc("late-copy", planted["records"][2]["text"], **{DUP_COUNT: 2, DUP_MEMBERS: ["older-copy"]})
    r = _run(tmp_path, [*planted_run.docs.values(), late], **SMALL)
    assert r.reason("late-copy") == "exact_duplicate"
    assert r.docs["base-02"]["metadata"][DUP_COUNT] == 4
    assert r.docs["base-02"]["metadata"][DUP_MEMBERS] == ["base-02.ws", "late-copy", "older-copy"]
    assert sum(d["metadata"][DUP_COUNT] for d in r.docs.values()) == len(planted["records"]) + 2


def test_dup_members_list_is_capped_but_dup_count_is_not(prose, tmp_path):
    text = prose[0]["text"]
    records = [_doc(f"copy-{i:02d}", text) for i in range(12)]
    r = _run(tmp_path, records, max_members_listed=5, **SMALL)
    (kept,) = r.docs.values()
    assert kept["id"] == "copy-00"
    assert kept["metadata"][DUP_COUNT] == 12 and len(kept["metadata"][DUP_MEMBERS]) == 5
    assert len(r.clusters["copy-00"]["members"]) == 11  # clusters.jsonl lists them all


def test_documents_shorter_than_n_grams_are_only_exact_deduplicated(tmp_path):
    records = [_doc("a", "Short note."), _doc("b", "short   NOTE."), _doc("c", "Short note.")]
    r = _run(tmp_path, records, **SMALL)
    assert set(r.docs) == {"a", "b"}
    assert r.reason("c") == "exact_duplicate"
    assert r.report["minhash"]["leaders_too_short"] == 2


@pytest.mark.slow  # loading spaCy and tokenizing with it takes several seconds
def test_spacy_tokenizer_mode_finds_the_same_duplicates(planted, planted_run, tmp_path):
    r = _run(tmp_path, planted["records"], word_tokenizer="spacy")
    assert set(r.docs) == set(planted_run.docs)


# --- fast shingling --------------------------------------------------------------------------------
TRICKY = [
    "", "   ", "Hello, World!", "Ünïcödé façade — naïve café; déjà vu.", "A1b2 3.14 1,000,000 ٣٫١٤ x²",
    "tabs\tand\nnew\r\nlines  ", "e\u0301 combining a\u0308", "中文，标点。日本語のテキスト！", "¿Qué? ¡Sí!",
    "code: def f(x): return x**2  # comment", "\u00a0non-breaking\u2003em space", "MONDAY January",
    "ﬁ ligature Ⅻ roman", "İstanbul ǅ titlecase", "ẞ sharp s", "\x00\x07 controls \x7f\x9f",
]


def test_simplify_equals_datatrove_simplify_text(prose):
    cfg = TextNormConfig()
    for text in TRICKY + [r["text"] for r in prose]:
        assert simplify(text) == simplify_text(text, cfg), repr(text[:60])


def test_fast_shingles_are_the_reference_word_ngrams():
    text = "The quick brown fox jumps over the lazy dog. The quick brown fox sleeps!"
    shingles = np.unique(Shingler().shingles(text, 5))
    assert len(shingles) == len(ref_shingles(text))
    other = "The quick brown fox jumps over the lazy cat."
    got = jaccard(shingles, np.unique(Shingler().shingles(other, 5)))
    assert got == pytest.approx(ref_jaccard(text, other))


def test_fast_tokenizer_splits_words_and_cjk_characters():
    tok = FastWordTokenizer()
    assert tok.word_tokenize("hello  world\tagain") == ["hello", "world", "again"]
    assert tok.word_tokenize("日本語 text 한국") == ["日", "本", "語", "text", "한", "국"]
    assert tok.sent_tokenize("One. Two!  Three?\nFour") == ["One.", "Two!", "Three?", "Four"]


# --- decontamination -------------------------------------------------------------------------------
def _sentences(text: str, words: int) -> str:
    """The first ``words`` words of ``text`` (single-spaced)."""
    return " ".join(text.split()[:words])


def _normalized_words(text: str, words: int) -> str:
    """The first ``words`` words of ``text`` as the stage sees them (URLs split, punctuation gone)."""
    return " ".join(simplify_text(text, TextNormConfig()).split()[:words])


@pytest.fixture(scope="module")
def contamination(prose) -> dict:
    train = [_doc(f"train-{i:02d}", r["text"]) for i, r in enumerate(prose[:8])]
    items = [_sentences(r["text"], 60) for r in prose[10:13]]  # three 60-word items from held-out documents
    short_item = "What is the capital city"
    edited = simplify_text(items[2], TextNormConfig()).split()
    for k in range(10, len(edited), 20):  # a word in 20 changed: breaks most 13-grams, few 5-grams
        edited[k] = REPLACEMENTS[k % len(REPLACEMENTS)]
    edited = " ".join(edited)
    planted = [
        _doc("embedded", train[4]["text"] + "\n\n" + items[0] + "\n\n" + train[5]["text"][:500]),
        _doc("embedded.copy", train[4]["text"] + "\n\n" + items[0] + "\n\n" + train[5]["text"][:500]),
        # punctuation dropped and upper-cased: the same normalized words
        _doc("reformatted", train[6]["text"][:800] + "\n" + re.sub(r"[,.;:]", "", items[1]).upper()),
        _doc("edited-copy", edited),
        # only 10 words of an item (no 13-gram), and the too-short item: not contamination
        _doc("partial", prose[13]["text"] + " " + _normalized_words(items[0], 10) + ". " + short_item + "?"),
        # three quarters of an item: most of its 13-grams (contaminated); a third: few (clean)
        _doc("mostly", prose[14]["text"] + "\n" + _normalized_words(items[1], 45)),
        _doc("third", prose[15]["text"] + "\n" + _normalized_words(items[0], 25)),
    ]
    eval_rows = [{"id": "q0", "text": items[0]}, {"id": "q1", "question": items[1], "answer": "42"},
                 {"id": "q2", "prompt": items[2]}, {"id": "q3", "question": short_item}]
    return {"train": train, "planted": planted, "items": items, "edited": edited, "eval_rows": eval_rows}


def _eval_file(path: Path, rows: list[dict]) -> Path:
    with gzip.open(path, "wb") as f:
        for row in rows:
            f.write(orjson.dumps(row) + b"\n")
    return path


def test_planted_contamination_preconditions(contamination):
    # the edited copy escapes 13-gram containment but stays Jaccard-similar: only MinHash-LSH sees it
    item, edited = contamination["items"][2], contamination["edited"]
    assert ref_containment(item, edited, 13) < 0.5
    assert ref_jaccard(item, edited) >= 0.5
    docs = {d["id"]: d["text"] for d in contamination["planted"]}
    assert all(ref_containment(i, docs["partial"], 13) == 0 for i in contamination["items"])
    assert 0.5 < ref_containment(contamination["items"][1], docs["mostly"], 13) < 0.9
    assert 0 < ref_containment(contamination["items"][0], docs["third"], 13) < 0.5


def test_decontamination_drops_embedded_eval_items_and_keeps_clean_documents(contamination, tmp_path):
    path = _eval_file(tmp_path / "quiz.jsonl.gz", contamination["eval_rows"])
    r = _run(tmp_path, contamination["train"] + contamination["planted"], decontaminate_paths=[str(path)], **SMALL)
    for doc_id in ("embedded", "embedded.copy", "reformatted", "edited-copy", "mostly"):
        assert r.reason(doc_id) == "eval_contamination", doc_id
    assert set(r.docs) == {d["id"] for d in contamination["train"]} | {"partial", "third"}
    quiz = r.report["decontamination"]["eval_sets"]["quiz"]
    assert quiz["items"] == 4 and quiz["checked_items"] == 3 and quiz["too_short_items"] == 1
    assert quiz["contaminated_docs"] == 5 and quiz["matched_items"] == 3
    # one group each: the exact copy of "embedded" shares its verdict
    assert quiz["doc_matches_by_method"] == {"minhash_jaccard": 1, "ngram_containment": 3}
    assert r.report["documents"]["dropped"]["eval_contamination"] == 5
    assert r.ctx.summary["contaminated"] == 5
    samples = {s["id"]: s for s in r.dropped if s["reason"] == "eval_contamination"}
    assert samples["embedded"]["matches"][0] == {"eval_set": "quiz", "item": "q0",
                                                  "method": "ngram_containment", "score": 1.0}
    (mostly,) = samples["mostly"]["matches"]
    docs = {d["id"]: d["text"] for d in contamination["planted"]}
    assert mostly["score"] == pytest.approx(ref_containment(contamination["items"][1], docs["mostly"], 13), abs=1e-4)
    (edited,) = samples["edited-copy"]["matches"]
    assert edited["method"] == "minhash_jaccard"
    assert edited["score"] == pytest.approx(ref_jaccard(contamination["items"][2], contamination["edited"]), abs=1e-4)


def test_decontamination_flag_mode_keeps_and_marks_contaminated_documents(contamination, tmp_path):
    path = _eval_file(tmp_path / "quiz.jsonl.gz", contamination["eval_rows"])
    r = _run(tmp_path, contamination["train"] + contamination["planted"], decontaminate_paths=[str(path)],
             decontamination="flag", **SMALL)
    assert r.report["documents"]["dropped"]["eval_contamination"] == 0
    flagged = {i for i, d in r.docs.items() if CONTAMINATION in d["metadata"]}
    assert flagged == {"embedded", "reformatted", "edited-copy", "mostly"}  # embedded.copy: an exact duplicate
    assert r.reason("embedded.copy") == "exact_duplicate"
    assert r.docs["embedded"]["metadata"][CONTAMINATION][0]["item"] == "q0"
    assert r.report["decontamination"]["contaminated_docs"] == 5
    assert r.ctx.summary["contaminated"] == 5


def test_evalset_artifacts_on_the_eval_sets_input_are_used(contamination, tmp_path):
    art_dir = tmp_path / "evalset"
    art_dir.mkdir()
    _eval_file(art_dir / "items.jsonl.gz", contamination["eval_rows"][:1])
    (art_dir / "manifest.json").write_text(json.dumps({"type": "evalset", "stage": "mmlu", "digest": "e"}))
    r = _run(tmp_path, contamination["train"] + contamination["planted"][:1],
             eval_sets=[Artifact.load(art_dir)], **SMALL)
    assert r.reason("embedded") == "eval_contamination"
    assert r.report["decontamination"]["eval_sets"]["mmlu/items"]["contaminated_docs"] == 1


def test_eval_file_without_any_text_field_is_an_error(contamination, tmp_path):
    path = _eval_file(tmp_path / "bad.jsonl.gz", [{"id": 1, "body": "x"}])
    with pytest.raises(ValueError, match="decontaminate_text_keys"):
        _run(tmp_path, contamination["train"], decontaminate_paths=[str(path)], **SMALL)


def test_missing_decontaminate_path_is_an_error(contamination, tmp_path):
    with pytest.raises(FileNotFoundError, match="names no file"):
        _run(tmp_path, contamination["train"], decontaminate_paths=[str(tmp_path / "nope.jsonl")], **SMALL)


# --- params and contract ---------------------------------------------------------------------------
def test_defaults_find_pairs_at_the_threshold_and_leave_the_decision_to_the_exact_check():
    p = DedupParams()
    assert (p.bands, p.rows, p.n_grams, p.verify, p.jaccard_threshold) == (20, 6, 5, "exact", 0.8)
    assert p.detection_probability(0.8) > 0.997 and p.detection_probability(0.85) > 0.9999
    assert p.s_curve_threshold == pytest.approx(0.607, abs=1e-3)
    assert p.word_tokenizer == "fast"
    # 5 standard errors of the 120-hash estimate at J = 0.8
    assert estimate_margin(p) == pytest.approx(5 * (0.8 * 0.2 / 120) ** 0.5)


@pytest.mark.parametrize("bad", [{"bands": 0}, {"rows": 0}, {"jaccard_threshold": 0}, {"jaccard_threshold": 1.5},
                                 {"contamination_containment": 0}, {"decontaminate_paths": [" "]},
                                 {"decontaminate_text_keys": []}, {"word_tokenizer": "nltk"}, {"unknown": 1}])
def test_bad_params_are_rejected(bad):
    with pytest.raises(ValidationError):
        DedupParams(**bad)


def test_stage_contract():
    assert STAGE.name == "dedup" and STAGE.produces == "documents"
    assert STAGE.inputs["documents"].accepts("scored_documents")
    assert not STAGE.inputs["eval_sets"].required and STAGE.inputs["eval_sets"].many


def test_empty_input_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no documents"):
        _run(tmp_path, [])


# --- the sample corpus -----------------------------------------------------------------------------
@pytest.mark.slow
def test_sample_corpus_dedup_and_decontamination(tmp_path):
    records = []
    for path in sorted(SAMPLE_CORPUS_DIR.glob("*.jsonl.gz")):
        with gzip.open(path, "rb") as f:
            records += [orjson.loads(line) for line in f]
    # eval items: 80-word passages of five prose documents
    prose_docs = [r for r in records if r["domain"] == "prose" and len(r["text"].split()) > 300][:5]
    rows = [{"id": d["id"], "text": " ".join(d["text"].split()[100:180])} for d in prose_docs]
    path = _eval_file(tmp_path / "passages.jsonl.gz", rows)
    r = _run(tmp_path, records, decontaminate_paths=[str(path)])
    rep = r.report["documents"]
    assert rep["in"] == len(records) == rep["kept"] + sum(rep["dropped"].values())
    # licence texts repeat across packages: the legal domain has exact and near duplicates
    assert r.report["domains"]["legal"]["exact_duplicate"] > 0
    assert r.report["domains"]["legal"]["near_duplicate"] > 0
    assert all(d["metadata"][DUP_COUNT] >= 1 for d in r.docs.values())
    assert sum(d["metadata"][DUP_COUNT] for d in r.docs.values()) == rep["in"] - rep["dropped"]["eval_contamination"]
    # each passage's source document (or a copy of it) is found
    assert r.report["decontamination"]["eval_sets"]["passages"]["matched_items"] == 5
    for d in prose_docs:
        assert d["id"] not in r.docs
    v = r.report["verification"]
    assert v["precision"] == 1.0 and v["min_member_jaccard"] >= 0.8 and v["near_pairs"] > 0


# --- bounded memory on long documents ----------------------------------------------------------------
def _long_text(words: int, seed: int = 0) -> str:
    """One line of ``words`` random words (no sentence breaks, no newlines): the worst case for memory."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=k)) for k in rng.integers(2, 10, size=5000)]
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), size=words))


@pytest.mark.parametrize("precision", [64, 32])
def test_blocked_signature_equals_datatrove_signature(precision):
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.utils.hashing import HashConfig

    from data.minhash import BoundedMinhashSignature

    config = MinhashConfig(num_buckets=20, hashes_per_bucket=6, hash_config=HashConfig(precision=precision))
    stock, blocked = MinhashDedupSignature("/tmp/unused", config=config), BoundedMinhashSignature("/tmp/unused",
                                                                                                  config=config)
    rng = np.random.default_rng(precision)
    for n in (1, 5, 4095, 4096, 4097, 10_000):  # around and across the block size
        shingles = rng.integers(0, 2**64, size=(n, 1), dtype=np.uint64)
        assert blocked.get_signature(shingles) == stock.get_signature(shingles), n


def test_words_hashed_in_pieces_equal_the_whole_text(prose):
    texts = TRICKY + [r["text"] for r in prose] + ["x \u0301 y , . z", "ΣΑΣ σας ΟΔΟΣ. " * 50, "a" * 300 + " b"]
    for text in texts:
        whole = Shingler(piece_chars=1 << 30).word_hashes(text)
        for size in (7, 64, 1000):
            assert np.array_equal(Shingler(piece_chars=size).word_hashes(text), whole), (size, text[:40])
    # the whole-text reference is datatrove's simplify_text split on whitespace
    text = prose[0]["text"]
    assert len(Shingler(piece_chars=50).word_hashes(text)) == len(simplify_text(text, TextNormConfig()).split())


def test_signature_memory_of_a_long_single_line_document_is_bounded():
    """datatrove's get_signature holds an N-shingles x hashes uint64 array (~1 KB per word at 120 hashes,
    twice over): 400k words took ~0.8 GB. Blocked: 8 bytes per word (word hashes) + 8 per shingle + a
    constant."""
    import tracemalloc

    from datatrove.pipeline.dedup.minhash import MinhashConfig

    from data.minhash import FastMinhashSignature

    words = 400_000
    text = _long_text(words)
    step = FastMinhashSignature("/tmp/unused", MinhashConfig(num_buckets=20, hashes_per_bucket=6))
    tracemalloc.start()
    try:
        sig = step.get_signature(step.get_shingles(text))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(sig) == 20 and all(len(band) == 6 for band in sig)
    assert peak < 16 * words + 24e6, f"peak {peak / 1e6:.0f} MB for {words} words"


_RSS_PROBE = """
import json, resource, sys
from pathlib import Path
from data.dedup import run
from data.dedup_params import DedupParams
from pipeline.stage import Artifact, StageContext
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ctx = StageContext(Path(sys.argv[2]), inputs={"documents": Artifact(path=Path(sys.argv[1]),
                   manifest={"type": "documents"})}, stage_name="dedup")
run(DedupParams(), ctx)
print(json.dumps({"before_kb": before, "after_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


@pytest.mark.slow  # a subprocess (imports) and a 5 MB document through every pass
def test_dedup_stage_peak_rss_with_a_multi_mb_single_line_document(prose, tmp_path):
    """The whole stage in a fresh process: peak RSS growth over the process after imports. Before
    blocked signatures a 5 MB one-line document (800k words) took the process from ~0.36 to ~1.6 GB
    (BENCHMARKS.md: 1M words, 1.96 GB)."""
    import subprocess
    import sys

    long_doc = _doc("long", _long_text(800_000))
    assert len(long_doc["text"]) > 5_000_000 and "\n" not in long_doc["text"]
    _artifact(tmp_path / "in", [*prose[:6], long_doc, _doc("long.copy", long_doc["text"] + " tail")])
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(tmp_path / "in"), str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent, check=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    growth_mb = (rss["after_kb"] - rss["before_kb"]) / 1024
    print(f"peak RSS growth {growth_mb:.0f} MB")
    assert growth_mb < 250, f"dedup grew RSS by {growth_mb:.0f} MB on a 5 MB document"
    result = Result(StageContext(tmp_path / "out", stage_name="dedup"))
    assert result.reason("long") == "near_duplicate" and "long.copy" in result.docs  # the longer one stays


# --- bounded memory on many documents and on one large cluster ------------------------------------------
def _vocabulary(rng: np.random.Generator, size: int = 2000) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, size=k)) for k in rng.integers(3, 10, size=size)]


def _generated_corpus(n: int, seed: int = 0) -> list[dict]:
    """``n`` documents of 80-200 words from a fixed 2,000-word vocabulary (the word-hash memo stays the same
    size): 10% exact copies of an earlier document, 30% near copies (2% of its words replaced), 60% new."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng)
    texts: list[str] = []
    for _ in range(n):
        kind = rng.random()
        if texts and kind < 0.1:
            text = texts[rng.integers(len(texts))]
        elif texts and kind < 0.4:
            words = texts[rng.integers(len(texts))].split(" ")
            for k in np.flatnonzero(rng.random(len(words)) < 0.02):
                words[k] = vocab[rng.integers(len(vocab))]
            text = " ".join(words)
        else:
            text = " ".join(vocab[k] for k in rng.integers(0, len(vocab), size=rng.integers(80, 200)))
        texts.append(text)
    return [_doc(f"doc-{i:06d}", t, domain=f"d{i % 3}") for i, t in enumerate(texts)]


def _cluster_of_copies(k: int, seed: int = 1) -> list[dict]:
    """``k`` documents sharing one 300-word text, each with its own ending of 5-15 words of a 100-word vocabulary
    (the word-hash memo stays the same size): one LSH cluster, Jaccard 0.9 or more between any two."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng)
    shared = " ".join(vocab[w] for w in rng.integers(0, len(vocab), size=300))
    return [_doc(f"copy-{i:05d}", shared + " " + " ".join(vocab[w] for w in rng.integers(0, 100, size=rng.integers(5, 16))))
            for i in range(k)]


def _traced_run(tmp_path: Path, records: list[dict], name: str, **params) -> tuple[int, Result]:
    """The stage under tracemalloc (which also traces numpy's buffers): its peak heap in bytes, and the result.
    The input is written before tracing; no figures are drawn (constant size, and slow under tracing). 4 tasks
    (run one after the other here): datatrove's signature step sorts each band of its shard in memory, 52 bytes
    per leader, in a shard task of its own under Ray; a quarter of the leaders keeps that out of the way."""
    import tracemalloc

    path = tmp_path / f"{name}-in"
    with DocumentWriter(path, shard_docs=500) as w:
        for rec in records:
            w.write(rec)
    ctx = StageContext(tmp_path / name, inputs={"documents": Artifact(path=path, manifest={"type": "documents"})},
                       stage_name="dedup", resources=Resources(tasks=4))
    ctx.log_figure = lambda *args, **kwargs: None
    tracemalloc.start()
    try:
        run(DedupParams(**params), ctx)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, Result(ctx)


@pytest.fixture
def traced_stage(tmp_path, monkeypatch):
    """A dedup run on a few documents first, so the imports it makes on first use are not in the peaks; SQL rows
    are then buffered 64 at a time (a fixed ~1 MB at the stage's 4096 would mask per-document state here)."""
    _traced_run(tmp_path, _generated_corpus(30, seed=9), "warm-up")
    monkeypatch.setattr("data.dedup_state.BATCH", 64)
    return lambda records, name, **params: _traced_run(tmp_path, records, name, **params)


@pytest.mark.slow  # ~2,250 documents under tracemalloc: ~15 s
def test_stage_memory_does_not_grow_with_the_number_of_documents(traced_stage):
    """Peak heap at N and 8N documents. When the stage kept its state in Python objects and arrays (ids,
    groups, every leader's signature, the candidates' shingle sets) this grew ~1.6 KB per document (and RSS
    reached 992 MiB at 100x the benchmark corpus); with the state on disk ~25 bytes (datatrove's band sort in
    the signature shards, 8 bytes per near duplicate for the report's quantiles). Bound: 300 bytes."""
    n = 250
    small, _ = traced_stage(_generated_corpus(n), "small")
    large, result = traced_stage(_generated_corpus(8 * n), "large")
    dropped = result.report["documents"]["dropped"]
    assert dropped["exact_duplicate"] > 0.08 * 8 * n and dropped["near_duplicate"] > 0.08 * 8 * n  # real work
    per_doc = (large - small) / (7 * n)
    print(f"peak {small / 1e6:.2f} MB at {n} documents, {large / 1e6:.2f} MB at {8 * n}: {per_doc:.0f} B/document")
    assert per_doc < 300, f"dedup's peak heap grew {per_doc:.0f} bytes per document ({small} -> {large})"


@pytest.mark.slow  # ~1,000 documents under tracemalloc: ~10 s
def test_one_large_near_duplicate_cluster_is_handled_in_bounded_memory(traced_stage):
    """k documents that share most of their text: one representative takes them all, each member is checked
    once (candidates come in blocks, shingle sets one at a time), dup_members is cut at its cap while dup_count
    and clusters.jsonl hold every member. The peak does not grow with k: ~40 bytes per member (it grew ~6 KB per
    member when the candidates' signatures and shingle sets were held at once). Bound: 300 bytes."""
    k = 200
    small, _ = traced_stage(_cluster_of_copies(k), "small", max_members_listed=10)
    large, result = traced_stage(_cluster_of_copies(4 * k), "large", max_members_listed=10)
    (kept,) = result.docs.values()
    assert kept["metadata"][DUP_COUNT] == 4 * k and len(kept["metadata"][DUP_MEMBERS]) == 10
    assert len(result.clusters[kept["id"]]["members"]) == 4 * k - 1
    v = result.report["verification"]
    assert v["candidate_pairs"] == v["pairs_checked"] == v["near_pairs"] == 4 * k - 1  # once per member
    per_doc = (large - small) / (3 * k)
    print(f"peak {small / 1e6:.2f} MB with {k} copies, {large / 1e6:.2f} MB with {4 * k}: {per_doc:.0f} B/copy")
    assert per_doc < 300, f"dedup's peak heap grew {per_doc:.0f} bytes per cluster member ({small} -> {large})"


def test_stage_metrics_name_lsh_verification_timings_and_per_domain_rates():
    """data.dedup_report.stage_metrics, a pure function of the tallies: the metrics logged, in the order logged
    (a verification field that is None is left out)."""
    from collections import Counter

    from data.dedup_exact import FirstPassCounts
    from data.dedup_report import DedupTally, stage_metrics

    n = FirstPassCounts(docs=10, bytes=4_000_000, groups=8, leaders=7)
    t = DedupTally(kept=6, counts={"exact_duplicate": 2, "near_duplicate": 2, "eval_contamination": 0},
                   domains={"web": Counter({"in": 10, "kept": 6, "exact_duplicate": 2, "near_duplicate": 2})},
                   contaminated_docs=0, dup_counts=Counter({1: 4, 3: 2}), clusters=2)
    verification = {"near_pairs": 2, "pairs_checked": 3, "lsh_pairs": 4, "candidate_pairs": 5, "skipped_by_estimate": 0,
                    "checked_below_threshold": 1, "min_member_jaccard": 0.85, "edge_precision_estimate": None}
    params = DedupParams()
    metrics = stage_metrics(params, n, t, verification, None,
                            seconds={"read_minhash": 1.0, "verify": 0.5, "write": 0.5, "total": 2.0})
    assert metrics == {
        "s_curve_threshold": params.s_curve_threshold, "clusters": 2, "near_pairs": 2, "pairs_verified": 3,
        "lsh_pairs": 4, "seconds.read_minhash": 1.0, "seconds.verify": 0.5, "seconds.write": 0.5,
        "seconds.total": 2.0, "docs_per_s": 5.0, "mb_per_s": 2.0, "candidate_pairs": 5, "skipped_by_estimate": 0,
        "checked_below_threshold": 1, "min_member_jaccard": 0.85,
        "dup_rate.web": 0.4, "exact_rate.web": 0.2, "near_rate.web": 0.2}
    assert list(metrics)[:11] == ["s_curve_threshold", "clusters", "near_pairs", "pairs_verified", "lsh_pairs",
                                  "seconds.read_minhash", "seconds.verify", "seconds.write", "seconds.total",
                                  "docs_per_s", "mb_per_s"]


def test_validate_external_names_each_missing_eval_set(contamination, tmp_path):
    path = _eval_file(tmp_path / "quiz.jsonl.gz", contamination["eval_rows"])
    params = DedupParams(decontaminate_paths=[str(path), str(tmp_path / "gone.jsonl")])
    [(field, message)] = STAGE.validate_external(params)
    assert field == "decontaminate_paths.1" and "'" + str(tmp_path / "gone.jsonl") + "' names no file" in message
    assert STAGE.validate_external(DedupParams()) == []
