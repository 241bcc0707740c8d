"""From scratch through the Auto classes (#33): `AutoModelForCausalLM.from_config(kha_config)` builds the family's
KHA class for every family, however the config was made (from_base, the constructor, AutoConfig.for_model, a
folder), with and without trust_remote_code, with kha_hf imported and as remote code; and a model built that way
trains with `Trainer`, saves and reloads exactly.

transformers 5.24's `_get_model_class` iterates `config.architectures`, which a fresh config leaves `None`; the
workaround sits in `KHAConfig.__post_init__`, and `test_upstream_still_needs_the_workaround` turns red once
transformers reads a missing `architectures` as empty (then the workaround can go).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)
from transformers.models.auto import auto_factory

from kha_hf import KHAConfig, KHAForCausalLM, KHAModel
from kha_hf.modeling.modeling_kha import family_classes
from tests.helpers import ALL_FAMILIES, MLA_FAMILIES, assert_close, run_python, tiny_config

IDS = torch.tensor([[3, 9, 27, 81, 5, 15, 45, 7]])


def _preset(family: str) -> str:
    return "linear_qkv" if family in MLA_FAMILIES else "mlp_v"


def _base_fields(family: str) -> dict:
    """The tiny base config of FAMILY as constructor keywords (model_type and file keys left out)."""
    fields = tiny_config(family).to_dict()
    for key in ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path"):
        fields.pop(key, None)
    return fields


def _check_built(model, family: str, public: type, index: int) -> None:
    base_type = tiny_config(family).model_type
    assert isinstance(model, public), type(model)
    assert type(model) is family_classes(base_type)[index], f"{family}: built {type(model).__name__}"


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_auto_classes_build_the_family_class_from_every_kind_of_kha_config(family, tmp_path):
    base_type = tiny_config(family).model_type
    configs = {
        "from_base": KHAConfig.from_base(tiny_config(family), knock=_preset(family)),
        "constructor": KHAConfig(base_model_type=base_type, knock=_preset(family), **_base_fields(family)),
        "for_model": AutoConfig.for_model(
            "kha", base_model_type=base_type, knock=_preset(family), **_base_fields(family)
        ),
    }
    configs["from_base"].save_pretrained(tmp_path)
    configs["folder"] = AutoConfig.from_pretrained(tmp_path)
    for how, config in configs.items():
        assert isinstance(config, KHAConfig), how
        for trust in (None, True):
            kwargs = {} if trust is None else {"trust_remote_code": trust}
            _check_built(AutoModelForCausalLM.from_config(config, **kwargs), family, KHAForCausalLM, 2)
            _check_built(AutoModel.from_config(config, **kwargs), family, KHAModel, 1)


def test_a_from_config_model_starts_with_identity_knocks_and_saves_architectures_null(tmp_path):
    config = KHAConfig.from_base(tiny_config("llama"), knock="linear_qkv")
    model = AutoModelForCausalLM.from_config(config)
    knocks = {name: p for name, p in model.named_parameters() if "_knock." in name}
    assert knocks and all(torch.equal(p, torch.eye(p.shape[0])) for p in knocks.values())
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).to_dict()["architectures"] is None  # as transformers writes "unset"
    model.save_pretrained(tmp_path / "model")
    assert AutoConfig.from_pretrained(tmp_path / "model").architectures == ["KHAForCausalLM"]


def test_upstream_still_needs_the_workaround():
    """Red when transformers reads `architectures=None` as empty: then drop the `[]` in KHAConfig.__post_init__."""
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    assert config.architectures is None
    with pytest.raises(TypeError, match="not iterable"):
        auto_factory._get_model_class(config, {LlamaConfig: (KHAForCausalLM, KHAModel)})


def test_from_config_as_remote_code_without_kha_hf(tmp_path):
    KHAForCausalLM(KHAConfig.from_base(tiny_config("qwen3"), knock="mlp_v")).save_pretrained(tmp_path / "saved")
    script = textwrap.dedent(
        f"""
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        config = AutoConfig.from_pretrained({str(tmp_path / "saved")!r}, trust_remote_code=True)
        config.architectures = None  # as a user who builds a config to pretrain from scratch has it
        for auto in (AutoModelForCausalLM, AutoModel):
            model = auto.from_config(config, trust_remote_code=True)
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            print("BUILT", type(model).__name__)
        """
    )
    result = run_python(script, tmp_path)
    assert result.stdout.split() == ["BUILT", "KHAQwen3ForCausalLM", "BUILT", "KHAQwen3Model"], (
        result.stdout + result.stderr[-3000:]
    )


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 16, length: int = 12):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_from_scratch_training_through_the_auto_classes_saves_and_reloads_exactly(tmp_path):
    config = AutoConfig.for_model("kha", base_model_type="llama", knock="mlp_v", **_base_fields("llama"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    result = Trainer(model=model, args=args, train_dataset=_Blocks(config.vocab_size)).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert any("v_knock" in name for name in moved) and any("q_proj" in name for name in moved), sorted(moved)
    model.eval().save_pretrained(tmp_path / "trained")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "trained").eval()
    assert type(reloaded) is type(model)
    with torch.no_grad():
        assert_close(reloaded(IDS).logits, model(IDS).logits, what="reloaded vs trained")


def test_from_scratch_sft_with_trl_through_the_auto_classes(tmp_path):
    """TRL's SFTTrainer, as pretraining recipes use it, on a model built by `from_config`: every weight trains
    (knocks included), the run saves with trainer.save_model and reloads exactly through the Auto class."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "base", "llama")  # only its tokenizer is used
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "base")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    config = KHAConfig.from_base(AutoConfig.from_pretrained(tmp_path / "base"), knock="mlp_v")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model) is family_classes("llama")[2]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        bf16=False,  # TRL's CPU bf16 default would wrap the forward in autocast beyond training
        max_length=32,
    )
    data = datasets.Dataset.from_dict({"text": ["the quick brown fox jumps over the lazy dog"] * 8})
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(torch.isfinite(torch.tensor(loss)) for loss in losses), losses
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert any("v_knock" in name for name in moved) and any("q_proj" in name for name in moved), sorted(moved)
    trainer.save_model(str(tmp_path / "trained"))
    model.eval()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "trained").eval()
    assert type(reloaded) is type(model)
    with torch.no_grad():
        assert_close(reloaded(IDS).logits, model(IDS).logits, what="reloaded vs SFT-trained")
