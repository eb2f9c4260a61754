"""The training engine's config: every knob defined once, typed, and the file each rank reads.

Three layers, each a pydantic model (no torch here: stage params are validated without it):

- :class:`EngineKnobs`: optimizer, schedule shape, MoE, parallelism, checkpointing, the divergence guard, kernels and
  the in-training probe. Both training stages' params carry them flat (``pretrain.peak_lr`` in a DAG), through
  ``pretrain/params.py``'s ``TrainingParams``.
- :class:`RunShape`: what one training run is (model size, row length, batch rows and their schedule, token budget).
  ``pretrain``'s params carry it as it is; ``long_context`` derives one per phase.
- :class:`EngineConfig`: the two plus where the run reads and writes. The stage builds it
  (:meth:`EngineConfig.for_run`), writes it to its work dir (:meth:`EngineConfig.write`), and every rank reads it
  back (:meth:`EngineConfig.load`): the rank config is this model, not a copy of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.artifacts import write_text_atomic


class EngineKnobs(BaseModel):
    """The engine's knobs both training stages expose to users (the field descriptions are the reference)."""

    peak_lr: float = Field(3e-3, gt=0, description="Peak learning rate of the WSD schedule.")
    warmup_frac: float = Field(0.05, ge=0, lt=1, description="Linear warm-up, as a fraction of the run.")
    decay_frac: float = Field(0.2, ge=0, lt=1, description="Final exponential fast decay, as a fraction of the run.")
    final_lr_ratio: float = Field(0.1, gt=0, le=1, description="lr at the end of the decay / peak lr.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay on matrices (report: 0.1).")
    beta1: float = Field(0.9, gt=0, lt=1, description="AdamW beta1 (report: 0.9).")
    beta2: float = Field(0.95, gt=0, lt=1, description="AdamW beta2 (report: 0.95).")
    grad_clip: float = Field(1.0, gt=0, description="Gradient clipping (global norm).")
    zero_stage: Literal[1, 2] = Field(1, description="DeepSpeed ZeRO stage (DeepSpeed refuses its MoE under 3).")
    expert_parallel_size: int = Field(1, ge=1, description="Ranks that split each layer's experts (DeepSpeed-MoE).")
    sequence_parallel: int = Field(1, ge=1, description=(
        "Ranks that split each row (sequence parallelism, §3.2.2 LASP+: lightning layers exchange only their d x d "
        "states, softmax layers all-gather K and V): each group of this many consecutive ranks is one data-parallel "
        "replica and every rank holds a contiguous 1/sequence_parallel of each of its rows, so a row too long for "
        "one GPU trains over several. It must divide the processes per node (default: the GPUs), and each row must "
        "split into equal slices of at least 16 tokens. batch_rows and micro_batch_rows count a group's rows once. "
        "Not with expert_parallel_size > 1 or compile. Token-drop capacity is per rank's slice: train dropless "
        "(token_drop: false) for the exact single-GPU result."))
    global_router: bool = Field(True, description=(
        "§2.1 global router: all-gather per-expert counts over the expert-parallel group; capacity applied globally."))
    token_drop: bool = Field(True, description="Capacity-based token drop in training (False: dropless).")
    capacity_factor: float = Field(1.25, gt=0, description="Expert capacity = ceil(factor x tokens x k / E).")
    min_capacity: int = Field(0, ge=0, description=(
        "Lower bound on capacity (DeepSpeed's own default is 4; the paper has none)."))
    aux_loss_coef: float = Field(0.001, ge=0, description=(
        "alpha_aux of the balance loss, the report's (1/E) sum_i f_i m_i (§2.1; model/moe.py). The released code's "
        "loss (transformers' MiniMax, as Mixtral's) is E sum_i (k f_i) P_i, k E^2 times larger (x128 at gpu-300m's "
        "E = 8, k = 2), so a coefficient here weighs k E^2 times less than the same number there. The default is the "
        "released config's number, 0.001."))
    checkpoint_every: int = Field(50, ge=0, description=(
        "Steps between DeepSpeed checkpoints (plus one before the first step and one at the end); 0: none, and a "
        "stopped run starts over (for runs that end inside one machine lease: each save of gpu-300m is ~10 GB)."))
    log_every: int = Field(10, ge=1, description="Steps between metric logs.")
    seed: int = Field(0, ge=0, description="Packing order, loader order and initialisation.")
    spike_factor: float = Field(10.0, gt=1, description="Skip a step whose grad norm exceeds this x the recent median.")
    max_consecutive_skips: int = Field(5, ge=1, description="Stop with an error after this many skipped steps in a row.")
    max_spike_skips: int = Field(2, ge=0, description=(
        "Grad-norm spikes skipped in a row before a norm that stays high is taken (clipped) as the new level."))
    lightning_impl: str = Field("auto", description="Lightning kernel: auto (Triton on CUDA, chunked PyTorch on CPU).")
    compile: bool = Field(False, description="torch.compile the model (GPU).")
    probe_every: int = Field(0, ge=0, description=(
        "Steps between in-training retrieval probes on held-out text (copy accuracy, NIAH forced choice at seq_len; "
        "pretrain/probe.py), logged as probe_* metrics; 0: none. Not with sequence_parallel > 1."))
    probe_trials: int = Field(8, ge=1, description="NIAH forced-choice prompts and copy probes per in-training probe.")


