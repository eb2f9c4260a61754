"""Which part of the pretrain stage's copy rows slows copying? (CPU minutes a run, or a GPU; issue 33, 2026-11-27)

Trains ``bench/copy_toy.py``'s toy hybrid (d 128, 8 layers; ``--size gpu-300m`` a named size; head started as the
embedding, AdamW ``--lr`` 1e-3 after 20 warm-up steps, clip 1.0; ``--device cuda``: bf16 autocast) on ``--rows`` 8
rows of ``--L`` tokens a step, each row packed with copy samples, each sample its own
document (``cu_seqlens``, positions from 0), in the layout of ``data/retrieval.copy_sample``:
``[BOS] x R MARK R [EOS]`` (``R``: ``--lo``..``--hi`` ids drawn uniformly; ``x``: fillers where the length needs them;
the last sample of a row takes what is left of it). Each flag takes one part of that layout away:

    python bench/copy_rows.py                                              # the stage's rows: BOS, 5-id marker, EOS
    python bench/copy_rows.py --eos-target 1                               # ... as they were: the EOS a target
    python bench/copy_rows.py --lo 32 --hi 32 --mark 0 --bos 0 --eos 0 --first 0   # the copy probe's pairs
    python bench/copy_rows.py --lo 32 --hi 32 --mark 0 --bos 0 --first 0 --L 260 --eos-target 1   # ... with an EOS
    python bench/copy_rows.py --lo 16 --hi 48 --mark 0 --bos 0 --eos 0 --first 0   # ... spans of 16-48
    python bench/copy_rows.py --lo 32 --hi 32 --mark 0 --bos 0 --eos 0 --first 0 --steps 400 \
        --eval-lo 16 --eval-hi 48                                              # fixed spans, scored on varying ones

``--eos-target 1`` makes the EOS a target too, as the stage's rows did until 2026-11-27 (BENCHMARKS.md: that
alone stopped the toy from learning short spans). ``--first 0`` leaves the repeat's first id out of the loss (no
model can predict it), as copy_toy does. Every 25 steps one JSON line: the training loss on the batch,
``copy_accuracy`` (top-1 over the targets of a fresh batch: the repeat, by default with its first id) and, with
``--eval-hi``, the loss and accuracy on a fresh batch whose spans are drawn from ``--eval-lo``..``--eval-hi``. ln V
is 8.32 at the default 4,096 ids (8 reserved). The ``--eval-hi`` batch comes from the training draws (as in
BENCHMARKS.md's runs), the accuracy batch from draws of its own. BENCHMARKS.md ("The whole spec in one lease") has
the tables.

The samples are built here rather than by ``data.retrieval.copy_sample`` because every part of them is switched on
and off, and because BENCHMARKS.md's runs are reproduced by these exact draws; with the defaults the targets are
the ones ``copy_sample`` marks (``tests/test_copy_toy.py`` checks that), with the marker ids 4-8 in place of the
tokenizer's marker.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy_toy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lo", type=int, default=16, help="shortest span")
    ap.add_argument("--hi", type=int, default=48, help="longest span")
    ap.add_argument("--mark", type=int, default=5, help="marker ids between the span and its repeat (0: none)")
    ap.add_argument("--bos", type=int, default=1, help="1: each sample starts with BOS")
    ap.add_argument("--eos", type=int, default=1, help="1: each sample ends with EOS (a target only with --eos-target 1)")
    ap.add_argument("--eos-target", type=int, default=0, help=(
        "with --eos 1: 1 makes the EOS a target too (the stage's rows before 2026-11-27; data.retrieval.copy_sample "
        "no longer does)"))
    ap.add_argument("--first", type=int, default=1, help="1: the repeat's first id is a target (the stage's rows)")
    ap.add_argument("--L", type=int, default=256, help="row length")
    ap.add_argument("--eval-lo", type=int, default=0)
    ap.add_argument("--eval-hi", type=int, default=0, help="also score spans of eval-lo..eval-hi every 25 steps")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=8, help="rows a step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--head-init", default="embed", choices=("embed", "xavier"), help="copy_toy's --head-init")
    ap.add_argument("--size", default="", help="a named model size (model/sizes.py) instead of the toy")
    ap.add_argument("--device", default="cpu", help="cuda: bf16 autocast on the GPU")
    return ap.parse_args(argv)


class Rows:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.lo, self.hi = a, a.lo, a.hi
        self.rng = np.random.default_rng(a.seed)
        self.pool = np.arange(8, a.vocab)
        self.mark = np.arange(4, 4 + a.mark) if a.mark else np.zeros(0, np.int64)

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """One sample of ``n`` tokens and its no-loss mask."""
        a, rng, pool = self.a, self.rng, self.pool
        lead = [0] if a.bos else []
        span = (n - len(lead) - self.mark.size - a.eos) // 2
        r = pool[rng.integers(pool.size, size=span)]
        x = pool[rng.integers(pool.size, size=n - len(lead) - self.mark.size - a.eos - 2 * span)]
        t = np.concatenate([lead, x, r, self.mark, r, [1] * a.eos]).astype(np.int64)
        no_loss = np.ones(n, bool)
        no_loss[len(t) - a.eos - span + (0 if a.first else 1):] = False
        if a.eos and not a.eos_target:
            no_loss[-1] = True
        return t, no_loss

    def row(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, L = self.a, self.a.L
        pieces, masks, starts, space = [], [], [0], L
        extra = (1 if a.bos else 0) + a.eos + self.mark.size
        while space:
            n = min(2 * int(self.rng.integers(self.lo, self.hi + 1)) + extra, space)
            if space - n < 2 * self.lo + extra:
                n = space  # the last sample takes the rest of the row
            t, no_loss = self.sample(n)
            pieces.append(t)
            masks.append(no_loss)
            space -= n
            if space:
                starts.append(L - space)
        return np.concatenate(pieces), np.asarray(starts + [L]), np.concatenate(masks)

    def batch(self) -> dict[str, torch.Tensor]:
        """``--rows`` rows as one packed sequence (the stage's make_batch layout)."""
        L, rows = self.a.L, self.a.rows
        ids, labels, pos, cu = [], [], [], []
        for b in range(rows):
            t, st, no_loss = self.row()
            keep = ~no_loss
            keep[st[:-1]] = False
            ids.append(t)
            labels.append(np.where(keep, t, -100))
            pos.append(np.arange(L) - np.repeat(st[:-1], np.diff(st)))
            cu.append(st[:-1] + b * L)
        cu.append([rows * L])
        return {"input_ids": torch.from_numpy(np.concatenate(ids).astype(np.int64))[None],
                "labels": torch.from_numpy(np.concatenate(labels).astype(np.int64))[None],
                "position_ids": torch.from_numpy(np.concatenate(pos))[None],
                "cu_seqlens": torch.from_numpy(np.concatenate(cu).astype(np.int32))}


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    model = copy_toy.build_model(copy_toy.parse_args(["--vocab", str(a.vocab), "--seq-len", str(a.L),
                                                      "--head-init", a.head_init, "--size", a.size,
                                                      "--device", a.device]))
    device = torch.device(a.device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast:  # cu_seqlens stays on the host, as the stage passes it
            return model(**{k: v if k == "cu_seqlens" else v.to(device) for k, v in batch.items()}).loss

    @torch.no_grad()
    def scored(batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(loss, top-1 accuracy over the targets) of a fresh batch, in eval mode."""
        model.eval()
        with autocast:
            out = model(**{k: v if k == "cu_seqlens" else v.to(device) for k, v in batch.items()})
        model.train()
        target = batch["labels"][0, 1:].to(device)
        keep = target != -100
        acc = (out.logits[0, :-1].argmax(-1)[keep] == target[keep]).float().mean()
        return round(float(out.loss), 3), round(float(acc), 3)

    rows = Rows(a)
    probe = Rows(argparse.Namespace(**{**vars(a), "seed": a.seed + 1}))
    t0 = time.time()
    for step in range(1, a.steps + 1):
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, step / 20)
        loss = loss_of(rows.batch())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == a.steps:
            rec = {"step": step, "loss": round(float(loss.detach()), 3)}
            _, rec["copy_accuracy"] = scored(probe.batch())  # its own draws: training's stay as they were
            if a.eval_hi:
                rows.lo, rows.hi = a.eval_lo, a.eval_hi
                rec["eval_loss"], rec["eval_copy_accuracy"] = scored(rows.batch())
                rows.lo, rows.hi = a.lo, a.hi
            print(json.dumps({**rec, "ln_v": round(math.log(a.vocab - 8), 2), "seconds": round(time.time() - t0)}),
                  flush=True)


if __name__ == "__main__":
    main()
