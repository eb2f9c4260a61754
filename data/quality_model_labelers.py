"""The model-backed labelers of the ``quality`` stage: ``causal_lm`` (the paper's path, §4.1.1: an instruction-following
causal LM prompted with :data:`RUBRIC_TEMPLATE`, its replies parsed strictly) and ``reward_model`` (a trained reward
model's reward per dimension, as a mid-rank percentile of the labeled sample times 5)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from data.documents import QUALITY_DIMENSIONS as DIMENSIONS
from data.documents import SCORE_MAX, SCORE_MIN
from data.quality_labels import (
    CausalLMLabelerParams,
    Label,
    LabelDoc,
    LabelOutcome,
    MalformedReply,
    RewardModelLabelerParams,
    category_from_metadata,
    parse_reply,
)
from data.reward_scoring import REWARD_MODEL_DIR, RewardModelScorer
from pipeline.stage import MANIFEST_NAME, content_fingerprint

RUBRIC_TEMPLATE = """\
You rate documents for a language-model training corpus.

Rate the document below on two scales from 0 (none) to 5 (excellent), and name its category.
- knowledge_depth: how much specific, accurate knowledge it conveys and how deeply it explains why \
and how things work. 0 = none (noise, boilerplate), 3 = solid factual content, 5 = expert explanation.
- helpfulness: how useful it is to a reader who wants to understand or do something. 0 = useless, \
3 = useful with effort, 5 = clear, complete and directly usable.
- category: exactly one of: {categories}.

Document:
<<<
{document}
>>>

Reply with exactly these three lines and nothing else:
knowledge_depth: <integer 0-5>
helpfulness: <integer 0-5>
category: <one category from the list>"""


def directory_fingerprint(path: Path) -> dict[str, Any]:
    """Content identity of a model directory: its artifact digest, else each file's fingerprint."""
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        return {"artifact_digest": json.loads(manifest.read_text())["digest"]}
    return {"files": [{"path": p.relative_to(path).as_posix(), **content_fingerprint(p)}
                      for p in sorted(path.rglob("*")) if p.is_file()]}


def _model_directory(path: Path) -> Path:
    """``path`` itself when it holds a config.json; a training stage's checkpoint artifact holds its model in
    ``model/`` (pretrain/export.py), so that is taken too."""
    if (path / "config.json").is_file():
        return path
    if (path / "model" / "config.json").is_file():
        return path / "model"
    raise FileNotFoundError(
        f"causal_lm labeler: model_path {path} is not a Hugging Face model directory (no config.json, nor "
        "model/config.json of a checkpoint artifact); give a saved model directory or a checkpoint artifact")


def _labeler_device(choice: str, kind: str = "causal_lm") -> str:
    import torch  # heavy: only the model-backed labelers need it

    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{kind} labeler: device=cuda but this process sees no GPU (give the quality stage "
                           "`resources: {gpus: 1}` or set labeler.device to auto/cpu)")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


class CausalLMLabeler:
    """Prompts a local causal LM with :data:`RUBRIC_TEMPLATE`; greedy decoding; strict parsing."""

    kind = "causal_lm"

    def __init__(self, params: CausalLMLabelerParams, taxonomy: Sequence[str]) -> None:
        import torch  # heavy: torch and transformers, only for this labeler
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: transformers

        self.params = params
        self.taxonomy = tuple(taxonomy)
        given = Path(params.model_path).expanduser()
        self.model_path = _model_directory(given)
        tok_path = Path(params.tokenizer_path).expanduser() if params.tokenizer_path else self.model_path
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(
                f"causal_lm labeler: no tokenizer loadable from {tok_path} ({e}); set labeler.tokenizer_path "
                "to a tokenizer directory (e.g. the tokenizer stage's artifact)") from e
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(f"causal_lm labeler: tokenizer {tok_path} has neither a pad nor an eos "
                                 "token, so prompts cannot be batched")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if json.loads((self.model_path / "config.json").read_text()).get("model_type") == "hylight_hybrid":
            import model  # noqa: F401  (registers hylight_hybrid with the Auto classes; a fresh worker lacks it)
        self.device = torch.device(_labeler_device(params.device))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, local_files_only=True,
                                                          dtype=dtype).to(self.device).eval()
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None) or getattr(
            self.model.config, "n_positions", None)
        self.fingerprint = directory_fingerprint(given)

    def _prompt(self, document: str) -> str:
        text = RUBRIC_TEMPLATE.format(categories=", ".join(self.taxonomy), document=document)
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return text + "\n"

    def _doc_budget(self) -> int:
        """Document tokens that fit beside the rubric and the reply in the model's context."""
        budget = self.params.doc_tokens
        if self.max_positions:
            rubric = len(self.tokenizer(self._prompt(""), add_special_tokens=False).input_ids)
            budget = min(budget, self.max_positions - rubric - self.params.max_new_tokens)
        if budget < 16:
            raise ValueError(
                f"causal_lm labeler: the model's context ({self.max_positions} positions) leaves {budget} "
                f"tokens for the document beside the rubric and max_new_tokens={self.params.max_new_tokens}")
        return budget

    def label(self, docs: Sequence[LabelDoc], progress: Callable[[str], None] | None = None) -> LabelOutcome:
        import torch  # heavy: only the model-backed labelers need it

        outcome = LabelOutcome(info=self.describe())
        budget = self._doc_budget()
        tok = self.tokenizer
        for start in range(0, len(docs), self.params.batch_size):
            batch = docs[start:start + self.params.batch_size]
            cut = [tok.decode(tok(d.text, add_special_tokens=False).input_ids[:budget]) for d in batch]
            prompts = [self._prompt(c) for c in cut]
            # a chat template writes its own BOS; a plain prompt gets the tokenizer's specials
            enc = tok(prompts, return_tensors="pt", padding=True,
                      add_special_tokens=not bool(tok.chat_template))
            enc = enc.to(self.device)
            with torch.inference_mode():
                out = self.model.generate(**enc, max_new_tokens=self.params.max_new_tokens, do_sample=False,
                                          pad_token_id=tok.pad_token_id)
            replies = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for d, reply in zip(batch, replies, strict=True):
                outcome.replies[d.id] = reply
                try:
                    outcome.labels[d.id] = parse_reply(reply, self.taxonomy)
                except MalformedReply as e:
                    outcome.rejected[d.id] = e.reason
            if progress:
                progress(f"labeled {min(start + len(batch), len(docs))}/{len(docs)} documents "
                         f"({len(outcome.rejected)} replies rejected)")
        return outcome

    def describe(self) -> dict[str, Any]:
        return {"labeler_kind": self.kind, "model_path": str(self.model_path),
                "model_fingerprint": self.fingerprint, "model_class": type(self.model).__name__,
                "device": str(self.device),
                "generation": {"greedy": True, "max_new_tokens": self.params.max_new_tokens,
                               "doc_tokens": self.params.doc_tokens},
                "rubric_sha256": hashlib.sha256(RUBRIC_TEMPLATE.encode()).hexdigest()}


