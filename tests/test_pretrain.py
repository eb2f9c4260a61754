"""The ``pretrain`` stage (issue 9): DeepSpeed-MoE layer parity with ``model/moe.py``, expert parallelism and the
§2.1 global router over two gloo processes, the stage end to end (metrics, WSD lr, batch doubling, exports that
load in transformers), kill-and-resume equality, the divergence guard, and a two-process training run.

The slow tests share one trained run (``trained``, module scope) and otherwise use token budgets of a few
thousand tokens; everything runs on CPU in fp32 (training) or float64 (layer parity).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from model import HybridForCausalLM, config_for
from model.moe import MoEFeedForward, MoEOutput, expert_capacity
from pipeline.stage import StageContext
from pretrain.moe import DeepSpeedMoEFeedForward, export_model_state, install_deepspeed_moe
from tests.pretrain_fixtures import PretrainInputs

# --- 1. the layer: DeepSpeedMoEFeedForward == model.moe.MoEFeedForward (float64, one process) -----------------


def _float64_model(**overrides: object) -> HybridForCausalLM:
    torch.manual_seed(0)  # DeepNorm init; the router's logits then have std ~1.2 on unit inputs: varied routing
    return HybridForCausalLM(config_for("tiny", num_hidden_layers=2, **overrides)).double()


def _moe_pair(**overrides: object) -> tuple[MoEFeedForward, DeepSpeedMoEFeedForward, HybridForCausalLM]:
    """(reference layer, the DeepSpeed layer installed from it, the model holding the DeepSpeed layers)."""
    ref_model = _float64_model(**overrides)
    ds_model = copy.deepcopy(ref_model)
    layers = install_deepspeed_moe(ds_model)
    assert len(layers) == 2 and all(isinstance(m, DeepSpeedMoEFeedForward) for m in layers)
    return ref_model.model.layers[1].moe, ds_model.model.layers[1].moe, ds_model


def _expert_grads(layer: DeepSpeedMoEFeedForward) -> tuple[torch.Tensor, torch.Tensor]:
    """The local experts' gradients in the reference layout: gate_up [E_l, 2F, d] (gate rows, then up), down."""
    experts = layer.experts  # gate_up_proj [E_l, 2F, d], down_proj [E_l, d, F]
    return experts.gate_up_proj.grad, experts.down_proj.grad


def _forward_backward(layer: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None,
                      upstream: torch.Tensor) -> tuple[MoEOutput, torch.Tensor]:
    """Output and input gradient of ``sum(upstream * out) + 0.37 * aux_loss`` (the aux term reaches the router)."""
    x = x.detach().clone().requires_grad_(True)
    out = layer(x, mask)
    ((out.hidden * upstream).sum() + 0.37 * out.aux_loss).backward()
    return out, x.grad


CASES = {  # name: (capacity_factor, token_drop, training)
    "token-drop": (0.6, True, True),
    "dropless-train": (0.6, False, True),
    "eval": (0.6, True, False),  # eval is dropless whatever token_drop says
}


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padding"])
@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_moe_layer_equals_the_reference_layer_in_float64(case: str, padded: bool) -> None:
    capacity_factor, token_drop, training = CASES[case]
    ref, ds, _ = _moe_pair(capacity_factor=capacity_factor, moe_token_drop=token_drop)
    ref.train(training)
    ds.train(training)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 48, 64, generator=g, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=g, dtype=torch.float64)
    mask = None
    if padded:  # padding in the middle of row 0 and at the end of row 1: it must neither route nor count
        mask = torch.ones(2, 48, dtype=torch.bool)
        mask[0, 10:14] = False
        mask[1, 41:] = False

    ref_out, ref_dx = _forward_backward(ref, x, mask, upstream)
    ds_out, ds_dx = _forward_backward(ds, x, mask, upstream)

    if case == "token-drop":  # capacity ceil(0.6 * N * 2 / 4) < the ~N/2 slots an expert gets on average
        assert ref_out.dropped.sum() > 10, "the token-drop case must actually drop slots"
    else:
        assert ref_out.dropped.sum() == 0
    assert torch.equal(ds_out.routed, ref_out.routed)
    assert torch.equal(ds_out.dropped, ref_out.dropped)
    n_real = 96 if mask is None else int(mask.sum())
    assert int(ds_out.routed.sum()) == 2 * n_real  # k slots per real token, padding excluded
    tol = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ds_out.hidden, ref_out.hidden, **tol)
    torch.testing.assert_close(ds_out.aux_loss, ref_out.aux_loss, **tol)
    torch.testing.assert_close(ds_out.router_logits, ref_out.router_logits, **tol)
    torch.testing.assert_close(ds_dx, ref_dx, **tol)
    torch.testing.assert_close(ds.router.weight.grad, ref.router.weight.grad, **tol)
    gate_up, down = _expert_grads(ds)
    torch.testing.assert_close(gate_up, ref.experts.gate_up_proj.grad, **tol)
    torch.testing.assert_close(down, ref.experts.down_proj.grad, **tol)
    if mask is not None:  # padding rows get nothing from the experts
        assert torch.count_nonzero(ds_out.hidden[~mask]) == 0


def test_deepspeed_moe_layer_traces_under_torch_compile_with_the_eager_values_and_gradients() -> None:
    """The stage compiles the MoE layers (``compile: true``). Dynamo and AOTAutograd must trace the layer's
    dispatch/combine autograd functions (gathers forward and backward) and give eager's outputs and gradients.
    ``aot_eager`` runs exactly that tracing without inductor's C++ code generation (~1 min on this CPU)."""
    torch._dynamo.reset()
    _, eager, _ = _moe_pair(capacity_factor=1.0)
    eager.train()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend="aot_eager", dynamic=False)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 48, eager.hidden_size, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[1, 40:] = False
    results = []
    for layer in (eager, compiled):
        x = x0.clone().requires_grad_(True)
        out = layer(x, mask)
        ((out.hidden * x0).sum() + 0.37 * out.aux_loss).backward()
        results.append([out.hidden.detach(), x.grad, layer.router.weight.grad, *_expert_grads(layer), out.dropped])
    assert results[0][-1].sum() > 0  # capacity 1.0 drops slots: the drop path is traced too
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a.double(), b.double(), rtol=1e-10, atol=1e-12)


def test_deepspeed_moe_layer_takes_an_empty_batch() -> None:
    _, layer, _ = _moe_pair()
    layer.train()
    x = torch.zeros(1, 0, layer.hidden_size, dtype=torch.float64, requires_grad=True)
    out = layer(x, None)
    assert out.hidden.shape == (1, 0, layer.hidden_size) and int(out.routed.sum()) == 0
    out.hidden.sum().backward()
    assert x.grad.shape == x.shape


def test_export_model_state_round_trips_to_the_reference_state_dict_exactly() -> None:
    ref_model = _float64_model()
    ds_model = copy.deepcopy(ref_model)
    install_deepspeed_moe(ds_model)
    assert not any(k.endswith("experts.gate_up_proj") for k in ds_model.state_dict())  # the swap happened
    exported = export_model_state(ds_model)
    reference = ref_model.state_dict()
    assert sorted(exported) == sorted(reference)
    for key, value in reference.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
    fresh = HybridForCausalLM(ref_model.config).double()
    fresh.load_state_dict(exported, strict=True)


def test_export_model_state_puts_each_deepspeed_expert_weight_at_its_reference_slice() -> None:
    """A change to one DeepSpeed expert tensor lands exactly at its slice of the stacked reference weights."""
    ds_model = copy.deepcopy(_float64_model())
    install_deepspeed_moe(ds_model)
    layer = ds_model.model.layers[0].moe
    f = layer.intermediate_size
    with torch.no_grad():
        layer.experts.gate_up_proj[2, :f].fill_(1.0)
        layer.experts.gate_up_proj[2, f:].fill_(3.0)
        layer.experts.down_proj[3].fill_(2.0)
    state = export_model_state(ds_model)
    gate_up, down = state["model.layers.0.moe.experts.gate_up_proj"], state["model.layers.0.moe.experts.down_proj"]
    assert torch.all(gate_up[2, :f] == 1.0) and torch.all(gate_up[2, f:] == 3.0)
    assert torch.all(down[3] == 2.0)
    assert not torch.any(gate_up[[0, 1, 3]] == 1.0) and not torch.any(down[[0, 1, 2]] == 2.0)


