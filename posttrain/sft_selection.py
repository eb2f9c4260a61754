"""How the ``sft`` stage picks its data (report §5.3): the target of one prompt from its scored samples
(:func:`select_target`: correct first, then the hierarchy's total), the n-gram and embedding diversity filters over
the selected targets (:func:`diversity_filter`, with :func:`policy_embeddings`: the policy's own mean-pooled last
hidden state), and the training conversation of a target (:func:`example_messages`). The stage
(:mod:`posttrain.sft`) samples, scores and drops; these are the rules it applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from data.reward_scoring import chat_messages
from posttrain.preference_pairs import reference_response
from posttrain.rewards import RewardComponents
from posttrain.verifiable import CHECKERS


@dataclass
class Target:
    """The SFT target chosen for one prompt."""

    record: dict[str, Any]
    response: str
    source: str  # 'sampled' or 'reference' (posttrain.sft.SOURCES)
    components: RewardComponents
    temperature: float | None  # the sample's temperature; None for a reference


def select_target(record: dict[str, Any], texts: Sequence[str], components: Sequence[RewardComponents], *,
                  reference_fallback: bool, reference_components: RewardComponents | None = None,
                  min_open_ended_reward: float | None = None,
                  temperatures: Sequence[float] | None = None) -> tuple[Target | None, str]:
    """(target, '') or (None, drop reason) for one prompt from its candidate samples (already filtered: finished,
    non-empty) and their hierarchy components. Ties go to the earlier candidate."""
    temps = list(temperatures) if temperatures is not None else [None] * len(texts)

    def best(idx: list[int]) -> int:
        return max(idx, key=lambda i: (components[i].total, -i))

    if record.get("checker") in CHECKERS:
        correct = [i for i, c in enumerate(components) if c.correct]
        if correct:
            i = best(correct)
            return Target(record, texts[i], "sampled", components[i], temps[i]), ""
        if not reference_fallback:
            return None, "no_correct_sample"
        if reference_components is None or not reference_components.correct:
            return None, "reference_incorrect"
        return Target(record, reference_response(record), "reference", reference_components, None), ""
    if not texts:
        return None, "no_finished_sample"
    i = best(list(range(len(texts))))
    if min_open_ended_reward is not None and components[i].total < min_open_ended_reward:
        return None, "below_min_reward"
    return Target(record, texts[i], "sampled", components[i], temps[i]), ""


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """Casefolded word n-grams of ``text`` (its words as one gram when it has fewer than n)."""
    words = text.casefold().split()
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def ngram_jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def diversity_filter(texts: Sequence[str], embeddings: Sequence[Sequence[float]] | None, *, ngram_size: int,
                     ngram_jaccard_max: float, embedding_cosine_max: float,
                     min_words: int) -> list[str]:
    """One verdict per text, in order: '' (kept), 'ngram_duplicate' or 'embedding_duplicate'. Each text is compared
    with the texts KEPT before it (a dropped one blocks nothing); texts under ``min_words`` words are kept and not
    compared. ``embeddings`` (one vector per text; None: no embedding filter) need not be normalised."""
    import torch  # heavy: torch

    verdicts: list[str] = []
    kept_grams: list[set] = []
    kept_vecs: list[Any] = []
    for i, text in enumerate(texts):
        if len(text.split()) < min_words:
            verdicts.append("")
            continue
        grams = word_ngrams(text, ngram_size)
        if any(ngram_jaccard(grams, g) > ngram_jaccard_max for g in kept_grams):
            verdicts.append("ngram_duplicate")
            continue
        vec = None
        if embeddings is not None:
            vec = torch.nn.functional.normalize(torch.as_tensor(embeddings[i], dtype=torch.float32), dim=0)
            if kept_vecs and float((torch.stack(kept_vecs) @ vec).max()) > embedding_cosine_max:
                verdicts.append("embedding_duplicate")
                continue
            kept_vecs.append(vec)
        kept_grams.append(grams)
        verdicts.append("")
    return verdicts


def policy_embeddings(model: Any, tokenizer: Any, texts: Sequence[str], batch_size: int = 16) -> list[list[float]]:
    """Mean over a text's tokens of the policy's last hidden state (the backbone's output, before the LM head).
    Right-padded batches: the model is causal, so the pads after a text do not change its states."""
    import torch  # heavy: torch

    out: list[list[float]] = [[] for _ in texts]
    device = next(model.parameters()).device
    encoded = [tokenizer(t, add_special_tokens=False).input_ids or [tokenizer.pad_token_id] for t in texts]
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            chunk = encoded[start:start + batch_size]
            width = max(len(e) for e in chunk)
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, e in enumerate(chunk):
                ids[row, :len(e)] = torch.tensor(e)
                mask[row, :len(e)] = 1
            hidden = model.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 use_cache=False).last_hidden_state.float()
            m = mask.to(device).unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1)
            for row in range(len(chunk)):
                out[start + row] = pooled[row].cpu().tolist()
    model.train(was_training)
    return out



def example_messages(target: Target) -> list[dict[str, str]]:
    """The training conversation. The target's leading whitespace is dropped: the template ends the assistant
    header with a newline, and byte-level BPE would merge that newline with a leading newline or space of the
    response into one token, which the assistant mask then labels (half of it is the template)."""
    return chat_messages(target.record["prompt"], target.response.lstrip())
