"""Small real inputs for the pretrain stage: documents from the shipped sample corpus, a tokenizer trained with the
project's BPE pipeline and special tokens, and a mixture manifest as data/mix.py writes it."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Tokenizer, pre_tokenizers, trainers

from data.documents import SCORED_DOCUMENTS_TYPE, DocumentWriter
from data.mix import MANIFEST_FILE, MIXTURE_TYPE, PACKING_TOKENS_PER_DOC
from data.tokenizer import SPECIAL_TOKENS, TOKENIZER_TYPE, build_tokenizer
from pipeline.stage import MANIFEST_NAME, Artifact, StageContext, StageKind, StageParams

SAMPLE_CORPUS = Path(__file__).resolve().parents[1] / "data" / "sample_corpus"


@dataclass
class PretrainInputs:
    documents: Artifact
    tokenizer: Artifact
    mixture: Artifact

    def as_inputs(self) -> dict[str, Artifact]:
        return {"documents": self.documents, "tokenizer": self.tokenizer, "mixture": self.mixture}


def _artifact(path: Path, type_: str) -> Artifact:
    manifest = {"type": type_, "digest": f"test-{type_}", "rows": {}, "summary": {}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return Artifact(path=path, manifest=manifest)


def _save_like_the_tokenizer_stage(tok_dir: Path) -> None:
    """tokenizer_config.json and chat_template.jinja beside tokenizer.json, as data/tokenizer.py saves them (the
    export must carry the chat template and the special-token ids into the model directories)."""
    from transformers import PreTrainedTokenizerFast

    from data.tokenizer import BOS_TOKEN, CHAT_TEMPLATE, END_OF_TURN_TOKEN, EOS_TOKEN, PAD_TOKEN, ROLE_TOKENS

    PreTrainedTokenizerFast(
        tokenizer_file=str(tok_dir / "tokenizer.json"), bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN, additional_special_tokens=[*ROLE_TOKENS, END_OF_TURN_TOKEN], chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False).save_pretrained(tok_dir)


def build_inputs(root: Path, *, documents: int = 120, max_chars: int = 3000, vocab_size: int = 512,
                 sample_count: int = 1, domains: tuple[str, ...] = ("prose",)) -> PretrainInputs:
    """Up to ``documents`` documents of each of ``domains`` (shipped sample corpus files, truncated to
    ``max_chars``); every 10th gets sample_count 0 (held out)."""
    records = []
    for domain in domains:
        taken = 0
        with gzip.open(SAMPLE_CORPUS / f"{domain}.jsonl.gz", "rb") as f:
            for line in f:
                r = orjson.loads(line)
                records.append({"id": r["id"], "text": r["text"][:max_chars], "source": "sample", "domain": domain,
                                "metadata": {}})
                taken += 1
                if taken == documents:
                    break
    doc_dir = root / "documents"
    with DocumentWriter(doc_dir) as w:
        for r in records:
            w.write(r)
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True)
    tok = build_tokenizer()
    tok.train_from_iterator([r["text"] for r in records], trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tok_dir / "tokenizer.json"))
    _save_like_the_tokenizer_stage(tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    mix_dir = root / "mixture"
    mix_dir.mkdir()
    with gzip.GzipFile(mix_dir / MANIFEST_FILE, "wb", mtime=0) as f:
        for i, r in enumerate(records):
            count = 0 if i % 10 == 0 else sample_count
            n = len(tok.encode(r["text"], add_special_tokens=False).ids) + PACKING_TOKENS_PER_DOC
            f.write(orjson.dumps({
                "id": r["id"], "sample_count": count, "full_sample_count": count, "tokens": n, "bucket": "mid",
                "category": "prose", "domain": "prose", "score": 2.5, "dup_count": 1, "max_epochs": 3,
                "expected_epochs": float(count), "zero_reason": None if count else "budget"}) + b"\n")
    return PretrainInputs(_artifact(doc_dir, "scored_documents"), _artifact(tok_dir, "tokenizer"),
                          _artifact(mix_dir, "mixture"))


# --- the inputs as pipeline stages (``uses: tests.pretrain_fixtures:PREBUILT_*``): a spec can then run ``pretrain``
# through the orchestrator on them


class PrebuiltParams(StageParams):
    path: str  # a directory build_inputs() made


def _publish(params: PrebuiltParams, ctx: StageContext) -> None:
    import shutil

    shutil.copytree(params.path, ctx.out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST_NAME))


PREBUILT_DOCUMENTS = StageKind(name="test_prebuilt_documents", params=PrebuiltParams, run=_publish,
                               produces=SCORED_DOCUMENTS_TYPE)
PREBUILT_TOKENIZER = StageKind(name="test_prebuilt_tokenizer", params=PrebuiltParams, run=_publish,
                               produces=TOKENIZER_TYPE)
PREBUILT_MIXTURE = StageKind(name="test_prebuilt_mixture", params=PrebuiltParams, run=_publish, produces=MIXTURE_TYPE)


# --- two-process expert parallelism (tests/test_pretrain.py) ----------------------------------------------------
# The worker runs in processes started by torch.multiprocessing.spawn, so it and what it shares with the test
# (the seeded model, the inputs) live here, importable by both.

EP_WORLD = 2
EP_SKEW_TOKENS = 64  # tokens per rank in the token-drop case
EP_SKEW_PADDING = 4  # padding tokens at the end of rank 1's tokens there


def ep_model() -> Any:
    """The seeded float64 tiny model every rank (and the single-process reference) starts from."""
    import torch

    from model import HybridForCausalLM, config_for

    torch.manual_seed(0)
    return HybridForCausalLM(config_for("tiny", num_hidden_layers=2, capacity_factor=1.0)).double()


def ep_dropless_inputs(rank: int) -> tuple[Any, Any, Any]:
    """(x [1, T, d], token mask, upstream gradient) of one rank: different tokens and lengths per rank."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    n = 40 + 9 * rank
    x = torch.randn(1, n, 64, generator=g, dtype=torch.float64)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, 5 + rank] = False  # one padding token inside each rank's tokens
    return x, mask, torch.randn(1, n, 64, generator=g, dtype=torch.float64)


