"""How fast does ``model/``'s hybrid learn to copy, by the vocabulary of what it copies? (CPU, minutes; issue 22)

Trains a small hybrid (``--layers`` layers, d ``--d``, vocabulary ``--vocab``) from scratch on rows of random spans
of ``--span`` ids, each repeated once right after itself, the loss on the repeat alone (the induction task of the
issue's toy), plain AdamW. Every 50 steps it prints the training loss and the top-1 accuracy on the repeats of 16
fresh rows drawn from the whole vocabulary (ln V is the loss of a model that does not copy). Span ids are drawn

* uniformly from the ``--vocab`` ids (default),
* ``--zipf``: with p ∝ 1/rank, as words are,
* ``--small N --small-steps S``: uniformly from the first N ids for the first S steps, then from all (a curriculum).

    python bench/copy_toy.py --vocab 256                     # copies within ~150 steps on one core
    python bench/copy_toy.py --vocab 4096                    # nothing in 200 steps
    python bench/copy_toy.py --vocab 4096 --zipf --steps 400
    python bench/copy_toy.py --vocab 4096 --small 260 --small-steps 150 --steps 400

On a GPU (issue 33): ``--size gpu-300m`` builds a named size instead of the toy, ``--device cuda`` trains it in
bf16 autocast (``--fp32``: not), ``--dropless`` turns the MoE's token drop off, ``--packed`` lays each span pair
out as its own document as the recipe's copy rows are, ``--pattern all-softmax`` trains without lightning layers
and ``--tied`` ties the output head to the embedding. ``bench/copy_probe_gpu.sh`` runs variants one per GPU.

    python bench/copy_toy.py --size gpu-300m --device cuda --vocab 32768 --span 256 --seq-len 513 --rows 32 \
        --steps 750 --lr 5e-4                                # the issue's probe task: ~175 s on an H100

One JSON line per report. BENCHMARKS.md ("Retrieval on one H100, continued"; "The recipe on a 2-GPU host in one
lease") has the measured tables.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

RESERVED = 4  # ids below this are never drawn (id 0 starts each row)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--span", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--zipf", action="store_true")
    ap.add_argument("--small", type=int, default=0)
    ap.add_argument("--small-steps", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--span-min", type=int, default=0, help=(
        "draw each pair's span uniformly from [span-min, span] instead of always --span (0: fixed). A fixed span "
        "can be copied by attending a fixed distance back (position alone); spans of varying length, each pair "
        "its own document under --packed, can only be copied by finding the current id earlier in the span and "
        "taking the one after it (an induction head), which is what the recipe's copy rows and retrieval need. "
        "The accuracy check draws its spans the same way"))
    ap.add_argument("--eval-span", type=int, nargs=2, metavar=("MIN", "MAX"), default=None, help=(
        "also report the accuracy on spans drawn from [MIN, MAX] (eval_copy_accuracy): does what was learnt on "
        "the training spans carry over to others?"))
    ap.add_argument("--fixed-steps", type=int, default=0, help=(
        "with --span-min: the first S steps' spans are all --span (a curriculum: fixed-distance copying first)"))
    ap.add_argument("--text-share", type=float, default=0.0, help=(
        "share of each batch's rows that are i.i.d. Zipf tokens with the loss on every token (a stand-in for text: "
        "learnable as a unigram, no copying), as the recipe's copy curriculum mixes copy rows with text"))
    ap.add_argument("--packed", action="store_true", help=(
        "lay each batch out as pretrain/packed_data.make_batch does: all rows as one sequence, each span pair its "
        "own document (cu_seqlens, position ids restarting), as the recipe's copy rows are; default: each row one "
        "sequence of span pairs back to back"))
    ap.add_argument("--size", default="", help=(
        "a named model size (model/sizes.py, e.g. gpu-300m) at --vocab instead of the --d/--layers toy"))
    ap.add_argument("--device", default="cpu", help="cuda: the model in bf16 autocast on the GPU")
    ap.add_argument("--fp32", action="store_true", help="on cuda: no bf16 autocast")
    ap.add_argument("--dropless", action="store_true", help="train the MoE dropless (moe_token_drop false)")
    ap.add_argument("--pattern", default="hybrid", choices=("hybrid", "all-softmax", "all-lightning"),
                    help="the attention pattern (model/configuration.py)")
    ap.add_argument("--tied", action="store_true", help=(
        "tie the output head to the input embedding (MiniMax-Text-01 does not; a diagnostic: copying then needs no "
        "learnt map from each id's embedding back to its logit)"))
    ap.add_argument("--warmup", type=int, default=20, help="linear LR warm-up steps, then constant")
    ap.add_argument("--head-init", default="xavier", choices=("xavier", "embed"), help=(
        "embed: the (untied) output head starts as a copy of the input embedding, so that an id's embedding scores "
        "its own id highest from the first step; xavier: drawn on its own (the model's init)"))
    return ap.parse_args(argv)


class CopyRows:
    """Batches of rows of span pairs (and text stand-in rows), their labels on each repeat after its first token."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.V, self.L, self.span = args, args.vocab, args.seq_len, args.span
        self.rng = np.random.default_rng(args.seed)
        zipf = 1.0 / np.arange(1, self.V - RESERVED + 1)
        self.zipf = zipf / zipf.sum()

    def span_of(self, step: int | None) -> int:
        """This pair's span: --span, or uniform in [--span-min, --span] (after --fixed-steps)."""
        args = self.args
        if not args.span_min or (step is not None and step <= args.fixed_steps):
            return self.span
        return int(self.rng.integers(args.span_min, self.span + 1))

    def draw(self, step: int | None, span: int) -> np.ndarray:
        args, V = self.args, self.V
        if args.zipf:
            return RESERVED + self.rng.choice(V - RESERVED, size=span, p=self.zipf)
        hi = args.small if args.small and step is not None and step <= args.small_steps else V
        return self.rng.integers(RESERVED, hi, size=span)

    def batch(self, n: int, step: int | None, text_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        L, span, V = self.L, self.span, self.V
        ids = np.zeros((n, L), np.int64)
        labels = np.full((n, L), -100, np.int64)
        for b in range(n - text_rows, n):  # the text stand-in: Zipf tokens, every one a target
            ids[b, 1:] = RESERVED + self.rng.choice(V - RESERVED, size=L - 1, p=self.zipf)
            labels[b, 2:] = ids[b, 2:]
        self.cuts = [[1] for _ in range(n)]  # per row: where each span pair starts a document (packed())
        for b in range(n - text_rows):
            p = 1
            while True:
                span = self.span_of(step)
                if p + 2 * span > L:
                    break
                r = self.draw(step, span)
                ids[b, p:p + span] = ids[b, p + span:p + 2 * span] = r
                labels[b, p + span + 1:p + 2 * span] = r[1:]  # the repeat after its first token
                p += 2 * span
                self.cuts[b].append(p)
        return torch.from_numpy(ids), torch.from_numpy(labels)

    def packed(self, n: int) -> dict[str, torch.Tensor]:
        """The last :meth:`batch`'s ``n`` rows as one sequence of documents: each row's first token, each span
        pair, the row's tail."""
        L = self.L
        bounds, positions = [0], []
        for b in range(n):
            cuts = self.cuts[b] + ([L] if self.cuts[b][-1] != L else [])
            start = 0
            for c in cuts:
                if c > start:
                    positions.append(torch.arange(c - start))
                    bounds.append(b * L + c)
                    start = c
        return {"position_ids": torch.cat(positions)[None],
                "cu_seqlens": torch.tensor(sorted(set(bounds)), dtype=torch.int32)}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from model.modeling import HybridForCausalLM
    from model.sizes import config_for

    V, L = args.vocab, args.seq_len
    extra = {"attention_pattern": args.pattern, "tie_word_embeddings": args.tied}
    if args.dropless:
        extra["moe_token_drop"] = False
    if args.size:
        cfg = config_for(args.size, vocab_size=V, **extra)
    else:
        cfg = config_for("tiny", vocab_size=V, hidden_size=args.d, num_hidden_layers=args.layers,
                         num_attention_heads=max(2, args.d // 32), head_dim=32,
                         num_key_value_heads=max(1, args.d // 64), max_position_embeddings=max(L, 256), **extra)
    model = HybridForCausalLM(cfg)
    if args.head_init == "embed" and not args.tied:  # what the pretrain stage's head_init: embedding runs
        from pretrain.train import init_head_from_embedding

        init_head_from_embedding(model)
    return model.to(torch.device(args.device))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = build_model(args)
    device = torch.device(args.device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and not args.fp32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = CopyRows(args)

    def forward(x: torch.Tensor, y: torch.Tensor | None = None, rows: CopyRows = data):
        n = x.shape[0]
        x, y = x.to(device), None if y is None else y.to(device)
        with autocast:
            if not args.packed:
                return model(input_ids=x, labels=y)
            extra = {k: v.to(device) if k == "position_ids" else v for k, v in rows.packed(n).items()}
            out = model(input_ids=x.reshape(1, -1), labels=None if y is None else y.reshape(1, -1), **extra)
        out.logits = out.logits.reshape(n, args.seq_len, -1)
        return out

    def accuracy(rows: CopyRows) -> float:
        """Top-1 accuracy on the repeats of 16 fresh rows, always over the whole vocabulary (or the Zipf draw)."""
        model.eval()
        with torch.no_grad():
            x, y = rows.batch(16, None)
            pred = forward(x, rows=rows).logits[:, :-1].argmax(-1)
        model.train()
        target = y[:, 1:].to(pred.device)
        keep = target != -100
        return round(float((pred[keep] == target[keep]).float().mean()), 3)

    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / max(1, args.warmup))
        x, y = data.batch(args.rows, step, text_rows=round(args.rows * args.text_share))
        loss = forward(x, y).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps:
            report = {"step": step, "loss": round(float(loss.detach()), 3), "copy_accuracy": accuracy(data)}
            if args.eval_span:
                report["eval_copy_accuracy"] = accuracy(CopyRows(argparse.Namespace(
                    **{**vars(args), "span_min": args.eval_span[0], "span": args.eval_span[1], "fixed_steps": 0,
                       "seed": args.seed + step})))
            print(json.dumps({**report, "ln_v": round(math.log(args.vocab - RESERVED), 2),
                              "seconds": round(time.perf_counter() - t0)}), flush=True)


if __name__ == "__main__":
    main()
