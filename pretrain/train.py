"""The pretraining loop on DeepSpeed: one function every rank runs, CPU tiny and multi-GPU alike.

``python -m pretrain.train --config CONFIG.json`` is what the ``pretrain`` stage launches (one process on a CPU or
one GPU, ``pretrain/local_ranks.py`` for several GPUs of one node); a Ray Train worker of a multi-node stage calls
the same :func:`run_rank`; :func:`train` is the body. It reads packed rows (``pretrain/packed_data.py``),
builds the ``model/`` hybrid with DeepNorm init, swaps its MoE layers for DeepSpeed-MoE ones with the global router
(``pretrain/moe.py``), and trains with ``deepspeed.initialize`` (ZeRO stage 1 or 2, torch AdamW with the report's
β = (0.9, 0.95) and weight decay 0.1, gradient clipping, bf16 on GPU / fp32 on CPU), under the WSD learning-rate
schedule and the critical-batch-size doubling of §4.2 (``pretrain/schedules.py``).

Sequence parallelism (``sequence_parallel`` = SP > 1, :class:`RankGrid`): groups of SP consecutive ranks are one
data-parallel replica each. A group's ranks read the same rows, each takes its contiguous slice of them
(``pretrain/sequence_parallel.py``: LASP+ for lightning layers, a K/V all-gather for softmax ones, the balance loss
made global), and backpropagates SP x its share of the loss: the shares sum to the rows' loss and DeepSpeed
averages gradients over all ranks, so the update is the data-parallel one. The logged loss (the one the batch
schedule reads) is the whole batch's on every rank: each group's parts summed, averaged over the replicas.

Rank 0 reports to the parent through stdout lines ``@@hylight {json}`` (metrics, progress, events), which the stage
forwards to MLflow, and appends every logged step to ``train_log.jsonl`` in the export directory.

Checkpoints (DeepSpeed's: model, optimizer partitions, per-expert files) carry everything else a resume needs in
their client state: the loader position, the batch-size schedule, tokens seen, the guard's counters, the RNG
states and the metric history, so a killed run continues from its last checkpoint and, on CPU, reproduces the
uninterrupted loss curve.

Divergence guard: a non-finite loss or gradient makes DeepSpeed's ZeRO optimizer skip the step (its overflow
path: no update, gradients cleared); a finite gradient norm above ``spike_factor`` x the median of the last 64
accepted steps is turned into the same skip, at most ``max_spike_skips`` times in a row (a norm that stays high is
then taken, clipped: ``GradGuard``). Every rank takes the same decision (the largest rank norm is judged). Skips
are counted (``skipped_steps``); ``max_consecutive_skips`` in a row stop training with a clear error, leaving the
last periodic checkpoint as the valid one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import resource
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.tokenizer import special_token_ids
from pretrain.export import export_checkpoint
from pretrain.sequence_parallel_checks import sequence_parallel_problems

METRIC_PREFIX = "@@hylight "
CHECKPOINT_DIR = "deepspeed"
TRAIN_LOG = "train_log.jsonl"


@dataclass
class TrainConfig:
    """Everything a rank needs; JSON-able (the stage writes it, ``python -m pretrain.train`` reads it)."""

    data_dir: str
    tokenizer_dir: str
    resume_dir: str
    export_dir: str
    size: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 256
    micro_batch_rows: int = 4  # rows per forward call on each rank (one packed sequence of rows x seq_len)
    batch_rows: int = 8  # initial global batch, in rows
    max_batch_rows: int = 64
    double_at_tokens: list[int] = field(default_factory=list)
    double_below_loss: list[float] = field(default_factory=list)
    train_tokens: int = 1_000_000
    peak_lr: float = 3e-3
    warmup_frac: float = 0.05
    decay_frac: float = 0.2
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    zero_stage: int = 1
    expert_parallel_size: int = 1
    sequence_parallel: int = 1  # ranks that split each row (LASP+, pretrain/sequence_parallel.py): RankGrid
    global_router: bool = True
    token_drop: bool = True
    capacity_factor: float = 1.25
    min_capacity: int = 0
    aux_loss_coef: float = 0.001
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_max_rows: int = 64
    seed: int = 0
    spike_factor: float = 10.0
    max_consecutive_skips: int = 5
    max_spike_skips: int = 2
    inject_nan_at_steps: list[int] = field(default_factory=list)  # fault injection, for testing the guard
    lightning_impl: str = "auto"
    compile: bool = False
    # long-context phases (pretrain/long_context.py): start from a checkpoint's model/ directory (its architecture
    # and weights; model_overrides still apply, e.g. rope_theta), and read the rows in their stored order
    init_from: str | None = None
    ordered_rows: bool = False
    # the in-training retrieval probe (pretrain/probe.py): every probe_every steps (a multiple of log_every), 0: off
    probe_every: int = 0
    probe_trials: int = 8

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        return cls(**json.loads(Path(path).read_text()))


class DivergenceError(RuntimeError):
    pass


# --- reporting -----------------------------------------------------------------------------------------------


def emit(kind: str, payload: dict[str, Any], rank: int) -> None:
    """One line to the parent (rank 0 only): ``@@hylight {"kind": ..., ...}``."""
    if rank == 0:
        print(METRIC_PREFIX + json.dumps({"kind": kind, **payload}), flush=True)


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


# --- setup ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankGrid:
    """The ranks as data-parallel replicas x sequence-parallel groups. Ranks [g·sp, (g+1)·sp) (consecutive: one
    node's GPUs when the ranks per node are a multiple of sp) form replica g: they read the same rows and each holds
    one contiguous slice of every row (``pretrain/sequence_parallel.py``, §3.2.2 LASP+). With sp = 1 every rank
    is a replica of its own."""

    rank: int
    world: int
    sequence_parallel: int = 1

    def __post_init__(self) -> None:
        if self.sequence_parallel < 1 or self.world % self.sequence_parallel:
            raise ValueError(f"sequence_parallel={self.sequence_parallel} must divide the {self.world} training "
                             "ranks (processes x nodes): each group of that many consecutive ranks splits one row")

    @property
    def data_parallel(self) -> int:
        """Replicas: the rows of one optimizer step are shared out over these."""
        return self.world // self.sequence_parallel

    @property
    def data_rank(self) -> int:
        return self.rank // self.sequence_parallel

    @property
    def sequence_rank(self) -> int:
        """Which slice of each row this rank holds."""
        return self.rank % self.sequence_parallel

    def sequence_group(self) -> Any:
        """This rank's sequence-parallel process group. A collective: every rank creates every group, in order."""
        import torch.distributed as dist

        sp = self.sequence_parallel
        groups = [dist.new_group(list(range(g * sp, (g + 1) * sp))) for g in range(self.data_parallel)]
        return groups[self.data_rank]


def init_distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device; a lone process (no launcher) gets a world of one on 127.0.0.1. A process group
    set up before the call is used as it is: Ray Train's workers get theirs (gloo or NCCL, the CUDA device set) before
    they call :func:`run_rank`. With a loopback ``MASTER_ADDR`` every listener the group opens is on loopback
    (:func:`_loopback_store`); any other address is a cluster's, served as torch.distributed does."""
    import deepspeed
    import torch.distributed as dist

    from pretrain.local_ranks import LOOPBACK, free_loopback_port

    cuda = torch.cuda.is_available()
    if not cuda:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce with g++ on first use (50-85 s, ENV-NOTES);
        # gloo does the job for our sizes.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if dist.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing group
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return dist.get_rank(), dist.get_world_size(), device
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": LOOPBACK}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_loopback_port()))
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if cuda:
        torch.cuda.set_device(local)
    backend = "nccl" if cuda else "gloo"
    store = _loopback_store(rank, world)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    deepspeed.init_distributed(dist_backend=backend)  # adopts the group just made, or makes one from MASTER_*
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    return rank, world, device


LOOPBACK_HOSTS = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1", "::1": "::1"}


def _loopback_store(rank: int, world: int) -> Any:
    """The process group's store when ``MASTER_ADDR`` is loopback, its server (rank 0) listening on loopback only:
    torch's own TCPStore server listens on every interface (``*:MASTER_PORT``) whatever ``MASTER_ADDR`` says, so
    rank 0 binds the socket itself and hands it over (``master_listen_fd``). gloo and NCCL are pointed at ``lo``
    for their own listeners unless the user chose an interface. None for a cluster's address, or under torchrun,
    whose agent already serves the store (``TORCHELASTIC_USE_AGENT_STORE``)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    host = LOOPBACK_HOSTS.get(os.environ["MASTER_ADDR"])
    if host is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=default_pg_timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port a previous run's store left in TIME_WAIT
    sock.bind((host, port))
    sock.listen(128)
    return dist.TCPStore(host, port, world, is_master=True, timeout=default_pg_timeout, multi_tenant=True,
                         master_listen_fd=sock.detach())


def build_model(cfg: TrainConfig) -> Any:
    import model  # noqa: F401  (registers the Auto classes)
    from model import HybridForCausalLM, config_for  # heavy: transformers

    special = special_token_ids(cfg.tokenizer_dir)
    overrides = {
        "vocab_size": special["vocab_size"],
        "capacity_factor": cfg.capacity_factor,
        "moe_token_drop": cfg.token_drop,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "lightning_impl": cfg.lightning_impl,
        "bos_token_id": special["bos"],
        "eos_token_id": special["eos"],
        "pad_token_id": special["pad"],
        "use_cache": False,
        **cfg.model_overrides,
    }
    if cfg.init_from:
        return _model_from_checkpoint(cfg, overrides)
    mc = config_for(cfg.size, **overrides)
    if mc.max_position_embeddings < cfg.seq_len:
        mc.max_position_embeddings = cfg.seq_len
    torch.manual_seed(cfg.seed)  # the same DeepNorm init on every rank
    return HybridForCausalLM(mc)


def _model_from_checkpoint(cfg: TrainConfig, overrides: dict[str, Any]) -> Any:
    """The model saved in ``cfg.init_from`` (a checkpoint's ``model/``), its config updated by ``overrides``."""
    from model import HybridConfig, HybridForCausalLM  # heavy: transformers

    mc = HybridConfig.from_pretrained(cfg.init_from)
    if mc.vocab_size != overrides["vocab_size"]:
        raise ValueError(f"the checkpoint in {cfg.init_from} has vocab_size {mc.vocab_size} but the tokenizer in "
                         f"{cfg.tokenizer_dir} has {overrides['vocab_size']}: pass the tokenizer it was trained with")
    for key, value in overrides.items():
        setattr(mc, key, value)
    mc.max_position_embeddings = max(mc.max_position_embeddings, cfg.seq_len)
    return HybridForCausalLM.from_pretrained(cfg.init_from, config=mc, dtype=torch.float32)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (embeddings, projections, experts, router), none on norm gains; expert parameters
    in their own groups (DeepSpeed-MoE reduces them over the expert-data-parallel group)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def accumulation_steps(batch_rows: int, micro_batch_rows: int, data_parallel: int) -> int:
    """Micro-batches per optimizer step: ``batch_rows`` shared out over the data-parallel replicas (a
    sequence-parallel group is one replica: its ranks read the same rows)."""
    return max(1, batch_rows // (micro_batch_rows * data_parallel))


def deepspeed_config(cfg: TrainConfig, world: int, device: torch.device) -> dict[str, Any]:
    gas = accumulation_steps(cfg.batch_rows, cfg.micro_batch_rows, world // cfg.sequence_parallel)
    # DeepSpeed takes every rank for a data-parallel one (it averages gradients over all of them, and checks
    # train_batch_size = micro x gas x ranks): its train_batch_size counts each row once per sequence-parallel rank
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_rows,
        "gradient_accumulation_steps": gas,
        "train_batch_size": cfg.micro_batch_rows * gas * world,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        # check_grad_overflow off: DeepSpeed's per-gradient NaN/inf scan (several small kernels per parameter, ~15%
        # of the host time of a gpu-300m step) is replaced by the global gradient norm, which any NaN/inf makes
        # invalid; the guard installed by _install_spike_guard turns an invalid norm into a skipped step
        "bf16": {"enabled": device.type == "cuda", "check_grad_overflow": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def compile_mode(cfg: TrainConfig, device: torch.device) -> str:
    """torch.compile mode of ``compile_layers``: "reduce-overhead" (CUDA graphs: one replay instead of ~100 kernel
    launches per compiled module call; measured 1.3x on the whole gpu-300m step at 2K x 8, BENCHMARKS.md) on one
    GPU without expert parallelism, whose all-to-all reads split sizes on the host and cannot be captured;
    "default" elsewhere."""
    return "reduce-overhead" if device.type == "cuda" and cfg.expert_parallel_size == 1 else "default"


def compile_layers(model: torch.nn.Module, mode: str | None = None) -> None:
    """torch.compile the RMSNorms and the MoE feed-forwards in place: it fuses the fp32 norm arithmetic and the
    routing/dispatch elementwise work. The attention layers stay eager (their Triton and FlexAttention kernels
    are compiled already, and the packed-document bookkeeping around them does not lower in inductor)."""
    from model.modeling import RMSNorm  # heavy: transformers
    from pretrain.moe import DeepSpeedMoEFeedForward  # heavy: deepspeed, transformers

    for module in model.modules():
        if isinstance(module, RMSNorm | DeepSpeedMoEFeedForward):
            module.compile(dynamic=False, mode=mode)


@contextlib.contextmanager
def eager_layers(model: torch.nn.Module) -> Iterator[None]:
    """Run the modules ``compile_layers`` compiled eagerly inside the block. The held-out evaluation needs this
    under "reduce-overhead": without a pending backward, CUDA-graph trees replay one RMSNorm graph for the next
    layer's norm and overwrite the output the residual still reads ("accessing tensor output of CUDAGraphs that has
    been overwritten by a subsequent run", seen on the H100). Evaluation is a few calls; eager costs nothing."""
    stashed = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
    for m, _ in stashed:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, impl in stashed:
            m._compiled_call_impl = impl


def install_foreach_grad_norm(optimizer: Any) -> None:
    """DeepSpeed's ZeRO-1/2 global gradient norm with one multi-tensor kernel instead of one cast and one norm per
    gradient. ``get_grad_norm_direct`` upcasts every gradient to float64 and norms it alone: 2 kernels and ~60 us
    of host time per parameter, ~160 parameters in gpu-300m (~6 ms of GPU time and ~10 ms of host time per step
    at 2K x 8, BENCHMARKS.md). Here ``torch._foreach_norm`` norms them all in float32 and the squares are summed
    in float64, the rest as DeepSpeed does it (the same gradients skipped, the same all-reduces, an invalid norm
    masked to -1). Only the L2 norm is replaced; other norms go to DeepSpeed's method."""
    from deepspeed import comm as ds_dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace

    original = optimizer.get_grad_norm_direct

    def foreach_norm(gradients: Any, params: Any, norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0:
            return original(gradients, params, norm_type)
        grads = []
        for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params, strict=False):
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue
            if is_model_parallel_parameter(p) or optimizer.model_parallel_rank == 0:
                grads.append(g.detach())
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            total = torch.stack(norms).double().pow(2).sum().float()
        else:
            total = torch.tensor(0.0, dtype=torch.float32, device=optimizer.device)
        ds_dist.all_reduce(total, op=ds_dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        optimizer._model_parallel_all_reduce(tensor=total, op=ds_dist.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)
        return total

    optimizer.get_grad_norm_direct = foreach_norm


def _install_spike_guard(optimizer: Any, guard: GradGuard) -> None:
    """Make DeepSpeed's ZeRO optimizer treat a gradient-norm spike like an overflow (skip + clear grads)."""
    original = optimizer.scaled_global_norm

    def guarded_norm(*args: Any, **kwargs: Any) -> Any:
        norm = original(*args, **kwargs)
        value = float(norm)
        if not math.isfinite(value) or value < 0:  # DeepSpeed reports a NaN/inf norm as -1
            value = math.inf
        value = _max_over_ranks(value, norm.device if torch.is_tensor(norm) else None)
        invalid = not math.isfinite(value)
        guard.last_norm = float("nan") if invalid else value
        if invalid or guard.skip_spike(value):
            guard.spiked = not invalid
            # the step's skip path (gradients cleared, no update): DeepSpeed reads this flag right after the norm,
            # and with bf16 and check_grad_overflow off it would not set it for an invalid norm itself
            optimizer.overflow = True
        return norm

    optimizer.scaled_global_norm = guarded_norm


def _max_over_ranks(value: float, device: torch.device | None) -> float:
    """The largest of every rank's value. The guard's skip decision must be the same on every rank: DeepSpeed's
    norm of the expert parameters is local to a rank under expert parallelism (averaged over the expert-data-
    parallel group, of size 1 when the experts span all ranks), so ranks see different norms, and a rank that
    skips a step while another takes it leaves ZeRO's all-gather of the updated partitions unmatched: the next
    collective pairs with the wrong call and reads garbage (NaN losses right after a one-rank spike skip, seen
    on two GPUs). One scalar all-reduce per step; the guard then judges the largest rank norm."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    if device is None or (dist.get_backend() == "nccl" and device.type != "cuda"):
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


@dataclass
class GradGuard:
    """Which optimizer steps to skip. A non-finite gradient norm is always skipped. A finite norm above
    ``spike_factor`` x the median of the recent accepted norms is skipped as a one-batch outlier at most
    ``max_spike_skips`` steps in a row: a skip leaves the weights where they are, so when the norm stays high the
    next batches spike too and skipping them would only run into ``max_consecutive`` (seen on two GPUs, where
    a run at lr 1e-3 after a 3-step warm-up stopped at norms of 18-21 that one GPU had clipped and trained
    through). The next such step is taken (gradient clipping bounds it), counted in ``accepted_spikes``, and
    its norm joins the history."""

    spike_factor: float
    max_consecutive: int
    max_spike_skips: int = 2
    history: deque = field(default_factory=lambda: deque(maxlen=64))
    skipped: int = 0
    consecutive: int = 0
    spike_run: int = 0  # steps skipped for a spike since the last accepted step
    accepted_spikes: int = 0
    last_norm: float = float("nan")
    spiked: bool = False
    accepting: bool = False

    def is_spike(self, norm: float) -> bool:
        return len(self.history) >= 8 and norm > self.spike_factor * statistics.median(self.history)

    def skip_spike(self, norm: float) -> bool:
        """Whether this finite norm is a spike to skip (False for a spike that has lasted: it is taken)."""
        self.accepting = False
        if not self.is_spike(norm):
            return False
        if self.spike_run < self.max_spike_skips:
            return True
        self.accepting = True
        return False

    def after_step(self, overflow: bool) -> bool:
        """Record one optimizer step; True if it was skipped."""
        skipped = overflow or self.spiked
        if self.spiked:
            self.spike_run += 1
        self.spiked = False
        if skipped:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.consecutive = self.spike_run = 0
            self.accepted_spikes += self.accepting
            if math.isfinite(self.last_norm):
                self.history.append(self.last_norm)
        self.accepting = False
        return skipped

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "skipped": self.skipped, "consecutive": self.consecutive,
                "spike_run": self.spike_run, "accepted_spikes": self.accepted_spikes}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.history = deque(s["history"], maxlen=64)
        self.skipped, self.consecutive = s["skipped"], s["consecutive"]
        self.spike_run, self.accepted_spikes = s.get("spike_run", 0), s.get("accepted_spikes", 0)


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


# --- the loop ------------------------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> dict[str, float]:
    import deepspeed
    import torch.distributed as dist

    from pretrain.loss import install_loss
    from pretrain.moe import install_deepspeed_moe  # heavy: deepspeed, transformers
    from pretrain.packed_data import PackedRows, RowLoader, make_batch, unigram_loss
    from pretrain.schedules import BatchSizeSchedule, WSDSchedule  # heavy: matplotlib
    from pretrain.sequence_parallel import (
        apply_sequence_parallel,
        loss_share,
        sequence_parallel_output,
        shard_batch,
    )

    rank, world, device = init_distributed()
    if cfg.expert_parallel_size < 1 or world % cfg.expert_parallel_size:
        raise ValueError(f"expert_parallel_size={cfg.expert_parallel_size} must divide the world size {world}")
    problems = sequence_parallel_problems(cfg.sequence_parallel, seq_lens={"seq_len": cfg.seq_len},
                                          expert_parallel_size=cfg.expert_parallel_size, compile_=cfg.compile)
    if problems:
        raise ValueError("; ".join(problems))
    grid = RankGrid(rank, world, cfg.sequence_parallel)
    packing = json.loads((Path(cfg.data_dir) / "packing.json").read_text())
    if packing["seq_len"] != cfg.seq_len:
        raise ValueError(f"packed rows are {packing['seq_len']} tokens but seq_len={cfg.seq_len}")
    rows = PackedRows(cfg.data_dir, "train")
    eval_rows = PackedRows(cfg.data_dir, "eval")
    tokens_per_row = cfg.seq_len
    probe = None
    if cfg.probe_every:
        from pretrain.probe import RetrievalProbe

        if cfg.probe_every % cfg.log_every or grid.sequence_parallel > 1:
            raise ValueError(f"probe_every={cfg.probe_every} must be a multiple of log_every={cfg.log_every}, "
                             "without sequence parallelism")
        probe = RetrievalProbe(cfg.tokenizer_dir, eval_rows, seq_len=cfg.seq_len, trials=cfg.probe_trials,
                               seed=cfg.seed)

    model = build_model(cfg)
    model_config = model.config
    ep_rank = rank % cfg.expert_parallel_size  # DeepSpeed's E+D layout: ranks [0..ep) form expert group 0
    install_deepspeed_moe(model, ep_size=cfg.expert_parallel_size, ep_rank=ep_rank,
                          global_router=cfg.global_router, min_capacity=cfg.min_capacity)
    sp = None  # the sequence-parallel plan (pretrain/sequence_parallel.py), applied from outside the model
    if grid.sequence_parallel > 1:
        sp = apply_sequence_parallel(model, grid.sequence_group())
    optimizer = torch.optim.AdamW(optimizer_groups(model, cfg.weight_decay), lr=cfg.peak_lr,
                                  betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=device.type == "cuda")
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=deepspeed_config(cfg, world, device))
    guard = GradGuard(cfg.spike_factor, cfg.max_consecutive_skips, cfg.max_spike_skips)
    install_foreach_grad_norm(optimizer)
    _install_spike_guard(optimizer, guard)
    install_loss(engine.module, cfg.compile)
    if cfg.compile:
        compile_layers(engine.module, mode=compile_mode(cfg, device))
    forward = engine

    initial_batch_tokens = cfg.batch_rows * tokens_per_row
    lr_schedule = WSDSchedule.from_total(
        cfg.peak_lr, max(1, cfg.train_tokens // initial_batch_tokens), warmup_frac=cfg.warmup_frac,
        decay_frac=cfg.decay_frac, final_lr_ratio=cfg.final_lr_ratio)
    batch_schedule = BatchSizeSchedule(cfg.batch_rows, cfg.max_batch_rows, cfg.double_at_tokens,
                                       cfg.double_below_loss)
    # the ranks of a sequence-parallel group read the same rows (each then takes its slice of them)
    loader = RowLoader(rows, seed=cfg.seed, rank=grid.data_rank, world_size=grid.data_parallel,
                       shuffle=not cfg.ordered_rows)

    step, tokens_seen, history = 0, 0, []
    num_layers = model_config.num_hidden_layers
    routed_sum = torch.zeros(num_layers, model_config.num_experts, dtype=torch.float64, device=device)
    dropped_sum = torch.zeros_like(routed_sum)
    ckpt_dir = Path(cfg.resume_dir) / CHECKPOINT_DIR
    resumed = (ckpt_dir / "latest").exists()
    if resumed:
        _, client = engine.load_checkpoint(str(ckpt_dir), load_lr_scheduler_states=False)
        step, tokens_seen, history = client["step"], client["tokens_seen"], client["history"]
        loader.load_state_dict(client["loader"])
        batch_schedule.load_state_dict(client["batch_schedule"])
        guard.load_state_dict(client["guard"])
        _set_rng_state(client["rng"])
        if rank == 0:  # whole-run expert load: the checkpoint holds the sums over all ranks
            routed_sum += client["expert_routed"].to(device)
            dropped_sum += client["expert_dropped"].to(device)
        emit("progress", {"message": f"resumed from step {step} ({tokens_seen:,} tokens) in {ckpt_dir}"}, rank)

    peak = measured_peak_flops(device)
    from model.accounting import packed_flops  # heavy: transformers

    log_path = Path(cfg.export_dir) / TRAIN_LOG
    Path(cfg.export_dir).mkdir(parents=True, exist_ok=True)
    if rank == 0:  # the log restarts from the checkpoint's history (lines after it are from the killed attempt)
        log_path.write_text("".join(json.dumps(h) + "\n" for h in history))

    def save_checkpoint() -> None:
        client = {"step": step, "tokens_seen": tokens_seen, "history": history, "loader": loader.state_dict(),
                  "batch_schedule": batch_schedule.state_dict(), "guard": guard.state_dict(),
                  "rng": _rng_state(), "expert_routed": _sum_over_ranks(routed_sum).cpu(),
                  "expert_dropped": _sum_over_ranks(dropped_sum).cpu()}  # collectives: every rank
        engine.save_checkpoint(str(ckpt_dir), tag=f"step{step:08d}", client_state=client)
        if rank == 0:  # keep the newest few
            tags = sorted(p for p in ckpt_dir.glob("step*") if p.is_dir())
            for old in tags[: -cfg.keep_checkpoints]:
                import shutil

                shutil.rmtree(old, ignore_errors=True)

    window_t, window_tokens, window_losses, window_aux = time.perf_counter(), 0, [], []
    window_flops = 0.0  # model FLOPs of this rank's batches since the last log (model.accounting.packed_flops)
    aux_coef = model_config.router_aux_loss_coef  # what the model adds to the loss (cfg.aux_loss_coef)
    window_start = torch.stack([routed_sum.sum(), dropped_sum.sum()])  # routed, dropped at the last log
    if not resumed:  # a valid checkpoint exists from the start: the guard's error can always point at one
        save_checkpoint()
    train_start = time.perf_counter()
    engine.train()
    while tokens_seen < cfg.train_tokens:
        batch_rows = batch_schedule.batch_size
        gas = accumulation_steps(batch_rows, cfg.micro_batch_rows, grid.data_parallel)
        if gas != engine.gradient_accumulation_steps():
            engine.set_train_batch_size(cfg.micro_batch_rows * gas * world)
        lr = lr_schedule.lr(tokens_seen // initial_batch_tokens)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss_t = torch.zeros((), dtype=torch.float64, device=device)  # on the device: read once a step
        step_aux_t = torch.zeros((), dtype=torch.float64, device=device)
        step_tokens = 0
        for _ in range(gas):
            batch = make_batch(rows, loader.next_indices(cfg.micro_batch_rows))
            if sp is None:
                out = forward(input_ids=batch.input_ids.to(device), labels=batch.labels.to(device),
                              cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids.to(device),  # bounds: host
                              output_router_logits=True)
                loss = out.loss
            else:
                shard = shard_batch(batch.input_ids, batch.labels, batch.position_ids, batch.cu_seqlens,
                                    grid.sequence_rank, grid.sequence_parallel).to(device)
                out = sequence_parallel_output(forward, sp, shard, output_router_logits=True)
                # The group's shares sum to the row's loss, so the sum of their gradients is the row's gradient;
                # DeepSpeed averages over all world = DP x SP ranks, so each share is scaled by SP: the average of
                # SP x (share gradients) is the mean over the DP replicas of the whole-row gradients
                loss = loss_share(out, shard, aux_coef) * grid.sequence_parallel
            if step in cfg.inject_nan_at_steps:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
            aux = out.aux_loss.detach()  # global over a sequence-parallel group: every rank has the row's
            # the row's cross-entropy (under SP this rank's part; the group's parts are summed after the step)
            step_loss_t += (loss.detach() - aux_coef * aux).double() / (gas * grid.sequence_parallel)
            step_aux_t += aux.double() / gas
            step_tokens += batch.input_ids.numel()  # this replica's rows
            # this rank's documents; a sequence-parallel rank computes 1/SP of its replica's
            window_flops += packed_flops(model_config, np.diff(batch.cu_seqlens.numpy())) / grid.sequence_parallel
            routed_sum += out.moe_routed.detach()  # on the device: no sync until the next log
            dropped_sum += out.moe_dropped.detach()
        skipped = guard.after_step(bool(getattr(optimizer, "overflow", False)))
        if world > 1:
            # the step's loss over the whole batch, the same number on every rank: a sequence-parallel group's parts
            # summed into its rows' loss, then the mean over the data-parallel replicas. The batch schedule's
            # loss triggers (double_batch_below_loss) read it, so every rank changes the batch size at the same
            # step (with each replica's own loss they could disagree and wait on each other forever)
            dist.all_reduce(step_loss_t)
            step_loss_t /= grid.data_parallel
        step_loss, step_aux = torch.stack([step_loss_t, step_aux_t]).tolist()  # one host sync per step
        step += 1
        global_tokens = step_tokens * grid.data_parallel
        tokens_seen += global_tokens
        window_tokens += global_tokens
        if guard.consecutive >= cfg.max_consecutive_skips:
            raise DivergenceError(
                f"{guard.consecutive} optimizer steps in a row were skipped (non-finite loss/gradients or grad-norm "
                f"spikes above {cfg.spike_factor}x the recent median) at step {step}; the last valid checkpoint is "
                f"in {ckpt_dir}. Rerunning with the same params resumes from it (and likely diverges again); a "
                f"lower learning rate or other params start a new run under a new cache key.")
        if not skipped:
            window_losses.append(step_loss)
            window_aux.append(step_aux)
            batch_schedule.update(tokens_seen, step_loss)
        if step % cfg.log_every == 0 or tokens_seen >= cfg.train_tokens:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            tps = window_tokens / (now - window_t)
            totals = torch.stack([routed_sum.sum(), dropped_sum.sum()])
            window = torch.cat([totals - window_start, totals.new_tensor([window_flops])])
            window_routed, window_dropped, flops_all = _sum_over_ranks(window).tolist()  # all ranks
            window_start = totals
            metrics = {
                "loss": statistics.fmean(window_losses) if window_losses else float("nan"),
                "aux_loss": statistics.fmean(window_aux) if window_aux else float("nan"),
                "lr": lr, "batch_size": batch_rows, "grad_norm": guard.last_norm,
                "tokens_per_second": tps, "mfu": flops_all / (now - window_t) / (peak * world),
                "drop_rate": window_dropped / max(window_routed, 1.0),  # all ranks' slots since the last log
                "memory_gb": memory_gb(device), "tokens": tokens_seen, "skipped_steps": guard.skipped,
                "accepted_spikes": guard.accepted_spikes,
            }
            if probe is not None and (step % cfg.probe_every == 0 or tokens_seen >= cfg.train_tokens):
                probe_t = time.perf_counter()
                with eager_layers(engine.module):
                    metrics |= probe.run(engine.module, device)
                metrics["probe_seconds"] = time.perf_counter() - probe_t
                emit("progress", {"message": (
                    f"probe at step {step}: copy accuracy {metrics['copy_accuracy']:.3f}, NIAH forced choice "
                    f"{metrics['niah_choice_accuracy']:.2f} (chance {probe.chance:.2f}), margin "
                    f"{metrics['niah_answer_margin']:+.2f} nats")}, rank)
            history.append({"step": step, **metrics})
            if rank == 0:
                with open(log_path, "a") as f:
                    f.write(json.dumps(history[-1]) + "\n")
            emit("metrics", {"step": step, "metrics": metrics}, rank)
            emit("progress", {"message": (
                f"step {step} · {tokens_seen:,}/{cfg.train_tokens:,} tokens · loss {metrics['loss']:.4f} · "
                f"lr {lr:.2e} · batch {batch_rows} · {tps:,.0f} tok/s · mfu {metrics['mfu']:.1%} · "
                f"drop {metrics['drop_rate']:.2%} · skipped {guard.skipped}")}, rank)
            window_t, window_tokens, window_losses, window_aux = time.perf_counter(), 0, [], []
            window_flops = 0.0
        if step % cfg.checkpoint_every == 0:
            save_checkpoint()
    save_checkpoint()
    train_seconds = time.perf_counter() - train_start

    # --- end: held-out loss, expert load, export -------------------------------------------------------------
    engine.eval()
    with eager_layers(engine.module):
        eval_loss = evaluate(engine, eval_rows, make_batch, cfg, device, grid, sp)
    uni = unigram_loss(eval_rows, np.load(Path(cfg.data_dir) / "unigram_counts.npy"))
    routed_all = _sum_over_ranks(routed_sum).cpu()
    dropped_all = _sum_over_ranks(dropped_sum).cpu()
    export_checkpoint(engine.module, model_config, cfg, rank)
    summary = {"eval_loss": eval_loss, "unigram_loss": uni, "steps": step, "tokens": tokens_seen,
               "skipped_steps": guard.skipped, "accepted_spikes": guard.accepted_spikes,
               "train_seconds": train_seconds,
               "drop_rate": float(dropped_all.sum() / max(routed_all.sum(), 1.0))}
    if rank == 0:
        np.save(Path(cfg.export_dir) / "expert_routed.npy", routed_all.numpy())
        np.save(Path(cfg.export_dir) / "expert_dropped.npy", dropped_all.numpy())
        (Path(cfg.export_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    emit("summary", {"summary": summary}, rank)
    dist.barrier()
    dist.destroy_process_group()
    return summary


@torch.no_grad()
def evaluate(engine: Any, eval_rows: Any, make_batch: Any, cfg: TrainConfig, device: torch.device,
             grid: RankGrid | None = None, sp: Any = None) -> float:
    """Mean next-token cross-entropy (nats) over the held-out rows' label positions, dropless (eval mode). The rows
    are shared out over the data-parallel replicas; under sequence parallelism (``sp``, the plan of
    ``pretrain/sequence_parallel.py``) each rank of a replica scores its slice of them."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from pretrain.sequence_parallel import (
        IGNORE_INDEX,
        sequence_parallel_output,
        shard_batch,
        shard_cross_entropy_sum,
    )

    grid = grid or RankGrid(dist.get_rank(), dist.get_world_size())
    n = min(len(eval_rows), cfg.eval_max_rows)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    mine = list(range(grid.data_rank, n, grid.data_parallel))
    # every rank runs the same number of calls (expert parallelism needs all ranks in each layer's all-to-all,
    # sequence parallelism all ranks of a group in each layer's all-gather)
    calls = math.ceil(math.ceil(n / grid.data_parallel) / cfg.micro_batch_rows)
    for c in range(calls):
        idx = mine[c * cfg.micro_batch_rows:(c + 1) * cfg.micro_batch_rows] or [0]
        batch = make_batch(eval_rows, idx)
        padding = c * cfg.micro_batch_rows >= len(mine)  # a padding call of a rank with fewer rows
        if sp is None:
            out = engine(input_ids=batch.input_ids.to(device), cu_seqlens=batch.cu_seqlens.to(device),
                         position_ids=batch.position_ids.to(device), output_router_logits=False)
            if padding:
                continue
            logits = out.logits[0, :-1].float()
            labels = batch.labels[0, 1:].to(device)
            total[0] += F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum").double()
            total[1] += (labels != IGNORE_INDEX).sum()
        else:
            shard = shard_batch(batch.input_ids, batch.labels, batch.position_ids, batch.cu_seqlens,
                                grid.sequence_rank, grid.sequence_parallel).to(device)
            out = sequence_parallel_output(engine, sp, shard, output_router_logits=False)
            if padding:
                continue
            total[0] += shard_cross_entropy_sum(out.logits, shard).double()
            total[1] += (shard.shifted_labels != IGNORE_INDEX).sum()
    dist.all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Sum over every rank (each counts its own tokens: a sequence-parallel rank those of its slice)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return t
    x = t.clone()
    dist.all_reduce(x)
    return x


def run_rank(config_path: str | Path, events_path: str | Path | None = None) -> dict[str, float]:
    """One rank's whole job, whoever launched it: :func:`main` (a lone process or a local rank) and a Ray Train
    worker (``pretrain/stage.py``) both call this. ``events_path``: rank 0 appends its stdout, the ``@@hylight`` lines
    included, to that file (a Ray Train worker's stdout does not reach the stage's process)."""
    import socket

    config_path = Path(config_path)
    if not config_path.is_file():
        raise FileNotFoundError(
            f"pretrain rank on {socket.gethostname()}: the stage's config {config_path} is not visible here. Every "
            "node of a multi-node stage reads the packed data and writes checkpoints and exports under the pipeline's "
            "artifact_root: put it on a filesystem all nodes share, at the same path (README, 'Multi-node training').")
    cfg = TrainConfig.load(config_path)
    if events_path is None or os.environ.get("RANK", "0") != "0":
        return train(cfg)
    with open(events_path, "a", buffering=1, encoding="utf-8") as events, contextlib.redirect_stdout(events):
        return train(cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="One rank of the hylight pretrain stage (launched by the stage).")
    ap.add_argument("--config", required=True, help="TrainConfig JSON written by the pretrain stage")
    args = ap.parse_args(argv)
    try:
        run_rank(args.config)
    except DivergenceError as e:
        print(f"pretrain: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

