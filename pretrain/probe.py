"""The in-training retrieval probe: copy accuracy and NIAH forced choice every ``probe_every`` steps (issue 22).

The ``eval`` stage measures retrieval once, at the end; learning to copy is a phase change (Olsson et al.), so
``pretrain`` and ``long_context`` also measure it while they train, on held-out text, and log it as a curve:

* ``copy_accuracy``: top-1 accuracy on the second copy of ``[BOS] R R`` (``R`` tokens drawn uniformly from the
  distinct ordinary tokens of the held-out text: tokens a model trained on this corpus has met, in an order no
  text has; ``data/eval_tasks.build_copy_trials``), and ``copy_loss_gain``, the first copy's mean loss minus
  the second's (nats); the eval stage's default ``copy_pool``. ``copy_pool="vocab"`` draws from the whole ordinary
  vocabulary instead: on a small corpus many of a 32K vocabulary's tokens are never a training target, and a model
  that copies every token it has met can still score 0 there;
* ``niah_choice_accuracy``: vanilla NIAH prompts of the training length (``data/eval_tasks``: the needle in
  a haystack of held-out rows, one prompt per depth from 0 to 1) scored as a forced choice between the needle's
  number and ``distractors`` numbers the prompt never held (teacher-forced log-likelihood of each as the answer;
  chance is 1 / (1 + distractors)), and ``niah_answer_margin`` (nats: the needle's number minus the distractors'
  mean).

The eval's own prompt builders are used, so the probe and the stage measure the same thing; the probe never trains
on them. It runs whole packed sequences (no cache), in eval mode without gradients; every rank runs it (expert
parallelism needs all ranks in each forward), rank 0 reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.eval_tasks import (
    TokenStream,
    build_copy_trials,
    build_niah_trials,
    held_out_token_pool,
    niah_distractors,
)

DISTRACTORS = 3  # wrong numbers per NIAH prompt: chance is 1 / (1 + DISTRACTORS)
CHANCE = 1.0 / (1 + DISTRACTORS)
# the eval stage's names (evaluation/eval.py), so a training curve and an eval report read alike
PROBE_METRICS = ("copy_accuracy", "copy_loss_gain", "niah_choice_accuracy", "niah_answer_margin")


class RetrievalProbe:
    """Built once per run from the tokenizer and the held-out rows; :meth:`run` measures a model."""

    def __init__(self, tokenizer_dir: str | Path, eval_rows: Any, *, seq_len: int, trials: int, seed: int,
                 distractors: int = DISTRACTORS, copy_tokens: int = 64, copy_pool: str = "seen") -> None:
        from tokenizers import Tokenizer  # heavy: tokenizers (Rust extension)

        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        special = set(tok.get_added_tokens_decoder())
        self.bos = int(eval_rows.info.special_ids["bos"])

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids

        text: list[np.ndarray] = []
        need = seq_len * 2
        for i in range(len(eval_rows)):  # held-out text, special tokens out, enough for a few haystacks
            tokens, _, pad = eval_rows.row(i)
            text.append(tokens[~pad & ~np.isin(tokens, list(special))])
            need -= text[-1].size
            if need <= 0:
                break
        stream = TokenStream(np.concatenate(text))
        depths = np.linspace(0.0, 1.0, trials).round(4).tolist() if trials > 1 else [0.5]
        self.niah = build_niah_trials(stream, encode, self.bos, [seq_len], depths, 1, seed)
        wrong = niah_distractors(self.niah, distractors, seed)
        self.candidates = [[encode(f" {x}") for x in [t.number, *w]] for t, w in zip(self.niah, wrong, strict=True)]
        self.chance = 1.0 / (1 + distractors)
        if copy_pool not in ("seen", "vocab"):
            raise ValueError(f"copy_pool={copy_pool!r}: expected 'seen' or 'vocab'")
        ordinary = [i for i in range(tok.get_vocab_size(with_added_tokens=True)) if i not in special]
        if copy_pool == "seen":
            ordinary = held_out_token_pool(np.concatenate(text), ordinary)
        self.copy_pool_size = len(ordinary)
        n = max(4, min(copy_tokens, (seq_len - 1) // 2))
        self.copy = build_copy_trials(ordinary, self.bos, trials, n, seed)

    @staticmethod
    def _packed_logprobs(model: Any, seqs: list[list[int]], device: torch.device,
                         targets: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence, (log-prob of the token at each of ``targets`` positions, whether it was the argmax): one
        packed forward (``cu_seqlens``: each sequence is its own document), the LM head only where needed."""
        ids = torch.tensor([t for s in seqs for t in s], device=device)[None]
        lens = torch.tensor([len(s) for s in seqs])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()]).to(device)[None]
        h = model.model(input_ids=ids, cu_seqlens=cu.to(device), position_ids=pos,
                        output_router_logits=False).last_hidden_state[0]
        out = []
        for k, tgt in enumerate(targets):
            at = torch.as_tensor(np.asarray(tgt, np.int64) + int(cu[k]), device=device)
            logp = torch.log_softmax(model.lm_head(h[at - 1]).float(), dim=-1)  # position p is predicted at p - 1
            want = ids[0, at]
            out.append((logp.gather(1, want[:, None])[:, 0], logp.argmax(-1) == want))
        return out

    @torch.no_grad()
    def run(self, model: Any, device: torch.device) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            copy = self._packed_logprobs(
                model, [t.ids for t in self.copy], device,
                [np.r_[np.asarray(t.first_copy_targets()), np.asarray(t.second_copy_targets())] for t in self.copy])
            acc, gain = [], []
            for t, (lp, hit) in zip(self.copy, copy, strict=True):
                m = len(t.first_copy_targets())
                acc.append(float(hit[m:].float().mean()))
                gain.append(float(-lp[:m].mean() + lp[m:].mean()))
            choice, margin = [], []
            for t, cands in zip(self.niah, self.candidates, strict=True):
                seqs = [t.ids + c for c in cands]
                lls = [float(lp.sum()) for lp, _ in self._packed_logprobs(
                    model, seqs, device, [np.arange(len(t.ids), len(s)) for s in seqs])]
                choice.append(lls[0] > max(lls[1:]))
                margin.append(lls[0] - float(np.mean(lls[1:])))
        finally:
            model.train(was_training)
        return {"copy_accuracy": float(np.mean(acc)), "copy_loss_gain": float(np.mean(gain)),
                "niah_choice_accuracy": float(np.mean(choice)), "niah_answer_margin": float(np.mean(margin))}


