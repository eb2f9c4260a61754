"""Stage ``tokenizer``: round trip, HF reload, chat template masks, sampling, determinism, metrics."""

from __future__ import annotations

import json
import os
import random
import re

os.environ["HF_HUB_OFFLINE"] = "1"  # AutoTokenizer must load the artifact without the Hub

import pytest
from jinja2.exceptions import TemplateError
from pydantic import ValidationError
from transformers import AutoTokenizer

from data.documents import DocumentWriter
from data.tokenizer import (
    END_OF_TURN_TOKEN,
    MIN_VOCAB_SIZE,
    REPORT_NAME,
    SPECIAL_TOKENS,
    STAGE,
    TokenizerParams,
    build_tokenizer,
    run,
)
from pipeline.stage import Artifact, StageContext

VOCAB = 768

# --- a tiny varied corpus -----------------------------------------------------------------------
WORDS = ("the model learns that data isn't free and we'll see it's fine because people don't "
         "know what they're doing with café naïve Zürich résumé Ångström").split()
CODE = [
    "def {name}(x, y):\n    \"\"\"Add {n} to x.\"\"\"\n    if x > {n}:\n        return x + y\n    return y\n",
    "class {Name}:\n\tdef __init__(self):\n\t\tself.value = {n}\n\t\tself.items = []\n",
    "function {name}(a, b) {{\r\n  const total = a * {n};\r\n  return total + b;\r\n}}\r\n",
    "for i in range({n}):\n    print(f\"{{i}}: {name}\")  # loop\n\n\n",
]
MULTI = [
    "机器学习是人工智能的一个分支。数据 {n} 条。",
    "東京は日本の首都です。カタカナとひらがな。",
    "한국어 문장입니다. 숫자 {n}.",
    "مرحبا بالعالم، هذا نص عربي رقم {n}.",
    "שלום עולם, זה טקסט בעברית {n}.",
    "Привет, мир! Это русский текст {n}.",
    "नमस्ते दुनिया, यह हिंदी है।",
    "Family: 👨‍👩‍👧‍👦 flags 🏳️‍🌈 thumbs 👍🏽 and e\u0301 combining a\u0308.",
]


