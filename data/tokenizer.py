"""Stage ``tokenizer``: a byte-level BPE tokenizer trained on a documents artifact (artifact type ``tokenizer``).

The output directory is a Hugging Face tokenizer folder: ``AutoTokenizer.from_pretrained(artifact_path)``
loads it offline (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``), plus
``tokenizer_report.json`` with everything measured and ``plots/bytes_per_token.png``.

Design choices that consumers rely on:

* **Byte level, no normalizer.** Every byte is in the base alphabet, so there is no unknown token and
  ``decode(encode(x)) == x`` for any string (no NFC/NFKC folding, no stripping, no prefix space).
* **Pre-tokenizer** in the Llama-3 / cl100k style (:data:`SPLIT_PATTERN`): contractions, letter runs with
  one optional leading symbol/space, digits in groups of at most ``split_digits``, punctuation runs with
  an optional leading space, newline runs, other whitespace. Merges never cross these boundaries.
* **Special tokens** (:data:`SPECIAL_TOKENS`) hold the fixed ids ``0..7`` in that order.
* **Plain ``encode`` adds nothing**: no BOS/EOS post-processor. Pretraining packing adds ``BOS``/``EOS``
  per document itself; the chat template writes its own ``BOS``. Special-token strings that occur in raw
  text are matched as special tokens by default; pass ``split_special_tokens=True`` where untrusted text
  must not be able to inject them.
* **Chat template**: ``<|bos|>`` then per message ``<|role|>\\n{content}<|end|>\\n``; the assistant's
  content and its ``<|end|>`` sit inside ``{% generation %}`` so ``return_assistant_tokens_mask=True``
  marks exactly the tokens a model is trained to produce.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from data.documents import ANY_DOCUMENTS, iter_documents, unit_hash
from pipeline.artifacts import write_text_atomic
from pipeline.stage import InputSpec, StageContext, StageKind, StageParams, metric_key

TOKENIZER_TYPE = "tokenizer"
REPORT_NAME = "tokenizer_report.json"

# --- special tokens: one source of truth for every stage that builds sequences --------------------
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
TOOL_TOKEN = "<|tool|>"
END_OF_TURN_TOKEN = "<|end|>"
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = (SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, TOOL_TOKEN)
# order == token id (0..7): added to the trainer first
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS, END_OF_TURN_TOKEN)
BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)


def split_pattern(split_digits: int = 3) -> str:
    """The pre-tokenizer regex (Oniguruma syntax), Llama-3 / cl100k style.

    Alternatives in order: English contractions; a letter run with at most one leading non-letter,
    non-digit, non-newline char (so ``" word"`` and ``"_name"`` stay one piece); digits in groups of
    1..``split_digits`` (numbers get a small, regular vocabulary); punctuation runs with an optional
    leading space and trailing newlines; newline runs with their indentation before; whitespace that
    is not followed by a non-space (so the last space attaches to the next word); other whitespace.
    """
    return (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
        r"|[^\r\n\p{L}\p{N}]?\p{L}+"
        rf"|\p{{N}}{{1,{split_digits}}}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+"
        r"|\s+(?!\S)"
        r"|\s+"
    )


SPLIT_PATTERN = split_pattern(3)

# Jinja (saved by transformers 5 as chat_template.jinja). The generation block holds the assistant's
# content and its end-of-turn token, not the newline after it, so the mask is exactly what to learn.
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in ['" + "', '".join(CHAT_ROLES) + "'] -%}\n"
    "{{- raise_exception('chat template: unknown role ' ~ message['role'] ~ ' (expected one of "
    + ", ".join(CHAT_ROLES) + ")') -}}\n"
    "{%- endif -%}\n"
    "{{- '<|' ~ message['role'] ~ '|>\\n' -}}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{%- generation -%}{{- message['content'] ~ '" + END_OF_TURN_TOKEN + "' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}\n"
    "{%- else -%}\n"
    "{{- message['content'] ~ '" + END_OF_TURN_TOKEN + "\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT_TOKEN + "\\n' -}}{%- endif -%}\n"
)


class TokenizerParams(StageParams):
    vocab_size: int = Field(8192, description="Vocabulary size including the 256 byte tokens and the specials.")
    min_frequency: int = Field(2, ge=0, description="Minimum pair frequency for a merge.")
    domain_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Per-domain up-sampling of the training sample: 2.0 = each doc twice, 0.5 = a "
                    "deterministic half (hash of the id), 0 = excluded; unlisted domains weigh 1.0.")
    max_train_bytes: int | None = Field(
        200_000_000, gt=0,
        description="Cap on the weighted training sample in UTF-8 bytes (deterministic uniform subsample).")
    split_digits: int = Field(3, description="Numbers are pre-split into groups of at most this many digits.")
    model_max_length: int = Field(8192, gt=0, description="Saved as the tokenizer's model_max_length.")
    eval_fraction: float = Field(
        0.05, ge=0.0, lt=1.0,
        description="Documents held out (by id hash) to measure bytes per token per domain; never trained on.")
    seed: int = Field(0, description="Salt of the deterministic per-document choices.")

    @field_validator("vocab_size")
    @classmethod
    def _vocab_covers_bytes_and_specials(cls, v: int) -> int:
        if v < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size={v} is too small: a byte-level BPE needs the {BYTE_ALPHABET_SIZE} byte tokens "
                f"plus the {len(SPECIAL_TOKENS)} special tokens, so vocab_size must be >= {MIN_VOCAB_SIZE}")
        return v

    @field_validator("domain_weights")
    @classmethod
    def _weights_are_finite_non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {d: w for d, w in v.items() if not (w >= 0 and math.isfinite(w))}
        if bad:
            raise ValueError(
                f"domain_weights must be finite and >= 0 (0 excludes a domain); got {bad}")
        return v

    @field_validator("split_digits")
    @classmethod
    def _split_digits_in_range(cls, v: int) -> int:
        if not 1 <= v <= 3:
            raise ValueError(f"split_digits={v}: numbers are split into groups of 1..3 digits; use 1, 2 or 3")
        return v


# --- deterministic per-document choices ---------------------------------------------------------
def _copies(weight: float, u: float) -> int:
    """How many times a doc enters the sample: floor(w) plus one more with probability frac(w)."""
    whole = math.floor(weight)
    return whole + (1 if u < weight - whole else 0)


def _domain(record: dict[str, Any]) -> str:
    return record.get("domain") or "unknown"


@dataclass
class DomainStats:
    weight: float = 1.0
    docs: int = 0  # all documents of the domain in the input
    bytes: int = 0
    eval_docs: int = 0  # held out
    eval_bytes: int = 0
    sampled_docs: int = 0  # training copies after weights (before the byte cap)
    sampled_bytes: int = 0
    train_docs: int = 0  # copies actually fed to the trainer
    train_bytes: int = 0
    measured_on: str = "held_out"  # or "train_fallback" when the domain has no held-out documents
    measured_docs: int = 0
    measured_bytes: int = 0
    measured_tokens: int = 0
    bytes_per_token: float | None = None


class _Sampler:
    """Decides, per document, held-out or not and how many training copies (all by id hash)."""

    def __init__(self, params: TokenizerParams) -> None:
        self.p = params
        self.keep_fraction = 1.0  # set after the counting pass when max_train_bytes binds

    def is_eval(self, doc_id: str) -> bool:
        return unit_hash(self.p.seed, "eval", doc_id) < self.p.eval_fraction

    def copies(self, doc_id: str, domain: str) -> int:
        weight = self.p.domain_weights.get(domain, 1.0)
        return _copies(weight, unit_hash(self.p.seed, "weight", doc_id))

    def kept(self, doc_id: str) -> bool:
        return self.keep_fraction >= 1.0 or unit_hash(self.p.seed, "cap", doc_id) < self.keep_fraction


def build_tokenizer(split_digits: int = 3) -> Any:
    """An untrained byte-level BPE ``tokenizers.Tokenizer`` with this stage's pipeline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # heavy: Rust tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern(split_digits)), behavior="isolated"),
        # the split above did the word splitting; ByteLevel only maps bytes to printable chars
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def special_token_ids(tokenizer_dir: str | Path) -> dict[str, Any]:
    """vocab size and the bos/eos/pad/end-of-turn ids of a tokenizer this stage trained (``tokenizer_dir``)."""
    from tokenizers import Tokenizer  # heavy: the Rust tokenizers library

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = {name: tok.token_to_id(t) for name, t in
           (("bos", BOS_TOKEN), ("eos", EOS_TOKEN), ("pad", PAD_TOKEN), ("end_of_turn", END_OF_TURN_TOKEN))}
    missing = [n for n, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer in {tokenizer_dir} has no {missing} special tokens; train it with the "
                         "project's tokenizer stage (data/tokenizer.py)")
    return {"vocab_size": tok.get_vocab_size(), **ids}


