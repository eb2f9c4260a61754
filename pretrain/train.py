"""One training rank on DeepSpeed: what every rank runs, CPU tiny and multi-GPU alike.

``python -m pretrain.train --config CONFIG.json`` is what the ``pretrain`` and ``long_context`` stages launch (one
process on a CPU or one GPU, ``pretrain/local_ranks.py`` for several GPUs of one node; ``pretrain/launch.py``); a Ray
Train worker of a multi-node stage calls the same :func:`run_rank`. The config is ``pretrain/engine_config.py``'s
:class:`~pretrain.engine_config.EngineConfig`. :func:`train` sets the run up and hands it to the loop
(``pretrain/trainer.py``, its callbacks in ``pretrain/callbacks.py``): it reads packed rows
(``pretrain/packed_data.py``), builds the ``model/`` hybrid with DeepNorm init, swaps its MoE layers for DeepSpeed-MoE
ones with the global router (``pretrain/moe.py``), and trains with ``deepspeed.initialize`` (ZeRO stage 1 or 2, torch
AdamW with the report's β = (0.9, 0.95) and weight decay 0.1, gradient clipping, bf16 on GPU / fp32 on CPU), under the
WSD learning-rate schedule and the critical-batch-size doubling of §4.2 (``pretrain/schedules.py``); at the end it
scores the held-out rows and exports the model (``pretrain/export.py``).

Sequence parallelism (``sequence_parallel`` = SP > 1, :class:`RankGrid`): groups of SP consecutive ranks are one
data-parallel replica each. A group's ranks read the same rows, each takes its contiguous slice of them
(``pretrain/sequence_parallel.py``: LASP+ for lightning layers, a K/V all-gather for softmax ones, the balance loss
made global), and backpropagates SP x its share of the loss: the shares sum to the rows' loss and DeepSpeed
averages gradients over all ranks, so the update is the data-parallel one. The logged loss (the one the batch
schedule reads) is the whole batch's on every rank: each group's parts summed, averaged over the replicas.

Rank 0 reports to the parent through stdout lines ``@@hylight {json}`` (``pretrain/events.py``: metrics, progress,
the summary), which the stage forwards to MLflow, and appends every logged step to ``train_log.jsonl`` in the export
directory. Checkpoints and resume: ``pretrain/callbacks.py``; the divergence guard: ``pretrain/grad_guard.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.constants import default_pg_timeout

from data.tokenizer import special_token_ids
from pipeline.artifacts import write_text_atomic
from pretrain.callbacks import (
    BatchSizeScheduleCallback,
    CheckpointCallback,
    Checkpointer,
    DivergenceGuardCallback,
    LogCallback,
    ProbeCallback,
    ThroughputCallback,
    measured_peak_flops,  # noqa: F401  (bench/ imports it from here)
)
from pretrain.engine_config import EngineConfig
from pretrain.events import emit
from pretrain.export import export_checkpoint
from pretrain.grad_guard import DivergenceError, GradGuard, install_spike_guard
from pretrain.local_ranks import LOOPBACK, STORE_FD_ENV, free_loopback_port, listening_loopback_socket
from pretrain.loss import install_loss
from pretrain.packed_data import UNIGRAM_FILE, PackedRows, make_batch, make_loader, unigram_loss
from pretrain.probe import RetrievalProbe
from pretrain.schedules import BatchSizeSchedule, WSDSchedule
from pretrain.sequence_parallel import (
    IGNORE_INDEX,
    apply_sequence_parallel,
    sequence_parallel_output,
    shard_batch,
    shard_cross_entropy_sum,
)
from pretrain.trainer import Trainer, accumulation_steps, eager_layers

CHECKPOINT_DIR = "deepspeed"
TrainConfig = EngineConfig  # the rank config's earlier name (bench/ and tests build it under this one)

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
        sp = self.sequence_parallel
        groups = [dist.new_group(list(range(g * sp, (g + 1) * sp))) for g in range(self.data_parallel)]
        return groups[self.data_rank]


def init_distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device; a lone process (no launcher) gets a world of one on 127.0.0.1. A process group
    set up before the call is used as it is: Ray Train's workers get theirs (gloo or NCCL, the CUDA device set) before
    they call :func:`run_rank`. With a loopback ``MASTER_ADDR`` every listener the group opens is on loopback
    (:func:`_loopback_store`); any other address is a cluster's, served as torch.distributed does."""
    import deepspeed  # heavy: deepspeed

    cuda = torch.cuda.is_available()
    if not cuda:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce with g++ on first use (50-85 s, ENV-NOTES);
        # gloo does the job for our sizes.
        import deepspeed.ops  # heavy: deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if dist.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing group
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return dist.get_rank(), dist.get_world_size(), device
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": LOOPBACK}.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ and os.environ["MASTER_ADDR"] == LOOPBACK:
        # a lone process: its store's port bound here, not looked up and bound later (another job could take it)
        sock = listening_loopback_socket()
        os.environ["MASTER_PORT"], os.environ[STORE_FD_ENV] = str(sock.getsockname()[1]), str(sock.detach())
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
    host = LOOPBACK_HOSTS.get(os.environ["MASTER_ADDR"])
    inherited = os.environ.pop(STORE_FD_ENV, None)  # pretrain.local_ranks bound the port before any rank started
    if host is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        if inherited is not None:  # not ours to serve: free the port for whoever serves the store
            os.close(int(inherited))
        return None
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        if inherited is not None:
            os.close(int(inherited))
        return dist.TCPStore(host, port, world, is_master=False, timeout=default_pg_timeout)
    if inherited is not None:
        listen_fd = int(inherited)
        os.set_inheritable(listen_fd, False)  # a process this rank starts must not keep the store's port
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port a previous run's store left in TIME_WAIT
        sock.bind((host, port))
        sock.listen(128)
        listen_fd = sock.detach()
    return dist.TCPStore(host, port, world, is_master=True, timeout=default_pg_timeout, multi_tenant=True,
                         master_listen_fd=listen_fd)


