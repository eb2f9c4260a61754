"""Sequence parallelism (pretrain/sequence_parallel.py; MiniMax-01 §3.2.2 LASP+, §3.2.1): every rank's part equals
the single-process computation on the whole row, over real gloo process groups of 2 and 3 ranks on 127.0.0.1.

One spawn of 3 ranks runs every case (``_worker``), on the world and on a 2-rank subgroup, and saves per-rank
numbers; the tests read them. The
references are the repo's single-process kernels and model on the full row, in float64.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch

# (world, tokens per rank, packed document starts for the lightning/softmax op cases): documents cross rank
# boundaries, one spans a whole rank (world 3: 10..60 covers rank 1's 24..48), one starts exactly at a boundary
OP_CASES = {2: (24, (0, 5, 30)), 3: (24, (0, 10, 48, 50, 66))}
HEADS, KV_HEADS, DK, DV, BLOCK = 4, 2, 8, 6, 16
MODEL_TOKENS, MODEL_DOC_STARTS = 96, (0, 20, 70)  # 2 ranks x 48: document 20..70 crosses the boundary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _op_inputs(total: int, batch: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + total + batch)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "q": rnd(batch, HEADS, total, DK).sigmoid(), "k": rnd(batch, HEADS, total, DK).sigmoid(),
        "v": rnd(batch, HEADS, total, DV), "s0": rnd(batch, HEADS, DK, DV), "g": rnd(batch, HEADS, total, DV),
        "sq": rnd(batch, HEADS, total, DK), "sk": rnd(batch, KV_HEADS, total, DK),
        "sv": rnd(batch, KV_HEADS, total, DK), "sg": rnd(batch, HEADS, total, DK),
    }  # fmt: skip


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max())


def _lightning_case(rank: int, world: int, group, batch: int, doc_starts: tuple, with_s0: bool) -> dict:  # noqa: ANN001
    from kernels.lightning import lightning_attention, lightning_decay_rates
    from pretrain.sequence_parallel import CommCounter, ShardLayout, lasp_lightning_attention

    length = OP_CASES[world][0]
    total = world * length
    x = _op_inputs(total, batch)
    rates = lightning_decay_rates(HEADS, 1, 4)
    cu = torch.tensor([*doc_starts, total], dtype=torch.int32) if doc_starts else None
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "s0")}
    ref_o, ref_final = lightning_attention(
        leaves["q"], leaves["k"], leaves["v"], rates, block_size=BLOCK, cu_seqlens=cu, impl="chunk",
        initial_state=leaves["s0"] if with_s0 else None, output_final_state=cu is None,
    )  # fmt: skip
    (ref_o * x["g"]).sum().backward()

    shard = ShardLayout(rank, world, length, doc_starts)
    sl = slice(shard.offset, shard.offset + length)
    mine = {n: x[n][:, :, sl].clone().requires_grad_() for n in ("q", "k", "v")}
    s0 = x["s0"].clone().requires_grad_()
    counter = CommCounter()
    o, final = lasp_lightning_attention(
        mine["q"], mine["k"], mine["v"], rates, shard, group, block_size=BLOCK, counter=counter,
        initial_state=s0 if with_s0 else None, output_final_state=True, impl="chunk",
    )  # fmt: skip
    (o * x["g"][:, :, sl]).sum().backward()
    res = {"o": _max_err(o, ref_o[:, :, sl])}
    for n in ("q", "k", "v"):
        res[f"d{n}"] = _max_err(mine[n].grad, leaves[n].grad[:, :, sl])
    if with_s0:  # every rank's share of the initial state's gradient, summed, is the full one
        torch.distributed.all_reduce(s0.grad, group=group)
        res["ds0"] = _max_err(s0.grad, leaves["s0"].grad)
    if cu is None and rank == world - 1:
        res["final"] = _max_err(final, ref_final)
    res["bytes"] = counter.total()
    res["bytes_formula"] = 2 * world * batch * HEADS * DK * DV * 8  # gather forward + reduce backward, fp64
    res["calls"] = [c[1] for c in counter.calls]
    return res


def _softmax_case(rank: int, world: int, group, batch: int, doc_starts: tuple) -> dict:  # noqa: ANN001
    import torch.nn.functional as F

    from kernels.softmax_varlen import document_causal_attention_reference
    from pretrain.sequence_parallel import CommCounter, ShardLayout, sequence_parallel_softmax_attention

    length = OP_CASES[world][0]
    total = world * length
    x = _op_inputs(total, batch)
    leaves = {n: x[n].clone().requires_grad_() for n in ("sq", "sk", "sv")}
    if doc_starts:
        cu = torch.tensor([*doc_starts, total], dtype=torch.int32)
        ref = document_causal_attention_reference(leaves["sq"], leaves["sk"], leaves["sv"], cu, enable_gqa=True)
    else:
        ref = F.scaled_dot_product_attention(leaves["sq"], leaves["sk"], leaves["sv"], is_causal=True,
                                             enable_gqa=True)  # fmt: skip
    (ref * x["sg"]).sum().backward()
    shard = ShardLayout(rank, world, length, doc_starts)
    sl = slice(shard.offset, shard.offset + length)
    mine = {n: x[n][:, :, sl].clone().requires_grad_() for n in ("sq", "sk", "sv")}
    counter = CommCounter()
    o = sequence_parallel_softmax_attention(mine["sq"], mine["sk"], mine["sv"], shard, group, enable_gqa=True,
                                            counter=counter)  # fmt: skip
    (o * x["sg"][:, :, sl]).sum().backward()
    res = {"o": _max_err(o, ref[:, :, sl])}
    for n in ("sq", "sk", "sv"):
        res[f"d{n}"] = _max_err(mine[n].grad, leaves[n].grad[:, :, sl])
    res["bytes"] = counter.total()
    res["bytes_formula"] = 4 * total * batch * KV_HEADS * DK * 8  # K and V, forward and backward, fp64
    return res


def _tiny_model():  # noqa: ANN202
    from model import HybridForCausalLM, config_for

    torch.manual_seed(0)
    # dropless: token-drop capacity is per rank under SP (as under data parallelism), see the module docstring
    config = config_for("tiny", moe_token_drop=False, router_aux_loss_coef=0.01)
    return HybridForCausalLM(config).double().train()


def _model_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 512, (1, MODEL_TOKENS), generator=g)
    labels = ids.clone()
    labels[0, [19, 69, 95]] = -100  # as make_batch: no loss on a document's last token
    cu = torch.tensor([*MODEL_DOC_STARTS, MODEL_TOKENS], dtype=torch.int32)
    return ids, labels, cu


def _model_case(rank: int, world: int, group) -> dict:  # noqa: ANN001
    import copy

    import torch.nn.functional as F

    from pretrain.sequence_parallel import (
        apply_sequence_parallel,
        expected_step_bytes,
        sequence_parallel_loss,
        shard_batch,
    )

    ids, labels, cu = _model_batch()
    ref_model = _tiny_model()
    sp_model = copy.deepcopy(ref_model)
    # the single-process reference: the whole row, loss in float64 by hand (HF's loss casts logits to float32)
    out = ref_model(input_ids=ids, cu_seqlens=cu, use_cache=False)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    ref_loss = F.cross_entropy(out.logits[0], shifted[0], ignore_index=-100) + 0.01 * out.aux_loss
    ref_loss.backward()

    sp = apply_sequence_parallel(sp_model, group)
    shard = shard_batch(ids, labels, None, cu, rank, world)
    loss = sequence_parallel_loss(sp_model, sp, shard)
    loss.backward()
    measured = sp.counter.total()
    by_what = {w: sp.counter.total(w) for w in ("lightning_state", "softmax_kv", "moe_aux")}
    total_loss = loss.detach().clone()
    torch.distributed.all_reduce(total_loss, group=group)
    worst = 0.0
    ref_params = dict(ref_model.named_parameters())
    for name, p in sp_model.named_parameters():
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        ref = ref_params[name].grad
        worst = max(worst, _max_err(grad, ref) / max(float(ref.abs().max()), 1e-30))
    try:
        sp_model(input_ids=shard.input_ids, cu_seqlens=shard.cu_seqlens)
        outside = "no error"
    except RuntimeError as err:
        outside = str(err)
    return {
        "loss": float(total_loss), "ref_loss": float(ref_loss.detach()), "grad_rel": worst, "bytes": measured,
        "by_what": by_what, "formula": expected_step_bytes(sp_model.config, shard.layout, 1, torch.float64),
        "outside": outside, "local_cu": shard.cu_seqlens.tolist(), "positions": shard.position_ids[0, :3].tolist(),
    }  # fmt: skip


def _cases(rank: int, world: int, group) -> dict:  # noqa: ANN001
    starts = OP_CASES[world][1]
    res = {
        "lightning_rows": _lightning_case(rank, world, group, 2, (), with_s0=False),
        "lightning_rows_s0": _lightning_case(rank, world, group, 2, (), with_s0=True),
        "lightning_packed": _lightning_case(rank, world, group, 1, starts, with_s0=False),
        "softmax_rows": _softmax_case(rank, world, group, 2, ()),
        "softmax_packed": _softmax_case(rank, world, group, 1, starts),
    }
    if world == 2:
        res["model"] = _model_case(rank, world, group)
    return res


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """World 3 runs the op cases on the default group, then ranks 0 and 1 run every case on a group of their own
    (a non-default group, as under data x sequence parallelism) while rank 2 waits."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = {3: _cases(rank, 3, None)}
        pair = torch.distributed.new_group([0, 1])
        if rank < 2:
            res[2] = _cases(rank, 2, pair)
        torch.save(res, Path(out_dir) / f"rank{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("sp")
    procs = mp.spawn(_worker, args=(3, _free_port(), str(out)), nprocs=3, join=False)
    deadline = time.monotonic() + 240  # a mismatched collective would hang: fail instead
    while not procs.join(timeout=1):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("the 3 sequence-parallel ranks did not finish within 240 s (a hung collective?)")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(3)]


