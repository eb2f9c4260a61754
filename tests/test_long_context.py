"""The ``long_context`` stage (issue 11 items 1-2): the phase schedule and its source weights, long-document
assembly, long QA, the rows a phase trains on, and the stage end to end on a tiny pretrained checkpoint (each
phase's checkpoint with its RoPE base and length, the MiniMax export, MLflow metrics, kill and resume in the second
phase).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pretrain.long_data import (
    NEEDLE_TEMPLATE,
    TokenSamples,
    TokenSampleWriter,
    assemble_long_documents,
    make_long_qa,
    word_start_tokens,
)
from pretrain.long_mix import LONG, MEDIUM, QA, SHORT, SampleQueue, ShortStream, phase_weights, plan_rows

# --- 1. the schedule -------------------------------------------------------------------------------------------


def test_phase_weights_move_linearly_over_the_transition_then_hold() -> None:
    prev, goal = np.array([20, 50, 30]), np.array([30, 70, 0])  # unnormalised weights are shares after normalising
    kw = dict(transition_frac=0.2, qa_share=0.1, qa_last_frac=0.2)
    assert phase_weights(0.0, prev, goal, **kw) == pytest.approx([0.2, 0.5, 0.3, 0.0])
    assert phase_weights(0.05, prev, goal, **kw) == pytest.approx([0.225, 0.55, 0.225, 0.0])  # a quarter of the way
    assert phase_weights(0.1, prev, goal, **kw) == pytest.approx([0.25, 0.6, 0.15, 0.0])
    assert phase_weights(0.2, prev, goal, **kw) == pytest.approx([0.3, 0.7, 0.0, 0.0])
    assert phase_weights(0.7999, prev, goal, **kw) == pytest.approx([0.3, 0.7, 0.0, 0.0])
    # the last 20%: 10% long QA, the sources share the other 90% in their proportions
    assert phase_weights(0.8, prev, goal, **kw) == pytest.approx([0.27, 0.63, 0.0, 0.1])
    assert phase_weights(0.99, prev, goal, **kw) == pytest.approx([0.27, 0.63, 0.0, 0.1])
    assert phase_weights(0.5, prev, goal, transition_frac=0.0, qa_share=0.1, qa_last_frac=0.2) == \
        pytest.approx([0.3, 0.7, 0.0, 0.0])  # no transition: the phase's own weights from its first row


def test_default_params_are_two_table_6_shaped_phases_with_derived_bounds() -> None:
    from pretrain.long_context import LongContextParams

    p = LongContextParams()
    assert [(x.seq_len, x.rope_theta) for x in p.phases] == [(512, 20_000.0), (1024, 40_000.0)]
    assert p.phases[0].weights.tolist() == pytest.approx([0.3, 0.7, 0.0])  # Table 6's first phase: no long data
    assert p.phases[1].weights.tolist() == pytest.approx([0.35, 0.35, 0.3])
    assert (p.short_bound, p.medium_bound) == (128, 512)  # Table 6: 32K and 128K for a first phase of 128K
    assert p.document_lengths == [256, 512, 1024]
    assert (p.phase_rows(0), p.phase_rows(1)) == (64, 32)  # 32768 tokens in whole batches of 4096
    assert p.qa_share == 0.1 and p.qa_last_frac == 0.2  # §4.2
    # the previous phase's weights are where a phase starts; the first starts from the corpus's
    corpus = np.array([0.1, 0.3, 0.6])
    assert p.previous_weights(0, corpus) is corpus
    assert p.previous_weights(1, corpus).tolist() == pytest.approx([0.3, 0.7, 0.0])
    first_row = p.weights_of_row(1, corpus)(0)  # the middle of row 0 of 32: 1/64 of the way, 5/64 of the ramp
    assert first_row == pytest.approx(np.append([0.3, 0.7, 0.0] + (np.array([0.35, 0.35, 0.3]) - [0.3, 0.7, 0.0])
                                                * (0.5 / 32 / 0.2), 0.0))


@pytest.mark.parametrize("bad, match", [
    (dict(batch_tokens=3000), "must divide batch_tokens"),
    (dict(micro_batch_tokens=3072, batch_tokens=4096), "must divide"),
    (dict(phases=[]), "at least 1"),
    (dict(short_max_tokens=600), "below medium_max_tokens"),
    (dict(phases=[dict(seq_len=512, rope_theta=1e4, tokens=10, short=0, medium=0, long=0)]), "positive"),
    # 8 rows at 0.9: 7 retrieval rows and 1 plain row, less text than one sample of 1,024 tokens may take (the
    # tenth lease's CPU rehearsal found this 81 s into the stage; now the spec says so)
    (dict(phases=[dict(seq_len=1024, rope_theta=4e4, tokens=8192, short=35, medium=35, long=30)],
          retrieval_share=0.9), r"leaves 1 of its 8 rows plain"),
])
def test_bad_params_are_clear_errors(bad: dict, match: str) -> None:
    from pydantic import ValidationError

    from pretrain.long_context import LongContextParams

    with pytest.raises(ValidationError, match=match):
        LongContextParams(**bad)


def test_two_plain_rows_are_enough_for_the_retrieval_samples() -> None:
    from pretrain.long_context import LongContextParams

    p = LongContextParams(phases=[dict(seq_len=1024, rope_theta=4e4, tokens=16384, short=35, medium=35, long=30)],
                          retrieval_share=0.9)
    assert (p.phase_rows(0), p.retrieval_rows(0)) == (16, 14)
    # a share that rounds to no retrieval row needs no plain text for samples
    one = LongContextParams(phases=[dict(seq_len=4096, rope_theta=4e4, tokens=4096, short=35, medium=35, long=30)],
                            batch_tokens=4096, micro_batch_tokens=4096, retrieval_share=0.25)
    assert (one.phase_rows(0), one.retrieval_rows(0)) == (1, 0)


# --- 2. rows that follow the schedule ---------------------------------------------------------------------------


def _queue(lengths: list[int], tag: int, seq_len: int) -> SampleQueue:
    """Synthetic samples: sample k of a source is ``[tag * 1000 + k] * length``."""
    samples = [np.full(n, tag * 1000 + k, np.int32) for k, n in enumerate(lengths)]
    return SampleQueue(np.array([[0, k] for k in range(len(samples))]), lambda _, k: samples[k], seq_len, [0, tag])


def test_rows_follow_the_interpolated_weights_and_take_qa_only_in_the_last_fifth() -> None:
    L, rows = 512, 400
    rng = np.random.default_rng(0)
    queues = {MEDIUM: _queue(rng.integers(128, 512, 50).tolist(), MEDIUM, L),
              LONG: _queue(rng.integers(513, 2000, 50).tolist(), LONG, L),  # longer than a row: windows of L
              QA: _queue(rng.integers(200, 512, 50).tolist(), QA, L)}
    short = ShortStream(_queue(rng.integers(10, 128, 50).tolist(), SHORT, L), pad_id=2)
    prev, goal = np.array([0.6, 0.4, 0.0]), np.array([0.3, 0.4, 0.3])
    kw = dict(transition_frac=0.25, qa_share=0.1, qa_last_frac=0.2)

    def weights(j: int) -> np.ndarray:
        return phase_weights((j + 0.5) / rows, prev, goal, **kw)

    realised = np.zeros((rows, 4), np.int64)
    planned = list(plan_rows(rows, L, weights, queues, short, realised))
    assert len(planned) == rows
    assert all(sum(p.tokens.size for p in pieces) == L for pieces in planned)  # full rows, no padding
    assert short.pad_tokens == 0 and realised.sum() == rows * L
    # medium, long (windows) and QA samples are never cut by a row end: each piece is a whole sample or window
    for pieces in planned:
        for p in pieces:
            if p.source in (MEDIUM, QA):
                assert not p.continuation and p.tokens.size == len(queues[p.source].tokens_of("", p.ref[1]))
            if p.source == LONG:
                whole = queues[LONG].tokens_of("", p.ref[1]).size
                assert p.tokens.size == L or p.tokens.size == whole % L
    # cumulative tokens of every source stay within one sample (<= 512 tokens) of the cumulative target
    target = np.cumsum(np.stack([weights(j) for j in range(rows)]) * L, axis=0)
    assert np.abs(np.cumsum(realised, axis=0)[:, 1:] - target[:, 1:]).max() <= L
    # QA: none before the last fifth; 10% of its tokens in it (within one sample)
    last = int(rows * 0.8)
    assert realised[:last, QA].sum() == 0
    assert abs(realised[last:, QA].sum() / ((rows - last) * L) - 0.1) <= L / ((rows - last) * L)
    # the transition: the first tenth is still near the previous weights, the middle at the phase's own
    early = realised[:40].sum(0) / (40 * L)
    middle = realised[150:300].sum(0) / (150 * L)
    assert early[LONG] < 0.12 and early[SHORT] > 0.45
    assert middle[:3] == pytest.approx(goal, abs=0.02)


# --- 3. long documents ------------------------------------------------------------------------------------------


def test_assembly_concatenates_within_a_domain_to_exact_lengths_and_counts_every_document(tmp_path: Path) -> None:
    docs = [("a", "x", np.arange(10, 20)), ("b", "y", np.arange(100, 103)), ("c", "x", np.arange(30, 37)),
            ("d", "x", np.arange(50, 60)), ("e", "y", np.arange(200, 215))]
    with TokenSampleWriter(tmp_path, "long") as w:
        stats = assemble_long_documents(docs, [8, 12], w, bos=0, eos=1, separator=[5])
    out = TokenSamples(tmp_path, "long")
    got = [(m["group"], out.tokens(i).tolist(), m["members"]) for i, m in enumerate(out.meta)]
    assert got == [  # by hand: targets 8, 12, 8, ... in turn per domain; BOS, members joined by 5, EOS
        ("x", [0, 10, 11, 12, 13, 14, 15, 1], [["a", 0, 6]]),
        ("x", [0, 16, 17, 18, 19, 5, 30, 31, 32, 33, 34, 1], [["a", 6, 10], ["c", 0, 5]]),
        ("x", [0, 35, 36, 5, 50, 51, 52, 1], [["c", 5, 7], ["d", 0, 3]]),
        ("y", [0, 100, 101, 102, 5, 200, 201, 1], [["b", 0, 3], ["e", 0, 2]]),
        ("y", [0, *range(202, 212), 1], [["e", 2, 12]]),
    ]
    assert (stats.documents_in, stats.tokens_in) == (5, 45)
    assert (stats.tokens_used, stats.tokens_left) == (6 + 9 + 5 + 5 + 10, 7 + 3)  # d's 7 and e's 3 in open tails
    assert (stats.documents_fully_used, stats.documents_partly_used, stats.documents_unused) == (3, 2, 0)
    assert stats.per_length == {"8": 3, "12": 2} and stats.groups == 2 and stats.long_documents == 5


def test_assembly_of_many_documents_loses_no_token_and_mixes_no_domains(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    docs, text = [], {}
    for k in range(300):
        group = ["code", "prose", "legal"][int(rng.integers(3))]
        tokens = rng.integers(10, 500, int(rng.integers(1, 400))).astype(np.int32)
        docs.append((f"d{k}", group, tokens))
        text[f"d{k}"] = (group, tokens)
    targets = [256, 1000, 64]
    with TokenSampleWriter(tmp_path, "long") as w:
        stats = assemble_long_documents(iter(docs), targets, w, bos=0, eos=1, separator=[2, 3])
    out = TokenSamples(tmp_path, "long")
    seen = {d: [] for d in text}
    for i, meta in enumerate(out.meta):
        tokens = out.tokens(i)
        assert tokens.size in targets and tokens[0] == 0 and tokens[-1] == 1
        assert {text[d][0] for d, _, _ in meta["members"]} == {meta["group"]}  # one domain per long document
        rebuilt = [0]
        for k, (d, a, b) in enumerate(meta["members"]):
            rebuilt += ([2, 3] if k else []) + text[d][1][a:b].tolist()
            seen[d].append((a, b))
        # the content is exactly its members joined by the separator (a cut separator may close it)
        assert tokens[:len(rebuilt)].tolist() == rebuilt
        assert tokens[len(rebuilt):-1].tolist() == [2, 3][:tokens.size - 1 - len(rebuilt)]
    used = 0
    for spans in seen.values():  # each document's pieces are consecutive and start at its first token
        assert not spans or [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]]
        used += sum(b - a for a, b in spans)
    assert used == stats.tokens_used and stats.tokens_used + stats.tokens_left == sum(t.size for _, _, t in docs)
    assert stats.documents_fully_used + stats.documents_partly_used + stats.documents_unused == 300
    lengths = {str(t): sum(1 for m in out.meta if m["tokens"] == t) for t in targets}
    assert lengths == stats.per_length and stats.long_documents == len(out)


# --- 4. long QA -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from tokenizers import Tokenizer

    from tests.pretrain_fixtures import build_inputs

    inputs = build_inputs(tmp_path_factory.mktemp("qa_tok"), documents=60)
    return Tokenizer.from_file(str(inputs.tokenizer.path / "tokenizer.json"))


@pytest.mark.parametrize("depth_seed", [0, 1, 2, 3])
def test_long_qa_plants_the_fact_at_a_word_boundary_near_the_depth_and_only_the_answer_is_a_target(
        tokenizer, depth_seed: int) -> None:
    text = " ".join(f"word{k % 50} is here." for k in range(400))
    context = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
    word_start = word_start_tokens(tokenizer)
    qa = make_long_qa(context, 512, np.random.default_rng(depth_seed), tokenizer, word_start, bos=0, eos=1,
                      context_id="ctx")
    m, tokens = qa.meta, qa.tokens
    assert tokens.size <= 512 and tokens[0] == 0 and tokens[-1] == 1
    needle = tokenizer.decode(tokens[m["needle_start"]:m["needle_end"]].tolist())
    assert needle == NEEDLE_TEMPLATE.format(name=m["name"], number=m["number"])
    # the context around the fact is the document's, unbroken: the fact sits before a token that starts a word
    n_ctx = m["context_tokens"]
    assert tokens[1:m["needle_start"]].tolist() + tokens[m["needle_end"]:m["needle_end"] + n_ctx - (
        m["needle_start"] - 1)].tolist() == context[:n_ctx].tolist()
    after = int(tokens[m["needle_end"]])
    assert m["needle_start"] - 1 == n_ctx or word_start[after]
    assert abs(m["depth"] - m["drawn_depth"]) < 0.05  # words here are ~4 tokens: the boundary is near the depth
    # question at the end, the number its answer; the answer's tokens and the EOS are the only targets
    tail = tokenizer.decode(tokens[m["needle_end"] + n_ctx - (m["needle_start"] - 1):].tolist())
    assert tail.startswith(f"\n\nQuestion: What is the access code of {m['name']}?\nAnswer:")
    answer = tokens[m["answer_start"]:-1]
    assert tokenizer.decode(answer.tolist()) == f" {m['number']}"
    assert np.flatnonzero(~qa.no_loss).tolist() == list(range(m["answer_start"], tokens.size))


def test_long_qa_labels_through_the_packed_rows_are_the_answer_tokens(tokenizer, tmp_path: Path) -> None:
    """A QA sample written in a phase's rows (pretrain/long_mix.py) and read back by pretrain/packed_data.py's make_batch:
    labels count at the answer and its EOS and nowhere else in the sample; other samples keep every label."""
    from pretrain.long_mix import PhaseSources, QAQueue, write_phase_rows
    from pretrain.packed_data import PackedRows, make_batch

    L = 256
    ctx_tokens = np.asarray(tokenizer.encode(" ".join(["alpha beta gamma."] * 200), add_special_tokens=False).ids,
                            np.int32)
    contexts = SampleQueue(np.array([[1, 0]]), lambda *_: np.concatenate([[0], ctx_tokens[:180], [1]]), L, [0, 9])

    def make(context: np.ndarray, cid: str, rng: np.random.Generator):  # noqa: ANN202
        return make_long_qa(context, L, rng, tokenizer, word_start_tokens(tokenizer), bos=0, eos=1, context_id=cid)

    with TokenSampleWriter(tmp_path / "d", "long_qa") as writer:
        queues = {QA: QAQueue(contexts, make, writer, [0, 1], bos=0, eos=1)}
        short = ShortStream(_queue([50, 70, 90], SHORT, L), pad_id=2)
        sources = PhaseSources(queues, short, [np.arange(L, dtype=np.int32) % 100], np.array([1.0, 0, 0]),
                               np.array([1.0, 0, 0]))
        data = write_phase_rows(
            tmp_path / "d", sources, seq_len=L, rows=4, seed=0, vocab_size=tokenizer.get_vocab_size(),
            weights_of_row=lambda j: np.array([0.5, 0, 0, 0.5]), special_ids={"bos": 0, "eos": 1, "pad": 2},
            inherited=dict(mixture_documents=1, mixture_tokens=1, unused_documents=0, eval_from_unsampled=0,
                           held_out_from_training=0, held_out_training_tokens=0), describe={})
    qa = TokenSamples(tmp_path / "d", "long_qa")
    assert data["qa_samples"] == len(qa) >= 1
    rows = PackedRows(tmp_path / "d", "train")
    first = qa.meta[0]
    for j in range(len(rows)):
        tokens, starts, _ = rows.row(j)
        if tokens[:first["tokens"]].tolist() == qa.tokens(0).tolist():  # the QA sample opens its row
            labels = make_batch(rows, [j]).labels[0].numpy()
            counted = np.flatnonzero(labels[:first["tokens"]] != -100)
            assert counted.tolist() == list(range(first["answer_start"], first["tokens"]))
            assert labels[counted].tolist() == qa.tokens(0)[first["answer_start"]:].tolist()
            rest = labels[first["tokens"]:]  # short documents after it: every label but their first tokens
            assert (rest != -100).sum() == L - first["tokens"] - (len(starts) - 2)
            break
    else:
        pytest.fail("no row starts with the QA sample")
    assert rows.info.train.loss_tokens == sum(int((make_batch(rows, [j]).labels != -100).sum()) for j in range(4))


# --- 5. the stage on a tiny pretrained checkpoint ---------------------------------------------------------------

PHASES = [dict(seq_len=256, rope_theta=20_000.0, tokens=4096, short=30, medium=70, long=0),
          dict(seq_len=512, rope_theta=40_000.0, tokens=4096, short=35, medium=35, long=30)]
STAGE_PARAMS = dict(phases=PHASES, batch_tokens=1024, micro_batch_tokens=512, log_every=1, checkpoint_every=2,
                    eval_rows=4, qa_share=0.3, qa_last_frac=0.5,  # a QA sample even in 8 rows of 512
                    seed=5)  # not pretrain's 0: the held-out documents stay pretrain's (its seed chose them)
STEPS = 4  # per phase: 4096 tokens in batches of 1024


@dataclass
class Inputs:
    artifacts: dict
    pretrain_out: Path


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    """A tiny model pretrained for 8 steps at 128 tokens (the pretrain stage itself), and its inputs."""
    from pipeline.stage import Artifact, Resources, StageContext
    from pretrain.stage import PretrainParams, run
    from tests.pretrain_fixtures import build_inputs

    root = tmp_path_factory.mktemp("lc_pretrain")
    inputs = build_inputs(root / "inputs", domains=("prose", "code"))
    ctx = StageContext(root / "ckpt", inputs.as_inputs(), stage_name="pretrain", resources=Resources(cpus=1),
                       resume_dir=root / "resume")
    run(PretrainParams(seq_len=128, micro_batch_rows=4, batch_rows=8, max_batch_rows=8, train_tokens=8192,
                       log_every=4, checkpoint_every=8, eval_documents=16), ctx)
    (root / "ckpt" / "manifest.json").write_text(json.dumps({"type": "checkpoint", "digest": "test-checkpoint"}))
    return Inputs({**inputs.as_inputs(), "checkpoint": Artifact.load(root / "ckpt")}, root / "ckpt")


def _context(root: Path, inputs: Inputs, out: str = "out"):  # noqa: ANN202
    from pipeline.stage import Resources, StageContext

    return StageContext(root / out, inputs.artifacts, stage_name="long_context", resources=Resources(cpus=1),
                        resume_dir=root / "resume")


@dataclass
class Extended:
    ctx: object
    out: Path
    root: Path


@pytest.fixture(scope="module")
def extended(pretrained: Inputs, tmp_path_factory: pytest.TempPathFactory) -> Extended:
    from pretrain.long_context import LongContextParams, run

    root = tmp_path_factory.mktemp("lc")
    ctx = _context(root, pretrained)
    run(LongContextParams(**STAGE_PARAMS), ctx)
    return Extended(ctx, root / "out", root)


@pytest.mark.slow
def test_stage_keeps_each_phase_checkpoint_with_its_rope_base_and_length(extended: Extended,
                                                                         pretrained: Inputs) -> None:
    from safetensors.torch import load_file

    before = json.loads((pretrained.pretrain_out / "model" / "config.json").read_text())
    assert before["rope_theta"] == 10_000.0
    weights = [load_file(pretrained.pretrain_out / "model" / "model.safetensors")]
    for i, phase in enumerate(PHASES):
        d = extended.out / "phases" / str(i)
        for sub in ("model", "minimax"):
            config = json.loads((d / sub / "config.json").read_text())
            assert config["max_position_embeddings"] == phase["seq_len"], (i, sub)
        assert json.loads((d / "model" / "config.json").read_text())["rope_theta"] == phase["rope_theta"]
        summary = json.loads((d / "summary.json").read_text())
        assert summary["steps"] == STEPS and summary["tokens"] == 4096 and summary["skipped_steps"] == 0
        assert summary["eval_loss"] < math.log(512)  # below a uniform guess over the vocabulary (the model is tiny)
        packing = json.loads((d / "packing.json").read_text())
        assert packing["seq_len"] == phase["seq_len"] and packing["eval"]["rows"] == 4
        weights.append(load_file(d / "model" / "model.safetensors"))
    # each phase trained: its weights moved from the ones it started from
    key = "model.layers.7.attn.q_proj.weight"  # the softmax layer
    assert all(float((b[key] - a[key]).abs().max()) > 1e-4 for a, b in zip(weights, weights[1:], strict=False))
    # phase 1 started from phase 0's export; the artifact's model is the last phase's
    cfg1 = json.loads((extended.ctx.work_dir / "train_config_phase1.json").read_text())
    assert cfg1["init_from"] == str(extended.root / "resume" / "phase0" / "export" / "model")
    assert cfg1["ordered_rows"] and cfg1["seq_len"] == 512
    final = load_file(extended.out / "model" / "model.safetensors")
    assert all(np.array_equal(final[k].numpy(), weights[-1][k].numpy()) for k in final)
    summary = json.loads((extended.out / "summary.json").read_text())
    assert (summary["seq_len"], summary["rope_theta"], summary["steps"]) == (512, 40_000.0, 2 * STEPS)


@pytest.mark.slow
def test_stage_with_its_own_seed_keeps_pretrains_held_out_documents_for_eval(extended: Extended,
                                                                              pretrained: Inputs) -> None:
    """long_context's `seed` orders its own rows; the eval stage finds the documents pretrain held out (chosen by
    pretrain's seed) through the artifact's packing.json: the seventh lease's reseeded twin failed here."""
    from evaluation.heldout import heldout_documents

    packing = json.loads((extended.out / "packing.json").read_text())
    assert (packing["seed"], packing["heldout_seed"]) == (5, 0)
    held = heldout_documents(extended.out, pretrained.artifacts["mixture"].path,
                             pretrained.artifacts["documents"].path)
    recorded = [e["id"] for e in json.loads((pretrained.pretrain_out.parent / "resume" / "data" /
                                             "eval_documents.json").read_text())]
    assert [i for i, _ in held.docs] == recorded and len(recorded) == 16