def build_model(cfg: EngineConfig) -> Any:
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
    lm = HybridForCausalLM(mc)
    if cfg.head_init == "embedding" and not mc.tie_word_embeddings:
        init_head_from_embedding(lm)
    if cfg.unigram_init:
        if mc.tie_word_embeddings:
            raise ValueError("unigram_init needs an untied output head (the released model's): "
                             "tie_word_embeddings is set")
        counts = np.load(Path(cfg.data_dir) / UNIGRAM_FILE)
        rows = PackedRows(cfg.data_dir, "eval")
        rows = rows if len(rows) else PackedRows(cfg.data_dir, "train")
        ids = rows.row(0)[0][:UNIGRAM_INIT_TOKENS]
        init_unigram_direction(lm, counts, torch.as_tensor(np.asarray(ids, np.int64))[None], cfg.unigram_init)
    return lm


UNIGRAM_INIT_TOKENS = 256  # the held-out tokens whose final hidden states measure the shared direction's reading
UNIGRAM_INIT_SEED = 1234  # of the shared direction: the same on every rank


@torch.no_grad()
def init_unigram_direction(model: Any, unigram_counts: np.ndarray, input_ids: torch.Tensor, share: float) -> float:
    """``unigram_init``: add one fixed unit direction w to every embedding row (``share`` times a row's mean norm)
    and the rank-1 term u w^T / c to the untied head, where u is the centred log unigram (add-one smoothed) and c the
    mean of the final hidden states along w on ``input_ids``: the logits then start near the unigram distribution
    through a direction every token carries, instead of one the layers must build. Without it all-softmax models
    fit the unigram by turning every softmax output into one shared vector and stay on the unigram plateau
    (BENCHMARKS.md, "why all-softmax stalls"). Changes the initial weights only, no parameter is added, and the
    released architecture is unchanged. The same seed gives the same init on every rank. Returns c."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    d = embed.shape[1]
    w = torch.randn(d, generator=torch.Generator().manual_seed(UNIGRAM_INIT_SEED), dtype=torch.float64)
    w = (w / w.norm()).to(embed.dtype)
    embed.add_(share * embed.norm(dim=1).mean() * w)
    was_training = model.training
    model.eval()
    h = model.model(input_ids=input_ids.to(embed.device)).last_hidden_state
    model.train(was_training)
    c = float((h.float() @ w.float()).mean())
    if not abs(c) > 1e-3:
        raise ValueError(f"unigram_init: the final hidden states carry the shared direction at {c:.2e}: too little "
                         f"to read the unigram from; raise unigram_init ({share})")
    counts = np.asarray(unigram_counts, np.float64)
    log_p = np.log(counts + 1.0) - np.log(counts.sum() + counts.size)
    u = torch.from_numpy(log_p - log_p.mean()).to(head.dtype)
    head.add_(torch.outer(u, w.to(head.dtype)) / c)
    return c


def init_head_from_embedding(model: Any) -> None:
    """Start the (untied) output head as a copy of the input embedding (``head_init: embedding``): the logit of id
    i for an input whose last hidden state is id i's embedding is then its largest, so copying an id needs no map
    back from embedding space to be learnt first. The two stay separate parameters."""
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if head.shape != embed.shape:
        raise ValueError(f"head_init: embedding needs the output head {tuple(head.shape)} to match the embedding "
                         f"{tuple(embed.shape)}")
    with torch.no_grad():
        head.copy_(embed)


def _model_from_checkpoint(cfg: EngineConfig, overrides: dict[str, Any]) -> Any:
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
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # heavy: deepspeed

    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def deepspeed_config(cfg: EngineConfig, world: int, device: torch.device) -> dict[str, Any]:
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


def compile_mode(cfg: EngineConfig, device: torch.device) -> str:
    """torch.compile mode of ``compile_layers``: "reduce-overhead" (CUDA graphs: one replay instead of ~100 kernel
    launches per compiled module call; measured 1.3x on the whole gpu-300m step at 2K x 8, BENCHMARKS.md) on one
    GPU without expert parallelism, whose all-to-all reads split sizes on the host and cannot be captured;
    "default" elsewhere."""
    return "reduce-overhead" if device.type == "cuda" and cfg.expert_parallel_size == 1 else "default"


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs


def compile_layers(model: torch.nn.Module, mode: str | None = None) -> list[torch.nn.Parameter]:
    """torch.compile the RMSNorms and the MoE feed-forwards in place: it fuses the fp32 norm arithmetic and the
    routing/dispatch elementwise work. The attention layers stay eager (their Triton and FlexAttention kernels
    are compiled already, and the packed-document bookkeeping around them does not lower in inductor). Returns the
    parameters whose gradients CUDA graphs write (the compiled modules' in a CUDA-graph mode, else none): the
    trainer moves them out of the graphs' memory between micro-batches (``pretrain/trainer.release_graph_grads``)."""
    from model.modeling import RMSNorm  # heavy: transformers
    from pretrain.moe import DeepSpeedMoEFeedForward  # heavy: deepspeed, transformers

    params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, RMSNorm | DeepSpeedMoEFeedForward):
            module.compile(dynamic=False, mode=mode)
            params |= {id(p): p for p in module.parameters() if p.requires_grad}
    return list(params.values()) if mode in CUDA_GRAPH_MODES else []


