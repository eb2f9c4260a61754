"""Stage ``mix``: epoch caps, exact budget arithmetic, shortfall handling, category floor, quality tilt,
ablation repetition (§4.1.3.2), determinism, accounting."""

from __future__ import annotations

import gzip
import json
import logging
import math
import random
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from data.documents import DUP_COUNT, QUALITY, SCORED_DOCUMENTS_TYPE, DocumentWriter
from data.mix import (
    MANIFEST_FILE,
    PACKING_TOKENS_PER_DOC,
    STAGE,
    STATS_FILE,
    ZERO_REASONS,
    BudgetShortfallError,
    DocumentTable,
    MissingQualityError,
    MixParams,
    iter_mixture,
    mixture_stats,
    plan_mixture,
    run,
)
from data.tokenizer import TokenizerParams
from data.tokenizer import run as train_tokenizer
from pipeline.stage import Artifact, StageContext

CATEGORIES = ("science", "code", "forum", "spam")
WORDS = ("the of model data energy cell function return value loop proof theorem lemma buy now cheap "
         "click here free offer we think that it is a good idea to test this carefully").split()


# --- inputs ---------------------------------------------------------------------------------------
def _records(n: int = 240, seed: int = 0) -> list[dict]:
    """Scored documents: 'spam' is all low quality, the others spread over the score range."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        cat = CATEGORIES[i % len(CATEGORIES)]
        if cat == "spam":
            kd, hp = rng.uniform(0, 1.5), rng.uniform(0, 2.0)
        else:
            kd, hp = rng.uniform(0.5, 5), rng.uniform(0.5, 5)
        meta: dict = {QUALITY: {"knowledge_depth": round(kd, 2), "helpfulness": round(hp, 2), "category": cat}}
        if i % 3:  # absent dup_count means 1
            meta[DUP_COUNT] = rng.randint(1, 5)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 150)))
        records.append({"id": f"doc-{i:04d}", "text": text, "source": "test",
                        "domain": "code" if cat == "code" else "prose", "metadata": meta})
    return records


def _documents(path, records, type_=SCORED_DOCUMENTS_TYPE) -> Artifact:
    with DocumentWriter(path, shard_docs=100) as w:
        for r in records:
            w.write(r)
    return Artifact(path=path, manifest={"type": type_, "digest": f"test-{path.name}"})


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return _records()


@pytest.fixture(scope="module")
def documents(records, tmp_path_factory) -> Artifact:
    return _documents(tmp_path_factory.mktemp("scored"), records)


@pytest.fixture(scope="module")
def tokenizer(documents, tmp_path_factory) -> Artifact:
    """The real tokenizer stage, small: a few hundred merges on the test corpus (~1 s)."""
    ctx = StageContext(tmp_path_factory.mktemp("tokenizer"), inputs={"documents": documents}, stage_name="tokenizer")
    train_tokenizer(TokenizerParams(vocab_size=400, eval_fraction=0.1), ctx)
    return Artifact(path=ctx.out_dir, manifest={"type": "tokenizer", "digest": "test-tokenizer"})


@pytest.fixture(scope="module")
def token_counts(records, tokenizer) -> dict[str, int]:
    """Tokens per document computed independently of data.mix: HF AutoTokenizer + BOS/EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer.path)
    return {r["id"]: len(tok.encode(r["text"], add_special_tokens=False)) + 2 for r in records}


def _mix(documents: Artifact, tokenizer: Artifact, out, **params) -> StageContext:
    ctx = StageContext(out, inputs={"documents": documents, "tokenizer": tokenizer}, stage_name="mix")
    run(MixParams(**params), ctx)
    return ctx


def _stats(ctx: StageContext) -> dict:
    return json.loads((ctx.out_dir / STATS_FILE).read_text())


def _rows(ctx: StageContext) -> list[dict]:
    return list(iter_mixture(ctx.out_dir))


@pytest.fixture(scope="module")
def unique_tokens(token_counts) -> int:
    return sum(token_counts.values())


@pytest.fixture(scope="module")
def mixed(documents, tokenizer, unique_tokens, tmp_path_factory) -> StageContext:
    """The default mixture at 1.5x the unique tokens."""
    return _mix(documents, tokenizer, tmp_path_factory.mktemp("mix"), token_budget=int(1.5 * unique_tokens))


