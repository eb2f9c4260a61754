"""Fast generation (model/generation.py): ``HybridForCausalLM.generate`` over a preallocated cache with a packed
prefill and a host-free decode step gives transformers' loop's tokens (greedy: identical in fp32; sampling: the same
warped distribution), stops per row at any eos, falls back to transformers' loop for what it does not implement, and
reuses its cache across calls without leaking state. CPU only (no CUDA graphs here; bench/bench_decode_gpu.py checks
the graph and compiled steps on a GPU)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from model.cache import StaticHybridCache
from model.generation import (
    COMPILED_REUSE_FACTOR,
    ENGINES_KEPT,
    DecodeEngine,
    GenerationSpec,
    batch_bucket,
    choose_bucket,
    collector_paused,
    engines_of,
    next_tokens,
    release_engines,
)
from model.modeling import HybridForCausalLM
from model.sizes import config_for
from tests.test_model_moe import _SYNCING_OPS, _RecordOps

PATTERNS = {
    "hybrid": ["lightning", "softmax", "lightning", "lightning"],
    "all-lightning": "all-lightning",
    "all-softmax": "all-softmax",
}
PAD, EOS = 2, 1


def _model(pattern="hybrid", seed=0, dtype=torch.float32) -> HybridForCausalLM:
    torch.manual_seed(seed)
    cfg = config_for("tiny", num_hidden_layers=4, attention_pattern=PATTERNS[pattern], lightning_block_size=16,
                     pad_token_id=PAD, eos_token_id=EOS, bos_token_id=0)  # fmt: skip
    return HybridForCausalLM(cfg).to(dtype).eval()


def _left_padded(lengths, seed=0, side="left"):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, cols] = torch.randint(3, 512, (n,), generator=g)
        mask[i, cols] = 1
    return ids, mask


def _both(model, ids, mask, **kw):
    """(fast path's ids, transformers' loop's ids); the fast call's statistics stay in ``model.fast_stats``."""
    fast = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert model.last_generation_refusal is None
    model.fast_stats = model.last_generation_stats
    slow = model.generate(input_ids=ids, attention_mask=mask, fast_decode=False, **kw)
    assert model.last_generation_stats is None  # transformers' loop leaves no statistics
    return fast, slow


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_greedy_tokens_equal_transformers_loop_on_a_left_padded_batch(pattern):
    model = _model(pattern)
    ids, mask = _left_padded([13, 5, 9, 1])
    fast, slow = _both(model, ids, mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert fast.shape == slow.shape == (4, 13 + 24)
    assert torch.equal(fast, slow)


def test_greedy_tokens_of_a_trained_model_equal_transformers_loop():
    """A model trained to continue a pattern (confident logits, unlike a random model's near-ties)."""
    model = _model("hybrid").train()
    period = torch.tensor([5, 9, 17, 33, 65, 129, 257])
    data = period.repeat(20)[None].expand(8, -1).clone()
    for row in range(8):
        data[row] = data[row].roll(row)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        loss = model(input_ids=data, labels=data).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    prompts = [data[0, :10], data[3, :4], data[5, :15]]
    ids = torch.full((3, 15), PAD)
    mask = torch.zeros(3, 15, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 15 - len(p):], mask[i, 15 - len(p):] = p, 1
    fast, slow = _both(model, ids, mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert torch.equal(fast, slow)
    # it learned the pattern: the continuation follows the period
    nxt = {int(a): int(b) for a, b in zip(period, period.roll(-1), strict=True)}
    assert all(nxt[int(a)] == int(b) for a, b in zip(fast[0, 14:-1], fast[0, 15:], strict=True))


@pytest.mark.parametrize("min_new", [0, 12])
def test_eos_mid_batch_pads_finished_rows_and_stops_like_transformers(min_new):
    model = _model("hybrid")
    ids, mask = _left_padded([7, 12, 3, 9], seed=1)
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                          pad_token_id=PAD, eos_token_id=None)
    eos = [int(free[0, 12 + 4]), int(free[2, 12 + 8])]  # tokens rows 0 and 2 emit early on
    fast, slow = _both(model, ids, mask, max_new_tokens=30, min_new_tokens=min_new, do_sample=False,
                       pad_token_id=PAD, eos_token_id=eos)
    assert fast.shape == slow.shape and torch.equal(fast, slow)
    new = fast[:, 12:]
    for row in new:  # after a row's first eos (at or past min_new_tokens) only pad follows
        hits = [j for j, t in enumerate(row.tolist()) if t in eos and j >= min_new]
        if hits:
            assert (row[hits[0] + 1:] == PAD).all()
    stats = model.fast_stats
    ends = []
    for row in new.tolist():
        hit = next((j for j, t in enumerate(row) if t in eos and j >= min_new), None)
        ends.append(len(row) if hit is None else hit + 1)
    assert stats.steps == new.shape[1] and stats.new_tokens == sum(ends)
    assert stats.padding_waste == pytest.approx(1 - sum(ends) / (4 * new.shape[1]))


def test_right_padding_is_packed_like_left_padding():
    model = _model("hybrid")
    lengths = [6, 11, 2]
    left, lmask = _left_padded(lengths, seed=3, side="left")
    right, rmask = _left_padded(lengths, seed=3, side="right")
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    a = model.generate(input_ids=left, attention_mask=lmask, **kw)
    b = model.generate(input_ids=right, attention_mask=rmask, **kw)
    assert torch.equal(a[:, 11:], b[:, 11:])


def test_sampling_draws_the_same_tokens_as_transformers_loop_on_cpu():
    """torch.multinomial(p, 1) draws argmax(p / Exp(1)) on CPU, the trick next_tokens uses: one seed, one draw, when
    the batch fills its bucket (padding rows draw noise too and would shift the stream). In float64, so that
    packing's rounding (~1e-7 in fp32) cannot flip a near-tie of p_i / E_i."""
    model = _model("hybrid", dtype=torch.float64)
    ids, mask = _left_padded([8, 8, 3, 6], seed=4)
    runs = []
    for fast in (True, False):
        torch.manual_seed(7)
        runs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=40,
                                   top_p=0.9, temperature=1.3, pad_token_id=PAD, eos_token_id=None,
                                   fast_decode=fast))
    assert torch.equal(runs[0], runs[1])


