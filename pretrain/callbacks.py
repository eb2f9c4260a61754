"""The training loop's callbacks (``pretrain/trainer.py``), in the order ``pretrain/train.py`` lists them:

- :class:`DivergenceGuardCallback`: stop with :class:`~pretrain.grad_guard.DivergenceError` after
  ``max_consecutive_skips`` skipped steps in a row.
- :class:`BatchSizeScheduleCallback`: the §4.2 batch-size doubling reads every accepted step's tokens and loss.
- :class:`ThroughputCallback`: the window of steps between two logs: its loss, throughput, MFU and drop rate.
- :class:`ProbeCallback`: the in-training retrieval probe (``pretrain/probe.py``) at its logged steps.
- :class:`LogCallback`: every logged step to ``train_log.jsonl`` and, as ``@@hylight`` events, to the stage (MLflow).
- :class:`CheckpointCallback`: DeepSpeed checkpoints (one before the first step, every ``checkpoint_every``, one at
  the end; none at all with ``checkpoint_every`` 0) through :class:`Checkpointer`, which also resumes a killed run.
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.artifacts import write_text_atomic
from pretrain.events import emit
from pretrain.grad_guard import DivergenceError
from pretrain.trainer import Callback, StepResult, Trainer, eager_layers, sum_over_ranks

TRAIN_LOG = "train_log.jsonl"


# --- checkpointing and resume --------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """DeepSpeed's checkpoints of a run in ``directory`` (model, optimizer partitions, per-expert files), with
    everything else a resume needs in their client state: the loader position, the batch-size schedule, tokens seen,
    the guard's counters, the RNG states, the metric history and the whole-run expert load. A killed run continues
    from its last checkpoint and, on CPU, reproduces the uninterrupted loss curve."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory, self.keep = directory, keep

    def load(self, trainer: Trainer) -> bool:
        """Resume ``trainer`` from the newest checkpoint; False if there is none."""
        if not (self.directory / "latest").exists():
            return False
        _, client = trainer.engine.load_checkpoint(str(self.directory), load_lr_scheduler_states=False)
        state = trainer.state
        state.step, state.tokens_seen, state.history = client["step"], client["tokens_seen"], client["history"]
        trainer.loader.load_state_dict(client["loader"])
        trainer.batch_schedule.load_state_dict(client["batch_schedule"])
        trainer.guard.load_state_dict(client["guard"])
        _set_rng_state(client["rng"])
        if trainer.rank == 0:  # whole-run expert load: the checkpoint holds the sums over all ranks
            trainer.routed += client["expert_routed"].to(trainer.device)
            trainer.dropped += client["expert_dropped"].to(trainer.device)
        emit("progress", {"message": f"resumed from step {state.step} ({state.tokens_seen:,} tokens) in "
                                     f"{self.directory}"}, trainer.rank)
        return True

    def save(self, trainer: Trainer) -> None:
        """A checkpoint of the current step (a collective: every rank calls it); the newest ``keep`` are kept."""
        state = trainer.state
        client = {"step": state.step, "tokens_seen": state.tokens_seen, "history": state.history,
                  "loader": trainer.loader.state_dict(), "batch_schedule": trainer.batch_schedule.state_dict(),
                  "guard": trainer.guard.state_dict(), "rng": _rng_state(),
                  "expert_routed": sum_over_ranks(trainer.routed).cpu(),
                  "expert_dropped": sum_over_ranks(trainer.dropped).cpu()}  # collectives: every rank
        trainer.engine.save_checkpoint(str(self.directory), tag=f"step{state.step:08d}", client_state=client)
        if trainer.rank == 0:  # keep the newest few
            tags = sorted(p for p in self.directory.glob("step*") if p.is_dir())
            for old in tags[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)


class CheckpointCallback(Callback):
    """A checkpoint before the first step (a valid one exists from the start: the guard's error can always point at
    one), every ``every`` steps, and at the end. Last in the list: a checkpoint holds the step's logged metrics.

    ``every`` 0 saves none: a stopped run starts over from its first step. That is for runs that end inside one
    machine's lease, where a checkpoint cannot outlive the machine and each save of ``gpu-300m``'s weights and
    optimizer state (~10 GB by count) cost ~20 s of a 4-GPU lease's pretraining (BENCHMARKS.md, issue 33)."""

    def __init__(self, checkpointer: Checkpointer, every: int) -> None:
        self.checkpointer, self.every = checkpointer, every

    def on_fit_start(self, trainer: Trainer) -> None:
        if self.every and not trainer.resumed:
            self.checkpointer.save(trainer)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self.every and result.step % self.every == 0:
            self.checkpointer.save(trainer)

    def on_fit_end(self, trainer: Trainer) -> None:
        if self.every:
            self.checkpointer.save(trainer)