# --- 2. expert parallelism and the global router over two gloo processes --------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _admit(top_i: torch.Tensor, valid: torch.Tensor, capacity: int, used: list[int]) -> torch.Tensor:
    """GShard admission by hand: all first choices in token order, then all second choices; an expert takes a
    slot while fewer than ``capacity`` slots are in it (``used`` counts what earlier ranks put there)."""
    keep = torch.zeros_like(top_i, dtype=torch.bool)
    for choice in range(top_i.shape[1]):
        for t in range(top_i.shape[0]):
            e = int(top_i[t, choice])
            if valid[t] and used[e] < capacity:
                keep[t, choice] = True
                used[e] += 1
    return keep


@pytest.fixture(scope="module")
def expert_parallel_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Run tests.pretrain_fixtures.expert_parallel_worker on two spawned gloo ranks; their results per rank."""
    import torch.multiprocessing as mp

    from tests.pretrain_fixtures import EP_WORLD, expert_parallel_worker

    out = tmp_path_factory.mktemp("ep")
    procs = mp.spawn(expert_parallel_worker, args=(EP_WORLD, _free_port(), str(out)), nprocs=EP_WORLD, join=False)
    deadline = time.monotonic() + 240  # a collective mismatch would hang: fail instead
    while not procs.join(timeout=1):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("the two expert-parallel ranks did not finish within 240 s (a hung collective?)")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(EP_WORLD)]


@pytest.mark.slow
def test_expert_parallel_dropless_output_and_expert_grads_equal_a_single_process_reference(
        expert_parallel_results: list[dict]) -> None:
    from tests.pretrain_fixtures import EP_WORLD, ep_dropless_inputs, ep_model

    ref = ep_model().model.layers[1].moe
    ref.train()
    ref.token_drop = False
    gate_up_total = torch.zeros_like(ref.experts.gate_up_proj)
    down_total = torch.zeros_like(ref.experts.down_proj)
    local = ref.num_experts // EP_WORLD
    for rank, res in enumerate(r["dropless"] for r in expert_parallel_results):
        assert res["ep_group_ranks"] == EP_WORLD
        ref.zero_grad()
        x, mask, upstream = ep_dropless_inputs(rank)
        out, x_grad = _forward_backward(ref, x, mask, upstream)
        assert res["dropped"].sum() == 0 and torch.equal(res["routed"], out.routed)
        assert (res["hidden"] - out.hidden).abs().max() < 1e-10  # this rank's tokens, all experts in one process
        assert (res["x_grad"] - x_grad).abs().max() < 1e-10
        assert (res["router_grad"] - ref.router.weight.grad).abs().max() < 1e-10  # the router is data-parallel
        gate_up_total += ref.experts.gate_up_proj.grad
        down_total += ref.experts.down_proj.grad
        # the other rank's tokens reached this rank's experts: their share of the gradient is non-zero
        assert res["gate_up_grad"].abs().sum() > 0
    for rank, res in enumerate(r["dropless"] for r in expert_parallel_results):
        owned = slice(rank * local, (rank + 1) * local)  # DeepSpeed's layout: rank r holds experts [r*E_l, ...)
        # an expert's gradient sums over the tokens of BOTH ranks (the backward all-to-all brings them home)
        assert (res["gate_up_grad"] - gate_up_total[owned]).abs().max() < 1e-10
        assert (res["down_grad"] - down_total[owned]).abs().max() < 1e-10


@pytest.mark.slow
def test_global_router_applies_capacity_over_both_ranks_and_drops_fewer_slots(
        expert_parallel_results: list[dict]) -> None:
    from tests.pretrain_fixtures import (
        EP_SKEW_PADDING,
        EP_SKEW_TOKENS,
        EP_WORLD,
        ep_model,
        ep_skewed_inputs,
        ep_skewed_router,
    )

    ref = ep_model().model.layers[1].moe
    ep_skewed_router(ref)
    E, k, factor = ref.num_experts, ref.top_k, ref.capacity_factor
    inputs = [ep_skewed_inputs(r) for r in range(EP_WORLD)]
    routing = []
    for x, mask in inputs:
        _, _, top_w, top_i = ref.router(x[0])
        routing.append((top_w, top_i, mask[0]))
        routed = torch.bincount(top_i[mask[0]].reshape(-1), minlength=E)
        assert torch.equal(routed, expert_parallel_results[len(routing) - 1]["global"]["routed"])
    # the skew the test relies on: each rank's first choices all on its own expert
    assert all(torch.all(routing[r][1][routing[r][2], 0] == r) for r in range(EP_WORLD))

    real = [EP_SKEW_TOKENS, EP_SKEW_TOKENS - EP_SKEW_PADDING]  # padding never counts towards capacity
    total_routed = sum(res["global"]["routed"] for res in expert_parallel_results)
    global_cap = expert_capacity(sum(real), k, E, factor)  # ceil(1.0 * 124 * 2 / 4) = 62
    admitted_global = sum(res["global"]["routed"] - res["global"]["dropped"] for res in expert_parallel_results)
    assert admitted_global.tolist() == [min(int(s), global_cap) for s in total_routed]
    for r, res in enumerate(expert_parallel_results):  # without it, each rank caps its own slots
        local_cap = expert_capacity(real[r], k, E, factor)
        admitted = res["local"]["routed"] - res["local"]["dropped"]
        assert admitted.tolist() == [min(int(s), local_cap) for s in res["local"]["routed"]]
    dropped_global = int(sum(res["global"]["dropped"].sum() for res in expert_parallel_results))
    dropped_local = int(sum(res["local"]["dropped"].sum() for res in expert_parallel_results))
    assert 0 < dropped_global < 0.8 * dropped_local, (dropped_global, dropped_local)

    # the outputs under drop: rank 0's slots are admitted first, rank 1 fills what is left of each expert
    used = [0] * E
    for r, (top_w, top_i, valid) in enumerate(routing):
        x = inputs[r][0][0]
        keep = _admit(top_i, valid, global_cap, used)
        expected = ref.experts(x, top_i, top_w, keep)
        assert (expert_parallel_results[r]["global"]["hidden"][0] - expected).abs().max() < 1e-10
        keep = _admit(top_i, valid, expert_capacity(real[r], k, E, factor), [0] * E)
        expected = ref.experts(x, top_i, top_w, keep)
        assert (expert_parallel_results[r]["local"]["hidden"][0] - expected).abs().max() < 1e-10


# --- 3. the stage end to end (one shared run) ----------------------------------------------------------------

# 64 initial batches of 8 rows x 128 tokens; the batch doubles to 16 rows once 16 batches are done, so the run
# is 16 + 24 = 40 optimizer steps, every one logged. ~30 s on one core.
SEQ, ROWS = 128, 8
STAGE_PARAMS: dict = dict(seq_len=SEQ, micro_batch_rows=4, batch_rows=ROWS, max_batch_rows=16, train_tokens=65536,
                          peak_lr=3e-3, warmup_frac=0.1, decay_frac=0.2, final_lr_ratio=0.1,
                          double_batch_at_tokens=[16384], log_every=1, checkpoint_every=10, eval_documents=12)
ISSUE_METRICS = ("loss", "aux_loss", "lr", "batch_size", "grad_norm", "tokens_per_second", "mfu", "drop_rate",
                 "memory_gb")


def _context(root: Path, inputs: PretrainInputs, **resources: float) -> StageContext:
    from pipeline.stage import Resources

    ctx = StageContext(root / "out", inputs.as_inputs(), stage_name="pretrain", resources=Resources(**resources),
                       resume_dir=root / "resume")
    return ctx


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line]


@dataclass
class TrainedRun:
    ctx: StageContext
    out: Path
    resume: Path
    history: list[dict]
    summary: dict


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory: pytest.TempPathFactory) -> PretrainInputs:
    from tests.pretrain_fixtures import build_inputs

    return build_inputs(tmp_path_factory.mktemp("pretrain_inputs"))


@pytest.fixture(scope="module")
def trained(stage_inputs: PretrainInputs, tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    from pretrain.stage import PretrainParams, run

    root = tmp_path_factory.mktemp("trained")
    ctx = _context(root, stage_inputs, cpus=1)
    run(PretrainParams(**STAGE_PARAMS), ctx)
    return TrainedRun(ctx, ctx.out_dir, root / "resume", _history(ctx.out_dir),
                      json.loads((ctx.out_dir / "summary.json").read_text()))


def test_stage_packs_into_a_work_dir_that_does_not_exist_yet(stage_inputs: PretrainInputs, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner hands the stage a work_dir path it has not created (pipeline/runner.py); packing must not
    depend on it existing. Stops at the launch (run_process_tree replaced), so no training runs."""
    import pipeline.launch
    from pipeline.stage import Resources
    from pretrain.stage import PretrainParams, run

    class Launched(Exception):
        pass

    def launch(*args: object, **kwargs: object) -> None:
        raise Launched

    monkeypatch.setattr(pipeline.launch, "run_process_tree", launch)
    ctx = StageContext(tmp_path / "out", stage_inputs.as_inputs(), stage_name="pretrain",
                       resources=Resources(cpus=1), resume_dir=tmp_path / "resume")
    assert not ctx.work_dir.exists()
    with pytest.raises(Launched):
        run(PretrainParams(**STAGE_PARAMS), ctx)
    assert (tmp_path / "resume" / "data" / "packing.json").exists()