def reward_model_directory(path: Path) -> Path:
    """``path`` itself when it holds a config.json, else a reward_model artifact's ``reward_model/``."""
    for candidate in (path, path / REWARD_MODEL_DIR):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"reward_model labeler: model_path {path} is neither a saved reward model (no config.json) nor a "
        f"reward_model stage artifact (no {REWARD_MODEL_DIR}/config.json)")


def mid_rank_percentiles(values: Sequence[float]) -> list[float]:
    """Each value's mid-rank percentile in (0, 1): (average 1-based rank among equal values - 0.5) / n."""
    from scipy.stats import rankdata  # a dependency of scikit-learn, which the quality stage needs

    if not values:
        return []
    return [float(r) for r in (rankdata(values, method="average") - 0.5) / len(values)]


class RewardModelLabeler:
    """Scores each document with a reward model, once per dimension; the label is the reward's percentile x 5."""

    kind = "reward_model"

    def __init__(self, params: RewardModelLabelerParams, taxonomy: Sequence[str]) -> None:
        import torch  # heavy: only the model-backed labelers need it

        self.params = params
        self.taxonomy = tuple(taxonomy)
        given = Path(params.model_path).expanduser()
        self.model_path = reward_model_directory(given)
        self.device = torch.device(_labeler_device(params.device, self.kind))
        self.scorer = RewardModelScorer(self.model_path, batch_size=params.batch_size)
        if self.device.type == "cuda":
            self.scorer.model.to(device=self.device, dtype=torch.bfloat16)
        if not self.scorer.tokenizer.chat_template:
            raise ValueError(f"reward_model labeler: the tokenizer in {self.model_path} has no chat template; the "
                             "reward model scores (user turn, answer) conversations in its chat format")
        self.fingerprint = directory_fingerprint(given)

    def label(self, docs: Sequence[LabelDoc], progress: Callable[[str], None] | None = None) -> LabelOutcome:
        outcome = LabelOutcome(info=self.describe())
        tok = self.scorer.tokenizer
        cut = [tok.decode(tok(d.text, add_special_tokens=False).input_ids[:self.params.doc_tokens]) for d in docs]
        rewards: dict[str, list[float]] = {}
        step = max(self.params.batch_size * 8, 1)  # a progress line every few batches
        for n_dim, dim in enumerate(DIMENSIONS):
            rewards[dim] = []
            for start in range(0, len(cut), step):
                part = cut[start:start + step]
                rewards[dim] += self.scorer.score([self.params.prompts[dim]] * len(part), part)
                if progress:
                    done = n_dim * len(cut) + start + len(part)
                    progress(f"scored {done}/{len(cut) * len(DIMENSIONS)} (document, dimension) pairs")
        finite = [i for i in range(len(docs)) if all(math.isfinite(rewards[d][i]) for d in DIMENSIONS)]
        pct = {d: mid_rank_percentiles([rewards[d][i] for i in finite]) for d in DIMENSIONS}
        for i, d in enumerate(docs):
            outcome.replies[d.id] = "; ".join(f"{dim} reward {rewards[dim][i]:.6g}" for dim in DIMENSIONS)
        span = SCORE_MAX - SCORE_MIN
        for j, i in enumerate(finite):
            d = docs[i]
            category = category_from_metadata(d.id, d.domain, self.params.category_map, self.params.default_category)
            outcome.labels[d.id] = Label(knowledge_depth=SCORE_MIN + span * pct[DIMENSIONS[0]][j],
                                         helpfulness=SCORE_MIN + span * pct[DIMENSIONS[1]][j], category=category)
        kept = set(finite)
        for i, d in enumerate(docs):
            if i not in kept:
                outcome.rejected[d.id] = "non_finite_reward"
        outcome.info["rewards"] = {dim: _summary([rewards[dim][i] for i in finite]) for dim in DIMENSIONS}
        return outcome

    def describe(self) -> dict[str, Any]:
        return {"labeler_kind": self.kind, "model_path": str(self.model_path),
                "model_fingerprint": self.fingerprint, "model_class": type(self.scorer.model).__name__,
                "device": str(self.device), "doc_tokens": self.params.doc_tokens, "prompts": dict(self.params.prompts),
                "label": "mid-rank percentile of the reward among the labeled sample, times 5 (relative, not an "
                         "absolute grade)"}


def _summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {"count": len(ordered), "min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}
