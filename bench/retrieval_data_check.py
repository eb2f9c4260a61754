"""Does a hybrid learn to copy from the retrieval-bearing samples? A check of the data, not of the stages (CPU or GPU).

Trains ``model/``'s hybrid (size ``--size``, plain PyTorch AdamW, no DeepSpeed; bf16 autocast on a GPU when there is
one) on rows made only of
``data/retrieval.py`` samples of one or more kinds (``--kinds``), with the samples' own loss masks, and every
``--probe-every`` steps measures:

* ``answer_accuracy``: top-1 accuracy on the answer tokens of held-out samples of the same kinds (the trained task);
* the in-training probe of the stages (``pretrain/probe.py``): copy accuracy on repeated *random token ids* and the
  NIAH forced choice at the row length (the transfer the eval stage asks for).

``--kinds random_repeat`` is the control the issue's toy used: a span of uniformly random ordinary token ids
repeated once, the loss on the repeat. It needs no corpus text.

    python bench/retrieval_data_check.py --tokenizer DIR --data PACKED_DIR --kinds repeat --steps 300

``--data`` is a packed dataset (``pretrain/packed_data.py``; its train rows give the context text, its eval rows the
probe's haystacks). Prints one line per probe and a final JSON line (also appended to ``--out``).

To try a pretraining mixture rather than the samples alone: ``--text-share F`` makes that share of the rows packed
natural-text train rows (their own loss mask; documents attend across their boundaries here, unlike the stage),
``--answers-only`` puts the retrieval samples' loss on their answers alone (not on their natural-text context), and
``--micro-rows`` accumulates gradients over micro-batches of that many rows (the stage's batch at less memory).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def random_repeat(vocab: list[int], bos: int, eos: int, length: int, rng: np.random.Generator) -> tuple:
    n = (length - 2) // 2
    r = np.asarray(vocab)[rng.integers(len(vocab), size=n)]
    tokens = np.concatenate([[bos], r, r, [eos] * (length - 1 - 2 * n)]).astype(np.int64)
    no_loss = np.ones(length, bool)
    no_loss[2 + n:1 + 2 * n] = False  # the repeat after its first token
    return tokens, no_loss, ~no_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--kinds", default="repeat")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--probe-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-share", type=float, default=0.0, help="share of rows that are natural-text rows")
    ap.add_argument("--answers-only", action="store_true", help="retrieval samples' loss on the answers alone")
    ap.add_argument("--micro-rows", type=int, default=0, help="rows per micro-batch (0: the whole batch)")
    ap.add_argument("--label", default="", help="a name for this run in the output")
    ap.add_argument("--out", default="", help="append the final JSON line to this file")
    args = ap.parse_args(argv)
    if not 0.0 <= args.text_share <= 1.0:
        ap.error("--text-share must be within [0, 1]")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from tokenizers import Tokenizer

    from data.retrieval import RetrievalMaker
    from model.modeling import HybridForCausalLM
    from model.sizes import config_for
    from pretrain.packed_data import PackedRows, loss_mask
    from pretrain.probe import RetrievalProbe
    from pretrain.retrieval_rows import TrainingText

    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(f"{args.tokenizer}/tokenizer.json")
    train, held = PackedRows(args.data, "train"), PackedRows(args.data, "eval")
    special = train.info.special_ids
    bos, eos = special["bos"], special["eos"]
    maker = RetrievalMaker(tok, bos=bos, eos=eos)
    rng = np.random.default_rng(args.seed)
    contexts = TrainingText(train, special.values(), rng)
    added = set(tok.get_added_tokens_decoder())
    vocab = [i for i in range(tok.get_vocab_size(with_added_tokens=True)) if i not in added]
    kinds = args.kinds.split(",")
    L = args.seq_len

    def sample(r: np.random.Generator, text_share: float = 0.0) -> tuple:
        if text_share and r.random() < text_share:
            tokens, starts, pad = train.row(int(r.integers(len(train))))
            tokens = np.asarray(tokens[:L], np.int64)
            keep = loss_mask(starts, pad)[:L]
            return tokens, ~keep, np.zeros(L, bool)
        kind = kinds[int(r.integers(len(kinds)))]
        if kind == "random_repeat":
            return random_repeat(vocab, bos, eos, L, r)
        s = maker.make(kind, contexts.take(L), L, r)
        no_loss = ~s.answer if args.answers_only else s.no_loss
        return s.tokens.astype(np.int64), no_loss, s.answer

    def batch(r: np.random.Generator, n: int, text_share: float = 0.0) -> tuple:
        rows = [sample(r, text_share) for _ in range(n)]
        ids = torch.tensor(np.stack([x[0] for x in rows]))
        labels = ids.clone()
        labels[torch.tensor(np.stack([x[1] for x in rows]))] = -100
        return ids, labels, torch.tensor(np.stack([x[2] for x in rows]))

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    eval_ids, _, eval_answer = batch(np.random.default_rng(10_000 + args.seed), 32)
    eval_ids, eval_answer = eval_ids.to(device), eval_answer.to(device)
    model = HybridForCausalLM(config_for(args.size, vocab_size=train.info.vocab_size)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    probe = RetrievalProbe(args.tokenizer, held, seq_len=L, trials=8, seed=args.seed)
    probe_vocab = RetrievalProbe(args.tokenizer, held, seq_len=L, trials=8, seed=args.seed, copy_pool="vocab")
    warm = max(1, args.steps // 20)
    out = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / warm)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels, _ = batch(rng, args.rows, args.text_share)
        opt.zero_grad()
        micro = args.micro_rows or args.rows
        counted = int((labels[:, 1:] != -100).sum())
        loss = 0.0
        for s in range(0, args.rows, micro):  # each micro-batch's mean loss weighted by its share of the labels
            part = labels[s:s + micro]
            w = int((part[:, 1:] != -100).sum()) / max(counted, 1)
            if w == 0:
                continue
            with autocast:
                mb = model(input_ids=ids[s:s + micro].to(device), labels=part.to(device)).loss
            (mb * w).backward()
            loss += float(mb.detach()) * w
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.probe_every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad(), autocast:
                logits = model(input_ids=eval_ids).logits
            pred = logits[:, :-1].argmax(-1)
            target = eval_answer[:, 1:]
            acc = float((pred == eval_ids[:, 1:])[target].float().mean())
            with autocast:
                p = probe.run(model, device)
                pv = probe_vocab.run(model, device)
            p["copy_accuracy_vocab"] = pv["copy_accuracy"]
            model.train()
            row = {"label": args.label, "step": step, "loss": float(loss), "answer_accuracy": acc, **p,
                   "seconds": round(time.perf_counter() - t0, 1)}
            out.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    final = json.dumps({"label": args.label, "kinds": kinds, "size": args.size, "seq_len": L, "rows": args.rows,
                        "lr": args.lr, "text_share": args.text_share, "answers_only": args.answers_only,
                        "steps": args.steps, "history": out, "final": out[-1]})
    print(final)
    if args.out:
        with open(args.out, "a") as f:
            f.write(final + "\n")


if __name__ == "__main__":
    main()