def install_foreach_grad_norm(optimizer: Any) -> None:
    """DeepSpeed's ZeRO-1/2 global gradient norm with one multi-tensor kernel instead of one cast and one norm per
    gradient. ``get_grad_norm_direct`` upcasts every gradient to float64 and norms it alone: 2 kernels and ~60 us
    of host time per parameter, ~160 parameters in gpu-300m (~6 ms of GPU time and ~10 ms of host time per step
    at 2K x 8, BENCHMARKS.md). Here ``torch._foreach_norm`` norms them all in float32 and the squares are summed
    in float64, the rest as DeepSpeed does it (the same gradients skipped, the same all-reduces, an invalid norm
    masked to -1). Only the L2 norm is replaced; other norms go to DeepSpeed's method."""
    from deepspeed import comm as ds_dist  # heavy: deepspeed
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


# --- the loop ------------------------------------------------------------------------------------------------


def train(cfg: EngineConfig) -> dict[str, float]:
    """One rank's run: set up, :meth:`Trainer.fit`, then the held-out loss, the expert load and the export."""
    from model.accounting import packed_flops  # heavy: transformers

    rank, world, device = init_distributed()
    if cfg.expert_parallel_size < 1 or world % cfg.expert_parallel_size:
        raise ValueError(f"expert_parallel_size={cfg.expert_parallel_size} must divide the world size {world}")
    grid = RankGrid(rank, world, cfg.sequence_parallel)
    packing = json.loads((Path(cfg.data_dir) / "packing.json").read_text())
    if packing["seq_len"] != cfg.seq_len:
        raise ValueError(f"packed rows are {packing['seq_len']} tokens but seq_len={cfg.seq_len}")
    rows = PackedRows(cfg.data_dir, "train")
    eval_rows = PackedRows(cfg.data_dir, "eval")
    probe = None  # its params were checked with the stage's (pretrain/params.py): a multiple of log_every, SP 1
    if cfg.probe_every:
        probe = RetrievalProbe(cfg.tokenizer_dir, eval_rows, seq_len=cfg.seq_len, trials=cfg.probe_trials,
                               seed=cfg.seed)

    engine, optimizer, guard, sp, graph_params = build_engine(cfg, grid, device)
    model_config = engine.module.config
    lr_schedule = WSDSchedule.from_total(
        cfg.peak_lr, max(1, cfg.train_tokens // (cfg.batch_rows * cfg.seq_len)), warmup_frac=cfg.warmup_frac,
        decay_frac=cfg.decay_frac, final_lr_ratio=cfg.final_lr_ratio)
    batch_schedule = BatchSizeSchedule(cfg.batch_rows, cfg.max_batch_rows, cfg.double_batch_at_tokens,
                                       cfg.double_batch_below_loss)
    # the ranks of a sequence-parallel group read the same rows (each then takes its slice of them)
    loader = make_loader(rows, seed=cfg.seed, rank=grid.data_rank, world_size=grid.data_parallel,
                         shuffle=not cfg.ordered_rows)
    ckpt_dir = Path(cfg.resume_dir) / CHECKPOINT_DIR
    checkpointer = Checkpointer(ckpt_dir, cfg.keep_checkpoints)
    callbacks = [
        DivergenceGuardCallback(cfg.max_consecutive_skips, cfg.spike_factor,
                                ckpt_dir if cfg.checkpoint_every else None),
        BatchSizeScheduleCallback(),
        ThroughputCallback(),
        *([ProbeCallback(probe, cfg.probe_every)] if probe is not None else []),
        LogCallback(Path(cfg.export_dir), cfg.train_tokens),
        CheckpointCallback(checkpointer, cfg.checkpoint_every),  # last: a checkpoint holds the step's log
    ]
    trainer = Trainer(cfg, engine=engine, optimizer=optimizer, grid=grid, device=device, rows=rows, loader=loader,
                      make_batch=make_batch, lr_schedule=lr_schedule, batch_schedule=batch_schedule, guard=guard,
                      sp=sp, flops_of=lambda b: packed_flops(model_config, np.diff(b.cu_seqlens.numpy())),
                      callbacks=callbacks, graph_params=graph_params)
    trainer.resumed = checkpointer.load(trainer)
    trainer.fit()

    # --- end: held-out loss, expert load, export -------------------------------------------------------------
    engine.eval()
    with eager_layers(engine.module):
        eval_loss = evaluate(engine, eval_rows, make_batch, cfg, device, grid, sp)
    uni = unigram_loss(eval_rows, np.load(Path(cfg.data_dir) / "unigram_counts.npy"))
    routed_all, dropped_all = trainer.expert_load()
    export_checkpoint(engine.module, model_config, cfg, rank)
    summary = {"eval_loss": eval_loss, "unigram_loss": uni, "steps": trainer.state.step,
               "tokens": trainer.state.tokens_seen, "skipped_steps": guard.skipped,
               "accepted_spikes": guard.accepted_spikes, "train_seconds": trainer.train_seconds,
               "drop_rate": float(dropped_all.sum() / max(routed_all.sum(), 1.0))}
    if rank == 0:
        np.save(Path(cfg.export_dir) / "expert_routed.npy", routed_all.numpy())
        np.save(Path(cfg.export_dir) / "expert_dropped.npy", dropped_all.numpy())
        write_text_atomic(Path(cfg.export_dir) / "summary.json", json.dumps(summary, indent=2) + "\n")
    emit("summary", {"summary": summary}, rank)
    dist.barrier()
    dist.destroy_process_group()
    return summary


def build_engine(cfg: EngineConfig, grid: RankGrid,
                 device: torch.device) -> tuple[Any, Any, GradGuard, Any, list[torch.nn.Parameter]]:
    """The model (DeepNorm init, or ``init_from``'s weights) with DeepSpeed-MoE layers and, under sequence
    parallelism, its plan; AdamW inside DeepSpeed's engine with the divergence guard and the one-kernel gradient norm
    installed, the fused loss, and the compiled layers. Returns (engine, optimizer, guard, sequence-parallel plan,
    the parameters whose gradients CUDA graphs write)."""
    import deepspeed  # heavy: deepspeed

    from pretrain.moe import install_deepspeed_moe  # heavy: deepspeed, transformers

    model = build_model(cfg)
    ep_rank = grid.rank % cfg.expert_parallel_size  # DeepSpeed's E+D layout: ranks [0..ep) form expert group 0
    install_deepspeed_moe(model, ep_size=cfg.expert_parallel_size, ep_rank=ep_rank,
                          global_router=cfg.global_router, min_capacity=cfg.min_capacity)
    sp = None  # the sequence-parallel plan (pretrain/sequence_parallel.py), applied from outside the model
    if grid.sequence_parallel > 1:
        sp = apply_sequence_parallel(model, grid.sequence_group())
    optimizer = torch.optim.AdamW(optimizer_groups(model, cfg.weight_decay), lr=cfg.peak_lr,
                                  betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=device.type == "cuda")
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=deepspeed_config(cfg, grid.world, device))
    guard = GradGuard(cfg.spike_factor, cfg.max_consecutive_skips, cfg.max_spike_skips)
    install_foreach_grad_norm(optimizer)
    install_spike_guard(optimizer, guard)
    install_loss(engine.module, cfg.compile)
    graph_params = compile_layers(engine.module, mode=compile_mode(cfg, device)) if cfg.compile else []
    return engine, optimizer, guard, sp, graph_params