def _corpus(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for _ in range(120):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
        docs.append(("web", f"{words.capitalize()}. It costs ${rng.randint(1, 99999)}.{rng.randint(0, 99):02d}!"))
    for i in range(80):
        t = rng.choice(CODE)
        docs.append(("code", t.format(name=f"fn_{i}", Name=f"Thing{i}", n=rng.randint(0, 10**6))))
    for _ in range(60):
        nums = " ".join(str(rng.randint(0, 10**rng.randint(1, 12))) for _ in range(15))
        docs.append(("math", f"Sum: {nums} = {rng.random() * 1e6:.6f}; π ≈ 3.14159265358979"))
    for _ in range(80):
        docs.append(("multilingual", " ".join(rng.choice(MULTI).format(n=rng.randint(0, 9999))
                                              for _ in range(rng.randint(2, 6)))))
    rng.shuffle(docs)
    records = [{"id": f"doc-{i:05d}", "text": text, "source": "test", "domain": domain, "metadata": {}}
               for i, (domain, text) in enumerate(docs)]
    # one document of its own domain: with eval_fraction 0.1 its id is not held out, so it exercises
    # the "measure on training docs" fallback
    records.append({"id": "rare-0", "text": "A rare domain with one document.", "source": "test",
                    "domain": "rare", "metadata": {}})
    return records


DOMAINS = ("web", "code", "math", "multilingual", "rare")


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> Artifact:
    path = tmp_path_factory.mktemp("documents")
    with DocumentWriter(path, shard_docs=100) as w:  # several shards
        for rec in _corpus():
            w.write(rec)
    return Artifact(path=path, manifest={"type": "documents", "digest": "test-corpus"})


def _train(documents: Artifact, out_dir, **params) -> StageContext:
    ctx = StageContext(out_dir, inputs={"documents": documents}, stage_name="tokenizer")
    run(TokenizerParams(**({"vocab_size": VOCAB, "eval_fraction": 0.1} | params)), ctx)
    return ctx


@pytest.fixture(scope="module")
def trained(documents, tmp_path_factory) -> StageContext:
    return _train(documents, tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(trained):
    return AutoTokenizer.from_pretrained(trained.out_dir)


def _report(ctx: StageContext) -> dict:
    return json.loads((ctx.out_dir / REPORT_NAME).read_text())


# --- round trip ---------------------------------------------------------------------------------
ROUND_TRIP = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing   spaces   ",
    "\n\n\nnewlines\n\n",
    "tabs\tand\t\tmore\ttabs\t",
    "def f(x):\r\n\tif x:\r\n\t    return 1  # mixed indent\r\n",
    "    indented\n\t\ttabbed\n  \t mixed \t \n",
    "中文、日本語、한국어の混在テキスト。",
    "مرحبا بالعالم — שלום עולם (RTL) ‏mixed‎ LTR",
    "ZWJ: 👨‍👩‍👧‍👦 🏳️‍🌈 👩🏽‍💻 skin 👍🏿",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Å vs A\u030a",
    "accents: àéîõü ÀÉÎÕÜ ß ﬁ ligature",
    "digits: 12345678901234567890 0.000001 1,234,567 -42e10",
    "control \x00 \x07 \x7f \u200b zero-width \ufeff BOM \uffff",
    "it's we'll they're I'M DON'T",
    "symbols: <=> != ->> ... !!! ??? ~~~ @@@ ### $$$ %%%",
    "special-looking text <|user|> and <|end|> in prose",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_encode_round_trips_any_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_every_byte_is_encodable_without_unknown_tokens(tokenizer):
    text = bytes(range(256)).decode("latin-1") + "".join(chr(c) for c in range(0x2000, 0x2100))
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None


def test_plain_encode_adds_no_bos_or_eos(tokenizer):
    ids = tokenizer("Hello world").input_ids
    assert tokenizer.bos_token_id not in ids and tokenizer.eos_token_id not in ids


@pytest.mark.parametrize("split_digits", [1, 2, 3])
def test_pre_tokenizer_splits_digit_runs_into_groups_of_at_most_split_digits(split_digits):
    pieces = [p for p, _ in build_tokenizer(split_digits).pre_tokenizer.pre_tokenize_str("x 1234567890 y")]
    digit_pieces = [p for p in pieces if p.isdigit()]
    assert "".join(digit_pieces) == "1234567890"
    assert all(len(p) <= split_digits for p in digit_pieces)
    assert len(digit_pieces[0]) == split_digits  # groups fill from the left


def test_no_vocab_token_holds_more_digits_than_split_digits(tokenizer):
    longest = max((len(run) for tok in tokenizer.get_vocab() for run in re.findall(r"\d+", tok)), default=0)
    assert longest <= 3


# --- saved artifact -----------------------------------------------------------------------------
def test_autotokenizer_reload_has_same_ids_specials_and_template(trained, tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(trained.out_dir / "tokenizer.json"))
    for text in ROUND_TRIP:
        assert tokenizer.encode(text) == raw.encode(text, add_special_tokens=False).ids
    assert len(tokenizer) == raw.get_vocab_size() == _report(trained)["vocab_size"]
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == SPECIAL_TOKENS[:3]
    assert set(tokenizer.all_special_tokens) == set(SPECIAL_TOKENS)
    assert tokenizer.model_max_length == 8192
    assert tokenizer.chat_template and "generation" in tokenizer.chat_template
    assert (trained.out_dir / "chat_template.jinja").exists()


# --- chat template ------------------------------------------------------------------------------
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What's 12345 + 1?"},
    {"role": "assistant", "content": "It's 12346."},
    {"role": "tool", "content": "{\"result\": 12346}"},
    {"role": "user", "content": "Say hi in 中文 👋"},
    {"role": "assistant", "content": "你好 👋\n  (done)"},
]


def test_chat_template_renders_roles_bos_and_end_of_turn(tokenizer):
    text = tokenizer.apply_chat_template(CHAT[:2], tokenize=False)
    assert text == "<|bos|><|system|>\nYou are terse.<|end|>\n<|user|>\nWhat's 12345 + 1?<|end|>\n"
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == text + "<|assistant|>\n"


def test_generation_mask_covers_exactly_assistant_content_and_end_of_turn(tokenizer):
    out = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(CHAT, tokenize=False))
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    expected = [i for m in CHAT if m["role"] == "assistant" for i in tokenizer.encode(m["content"]) + [end]]
    assert [i for i, m in zip(ids, mask, strict=True) if m] == expected
    # two contiguous spans, one per assistant turn
    starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
    assert len(starts) == 2
    assert all(tokenizer.convert_ids_to_tokens(ids[k - 2]) == "<|assistant|>" for k in starts)


