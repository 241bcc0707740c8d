"""TRL's trainers with knock adapters (#29), a few steps each on a tiny Llama with a real (tiny) tokenizer: SFT,
DPO (its reference model is the adapter switched off), reward modelling on a sequence-classification head, GRPO
without vLLM, SFT of a KHA model whose knocks alone train, and reward modelling on a KHA reward model
(`KHAForSequenceClassification`). Each asserts that only the intended parameters
changed, the losses are finite, and the saved result reloads with identical logits."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from peft import PeftModel

from kha_hf import KHAForCausalLM, KnockConfig
from tests.helpers import assert_close, save_tiny_checkpoint

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

IDS = torch.tensor([[3, 9, 27, 81, 5, 15, 45, 7, 21]])


@pytest.fixture
def base(tmp_path):
    folder = tmp_path / "base"
    save_tiny_checkpoint(folder, "llama")
    return folder


def _tokenizer(folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def _args(config_class, tmp_path, **extra):
    return config_class(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,  # TRL's default on a CPU with bf16 wraps the model's forward in autocast, which outlives training
        **extra,
    )


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed(model, before) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def _check_losses(trainer) -> None:
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses), losses


def _check_reload(trainer, base_folder, tmp_path, auto_class) -> None:
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=IDS).logits
    trainer.model.save_pretrained(tmp_path / "adapter")
    stock = auto_class.from_pretrained(base_folder, **({"num_labels": 1} if "Sequence" in auto_class.__name__ else {}))
    reloaded = PeftModel.from_pretrained(stock, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert_close(reloaded(input_ids=IDS).logits, expected, what="reloaded adapter")


def _reward_trainer(model, tokenizer, tmp_path, **extra):
    data = datasets.Dataset.from_dict({"chosen": ["the quick brown fox"] * 4, "rejected": ["the lazy dog"] * 4})
    args = _args(trl.RewardConfig, tmp_path, max_length=32)
    return trl.RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, **extra)


def test_sft_trains_only_the_knock_adapter(base, tmp_path):
    from transformers import AutoModelForCausalLM

    data = datasets.Dataset.from_dict({"text": ["the quick brown fox jumps over the lazy dog"] * 8})
    model = AutoModelForCausalLM.from_pretrained(base)
    trainer = trl.SFTTrainer(
        model=model,
        args=_args(trl.SFTConfig, tmp_path, max_length=32),
        train_dataset=data,
        processing_class=_tokenizer(base),
        peft_config=KnockConfig(knock="linear_qkv"),
    )
    before = _snapshot(trainer.model)
    trainer.train()
    changed = _changed(trainer.model, before)
    assert changed and all(".knock_sets." in n for n in changed), sorted(changed)[:4]
    _check_losses(trainer)
    _check_reload(trainer, base, tmp_path, AutoModelForCausalLM)


def test_sft_of_a_kha_model_trains_its_knocks_alone(base, tmp_path):
    data = datasets.Dataset.from_dict({"text": ["the quick brown fox jumps over the lazy dog"] * 8})
    model = KHAForCausalLM.from_pretrained(base, knock="mlp_v")
    for name, param in model.named_parameters():
        param.requires_grad_("_knock." in name)
    trainer = trl.SFTTrainer(
        model=model,
        args=_args(trl.SFTConfig, tmp_path, max_length=32),
        train_dataset=data,
        processing_class=_tokenizer(base),
    )
    before = _snapshot(model)
    trainer.train()
    changed = _changed(model, before)
    assert changed and all("_knock." in n for n in changed), sorted(changed)[:4]
    _check_losses(trainer)
    model.eval().save_pretrained(tmp_path / "kha")
    with torch.no_grad():
        reloaded = KHAForCausalLM.from_pretrained(tmp_path / "kha").eval()
        assert_close(reloaded(IDS).logits, model(IDS).logits, what="reloaded KHA model")


def test_dpo_with_a_knock_adapter_uses_the_switched_off_adapter_as_reference(base, tmp_path):
    from transformers import AutoModelForCausalLM

    data = datasets.Dataset.from_dict(
        {"prompt": ["the quick"] * 4, "chosen": [" brown fox"] * 4, "rejected": [" lazy"] * 4}
    )
    trainer = trl.DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(base),
        args=_args(trl.DPOConfig, tmp_path, max_length=32),
        train_dataset=data,
        processing_class=_tokenizer(base),
        peft_config=KnockConfig(knock="linear_qkv"),
    )
    assert trainer.ref_model is None  # TRL's reference is the model with its adapter disabled
    before = _snapshot(trainer.model)
    trainer.train()
    changed = _changed(trainer.model, before)
    assert changed and all(".knock_sets." in n for n in changed), sorted(changed)[:4]
    _check_losses(trainer)
    rewards = [e["rewards/margins"] for e in trainer.state.log_history if "rewards/margins" in e]
    assert rewards and rewards[-1] > 0  # the adapter moved the policy away from its reference, toward "chosen"
    _check_reload(trainer, base, tmp_path, AutoModelForCausalLM)


def test_reward_trainer_on_a_classification_head_with_a_knock_adapter(base, tmp_path):
    from transformers import AutoModelForSequenceClassification

    tokenizer = _tokenizer(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    trainer = _reward_trainer(
        model, tokenizer, tmp_path, peft_config=KnockConfig(knock="linear_qkv", task_type="SEQ_CLS")
    )
    before = _snapshot(trainer.model)
    trainer.train()
    changed = _changed(trainer.model, before)
    assert any(".knock_sets." in n for n in changed) and any("score" in n for n in changed), sorted(changed)
    assert all(".knock_sets." in n or "score.modules_to_save" in n for n in changed), sorted(changed)
    _check_losses(trainer)
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=IDS).logits
    trainer.model.save_pretrained(tmp_path / "adapter")
    stock = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    stock.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(stock, tmp_path / "adapter").eval()
        assert_close(reloaded(input_ids=IDS).logits, expected, what="reloaded reward model")


def test_reward_trainer_on_a_kha_reward_model_trains_its_knocks_and_score(base, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from kha_hf import KHAForSequenceClassification

    tokenizer = _tokenizer(base)
    # a KHA reward model from the causal LM's checkpoint: identity knocks, a new score head (as stock does)
    model = KHAForSequenceClassification.from_pretrained(base, knock="mlp_v", num_labels=1)
    assert type(model).__name__ == "KHALlamaForSequenceClassification"
    model.config.pad_token_id = tokenizer.pad_token_id
    for name, param in model.named_parameters():
        param.requires_grad_("_knock." in name or name.startswith("score."))
    trainer = _reward_trainer(model, tokenizer, tmp_path)
    before = _snapshot(model)
    trainer.train()
    changed = _changed(model, before)
    assert any("_knock." in n for n in changed) and "score.weight" in changed, sorted(changed)
    assert all("_knock." in n or n == "score.weight" for n in changed), sorted(changed)
    _check_losses(trainer)
    model.eval().save_pretrained(tmp_path / "reward")
    with torch.no_grad():
        reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "reward").eval()
        assert type(reloaded) is type(model)
        assert_close(reloaded(IDS).logits, model(IDS).logits, what="reloaded KHA reward model")


def test_grpo_without_vllm_trains_the_knock_adapter(base, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    # Under pytest, tests/ is on sys.path and tests/vllm/ looks like an installed `vllm` (a namespace package without
    # a version), which trl 1.16 probes at import and fails on; this environment has no vLLM.
    import_utils = importlib.import_module("trl.import_utils")
    monkeypatch.setattr(import_utils, "is_vllm_available", lambda *args, **kwargs: False)

    def reward_length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(base),
        reward_funcs=reward_length,
        args=_args(trl.GRPOConfig, tmp_path, num_generations=2, max_completion_length=8),
        train_dataset=datasets.Dataset.from_dict({"prompt": ["the quick"] * 4}),
        processing_class=_tokenizer(base),
        peft_config=KnockConfig(knock="linear_qkv"),
    )
    before = _snapshot(trainer.model)
    trainer.train()
    changed = _changed(trainer.model, before)
    assert all(".knock_sets." in n for n in changed), sorted(changed)[:4]
    _check_losses(trainer)
