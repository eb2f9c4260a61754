"""The trainer of every post-training stage (SFT, DPO, GRPO, reward model) optimises ``router_aux_loss_coef`` × the model's own
§2.1 balance loss, once. The term is measured as the loss of a trainer built with coefficient c minus the loss
of one built with 0, on the same weights and batch. The reference is ``model.moe.balance_loss`` on the router
logits that each MoE layer produced in that same forward (TRL's own term, Mixtral's E·Σ f·P, is k·E² times it)."""

from __future__ import annotations

import copy

import pytest
import torch

from model.moe import MoEFeedForward, balance_loss, slots_per_expert
from tests.test_grpo_trainer import tiny_policy  # noqa: F401  (a fixture: the tiny model and tokenizer GRPO's tests use)

COEF = 0.5  # large, so that the balance term stands far above float noise in the task loss


@pytest.fixture(scope="module")
def tiny(tiny_policy):  # noqa: F811  (pytest passes the fixture imported above)
    """test_grpo's byte-level BPE tokenizer (vocab 300) and 2-layer tiny model (E = 4, k = 2), with the tokenizer
    saved beside the model, as a checkpoint's ``model/`` holds it (load_policy reads it)."""
    tokenizer, path = tiny_policy
    tokenizer.save_pretrained(path)
    return tokenizer, path


def _policy(path, coef: float):
    """The policy as the stages load it (dropless), with ``router_aux_loss_coef`` = coef, in training mode."""
    from posttrain.policy import load_policy

    model, _ = load_policy(path)
    model.config.router_aux_loss_coef = coef
    return model.train()


