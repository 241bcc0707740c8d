"""A converted KHA checkpoint as Axolotl's `base_model` (the plugin registers `model_type: kha` before Axolotl reads
the config): full fine-tuning, knocks-only training (Axolotl's `unfrozen_parameters`), and a LoRA on it (merged by
`axolotl merge-lora`), with Axolotl's Triton LoRA kernels for the attention, which Axolotl switches on by itself,
switched off by the plugin."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close

pytestmark = pytest.mark.slow
IDS = torch.tensor([[5, 17, 42, 9, 77, 3, 101, 250]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


@pytest.fixture
def kha_base(tmp_path):
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "kha", "llama", knock="linear_qkv")
    return tmp_path / "kha"


def _weights(folder) -> dict[str, torch.Tensor]:
    from kha_hf import KHAForCausalLM

    return {k: v.clone() for k, v in KHAForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict().items()}


def test_full_fine_tuning_of_a_kha_checkpoint(kha_base, tmp_path):
    from transformers import AutoModelForCausalLM

    from kha_hf import KHAForCausalLM
    from tests.axolotl.runner import config, text_loss, train

    before = _weights(kha_base)
    model, _, _ = train(config(tmp_path, kha_base, learning_rate=0.001))
    assert isinstance(model, KHAForCausalLM)
    assert text_loss(model, kha_base) < text_loss(AutoModelForCausalLM.from_pretrained(kha_base), kha_base)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert isinstance(saved, KHAForCausalLM)
    assert_close(_logits(saved), _logits(model), what="the saved KHA checkpoint vs Axolotl's model in memory")
    after = saved.state_dict()
    assert not torch.equal(
        after["model.layers.0.self_attn.v_knock.weight"], before["model.layers.0.self_attn.v_knock.weight"]
    )
    assert not torch.equal(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])


def test_knocks_only_training_with_unfrozen_parameters(kha_base, tmp_path):
    from kha_hf import KHAForCausalLM
    from tests.axolotl.runner import config, text_loss, train

    before = _weights(kha_base)
    cfg = config(tmp_path, kha_base, unfrozen_parameters=["^model.layers.[0-9]+.self_attn.[qkv]_knock.weight$"])
    model, _, _ = train(cfg)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("_knock." in name for name in trainable), sorted(trainable)[:3]
    assert text_loss(model, kha_base) < text_loss(KHAForCausalLM.from_pretrained(kha_base), kha_base)
    after = _weights(tmp_path / "out")
    changed = {key for key in before if not torch.equal(before[key], after[key])}
    assert changed and all("_knock." in key for key in changed), sorted(changed)[:3]
    assert len(changed) == 9  # q, k and v knocks of 3 layers, nothing else


def test_a_lora_on_a_kha_checkpoint_with_axolotls_kernel_defaults(kha_base, tmp_path):
    """No `lora_*_kernel` key: Axolotl would switch all four Triton kernels on for `adapter: lora` and then fail to
    find the attention class of model_type kha ("could not import attention class"). The plugin switches the q/k/v
    and o kernels off (the MLP and embedding kernels follow Axolotl's rule: off once any kernel key is set)."""
    from peft import PeftModel

    from kha_hf import KHAForCausalLM
    from tests.axolotl.runner import config, text_loss, train, validate

    cfg = config(tmp_path, kha_base, adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True)
    validated = validate(cfg)
    assert (validated.lora_qkv_kernel, validated.lora_o_kernel) == (False, False)
    model, _, _ = train(cfg)
    assert text_loss(model, kha_base) < text_loss(KHAForCausalLM.from_pretrained(kha_base), kha_base)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable), trainable[:3]
    base = KHAForCausalLM.from_pretrained(kha_base, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "out")
    assert_close(_logits(reloaded), _logits(model), what="LoRA on KHA reloaded vs in memory")

    # axolotl merge-lora, Axolotl's default (shard-by-shard) method: a KHA checkpoint, knocks kept
    import yaml
    from axolotl.cli.merge_lora import do_cli

    from tests.axolotl.runner import clear_plugins

    clear_plugins()
    (tmp_path / "merge.yml").write_text(yaml.safe_dump(cfg))
    do_cli(config=str(tmp_path / "merge.yml"))
    merged = KHAForCausalLM.from_pretrained(tmp_path / "out" / "merged", dtype=torch.float32)
    assert_close(_logits(merged), _logits(model), atol=1e-5, what="LoRA on KHA merged by axolotl merge-lora")
    untrained = KHAForCausalLM.from_pretrained(kha_base, dtype=torch.float32)  # PEFT wrapped `base` in place
    assert (_logits(merged) - _logits(untrained)).abs().max() > 1e-4, "the merged model is the base: no LoRA merged"


def test_attention_kernels_asked_for_on_a_kha_model_are_refused_in_one_line(kha_base, tmp_path):
    from tests.axolotl.runner import config, validate

    cfg = config(
        tmp_path, kha_base, adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True, lora_qkv_kernel=True
    )
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert str(err.value).startswith("lora_qkv_kernel cannot run on a KHA model")
    assert len(str(err.value).splitlines()) == 1