@pytest.fixture(params=[2, 3], ids=["world2", "world3"])
def results(request: pytest.FixtureRequest, spawned: list[dict]) -> list[dict]:
    """Per rank of a group of ``world``: that rank's numbers."""
    return [spawned[r][request.param] for r in range(request.param)]


TOL = 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("case", ["lightning_rows", "lightning_rows_s0", "lightning_packed"])
def test_lasp_lightning_output_and_qkv_grads_equal_the_single_process_kernel(results: list[dict], case: str):
    for rank, res in enumerate(r[case] for r in results):
        for key in ("o", "dq", "dk", "dv", "ds0", "final"):
            if key in res:
                assert res[key] < TOL, f"rank {rank} {case} {key}: max error {res[key]:.3e}"
    assert "ds0" in results[0]["lightning_rows_s0"] and "final" in results[-1]["lightning_rows_s0"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["softmax_rows", "softmax_packed"])
def test_sp_softmax_output_and_qkv_grads_equal_the_single_process_attention(results: list[dict], case: str):
    for rank, res in enumerate(r[case] for r in results):
        for key in ("o", "dsq", "dsk", "dsv"):
            assert res[key] < TOL, f"rank {rank} {case} {key}: max error {res[key]:.3e}"


@pytest.mark.slow
def test_communication_bytes_of_the_ops_equal_the_formula(results: list[dict]):
    world = len(results)
    for res in results:
        for case in ("lightning_rows", "lightning_rows_s0", "softmax_rows"):
            assert res[case]["bytes"] == res[case]["bytes_formula"], case
        assert res["lightning_rows"]["calls"] == ["all_gather", "reduce_scatter"]  # ONE gather per layer
        # by hand: world 2 -> 2 * 2 ranks * B 2 * H 4 * 8 * 6 * 8 bytes = 12288 (independent of the 24 tokens)
        assert res["lightning_rows"]["bytes"] == {2: 12288, 3: 18432}[world]
        assert res["lightning_packed"]["bytes"] == res["lightning_rows"]["bytes"] // 2  # B = 1


