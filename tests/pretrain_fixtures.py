"""Small real inputs for the pretrain stage: documents from the shipped sample corpus, a tokenizer trained with the
project's BPE pipeline and special tokens, and a mixture manifest as data/mix.py writes it."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import orjson
from tokenizers import Tokenizer, pre_tokenizers, trainers

from data.documents import DocumentWriter
from data.mix import MANIFEST_FILE, PACKING_TOKENS_PER_DOC
from data.tokenizer import SPECIAL_TOKENS, build_tokenizer
from pipeline.stage import Artifact

SAMPLE_CORPUS = Path(__file__).resolve().parents[1] / "data" / "sample_corpus"


@dataclass
class PretrainInputs:
    documents: Artifact
    tokenizer: Artifact
    mixture: Artifact

    def as_inputs(self) -> dict[str, Artifact]:
        return {"documents": self.documents, "tokenizer": self.tokenizer, "mixture": self.mixture}


def _artifact(path: Path, type_: str) -> Artifact:
    manifest = {"type": type_, "digest": f"test-{type_}", "rows": {}, "summary": {}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return Artifact(path=path, manifest=manifest)


def build_inputs(root: Path, *, documents: int = 120, max_chars: int = 3000, vocab_size: int = 512,
                 sample_count: int = 1) -> PretrainInputs:
    """``documents`` prose documents (truncated to ``max_chars``); every 10th gets sample_count 0 (held out)."""
    records = []
    with gzip.open(SAMPLE_CORPUS / "prose.jsonl.gz", "rb") as f:
        for line in f:
            r = orjson.loads(line)
            records.append({"id": r["id"], "text": r["text"][:max_chars], "source": "sample", "domain": "prose",
                            "metadata": {}})
            if len(records) == documents:
                break
    doc_dir = root / "documents"
    with DocumentWriter(doc_dir) as w:
        for r in records:
            w.write(r)
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True)
    tok = build_tokenizer()
    tok.train_from_iterator([r["text"] for r in records], trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tok_dir / "tokenizer.json"))
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    mix_dir = root / "mixture"
    mix_dir.mkdir()
    with gzip.GzipFile(mix_dir / MANIFEST_FILE, "wb", mtime=0) as f:
        for i, r in enumerate(records):
            count = 0 if i % 10 == 0 else sample_count
            n = len(tok.encode(r["text"], add_special_tokens=False).ids) + PACKING_TOKENS_PER_DOC
            f.write(orjson.dumps({
                "id": r["id"], "sample_count": count, "full_sample_count": count, "tokens": n, "bucket": "mid",
                "category": "prose", "domain": "prose", "score": 2.5, "dup_count": 1, "max_epochs": 3,
                "expected_epochs": float(count), "zero_reason": None if count else "budget"}) + b"\n")
    return PretrainInputs(_artifact(doc_dir, "scored_documents"), _artifact(tok_dir, "tokenizer"),
                          _artifact(mix_dir, "mixture"))