@pytest.mark.slow
def test_stage_eval_loss_is_clearly_below_the_unigram_loss(trained: TrainedRun) -> None:
    s = trained.ctx.summary
    # measured: eval 4.70 vs unigram 5.38 nats after 65k tokens; a model that learned only token frequencies
    # sits at the unigram loss
    assert s["unigram_loss"] - s["eval_loss"] > 0.3, s
    assert s["eval_loss"] == pytest.approx(trained.summary["eval_loss"], rel=1e-12)
    assert s["steps"] == 40 and s["tokens"] == 65536 and s["skipped_steps"] == 0


@pytest.mark.slow
def test_stage_writes_the_reproducible_part_of_its_log_as_the_loss_curve_compare_reads(trained: TrainedRun) -> None:
    """loss_curve.json (payload) holds step, tokens, loss and lr of every logged step and nothing run-dependent;
    train_log.jsonl, with its throughput and memory figures, is only a record."""
    from pretrain.stage import LOSS_CURVE_FIELDS, LOSS_CURVE_FILE, STAGE

    curve = json.loads((trained.out / LOSS_CURVE_FILE).read_text())
    assert curve["fields"] == list(LOSS_CURVE_FIELDS) == ["step", "tokens", "loss", "lr"]
    assert curve["rows"] == [{k: h[k] for k in LOSS_CURVE_FIELDS} for h in trained.history]
    assert "train_log.jsonl" in STAGE.records and LOSS_CURVE_FILE not in STAGE.records


def test_stage_logs_every_issue_metric_under_its_name_at_every_logged_step(trained: TrainedRun) -> None:
    sink = trained.ctx.sink
    steps = list(range(1, 41))
    for name in ISSUE_METRICS:
        logged = [(step, v) for k, v, step in sink.metrics if k == name and step is not None]
        assert [step for step, _ in logged] == steps, name
        assert all(math.isfinite(v) for _, v in logged), name
        # the sink got what the ranks wrote to train_log.jsonl
        assert [v for _, v in logged] == pytest.approx([h[name] for h in trained.history], rel=1e-12), name
    for name in ("eval_loss", "unigram_loss"):  # logged once, at the end (a summary value of a stepped metric is
        # its last point, not a second entry: pipeline.stage.StageContext.log_summary)
        assert [v for k, v, step in sink.metrics if k == name] == [trained.summary[name]], name
    first = trained.history[0]
    assert abs(first["loss"] - math.log(512)) < 0.5  # nats per token from a near-uniform start, aux excluded
    for h in trained.history:
        assert 0 < h["aux_loss"] < 1 and h["grad_norm"] > 0 and h["tokens_per_second"] > 0
        assert 0 < h["mfu"] < 1 and 0 <= h["drop_rate"] < 0.5 and h["memory_gb"] > 0.05
    assert any(h["drop_rate"] > 0 for h in trained.history)  # capacity_factor 1.25 drops some slots


@pytest.mark.slow
def test_stage_lr_follows_the_wsd_shape(trained: TrainedRun) -> None:
    """lr of a step = WSD(s) at s = tokens before the step / initial batch tokens (§4.2): linear warm-up from 0
    over 6 initial batches, constant 3e-3, exponential decay over the last 13 toward 3e-4."""
    peak, warmup, constant, decay, final = 3e-3, 6, 45, 13, 3e-4

    def wsd(s: int) -> float:
        if s < warmup:
            return peak * s / warmup
        if s < warmup + constant:
            return peak
        return peak * (final / peak) ** ((s - warmup - constant) / decay)

    lrs = [h["lr"] for h in trained.history]
    for h in trained.history:
        before = h["tokens"] - h["batch_size"] * SEQ
        assert h["lr"] == pytest.approx(wsd(before // (ROWS * SEQ)), rel=1e-9, abs=1e-15), h["step"]
    assert lrs[:7] == pytest.approx([0.0, 5e-4, 1e-3, 1.5e-3, 2e-3, 2.5e-3, 3e-3])
    assert max(lrs) == pytest.approx(peak)
    tail = lrs[-6:]  # decay: a constant ratio from step to step (each step is 2 initial batches here)
    ratios = [b / a for a, b in zip(tail, tail[1:], strict=False)]
    assert ratios == pytest.approx([(final / peak) ** (2 / decay)] * len(ratios), rel=1e-9)
    # the last step runs at lr(62 of 64): two schedule steps above the final value
    assert final < lrs[-1] <= final * (peak / final) ** (2 / decay) * (1 + 1e-9)


@pytest.mark.slow
def test_stage_doubles_the_batch_at_the_configured_token_count(trained: TrainedRun) -> None:
    sizes = [h["batch_size"] for h in trained.history]
    assert sizes == [8] * 16 + [16] * 24  # 16 x 1024 tokens reach 16384: step 17 is the first doubled one
    tokens = [h["tokens"] for h in trained.history]
    assert tokens == [1024 * s for s in range(1, 17)] + [16384 + 2048 * s for s in range(1, 25)]


def _eval_loss_of(model: torch.nn.Module, data_dir: Path, max_rows: int, micro_rows: int) -> float:
    """pretrain/train.py:evaluate's measure, from a loaded model: mean label-position CE over packed eval rows."""
    import torch.nn.functional as F

    from pretrain.packed_data import PackedRows, make_batch

    rows = PackedRows(data_dir, "eval")
    n = min(len(rows), max_rows)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, micro_rows):
            batch = make_batch(rows, list(range(start, min(n, start + micro_rows))))
            logits = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens,
                           position_ids=batch.position_ids).logits[0, :-1].double()
            labels = batch.labels[0, 1:]
            total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    return total / count


MINIMAX_LOGITS = """
import sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.models.minimax import MiniMaxForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
assert type(model) is MiniMaxForCausalLM, type(model)
assert "model" not in sys.modules, "loading the MiniMax export imported hylight's model package"
ids = torch.from_numpy(np.load(sys.argv[2]))
with torch.no_grad():
    np.save(sys.argv[3], model.eval()(input_ids=ids).logits.double().numpy())
gen = GenerationConfig.from_pretrained(sys.argv[1])
print("GEN", gen.bos_token_id, gen.eos_token_id, gen.pad_token_id)
"""