@pytest.mark.slow
def test_tiny_hybrid_loss_and_every_grad_on_two_ranks_equal_one_process(spawned: list[dict]):
    results = [spawned[r][2] for r in range(2)]
    for rank, res in enumerate(r["model"] for r in results):
        m = res
        assert abs(m["loss"] - m["ref_loss"]) < 1e-12, (rank, m["loss"], m["ref_loss"])
        assert m["grad_rel"] < 1e-10, (rank, m["grad_rel"])
        assert "outside `with sp.batch" in m["outside"]
    # rank 1 holds tokens 48..95: document 20..70 continues into it (positions 28, 29, ...), 70 starts one
    assert results[1]["model"]["local_cu"] == [0, 22, 48]
    assert results[1]["model"]["positions"] == [28, 29, 30]


@pytest.mark.slow
def test_model_communication_bytes_equal_the_formula_by_hand(spawned: list[dict]):
    results = [spawned[r][2] for r in range(2)]
    # tiny: 8 layers (7 lightning, 1 softmax), H 4, d 16, H_kv 2, E 4; float64; P 2, N 96
    by_hand = {
        "lightning_state": 7 * 2 * 2 * 1 * 4 * 16 * 16 * 8,  # 114688: O(d^2), not O(N)
        "softmax_kv": 1 * 4 * 96 * 1 * 2 * 16 * 8,  # 98304: K and V of all N tokens, forward and backward
        "moe_aux": 8 * 2 * (2 * 4 + 1) * 8,  # 1152
    }
    for res in (r["model"] for r in results):
        assert res["by_what"] == by_hand == res["formula"]
        assert res["bytes"] == sum(by_hand.values())


