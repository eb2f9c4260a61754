"""Host copies of small index tensors that every layer of one forward call reads (``cu_seqlens``).

Reading a CUDA tensor's values on the host waits for all queued GPU work. The lightning and softmax kernels need
the document bounds on the host to plan their launches, and the 16 layers of a model all get the same tensor
object: without a cache each layer waited for the GPU once (16 reads per gpu-300m forward, plus the layout's; an
H100 profile showed 37 stream syncs per training step, each leaving the GPU idle while the host catches up). ``host_ints`` reads a tensor once and
remembers its values for as long as the tensor lives and is not written in place (through torch: a write that
bypasses the version counter, such as ``.data`` or a raw kernel, would leave a stale copy; no caller writes a
``cu_seqlens`` tensor that way); ``remember_host_ints`` records
the values of a tensor built from host data, so that it is never read back at all.
"""

from __future__ import annotations

import weakref

import torch

_VALUES: dict[int, tuple[int, tuple[int, ...]]] = {}  # id(tensor) -> (version counter, values)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors keep no version counter: never cached
        return None


def remember_host_ints(t: torch.Tensor, values: list[int] | tuple[int, ...]) -> None:
    """Record ``values`` as the contents of the 1-D integer tensor ``t`` (the caller built ``t`` from them)."""
    version = _version(t)
    if version is None:
        return
    if id(t) not in _VALUES:
        weakref.finalize(t, _VALUES.pop, id(t), None)
    _VALUES[id(t)] = (version, tuple(int(v) for v in values))


def host_ints(t: torch.Tensor) -> list[int]:
    """``t.tolist()`` as ints, read from the device at most once per tensor object and version (a CPU tensor is
    read directly: cheap, and numpy views can write it without bumping its version counter)."""
    if t.device.type == "cpu":
        return _read(t)
    return _cached_read(t)


def _read(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.tolist()]


def _cached_read(t: torch.Tensor) -> list[int]:
    version = _version(t)
    hit = _VALUES.get(id(t))
    if version is not None and hit is not None and hit[0] == version:
        return list(hit[1])
    values = _read(t)
    if version is not None:
        remember_host_ints(t, values)
    return values