def test_next_tokens_sample_the_distribution_of_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -0.5, -3.0]])
    spec = GenerationSpec(max_new_tokens=1, do_sample=True, temperature=0.7, top_k=4, top_p=0.8)
    warped = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(4), TopPLogitsWarper(0.8)):
        warped = warper(None, warped)
    expected = warped.softmax(-1)[0]
    n = 40_000
    draws = next_tokens(logits.expand(n, -1), spec, torch.zeros(1, dtype=torch.long), None)
    freq = torch.bincount(draws, minlength=6).double() / n
    assert (freq[expected == 0] == 0).all()  # tokens the warpers remove are never drawn
    torch.testing.assert_close(freq, expected.double(), atol=0.01, rtol=0)


def test_min_new_tokens_masks_every_eos_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # token 1 (an eos) is the argmax
    spec = GenerationSpec(max_new_tokens=5, min_new_tokens=2, eos=(1, 2))
    eos = torch.tensor([1, 2])
    early = next_tokens(logits, spec, torch.tensor([1]), eos)
    late = next_tokens(logits, spec, torch.tensor([2]), eos)
    assert early.tolist() == [3] and late.tolist() == [1]


def test_calls_only_transformers_loop_implements_fall_back_and_say_why():
    model = _model("hybrid")
    ids, mask = _left_padded([6, 4], seed=5)
    beams = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False,
                           pad_token_id=PAD)
    assert "num_beams" in model.last_generation_refusal and beams.shape == (2, 10)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, repetition_penalty=1.3,
                         pad_token_id=PAD)
    assert "repetition_penalty" in model.last_generation_refusal and out.shape == (2, 10)
    scored = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, output_scores=True,
                            return_dict_in_generate=True, pad_token_id=PAD)
    assert model.last_generation_refusal and len(scored.scores) == 4
    holes = mask.clone()
    holes[0, -3] = 0
    model.generate(input_ids=ids, attention_mask=holes, max_new_tokens=2, pad_token_id=PAD)
    assert "contiguous" in model.last_generation_refusal


def test_trl_grpo_generation_config_is_served():
    """TRL's GRPOTrainer (no vLLM) calls generate(input_ids, attention_mask, generation_config=...) with this."""
    model = _model("hybrid")
    cfg = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=PAD, bos_token_id=0, eos_token_id=[EOS],
                           temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                           cache_implementation=None, disable_compile=True)
    ids, mask = _left_padded([5, 3])
    spec, why = GenerationSpec.resolve(model, ids, cfg, {"attention_mask": mask})
    assert why is None and spec.do_sample and spec.eos == (EOS,) and spec.max_new_tokens == 8
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    assert model.last_generation_refusal is None and out.shape[0] == 2