@pytest.mark.slow
def test_stage_minimax_export_loads_in_transformers_with_the_new_rope_base(extended: Extended,
                                                                            tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import model  # noqa: F401  (registers hylight_hybrid)
    from model.hf_minimax import max_relative_error
    from pretrain.packed_data import PackedRows
    from tests.test_pretrain import MINIMAX_LOGITS  # transformers' MiniMax in an interpreter without hylight

    ours = AutoModelForCausalLM.from_pretrained(extended.out / "model").eval()
    assert ours.config.rope_theta == 40_000.0
    ids = PackedRows(extended.root / "resume" / "phase1" / "data", "eval").row(0)[0][:400].astype(np.int64)[None]
    np.save(tmp_path / "ids.npy", ids)
    with torch.no_grad():
        logits = ours(input_ids=torch.from_numpy(ids)).logits.double()
    done = subprocess.run([sys.executable, "-c", MINIMAX_LOGITS, str(extended.out / "minimax"),
                           str(tmp_path / "ids.npy"), str(tmp_path / "logits.npy")],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.from_numpy(np.load(tmp_path / "logits.npy"))
    assert max_relative_error(logits, theirs) < 1e-4  # positions up to 400 > the pretraining length: RoPE carried
    # the RoPE base matters at these positions: the same weights under the pretraining base give other logits
    ours.config.rope_theta = 10_000.0
    ours.model.rotary.base = 10_000.0
    with torch.no_grad():
        assert max_relative_error(ours(input_ids=torch.from_numpy(ids)).logits.double(), theirs) > 1e-3


@pytest.mark.slow
def test_stage_logs_continuing_curves_and_per_phase_eval_loss_to_mlflow(extended: Extended) -> None:
    sink = extended.ctx.sink
    for name in ("loss", "aux_loss", "lr", "grad_norm", "tokens_per_second", "mfu", "drop_rate", "memory_gb"):
        steps = [step for k, _, step in sink.metrics if k == name and step is not None]
        assert steps == list(range(1, 2 * STEPS + 1)), name  # phase 1's steps continue phase 0's
    tokens = [v for k, v, step in sink.metrics if k == "tokens" and step is not None]
    assert tokens == [1024.0 * s for s in range(1, 2 * STEPS + 1)]
    phases = [v for k, v, step in sink.metrics if k == "phase"]
    assert phases == [0.0] * STEPS + [1.0] * STEPS
    for name, values in (("eval_loss", None), ("seq_len", [256.0, 512.0]), ("rope_theta", [20_000.0, 40_000.0])):
        logged = [(step, v) for k, v, step in sink.metrics if k == name]
        assert [s for s, _ in logged] == [STEPS, 2 * STEPS], name
        if values:
            assert [v for _, v in logged] == values
    evals = [v for k, v, _ in sink.metrics if k == "eval_loss"]
    summaries = [json.loads((extended.out / "phases" / str(i) / "summary.json").read_text()) for i in range(2)]
    assert evals == [s["eval_loss"] for s in summaries]
    assert extended.ctx.summary["eval_loss"] == summaries[1]["eval_loss"]
    # the long data and each phase's realised source shares
    assert sink.last("long_documents") > 0 and sink.last("long_data.tokens_used") > 0
    shares = [sink.last(f"phase1.share.{s}") for s in ("short", "medium", "long", "qa")]
    assert sum(shares) == pytest.approx(1.0) and shares[3] > 0 and sink.last("phase1.qa_samples") >= 1
    assert sink.last("phase0.share.long") == 0.0 or sink.last("phase0.share.long") < 0.3  # only in the ramp
    for name in ("loss_curve.png", "source_schedule.png"):
        assert (extended.out / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    log = [json.loads(line) for line in (extended.out / "train_log.jsonl").read_text().splitlines()]
    assert [h["step"] for h in log] == list(range(1, 2 * STEPS + 1))
    assert [h["seq_len"] for h in log] == [256] * STEPS + [512] * STEPS
    curve = json.loads((extended.out / "loss_curve.json").read_text())["rows"]  # what compare reads
    assert curve == [{k: h[k] for k in ("step", "tokens", "loss", "lr") if k in h} for h in log]
    assert [r["step"] for r in curve] == list(range(1, 2 * STEPS + 1)) and all("loss" in r for r in curve)


@pytest.mark.slow
def test_stage_long_data_is_in_the_artifact_and_made_of_trained_documents_only(extended: Extended,
                                                                               pretrained: Inputs) -> None:
    from data.mix import iter_mixture

    stats = json.loads((extended.out / "long_data" / "long_data.json").read_text())
    docs = stats["long_documents"]
    assert docs["tokens_used"] + docs["tokens_left"] == docs["tokens_in"] and docs["long_documents"] > 0
    trained = {r["id"] for r in iter_mixture(pretrained.artifacts["mixture"].path) if r["sample_count"] > 0}
    held_out = {e["id"] for e in json.loads((pretrained.pretrain_out.parent / "resume" / "data" /
                                             "eval_documents.json").read_text())}
    long_docs = TokenSamples(extended.out / "long_data", "long_documents")
    members = {d for m in long_docs.meta for d, _, _ in m["members"]}
    assert members <= trained - held_out and not members & held_out  # the eval stage's haystacks stay unseen
    assert stats["held_out_documents"] == len(held_out) == 16
    assert sorted(set(long_docs.lengths.tolist())) == [128, 256, 512]  # half the first phase, then each phase


# --- 6. kill and resume in the second phase ---------------------------------------------------------------------


def _job_processes() -> list[int]:
    from pipeline.launch import descendants

    job = []
    for pid in descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"--hylight-supervise" in cmdline or b"pretrain.train" in cmdline:
            job.append(pid)
    return job


@pytest.mark.slow
def test_killed_stage_resumes_in_the_second_phase_and_ends_like_an_uninterrupted_run(
        pretrained: Inputs, extended: Extended, tmp_path: Path) -> None:
    from pipeline.launch import ProcessTreeError
    from pretrain.long_context import LongContextParams, run

    params = LongContextParams(**STAGE_PARAMS)
    ctx = _context(tmp_path, pretrained)
    errors: list[BaseException] = []

    def attempt() -> None:
        try:
            run(params, ctx)
        except BaseException as e:  # noqa: BLE001  (inspected below)
            errors.append(e)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    latest = tmp_path / "resume" / "phase1" / "deepspeed" / "latest"
    deadline = time.monotonic() + 300
    while not (latest.exists() and latest.read_text().strip() >= "step00000002"):
        assert thread.is_alive(), f"the first attempt ended before phase 1's step-2 checkpoint: {errors}"
        assert time.monotonic() < deadline, "no phase-1 checkpoint after 300 s"
        time.sleep(0.02)
    for pid in _job_processes():
        os.kill(pid, signal.SIGKILL)
    thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], ProcessTreeError), errors
    killed_at = int(latest.read_text().strip().removeprefix("step"))
    assert 2 <= killed_at < STEPS
    phase0_summary = (tmp_path / "resume" / "phase0" / "export" / "summary.json").stat().st_mtime_ns

    ctx2 = _context(tmp_path, pretrained, out="out2")
    run(params, ctx2)
    # phase 0 was not trained again: no config launched for it, its export untouched
    assert not (ctx2.work_dir / "train_config_phase0.json").exists()
    assert (ctx2.work_dir / "train_config_phase1.json").exists()
    assert (tmp_path / "resume" / "phase0" / "export" / "summary.json").stat().st_mtime_ns == phase0_summary
    # phase 1 continued from its checkpoint: the curve equals the uninterrupted run's, step for step
    log = [json.loads(line) for line in (tmp_path / "out2" / "train_log.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (extended.out / "train_log.jsonl").read_text().splitlines()]
    assert [h["step"] for h in log] == [h["step"] for h in ref]
    for a, b in zip(log, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["tokens"] == b["tokens"], a["step"]
    # MLflow of the rerun: phase 0's curve logged again, phase 1's new steps after its checkpoint
    steps = [step for k, _, step in ctx2.sink.metrics if k == "loss" and step is not None]
    assert steps == list(range(1, STEPS + 1)) + list(range(STEPS + killed_at + 1, 2 * STEPS + 1))
    from safetensors.torch import load_file

    ours, theirs = load_file(tmp_path / "out2" / "model" / "model.safetensors"), load_file(
        extended.out / "model" / "model.safetensors")
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in theirs) < 1e-5


# --- 7. softmax memory at a long phase's row --------------------------------------------------------------------

_PEAK = r"""
import json, sys
import torch
from model.modeling import RotaryEmbedding, SequenceLayout, SoftmaxAttention
from model.sizes import config_for

torch.set_num_threads(1)
N = int(sys.argv[1])
cfg = config_for("tiny", hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
torch.manual_seed(0)
layer, rotary = SoftmaxAttention(cfg, 0), RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)


def step(n):  # one row that is one document, as pretrain/packed_data.py's make_batch passes it: cu_seqlens [0, n]
    layout = SequenceLayout.build(1, n, 0, torch.device("cpu"), None, None, torch.tensor([0, n], dtype=torch.int32))
    assert layout.softmax_by_documents and layout.softmax_mask is None
    x = torch.randn(1, n, cfg.hidden_size, requires_grad=True)
    layer(x, layout, rotary(layout.position_ids, x.dtype)).square().mean().backward()


def peak(fn):
    def status(key):
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith(key))) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


step(512)
rows = {n: peak(lambda n=n: step(n)) for n in (N // 4, N)}
print(json.dumps({"rows": rows, "dense_mask": peak(lambda: torch.ones(N, N, dtype=torch.bool))}))
"""


@pytest.mark.slow
def test_softmax_layer_memory_is_linear_for_a_row_that_is_one_long_document() -> None:
    """A long phase's row is often a single document of the whole length: the softmax layer's forward + backward
    over it (the training path, through cu_seqlens) grows with N, not N^2 (measured: 7, 33 MiB at 4K, 16K tokens),
    and stays far below one dense [N, N] bool mask (256 MiB at 16K)."""
    n = 16384
    run = subprocess.run([sys.executable, "-c", _PEAK, str(n)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    peak = json.loads(run.stdout.strip().splitlines()[-1])
    assert peak["dense_mask"] > 0.9 * n * n, "the measurement does not see a dense [N, N] mask"
    small, large = peak["rows"][str(n // 4)], peak["rows"][str(n)]
    assert large < 8 * small, f"{small / 2**20:.1f} -> {large / 2**20:.1f} MiB for 4x the tokens: not linear"
    assert large < peak["dense_mask"] / 4, f"{large / 2**20:.1f} MiB for one {n}-token document"


@pytest.mark.parametrize("gpus", [1, 0])
def test_compile_is_accepted_with_or_without_gpus(tmp_path: Path, gpus: int) -> None:
    """``compile: true`` with GPUs was refused at the spec line while its CUDA-graphs failure had no known cause;
    issue 34 found it (gradient accumulation: pretrain/trainer.release_graph_grads), so the spec accepts it."""
    from pipeline.spec import SpecError, load_spec
    from pipeline.stage import Resources
    from pretrain.long_context import LongContextParams, long_context_resource_problems

    path = tmp_path / "spec.yaml"
    path.write_text(f"name: t\nartifact_root: {tmp_path / 'runs'}\nstages:\n  lc:\n    uses: long_context\n"
                    f"    params:\n      compile: true\n    resources:\n      gpus: {gpus}\n")
    with pytest.raises(SpecError) as e:  # the inputs are not bound: the spec is invalid in any case
        load_spec(path)
    assert [p for p in e.value.problems if "params.compile" in p] == [], e.value.problems
    assert long_context_resource_problems(LongContextParams(compile=True), Resources(cpus=1, gpus=gpus)) == []
