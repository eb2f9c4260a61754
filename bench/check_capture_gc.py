"""Does a garbage collection during a CUDA graph capture invalidate it? (GPU only; the twelfth lease's GRPO failure)

The two-GPU lease of 2026-11-28 lost `grpo_from_sft_more` 75 s in: its prompt selection built a new decode engine and
the engine's capture failed ("operation failed due to a previous error during capture"), after three "operation not
permitted when stream is capturing (function reset)" warnings. The reading tested here: a decode engine evicted from
a model's engines is not freed when dropped (its step function is a bound method of itself: a reference cycle), so
its CUDA graph is destroyed whenever Python's cyclic collector next runs; torch 2.11's ``torch.cuda.graph`` no longer
collects on entry, and a collection that lands inside a capture destroys a graph while a stream captures.

  python bench/check_capture_gc.py              # both sections; prints one line per case and exits 1 on a surprise

Sections:
  plain    torch alone: a dead cycle holding a captured graph, collected inside another capture (expected to
           fail), and the same with the collector paused and a collection before (expected to pass)
  engine   ``model.generate`` on a tiny hybrid over many prompt lengths (new engines, evictions), a collection
           forced inside every capture: with the fix (``DecodeEngine.release``, a collection before the capture;
           expected to pass) and with it undone (expected to fail). Run with HYLIGHT_DECODE_COMPILE=0 to skip the
           step's compile (the graph is the same without it).

The twelfth lease ran this with the first form of the fix (release on eviction, a collection before each capture,
the collector paused); the engines have since lost their self-reference too (``compiled_step_logits``), which
the "undone" case puts back.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import types

import torch


class _Holder:
    """A captured graph held in a reference cycle (as a decode engine's bound step function made one before the fix)."""

    def __init__(self) -> None:
        self.x = torch.zeros(8, device="cuda")
        self.step = self._step  # the cycle
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def _step(self) -> None:
        self.x.add_(1)


def _capture_with_collection_inside(paused: bool) -> str:
    from model.generation import collector_paused

    gc.disable()  # the dead holder waits for a collection, as between automatic ones
    try:
        holder = _Holder()
        del holder
        y = torch.zeros(8, device="cuda")
        graph = torch.cuda.CUDAGraph()
        if paused:
            gc.collect()
        guard = collector_paused() if paused else contextlib.nullcontext()
        with guard, torch.cuda.graph(graph):
            y.add_(1)
            if not paused:
                gc.collect()  # what an automatic collection does when it lands here
            y.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        return f"ok (y={y[0].item():g})"
    except Exception as e:  # noqa: BLE001 (the point is which error)
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        gc.enable()


def plain() -> bool:
    unpaused = _capture_with_collection_inside(paused=False)
    print(f"plain  collection inside the capture, dead graph in a cycle: {unpaused}")
    paused = _capture_with_collection_inside(paused=True)
    print(f"plain  collected before, collector paused during the capture: {paused}")
    return paused.startswith("ok")


def _undo_fix(gen: types.ModuleType) -> contextlib.ExitStack:
    """The decode engines as before the fix: each holds itself (its step function was a bound method kept on it),
    no release on eviction, no collection before the capture, the collector left on."""
    stack = contextlib.ExitStack()
    saved = (gen.DecodeEngine.release, gen.DecodeEngine.__init__, gen.collector_paused, gen.gc)
    init = gen.DecodeEngine.__init__

    def init_with_cycle(self: object, *args: object, **kwargs: object) -> None:
        self._forward = self._logits  # the cycle, set before the capture that __init__ runs
        init(self, *args, **kwargs)

    gen.DecodeEngine.release = lambda self: None
    gen.DecodeEngine.__init__ = init_with_cycle
    gen.collector_paused = contextlib.nullcontext
    gen.gc = types.SimpleNamespace(collect=lambda: 0)

    def restore() -> None:
        gen.DecodeEngine.release, gen.DecodeEngine.__init__, gen.collector_paused, gen.gc = saved

    stack.callback(restore)
    return stack


def _generate_many(fixed: bool, calls: int) -> str:
    import model.generation as gen
    from model import HybridForCausalLM, config_for

    torch.manual_seed(0)
    cfg = config_for("tiny", num_hidden_layers=4, lightning_block_size=16, pad_token_id=1, eos_token_id=2,
                     bos_token_id=0)
    model = HybridForCausalLM(cfg).to("cuda").eval()
    stack = contextlib.ExitStack() if fixed else _undo_fix(gen)
    step = gen.DecodeEngine._step

    def step_collecting(self: object) -> None:  # an automatic collection landing inside the capture, every time
        if torch.cuda.is_current_stream_capturing():
            gc.collect()
        step(self)

    gen.DecodeEngine._step = step_collecting
    stack.callback(setattr, gen.DecodeEngine, "_step", step)
    done = 0
    try:
        with stack:
            for i in range(calls):
                n = 8 + 300 * i  # a new capacity each call (CAPACITY_ROUND 256): a new engine, an old one evicted
                ids = torch.randint(3, 500, (4, n), device="cuda")
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               pad_token_id=1, eos_token_id=None)
                done += 1
        torch.cuda.synchronize()
        return f"ok ({done} calls, each a new capacity: a new engine and capture)"
    except Exception as e:  # noqa: BLE001 (the point is which error)
        return f"error after {done} calls: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        gen.release_engines(model)


def engine(calls: int) -> bool:
    fixed = _generate_many(fixed=True, calls=calls)
    print(f"engine with the fix: {fixed}")
    undone = _generate_many(fixed=False, calls=calls)
    print(f"engine with the fix undone: {undone}")
    return fixed.startswith("ok")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="plain,engine")
    ap.add_argument("--calls", type=int, default=12)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("check_capture_gc: needs a CUDA GPU (CUDA graphs); nothing checked")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    ok = True
    for section in args.sections.split(","):
        ok &= {"plain": plain, "engine": lambda: engine(args.calls)}[section]()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