def run(params: TokenizerParams, ctx: StageContext) -> None:
    docs_path = ctx.input("documents").path
    sampler = _Sampler(params)

    # pass 1: count per domain, decide hold-out and weights (cheap: no tokenization)
    stats, sampled_bytes, unused_weights = _count(params, ctx, docs_path, sampler)

    # pass 2: stream the weighted sample into the trainer, in input order, in batches
    tok, train_seconds = _train(params, ctx, docs_path, sampler, stats, sampled_bytes)
    vocab_size = tok.get_vocab_size()
    ctx.progress(f"trained: vocab {vocab_size} in {train_seconds:.1f}s")
    _save_pretrained(tok, params, ctx.out_dir)

    # pass 3: bytes per token on held-out docs (training docs for domains with none held out)
    fallback = {d for d, s in stats.items() if s.eval_docs == 0}
    for d in fallback:
        stats[d].measured_on = "train_fallback"
    _measure(tok, docs_path, sampler, stats, fallback, ctx)

    held_out = [s for s in stats.values() if s.measured_on == "held_out"]
    overall_on = held_out or list(stats.values())
    overall_bytes = sum(s.measured_bytes for s in overall_on)
    overall_tokens = sum(s.measured_tokens for s in overall_on)
    overall_bpt = overall_bytes / overall_tokens if overall_tokens else 0.0
    train_bytes = sum(s.train_bytes for s in stats.values())

    ctx.log_summary({
        "vocab_size": vocab_size,
        "train_seconds": train_seconds,
        "train_bytes": train_bytes,
        "bytes_per_token": overall_bpt,
    })
    ctx.log_metrics({f"bytes_per_token.{metric_key(d)}": s.bytes_per_token
                     for d, s in sorted(stats.items()) if s.bytes_per_token is not None})
    ctx.set_rows("vocab", vocab_size)
    ctx.set_rows("train_documents", sum(s.train_docs for s in stats.values()))
    ctx.log_figure(_bytes_per_token_figure(stats), "bytes_per_token.png")

    report = {
        "vocab_size": vocab_size,
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "split_pattern": split_pattern(params.split_digits),
        "params": params.model_dump(),  # timings go to metrics only: the artifact's bytes depend on inputs
        "train_documents": sum(s.train_docs for s in stats.values()),
        "train_bytes": train_bytes,
        "sampled_bytes_before_cap": sampled_bytes,
        "cap_keep_fraction": sampler.keep_fraction,
        "bytes_per_token": overall_bpt,
        "bytes_per_token_measured_on": "held_out" if held_out else "train_fallback",
        "domain_weights_unused": unused_weights,
        "fallback_domains": sorted(fallback),
        "domains": {d: asdict(s) for d, s in sorted(stats.items())},
    }
    write_text_atomic(ctx.out_dir / REPORT_NAME, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", REPORT_NAME):
        path = ctx.out_dir / name
        if path.exists():
            ctx.log_artifact(path, "tokenizer")


def _count(params: TokenizerParams, ctx: StageContext, docs_path: Path,
           sampler: _Sampler) -> tuple[dict[str, DomainStats], int, list[str]]:
    """Pass 1: documents and bytes per domain, held out or sampled (with their weights' copies); sets the
    sampler's keep fraction where ``max_train_bytes`` binds. Returns the stats, the sampled bytes (before the
    cap) and the ``domain_weights`` keys that name no domain of the input."""
    stats: dict[str, DomainStats] = {}
    ctx.progress(f"counting documents in {docs_path}")
    for rec in ctx.track(iter_documents(docs_path), what="documents counted"):
        domain = _domain(rec)
        s = stats.setdefault(domain, DomainStats(weight=params.domain_weights.get(domain, 1.0)))
        n = len(rec["text"].encode("utf-8"))
        s.docs += 1
        s.bytes += n
        if sampler.is_eval(rec["id"]):
            s.eval_docs += 1
            s.eval_bytes += n
        else:
            c = sampler.copies(rec["id"], domain)
            s.sampled_docs += c
            s.sampled_bytes += c * n
    if not stats:
        raise ValueError(f"tokenizer: documents artifact {docs_path} holds no documents")
    sampled_bytes = sum(s.sampled_bytes for s in stats.values())
    if sampled_bytes == 0:
        raise ValueError(
            f"tokenizer: the training sample is empty (domains {sorted(stats)}, "
            f"domain_weights={params.domain_weights}, eval_fraction={params.eval_fraction}); "
            "give at least one domain a weight > 0")
    if params.max_train_bytes is not None and sampled_bytes > params.max_train_bytes:
        sampler.keep_fraction = params.max_train_bytes / sampled_bytes
    unused_weights = sorted(set(params.domain_weights) - set(stats))
    if unused_weights:
        ctx.logger.warning("tokenizer: domain_weights name domains absent from the input: %s", unused_weights)
    return stats, sampled_bytes, unused_weights


def _train(params: TokenizerParams, ctx: StageContext, docs_path: Path, sampler: _Sampler,
           stats: dict[str, DomainStats], sampled_bytes: int) -> tuple[Any, float]:
    """Pass 2: byte-level BPE trained on the weighted sample, streamed in input order (each domain's training
    copies and bytes counted into ``stats``). Returns the tokenizer and the seconds training took."""
    from tokenizers import pre_tokenizers, trainers  # heavy: the Rust tokenizers library, only to train

    def training_batches(batch_docs: int = 1000) -> Iterator[list[str]]:
        batch: list[str] = []
        budget = params.max_train_bytes
        for rec in ctx.track(iter_documents(docs_path), what="documents read for training"):
            if sampler.is_eval(rec["id"]) or not sampler.kept(rec["id"]):
                continue
            domain = _domain(rec)
            c = sampler.copies(rec["id"], domain)
            if c == 0:
                continue
            n = len(rec["text"].encode("utf-8"))
            if budget is not None and n * c > budget:
                continue  # the hash subsample overshot the cap: skip what does not fit
            if budget is not None:
                budget -= n * c
            stats[domain].train_docs += c
            stats[domain].train_bytes += n * c
            batch.extend([rec["text"]] * c)
            if len(batch) >= batch_docs:
                yield batch
                batch = []
        if batch:
            yield batch

    tok = build_tokenizer(params.split_digits)
    trainer = trainers.BpeTrainer(
        vocab_size=params.vocab_size,
        min_frequency=params.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),  # first: ids 0..k-1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown token
        show_progress=False,
    )
    ctx.progress(f"training byte-level BPE (vocab {params.vocab_size}) on ~{sampled_bytes * sampler.keep_fraction:,.0f} bytes")
    start = time.perf_counter()
    tok.train_from_iterator(training_batches(), trainer)
    return tok, time.perf_counter() - start