def _table(n: int, seed: int, n_categories: int = 4, max_tokens: int = 2000) -> DocumentTable:
    rng = np.random.default_rng(seed)
    kd = rng.uniform(0, 5, n)
    return DocumentTable.from_columns(
        ids=[f"t{seed}-{i}" for i in range(n)], tokens=rng.integers(3, max_tokens, n), knowledge_depth=kd,
        helpfulness=np.clip(kd + rng.normal(0, 0.7, n), 0, 5),
        categories=[f"c{j}" for j in rng.integers(0, n_categories, n)],
        domains=[f"d{j}" for j in rng.integers(0, 2, n)], dup_count=rng.integers(1, 6, n))


# --- caps and budget arithmetic (property) -----------------------------------------------------------
@st.composite
def _problems(draw):
    n = draw(st.integers(1, 40))
    score = st.floats(0, 5, allow_nan=False)
    table = DocumentTable.from_columns(
        ids=[f"p{i}" for i in range(n)],
        tokens=draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n)),
        knowledge_depth=draw(st.lists(score, min_size=n, max_size=n)),
        helpfulness=draw(st.lists(score, min_size=n, max_size=n)),
        categories=draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=n, max_size=n)),
        domains=draw(st.lists(st.sampled_from(["x", "y"]), min_size=n, max_size=n)),
        dup_count=draw(st.lists(st.integers(1, 8), min_size=n, max_size=n)))
    budget_fraction = draw(st.floats(1e-4, 1.3))
    params = {"count_duplicates_against_cap": draw(st.booleans()),
              "min_category_share": draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])),
              "on_budget_shortfall": draw(st.sampled_from(["fail", "shrink"])),
              "category_weights": draw(st.sampled_from([{}, {"a": 5.0}, {"b": 0.1, "c": 3.0}])),
              "seed": draw(st.integers(0, 3))}
    return table, budget_fraction, params


def _capacity(table: DocumentTable, params: MixParams) -> int:
    plan_caps = np.array([b.max_epochs for b in params.buckets])
    score = (table.knowledge_depth + table.helpfulness) / 2
    caps = plan_caps[np.searchsorted([b.min_score for b in params.buckets], score, side="right") - 1]
    if params.count_duplicates_against_cap:
        caps = np.maximum(caps - (table.dup_count - 1), 0)
    return int((table.tokens * caps).sum())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problems())
def test_caps_never_exceeded_and_tokens_within_one_document_of_budget(problem):
    table, fraction, raw = problem
    probe = MixParams(token_budget=1, **raw)
    capacity = _capacity(table, probe)
    budget = max(1, int(fraction * capacity))
    params = MixParams(token_budget=budget, **raw)
    if budget > capacity and raw["on_budget_shortfall"] == "fail":
        with pytest.raises(BudgetShortfallError, match=f"at most {capacity:,} tokens"):
            plan_mixture(table, params)
        return
    plan = plan_mixture(table, params)
    counts, caps = plan.count, plan.cap
    max_epochs = np.array([b.max_epochs for b in params.buckets])[plan.bucket]
    assert plan.budget.capacity == capacity
    assert (counts >= 0).all() and (counts <= caps).all() and (caps <= max_epochs).all()
    if raw["count_duplicates_against_cap"]:
        assert (counts + table.dup_count - 1 <= max_epochs)[counts > 0].all()
    tokens = int((table.tokens * counts).sum())
    target = min(budget, capacity)
    assert tokens == plan.tokens == plan.budget.achieved
    assert 0 <= target - tokens < int(table.tokens.max())  # the documented tolerance
    if budget > capacity:  # shrink: everything at its cap, and said so
        assert plan.budget.shrunk_to == capacity and tokens == capacity and (counts == caps).all()
        assert any("budget shrunk" in w for w in plan.warnings)
    else:
        assert plan.budget.shrunk_to is None
    for i, reason in enumerate(plan.zero_reason):
        assert (reason is None) == (counts[i] > 0)
        assert reason is None or reason in ZERO_REASONS
        assert (reason == "duplicates_exhaust_cap") == (caps[i] == 0)


