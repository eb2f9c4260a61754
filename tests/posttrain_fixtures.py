"""Inputs of the post-training stages, built in seconds: the shipped sample corpus, a tokenizer trained on it, a
random tiny ``HybridForCausalLM`` saved as pretrain/export.py lays out a checkpoint (``model/`` + tokenizer files,
eos = [eos, end-of-turn]) and a prompts stage run over the documents."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.stage import Artifact, StageContext
from tests.pretrain_fixtures import PretrainInputs, build_inputs


@dataclass
class PosttrainInputs:
    inputs: PretrainInputs
    checkpoint: Path
    prompts: Path

    def checkpoint_artifact(self) -> Artifact:
        return Artifact(self.checkpoint, {"type": "checkpoint", "digest": "test-checkpoint"})

    def prompts_artifact(self) -> Artifact:
        return Artifact(self.prompts, {"type": "prompts", "digest": "test-prompts"})


def build_posttrain_inputs(root: Path, *, documents: int = 80, prompts: dict | None = None,
                           open_ended: int = 40, seed: int = 0, **model_overrides) -> PosttrainInputs:
    from data.tokenizer import special_token_ids
    from model import HybridForCausalLM, config_for
    from posttrain.prompts import PromptsParams
    from posttrain.prompts import run as run_prompts
    from pretrain.export import TOKENIZER_FILES

    inputs = build_inputs(root / "in", documents=documents, max_chars=20000, vocab_size=512)
    ids = special_token_ids(inputs.tokenizer.path)
    torch.manual_seed(seed)
    lm = HybridForCausalLM(config_for("tiny", vocab_size=ids["vocab_size"], bos_token_id=ids["bos"],
                                      pad_token_id=ids["pad"], eos_token_id=[ids["eos"], ids["end_of_turn"]],
                                      **model_overrides))
    ckpt = root / "ckpt"
    lm.save_pretrained(ckpt / "model")
    for name in TOKENIZER_FILES:
        if (inputs.tokenizer.path / name).exists():
            shutil.copy2(inputs.tokenizer.path / name, ckpt / "model" / name)
    pctx = StageContext(root / "prompts", {"documents": inputs.documents}, stage_name="prompts")
    verifiable = prompts or {"arithmetic": 90, "string": 90, "retrieval": 0, "code": 9}
    run_prompts(PromptsParams(verifiable=verifiable, open_ended=open_ended, excerpt_words=[30, 40, 50]), pctx)
    return PosttrainInputs(inputs, ckpt, pctx.out_dir)
