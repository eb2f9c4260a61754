"""The training loop: ``for batch in trainer.batches(): trainer.step(batch)``, with callbacks around each step.

:class:`Trainer` owns what one optimizer step needs (the DeepSpeed engine, the loader, the learning-rate and
batch-size schedules, the divergence guard's counters, the whole-run expert load) and takes the step: the
micro-batches of the step's batch through forward and backward (under sequence parallelism each rank its slice of
every row, ``pretrain/sequence_parallel.py``), the optimizer step, and the loss of the whole batch, the same number
on every rank. Everything else is a :class:`Callback` (``pretrain/callbacks.py``; OLMo-core's callbacks are the
model): checkpointing, the throughput/MFU window, the batch-size schedule, the divergence guard, the in-training
probe and the logging, called in the order given, so the order of the events, the metrics and the checkpoints is
the order of the list.

Per step the hooks run in three passes: ``on_step`` (every callback, right after the step), ``on_log`` (at a logged
step: each callback adds to or reads the step's metrics) and ``on_step_end`` (after the log: checkpoints). A
callback ends training early with :meth:`Trainer.stop`, or stops it with an error by raising.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pretrain.engine_config import EngineConfig
from pretrain.grad_guard import GradGuard
from pretrain.sequence_parallel import loss_share, sequence_parallel_output, shard_batch


class Callback:
    """A hook around the loop. Every method is optional; ``trainer`` is the :class:`Trainer`."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step (after a resume: ``trainer.resumed``)."""

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        """Right after every optimizer step."""

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        """At a logged step (``log_every``, and the last), after every ``on_step``: add to or read ``metrics``."""

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        """After the step's log."""

    def on_fit_end(self, trainer: Trainer) -> None:
        """After the last step."""


@dataclass
class StepBatch:
    """One optimizer step's rows: ``gas`` micro-batches (drawn from the loader as the step reads them) of
    ``batch_rows`` in all, trained at learning rate ``lr``."""

    batch_rows: int
    gas: int
    lr: float
    micro_batches: Iterator[Any]


@dataclass
class StepResult:
    """What one optimizer step did."""

    step: int  # the step just taken, counted from 1
    tokens: int  # tokens of the whole batch (all replicas)
    loss: float  # the whole batch's cross-entropy, the same on every rank (NaN for a step whose loss was)
    aux_loss: float  # the balance loss
    skipped: bool  # the optimizer skipped it (non-finite or spiking gradient norm)
    batch_rows: int
    lr: float
    flops: list[float] = field(default_factory=list)  # this rank's model FLOPs of each micro-batch


@dataclass
class TrainState:
    """Where the run is; checkpointed (``pretrain/callbacks.py``'s ``Checkpointer``)."""

    step: int = 0
    tokens_seen: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # every logged step's metrics