def ep_skewed_router(layer: Any) -> None:
    """Router logits = x[:, :E] (the first E hidden features), so inputs decide the routing."""
    import torch

    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, : layer.router.weight.shape[0]] = torch.eye(layer.router.weight.shape[0])


def ep_skewed_inputs(rank: int) -> tuple[Any, Any]:
    """Rank r's tokens put their first choice on expert r (feature r raised by 4), the second choice on
    whichever other expert their noise favours; rank 1 ends with padding."""
    import torch

    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(1, EP_SKEW_TOKENS, 64, generator=g, dtype=torch.float64)
    x[0, :, rank] += 4.0
    mask = torch.ones(1, EP_SKEW_TOKENS, dtype=torch.bool)
    if rank == 1:
        mask[0, EP_SKEW_TOKENS - EP_SKEW_PADDING:] = False
    return x, mask


def expert_parallel_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank: DeepSpeedMoEFeedForward with ep_size=2 over gloo; writes what it measured to out_dir."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from pretrain.moe import install_deepspeed_moe
    from pretrain.train import init_distributed  # gloo, DeepSpeed's shm comm op off

    torch.set_num_threads(1)
    init_distributed()
    results: dict[str, Any] = {}

    # (a) dropless: all-to-all to the experts' owners and back, gradients through both trips
    layer = install_deepspeed_moe(ep_model(), ep_size=world_size, ep_rank=rank)[1]
    layer.set_deepspeed_parallelism()  # creates DeepSpeed's expert-parallel group "ep_size_2"
    layer.train()
    layer.token_drop = False
    x, mask, upstream = ep_dropless_inputs(rank)
    x.requires_grad_(True)
    out = layer(x, mask)
    ((out.hidden * upstream).sum() + 0.37 * out.aux_loss).backward()
    experts = layer.experts  # this rank's experts, stacked: gate_up_proj [E_l, 2F, d], down_proj [E_l, d, F]
    results["dropless"] = {
        "hidden": out.hidden.detach(), "routed": out.routed, "dropped": out.dropped, "x_grad": x.grad,
        "router_grad": layer.router.weight.grad,
        "gate_up_grad": experts.gate_up_proj.grad, "down_grad": experts.down_proj.grad,
        "ep_group_ranks": dist.get_world_size(layer.ep_group),
    }

    # (b) token drop with skewed routing, with and without the §2.1 global router
    for name, global_router in (("global", True), ("local", False)):
        layer = install_deepspeed_moe(ep_model(), ep_size=world_size, ep_rank=rank,
                                      global_router=global_router)[1]
        layer.set_deepspeed_parallelism()
        ep_skewed_router(layer)
        layer.train()
        x, mask = ep_skewed_inputs(rank)
        with torch.no_grad():
            out = layer(x, mask)
        results[name] = {"hidden": out.hidden, "routed": out.routed, "dropped": out.dropped}

    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def grad_norm_worker(rank: int, port: int, out_file: str) -> None:
    """One process, world of one: the same model, batch and first step through DeepSpeed's ZeRO-1 engine twice,
    with DeepSpeed's per-gradient norm and with ``install_foreach_grad_norm``; writes both global norms, the float64
    norm of the gradients computed by plain autograd, and how often the replacement ran."""
    import os

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import deepspeed
    import torch

    from model import HybridForCausalLM, config_for
    from pretrain.moe import install_deepspeed_moe
    from pretrain.train import (
        TrainConfig,
        deepspeed_config,
        init_distributed,
        install_foreach_grad_norm,
        optimizer_groups,
    )

    torch.set_num_threads(1)
    _, _, device = init_distributed()
    def make() -> Any:  # seeded (no deepcopy: it drops the expert parameters' DeepSpeed attributes)
        torch.manual_seed(0)
        model = HybridForCausalLM(config_for("tiny", num_hidden_layers=2))
        install_deepspeed_moe(model)
        return model

    reference = make()
    ids = torch.randint(8, reference.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    reference(input_ids=ids, labels=ids).loss.backward()
    exact = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in reference.parameters()
                                                  if p.grad is not None]))
    cfg = TrainConfig(data_dir="", tokenizer_dir="", resume_dir="", export_dir="", size="tiny", seq_len=48,
                      micro_batch_rows=2, batch_rows=2, zero_stage=1, grad_clip=1.0)
    result: dict[str, Any] = {"exact": float(exact)}
    for name in ("deepspeed", "foreach"):
        model = make()
        opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-3)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(cfg, 1, device))
        calls = []
        if name == "foreach":
            install_foreach_grad_norm(opt)
            inner = opt.get_grad_norm_direct
            opt.get_grad_norm_direct = lambda *a, _c=calls, _f=inner, **k: _c.append(1) or _f(*a, **k)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        result[name] = float(engine.get_global_grad_norm())
        result[f"{name}_calls"] = len(calls)
    Path(out_file).write_text(json.dumps(result))