def probe_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The logged steps that carry a probe."""
    return [h for h in history if "copy_accuracy" in h]


def probe_figure(history: list[dict[str, Any]], chance: float | None = CHANCE,
                 boundaries: list[tuple[int, str]] | None = None) -> Any:
    """Copy accuracy and NIAH forced-choice accuracy against the step (``boundaries``: phase ends, labelled), or
    None without probes."""
    rows = probe_history(history)
    if not rows:
        return None
    import matplotlib.pyplot as plt  # heavy: matplotlib

    steps = [h["step"] for h in rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    ax[0].plot(steps, [h["copy_accuracy"] for h in rows], "o-", label="copy accuracy (second copy, top-1)")
    ax[0].plot(steps, [h["niah_choice_accuracy"] for h in rows], "s-", label="NIAH forced choice")
    if chance is not None:
        ax[0].axhline(chance, color="gray", ls=":", label=f"forced-choice chance {chance:.2f}")
    ax[0].set(ylim=(-0.02, 1.02), xlabel="step", ylabel="accuracy", title="retrieval probe (held-out text)")
    ax[0].legend(fontsize=8)
    ax[1].plot(steps, [h["copy_loss_gain"] for h in rows], "o-", label="copy loss gain (1st - 2nd copy)")
    ax[1].plot(steps, [h["niah_answer_margin"] for h in rows], "s-", label="NIAH answer margin")
    ax[1].axhline(0, color="gray", lw=0.8)
    ax[1].set(xlabel="step", ylabel="nats", title="the same, graded")
    ax[1].legend(fontsize=8)
    for step, label in boundaries or []:
        for a in ax:
            a.axvline(step, color="gray", ls="--", lw=0.8)
        ax[0].annotate(label, (step, 0.02), fontsize=7, rotation=90, ha="right")
    return fig