def test_num_return_sequences_repeats_each_prompt_in_consecutive_rows():
    model = _model("hybrid")
    ids, mask = _left_padded([5, 8], seed=6)
    torch.manual_seed(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                         num_return_sequences=3, pad_token_id=PAD, eos_token_id=None)
    assert out.shape == (6, 8 + 12)
    assert torch.equal(out[:3, :8], ids[0].expand(3, -1)) and torch.equal(out[3:, :8], ids[1].expand(3, -1))
    assert len({tuple(r) for r in out[:3, 8:].tolist()}) > 1  # the copies sample independently


def test_the_decode_step_runs_no_op_that_waits_for_the_host():
    model = _model("hybrid")
    spec = GenerationSpec(max_new_tokens=16, pad=PAD, eos=(EOS,), min_new_tokens=3, do_sample=True, top_k=5,
                          top_p=0.9, temperature=0.8)
    with torch.inference_mode():
        engine = DecodeEngine(model, 4, 64, spec, cuda_graph=False)
        engine.prefill([torch.randint(3, 512, (n,)) for n in (3, 9, 5)])
        with _RecordOps() as step:
            engine._step()
    assert step.ops and not step.ops & _SYNCING_OPS, step.ops & _SYNCING_OPS


def test_the_cache_is_reused_across_calls_and_leaks_nothing_between_them():
    model = _model("hybrid")
    kw = dict(max_new_tokens=9, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    a_ids, a_mask = _left_padded([7, 3, 5], seed=8)
    b_ids, b_mask = _left_padded([2, 6, 4], seed=9)
    first = model.generate(input_ids=a_ids, attention_mask=a_mask, **kw)
    engine = next(iter(engines_of(model).values()))
    model.generate(input_ids=b_ids, attention_mask=b_mask, **kw)  # 3 rows again: the same bucket of 4, reused
    assert len(engines_of(model)) == 1 and next(iter(engines_of(model).values())) is engine
    again = model.generate(input_ids=a_ids, attention_mask=a_mask, **kw)
    assert torch.equal(first, again)
    model.double()  # parameters moved: a new engine over the new storage
    model.generate(input_ids=a_ids, attention_mask=a_mask, **kw)
    assert next(iter(engines_of(model).values())) is not engine
    copy.deepcopy(model)  # the engines live beside the model: copying it copies no cache or graph


def test_an_evicted_engine_is_freed_when_dropped_not_at_a_later_collection():
    """The twelfth lease's GRPO failure (bench/check_capture_gc.py reproduced it on an H200): an evicted engine held
    itself through its step function, so its CUDA graph was destroyed whenever Python's cyclic collector next ran,
    which could be inside the next engine's capture. Evicted or released engines now free by reference count."""
    model = _model("hybrid")
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    was = gc.isenabled()
    gc.disable()  # only reference counts free anything in here
    try:
        refs = []
        for i in range(ENGINES_KEPT + 2):  # each call a new capacity (CAPACITY_ROUND apart): a new engine
            ids = torch.randint(3, 512, (2, 8 + 256 * i))
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
            refs.append(weakref.ref(next(iter(engines_of(model).values()))))
        alive = [r() is not None for r in refs]
        assert alive == [False] * 2 + [True] * ENGINES_KEPT, alive
        release_engines(model)  # and the kept ones go with release_engines, at once
        assert all(r() is None for r in refs) and not engines_of(model)
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("compile_step", [False, True])
def test_engines_hold_no_reference_to_themselves_so_a_deleted_models_engines_go_with_it(compile_step):
    """No cycle through an engine (its compiled step is one module-level function): what drops the last reference
    to an engine frees it, its cache and its graph at once, without the cyclic collector."""
    model = _model("hybrid")
    spec = GenerationSpec(max_new_tokens=4, pad=PAD)
    was = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode():
            engine = DecodeEngine(model, 2, 32, spec, cuda_graph=False, compile=compile_step)
        ref = weakref.ref(engine)
        del engine
        assert ref() is None
        ids = torch.randint(3, 512, (2, 8))
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                       pad_token_id=PAD, eos_token_id=None)
        kept = weakref.ref(next(iter(engines_of(model).values())))
        del model  # the model goes, and its engines with it
        assert kept() is None
    finally:
        if was:
            gc.enable()


