"""The decode-step kernels against their PyTorch references, on fresh random inputs: the split-K softmax decode
(kernels/softmax_decode*.py), the matrix-vector MoE for a few tokens (kernels/moe_decode*.py) and the in-place
lightning decode (kernels/lightning/triton_decode.py). On a CPU machine (CI) they run under TRITON_INTERPRET=1 in
float32 at tiny sizes; bench/bench_decode_gpu.py checks them in bf16 on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the import of the kernel modules
pytest.importorskip("triton", reason="triton is not installed: the decode kernels cannot be checked")

import model.modeling as modeling  # noqa: E402
import model.moe as moe_module  # noqa: E402
from kernels.lightning import lightning_attention_decode, lightning_decay_rates  # noqa: E402
from kernels.moe_decode import moe_decode_ffn, moe_decode_ffn_reference  # noqa: E402
from kernels.softmax_decode import softmax_decode_attention, softmax_decode_attention_reference  # noqa: E402
from kernels.softmax_decode_triton import split_count  # noqa: E402
from model.modeling import HybridForCausalLM  # noqa: E402
from model.moe import SwiGLUExperts  # noqa: E402
from model.sizes import config_for  # noqa: E402

if not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is off: nothing can run the kernels", allow_module_level=True)

DEV = "cuda" if ON_GPU else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("batch, heads, kv_heads, capacity, dim", [(3, 4, 2, 200, 16), (2, 4, 4, 70, 32),
                                                                    (1, 8, 2, 700, 16), (4, 2, 1, 64, 16)])
def test_split_k_decode_attention_equals_the_masked_reference(batch, heads, kv_heads, capacity, dim):
    g = torch.Generator().manual_seed(batch * 100 + capacity)
    q = torch.randn(batch, heads, 1, dim, generator=g).to(DEV)
    k = torch.randn(batch, kv_heads, capacity, dim, generator=g).to(DEV)
    v = torch.randn(batch, kv_heads, capacity, dim, generator=g).to(DEV)
    lengths = torch.randint(1, capacity + 1, (batch,), generator=g)
    lengths[0] = 1  # one key: the output is that key's value
    if batch > 1:
        lengths[-1] = capacity  # the whole buffer
    lengths = lengths.to(DEV)
    valid = torch.arange(capacity, device=DEV)[None, :] < lengths[:, None]
    k[~valid[:, None, :].expand(-1, kv_heads, -1)] = 1e4  # past a row's length: must never be read
    v[~valid[:, None, :].expand(-1, kv_heads, -1)] = float("nan")
    o = softmax_decode_attention(q, k, v, lengths, impl="triton")
    ref = softmax_decode_attention_reference(q.double(), k.double().nan_to_num(0), v.double().nan_to_num(0),
                                             lengths)
    assert torch.isfinite(o).all()
    assert _rel(o, ref) < 1e-5
    torch.testing.assert_close(o[0, :, 0].double(), v[0, :, 0].double().repeat_interleave(heads // kv_heads, 0))


def test_split_k_decode_reads_a_strided_cache_view():
    """The generation cache stores [B, capacity, H_kv, D] and hands the kernel a [B, H_kv, capacity, D] view."""
    g = torch.Generator().manual_seed(3)
    store = torch.randn(2, 96, 2, 16, generator=g).to(DEV)
    k, v = store.transpose(1, 2), (store * 0.5).transpose(1, 2)
    q = torch.randn(2, 4, 1, 16, generator=g).to(DEV)
    lengths = torch.tensor([50, 96], device=DEV)
    o = softmax_decode_attention(q, k, v, lengths, impl="triton")
    ref = softmax_decode_attention_reference(q.double(), k.double(), v.double(), lengths)
    assert _rel(o, ref) < 1e-5


def test_split_count_fills_the_gpu_but_never_splits_below_a_block():
    assert split_count(1, 2, 1 << 20) == 128  # 256 programs at batch 1
    assert split_count(256, 2, 640) == 1
    assert split_count(1, 2, 100) == 2  # ceil(100 / 64) chunks at most


@pytest.mark.parametrize("tokens, top_k, experts", [(1, 2, 8), (3, 2, 8), (2, 1, 4)])
def test_moe_decode_ffn_equals_the_reference(tokens, top_k, experts):
    g = torch.Generator().manual_seed(tokens * 10 + experts)
    d, f = 64, 48
    x = torch.randn(tokens, d, generator=g).to(DEV)
    gate_up = (torch.randn(experts, 2 * f, d, generator=g) / d**0.5).to(DEV)
    down = (torch.randn(experts, d, f, generator=g) / f**0.5).to(DEV)
    probs = torch.randn(tokens, experts, generator=g).softmax(-1)
    top_w, top_i = probs.topk(top_k)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(DEV)
    y = moe_decode_ffn(x, gate_up, down, top_i.to(DEV), top_w)
    ref = moe_decode_ffn_reference(x.double(), gate_up.double(), down.double(), top_i.to(DEV), top_w.double())
    assert _rel(y, ref) < 1e-5


def test_few_routed_slots_take_the_gemv_path_and_match_the_loop(monkeypatch):
    monkeypatch.setattr(moe_module, "GEMV_DEVICES", frozenset({DEV}))
    torch.manual_seed(0)
    experts = SwiGLUExperts(8, 64, 32).to(DEV)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 64**-0.5)
        experts.down_proj.normal_(0, 32**-0.5)
        x = torch.randn(3, 64, device=DEV)
        top_w, top_i = torch.randn(3, 8, device=DEV).softmax(-1).topk(2)
        keep = torch.ones_like(top_i, dtype=torch.bool)
        keep[1, 1] = False  # a padded slot contributes nothing
        assert experts.path_for(x, 2) == "gemv" and experts.path_for(torch.randn(4, 64, device=DEV), 2) != "gemv"
        fast = experts(x, top_i, top_w, keep)
        loop = experts.forward_reference(x, top_i, top_w, keep)
    assert _rel(fast, loop) < 1e-5
    x.requires_grad_(True)
    assert experts.path_for(x, 2) != "gemv"  # with gradients: never (no backward)


def test_in_place_lightning_decode_equals_the_out_of_place_step():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 4, 1, 16, generator=g).to(DEV) for _ in range(3))
    state = torch.randn(3, 4, 16, 16, generator=g).to(DEV)
    rates = lightning_decay_rates(4, 2, 8, device=DEV)
    ref_o, ref_state = lightning_attention_decode(q.double(), k.double(), v.double(), rates, state.double(),
                                                  impl="chunk")
    inplace = state.clone()
    address = inplace.data_ptr()
    o, new_state = lightning_attention_decode(q, k, v, rates, inplace, impl="triton", out_state=inplace)
    assert new_state.data_ptr() == address  # the preallocated cache keeps its address (CUDA graphs)
    assert _rel(o, ref_o) < 1e-5 and _rel(inplace, ref_state) < 1e-6


def test_fast_generate_through_every_decode_kernel_equals_transformers_loop(monkeypatch):
    """The model's decode step with the Triton kernels in place of the CPU paths: the lightning chunk/decode
    kernels (lightning_impl="triton"), the split-K softmax decode and the matrix-vector MoE."""
    monkeypatch.setattr(moe_module, "GEMV_DEVICES", frozenset({DEV}))
    monkeypatch.setattr(modeling, "softmax_decode_attention",
                        lambda *a: softmax_decode_attention(*a, impl="triton"))
    torch.manual_seed(0)
    cfg = config_for("tiny", num_hidden_layers=2, attention_pattern=["lightning", "softmax"], lightning_block_size=16,
                     lightning_impl="triton", pad_token_id=2, eos_token_id=1)
    model = HybridForCausalLM(cfg).to(DEV).eval()
    ids = torch.randint(3, 512, (1, 9), device=DEV)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=2, eos_token_id=None)
    fast = model.generate(input_ids=ids, **kw)
    assert model.last_generation_refusal is None
    monkeypatch.setattr(moe_module, "GEMV_DEVICES", frozenset())
    slow = model.generate(input_ids=ids, fast_decode=False, **kw)
    assert torch.equal(fast, slow)
