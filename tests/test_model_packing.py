"""Packed sequences: documents packed in a row (boundaries from restarting position_ids, or cu_seqlens) give
the logits and gradients of running each document alone -- lightning states reset and softmax attention is
masked at every boundary."""

from __future__ import annotations

import pytest
import torch

from model.modeling import HybridForCausalLM
from model.sizes import config_for

PATTERNS = {
    "hybrid": ["lightning", "softmax", "lightning", "lightning"],
    "all-lightning": "all-lightning",
    "all-softmax": "all-softmax",
}
LENGTHS = (7, 20, 13)  # crosses the 16-token lightning blocks at different offsets


def _model(pattern: str) -> HybridForCausalLM:
    torch.manual_seed(0)
    cfg = config_for(
        "tiny", num_hidden_layers=4, attention_pattern=PATTERNS[pattern], lightning_block_size=16
    )
    return HybridForCausalLM(cfg).double().eval()


def _docs(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g) for n in LENGTHS]


def _separate(model, docs):
    return [model(d[None], use_cache=False).logits[0] for d in docs]


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_packed_with_restarting_position_ids_equals_separate_documents(pattern):
    model = _model(pattern)
    docs = _docs()
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = model(ids, position_ids=pos).logits[0]
    torch.testing.assert_close(packed, torch.cat(_separate(model, docs)), rtol=1e-9, atol=1e-9)
    # without the boundaries the documents would leak into each other
    unpacked = model(ids).logits[0]
    assert not torch.allclose(unpacked[len(docs[0]) :], packed[len(docs[0]) :], atol=1e-4)


def test_cu_seqlens_gives_the_same_packing_as_position_ids():
    model = _model("hybrid")
    docs = _docs(1)
    ids = torch.cat(docs)[None]
    cu = torch.tensor([0, 7, 27, 40], dtype=torch.int32)
    a = model(ids, cu_seqlens=cu).logits
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    b = model(ids, position_ids=pos).logits
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_cu_seqlens_with_empty_documents_packs_like_the_nonempty_ones_and_keeps_its_bounds_on_the_host():
    """Empty documents (repeated bounds, first or last too) change nothing; the layers' packed bounds are built
    from the host copy and recorded, so no layer reads them back from the device."""
    from kernels import host_values
    from model.modeling import SequenceLayout

    model = _model("hybrid")
    ids = torch.cat(_docs(1))[None]
    plain = model(ids, cu_seqlens=torch.tensor([0, 7, 27, 40], dtype=torch.int32)).logits
    with_empty = torch.tensor([0, 0, 7, 7, 27, 40, 40], dtype=torch.int32)
    torch.testing.assert_close(model(ids, cu_seqlens=with_empty).logits, plain, rtol=1e-12, atol=1e-12)
    layout = SequenceLayout.build(1, 40, 0, torch.device("cpu"), None, None, with_empty)
    assert layout.cu_seqlens.tolist() == [0, 7, 27, 40] and layout.cu_seqlens.dtype == torch.int32
    assert host_values._VALUES[id(layout.cu_seqlens)][1] == (0, 7, 27, 40)
    assert layout.position_ids[0, [0, 6, 7, 26, 27, 39]].tolist() == [0, 6, 0, 19, 0, 12]
    with pytest.raises(ValueError, match="non-decreasing"):
        model(ids, cu_seqlens=torch.tensor([0, 27, 7, 40], dtype=torch.int32))
    with pytest.raises(ValueError, match="start at 0 and end"):
        model(ids, cu_seqlens=torch.tensor([0, 7, 27, 39], dtype=torch.int32))


def test_host_ints_reads_a_device_tensor_once_per_object_and_version(monkeypatch):
    """The cached read (used for non-CPU tensors) on CPU tensors, counting the reads it makes."""
    from kernels import host_values

    reads = []
    real = host_values._read
    monkeypatch.setattr(host_values, "_read", lambda t: reads.append(1) or real(t))
    t = torch.tensor([0, 3, 9])
    assert host_values._cached_read(t) == [0, 3, 9] and host_values._cached_read(t) == [0, 3, 9]
    assert len(reads) == 1  # the second call is answered from the cache
    t.add_(1)  # an in-place write bumps the version: read again
    assert host_values._cached_read(t) == [1, 4, 10] and len(reads) == 2
    u = torch.tensor([5, 6])
    host_values.remember_host_ints(u, [5, 6])
    assert host_values._cached_read(u) == [5, 6] and len(reads) == 2  # recorded, never read
    key = id(u)
    del u
    assert key not in host_values._VALUES  # forgotten with the tensor
    with torch.inference_mode():
        w = torch.tensor([1, 2])
    assert host_values._cached_read(w) == [1, 2] and host_values._cached_read(w) == [1, 2]
    assert len(reads) == 4  # inference tensors keep no version: never cached


def test_packed_rows_in_a_batch_and_their_gradients_equal_separate_documents():
    model = _model("hybrid")
    docs_a, docs_b = _docs(2), _docs(3)[::-1]  # two rows, boundaries at different places
    ids = torch.stack([torch.cat(docs_a), torch.cat(docs_b)])
    pos = torch.stack([torch.cat([torch.arange(len(d)) for d in ds]) for ds in (docs_a, docs_b)])
    packed = model(ids, position_ids=pos).logits
    packed.square().sum().backward()
    grads_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    separate = [torch.cat(_separate(model, ds)) for ds in (docs_a, docs_b)]
    torch.testing.assert_close(packed, torch.stack(separate), rtol=1e-9, atol=1e-9)
    sum(s.square().sum() for s in separate).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads_packed[name], p.grad, rtol=1e-8, atol=1e-10, msg=name)


def test_packed_input_cannot_continue_a_cache():
    model = _model("hybrid")
    with torch.no_grad():
        cache = model(torch.randint(0, 512, (1, 5)), use_cache=True).past_key_values
    with pytest.raises(ValueError, match="packed"):
        model(torch.randint(0, 512, (1, 6)), position_ids=torch.tensor([[5, 6, 0, 1, 2, 3]]),
              past_key_values=cache, use_cache=True)  # fmt: skip
