"""Generation spec: the cache (one d x d state per lightning head, KV only for softmax layers) gives the logits
of full recomputation; ``model.generate`` works greedy, sampling, batched with left padding and with chunked
prefill; lightning decode state does not grow with the context."""

from __future__ import annotations

import pytest
import torch

from model.cache import HybridCache
from model.modeling import HybridForCausalLM
from model.sizes import config_for

PATTERNS = {
    "hybrid": ["lightning", "softmax", "lightning", "lightning"],
    "all-lightning": "all-lightning",
    "all-softmax": "all-softmax",
}


def _model(pattern="hybrid", seed=0, dtype=torch.float64, **kw) -> HybridForCausalLM:
    torch.manual_seed(seed)
    cfg = config_for("tiny", num_hidden_layers=4, attention_pattern=PATTERNS[pattern], lightning_block_size=16,
                     pad_token_id=2, eos_token_id=1, bos_token_id=0, **kw)  # fmt: skip
    return HybridForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_prefill_then_decode_gives_the_logits_of_full_recomputation(pattern):
    model = _model(pattern)
    ids = torch.randint(3, 512, (2, 41))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :19], use_cache=True)
        cache, pieces = out.past_key_values, [out.logits]
        out = model(ids[:, 19:24], past_key_values=cache, use_cache=True)  # several new tokens at once
        pieces.append(out.logits)
        for t in range(24, 41):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
    assert isinstance(cache, HybridCache) and cache.get_seq_length() == 41
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-9, atol=1e-9)


def test_cache_holds_constant_lightning_state_and_kv_only_for_softmax_layers():
    model = _model("hybrid")
    sizes = {}
    for length in (16, 64):
        with torch.no_grad():
            cache = model(torch.randint(3, 512, (1, length)), use_cache=True).past_key_values
        assert sorted(cache.lightning_states) == [0, 2, 3] and sorted(cache.keys) == [1]
        sizes[length] = cache.nbytes()
    cfg = model.config
    per_layer_state = cfg.num_attention_heads * cfg.head_dim**2 * 8  # float64 bytes
    assert sizes[16]["lightning"] == sizes[64]["lightning"] == 3 * per_layer_state
    assert sizes[64]["softmax_kv"] == 4 * sizes[16]["softmax_kv"]


@pytest.mark.parametrize("pattern", ["hybrid", "all-lightning"])
def test_greedy_generate_with_cache_equals_without(pattern):
    model = _model(pattern)
    prompt = torch.randint(3, 512, (2, 11))
    with_cache = model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=True)
    without = model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=False)
    assert with_cache.shape == (2, 31)
    assert torch.equal(with_cache, without)


def test_sampling_generate_with_cache_equals_without():
    model = _model("hybrid")
    prompt = torch.randint(3, 512, (2, 9))
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        runs.append(model.generate(prompt, max_new_tokens=16, do_sample=True, top_k=50, temperature=1.5,
                                   use_cache=use_cache))  # fmt: skip
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(124)
    other = model.generate(prompt, max_new_tokens=16, do_sample=True, top_k=50, temperature=1.5)
    assert not torch.equal(other, runs[0])  # sampling really samples


def test_left_padded_batch_generates_what_each_row_generates_alone():
    model = _model("hybrid")
    pad = model.config.pad_token_id
    rows = [torch.randint(3, 512, (n,)) for n in (13, 6, 10)]
    width = max(len(r) for r in rows)
    ids = torch.full((3, width), pad)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)  # fmt: skip
    for i, r in enumerate(rows):
        alone = model.generate(r[None], max_new_tokens=12, do_sample=False, output_scores=True,
                               return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(batched.sequences[i, width:], alone.sequences[0, len(r) :])
        for step_batched, step_alone in zip(batched.scores, alone.scores, strict=True):
            torch.testing.assert_close(step_batched[i], step_alone[0], rtol=1e-9, atol=1e-9)


def test_left_padding_leaves_the_lightning_state_of_a_row_unchanged():
    model = _model("all-lightning")
    row = torch.randint(3, 512, (1, 9))
    padded = torch.cat([torch.full((1, 5), 2), row], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    with torch.no_grad():
        a = model(row, use_cache=True).past_key_values
        b = model(padded, attention_mask=mask, use_cache=True).past_key_values
        unmasked = model(padded, use_cache=True).past_key_values
    for layer in a.lightning_states:
        torch.testing.assert_close(
            b.lightning_states[layer], a.lightning_states[layer], rtol=1e-10, atol=1e-12
        )
    assert not torch.allclose(unmasked.lightning_states[0], a.lightning_states[0])  # the mask is what does it


def test_chunked_prefill_generate_equals_plain_generate():
    model = _model("hybrid")
    prompt = torch.randint(3, 512, (2, 37))
    plain = model.generate(prompt, max_new_tokens=8, do_sample=False)
    # transformers only chunks the prefill into a cache it is given
    chunked = model.generate(prompt, max_new_tokens=8, do_sample=False, prefill_chunk_size=10,
                             past_key_values=HybridCache())  # fmt: skip
    assert torch.equal(plain, chunked)


def test_float32_generate_runs_and_returns_a_hybrid_cache():
    model = _model("hybrid", dtype=torch.float32)
    out = model.generate(torch.randint(3, 512, (2, 5)), max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True)  # fmt: skip
    assert out.sequences.shape == (2, 9)
    assert isinstance(out.past_key_values, HybridCache) and out.past_key_values.get_seq_length() == 8


def test_beam_search_reorders_the_cache():
    model = _model("hybrid")
    prompt = torch.randint(3, 512, (2, 9))
    with_cache = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False)
    without = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False)
    assert torch.equal(with_cache, without)


def test_generate_in_training_mode_keeps_the_cache_and_equals_eval_mode():
    """TRL generates rollouts with the policy in training mode: generate asks for the cache explicitly, so the
    decode steps still see the whole context (a dropless model: training mode then changes nothing else)."""
    model = _model("hybrid", moe_token_drop=False)
    ids = torch.randint(3, 512, (2, 9))
    ids[1, :3] = 2  # left padding
    mask = (ids != 2).long()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2)
        model.train()
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2)
        model.eval()
    assert torch.equal(got, ref)
    model.train()
    out = model(ids, attention_mask=mask)  # a plain training forward still builds no cache
    model.eval()
    assert out.past_key_values is None


def test_generate_in_inference_mode_leaves_no_inference_tensor_for_a_later_training_step():
    """SFT on an H100 sampled under inference_mode, then trained: the lightning decay rates, cached on the first
    call, were inference tensors, and the Triton kernels' backward could not save them."""
    torch.manual_seed(0)
    model = HybridForCausalLM(config_for("tiny", num_hidden_layers=2, attention_pattern=["lightning", "softmax"]))
    ids = torch.randint(8, model.config.vocab_size, (2, 9))
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    rates = model.model.layers[0].attn.decay_rates
    assert not rates.is_inference()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert model.model.layers[0].attn.qkv_proj.weight.grad is not None