# --- the divergence guard and the batch-size schedule ----------------------------------------------------------


class DivergenceGuardCallback(Callback):
    """Stops training with an error once ``max_consecutive`` optimizer steps in a row were skipped (the guard that
    skips them is installed in the optimizer: ``pretrain/grad_guard.py``)."""

    def __init__(self, max_consecutive: int, spike_factor: float, checkpoints: Path | None) -> None:
        """``checkpoints``: where the last valid checkpoint is, or None where the run keeps none
        (``checkpoint_every`` 0)."""
        self.max_consecutive, self.spike_factor, self.checkpoints = max_consecutive, spike_factor, checkpoints

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        consecutive = trainer.guard.consecutive
        if consecutive >= self.max_consecutive:
            where = (f"the last valid checkpoint is in {self.checkpoints}. Rerunning with the same params resumes "
                     "from it (and likely diverges again)" if self.checkpoints is not None else
                     "this run keeps no checkpoints (checkpoint_every 0): rerunning with the same params starts "
                     "over from the first step")
            raise DivergenceError(
                f"{consecutive} optimizer steps in a row were skipped (non-finite loss/gradients or grad-norm "
                f"spikes above {self.spike_factor}x the recent median) at step {result.step}; {where}; a lower "
                "learning rate or other params start a new run under a new cache key.")


class BatchSizeScheduleCallback(Callback):
    """Feeds every accepted step's tokens and loss to the batch-size schedule (§4.2: doubling at token counts or
    below losses); the trainer reads the batch size from it for the next step."""

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        if not result.skipped:
            trainer.batch_schedule.update(trainer.state.tokens_seen, result.loss)


# --- throughput, MFU and the logged metrics --------------------------------------------------------------------


def measured_peak_flops(device: torch.device) -> float:
    """Peak matmul FLOP/s measured on this device (bf16 8192³ on CUDA, fp32 1024³ on CPU): the MFU denominator."""
    if device.type == "cuda":
        n, dtype, reps = 8192, torch.bfloat16, 10
    else:
        n, dtype, reps = 1024, torch.float32, 3
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class ThroughputCallback(Callback):
    """The window of steps since the last log: the mean loss of its accepted steps, tokens per second, MFU (model
    FLOPs of every rank's documents over the measured peak of all ranks) and the share of token slots dropped. At a
    logged step it writes the step's metrics, in this order: loss, aux_loss, lr, batch_size, grad_norm,
    tokens_per_second, mfu, drop_rate, memory_gb, tokens, skipped_steps, accepted_spikes."""

    def on_fit_start(self, trainer: Trainer) -> None:
        self.peak = measured_peak_flops(trainer.device)  # after a resume: it draws from the restored RNG
        self.graphs = compile_stats()[0]
        self._open_window(trainer)

    def _open_window(self, trainer: Trainer) -> None:
        self.started, self.tokens, self.losses, self.aux = time.perf_counter(), 0, [], []
        self.flops = 0.0  # model FLOPs of this rank's micro-batches (model.accounting.packed_flops)
        self.slots = torch.stack([trainer.routed.sum(), trainer.dropped.sum()])  # routed, dropped at the last log
        self.last: StepResult | None = None
        self.logged = False

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        for f in result.flops:
            self.flops += f
        self.tokens += result.tokens
        if not result.skipped:
            self.losses.append(result.loss)
            self.aux.append(result.aux_loss)
        self.last = result

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        tps = self.tokens / (now - self.started)
        totals = torch.stack([trainer.routed.sum(), trainer.dropped.sum()])
        window = torch.cat([totals - self.slots, totals.new_tensor([self.flops])])
        window_routed, window_dropped, flops_all = sum_over_ranks(window).tolist()  # all ranks
        self.slots, self.logged = totals, True
        guard, last = trainer.guard, self.last
        metrics |= {
            "loss": statistics.fmean(self.losses) if self.losses else float("nan"),
            "aux_loss": statistics.fmean(self.aux) if self.aux else float("nan"),
            "lr": last.lr, "batch_size": last.batch_rows, "grad_norm": guard.last_norm,
            "tokens_per_second": tps, "mfu": flops_all / (now - self.started) / (self.peak * trainer.grid.world),
            "drop_rate": window_dropped / max(window_routed, 1.0),  # all ranks' slots since the last log
            "memory_gb": memory_gb(trainer.device), "tokens": trainer.state.tokens_seen,
            "skipped_steps": guard.skipped, "accepted_spikes": guard.accepted_spikes,
        }
        graphs, frames, backward = compile_stats()
        if graphs != self.graphs:  # the first window's compiles, and any recompile later: where a cold start goes
            emit("progress", {"message": (
                f"torch.compile: {graphs} graph(s) so far (+{graphs - self.graphs} in this window), "
                f"{frames:.1f} s in Dynamo frames, {backward:.1f} s compiling backward graphs")}, trainer.rank)
            self.graphs = graphs

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self.logged:  # after the log's events (and the probe): the next window starts now
            self._open_window(trainer)