class RunShape(BaseModel):
    """What one training run is: the model, its rows, its batches and its budget."""

    size: str = Field("tiny", description="Named model size (model/sizes.py): tiny, cpu-small, gpu-300m, gpu-1b.")
    model_overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "HybridConfig fields to override (e.g. num_hidden_layers, or attention_pattern: hybrid (§2: a softmax layer "
        "after every 7 lightning ones), all-lightning, all-softmax or a per-layer list, for the §2.2.2.3 ablation); "
        "vocab_size and the special token ids always come from the tokenizer."))
    head_init: Literal["xavier", "embedding"] = Field("xavier", description=(
        "How a model trained from scratch starts its output head (untied, as released): xavier (drawn on its own, "
        "§4.1) or embedding (a copy of the input embedding, so each id's embedding scores its own id highest from "
        "the first step; the head still trains on its own). Our departure from the report where a DAG sets it "
        "(issue 33). On 4 x H200, gpu-300m first passed 0.5 copy accuracy at 32,768 ids after 150-350 steps with "
        "it and 450-600 without, on spans of one length (a fixed look-back copies them). On spans of varying "
        "length, on the CPU, the pretrain stage's toy copied with it and not without it in 400 steps; on 4 x H200 "
        "gpu-300m's hybrid copied with it and, with a Xavier head, neither copied nor left the unigram plateau "
        "(one run each, BENCHMARKS.md). Ignored when a run starts from a checkpoint."))
    unigram_init: float = Field(0.0, ge=0.0, le=4.0, description=(
        "A model trained from scratch starts with one shared direction added to every embedding row (this share of "
        "a row's norm; 0: none) and its untied head reading that direction as the log unigram, so the logits start "
        "near the unigram through a direction every token carries. Initial weights only: no parameter is added and "
        "the released architecture is unchanged; our departure from the report's Xavier init where a DAG sets it. "
        "Without it the all-softmax variant fits the unigram by turning every softmax output into one shared "
        "vector and stays on the unigram plateau (7.53 on 4 x H200 at LR 3e-4 and 6e-4). On the CPU (tiny, 48 "
        "steps, bench/diagnose_softmax_plateau.py --unigram-init 1): all-softmax 7.06 -> 6.40 and 6.33 (two seeds; "
        "unigram 6.98), the hybrid 6.64 -> 6.39. On 4 x H200 at gpu-300m, after the copy curriculum's window, it "
        "did not help: all-softmax at 3e-4 with it ended on the plateau (7.532) and the hybrid with it, which copies "
        "without it, never left ln V in the copy window and ended there too (7.526 against 4.218; one run each, "
        "BENCHMARKS.md, the tenth lease). Ignored when a run starts from a checkpoint."))
    seq_len: int = Field(256, ge=16, description="Tokens per packed row.")
    micro_batch_rows: int = Field(4, ge=1, description=(
        "Rows per forward call on each rank (with sequence_parallel: on each group, every rank holding a slice)."))
    batch_rows: int = Field(8, ge=1, description="Initial global batch in rows (gradient accumulation fills it).")
    max_batch_rows: int = Field(64, ge=1, description="Cap of the batch-size schedule.")
    double_batch_at_tokens: list[int] = Field(default_factory=list, description=(
        "Double the batch at these token counts (§4.2 batch-size schedule)."))
    double_batch_below_loss: list[float] = Field(default_factory=list, description=(
        "Double the batch when the smoothed training loss first falls below each value (critical-batch rule)."))
    train_tokens: int = Field(1_000_000, ge=1, description="Tokens to train on (global, counting padding).")
    eval_max_rows: int = Field(64, ge=1, description="Eval rows used for eval_loss.")
    inject_nan_at_steps: list[int] = Field(default_factory=list, description=(
        "Fault injection (tests of the divergence guard)."))

    def row_lengths(self) -> dict[str, int]:
        """The row lengths of the run, by the field that sets each (what sequence parallelism must split)."""
        return {"seq_len": self.seq_len}


class EngineConfig(EngineKnobs, RunShape):
    """Everything a rank needs: the knobs, the run, and its directories. JSON on disk (:meth:`write`)."""

    model_config = ConfigDict(extra="forbid")

    data_dir: str = Field(..., description="Packed rows (pretrain/packed_data.py).")
    tokenizer_dir: str = Field(..., description="The tokenizer the rows were made with.")
    resume_dir: str = Field(..., description="DeepSpeed checkpoints: a rerun resumes from the newest.")
    export_dir: str = Field(..., description="model/, minimax/, train_log.jsonl, summary.json, expert load.")
    # long-context phases (pretrain/long_context.py): start from a checkpoint's model/ directory (its architecture
    # and weights; model_overrides still apply, e.g. rope_theta), and read the rows in their stored order
    init_from: str | None = None
    ordered_rows: bool = False
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept in resume_dir.")

    @classmethod
    def for_run(cls, knobs: EngineKnobs, shape: RunShape, **where: Any) -> EngineConfig:
        """The rank config of a stage's run: ``knobs`` (the stage's params), ``shape`` (the params too for
        ``pretrain``; a phase's for ``long_context``) and ``where`` (directories, ``init_from``, ``ordered_rows``,
        and any knob the run sets itself, such as a phase's seed). The one place a stage's params become a rank's."""
        fields = {name: getattr(knobs, name) for name in EngineKnobs.model_fields}
        fields |= {name: getattr(shape, name) for name in RunShape.model_fields}
        return cls(**(fields | where))

    def write(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(self.model_dump(mode="json"), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> EngineConfig:
        return cls.model_validate_json(Path(path).read_text())