@pytest.mark.slow
def test_stage_exports_model_and_minimax_checkpoints_with_the_same_logits(trained: TrainedRun,
                                                                          tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    import model  # noqa: F401  (registers hylight_hybrid with the Auto classes)
    from model.hf_minimax import max_relative_error
    from pretrain.packed_data import PackedRows

    ours = AutoModelForCausalLM.from_pretrained(trained.out / "model").eval()
    assert type(ours) is HybridForCausalLM
    # the export holds the trained weights: it reproduces the stage's own held-out loss
    eval_loss = _eval_loss_of(ours, trained.resume / "data", max_rows=64, micro_rows=4)
    assert eval_loss == pytest.approx(trained.summary["eval_loss"], abs=2e-4)

    tokens = PackedRows(trained.resume / "data", "eval").row(0)[0][:100].astype(np.int64)[None]
    np.save(tmp_path / "ids.npy", tokens)
    with torch.no_grad():
        our_logits = ours(input_ids=torch.from_numpy(tokens)).logits.double()
    # a fresh interpreter that never imports hylight's model package: transformers' own MiniMax loads it
    done = subprocess.run([sys.executable, "-c", MINIMAX_LOGITS, str(trained.out / "minimax"),
                           str(tmp_path / "ids.npy"), str(tmp_path / "logits.npy")],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.from_numpy(np.load(tmp_path / "logits.npy"))
    assert max_relative_error(our_logits, theirs) < 1e-4
    assert "GEN" in done.stdout


@pytest.mark.slow
def test_stage_export_configs_carry_the_tokenizer_ids_and_chat_template(trained: TrainedRun) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from data.tokenizer import BOS_TOKEN, CHAT_TEMPLATE, END_OF_TURN_TOKEN, EOS_TOKEN, PAD_TOKEN

    tok = Tokenizer.from_file(str(trained.ctx.input("tokenizer").path / "tokenizer.json"))
    bos, eos, pad, eot = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, END_OF_TURN_TOKEN))
    assert eot not in (bos, eos, pad)
    for sub in ("model", "minimax"):
        d = trained.out / sub
        for name in ("config.json", "generation_config.json"):
            cfg = json.loads((d / name).read_text())
            assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (bos, [eos, eot], pad), \
                f"{sub}/{name}"
        config = json.loads((d / "config.json").read_text())
        assert config["vocab_size"] == tok.get_vocab_size()
        assert config["model_type"] == ("hylight_hybrid" if sub == "model" else "minimax")
        assert "auto_map" not in config  # no remote code
        assert (d / "chat_template.jinja").read_text() == CHAT_TEMPLATE
        hf_tok = AutoTokenizer.from_pretrained(d)
        assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (bos, eos, pad)
        assert hf_tok.chat_template == CHAT_TEMPLATE


@pytest.mark.slow
def test_stage_writes_plots_and_the_expert_load_it_measured(trained: TrainedRun) -> None:
    for name in ("loss_curve.png", "expert_load.png"):
        path = trained.out / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000, name
        assert (path, "plots") in trained.ctx.sink.artifacts
    routed = np.load(trained.out / "expert_routed.npy")
    dropped = np.load(trained.out / "expert_dropped.npy")
    assert routed.shape == dropped.shape == (8, 4)  # tiny: 8 layers x 4 experts
    # every training token sends k=2 slots through every layer; only the packed split's last row has padding
    pad = json.loads((trained.out / "packing.json").read_text())["train"]["pad_tokens"]
    per_layer = routed.sum(1)
    assert np.all(per_layer <= 2 * 65536) and np.all(per_layer >= 2 * (65536 - 4 * pad))
    assert np.all(dropped <= routed) and dropped.sum() > 0
    assert trained.summary["drop_rate"] == pytest.approx(dropped.sum() / routed.sum(), rel=1e-12)