def test_a_released_engine_refuses_to_step():
    model = _model("hybrid")
    with torch.inference_mode():
        engine = DecodeEngine(model, 2, 32, GenerationSpec(max_new_tokens=4, pad=PAD), cuda_graph=False)
        engine.prefill([torch.randint(3, 512, (5,)), torch.randint(3, 512, (3,))])
        engine.release()
        with pytest.raises(RuntimeError, match="was released"):
            engine.decode(2)


def test_the_collector_is_paused_inside_the_block_and_restored_after():
    was = gc.isenabled()
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            with collector_paused():
                assert not gc.isenabled()
            assert gc.isenabled() is before
            with pytest.raises(RuntimeError), collector_paused():  # restored on an error too
                raise RuntimeError("inside")
            assert gc.isenabled() is before
    finally:
        (gc.enable if was else gc.disable)()


def test_packed_prefill_fills_the_static_cache_like_a_plain_forward():
    model = _model("hybrid", dtype=torch.float64)
    prompts = [torch.randint(3, 512, (n,)) for n in (9, 4, 13)]
    cache = StaticHybridCache(model.config, 4, 32, "cpu", torch.float64)
    cache.begin_prefill([len(p) for p in prompts])
    cu = torch.tensor([0, 9, 13, 26], dtype=torch.int32)
    with torch.no_grad():
        out = model(input_ids=torch.cat(prompts)[None], cu_seqlens=cu, past_key_values=cache, use_cache=True,
                    logits_to_keep=torch.tensor([8, 12, 25]))
        for i, p in enumerate(prompts):
            ref = model(input_ids=p[None], use_cache=True)
            torch.testing.assert_close(out.logits[0, i], ref.logits[0, -1], rtol=1e-9, atol=1e-9)
            for layer, state in ref.past_key_values.lightning_states.items():
                torch.testing.assert_close(cache.lightning_states[layer][i], state[0], rtol=1e-9, atol=1e-12)
            keys = ref.past_key_values.keys[1][0]  # [H_kv, n, D]
            torch.testing.assert_close(cache.keys[1][i, :, : len(p)], keys, rtol=1e-12, atol=1e-13)
    assert cache.lengths.tolist() == [9, 4, 13, 0]
    assert (cache.lightning_states[0][3] == 0).all()  # a row past the prompts starts empty


def test_generated_ids_can_feed_a_training_forward():
    """Rollouts feed the policy's loss (GRPO): the returned tensor must not be an inference tensor."""
    model = _model("hybrid")
    ids, mask = _left_padded([4, 6], seed=10)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, pad_token_id=PAD)
    assert not out.is_inference()
    model.train()
    loss = model(input_ids=out, labels=out).loss
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_batches_are_bucketed_to_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 32, 33, 256)] == [1, 2, 4, 8, 32, 64, 256]


def test_a_small_batch_reuses_a_compiled_larger_bucket_within_the_factor():
    """A compile costs tens of seconds a bucket: a ragged last batch decodes in a compiled larger bucket (up to
    COMPILED_REUSE_FACTOR times its own), the smallest that holds it; nothing compiled, its own bucket."""
    assert [choose_bucket(n) for n in (1, 8, 33)] == [1, 8, 64]
    assert choose_bucket(8, {64}) == 64 and choose_bucket(8, {64, 16}) == 16
    assert choose_bucket(8, {8 * COMPILED_REUSE_FACTOR * 2}) == 8  # too large: its own bucket
    assert choose_bucket(100, {64}) == 128  # a compiled bucket too small to hold it is not used
    assert choose_bucket(1, {COMPILED_REUSE_FACTOR}) == COMPILED_REUSE_FACTOR