def _batch(tokenizer, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, 12] random token ids, left padded by 0..rows-1 tokens (padding must not count in §2.1's f and m)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, len(tokenizer), (rows, 12), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        ids[r, :r], mask[r, :r] = tokenizer.pad_token_id, 0
    return ids, mask


class RouterLogits:
    """The router logits and token mask of every MoE layer forward of ``model`` inside the block."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None, int, int]] = []

    def __enter__(self) -> RouterLogits:
        def record(module, args, output):
            mask = args[1] if len(args) > 1 else None
            self.calls.append((output.router_logits.detach(), mask, module.num_experts, module.top_k))

        self.handles = [m.register_forward_hook(record) for m in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def model_balance_loss(self) -> float:
        """model/moe.py's (1/E) Σ f_i m_i per layer from the recorded logits (eq. 1's softmax and top-k), averaged
        over layers as HybridModel does; over forwards where there were several."""
        losses = []
        for logits, mask, experts, k in self.calls:
            probs = torch.softmax(logits.double(), dim=-1)
            top_i = probs.topk(k, dim=-1).indices
            flat = None if mask is None else mask.reshape(-1).bool()
            valid = torch.ones_like(top_i, dtype=torch.bool) if flat is None else flat[:, None].expand_as(top_i)
            routed = slots_per_expert(torch.where(valid, top_i, experts), experts)
            losses.append(balance_loss(probs, routed, flat))
        assert losses, "no MoE layer ran"
        return torch.stack(losses).mean().item()


def _common(tmp_path) -> dict:
    return dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                max_steps=1, per_device_train_batch_size=2, gradient_checkpointing=False, dataloader_num_workers=0,
                disable_tqdm=True, seed=0)


def _balance_term(build, inputs_for, compute) -> tuple[float, float]:
    """(loss with COEF − loss with 0, model/moe.py's balance loss of the COEF trainer's forward)."""
    losses, reference = [], None
    for coef in (COEF, 0.0):
        trainer = build(coef)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which these calls step around
        with RouterLogits(trainer.model) as seen, torch.no_grad():
            losses.append(compute(trainer, inputs_for()).item())
        if coef:
            reference = seen.model_balance_loss()
    return losses[0] - losses[1], reference


def _check(term: float, reference: float) -> None:
    # at E = 4, k = 2 TRL's Mixtral term is ~32x this: a wrong formula or a double count is far outside rel=1e-4
    assert term == pytest.approx(COEF * reference, rel=1e-4, abs=1e-7), (term / (COEF * reference))


def test_sft_stage_trainer_optimises_the_models_own_balance_loss_once(tiny, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig

    from posttrain.sft import trainer_class

    tokenizer, path = tiny
    base = _policy(path, 0.0)

    def build(coef):
        model = copy.deepcopy(base)
        model.config.router_aux_loss_coef = coef
        return trainer_class()(
            model=model, args=SFTConfig(**_common(tmp_path), max_length=32), processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"text": ["the cat sat on the mat."] * 2}))

    def inputs():
        ids, mask = _batch(tokenizer, 3, seed=1)
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    _check(*_balance_term(build, inputs, lambda tr, x: tr.compute_loss(tr.model, x)))


def test_dpo_stage_trainer_optimises_the_models_own_balance_loss_once(tiny, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig

    from posttrain.dpo import trainer_class

    tokenizer, path = tiny
    base = _policy(path, 0.0)

    def build(coef):
        model, ref = copy.deepcopy(base), copy.deepcopy(base).eval()
        model.config.router_aux_loss_coef = coef
        data = Dataset.from_dict({"prompt": ["the cat"] * 2, "chosen": [" sat"] * 2, "rejected": [" ate"] * 2})
        return trainer_class()(
            model=model, ref_model=ref, args=DPOConfig(**_common(tmp_path), max_length=32),
            processing_class=tokenizer, train_dataset=data)

    def inputs():  # two pairs as DPO batches them: chosen rows, then rejected rows; the last 5 tokens completion
        ids, mask = _batch(tokenizer, 4, seed=2)
        completion = torch.zeros_like(mask)
        completion[:, -5:] = 1
        return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion}

    _check(*_balance_term(build, inputs, lambda tr, x: tr.compute_loss(tr.model, x)))


def test_grpo_trainer_optimises_the_models_own_balance_loss_once_scaled_for_accumulation(tiny, tmp_path):
    from datasets import Dataset

    from posttrain.grpo_trainer import HylightGRPOConfig, HylightGRPOTrainer

    tokenizer, path = tiny
    base = _policy(path, 0.0)

    def build(coef):
        model = copy.deepcopy(base)
        model.config.router_aux_loss_coef = coef
        config = HylightGRPOConfig(**{**_common(tmp_path), "per_device_train_batch_size": 4}, num_generations=4,
                                   max_completion_length=6, beta=0.0)
        return HylightGRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                                  args=config, processing_class=tokenizer,
                                  train_dataset=Dataset.from_dict({"prompt": ["the cat"] * 4}))

    def inputs():  # a rollout as TRL hands it to the loss: 6 prompt tokens (left padded), 6 completion tokens
        ids, mask = _batch(tokenizer, 4, seed=3)
        completion_mask = torch.ones(4, 6, dtype=torch.long)
        completion_mask[0, 4:] = 0  # a completion that ended early
        return {"prompt_ids": ids[:, :6], "prompt_mask": mask[:, :6], "completion_ids": ids[:, 6:],
                "completion_mask": completion_mask, "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
                "num_items_in_batch": completion_mask.sum().float()}

    def compute(tr, x):
        # 2 accumulation steps: GRPO's loss is already scaled for accumulation, so the balance term is halved
        tr.current_gradient_accumulation_steps = 2
        return tr.compute_loss(tr.model, x)

    term, reference = _balance_term(build, inputs, compute)
    _check(2 * term, reference)


def test_reward_model_stage_trainer_optimises_the_models_own_balance_loss_once(tiny, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig

    import model  # noqa: F401  (registers hylight_hybrid with the Auto classes)
    from posttrain.reward_model import trainer_class

    tokenizer, path = tiny
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    base.config.pad_token_id = tokenizer.pad_token_id

    def build(coef):
        rm = copy.deepcopy(base)
        rm.config.router_aux_loss_coef = coef
        return trainer_class()(
            model=rm, args=RewardConfig(**_common(tmp_path), max_length=None), processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"chosen_ids": [[5, 6, 7]] * 2, "rejected_ids": [[5, 6]] * 2}))

    def inputs():  # two pairs: chosen rows, then rejected rows
        ids, mask = _batch(tokenizer, 4, seed=4)
        return {"input_ids": ids, "attention_mask": mask}

    _check(*_balance_term(build, inputs, lambda tr, x: tr.compute_loss(tr.model, x)))


def test_trls_mixtral_term_is_k_e_squared_times_the_models_own(tiny):
    """Why the trainers do not use TRL's term: on the same router logits it is ~k·E² = 32 times §2.1's."""
    from trl.trainer.utils import add_fused_lm_head

    tokenizer, path = tiny
    model = _policy(path, 0.0)
    add_fused_lm_head(model)
    ids, mask = _batch(tokenizer, 4, seed=5)
    with RouterLogits(model) as seen, torch.no_grad():
        trl_term = model(input_ids=ids, attention_mask=mask, labels=ids, fused_lm_head=True,
                         output_router_logits=True).aux_loss.item()
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    assert 0.8 * k * experts**2 < trl_term / seen.model_balance_loss() < 1.2 * k * experts**2
