"""The text the ``eval`` stage measures on: exactly the pretrain stage's held-out documents.

``pretrain/packed_data.py`` chose them for ``eval_loss`` (documents the mixture never samples first, else ones it
took out of training); :func:`heldout_documents` recomputes that choice from the mixture with the seed and count in
the checkpoint's ``packing.json``, checks it against the document and token counts recorded there, and reads the
documents' texts from the scored documents the mixture was planned from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.documents import iter_documents


@dataclass
class HeldOut:
    docs: list[tuple[str, str]]  # (id, text) in pretrain's held-out order
    seq_len: int  # the checkpoint's trained length
    info: dict[str, Any]


def heldout_documents(checkpoint: Path, mixture: Path, documents: Path) -> HeldOut:
    """The documents the checkpoint's pretrain stage held out, with their texts (module docstring)."""
    from pretrain.packed_data import INFO_FILE, _choose_eval, _read_mixture, heldout_seed  # heavy: torch

    packing_file = checkpoint / INFO_FILE
    if not packing_file.is_file():
        raise FileNotFoundError(f"eval: checkpoint {checkpoint} has no {INFO_FILE}: the eval stage needs a checkpoint "
                                "written by the pretrain stage (it names the held-out documents' seed and count)")
    packing = json.loads(packing_file.read_text())
    table = _read_mixture(mixture)
    mixture_tokens = int((table.tokens * table.counts).sum())
    if (len(table.ids), mixture_tokens) != (packing["mixture_documents"], packing["mixture_tokens"]):
        raise ValueError(
            f"eval: mixture {mixture} has {len(table.ids)} documents / {mixture_tokens} tokens but checkpoint "
            f"{checkpoint} was trained on one of {packing['mixture_documents']} / {packing['mixture_tokens']}: bind the "
            "eval stage to the mix (and quality) stages the pretrain stage read")
    # The pretraining run's held-out set: its seed and size, and the training tokens it took out. These fields are
    # carried unchanged by the stages that continue a checkpoint (long_context, post-training), whose own `eval`
    # block describes their own rows; pretrain's `eval` block counts exactly these documents.
    count = int(packing["held_out_from_training"]) + int(packing["eval_from_unsampled"])
    chosen = _choose_eval(table, heldout_seed(packing), count)
    taken = int((table.tokens[chosen] * table.counts[chosen]).sum())
    own = packing["eval"]["documents"] == count and int(table.tokens[chosen].sum()) == packing["eval"]["tokens"]
    if taken != packing["held_out_training_tokens"] or (packing["eval"]["documents"] == count and not own):
        raise ValueError(f"eval: the held-out documents recomputed from {mixture} do not match what "
                         f"{checkpoint}/{INFO_FILE} records ({packing['held_out_training_tokens']} training tokens "
                         f"held out, {packing['eval']['tokens']} eval tokens): not the pretrain stage's held-out set")
    where = {int(i): k for k, i in enumerate(chosen)}
    texts: list[tuple[str, str] | None] = [None] * len(chosen)
    found = 0
    for i, rec in enumerate(iter_documents(documents)):
        if i in where:
            if rec["id"] != table.ids[i]:
                raise ValueError(f"eval: documents {documents} hold {rec['id']!r} at position {i} where the mixture "
                                 f"lists {table.ids[i]!r}: not the scored_documents the mixture was planned from")
            texts[where[i]] = (rec["id"], rec["text"])
            found += 1
            if found == len(chosen):
                break
    if any(t is None for t in texts):
        raise ValueError(f"eval: documents {documents} end before the mixture's held-out documents")
    info = {"documents": len(chosen), "tokens_with_bos_eos": int(table.tokens[chosen].sum()),
            "held_out_from_training": packing["held_out_from_training"],
            "never_sampled": packing["eval_from_unsampled"], "ids": [t[0] for t in texts]}
    return HeldOut([t for t in texts if t is not None], int(packing["seq_len"]), info)