# --- the bookkeeping, in one process ------------------------------------------------------------------------


def test_shard_batch_shifts_labels_globally_and_keeps_document_positions():
    from pretrain.sequence_parallel import shard_batch

    ids = torch.arange(10, 18)[None]  # 8 tokens, documents [0, 3) and [3, 8), 2 ranks of 4
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    r0, r1 = (shard_batch(ids, ids.clone(), None, cu, r, 2) for r in (0, 1))
    assert r0.shifted_labels.tolist() == [[11, 12, 13, 14]]  # rank 0's last label is rank 1's first token
    assert r1.shifted_labels.tolist() == [[15, 16, 17, -100]]
    assert r0.position_ids.tolist() == [[0, 1, 2, 0]] and r1.position_ids.tolist() == [[1, 2, 3, 4]]
    assert r0.cu_seqlens.tolist() == [0, 3, 4] and r1.cu_seqlens.tolist() == [0, 4]
    assert r0.num_label_tokens == r1.num_label_tokens == 7
    with pytest.raises(ValueError, match="not divisible by the 3 sequence-parallel ranks"):
        shard_batch(ids, ids, None, cu, 0, 3)


def test_lasp_prefix_reaches_back_to_the_last_rank_with_a_document_start():
    from pretrain.sequence_parallel import ShardLayout, _prefix_hops

    # 4 ranks of 10 tokens, documents start at 0, 5 and 32: the document 5..32 crosses ranks 1 and 2
    layouts = [ShardLayout(r, 4, 10, (0, 5, 32)) for r in range(4)]
    assert [_prefix_hops(s) for s in layouts] == [[-1, -1, -1, -1], [0, -1, -1, -1], [1, 0, -1, -1], [2, 1, 0, -1]]
    assert [s.local_bounds() for s in layouts] == [[0, 5, 10], [0, 10], [0, 10], [0, 2, 10]]
    assert _prefix_hops(ShardLayout(2, 4, 10, (0, 20))) == [-1, -1, -1, -1]  # rank 2 starts a document
    assert _prefix_hops(ShardLayout(3, 4, 10)) == [2, 1, 0, -1]  # unpacked rows: every earlier rank
