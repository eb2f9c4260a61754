"""Why does the all-softmax tiny model stay on the unigram plateau at 256-token rows? Diagnostics.

A small, self-contained training loop (no DeepSpeed; the model's own MoE with token drop, torch AdamW with the
pretrain stage's betas/weight decay/clip 1.0, linear warm-up then constant LR) on the packed rows the pretrain stage
already built for the CPU ablation, plus probes of the model's internals at chosen steps.

Data: a pretrain stage's packed dataset directory (``train_tokens.npy`` etc.), e.g. the CPU ablation's
``/tmp/abl_cpu_smlong/resume/data`` (256-token rows) and ``/tmp/abl_cpu_sm64/resume/data`` (64-token rows).
The tokenizer is only needed for vocab_size, which is read from ``packing.json``.

Run from a hylight checkout with ``OMP_NUM_THREADS=1 PYTHONPATH=.``:

    # train PATTERN on DATA for TOKENS tokens; probe at the listed steps; print eval loss vs unigram, loss by
    # position within the document, grad norm before clipping, and per-layer internals
    python bench/diagnose_softmax_plateau.py train --pattern all-softmax --data /tmp/abl_cpu_smlong/resume/data
    python bench/diagnose_softmax_plateau.py train --pattern hybrid --data /tmp/abl_cpu_smlong/resume/data
    python bench/diagnose_softmax_plateau.py train --pattern all-softmax --data /tmp/abl_cpu_sm64/resume/data \
        --rows 32                      # same tokens per step with 64-token rows
    python bench/diagnose_softmax_plateau.py train --pattern all-softmax --residual prenorm ...  # x + f(norm(x))
    python bench/diagnose_softmax_plateau.py train --pattern all-softmax --max-doc 64 ...  # cut docs to <= 64
    python bench/diagnose_softmax_plateau.py train --pattern all-softmax --lm-bias ...  # output bias = log unigram

    # a packed row against its documents run alone (logits must match)
    python bench/diagnose_softmax_plateau.py packing --data /tmp/abl_cpu_smlong/resume/data
    # document lengths of packed data sets
    python bench/diagnose_softmax_plateau.py doclens /tmp/abl_cpu_smlong/resume/data [...]

Probes (``--probe-steps``, at each listed step, on a fixed eval batch, dropless eval mode):
  resid   rms of the residual term alpha*norm(x) and of the attention output beta*a in each layer
  common  the share of the attention output's energy in its mean over tokens (1 = the same vector for every token)
  cos     mean cosine between the hidden states (after each layer) of two different tokens
  ent     softmax layers: mean attention entropy / log(#keys) (1 = uniform over the document's prefix)
  load    the router's largest expert share of the top-k slots per layer (1/E .. 1)

Findings (tiny, 48 steps x 2,048 tokens, lr 3e-3, unigram eval loss 7.282; logs /tmp/diag_*.log):
  all-softmax           eval 7.233; by step 16 every softmax output is one shared vector (common 1.00) 2-5x the
                        residual term, hidden states of all tokens identical from layer 2 on (cos 1.00), router
                        load 0.50 (every token to the same 2 of 4 experts); grad norm 0.4-0.5, clipped 1/48 steps
  hybrid                eval 6.895; lightning outputs stay 0.2-0.4, cos(out) 0.08-0.49, load 0.39-0.50
  --lm-bias (output bias initialised to the log unigram): all-softmax 6.306, no collapse (cos <= 0.06);
                        hybrid 6.282
  not the cause: packing (packed = alone to 4e-16), grad clipping, pre-norm residual (7.225), docs cut to 16 tokens
  (7.232), 64-token rows in this loop (7.225), lr 1e-3 (7.486, collapsing too), alpha 6 (7.232), seed 1 (7.245)

The copy window (``--copy-steps 48``, then 48 text steps; the tiny DAG's 256-token rows, unigram 6.982;
BENCHMARKS.md, the tenth lease): after a uniformly drawn window, ``--unigram-init 1`` (7.043) and ``--lm-bias``
(7.024) collapse all-softmax, which they prevent without a window (6.398, 6.22); with ``--copy-draw unigram``
the init does not (6.803). Without either, all-softmax 6.724 after the window.

    python bench/diagnose_softmax_plateau.py train --pattern all-softmax --data D --tokens 98304 --copy-steps 48 \
        --unigram-init 1.0 [--copy-draw unigram] [--head-init embedding]

``--copy-keep S`` keeps share S of the rows after the window copy rows (the stage's ``copy_keep_share``), and every
log line reports ``copy_acc``, top-1 accuracy on the repeats of 16 fixed held-out copy rows. Meant to ask whether
kept rows hold copying once text arrives; at this size it cannot yet: the tiny hybrid (D: 256-token rows, 4,096
ids; ``--copy-draw unigram --head-init embedding``, LR 3e-3) had not learnt to copy after 525 window steps
(copy_acc 0.018, the copy rows' loss 7.06, about the unigram's), and in a 400-step window its loss began to fall
only at steps 375-400 (copy_acc 0.023). One seed each; 2026-11-28.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from data.retrieval import copy_sample
from model import HybridForCausalLM, config_for, modeling
from model.configuration import SOFTMAX
from pretrain.packed_data import IGNORE_INDEX, Batch, PackedRows, make_batch, unigram_loss
from pretrain.train import UNIGRAM_INIT_TOKENS, init_head_from_embedding, init_unigram_direction

# --- residual-layout monkeypatches (controls, not model changes) -----------------------------------------------

def prenorm_forward(self, x, layout, rope, past_key_values=None):
    """Pre-norm control: x = x + attn(norm(x)); x = x + moe(norm(x)) (no alpha)."""
    h = self.attn_norm(x)
    a = self.attn(h, layout, rope, past_key_values) if self.kind == SOFTMAX else self.attn(h, layout, past_key_values)
    x = x + a * self.attn_beta
    moe = self.moe(self.ffn_norm(x), layout.token_mask)
    return x + moe.hidden * self.mlp_beta, moe


# --- probes -----------------------------------------------------------------------------------------------------

class Probe:
    """Hooks that record per-layer internals during one forward call."""

    def __init__(self, model):
        self.model, self.rec, self.handles = model, {}, []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.attn.register_forward_hook(self._attn_hook(i)))
            self.handles.append(layer.attn_norm.register_forward_hook(self._norm_hook(i)))
            self.handles.append(layer.moe.router.register_forward_hook(self._router_hook(i)))
            if layer.kind == SOFTMAX:
                self.handles.append(layer.attn.register_forward_hook(self._entropy_hook(i), with_kwargs=True))

    def _norm_hook(self, i):
        def hook(mod, args, out):
            self.rec.setdefault(i, {})["h_rms"] = out.pow(2).mean().sqrt().item()
        return hook

    def _attn_hook(self, i):
        def hook(mod, args, out):
            layer = self.model.model.layers[i]
            a = out[0] * layer.attn_beta
            r = self.rec.setdefault(i, {})
            r["attn_rms"] = a.pow(2).mean().sqrt().item()
            r["common"] = (a.mean(0, keepdim=True).pow(2).sum() * a.shape[0] / a.pow(2).sum()).item()
        return hook

    def _entropy_hook(self, i):
        def hook(mod, args, kwargs, out):
            x, layout, rope = args[0], args[1], args[2]
            B, T, _ = x.shape
            D = mod.head_dim
            q = mod.q_proj(x).view(B, T, mod.num_heads, D).transpose(1, 2)
            k = mod.k_proj(x).view(B, T, mod.num_kv_heads, D).transpose(1, 2)
            q, k = modeling.apply_partial_rotary(q, *rope), modeling.apply_partial_rotary(k, *rope)
            k = k.repeat_interleave(mod.num_heads // mod.num_kv_heads, dim=1)
            bounds = layout.cu_seqlens.tolist()
            ents = []
            for a, e in zip(bounds[:-1], bounds[1:], strict=True):
                if e - a < 8:
                    continue
                s = (q[0, :, a:e] @ k[0, :, a:e].transpose(-1, -2)) * D**-0.5
                s = s.masked_fill(torch.ones(e - a, e - a, dtype=torch.bool).triu(1), float("-inf"))
                p = s.softmax(-1)
                ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [H, n]
                n = torch.arange(1, e - a + 1, dtype=torch.float32)
                ents.append((ent[:, 1:] / n[1:].log()).mean().item())
            self.rec.setdefault(i, {})["ent"] = float(np.mean(ents)) if ents else float("nan")
        return hook

    def _router_hook(self, i):
        def hook(mod, args, out):
            top_i = out[3]
            counts = torch.bincount(top_i.reshape(-1), minlength=mod.weight.shape[0]).float()
            self.rec.setdefault(i, {})["load"] = (counts.max() / counts.sum()).item()
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def evaluate(model, batches, max_pos_bins=(0, 4, 16, 64, 128, 256, 1 << 30)):
    """Mean eval NLL, and NLL by position within the document (bins of position ids)."""
    model.eval()
    tot, n = 0.0, 0
    bins = np.asarray(max_pos_bins)
    by_bin = np.zeros((len(bins) - 1, 2))
    for b in batches:
        out = model(input_ids=b.input_ids, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids,
                    output_router_logits=False)
        logits = out.logits[0, :-1]
        labels = b.labels[0, 1:]
        keep = labels != IGNORE_INDEX
        nll = F.cross_entropy(logits[keep], labels[keep], reduction="none")
        pos = b.position_ids[0, 1:][keep].numpy()
        idx = np.digitize(pos, bins) - 1
        for j in range(len(bins) - 1):
            m = idx == j
            by_bin[j] += (nll.numpy()[m].sum(), m.sum())
        tot += nll.sum().item()
        n += keep.sum().item()
    model.train()
    return tot / n, {f"{bins[j]}-{bins[j + 1] - 1 if bins[j + 1] < 1 << 29 else ''}": round(s / max(c, 1), 3)
                     for j, (s, c) in enumerate(by_bin) if c}


@torch.no_grad()
def probe(model, batch):
    p = Probe(model)
    model.eval()
    out = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids,
                output_router_logits=False, output_hidden_states=True)
    model.train()
    p.close()
    hs = out.hidden_states  # inputs of each layer, then the final norm's output
    g = torch.Generator().manual_seed(0)
    T = batch.input_ids.shape[1]
    i1, i2 = torch.randint(0, T, (2000,), generator=g), torch.randint(0, T, (2000,), generator=g)
    keep = i1 != i2
    cos = [F.cosine_similarity(h[0, i1[keep]], h[0, i2[keep]], dim=-1).mean().item() for h in hs[1:]]
    rows = []
    for i in sorted(p.rec):
        r = p.rec[i]
        alpha = model.model.layers[i].attn_alpha
        rows.append(f"  L{i} {model.model.layers[i].kind[:4]}: |alpha*h| {alpha * r['h_rms']:.2f} |attn| "
                    f"{r['attn_rms']:.2f} common {r['common']:.2f} ent {r.get('ent', float('nan')):.2f} "
                    f"cos(out) {cos[i]:.2f} load {r['load']:.2f}")
    return "\n".join(rows)


def copy_batch(n_rows, L, vocab, rng, mark, weights=None):
    """``n_rows`` rows of one copy sample each (data/retrieval.py's ``copy_sample``: a span of ids drawn from the
    ordinary vocabulary, uniformly or by ``weights``, the marker, the span again; the loss on the repeat alone): the
    copy curriculum's rows, one sample a row (the stage packs spans of 32-256 ids several to a row)."""
    samples = [copy_sample(np.arange(3, vocab), L, rng, bos=0, eos=1, mark=mark, weights=weights)
               for _ in range(n_rows)]
    ids = np.concatenate([x.tokens for x in samples]).astype(np.int64)
    labels = np.concatenate([np.where(x.answer, x.tokens, IGNORE_INDEX) for x in samples]).astype(np.int64)
    return Batch(input_ids=torch.from_numpy(ids)[None], labels=torch.from_numpy(labels)[None],
                 cu_seqlens=torch.arange(0, (n_rows + 1) * L, L, dtype=torch.int32),
                 position_ids=torch.arange(L).repeat(n_rows)[None], tokens=int((labels != IGNORE_INDEX).sum()),
                 rows=tuple(range(n_rows)))