def compile_stats() -> tuple[int, float, float]:
    """(graphs torch.compile has made in this process, seconds in its Dynamo frames (they hold the forward graphs'
    Inductor compiles), seconds in Inductor's backward compiler (inside a frame's, or at the first backward where
    torch compiles it lazily)): zeros where torch's private counters are not there."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
    except ImportError:
        return 0, 0.0, 0.0
    return (int(counters["stats"].get("unique_graphs", 0)),
            float(sum(compilation_time_metrics.get("_compile.compile_inner", []))),
            float(sum(compilation_time_metrics.get("compile_fx.<locals>.bw_compiler", []))))


# --- in-training eval ------------------------------------------------------------------------------------------


class ProbeCallback(Callback):
    """The in-training retrieval probe (copy accuracy, NIAH forced choice; ``pretrain/probe.py``) every ``every``
    steps (a multiple of log_every) and at the last step; its metrics join the step's."""

    def __init__(self, probe: Any, every: int) -> None:
        self.probe, self.every = probe, every

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if not (trainer.state.step % self.every == 0 or trainer.done):
            return
        started = time.perf_counter()
        with eager_layers(trainer.engine.module):
            metrics |= self.probe.run(trainer.engine.module, trainer.device)
        metrics["probe_seconds"] = time.perf_counter() - started
        emit("progress", {"message": (
            f"probe at step {trainer.state.step}: copy accuracy {metrics['copy_accuracy']:.3f}, NIAH forced choice "
            f"{metrics['niah_choice_accuracy']:.2f} (chance {self.probe.chance:.2f}), margin "
            f"{metrics['niah_answer_margin']:+.2f} nats")}, trainer.rank)


# --- logging ---------------------------------------------------------------------------------------------------


class LogCallback(Callback):
    """Every logged step: into the run's history (checkpointed), a line of ``train_log.jsonl`` in ``export_dir``
    (rank 0), and ``metrics`` and ``progress`` events to the stage, which forwards them to MLflow."""

    def __init__(self, export_dir: Path, train_tokens: int) -> None:
        self.path, self.train_tokens = export_dir / TRAIN_LOG, train_tokens

    def on_fit_start(self, trainer: Trainer) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if trainer.rank == 0:  # the log restarts from the checkpoint's history (lines after it are from the killed attempt)
            write_text_atomic(self.path, "".join(json.dumps(h) + "\n" for h in trainer.state.history))

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        step, rank = trainer.state.step, trainer.rank
        trainer.state.history.append({"step": step, **metrics})
        if rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(trainer.state.history[-1]) + "\n")
        emit("metrics", {"step": step, "metrics": metrics}, rank)
        emit("progress", {"message": (
            f"step {step} · {trainer.state.tokens_seen:,}/{self.train_tokens:,} tokens · loss {metrics['loss']:.4f} · "
            f"lr {metrics['lr']:.2e} · batch {metrics['batch_size']} · {metrics['tokens_per_second']:,.0f} tok/s · "
            f"mfu {metrics['mfu']:.1%} · drop {metrics['drop_rate']:.2%} · skipped {trainer.guard.skipped}")}, rank)
