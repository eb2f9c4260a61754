"""The hand-off checkpoint of a training stage: ``model/`` format and transformers' MiniMax format, each with the
tokenizer, and with the tokenizer's bos/eos/pad ids (and the chat template's end-of-turn marker as a second eos)
carried into the model and generation configs, so post-training, ``generate`` and the wider ecosystem (vLLM,
lm-eval) can load either directory without remote code.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from data.tokenizer import special_token_ids

MODEL_DIR = "model"  # HybridForCausalLM (model_type hylight_hybrid; `import model` registers it)
MINIMAX_DIR = "minimax"  # transformers MiniMaxForCausalLM, no remote code
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def export_checkpoint(module: torch.nn.Module, model_config: Any, cfg: Any, rank: int) -> None:
    """Write ``<export_dir>/model`` and ``<export_dir>/minimax``. A collective (experts are gathered over the
    expert-parallel group): every rank calls it; rank 0 writes."""
    from pretrain.moe import export_model_state  # heavy: deepspeed, transformers

    state = export_model_state(module)
    if rank != 0:
        return
    from model import HybridForCausalLM  # heavy: transformers

    model_config.use_cache = True  # training turned it off; generation wants the O(1) lightning cache
    model = HybridForCausalLM(model_config)
    model.load_state_dict({k: v.detach().to("cpu", torch.float32) for k, v in state.items()}, strict=True)
    write_checkpoint_dirs(model, cfg.tokenizer_dir, Path(cfg.export_dir))


def write_checkpoint_dirs(model: Any, tokenizer_dir: str | Path, out: Path) -> None:
    """``out/model`` (HybridForCausalLM) and ``out/minimax`` (transformers MiniMax), each with the tokenizer files
    and generation config (bos/pad, eos = [eos, end-of-turn]). Post-training stages write their policies with it."""
    from transformers import AutoConfig, GenerationConfig  # heavy: transformers

    from model.hf_minimax import save_as_minimax  # heavy: transformers

    ids = special_token_ids(tokenizer_dir)
    model.config.use_cache = True
    model.config.bos_token_id, model.config.pad_token_id = ids["bos"], ids["pad"]
    model.config.eos_token_id = [ids["eos"], ids["end_of_turn"]]
    model.generation_config = GenerationConfig(bos_token_id=ids["bos"], pad_token_id=ids["pad"],
                                               eos_token_id=[ids["eos"], ids["end_of_turn"]])
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in model.parameters()):
        import copy  # written in fp32 from a CPU copy; the caller's model stays where it is

        model = copy.deepcopy(model).to("cpu", torch.float32)
    model.save_pretrained(out / MODEL_DIR)
    save_as_minimax(model.eval(), out / MINIMAX_DIR)
    # the MiniMax export builds its own config: carry the token ids into it and its generation config too
    hf_dir = out / MINIMAX_DIR
    hf_config = AutoConfig.from_pretrained(hf_dir)
    hf_config.bos_token_id, hf_config.pad_token_id = ids["bos"], ids["pad"]
    hf_config.eos_token_id = [ids["eos"], ids["end_of_turn"]]
    hf_config.save_pretrained(hf_dir)
    model.generation_config.save_pretrained(hf_dir)
    for d in (out / MODEL_DIR, hf_dir):
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists():
                shutil.copy2(src, d / name)