def join(a, b):
    """Two packed batches as one (``b``'s documents after ``a``'s)."""
    n = a.input_ids.shape[1]
    return Batch(input_ids=torch.cat([a.input_ids, b.input_ids], 1), labels=torch.cat([a.labels, b.labels], 1),
                 cu_seqlens=torch.cat([a.cu_seqlens, b.cu_seqlens[1:] + n]),
                 position_ids=torch.cat([a.position_ids, b.position_ids], 1), tokens=a.tokens + b.tokens,
                 rows=tuple(range(len(a.rows) + len(b.rows))))


@torch.no_grad()
def copy_accuracy(model, batch):
    """Top-1 accuracy on a copy batch's repeats (its label positions)."""
    model.eval()
    logits = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids).logits[0]
    model.train()
    labels = batch.labels[0, 1:]
    keep = labels != IGNORE_INDEX
    return (logits[:-1][keep].argmax(-1) == labels[keep]).float().mean().item()


# --- commands ---------------------------------------------------------------------------------------------------

def truncate_docs(batch, max_doc):
    """Split every segment longer than max_doc into pieces of max_doc (new documents: positions restart,
    the first label of each piece is masked, as at any segment start)."""
    cu = batch.cu_seqlens.tolist()
    new = []
    for a, e in zip(cu[:-1], cu[1:], strict=True):
        new.extend(range(a, e, max_doc))
    new.append(cu[-1])
    cu_t = torch.tensor(new, dtype=torch.int32)
    n = batch.input_ids.shape[1]
    doc = torch.bucketize(torch.arange(n), cu_t[1:].long(), right=True)
    pos = torch.arange(n) - cu_t.long()[doc]
    labels = batch.labels.clone()
    labels[0, cu_t[:-1].long()] = IGNORE_INDEX
    batch.cu_seqlens, batch.position_ids, batch.labels = cu_t, pos[None], labels
    return batch