def test_budget_arithmetic_is_exact_and_tokens_come_from_the_tokenizer(mixed, token_counts, unique_tokens):
    rows = _rows(mixed)
    budget = int(1.5 * unique_tokens)
    assert {r["id"]: r["tokens"] for r in rows} == token_counts  # len(encode) + BOS + EOS
    assert PACKING_TOKENS_PER_DOC == 2
    total = sum(r["sample_count"] * r["tokens"] for r in rows)
    stats = _stats(mixed)
    assert total == stats["tokens"]["mixture"] == stats["budget"]["achieved_full_schedule"] == mixed.summary["tokens"]
    assert 0 <= budget - total < max(token_counts.values())
    assert stats["tokens"]["unique_input"] == unique_tokens
    assert mixed.summary["budget_requested"] == budget and mixed.rows["tokens"] == total
    assert math.isclose(stats["tokens"]["effective_epochs"], total / unique_tokens)
    for name, b in stats["buckets"].items():
        mine = [r for r in rows if r["bucket"] == name]
        assert b["mixture_tokens"] == sum(r["sample_count"] * r["tokens"] for r in mine)
        assert math.isclose(b["effective_epochs"], b["mixture_tokens"] / sum(r["tokens"] for r in mine))
        assert b["max_sample_count"] == max(r["sample_count"] for r in mine) <= b["max_epochs"]