@torch.no_grad()
def evaluate(engine: Any, eval_rows: Any, make_batch: Any, cfg: EngineConfig, device: torch.device,
             grid: RankGrid | None = None, sp: Any = None) -> float:
    """Mean next-token cross-entropy (nats) over the held-out rows' label positions, dropless (eval mode). The rows
    are shared out over the data-parallel replicas; under sequence parallelism (``sp``, the plan of
    ``pretrain/sequence_parallel.py``) each rank of a replica scores its slice of them."""
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


def run_rank(config_path: str | Path, events_path: str | Path | None = None) -> dict[str, float]:
    """One rank's whole job, whoever launched it: :func:`main` (a lone process or a local rank) and a Ray Train
    worker (``pretrain/launch.py``) both call this. ``events_path``: rank 0 appends its stdout, the ``@@hylight`` lines
    included, to that file (a Ray Train worker's stdout does not reach the stage's process)."""
    config_path = Path(config_path)
    if not config_path.is_file():
        raise FileNotFoundError(
            f"pretrain rank on {socket.gethostname()}: the stage's config {config_path} is not visible here. Every "
            "node of a multi-node stage reads the packed data and writes checkpoints and exports under the pipeline's "
            "artifact_root: put it on a filesystem all nodes share, at the same path (README, 'Multi-node training').")
    cfg = EngineConfig.load(config_path)
    if events_path is None or os.environ.get("RANK", "0") != "0":
        return train(cfg)
    with open(events_path, "a", buffering=1, encoding="utf-8") as events, contextlib.redirect_stdout(events):
        return train(cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="One rank of the hylight pretrain stage (launched by the stage).")
    ap.add_argument("--config", required=True, help="EngineConfig JSON written by the stage")
    args = ap.parse_args(argv)
    try:
        run_rank(args.config)
    except DivergenceError as e:
        print(f"pretrain: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