def _save_pretrained(tok: Any, params: TokenizerParams, out_dir: Path) -> None:
    """The trained tokenizer as a Hugging Face tokenizer directory, with its special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast  # heavy: transformers, only to save the tokenizer

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[*ROLE_TOKENS, END_OF_TURN_TOKEN],
        model_max_length=params.model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # keep decode(encode(x)) == x
    )
    hf.save_pretrained(out_dir)


def _measure(tok: Any, docs_path: Path, sampler: _Sampler, stats: dict[str, DomainStats],
             fallback: set[str], ctx: StageContext, batch_docs: int = 256) -> None:
    """Encode the measured documents (no special tokens) and fill bytes/tokens per domain."""
    batch: list[tuple[str, str]] = []

    def flush() -> None:
        encodings = tok.encode_batch([text for _, text in batch], add_special_tokens=False)
        for (domain, text), enc in zip(batch, encodings, strict=True):
            s = stats[domain]
            s.measured_docs += 1
            s.measured_bytes += len(text.encode("utf-8"))
            s.measured_tokens += len(enc.ids)
        batch.clear()

    for rec in ctx.track(iter_documents(docs_path), what="documents read for evaluation"):
        domain = _domain(rec)
        if sampler.is_eval(rec["id"]) != (domain not in fallback):
            continue
        batch.append((domain, rec["text"]))
        if len(batch) >= batch_docs:
            flush()
    if batch:
        flush()
    for s in stats.values():
        s.bytes_per_token = s.measured_bytes / s.measured_tokens if s.measured_tokens else None


def _bytes_per_token_figure(stats: dict[str, DomainStats]) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global backend state in a worker

    domains = [d for d, s in sorted(stats.items()) if s.bytes_per_token is not None]
    values = [stats[d].bytes_per_token for d in domains]
    fig = Figure(figsize=(max(4.0, 0.6 * len(domains) + 2), 3.5))
    ax = fig.add_subplot()
    bars = ax.bar(domains, values,
                  color=["tab:blue" if stats[d].measured_on == "held_out" else "tab:gray" for d in domains])
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_ylabel("UTF-8 bytes per token")
    ax.set_title("Tokenizer compression per domain (gray: measured on training docs)", fontsize=9)
    ax.tick_params(axis="x", labelrotation=45)
    return fig


STAGE = StageKind(
    # run records (StageKind.records): hashed and verified, not part of the digest; no stage reads them
    records=("tokenizer_report.json", "plots/*"),
    name="tokenizer",
    params=TokenizerParams,
    run=run,
    produces=TOKENIZER_TYPE,
    inputs={"documents": InputSpec(
        ANY_DOCUMENTS,
        doc="documents to train on; a deterministic eval_fraction (by id hash) is held out to measure "
            "bytes per token per domain")},
    doc="Byte-level BPE (HF tokenizers) with Llama-3-style splits, special tokens and a chat template "
        "with generation markers; saved for AutoTokenizer.from_pretrained(artifact_path).",
)