def test_every_document_is_in_the_manifest_with_a_reason_for_zero(mixed, records, unique_tokens, documents,
                                                                    tokenizer, tmp_path):
    rows = _rows(mixed)
    assert [r["id"] for r in rows] == [r["id"] for r in records]  # input order, nothing lost
    for r in rows:
        assert (r["zero_reason"] is None) == (r["sample_count"] > 0)
        assert r["sample_count"] == r["full_sample_count"] <= r["max_epochs"]
    stats = _stats(mixed)
    zero = stats["documents"]["zero_sample_count"]
    assert stats["documents"]["input"] == len(records) == stats["documents"]["sampled"] + sum(zero.values())
    assert mixed.summary["unique_documents_sampled"] == stats["documents"]["sampled"] == mixed.rows["sampled_documents"]
    assert [r["id"] for r in iter_mixture(mixed.out_dir, only_sampled=True)] == [
        r["id"] for r in rows if r["sample_count"] > 0]
    # a budget of a tenth of the corpus leaves documents out, each with reason "budget"
    small = _mix(documents, tokenizer, tmp_path / "small", token_budget=unique_tokens // 10)
    small_rows = _rows(small)
    assert {r["zero_reason"] for r in small_rows if r["sample_count"] == 0} == {"budget"}
    assert _stats(small)["documents"]["zero_sample_count"]["budget"] == sum(
        r["sample_count"] == 0 for r in small_rows) > len(records) // 2


def test_metrics_plots_and_rows_are_logged(mixed, records):
    names = {k for k, _, _ in mixed.sink.metrics}
    assert {"tokens", "documents", "unique_documents_sampled", "budget_requested", "budget_achieved"} <= names
    assert {"epochs.low", "epochs.mid", "epochs.high", "share_before.category.spam", "share_after.category.spam",
            "share_after.domain.code", "zero.budget"} <= names
    assert mixed.summary["documents"] == mixed.rows["documents"] == len(records)
    for plot in ("category_share.png", "epochs_per_bucket.png"):
        assert (mixed.out_dir / "plots" / plot).stat().st_size > 0
    assert {"category_share.png", "epochs_per_bucket.png", STATS_FILE} <= {p.name for p, _ in mixed.sink.artifacts}


# --- shortfall --------------------------------------------------------------------------------------
def _capacity_of(rows: list[dict]) -> int:
    return sum(r["tokens"] * r["max_epochs"] for r in rows)


def test_budget_beyond_the_caps_fails_with_the_achievable_tokens_and_the_caps(mixed, documents, tokenizer, tmp_path):
    capacity = _capacity_of(_rows(mixed))
    with pytest.raises(BudgetShortfallError) as err:
        _mix(documents, tokenizer, tmp_path / "fail", token_budget=capacity + 1)
    msg = str(err.value)
    assert f"budget of {capacity + 1:,} tokens cannot be met" in msg and f"at most {capacity:,} tokens" in msg
    assert "low <= 2 epochs" in msg and "mid <= 3 epochs" in msg and "high <= 4 epochs" in msg
    assert "on_budget_shortfall: shrink" in msg
    assert not (tmp_path / "fail" / MANIFEST_FILE).exists()
    # exactly the capacity is achievable: every document at its cap
    ctx = _mix(documents, tokenizer, tmp_path / "full", token_budget=capacity)
    assert all(r["sample_count"] == r["max_epochs"] for r in _rows(ctx))
    assert ctx.summary["tokens"] == capacity and "budget_shrunk_to" not in ctx.summary


def test_budget_beyond_the_caps_shrinks_loudly_when_configured(mixed, documents, tokenizer, tmp_path, caplog):
    capacity = _capacity_of(_rows(mixed))
    with caplog.at_level(logging.WARNING):
        ctx = _mix(documents, tokenizer, tmp_path / "shrink", token_budget=2 * capacity, on_budget_shortfall="shrink")
    assert any("budget shrunk" in r.message and f"{capacity:,}" in r.message for r in caplog.records)
    assert ctx.summary["budget_shrunk_to"] == capacity == ctx.summary["tokens"]
    assert ctx.summary["budget_requested"] == 2 * capacity
    stats = _stats(ctx)
    assert stats["budget"]["shrunk"] is True and stats["budget"]["budget_shrunk_to"] == capacity
    assert any("budget shrunk" in w for w in stats["warnings"])
    assert all(r["sample_count"] == r["max_epochs"] for r in _rows(ctx))


# --- tilt and floor ---------------------------------------------------------------------------------
def test_mixture_tilts_toward_quality(mixed):
    b = _stats(mixed)["buckets"]
    assert b["high"]["share_after"] > b["high"]["share_before"]
    assert b["low"]["share_after"] < b["low"]["share_before"]
    assert b["low"]["effective_epochs"] < b["mid"]["effective_epochs"] < b["high"]["effective_epochs"]
    # weights proportional to caps: every bucket at the same fraction of its cap (up to integer rounding)
    fill = [b[n]["effective_epochs"] / b[n]["max_epochs"] for n in ("low", "mid", "high")]
    assert max(fill) - min(fill) < 0.05


def test_no_category_is_zeroed_and_the_floor_holds(documents, tokenizer, unique_tokens, tmp_path):
    budget = unique_tokens // 2
    shares = {}
    for floor in (0.0, 0.9):
        ctx = _mix(documents, tokenizer, tmp_path / f"floor{floor}", token_budget=budget, min_category_share=floor,
                   buckets=[{"name": "low", "min_score": 0, "max_epochs": 2, "weight": 1.0},
                            {"name": "high", "min_score": 2.5, "max_epochs": 4, "weight": 8.0}])
        stats = _stats(ctx)
        cats = stats["categories"]
        tolerance = max(r["tokens"] for r in _rows(ctx)) / budget  # one document of rounding
        for name, c in cats.items():
            assert c["sampled_documents"] > 0 and c["share_after"] > 0, name
            assert c["share_after"] >= floor * c["share_before"] - tolerance, name
        shares[floor] = cats["spam"]
    # spam is all low quality: the tilt alone cuts it well below its natural share, the floor lifts it
    assert shares[0.0]["share_after"] < 0.5 * shares[0.0]["share_before"]
    assert shares[0.9]["floor_binding"] and not shares[0.0]["floor_binding"]
    assert shares[0.9]["share_after"] > 1.5 * shares[0.0]["share_after"]


# --- dup_count --------------------------------------------------------------------------------------
def test_dup_count_counts_against_the_cap_only_when_asked(mixed, documents, tokenizer, unique_tokens, tmp_path):
    default_rows = _rows(mixed)
    caps = {"low": 2, "mid": 3, "high": 4}
    assert all(r["max_epochs"] == caps[r["bucket"]] for r in default_rows)  # dup_count reported, not counted
    ctx = _mix(documents, tokenizer, tmp_path / "dups", token_budget=unique_tokens, count_duplicates_against_cap=True)
    rows = _rows(ctx)
    for r in rows:
        assert r["max_epochs"] == max(caps[r["bucket"]] - (r["dup_count"] - 1), 0)
        assert r["sample_count"] + r["dup_count"] - 1 <= caps[r["bucket"]] or r["sample_count"] == 0
        assert (r["zero_reason"] == "duplicates_exhaust_cap") == (r["max_epochs"] == 0)
    assert any(r["zero_reason"] == "duplicates_exhaust_cap" for r in rows)
    assert _stats(ctx)["documents"]["zero_sample_count"]["duplicates_exhaust_cap"] == sum(
        r["max_epochs"] == 0 for r in rows)


# --- ablation (§4.1.3.2) ----------------------------------------------------------------------------
def test_ablation_keeps_full_schedule_repetition_and_selects_about_p_of_documents():
    """Selection is a hash-order prefix (per category, then global), so each document is in with
    probability ~p independently of its repetition r. With N eligible documents the selected fraction
    has standard deviation <= sqrt(p(1-p)/N) (without-replacement sampling is tighter than binomial),
    and the mean r of the n = pN selected has standard error sd(r) * sqrt((1-p)/n); both are checked
    at 4 sigma, a false-alarm rate below 1e-4 for this fixed seed set."""
    table = _table(4000, seed=1)
    unique = int(table.tokens.sum())
    full, small = int(2.5 * unique), int(0.5 * unique)
    params = MixParams(ablation={"enabled": True, "full_token_budget": full, "ablation_token_budget": small})
    plan = plan_mixture(table, params)
    reference = plan_mixture(table, MixParams(token_budget=full))
    assert (plan.full_count == reference.count).all()  # the full schedule is the non-ablation plan
    selected = plan.count > 0
    assert (plan.count[selected] == plan.full_count[selected]).all()  # repetition kept exactly
    dropped = (plan.count == 0) & (plan.full_count > 0)
    assert all(plan.zero_reason[i] == "ablation_subsample" for i in np.flatnonzero(dropped))
    # budget: never above, short by less than one document's full repetition
    largest = int((table.tokens * plan.full_count).max())
    assert 0 <= small - plan.ablation.achieved < largest and plan.tokens == plan.ablation.achieved
    p = plan.ablation.p
    assert math.isclose(p, small / plan.budget.achieved)
    eligible = plan.full_count > 0
    n_eligible = int(eligible.sum())
    assert abs(selected.sum() / n_eligible - p) <= 4 * math.sqrt(p * (1 - p) / n_eligible)
    for b in range(len(params.buckets)):
        in_b = eligible & (plan.bucket == b)
        r_full = plan.full_count[in_b]
        r_sel = plan.count[in_b & selected]
        se = r_full.std() * math.sqrt((1 - p) / max(r_sel.size, 1))
        assert abs(r_sel.mean() - r_full.mean()) <= 4 * se + 1e-12, params.buckets[b].name
        assert abs(r_sel.size / r_full.size - p) <= 4 * math.sqrt(p * (1 - p) / r_full.size)
    stats = mixture_stats(table, plan, params)["ablation"]
    assert stats["selected_fraction"] == selected.sum() / n_eligible
    for name, rep in stats["mean_repetition_by_bucket"].items():
        assert rep["full"] > 0 and rep["ablation"] > 0, name


def test_ablation_stage_reports_both_schedules(documents, tokenizer, unique_tokens, tmp_path):
    full, small = 2 * unique_tokens, unique_tokens // 2
    ctx = _mix(documents, tokenizer, tmp_path / "abl",
               ablation={"enabled": True, "full_token_budget": full, "ablation_token_budget": small})
    rows = _rows(ctx)
    stats = _stats(ctx)
    assert sum(r["full_sample_count"] * r["tokens"] for r in rows) == stats["budget"]["achieved_full_schedule"]
    assert sum(r["sample_count"] * r["tokens"] for r in rows) == stats["ablation"]["tokens"] == ctx.summary["tokens"]
    assert 0 <= full - stats["budget"]["achieved_full_schedule"] < max(r["tokens"] for r in rows)
    assert 0 <= small - ctx.summary["tokens"] < max(r["tokens"] * r["full_sample_count"] for r in rows)
    assert ctx.summary["ablation_p"] == pytest.approx(small / stats["budget"]["achieved_full_schedule"])
    assert all(r["sample_count"] in (0, r["full_sample_count"]) for r in rows)
    assert set(stats["ablation"]["full_schedule_buckets"]) == {"low", "mid", "high"}


# --- determinism ------------------------------------------------------------------------------------
def test_same_input_and_params_give_identical_bytes(mixed, documents, tokenizer, unique_tokens, tmp_path):
    again = _mix(documents, tokenizer, tmp_path / "again", token_budget=int(1.5 * unique_tokens))
    for name in (MANIFEST_FILE, STATS_FILE):
        assert (again.out_dir / name).read_bytes() == (mixed.out_dir / name).read_bytes(), name
    reseeded = _mix(documents, tokenizer, tmp_path / "seed", token_budget=int(1.5 * unique_tokens), seed=1)
    assert [r["sample_count"] for r in _rows(reseeded)] != [r["sample_count"] for r in _rows(mixed)]
    assert reseeded.summary["tokens"] <= int(1.5 * unique_tokens)


# --- input errors and params ------------------------------------------------------------------------
def test_unscored_documents_are_refused_with_a_clear_error(records, tokenizer, tmp_path):
    unscored = [dict(r, metadata={DUP_COUNT: 2}) for r in records[:5]]
    docs = _documents(tmp_path / "plain", unscored, type_="documents")
    with pytest.raises(MissingQualityError, match="mix needs documents scored by a quality stage.*doc-0000"):
        _mix(docs, tokenizer, tmp_path / "out", token_budget=1000)
    bad = [dict(r, metadata={QUALITY: {"knowledge_depth": 7, "helpfulness": 1, "category": "x"}}) for r in records[:2]]
    with pytest.raises(MissingQualityError, match=r"knowledge_depth.*= 7; expected a number in \[0.0, 5.0\]"):
        _mix(_documents(tmp_path / "bad", bad), tokenizer, tmp_path / "out2", token_budget=1000)
    dups = [dict(r, metadata=r["metadata"] | {DUP_COUNT: 0}) for r in records[:2]]
    with pytest.raises(ValueError, match="dup_count.*= 0"):
        _mix(_documents(tmp_path / "dups", dups), tokenizer, tmp_path / "out3", token_budget=1000)


def test_params_are_validated_with_clear_messages():
    MixParams(token_budget=10)
    with pytest.raises(ValidationError, match="token_budget is required"):
        MixParams()
    with pytest.raises(ValidationError, match="token_budget is unused with ablation.enabled"):
        MixParams(token_budget=10, ablation={"enabled": True, "full_token_budget": 10, "ablation_token_budget": 5})
    with pytest.raises(ValidationError, match="needs ablation.full_token_budget"):
        MixParams(ablation={"enabled": True, "full_token_budget": 10})
    with pytest.raises(ValidationError, match="exceeds ablation.full_token_budget"):
        MixParams(ablation={"enabled": True, "full_token_budget": 10, "ablation_token_budget": 11})
    with pytest.raises(ValidationError, match="strictly increasing min_score"):
        MixParams(token_budget=10, buckets=[{"name": "a", "min_score": 0, "max_epochs": 1, "weight": 1},
                                            {"name": "b", "min_score": 0, "max_epochs": 2, "weight": 1}])
    with pytest.raises(ValidationError, match="first bucket must start at min_score <= 0"):
        MixParams(token_budget=10, buckets=[{"name": "a", "min_score": 1, "max_epochs": 1, "weight": 1}])
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        MixParams(token_budget=10, buckets=[{"name": "a", "min_score": 0, "max_epochs": 0, "weight": 1}])
    with pytest.raises(ValidationError, match=r"finite and > 0.*'spam': 0.0"):
        MixParams(token_budget=10, category_weights={"spam": 0.0})
    with pytest.raises(ValidationError, match="positive sum"):
        MixParams(token_budget=10, score_weights={"knowledge_depth": 0, "helpfulness": 0})
    defaults = MixParams(token_budget=10)
    assert [(b.name, b.min_score, b.max_epochs) for b in defaults.buckets] == [
        ("low", 0.0, 2), ("mid", 2.0, 3), ("high", 3.5, 4)]  # §4.1.3.2: low <= 2, high <= 4 epochs


def test_stage_declares_scored_documents_and_tokenizer_in_mixture_out():
    assert STAGE.name == "mix" and STAGE.produces == "mixture" and STAGE.run is run
    assert STAGE.inputs["documents"].accepts(SCORED_DOCUMENTS_TYPE)
    assert not STAGE.inputs["documents"].accepts("documents")
    assert STAGE.inputs["tokenizer"].accepts("tokenizer")


# --- realistic: the shipped sample corpus ------------------------------------------------------------
@pytest.mark.slow
def test_sample_corpus_mixture_end_to_end(tmp_path):
    """The sample corpus with hash-derived quality scores (the quality stage is not this test's subject),
    the real tokenizer stage, and mix at 2x the unique tokens."""
    from data.documents import unit_hash as _unit_hash
    from data.ingest import SAMPLE_CORPUS_DIR

    records = []
    for path in sorted(SAMPLE_CORPUS_DIR.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                rec = json.loads(line)
                doc_id = str(rec.get("id", f"{path.stem}/{line_no}"))
                kd = 5 * _unit_hash(0, "kd", doc_id)
                records.append({"id": doc_id, "text": rec["text"], "source": path.name,
                                "domain": rec.get("domain", path.stem.split(".")[0]),
                                "metadata": {QUALITY: {"knowledge_depth": kd, "helpfulness": (kd + 5 * _unit_hash(
                                    0, "hp", doc_id)) / 2, "category": path.stem.split(".")[0]},
                                    DUP_COUNT: 1 + int(3 * _unit_hash(0, "dup", doc_id))}})
    docs = _documents(tmp_path / "docs", records)
    tctx = StageContext(tmp_path / "tok", inputs={"documents": docs}, stage_name="tokenizer")
    train_tokenizer(TokenizerParams(vocab_size=2048, max_train_bytes=2_000_000), tctx)
    tok = Artifact(path=tctx.out_dir, manifest={"type": "tokenizer", "digest": "sample"})
    start = time.perf_counter()
    probe = _mix(docs, tok, tmp_path / "probe", token_budget=1)
    unique = _stats(probe)["tokens"]["unique_input"]
    ctx = _mix(docs, tok, tmp_path / "mix", token_budget=2 * unique)
    elapsed = time.perf_counter() - start
    stats = _stats(ctx)
    rows = _rows(ctx)
    assert len(rows) == len(records)
    assert 0 <= 2 * unique - ctx.summary["tokens"] < max(r["tokens"] for r in rows)
    assert all(r["sample_count"] <= r["max_epochs"] for r in rows)
    assert all(c["sampled_documents"] > 0 for c in stats["categories"].values())
    assert stats["buckets"]["high"]["share_after"] > stats["buckets"]["high"]["share_before"]
    print(f"sample corpus: {len(records)} docs, {unique:,} unique tokens, two mix runs in {elapsed:.1f}s")


# --- the paper's epoch caps (§4.1.3.2) ----------------------------------------------------------------
def _buckets(low: int, high: int) -> list[dict]:
    return [{"name": "low", "min_score": 0, "max_epochs": low, "weight": 1.0},
            {"name": "high", "min_score": 2.5, "max_epochs": high, "weight": 2.0}]


@pytest.mark.parametrize(("low", "high", "problem"), [
    (3, 4, r"bucket 'low' \(the lowest scores, from 0.0\) has max_epochs=3 > 2"),
    (2, 5, r"bucket 'high' has max_epochs=5 > 4, the paper's cap for high-quality data"),
])
def test_caps_above_the_papers_are_refused_unless_allowed(low, high, problem):
    with pytest.raises(ValidationError, match=problem + r".*allow_over_paper_caps: true"):
        MixParams(token_budget=10, buckets=_buckets(low, high))
    allowed = MixParams(token_budget=10, buckets=_buckets(low, high), allow_over_paper_caps=True)
    assert [b.max_epochs for b in allowed.buckets] == [low, high]
    MixParams(token_budget=10, buckets=_buckets(2, 4))  # at the caps: fine
    MixParams(token_budget=10, buckets=_buckets(1, 3))


def test_allowed_caps_above_the_papers_are_warned_and_recorded(documents, tokenizer, unique_tokens, tmp_path,
                                                               caplog):
    caplog.set_level(logging.WARNING)
    ctx = _mix(documents, tokenizer, tmp_path / "over", token_budget=unique_tokens,
               buckets=_buckets(2, 6), allow_over_paper_caps=True)
    assert any("max_epochs=6 > 4" in r.getMessage() for r in caplog.records)
    assert "max_epochs=6 > 4" in ctx.sink.tags["mix.over_paper_caps"]
    assert ctx.sink.last("over_paper_caps") == 1
    assert _stats(ctx)["over_paper_caps"] == [
        "bucket 'high' has max_epochs=6 > 4, the paper's cap for high-quality data"]
    assert max(r["sample_count"] for r in _rows(ctx) if r["bucket"] == "high") <= 6
    default = _mix(documents, tokenizer, tmp_path / "default", token_budget=unique_tokens)
    assert default.sink.last("over_paper_caps") == 0 and "over_paper_caps" not in _stats(default)