def _checkpointed_experts(tag_dir: Path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up_proj (gate rows, then up rows) and down_proj of every expert of ``layer`` [E, ...] in global expert order, read from
    DeepSpeed's expert files (``layer_<L>_expert_<j>_mp_rank_00_model_states.pt``, j the global id of the saved
    expert module; a file holds one expert or one rank's experts stacked)."""
    files = sorted(tag_dir.glob(f"layer_{layer}_expert_*_mp_rank_00_model_states.pt"),
                   key=lambda p: int(p.name.split("_")[3]))
    assert files, f"no expert files for layer {layer} in {tag_dir}"
    parts: dict[str, list[torch.Tensor]] = {"gate_up_proj": [], "down_proj": []}
    for f in files:
        saved = torch.load(f, map_location="cpu", weights_only=False)
        for key, value in saved.items():
            name = key.rsplit(".", 1)[-1]
            parts[name].append(value.reshape(-1, *value.shape[-2:]).float())
    gate_up, down = (torch.cat(parts[n]) for n in ("gate_up_proj", "down_proj"))
    return gate_up, down


# --- 4. kill and resume -----------------------------------------------------------------------------------------


def _job_processes() -> list[int]:
    """This test process's descendants that belong to a launched training job (supervisor and ranks)."""
    from pipeline.launch import descendants

    job = []
    for pid in descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"--hylight-supervise" in cmdline or b"pretrain.train" in cmdline or b"torch.distributed.run" in cmdline:
            job.append(pid)
    return job


@dataclass
class ResumedRun:
    killed_at: int  # the checkpoint step the rerun resumed from
    ctx: StageContext
    history: list[dict]
    summary: dict


@pytest.fixture(scope="module")
def resumed(stage_inputs: PretrainInputs, tmp_path_factory: pytest.TempPathFactory) -> ResumedRun:
    """The shared run's params, SIGKILLed (whole process tree) once its step-10 checkpoint exists, then rerun
    with the same resume_dir into a fresh output directory, as `hylight run` does after a kill."""
    from pipeline.launch import ProcessTreeError
    from pretrain.stage import PretrainParams, run

    root = tmp_path_factory.mktemp("resume")
    params = PretrainParams(**STAGE_PARAMS)
    ctx = _context(root, stage_inputs, cpus=1)
    errors: list[BaseException] = []

    def attempt() -> None:
        try:
            run(params, ctx)
        except BaseException as e:  # noqa: BLE001  (inspected below)
            errors.append(e)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    latest = root / "resume" / "deepspeed" / "latest"
    deadline = time.monotonic() + 240
    while not (latest.exists() and latest.read_text().strip() >= "step00000010"):
        assert thread.is_alive(), f"the first attempt ended before its step-10 checkpoint: {errors}"
        assert time.monotonic() < deadline, "no step-10 checkpoint after 240 s"
        time.sleep(0.02)
    job = _job_processes()
    assert job, "found no training processes to kill"
    for pid in job:  # the whole tree at once, no chance to clean up
        os.kill(pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ProcessTreeError) and errors[0].returncode == -signal.SIGKILL, \
        errors
    assert not _job_processes()
    killed_at = int(latest.read_text().strip().removeprefix("step"))
    assert 10 <= killed_at < 40, f"killed at step {killed_at}: too late to test a resume"

    ctx2 = StageContext(root / "out2", stage_inputs.as_inputs(), stage_name="pretrain", resources=ctx.resources,
                        resume_dir=root / "resume")
    run(params, ctx2)
    return ResumedRun(killed_at, ctx2, _history(ctx2.out_dir),
                      json.loads((ctx2.out_dir / "summary.json").read_text()))


@pytest.mark.slow
def test_killed_stage_resumes_from_its_last_checkpoint_with_the_uninterrupted_loss_curve(
        resumed: ResumedRun, trained: TrainedRun) -> None:
    # the rerun trained only the steps after the checkpoint (the sink sees this attempt's metrics only)
    new_steps = [step for k, _, step in resumed.ctx.sink.metrics if k == "loss" and step is not None]
    assert new_steps == list(range(resumed.killed_at + 1, 41))
    assert [h["step"] for h in resumed.history] == [h["step"] for h in trained.history] == list(range(1, 41))
    for a, b in zip(resumed.history, trained.history, strict=True):
        assert (a["tokens"], a["batch_size"]) == (b["tokens"], b["batch_size"]), a["step"]
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["step"], a["loss"], b["loss"])
        assert abs(a["aux_loss"] - b["aux_loss"]) <= 1e-6, a["step"]
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12, abs=1e-18), a["step"]
        assert a["drop_rate"] == pytest.approx(b["drop_rate"], abs=1e-9), a["step"]  # the same slots dropped
    assert abs(resumed.summary["eval_loss"] - trained.summary["eval_loss"]) <= 1e-6
    from safetensors.torch import load_file

    ours = load_file(resumed.ctx.out_dir / "model" / "model.safetensors")
    ref = load_file(trained.out / "model" / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    assert max(float((ours[k] - ref[k]).abs().max()) for k in ref) < 1e-5


@pytest.mark.slow
def test_killed_stage_resume_keeps_the_whole_run_expert_load(resumed: ResumedRun, trained: TrainedRun) -> None:
    routed = np.load(resumed.ctx.out_dir / "expert_routed.npy")
    assert np.array_equal(routed, np.load(trained.out / "expert_routed.npy"))
    assert resumed.summary["drop_rate"] == pytest.approx(trained.summary["drop_rate"], abs=1e-12)


# --- 5. divergence guard ----------------------------------------------------------------------------------------

SMALL_RUN: dict = dict(STAGE_PARAMS, train_tokens=8192, double_batch_at_tokens=[], checkpoint_every=2)  # 8 steps


@pytest.mark.slow
def test_divergence_guard_skips_an_injected_nan_step_counts_it_and_training_continues(
        stage_inputs: PretrainInputs, tmp_path: Path) -> None:
    from pretrain.stage import PretrainParams, run

    ctx = _context(tmp_path, stage_inputs, cpus=1)
    run(PretrainParams(**SMALL_RUN, inject_nan_at_steps=[3]), ctx)  # the 4th optimizer step (0-based 3)
    history = _history(ctx.out_dir)
    summary = json.loads((ctx.out_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and ctx.summary["skipped_steps"] == 1
    assert summary["steps"] == 8 and summary["tokens"] == 8192  # it went on to the end
    assert [h["skipped_steps"] for h in history] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert not math.isfinite(history[3]["grad_norm"])  # the skipped step: non-finite gradient seen
    # every other step trained on finite weights: had the NaN update been applied, every later loss would be NaN
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for i, h in enumerate(history) if i != 3)
    assert history[-1]["loss"] < history[0]["loss"]
    assert math.isfinite(summary["eval_loss"])


@pytest.mark.slow
def test_divergence_guard_stops_after_repeated_skips_naming_a_valid_checkpoint(stage_inputs: PretrainInputs,
                                                                                 tmp_path: Path) -> None:
    from pipeline.launch import ProcessTreeError
    from pretrain.stage import PretrainParams, run

    ctx = _context(tmp_path, stage_inputs, cpus=1)
    params = PretrainParams(**dict(SMALL_RUN, checkpoint_every=1), inject_nan_at_steps=[3, 4, 5, 6, 7],
                            max_consecutive_skips=3)
    with pytest.raises(ProcessTreeError) as failure:
        run(params, ctx)
    ckpt = tmp_path / "resume" / "deepspeed"
    message = str(failure.value)
    assert "3 optimizer steps in a row were skipped" in message and str(ckpt) in message
    assert not (ctx.out_dir / "summary.json").exists()
    # the third skip (step 6) stops before its checkpoint: the newest ones are steps 4 and 5, both after skips
    tag = (ckpt / "latest").read_text().strip()
    assert tag == "step00000005" and (ckpt / tag / "mp_rank_00_model_states.pt").is_file()
    states = {t: torch.load(ckpt / t / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
              for t in ("step00000004", "step00000005")}
    assert states["step00000005"]["step"] == 5 and states["step00000005"]["guard"]["skipped"] == 2
    module4, module5 = states["step00000004"]["module"], states["step00000005"]["module"]
    assert all(torch.isfinite(v).all() for v in module5.values())
    # a skipped step leaves the weights as they were: step 5's checkpoint equals step 4's, experts included
    assert all(torch.equal(module4[k], module5[k]) for k in module5)
    for layer in range(8):
        before, after = (_checkpointed_experts(ckpt / t, layer) for t in states)
        assert all(torch.isfinite(a).all() and torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.slow
def test_divergence_guard_leaves_a_checkpoint_even_when_it_stops_before_the_first_periodic_one(
        stage_inputs: PretrainInputs, tmp_path: Path) -> None:
    from pipeline.launch import ProcessTreeError
    from pretrain.stage import PretrainParams, run

    ctx = _context(tmp_path, stage_inputs, cpus=1)
    params = PretrainParams(**dict(SMALL_RUN, checkpoint_every=100), inject_nan_at_steps=[1, 2, 3],
                            max_consecutive_skips=3)
    with pytest.raises(ProcessTreeError, match="in a row were skipped"):
        run(params, ctx)
    ckpt = tmp_path / "resume" / "deepspeed"
    assert (ckpt / "latest").is_file(), f"the error names {ckpt} as holding the last valid checkpoint"
    assert (ckpt / (ckpt / "latest").read_text().strip() / "mp_rank_00_model_states.pt").is_file()


# --- 6. two training processes with expert parallelism -------------------------------------------------------


@pytest.mark.slow
def test_two_process_stage_trains_with_expert_parallelism_and_exports_every_expert(stage_inputs: PretrainInputs,
                                                                                   tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from model.hf_minimax import max_relative_error
    from pretrain.packed_data import PackedRows
    from pretrain.stage import PretrainParams, run

    ctx = _context(tmp_path, stage_inputs, cpus=1)
    run(PretrainParams(**dict(SMALL_RUN, train_tokens=4096, checkpoint_every=100, eval_max_rows=16),
                       processes=2, expert_parallel_size=2), ctx)
    summary = json.loads((ctx.out_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens"] == 4096  # 8 rows a step: 4 on each rank
    assert math.isfinite(summary["eval_loss"])
    assert [step for k, _, step in ctx.sink.metrics if k == "loss" and step is not None] == [1, 2, 3, 4]

    # model/ holds all 4 experts of every layer, gathered from both ranks, each equal to DeepSpeed's own
    # per-expert checkpoint file of it (written by the rank that owns it, under its global id)
    state = load_file(ctx.out_dir / "model" / "model.safetensors")
    ckpt = tmp_path / "resume" / "deepspeed" / (tmp_path / "resume" / "deepspeed" / "latest").read_text().strip()
    for layer in range(8):
        gate_up = state[f"model.layers.{layer}.moe.experts.gate_up_proj"]
        down = state[f"model.layers.{layer}.moe.experts.down_proj"]
        assert gate_up.shape == (4, 256, 64) and down.shape == (4, 64, 128)
        saved_gate_up, saved_down = _checkpointed_experts(ckpt, layer)
        assert torch.equal(gate_up, saved_gate_up) and torch.equal(down, saved_down)
    assert not torch.equal(state["model.layers.0.moe.experts.gate_up_proj"][0],
                           state["model.layers.0.moe.experts.gate_up_proj"][2])

    import model  # noqa: F401  (registers hylight_hybrid)

    ours = AutoModelForCausalLM.from_pretrained(ctx.out_dir / "model").eval()
    theirs = AutoModelForCausalLM.from_pretrained(ctx.out_dir / "minimax").eval()
    ids = torch.from_numpy(PackedRows(tmp_path / "resume" / "data", "eval").row(1)[0][:96].astype(np.int64))[None]
    with torch.no_grad():
        assert max_relative_error(ours(input_ids=ids).logits, theirs(input_ids=ids).logits) < 1e-4


def _guard_rank(rank: int, init_file: str, cases: list[list[float]], out_dir: str) -> None:
    import collections

    import torch.distributed as dist

    from pretrain.grad_guard import GradGuard, install_spike_guard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    seen = []
    for norms in cases:
        class ZeroLike:  # the two members of DeepSpeed's ZeRO optimizer the guard uses
            overflow = False

            def scaled_global_norm(self, norms: list[float] = norms) -> torch.Tensor:
                return torch.tensor(norms[rank])

        opt, guard = ZeroLike(), GradGuard(spike_factor=10.0, max_consecutive=5)
        guard.history = collections.deque([1.0] * 8, maxlen=64)
        install_spike_guard(opt, guard)
        opt.scaled_global_norm()
        seen.append({"overflow": opt.overflow, "norm": guard.last_norm})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def test_divergence_guard_takes_the_same_decision_on_every_rank(tmp_path: Path) -> None:
    """Under expert parallelism DeepSpeed's gradient norm differs between ranks (the expert part is rank-local): a
    spike or a non-finite norm (-1 from DeepSpeed) seen on one rank must make every rank skip the step."""
    import torch.multiprocessing as mp

    cases = [[1.0, 50.0], [-1.0, 1.0], [1.0, 2.0]]  # a spike on rank 1, a NaN on rank 0, nothing
    mp.spawn(_guard_rank, args=(str(tmp_path / "init"), cases, str(tmp_path)), nprocs=2, join=True)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    spike, nan, fine = zip(*seen, strict=True)
    assert [s["overflow"] for s in spike] == [True, True]
    assert [s["norm"] for s in spike] == [50.0, 50.0]  # the largest rank norm, on both
    assert [s["overflow"] for s in nan] == [True, True] and all(math.isnan(s["norm"]) for s in nan)
    assert [s["overflow"] for s in fine] == [False, False] and [s["norm"] for s in fine] == [2.0, 2.0]


def test_foreach_gradient_norm_equals_deepspeeds_per_gradient_norm(tmp_path: Path) -> None:
    """install_foreach_grad_norm replaces DeepSpeed's per-gradient float64 norms with one multi-tensor norm: the global
    norm of a real ZeRO-1 step must stay DeepSpeed's (and the float64 norm of the same gradients by plain autograd)."""
    import socket

    import torch.multiprocessing as mp

    from tests.pretrain_fixtures import grad_norm_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "norms.json"
    mp.spawn(grad_norm_worker, args=(port, str(out)), nprocs=1, join=True)
    r = json.loads(out.read_text())
    assert r["foreach_calls"] >= 1  # the replacement computed the step's norm
    assert r["exact"] > 0.1
    assert abs(r["deepspeed"] - r["exact"]) <= 1e-5 * r["exact"]
    assert abs(r["foreach"] - r["deepspeed"]) <= 1e-5 * r["deepspeed"]


def test_divergence_guard_skips_a_spike_but_takes_a_norm_that_stays_high() -> None:
    from pretrain.grad_guard import GradGuard

    guard = GradGuard(spike_factor=10.0, max_consecutive=5, max_spike_skips=2)

    def step(norm: float) -> bool:  # what the ZeRO optimizer's norm hook and the training loop do per step
        guard.last_norm = norm
        guard.spiked = guard.skip_spike(norm)
        return guard.after_step(overflow=guard.spiked)

    assert [step(1.0) for _ in range(8)] == [False] * 8
    assert step(50.0) is True  # a one-batch outlier: skipped
    assert step(1.0) is False and guard.spike_run == 0  # the next batch is fine
    assert [step(20.0), step(21.0)] == [True, True]  # two spikes in a row: skipped
    assert step(19.0) is False and guard.accepted_spikes == 1  # the third in a row is the new level: taken
    assert guard.history[-1] == 19.0 and guard.skipped == 3 and guard.consecutive == 0
    saved = guard.state_dict()
    again = GradGuard(spike_factor=10.0, max_consecutive=5, max_spike_skips=2)
    again.load_state_dict(saved)
    assert again.state_dict() == saved

    never = GradGuard(spike_factor=10.0, max_consecutive=5, max_spike_skips=0)
    for _ in range(8):
        never.last_norm = 1.0
        never.after_step(False)
    assert never.skip_spike(50.0) is False  # max_spike_skips=0: spikes are taken (clipped), never skipped


# --- 6. the engine's pieces: config, layout rules, the loop and its callbacks (no training) -----------------------


def test_engine_config_is_built_from_the_stage_params_and_round_trips_through_the_rank_config_file(
        tmp_path: Path) -> None:
    """Every knob a user sets on the stage reaches the rank under its own name; the file the ranks read is the typed
    config itself (``EngineConfig.load`` gives back an equal model)."""
    from pretrain.engine_config import EngineConfig, EngineKnobs, RunShape
    from pretrain.long_context import LongContextParams
    from pretrain.stage import PretrainParams

    params = PretrainParams(seq_len=128, batch_rows=16, micro_batch_rows=2, max_batch_rows=32, peak_lr=1e-3,
                            double_batch_at_tokens=[4096], double_batch_below_loss=[5.0], spike_factor=7.0,
                            inject_nan_at_steps=[3], probe_every=20, log_every=10, checkpoint_every=20, seed=5)
    cfg = EngineConfig.for_run(params, params, data_dir="d", tokenizer_dir="t", resume_dir="r", export_dir="e")
    for name in [*EngineKnobs.model_fields, *RunShape.model_fields]:
        assert getattr(cfg, name) == getattr(params, name), name
    path = tmp_path / "train_config.json"
    cfg.write(path)
    on_disk = json.loads(path.read_text())
    assert set(on_disk) == set(EngineConfig.model_fields)
    assert EngineConfig.load(path) == cfg
    with pytest.raises(ValueError, match="peak_lrr"):  # a misspelt knob in a rank config is an error, not a default
        EngineConfig.model_validate({**on_disk, "peak_lrr": 1.0})

    lc = LongContextParams(seed=3)
    phase = EngineConfig.for_run(lc, lc.phase_run(1), seed=lc.seed + 1, data_dir="d", tokenizer_dir="t",
                                 resume_dir="r", export_dir="e", init_from="m", ordered_rows=True)
    assert (phase.peak_lr, phase.warmup_frac, phase.seed) == (1e-3, 0.1, 4)  # long_context's own defaults
    assert (phase.seq_len, phase.batch_rows, phase.max_batch_rows, phase.micro_batch_rows) == (1024, 4, 4, 2)
    assert phase.model_overrides == {"rope_theta": 40_000.0, "max_position_embeddings": 1024}
    assert phase.train_tokens == lc.phase_rows(1) * 1024 and phase.eval_max_rows == lc.eval_rows


def test_head_init_embedding_starts_the_untied_head_as_the_embedding_and_xavier_does_not(
        stage_inputs: PretrainInputs) -> None:
    """``head_init: embedding`` (issue 33): the head equals the embedding at the start, is still its own parameter
    (a step on the head leaves the embedding), and an id's embedding scores its own id highest; the default draws
    the head on its own; a tied model is left tied."""
    from pretrain.engine_config import EngineConfig
    from pretrain.train import build_model

    def cfg(**kw: object) -> EngineConfig:
        return EngineConfig(data_dir="d", tokenizer_dir=str(stage_inputs.tokenizer.path), resume_dir="r",
                            export_dir="e", size="tiny", **kw)

    model = build_model(cfg(head_init="embedding"))
    head, embed = model.lm_head.weight, model.get_input_embeddings().weight
    assert head is not embed and head.data_ptr() != embed.data_ptr()
    assert torch.equal(head, embed)
    scores = embed @ head.T  # a hidden state equal to id i's embedding
    assert torch.equal(scores.argmax(-1), torch.arange(embed.shape[0]))
    with torch.no_grad():
        head.add_(1.0)
    assert not torch.equal(head, embed)

    xavier = build_model(cfg())
    assert not torch.equal(xavier.lm_head.weight, xavier.get_input_embeddings().weight)
    assert torch.equal(xavier.get_input_embeddings().weight, build_model(cfg()).get_input_embeddings().weight)
    tied = build_model(cfg(head_init="embedding", model_overrides={"tie_word_embeddings": True}))
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    with pytest.raises(ValueError, match="head_init"):
        cfg(head_init="zeros")


def test_unigram_init_starts_the_logits_near_the_unigram_through_one_shared_direction(
        trained: TrainedRun, stage_inputs: PretrainInputs) -> None:
    """``unigram_init`` (the all-softmax plateau): only the embedding and the head change, every embedding row by
    the same vector, no parameter is added, and the held-out loss at step 0 starts near the unigram loss where the
    Xavier init starts above ln V; a tied head is refused, and so is a negative share."""
    from pretrain.engine_config import EngineConfig
    from pretrain.packed_data import PackedRows, make_batch, unigram_loss
    from pretrain.train import build_model

    data = trained.resume / "data"

    def cfg(**kw: object) -> EngineConfig:
        return EngineConfig(data_dir=str(data), tokenizer_dir=str(stage_inputs.tokenizer.path), resume_dir="r",
                            export_dir="e", size="tiny",
                            seq_len=json.loads((data / "packing.json").read_text())["seq_len"], **kw)

    base, uni = build_model(cfg(head_init="embedding")), build_model(cfg(head_init="embedding", unigram_init=1.0))
    names = dict(base.named_parameters())
    changed = {n for n, p in uni.named_parameters() if not torch.equal(p, names[n])}
    assert changed == {"model.embed_tokens.weight", "lm_head.weight"}
    assert len(names) == len(dict(uni.named_parameters()))
    shift = (uni.get_input_embeddings().weight - base.get_input_embeddings().weight).detach()
    assert torch.allclose(shift, shift[0].expand_as(shift), atol=1e-6)  # one direction for every row
    mean_norm = float(base.get_input_embeddings().weight.detach().norm(dim=1).mean())
    assert float(shift[0].norm()) == pytest.approx(mean_norm, rel=1e-4)

    eval_rows = PackedRows(str(data), "eval")
    uni_loss = unigram_loss(eval_rows, np.load(data / "unigram_counts.npy"))
    b = make_batch(eval_rows, list(range(min(4, len(eval_rows)))))

    def loss(m: torch.nn.Module) -> float:
        m.eval()
        with torch.no_grad():
            return float(m(input_ids=b.input_ids, labels=b.labels, cu_seqlens=b.cu_seqlens,
                           position_ids=b.position_ids).loss)

    vocab = base.config.vocab_size
    base_loss, uni_start = loss(base), loss(uni)
    assert base_loss > math.log(vocab) - 0.05
    assert abs(uni_start - uni_loss) < 0.25 * (base_loss - uni_loss), (base_loss, uni_start, uni_loss)
    with pytest.raises(ValueError, match="untied"):
        build_model(cfg(unigram_init=1.0, model_overrides={"tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="unigram_init"):
        cfg(unigram_init=-1.0)


@pytest.mark.parametrize("kind", ["pretrain", "long_context"])
@pytest.mark.parametrize("bad, resources", [
    (dict(sequence_parallel=3), None),  # 256 (512/1024) is not divisible by 3
    (dict(sequence_parallel=2, expert_parallel_size=2), None),
    (dict(sequence_parallel=2, processes=3), dict(cpus=1)),
    (dict(processes=4), dict(gpus=2)),
])
def test_layout_problems_are_the_one_rule_the_params_the_spec_and_the_run_apply(kind: str, bad: dict,
                                                                                 resources: dict | None,
                                                                                 tmp_path: Path) -> None:
    """The same words whichever way the stage is reached: params validation (without resources), the spec's
    ``validate_resources`` and the stage's ``run`` (params built in code) all report ``layout_problems``'s."""
    from pydantic import ValidationError

    from pipeline.registry import resolve
    from pipeline.spec import ResourcesSpec
    from pipeline.stage import Resources, StageContext
    from pretrain.launch import layout_problems

    stage = resolve(kind)
    params_type = stage.params
    unchecked = params_type().model_copy(update=bad)  # the defaults with the fields as given, not validated
    if resources is None:
        expected = [msg for _, msg in layout_problems(unchecked)]
        assert expected
        with pytest.raises(ValidationError) as e:
            params_type(**bad)
        assert all(msg in str(e.value) for msg in expected), (expected, str(e.value))
        return
    r = Resources(**resources)
    expected = layout_problems(unchecked, r)
    assert expected and not layout_problems(unchecked)  # the ranks per node only: the params alone are fine
    params = params_type(**bad)
    spec_resources = ResourcesSpec(**resources)  # what the spec's validation passes
    assert [p for p in stage.validate_resources(params, spec_resources) if p[0] != "params.batch_tokens"] == expected
    ctx = StageContext(tmp_path / "out", {}, stage_name=kind, resources=r, resume_dir=tmp_path / "resume")
    with pytest.raises(ValueError) as e:
        stage.run(params, ctx)
    assert str(e.value).startswith(f"{kind}: " + "; ".join(msg for _, msg in expected))
    assert not (tmp_path / "resume").exists()


class _FakeEngine:
    """The part of DeepSpeed's engine the Trainer uses: a model config, forward/backward/step, the batch size."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.module = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=1, num_experts=2,
                                                             router_aux_loss_coef=0.0))
        self.gas, self.forwards = 1, 0

    def __call__(self, **kw: torch.Tensor) -> object:
        from types import SimpleNamespace

        self.forwards += 1
        return SimpleNamespace(loss=torch.tensor(2.0), aux_loss=torch.tensor(0.0),
                               moe_routed=torch.ones(1, 2, dtype=torch.float64), moe_dropped=torch.zeros(1, 2))

    def train(self) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> None: ...

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def set_train_batch_size(self, n: int) -> None:
        self.gas = n


def _fake_trainer(callbacks: list, *, steps: int = 4, log_every: int = 2) -> object:
    """A Trainer on a fake engine: one row of 8 tokens a step, ``steps`` steps."""
    from types import SimpleNamespace

    from pretrain.engine_config import EngineConfig
    from pretrain.grad_guard import GradGuard
    from pretrain.schedules import BatchSizeSchedule
    from pretrain.trainer import Trainer

    cfg = EngineConfig(data_dir="", tokenizer_dir="", resume_dir="", export_dir="", seq_len=16, batch_rows=1,
                       micro_batch_rows=1, train_tokens=16 * steps, log_every=log_every, checkpoint_every=log_every)
    micro = SimpleNamespace(input_ids=torch.zeros(1, 16, dtype=torch.long), labels=torch.zeros(1, 16),
                            cu_seqlens=torch.tensor([0, 16]), position_ids=torch.zeros(1, 16))
    return Trainer(cfg, engine=_FakeEngine(), optimizer=SimpleNamespace(param_groups=[{}]),
                   grid=SimpleNamespace(rank=0, world=1, data_parallel=1, sequence_parallel=1),
                   device=torch.device("cpu"), rows=None, loader=SimpleNamespace(next_indices=lambda n: [0] * n),
                   make_batch=lambda rows, idx: micro, lr_schedule=SimpleNamespace(lr=lambda step: 0.1),
                   batch_schedule=BatchSizeSchedule(1, 1), guard=GradGuard(10.0, 5), sp=None,
                   flops_of=lambda b: 1.0, callbacks=callbacks)


class _GraphPoolEngine(_FakeEngine):
    """A fake engine whose one parameter gets its gradient as CUDA-graph trees give it (pytorch/pytorch#169545):
    the backward writes the gradient into graph-owned memory (``pool``) and autograd installs that very tensor as
    ``.grad``; the next forward starts a new graph generation that reuses (here: poisons) the memory."""

    def __init__(self) -> None:
        super().__init__()
        self.param = torch.nn.Parameter(torch.zeros(3))
        self.pool = torch.zeros(3)

    def __call__(self, **kw: torch.Tensor) -> object:
        self.pool.fill_(float("nan"))  # a new generation's replay overwrites the previous outputs
        return super().__call__(**kw)

    def backward(self, loss: torch.Tensor) -> None:
        self.pool.copy_(torch.full((3,), float(self.forwards)))  # micro-batch i's gradient: i everywhere
        if self.param.grad is None:
            self.param.grad = self.pool  # autograd keeps the graph's output tensor itself
        else:
            self.param.grad += self.pool


@pytest.mark.parametrize("graph_params", [True, False])
def test_gradients_cuda_graphs_write_survive_the_next_micro_batch(graph_params: bool) -> None:
    """Issue 34: compiled runs with gradient accumulation failed on GPUs ("accessing tensor output of CUDAGraphs that
    has been overwritten by a subsequent run"). The trainer copies the graph-written gradients out between the
    micro-batches of a step, so a step of two micro-batches ends with the sum of both gradients; without it the
    first micro-batch's gradient is whatever the second forward left in the graphs' memory."""
    from types import SimpleNamespace

    from pretrain.engine_config import EngineConfig
    from pretrain.grad_guard import GradGuard
    from pretrain.schedules import BatchSizeSchedule
    from pretrain.trainer import Trainer

    cfg = EngineConfig(data_dir="", tokenizer_dir="", resume_dir="", export_dir="", seq_len=16, batch_rows=2,
                       micro_batch_rows=1, max_batch_rows=2, train_tokens=32)
    micro = SimpleNamespace(input_ids=torch.zeros(1, 16, dtype=torch.long), labels=torch.zeros(1, 16),
                            cu_seqlens=torch.tensor([0, 16]), position_ids=torch.zeros(1, 16))
    engine = _GraphPoolEngine()
    trainer = Trainer(cfg, engine=engine, optimizer=SimpleNamespace(param_groups=[{}]),
                      grid=SimpleNamespace(rank=0, world=1, data_parallel=1, sequence_parallel=1),
                      device=torch.device("cpu"), rows=None, loader=SimpleNamespace(next_indices=lambda n: [0] * n),
                      make_batch=lambda rows, idx: micro, lr_schedule=SimpleNamespace(lr=lambda step: 0.1),
                      batch_schedule=BatchSizeSchedule(2, 2), guard=GradGuard(10.0, 5), sp=None,
                      flops_of=lambda b: 1.0, callbacks=[], graph_params=[engine.param] if graph_params else [])
    trainer.fit()
    assert (trainer.state.step, engine.forwards) == (1, 2)
    if graph_params:
        assert torch.equal(engine.param.grad, torch.full((3,), 3.0))  # 1 + 2
    else:  # what compiled runs with accumulation got before: the first gradient lost
        assert not torch.equal(engine.param.grad, torch.full((3,), 3.0))


def test_compile_layers_names_the_parameters_cuda_graphs_write_only_under_reduce_overhead() -> None:
    """``compile_layers`` returns the compiled modules' parameters (the RMSNorm gains, each MoE layer's router
    and experts) under "reduce-overhead", the mode whose backward graphs own the gradients, and none otherwise."""
    from model.modeling import RMSNorm
    from pretrain.train import compile_layers

    def model() -> HybridForCausalLM:
        m = HybridForCausalLM(config_for("tiny", num_hidden_layers=2))
        install_deepspeed_moe(m)
        return m

    m = model()
    expected = {id(p) for mod in m.modules() if isinstance(mod, RMSNorm | DeepSpeedMoEFeedForward)
                for p in mod.parameters()}
    params = compile_layers(m, mode="reduce-overhead")
    assert {id(p) for p in params} == expected and len(params) == len(expected)
    moe = [mod for mod in m.modules() if isinstance(mod, DeepSpeedMoEFeedForward)]
    assert len(moe) == 2 and all(id(p) in expected for mod in moe for p in mod.parameters())
    assert id(m.get_input_embeddings().weight) not in expected  # eager modules' gradients are autograd's own
    assert compile_layers(model(), mode="default") == []


class _Recorder:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def on_fit_start(self, trainer: object) -> None:
        self.calls.append(f"{self.name}.fit_start")

    def on_step(self, trainer: object, result: object) -> None:
        self.calls.append(f"{self.name}.step{result.step}")

    def on_log(self, trainer: object, metrics: dict) -> None:
        self.calls.append(f"{self.name}.log{trainer.state.step}:{sorted(metrics)}")
        metrics[self.name] = trainer.state.step

    def on_step_end(self, trainer: object, result: object) -> None:
        self.calls.append(f"{self.name}.end{result.step}")

    def on_fit_end(self, trainer: object) -> None:
        self.calls.append(f"{self.name}.fit_end")


def test_trainer_calls_its_callbacks_in_list_order_around_every_step_and_logs_every_log_every_steps() -> None:
    calls: list[str] = []
    trainer = _fake_trainer([_Recorder("a", calls), _Recorder("b", calls)], steps=3, log_every=2)
    trainer.fit()
    assert calls == [
        "a.fit_start", "b.fit_start",
        "a.step1", "b.step1", "a.end1", "b.end1",
        "a.step2", "b.step2", "a.log2:[]", "b.log2:['a']", "a.end2", "b.end2",  # b sees what a added
        "a.step3", "b.step3", "a.log3:[]", "b.log3:['a']", "a.end3", "b.end3",  # the last step is always logged
        "a.fit_end", "b.fit_end",
    ]
    assert (trainer.state.step, trainer.state.tokens_seen) == (3, 48)
    assert trainer.engine.forwards == 3


def test_a_callback_can_stop_training_after_its_step_and_the_run_still_ends_normally() -> None:
    from pretrain.trainer import Callback

    class StopAtTwo(Callback):
        def on_step(self, trainer: object, result: object) -> None:
            if result.step == 2:
                trainer.stop("enough")

    calls: list[str] = []
    trainer = _fake_trainer([StopAtTwo(), _Recorder("r", calls)], steps=10, log_every=5)
    trainer.fit()
    assert trainer.state.step == 2 and trainer.stop_reason == "enough"
    assert calls[-3:] == ["r.step2", "r.end2", "r.fit_end"]  # the step's callbacks ran, then the end of the fit


def test_divergence_guard_callback_stops_training_with_an_error_naming_the_checkpoints(tmp_path: Path) -> None:
    from pretrain.callbacks import DivergenceGuardCallback
    from pretrain.grad_guard import DivergenceError

    trainer = _fake_trainer([DivergenceGuardCallback(2, 10.0, tmp_path / "ckpt")], steps=10)
    trainer.optimizer.overflow = True  # every step skipped, as DeepSpeed reports a non-finite gradient
    with pytest.raises(DivergenceError, match=r"2 optimizer steps in a row were skipped .* at step 2; the last valid "
                                              rf"checkpoint is in {tmp_path / 'ckpt'}"):
        trainer.fit()
    assert trainer.state.step == 2 and trainer.guard.skipped == 2


class _SaveRecorder:
    """Stands in for the DeepSpeed Checkpointer (tests/test_pretrain's real-stage tests save real ones): the step
    of every save."""

    def __init__(self) -> None:
        self.saved: list[int] = []

    def save(self, trainer: object) -> None:
        self.saved.append(trainer.state.step)


@pytest.mark.parametrize(("every", "resumed", "saved"), [
    (2, False, [0, 2, 4, 5]),  # before the first step, every 2, and at the end
    (2, True, [2, 4, 5]),      # a resumed run has its checkpoint already
    (0, False, []),               # checkpoint_every 0: none at all
])
def test_checkpoint_callback_saves_before_the_first_step_every_n_and_at_the_end_or_never_with_zero(
        every: int, resumed: bool, saved: list[int]) -> None:
    from pretrain.callbacks import CheckpointCallback

    recorder = _SaveRecorder()
    trainer = _fake_trainer([CheckpointCallback(recorder, every)], steps=5, log_every=1)
    trainer.resumed = resumed
    trainer.fit()
    assert trainer.state.step == 5 and recorder.saved == saved


def test_checkpoint_every_zero_is_valid_and_other_values_must_be_multiples_of_log_every() -> None:
    from pretrain.stage import PretrainParams

    assert not [p for p in PretrainParams(checkpoint_every=0, log_every=10).training_problems() if "checkpoint" in p]
    with pytest.raises(ValueError, match="checkpoint_every=15 must be a multiple of log_every=10"):
        PretrainParams(checkpoint_every=15, log_every=10)
    with pytest.raises(ValueError, match="checkpoint_every"):
        PretrainParams(checkpoint_every=-1)


def test_divergence_guard_without_checkpoints_says_a_rerun_starts_over() -> None:
    from pretrain.callbacks import DivergenceGuardCallback
    from pretrain.grad_guard import DivergenceError

    trainer = _fake_trainer([DivergenceGuardCallback(2, 10.0, None)], steps=10)
    trainer.optimizer.overflow = True
    with pytest.raises(DivergenceError, match=r"keeps no checkpoints \(checkpoint_every 0\): rerunning with the same "
                                              r"params starts over from the first step"):
        trainer.fit()


def test_throughput_callback_says_when_a_window_compiled_graphs_and_is_quiet_otherwise(capsys, tmp_path: Path) -> None:
    """The cold start of a GPU pretrain (issue 33: 260 s in the first window with softmax layers) is shown as what
    torch.compile did in it; a window that compiled nothing adds no line."""
    from pretrain.callbacks import ThroughputCallback
    from pretrain.events import parse
    from pretrain.trainer import Callback

    class CompileAtStep3(Callback):
        def on_step(self, trainer: object, result: object) -> None:
            if result.step == 3:
                torch.compile(lambda x: torch.sin(x) * 2 + result.step, backend="eager")(torch.ones(3))

    import torch.distributed as dist

    trainer = _fake_trainer([CompileAtStep3(), ThroughputCallback()], steps=6, log_every=2)
    capsys.readouterr()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)  # its all-reduce
    try:
        trainer.fit()
    finally:
        dist.destroy_process_group()
    events = [e for e in map(parse, capsys.readouterr().out.splitlines()) if e and e["kind"] == "progress"]
    assert len(events) == 1, events  # the window of steps 3-4 alone
    assert re.fullmatch(r"torch\.compile: \d+ graph\(s\) so far \(\+1 in this window\), [0-9.]+ s in Dynamo frames, "
                        r"[0-9.]+ s compiling backward graphs",
                        events[0]["message"]), events


def test_batch_size_schedule_callback_feeds_only_accepted_steps_and_the_next_batch_reads_it() -> None:
    from pretrain.callbacks import BatchSizeScheduleCallback
    from pretrain.schedules import BatchSizeSchedule

    trainer = _fake_trainer([BatchSizeScheduleCallback()], steps=6)
    trainer.batch_schedule = BatchSizeSchedule(1, 2, double_at_tokens=[32])
    trainer.fit()
    # two steps of one 16-token row reach 32 tokens; then two rows a step (two micro-batches)
    assert trainer.engine.forwards == 2 + 2 * 2 and trainer.state.tokens_seen == 96
