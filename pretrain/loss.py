"""The training loss the pretrain stage installs on the model (``model.loss_function``), applied from outside
``model/`` like the DeepSpeed engine.

``causal_lm_loss`` is transformers' ``ForCausalLMLoss`` without ``num_items_in_batch``: labels shifted left by one
(the last position gets -100), mean cross-entropy over positions whose label is not -100, in fp32. Written as one
small function so ``torch.compile`` can fuse it: inductor computes the log-sum-exp over the bf16 logits with an
online reduction and writes the gradient (softmax - one-hot) in one pass, so the [tokens, vocab] fp32 copy of the
logits and the fp32 log-softmax that the eager path materialises (2 GiB each at 16K tokens x 32K vocab) never
exist. Eager (CPU, ``compile: false``) it is the same arithmetic as transformers'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **_: Any) -> torch.Tensor:
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, vocab_size).float(), shifted.reshape(-1).to(logits.device),
                           ignore_index=-100)


_compiled: Any = None


def install_loss(model: torch.nn.Module, compile_: bool) -> None:
    """Set ``model.loss_function`` (transformers' hook) to ``causal_lm_loss``, compiled when ``compile_``."""
    global _compiled
    fn = causal_lm_loss
    if compile_:
        if _compiled is None:
            _compiled = torch.compile(causal_lm_loss, dynamic=False)
        fn = _compiled
    model.loss_function = fn
