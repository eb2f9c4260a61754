"""Scoring (prompt, response) pairs with a trained reward model: what the ``reward_model`` stage trains
(``posttrain/reward_model.py``) and what reads it - the quality stage's reward-model labeler
(``data/quality_labeler.py``), SFT's sample selection, DPO's pairs and GRPO's reward. It sits here, below both
``data`` and ``posttrain``, so neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

REWARD_MODEL_DIR = "reward_model"  # where a reward_model artifact keeps the saved model and tokenizer


def chat_messages(prompt: str, response: str) -> list[dict[str, str]]:
    """The conversation a reward model scores: one user turn and the assistant's response."""
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def score_sequences(model: Any, sequences: Sequence[Sequence[int]], pad_id: int, batch_size: int = 32) -> list[float]:
    """Reward of each token sequence: right-padded batches of similar length, no gradient. Memory is bounded by
    ``batch_size`` x the longest sequence of a batch."""
    import torch  # heavy: torch (data stages import this module without it)

    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out = [0.0] * len(sequences)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            width = max(len(sequences[i]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
                mask[row, :len(sequences[i])] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0]
            for row, i in enumerate(idx):
                out[i] = float(logits[row])
    model.train(was_training)
    return out



class RewardModelScorer:
    """A trained reward model directory (this stage's ``reward_model/``) scoring (prompt, response) pairs in the
    chat format it was trained on."""

    def __init__(self, model_dir: str | Path, batch_size: int = 32, max_length: int | None = None,
                 device: Any = "cpu") -> None:
        """``device``: where the model scores. The post-training stages pass their policy's GPU: on the CPU, a
        ``gpu-300m`` reward model took ~2 minutes of SFT's selection on a 4-GPU lease (issue 33)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # heavy: transformers

        import model  # noqa: F401  (registers hylight_hybrid with the Auto classes)
        from model.moe import make_dropless  # heavy: transformers, torch

        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"reward model: {model_dir} holds no config.json; point at a reward_model stage "
                                    f"artifact's {REWARD_MODEL_DIR}/ directory")
        self.model = make_dropless(AutoModelForSequenceClassification.from_pretrained(model_dir)).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {model_dir} has num_labels={self.model.config.num_labels}; a reward "
                             "model outputs one score (num_labels=1)")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.batch_size = batch_size
        self.max_length = max_length

    def encode(self, prompt: str, response: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template(chat_messages(prompt, response), tokenize=True, return_dict=True)
        ids = list(ids["input_ids"])
        # too long: keep the end (the response and its end-of-turn, where the score is read)
        return ids[-self.max_length:] if self.max_length else ids

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        seqs = [self.encode(p, r) for p, r in zip(prompts, responses, strict=True)]
        return score_sequences(self.model, seqs, self.tokenizer.pad_token_id, self.batch_size)