def test_generate_picks_a_compiled_bucket_for_a_ragged_batch(monkeypatch):
    """_engine reads the buckets compiled for this model: with compile on, a call of 3 rows after one of 8 runs in the
    8-row engine and gives the same tokens as its own 4-row engine (greedy); with compile off buckets stay its own."""
    import model.generation as gen

    model = _model("hybrid")
    spec = GenerationSpec(max_new_tokens=6, pad=PAD)
    prompts8 = [torch.randint(3, 512, (n,)) for n in (5, 7, 3, 9, 4, 6, 8, 5)]
    monkeypatch.setattr(gen, "DecodeEngine", _EagerEngine)  # the CPU has no compile: record the bucket only
    with torch.inference_mode():
        assert gen._engine(model, 8, 32, spec, cuda_graph=False, compile=True).batch == 8
        assert gen._engine(model, 3, 32, spec, cuda_graph=False, compile=True).batch == 8
        assert gen._engine(model, 3, 32, spec, cuda_graph=False, compile=False).batch == 4
    outs = []
    for bucket in (4, 8):
        with torch.inference_mode():
            engine = DecodeEngine(model, bucket, 32, spec, cuda_graph=False)
            engine.prefill(prompts8[:3])
            engine.decode(spec.max_new_tokens - 1)
            outs.append(engine.out[:3, :spec.max_new_tokens].clone())
    assert torch.equal(outs[0], outs[1])  # the larger bucket decodes the same tokens


class _EagerEngine(DecodeEngine):
    def __init__(self, model, batch, capacity, spec, cuda_graph, compile=False):
        super().__init__(model, batch, capacity, spec, cuda_graph, compile=False)


def test_a_decode_step_reads_each_layers_projections_as_one_product_with_the_same_logits(monkeypatch):
    """The stacked projections (one matrix-vector product per attention layer) give the layers' own logits, and the
    step really reads them: a zeroed stack changes the logits."""
    model = _model("hybrid", dtype=torch.float64)
    prompts = [torch.randint(3, 512, (n,)) for n in (9, 4, 13)]
    spec = GenerationSpec(max_new_tokens=8, pad=PAD)
    logits = {}
    for stacked in ("1", "0"):
        monkeypatch.setenv("HYLIGHT_DECODE_STACKED", stacked)
        with torch.inference_mode():
            engine = DecodeEngine(model, 4, 32, spec, cuda_graph=False)
            assert bool(engine.cache.decode_proj) == (stacked == "1")
            engine.prefill(prompts)
            logits[stacked] = engine._logits()
    assert set(engine.cache.decode_proj) == set() and len(logits) == 2
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-10, atol=1e-10)
    monkeypatch.setenv("HYLIGHT_DECODE_STACKED", "1")
    with torch.inference_mode():
        engine = DecodeEngine(model, 4, 32, spec, cuda_graph=False)
        engine.prefill(prompts)
        for w in engine.cache.decode_proj.values():
            w.zero_()
        assert not torch.allclose(engine._logits(), logits["0"])


def test_a_model_trained_between_calls_decodes_with_its_new_weights():
    """The stacked projections are copies: each call reloads them, so a policy updated in place between two
    generate calls (GRPO, rejection sampling rounds) decodes with its new weights, as a fresh model would."""
    model = _model("hybrid")
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    ids, mask = _left_padded([7, 3, 5], seed=8)
    model.generate(input_ids=ids, attention_mask=mask, **kw)  # builds the engine and its stacked weights
    engine = next(iter(engines_of(model).values()))
    with torch.no_grad():  # an in-place update of every attention input projection (addresses unchanged)
        g = torch.Generator().manual_seed(3)
        for layer in model.model.layers:
            for w in layer.attn.decode_projection_weights():
                w.add_(torch.randn(w.shape, generator=g) * 0.5)
    after = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert next(iter(engines_of(model).values())) is engine  # the same engine served the second call
    fresh = copy.deepcopy(model)
    assert torch.equal(after, fresh.generate(input_ids=ids, attention_mask=mask, fast_decode=False, **kw))


