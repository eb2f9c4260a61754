"""The ``eval`` stage's view of a checkpoint: its model and tokenizer, and what the stage asks of them (greedy answers
in one packed generate call, per-token log-probabilities, the log-likelihood of continuations and of a multiple-choice
item's choices).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.eval_tasks import MCItem


class Scorer:
    """The checkpoint's model and tokenizer, and the three things the stage asks of them."""

    def __init__(self, checkpoint: Path) -> None:
        import torch  # heavy: torch
        from tokenizers import Tokenizer  # heavy: tokenizers
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: transformers

        import model  # noqa: F401  (registers hylight_hybrid with the Auto classes)

        model_dir = checkpoint / "model"
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"eval: {model_dir} holds no model: the checkpoint must have pretrain's model/")
        self.torch = torch
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.chat = AutoTokenizer.from_pretrained(model_dir)  # for its chat template
        cfg = self.model.config
        self.bos, self.pad = int(cfg.bos_token_id), int(cfg.pad_token_id)
        eos = cfg.eos_token_id
        self.eos = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        self._number_start: list[int] | None = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self.chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[str]:
        """Greedy answers, one generate call for all prompts: prompts of different lengths are left-padded, and
        model/generation.py packs their real tokens (no compute on padding)."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.as_tensor(np.asarray(p, np.int64))
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      do_sample=False, use_cache=True, pad_token_id=self.pad, eos_token_id=self.eos)
        return [self.decode(row[width:].tolist()) for row in out]

    def token_logprobs(self, ids: Any, mask: Any = None, chunk: int = 1024, hits: bool = False,
                       dist_at: int | None = None) -> Any:
        """log p(ids[:, t + 1] | ids[:, :t + 1]) as float32 [B, T - 1]; the vocabulary projection in position chunks
        (memory O(B x chunk x V), not O(B x T x V)). With ``hits``, also bool [B, T - 1]: whether that token is the
        model's top-1 prediction. With ``dist_at`` (a position t), also the whole next-token distribution there,
        float32 log-probabilities [B, V] (what follows ``ids[:, :t + 1]``), appended to what is returned."""
        torch = self.torch
        if dist_at is not None and not 0 <= dist_at < ids.shape[1] - 1:
            raise ValueError(f"dist_at={dist_at} is not a position with a next token (0..{ids.shape[1] - 2})")
        dist = None
        with torch.no_grad():
            h = self.model.model(input_ids=ids, attention_mask=mask, use_cache=False,
                                 output_router_logits=False).last_hidden_state
            out, top = [], []
            for s in range(0, ids.shape[1] - 1, chunk):
                e = min(s + chunk, ids.shape[1] - 1)
                logp = self.model.lm_head(h[:, s:e]).float().log_softmax(-1)
                out.append(logp.gather(-1, ids[:, s + 1:e + 1, None]).squeeze(-1))
                if hits:
                    top.append(logp.argmax(-1) == ids[:, s + 1:e + 1])
                if dist_at is not None and s <= dist_at < e:
                    dist = logp[:, dist_at - s].clone()
        got = [torch.cat(out, dim=1)] + ([torch.cat(top, dim=1)] if hits else []) + ([dist] if dist is not None else [])
        return tuple(got) if len(got) > 1 else got[0]

    def number_start_ids(self) -> list[int]:
        """Ordinary vocabulary ids whose text, leading whitespace aside, begins with a digit: every way an answer
        that is a number can begin."""
        if self._number_start is None:
            self._number_start = [i for i in self.ordinary_token_ids()
                                  if self.tokenizer.decode([i], skip_special_tokens=True).lstrip()[:1].isdigit()]
        return self._number_start

    def continuation_logliks(self, prefix: Sequence[int], conts: Sequence[Sequence[int]],
                             mass_ids: Sequence[int] | None = None) -> Any:
        """Sum of log p over each continuation's tokens after ``prefix``; the continuations run as one right-padded
        batch. With ``mass_ids``, also the probability that the token after ``prefix`` is one of them (from the same
        forward pass): ``(logliks, mass)``."""
        torch = self.torch
        seqs = [[*prefix, *c] for c in conts]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = torch.tensor(s)
            mask[b, :len(s)] = 1
        start = len(prefix)  # first continuation token; its log-prob sits at index start - 1
        if mass_ids is None:
            logp = self.token_logprobs(ids.to(self.device), mask.to(self.device)).cpu()
        else:
            logp, dist = self.token_logprobs(ids.to(self.device), mask.to(self.device), dist_at=start - 1)
            logp = logp.cpu()
            ids_t = torch.as_tensor(list(mass_ids), dtype=torch.long, device=dist.device)
            mass = float(dist[0].index_select(0, ids_t).logsumexp(0).exp()) if len(mass_ids) else 0.0
        lls = [float(logp[b, start - 1:start - 1 + len(c)].sum()) for b, c in enumerate(conts)]
        return lls if mass_ids is None else (lls, mass)

    def ordinary_token_ids(self) -> list[int]:
        """Every vocabulary id that is not a special (added) token."""
        special = set(self.tokenizer.get_added_tokens_decoder())
        return [i for i in range(self.tokenizer.get_vocab_size(with_added_tokens=True)) if i not in special]

    def choice_logliks(self, item: MCItem, max_len: int) -> list[float]:
        """Sum of log p over each choice's continuation tokens after ``[BOS] context`` (the context cut from the left
        so the longest choice fits in ``max_len`` tokens); the choices of an item run as one right-padded batch."""
        ctx = self.encode(item.context)
        conts = [self.encode(item.continuation(i)) for i in range(len(item.choices))]
        room = max_len - 1 - max(len(c) for c in conts)
        ctx = ctx[-room:] if room > 0 else []
        return self.continuation_logliks([self.bos, *ctx], conts)