def accumulation_steps(batch_rows: int, micro_batch_rows: int, data_parallel: int) -> int:
    """Micro-batches per optimizer step: ``batch_rows`` shared out over the data-parallel replicas (a
    sequence-parallel group is one replica: its ranks read the same rows)."""
    return max(1, batch_rows // (micro_batch_rows * data_parallel))


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Sum over every rank (each counts its own tokens: a sequence-parallel rank those of its slice)."""
    if dist.get_world_size() == 1:
        return t
    x = t.clone()
    dist.all_reduce(x)
    return x


@contextlib.contextmanager
def eager_layers(model: torch.nn.Module) -> Iterator[None]:
    """Run the modules ``compile_layers`` (``pretrain/train.py``) compiled eagerly inside the block. The held-out
    evaluation and the probe need this under "reduce-overhead": without a pending backward, CUDA-graph trees replay
    one RMSNorm graph for the next layer's norm and overwrite the output the residual still reads ("accessing tensor
    output of CUDAGraphs that has been overwritten by a subsequent run", seen on the H100). Evaluation is a few
    calls; eager costs nothing."""
    stashed = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
    for m, _ in stashed:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, impl in stashed:
            m._compiled_call_impl = impl


def release_graph_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Copy the gradients a CUDA-graph backward wrote out of the graphs' memory pool, between the micro-batches of a
    step. Under a CUDA-graph mode of ``compile_layers`` the compiled modules' backward graphs return their
    parameters' gradients in CUDA-graph memory, and autograd installs that tensor as ``.grad``. The next
    micro-batch's forward starts a new graph generation, which reuses the memory; accumulating into the old
    ``.grad`` then fails with "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"
    (pytorch/pytorch#169545). That error stopped every compiled run with gradient accumulation on a GPU (the recipe's
    16-row batch, long_context's phases); a step of one micro-batch needs nothing, as the optimizer reads the
    gradients before the next forward."""
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.clone()


class Trainer:
    """One rank's training loop (:meth:`fit`) and its step (:meth:`step`).

    ``engine``/``optimizer``: DeepSpeed's (``deepspeed.initialize``); ``grid``: the rank's place among the
    data-parallel replicas and sequence-parallel groups (``pretrain/train.py``'s ``RankGrid``); ``sp``: the
    sequence-parallel plan or None; ``rows``/``loader``/``make_batch``: the packed rows, their order and how a
    micro-batch is made of them; ``flops_of``: the model FLOPs of a micro-batch's documents; ``graph_params``: the
    parameters whose gradients CUDA graphs write (``compile_layers``), moved out of the graphs' memory between
    micro-batches (:func:`release_graph_grads`)."""

    def __init__(self, cfg: EngineConfig, *, engine: Any, optimizer: Any, grid: Any, device: torch.device,
                 rows: Any, loader: Any, make_batch: Callable[[Any, Any], Any], lr_schedule: Any,
                 batch_schedule: Any, guard: GradGuard, sp: Any, flops_of: Callable[[Any], float],
                 callbacks: list[Callback], graph_params: Sequence[torch.nn.Parameter] = ()) -> None:
        self.cfg, self.engine, self.optimizer, self.grid, self.device = cfg, engine, optimizer, grid, device
        self.rows, self.loader, self.make_batch = rows, loader, make_batch
        self.lr_schedule, self.batch_schedule, self.guard = lr_schedule, batch_schedule, guard
        self.sp, self.flops_of, self.callbacks = sp, flops_of, callbacks
        self.graph_params = list(graph_params)
        self.model_config = engine.module.config
        self.aux_coef = self.model_config.router_aux_loss_coef  # what the model adds to the loss (cfg.aux_loss_coef)
        self.state = TrainState()
        self.resumed = False
        self.stop_reason: str | None = None
        self.train_seconds = 0.0
        layers, experts = self.model_config.num_hidden_layers, self.model_config.num_experts
        self.routed = torch.zeros(layers, experts, dtype=torch.float64, device=device)  # token slots, whole run
        self.dropped = torch.zeros_like(self.routed)
        self.initial_batch_tokens = cfg.batch_rows * cfg.seq_len  # the WSD schedule counts in initial batches

    @property
    def rank(self) -> int:
        return self.grid.rank

    @property
    def done(self) -> bool:
        return self.state.tokens_seen >= self.cfg.train_tokens

    def stop(self, reason: str) -> None:
        """End training after the current step (its callbacks still run); the run then finishes as usual."""
        self.stop_reason = reason

    # --- the loop ------------------------------------------------------------------------------------------------

    def fit(self) -> None:
        for cb in self.callbacks:
            cb.on_fit_start(self)
        start = time.perf_counter()
        self.engine.train()
        for batch in self.batches():
            self._after_step(self.step(batch))
        for cb in self.callbacks:
            cb.on_fit_end(self)
        self.train_seconds = time.perf_counter() - start

    def batches(self) -> Iterator[StepBatch]:
        """The steps' batches until the token budget is spent (or a callback stops training). Each is made when
        the loop asks for it, after the previous step's callbacks: the batch-size schedule has had its say."""
        cfg = self.cfg
        while not self.done and self.stop_reason is None:
            batch_rows = self.batch_schedule.batch_size
            gas = accumulation_steps(batch_rows, cfg.micro_batch_rows, self.grid.data_parallel)
            lr = self.lr_schedule.lr(self.state.tokens_seen // self.initial_batch_tokens)
            micro = (self.make_batch(self.rows, self.loader.next_indices(cfg.micro_batch_rows)) for _ in range(gas))
            yield StepBatch(batch_rows, gas, lr, micro)

    def step(self, batch: StepBatch) -> StepResult:
        """One optimizer step on ``batch``: forward and backward of each micro-batch, DeepSpeed's step (the update,
        or its skip), and the whole batch's loss on every rank."""
        cfg, engine, grid = self.cfg, self.engine, self.grid
        if batch.gas != engine.gradient_accumulation_steps():
            engine.set_train_batch_size(cfg.micro_batch_rows * batch.gas * grid.world)
        for group in self.optimizer.param_groups:
            group["lr"] = batch.lr
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # on the device: read once a step
        aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens, flops = 0, []
        for i, micro in enumerate(batch.micro_batches):
            out, loss = self._forward(micro)
            if self.state.step in cfg.inject_nan_at_steps:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
            if i + 1 < batch.gas:  # another micro-batch's forward comes before the optimizer reads the gradients
                release_graph_grads(self.graph_params)
            aux = out.aux_loss.detach()  # global over a sequence-parallel group: every rank has the row's
            # the row's cross-entropy (under SP this rank's part; the group's parts are summed after the step)
            loss_sum += (loss.detach() - self.aux_coef * aux).double() / (batch.gas * grid.sequence_parallel)
            aux_sum += aux.double() / batch.gas
            tokens += micro.input_ids.numel()  # this replica's rows
            # this rank's documents; a sequence-parallel rank computes 1/SP of its replica's
            flops.append(self.flops_of(micro) / grid.sequence_parallel)
            self.routed += out.moe_routed.detach()  # on the device: no sync until the next log
            self.dropped += out.moe_dropped.detach()
        skipped = self.guard.after_step(bool(getattr(self.optimizer, "overflow", False)))
        if grid.world > 1:
            # the step's loss over the whole batch, the same number on every rank: a sequence-parallel group's parts
            # summed into its rows' loss, then the mean over the data-parallel replicas. The batch schedule's
            # loss triggers (double_batch_below_loss) read it, so every rank changes the batch size at the same
            # step (with each replica's own loss they could disagree and wait on each other forever)
            dist.all_reduce(loss_sum)
            loss_sum /= grid.data_parallel
        loss, aux_loss = torch.stack([loss_sum, aux_sum]).tolist()  # one host sync per step
        self.state.step += 1
        global_tokens = tokens * grid.data_parallel
        self.state.tokens_seen += global_tokens
        return StepResult(self.state.step, global_tokens, loss, aux_loss, skipped, batch.batch_rows, batch.lr, flops)

    def _forward(self, micro: Any) -> tuple[Any, torch.Tensor]:
        """The model's output on one micro-batch and the loss to backpropagate."""
        if self.sp is None:
            out = self.engine(input_ids=micro.input_ids.to(self.device), labels=micro.labels.to(self.device),
                              cu_seqlens=micro.cu_seqlens,  # bounds: host
                              position_ids=micro.position_ids.to(self.device), output_router_logits=True)
            return out, out.loss
        grid = self.grid
        shard = shard_batch(micro.input_ids, micro.labels, micro.position_ids, micro.cu_seqlens,
                            grid.sequence_rank, grid.sequence_parallel).to(self.device)
        out = sequence_parallel_output(self.engine, self.sp, shard, output_router_logits=True)
        # The group's shares sum to the row's loss, so the sum of their gradients is the row's gradient; DeepSpeed
        # averages over all world = DP x SP ranks, so each share is scaled by SP: the average of SP x (share
        # gradients) is the mean over the DP replicas of the whole-row gradients
        return out, loss_share(out, shard, self.aux_coef) * grid.sequence_parallel

    def _after_step(self, result: StepResult) -> None:
        for cb in self.callbacks:
            cb.on_step(self, result)
        if result.step % self.cfg.log_every == 0 or self.done:
            metrics: dict[str, Any] = {}
            for cb in self.callbacks:
                cb.on_log(self, metrics)
        for cb in self.callbacks:
            cb.on_step_end(self, result)

    def expert_load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token slots routed to and dropped by each [layer, expert] over the run, summed over the ranks, on the
        host (a collective: every rank calls it)."""
        return sum_over_ranks(self.routed).cpu(), sum_over_ranks(self.dropped).cpu()