def test_the_small_batch_router_reduction_equals_the_gate_product():
    from model.moe import router_logits_by_reduction

    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(3, 256, generator=g).to(dtype)
        w = (torch.randn(8, 256, generator=g) / 16).to(dtype)
        ours = router_logits_by_reduction(x, w)
        assert ours.dtype == dtype
        torch.testing.assert_close(ours.double(), (x.double() @ w.double().T).to(dtype).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens, reduced", [(1, True), (4, True), (8, False)])
def test_a_compiled_small_batch_step_routes_without_a_gemm(tokens, reduced):
    """Under torch.compile, no gradients and <= 4 tokens (a decode step), the router's logits are a reduction the
    compiler fuses, not a matrix product; the same logits and choices either way."""
    from model.moe import TopKRouter

    router = TopKRouter(64, 8, 2)
    torch.nn.init.normal_(router.weight, std=0.1)
    x = torch.randn(tokens, 64)
    graphs = []

    def record(gm, _inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    with torch.no_grad():
        ref = router(x)
        torch._dynamo.reset()
        ours = torch.compile(router, backend=record, fullgraph=True)(x)
    products = {t for t in graphs[0] if "linear" in t or "matmul" in t or ".mm" in t}
    assert bool(products) != reduced, graphs[0]
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pattern", ["hybrid", "all-softmax", "all-lightning"])
def test_a_chunked_prefill_fills_the_cache_and_gives_the_logits_of_the_whole_prefill(pattern):
    """Issue 34 item 5: one long prompt prefilled in pieces (each continuing the lightning states and attending to
    the keys cached so far, aligned bottom right) leaves the same states, keys and last logits as one whole
    prefill, pieces of unequal length included (37 tokens in pieces of 16: 16 + 16 + 5)."""
    model = _model(pattern, dtype=torch.float64)
    prompt = torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(5))
    whole = StaticHybridCache(model.config, 2, 48, "cpu", torch.float64)
    pieces = StaticHybridCache(model.config, 2, 48, "cpu", torch.float64)
    with torch.no_grad():
        whole.begin_prefill([37], copies=2)
        ref = model(input_ids=prompt[None], cu_seqlens=torch.tensor([0, 37], dtype=torch.int32),
                    past_key_values=whole, use_cache=True, logits_to_keep=1).logits[0, -1]
        pieces.begin_prefill([37], copies=2)
        for start in (0, 16, 32):
            n = min(16, 37 - start)
            pieces.begin_prefill_chunk(start, n)
            out = model(input_ids=prompt[start:start + n][None], cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
                        position_ids=torch.arange(start, start + n)[None], past_key_values=pieces, use_cache=True,
                        logits_to_keep=1).logits[0, -1]
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for layer, state in whole.lightning_states.items():
        torch.testing.assert_close(pieces.lightning_states[layer], state, rtol=1e-9, atol=1e-12)  # both copies
    for layer, keys in whole.keys.items():
        torch.testing.assert_close(pieces.keys[layer][:, :, :37], keys[:, :, :37], rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(pieces.values[layer][:, :, :37], whole.values[layer][:, :, :37])
    assert pieces.lengths.tolist() == [37, 37]


def test_generate_prefills_one_long_prompt_in_pieces_with_the_tokens_of_one_whole_prefill(monkeypatch):
    """A call of one prompt longer than PREFILL_CHUNK goes through the pieces (counted), and greedy decoding after
    it gives transformers' loop's tokens, a last piece of one token included (33 = 16 + 16 + 1: a one-token piece
    goes through the decode step's stacked projections); a call of two prompts still packs them in one prefill."""
    import model.generation as generation

    model = _model("hybrid")
    ids, mask = _left_padded([33], seed=9)
    monkeypatch.setattr(generation, "PREFILL_CHUNK", 16)
    calls = []
    real = generation.DecodeEngine._prefill_pieces
    monkeypatch.setattr(generation.DecodeEngine, "_prefill_pieces",
                        lambda self, prompt, chunk: calls.append((prompt.numel(), chunk)) or real(self, prompt, chunk))
    fast, slow = _both(model, ids, mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert calls == [(33, 16)]
    assert torch.equal(fast, slow)
    ids2, mask2 = _left_padded([33, 20], seed=9)
    fast2, slow2 = _both(model, ids2, mask2, max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert calls == [(33, 16)] and torch.equal(fast2, slow2)


def test_a_chunk_outside_the_prompt_or_of_several_prompts_is_refused():
    model = _model("hybrid")
    cache = StaticHybridCache(model.config, 2, 32, "cpu", torch.float32)
    cache.begin_prefill([10, 5])
    with pytest.raises(ValueError, match="chunked prefill is of one prompt"):
        cache.begin_prefill_chunk(0, 5)
    cache.begin_prefill([10])
    with pytest.raises(ValueError, match="outside the prompt's 10 tokens"):
        cache.begin_prefill_chunk(8, 4)


def test_a_bad_prefill_chunk_setting_is_refused_with_its_name():
    from model.generation import _prefill_chunk

    assert _prefill_chunk("0") == 0 and _prefill_chunk("65536") == 65536
    for bad in ("64k", "-1", ""):
        with pytest.raises(ValueError, match="HYLIGHT_PREFILL_CHUNK"):
            _prefill_chunk(bad)