def test_chat_template_rejects_unknown_role(tokenizer):
    with pytest.raises(TemplateError, match="unknown role narrator"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


# --- sampling, metrics, determinism -------------------------------------------------------------
def test_bytes_per_token_logged_for_every_domain(trained):
    sink = trained.sink
    for d in DOMAINS:
        assert 1.0 < sink.last(f"bytes_per_token.{d}") < 20.0
    assert trained.summary["vocab_size"] == trained.rows["vocab"] <= VOCAB
    assert trained.summary["bytes_per_token"] > 1.0
    assert trained.summary["train_seconds"] > 0 and trained.summary["train_bytes"] > 0
    assert (trained.out_dir / "plots" / "bytes_per_token.png").stat().st_size > 0
    logged = {p.name for p, _ in sink.artifacts}
    assert {"tokenizer.json", "tokenizer_config.json", "bytes_per_token.png", REPORT_NAME} <= logged


def test_report_holds_out_eval_docs_and_falls_back_when_a_domain_has_none(trained):
    report = _report(trained)
    domains = report["domains"]
    assert set(domains) == set(DOMAINS)
    for d, s in domains.items():
        assert s["eval_docs"] + s["train_docs"] == s["docs"], d  # weight 1, no cap: every other doc trains
        assert s["measured_on"] == ("held_out" if s["eval_docs"] else "train_fallback"), d
        assert s["measured_docs"] == (s["eval_docs"] or s["docs"]), d
    assert domains["rare"]["measured_on"] == "train_fallback"
    assert report["fallback_domains"] == ["rare"]
    assert report["train_bytes"] == sum(s["train_bytes"] for s in domains.values())


def test_domain_weights_change_the_training_sample(documents, trained, tmp_path):
    ctx = _train(documents, tmp_path, domain_weights={"code": 0.0, "web": 2.0, "math": 0.5})
    base, weighted = _report(trained)["domains"], _report(ctx)["domains"]
    assert weighted["code"]["train_docs"] == 0 and weighted["code"]["train_bytes"] == 0
    assert weighted["web"]["train_docs"] == 2 * base["web"]["train_docs"]
    assert 0.25 * base["math"]["train_docs"] < weighted["math"]["train_docs"] < 0.75 * base["math"]["train_docs"]
    assert weighted["multilingual"]["train_docs"] == base["multilingual"]["train_docs"]
    # the excluded domain is still measured on its held-out docs
    assert weighted["code"]["measured_on"] == "held_out"
    assert ctx.sink.last("bytes_per_token.code") > 0


def test_max_train_bytes_caps_the_sample(documents, tmp_path):
    ctx = _train(documents, tmp_path, max_train_bytes=20_000)
    report = _report(ctx)
    assert 0 < report["train_bytes"] <= 20_000
    assert report["cap_keep_fraction"] < 1.0


def test_same_input_and_params_give_identical_artifact_bytes(documents, trained, tmp_path):
    """Every file, reports and plots included: identical output must not invalidate dependents."""
    again = _train(documents, tmp_path)

    def tree(d):
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    first, second = tree(trained.out_dir), tree(again.out_dir)
    assert "tokenizer.json" in first and first.keys() == second.keys()
    assert [k for k in first if first[k] != second[k]] == []


# --- params ------------------------------------------------------------------------------------
def test_params_reject_vocab_smaller_than_bytes_plus_specials():
    assert MIN_VOCAB_SIZE == 256 + len(SPECIAL_TOKENS)
    with pytest.raises(ValidationError, match=f"vocab_size must be >= {MIN_VOCAB_SIZE}"):
        TokenizerParams(vocab_size=MIN_VOCAB_SIZE - 1)
    TokenizerParams(vocab_size=MIN_VOCAB_SIZE)


def test_params_reject_negative_domain_weight_and_bad_digit_groups():
    with pytest.raises(ValidationError, match=r"domain_weights must be finite and >= 0.*'web': -1.0"):
        TokenizerParams(domain_weights={"web": -1.0})
    with pytest.raises(ValidationError, match="split_digits=4"):
        TokenizerParams(split_digits=4)
    with pytest.raises(ValidationError, match="extra"):
        TokenizerParams(vocab=512)


def test_stage_declares_documents_in_tokenizer_out():
    assert STAGE.name == "tokenizer" and STAGE.produces == "tokenizer"
    assert STAGE.inputs["documents"].accepts("documents") and STAGE.inputs["documents"].accepts("scored_documents")
    assert STAGE.params is TokenizerParams and STAGE.run is run


def test_bytes_per_token_is_recomputed_exactly_from_held_out_documents(documents, trained, tokenizer):
    """The metric is UTF-8 bytes / tokens over the documents held out by id hash (no specials added)."""
    from data.documents import iter_documents, unit_hash

    totals: dict[str, list[int]] = {}
    for rec in iter_documents(documents.path):
        if unit_hash(0, "eval", rec["id"]) < 0.1:  # the hold-out rule with the _train params
            t = totals.setdefault(rec["domain"] or "unknown", [0, 0])
            t[0] += len(rec["text"].encode("utf-8"))
            t[1] += len(tokenizer.encode(rec["text"]))
    assert totals, "the test corpus must hold out some documents"
    for domain, (n_bytes, n_tokens) in totals.items():
        assert trained.sink.last(f"bytes_per_token.{domain}") == pytest.approx(n_bytes / n_tokens, rel=1e-9)
    all_bytes, all_tokens = (sum(t[i] for t in totals.values()) for i in (0, 1))
    assert trained.summary["bytes_per_token"] == pytest.approx(all_bytes / all_tokens, rel=1e-9)