def cmd_train(args):
    torch.manual_seed(args.seed)
    rows, eval_rows = PackedRows(args.data, "train"), PackedRows(args.data, "eval")
    L = rows.seq_len
    vocab = json.loads((Path(args.data) / "packing.json").read_text()).get("vocab_size") or rows.info.vocab_size
    overrides = dict(vocab_size=vocab, attention_pattern=args.pattern, use_cache=False,
                     moe_token_drop=not args.dropless, **json.loads(args.overrides))
    if args.residual == "prenorm":
        modeling.HybridDecoderLayer.forward = prenorm_forward
    cfg = config_for("tiny", **overrides)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, L)
    model = HybridForCausalLM(cfg)
    if args.lm_bias:  # control: a free output bias, so the unigram needs no token-independent hidden direction
        head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            counts = np.load(Path(args.data) / "unigram_counts.npy").astype(np.float64)
            log_p = np.log(counts + 1.0) - np.log(counts.sum() + counts.size)
            head.bias.copy_(torch.from_numpy(log_p - log_p.mean()))  # starts at the unigram distribution
        model.lm_head = head
    if args.head_init == "embedding":  # the pretrain stage's head_init: embedding (the GPU recipe sets it)
        with torch.no_grad():
            init_head_from_embedding(model)
    if args.unigram_init:  # the pretrain stage's unigram_init, with its own function and its 256 held-out tokens
        ids = torch.as_tensor(np.asarray(eval_rows.row(0)[0][:UNIGRAM_INIT_TOKENS], np.int64))[None]
        c = init_unigram_direction(model, np.load(Path(args.data) / "unigram_counts.npy"), ids, args.unigram_init)
        print(f"unigram init: share {args.unigram_init:g}; final hidden states along the direction {c:.3f}", flush=True)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    tokens_per_step = args.rows * L
    steps = args.tokens // tokens_per_step + args.copy_steps
    warm = max(1, int(args.warmup * steps))
    copy_rng = np.random.default_rng(args.seed + 1)
    mark = np.random.default_rng(12345).integers(3, vocab, size=2)
    copy_weights = None
    if args.copy_draw == "unigram":  # as the pretrain stage's copy_draw: unigram (add-one, so every id can come)
        counts = np.load(Path(args.data) / "unigram_counts.npy").astype(np.float64)[3:vocab] + 1.0
        copy_weights = counts / counts.sum()
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(rows))
    n_eval = max(1, (args.eval_tokens // L) // args.rows)
    fix = lambda b: truncate_docs(b, args.max_doc) if args.max_doc else b  # noqa: E731
    eval_batches = [fix(make_batch(eval_rows, list(range(j * args.rows, min((j + 1) * args.rows, len(eval_rows))))))
                    for j in range(n_eval) if j * args.rows < len(eval_rows)]
    probe_batch = eval_batches[0]
    uni = unigram_loss(eval_rows, np.load(Path(args.data) / "unigram_counts.npy"))
    probe_steps = {int(s) for s in args.probe_steps.split(",") if s}
    print(f"# {args.pattern} residual={args.residual} rows {args.rows}x{L} steps {steps} lr {args.lr} "
          f"lm_bias {args.lm_bias} copy_steps {args.copy_steps} "
          f"max_doc {args.max_doc} overrides {args.overrides}; unigram eval loss {uni:.3f}", flush=True)
    copy_eval = copy_batch(16, L, vocab, np.random.default_rng(999), mark, copy_weights)  # fixed held-out spans
    text_at = 0  # the next text row of `order`
    t0, losses, norms = time.time(), [], []
    for step in range(steps + 1):
        if step in probe_steps:
            print(f"step {step} probe:\n{probe(model, probe_batch)}", flush=True)
        if step == steps:
            break
        lr = args.lr * min(1.0, (step + 1) / warm)
        for g in opt.param_groups:
            g["lr"] = lr
        if step < args.copy_steps:  # the copy window first, as the GPU recipe's curriculum
            b = copy_batch(args.rows, L, vocab, copy_rng, mark, copy_weights)
        else:  # text rows; with --copy-keep, that share of the rows after the window still copy rows, evenly
            j = step - args.copy_steps
            k = int((j + 1) * args.rows * args.copy_keep) - int(j * args.rows * args.copy_keep)
            b = fix(make_batch(rows, order[text_at:text_at + args.rows - k].tolist()))
            text_at += args.rows - k
            if k:
                b = join(b, copy_batch(k, L, vocab, copy_rng, mark, copy_weights))
        out = model(input_ids=b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids,
                    output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item()
        opt.step()
        losses.append(out.loss.item())
        norms.append(gn)
        if (step + 1) % args.log_every == 0:
            window = "copy" if step < args.copy_steps else "text"
            print(f"step {step + 1} {window} loss {np.mean(losses[-args.log_every:]):.3f} grad_norm(pre-clip) "
                  f"mean {np.mean(norms[-args.log_every:]):.3f} max {np.max(norms[-args.log_every:]):.3f} "
                  f"lr {lr:.2e} copy_acc {copy_accuracy(model, copy_eval):.3f} ({time.time() - t0:.0f}s)", flush=True)
    ev, by_pos = evaluate(model, eval_batches)
    print(f"RESULT {args.pattern} residual={args.residual} rows={args.rows}x{L} max_doc={args.max_doc} "
          f"lm_bias={args.lm_bias} unigram_init={args.unigram_init} copy_steps={args.copy_steps} "
          f"copy_draw={args.copy_draw} copy_keep={args.copy_keep:g} head_init={args.head_init} "
          f"overrides={args.overrides} seed={args.seed}: eval {ev:.3f} unigram {uni:.3f} (diff {ev - uni:+.3f}); "
          f"copy accuracy {copy_accuracy(model, copy_eval):.3f}; eval by doc position {by_pos}; "
          f"clipped steps {sum(n > args.clip for n in norms)}/{len(norms)}", flush=True)


def cmd_packing(args):
    """Logits of a packed row vs each of its documents run alone (all-softmax and hybrid, fp64)."""
    rows = PackedRows(args.data, "eval")
    vocab = rows.info.vocab_size
    for pattern in ("all-softmax", "hybrid"):
        torch.manual_seed(0)
        cfg = config_for("tiny", vocab_size=vocab, attention_pattern=pattern, use_cache=False)
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, rows.seq_len)
        model = HybridForCausalLM(cfg).double().eval()
        multi = sorted(range(len(rows)), key=lambda i: -len(rows.row(i)[1]))[:2]  # rows with most segments
        b = make_batch(rows, multi)
        with torch.no_grad():
            packed = model(input_ids=b.input_ids, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids).logits[0]
            cu = b.cu_seqlens.tolist()
            worst = 0.0
            for a, e in zip(cu[:-1], cu[1:], strict=True):
                alone = model(input_ids=b.input_ids[:, a:e]).logits[0]
                worst = max(worst, (alone - packed[a:e]).abs().max().item())
            # the same row with a plain (unpacked) causal mask over the whole row, for contrast
            whole = model(input_ids=b.input_ids[:, : rows.seq_len]).logits[0]
            cross = (whole - packed[: rows.seq_len]).abs().max().item()
        print(f"{pattern}: {len(cu) - 1} segments, max |packed - alone| = {worst:.2e} "
              f"(vs ignoring boundaries: {cross:.2e}); positions of segment starts "
              f"{b.position_ids[0, cu[:-1]].tolist()[:6]}")


def cmd_doclens(args):
    for d in args.dirs:
        for split in ("train", "eval"):
            r = PackedRows(d, split)
            lens = []
            for i in range(min(len(r), 2000)):
                _, starts, _ = r.row(i)
                lens.extend(np.diff(starts.astype(np.int64)).tolist())
            lens = np.asarray(lens)
            q = np.percentile(lens, [10, 50, 90])
            print(f"{d} {split}: rows of {r.seq_len}; segments per row {len(lens) / min(len(r), 2000):.2f}; "
                  f"segment length p10/p50/p90 {q.tolist()} mean {lens.mean():.1f}; "
                  f"token-weighted mean segment length {np.sum(lens**2) / lens.sum():.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--pattern", default="all-softmax")
    t.add_argument("--data", default="/tmp/abl_cpu_smlong/resume/data")
    t.add_argument("--rows", type=int, default=8, help="rows per step (8 x 256 = the ablation's 2048 tokens)")
    t.add_argument("--tokens", type=int, default=100_000)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=float, default=0.05)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--residual", choices=("released", "prenorm"), default="released")
    t.add_argument("--max-doc", type=int, default=0, help="split documents into pieces of at most this many tokens")
    t.add_argument("--dropless", action="store_true")
    t.add_argument("--unigram-init", type=float, default=0.0,
                   help="init only: a shared embedding direction of this share of a row's norm, read by the head as the "
                        "log unigram (no new parameter)")
    t.add_argument("--lm-bias", action="store_true", help="control: add a learnable bias to lm_head, initialized to the log unigram")
    t.add_argument("--copy-steps", type=int, default=0,
                   help="train this many steps on copy rows first (the GPU recipe's copy window), then --tokens of text")
    t.add_argument("--head-init", choices=("xavier", "embedding"), default="xavier",
                   help="the output head's start (the pretrain stage's head_init; embedding: a copy of the embedding)")
    t.add_argument("--copy-draw", choices=("uniform", "unigram"), default="uniform",
                   help="how the copy window's spans draw their ids (the pretrain stage's copy_draw)")
    t.add_argument("--copy-keep", type=float, default=0.0,
                   help="after the copy window, this share of each step's rows still copy rows (copy_keep_share)")
    t.add_argument("--overrides", default="{}", help="JSON model config overrides")
    t.add_argument("--probe-steps", default="0,48")
    t.add_argument("--eval-tokens", type=int, default=16384)
    t.add_argument("--log-every", type=int, default=8)
    t.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("packing")
    p.add_argument("--data", default="/tmp/abl_cpu_smlong/resume/data")
    d = sub.add_parser("doclens")
    d.add_argument("dirs", nargs="+")
    args = ap.parse_args(argv)
    {"train": cmd_train, "packing": cmd_packing, "doclens": cmd_doclens}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
