"""Knocks as a PEFT method on stock models (#29): `get_peft_model(stock, KnockConfig(...))` for every family.

Per family and preset: bit-exact to the stock model at init, only knocks trainable, as many knock parameters as the
KHA model of that base; knocks copied from a KHA model (key names mapped by a rule written here, not by the code
under test) give exactly the KHA model's logits; the two trained from the same data and seed end with the same
knocks. Then the adapter lifecycle on Llama: save (only knocks), reload through PeftModel and AutoPeftModel, several
adapters, disable, modules_to_save, merge (linear: the fold rule; MLP: refused), to a KHA model, and bad files.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kha_hf import KHAForCausalLM, KnockConfig
from kha_hf.peft import knock_adapter_from_kha, to_kha_model
from tests.helpers import ALL_FAMILIES, MLA_FAMILIES, assert_close, randomize_knocks, run_python, tiny_base_model

IDS = torch.tensor([[3, 9, 27, 81, 5, 15, 45, 7, 21], [4, 8, 16, 32, 64, 1, 2, 11, 13]])


def presets(family: str) -> list[str]:
    return ["linear_v", "linear_qkv"] if family in MLA_FAMILIES else ["mlp_v", "linear_qkv", "mlp_v_linear_qk"]


def kha_name(adapter_key: str) -> str:
    """`model.layers.0.self_attn.q_proj.knock_sets.default.q_knock.weight` -> `model.layers.0.self_attn.q_knock.weight`
    (the adapter's knocks sit on the projection; a KHA model's on the attention module)."""
    key = adapter_key.removeprefix("base_model.model.")
    return re.sub(r"\.[a-z_]+_proj\.knock_sets\.[^.]+\.", ".", key)


def adapter_knocks(peft_model) -> dict[str, torch.nn.Parameter]:
    return {kha_name(n): p for n, p in peft_model.named_parameters() if ".knock_sets." in n}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_starts_exact_trains_only_knocks_and_computes_the_kha_models_knocks(family):
    stock = tiny_base_model(family)
    with torch.no_grad():
        expected = stock(IDS).logits
    for preset in presets(family):
        peft_model = get_peft_model(tiny_base_model(family), KnockConfig(knock=preset))
        with torch.no_grad():
            assert_close(peft_model(IDS).logits, expected, what=f"{family} {preset}: identity adapter vs stock")
        trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
        assert trainable and all(".knock_sets." in n for n in trainable), sorted(trainable)[:5]

        kha = KHAForCausalLM.from_base(tiny_base_model(family), knock=preset)
        randomize_knocks(kha, scale=0.05)
        kha_knocks = {n: p for n, p in kha.named_parameters() if "_knock." in n}
        knocks = adapter_knocks(peft_model)
        assert set(knocks) == set(kha_knocks), f"{family} {preset}: {sorted(set(knocks) ^ set(kha_knocks))[:4]}"
        with torch.no_grad():
            for name, param in knocks.items():
                param.copy_(kha_knocks[name])
            assert_close(peft_model(IDS).logits, kha(IDS).logits, what=f"{family} {preset}: adapter vs KHA model")


def _train(model, params, steps: int = 3) -> None:
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    for step in range(steps):
        ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("family", ["llama", "phi3", "deepseek_v3"])
def test_adapter_and_kha_model_trained_alike_end_with_the_same_knocks(family):
    preset = presets(family)[-1]
    kha = KHAForCausalLM.from_base(tiny_base_model(family), knock=preset).train()
    kha_knocks = {n: p for n, p in kha.named_parameters() if "_knock." in n}
    for name, param in kha.named_parameters():
        param.requires_grad_(name in kha_knocks)
    # the order of parameters decides nothing in AdamW, but the optimiser gets them in one order for both
    _train(kha, [kha_knocks[n] for n in sorted(kha_knocks)])
    peft_model = get_peft_model(tiny_base_model(family), KnockConfig(knock=preset)).train()
    knocks = adapter_knocks(peft_model)
    _train(peft_model, [knocks[n] for n in sorted(knocks)])
    moved = [n for n in knocks if not torch.equal(knocks[n], torch.eye(knocks[n].shape[0]))]
    assert moved, "training moved no knock"
    for name in knocks:
        assert_close(knocks[name].detach(), kha_knocks[name].detach(), atol=1e-6, what=f"{family} {name}")


@pytest.fixture
def llama_base(tmp_path):
    folder = tmp_path / "base"
    tiny_base_model("llama").save_pretrained(folder)
    return folder


def _adapter(base_folder, preset: str = "linear_qkv", scale: float = 0.05, **config):
    model = AutoModelForCausalLM.from_pretrained(base_folder, attn_implementation="eager").eval()
    peft_model = get_peft_model(model, KnockConfig(knock=preset, **config))
    randomize_knocks(peft_model, scale=scale)
    return peft_model


def _stock(base_folder):
    return AutoModelForCausalLM.from_pretrained(base_folder, attn_implementation="eager").eval()


def test_save_holds_only_the_knocks_and_reloads_exactly(llama_base, tmp_path):
    peft_model = _adapter(llama_base, "mlp_v_linear_qk")
    with torch.no_grad():
        expected = peft_model(IDS).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    # 3 layers x (q, k linear + v's up, gate, down)
    assert len(keys) == 15 and all(".knock_sets." in k and ".default." not in k for k in keys), keys[:3]
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "KNOCK" and saved["base_model_type"] == "llama"

    reloaded = PeftModel.from_pretrained(_stock(llama_base), tmp_path / "adapter")
    auto = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", attn_implementation="eager").eval()
    other_name = PeftModel.from_pretrained(_stock(llama_base), tmp_path / "adapter", adapter_name="shakespeare")
    with torch.no_grad():
        for model, how in ((reloaded, "PeftModel"), (auto, "AutoPeftModel"), (other_name, "another adapter name")):
            assert_close(model(IDS).logits, expected, what=how)


def test_several_adapters_switch_and_disable_exactly(llama_base, tmp_path):
    stock = _stock(llama_base)
    first = _adapter(llama_base, "linear_qkv")
    second = _adapter(llama_base, "mlp_v", scale=0.3)
    second.save_pretrained(tmp_path / "second")
    with torch.no_grad():
        logits_first, logits_second, logits_stock = first(IDS).logits, second(IDS).logits, stock(IDS).logits
        first.load_adapter(tmp_path / "second", adapter_name="second")
        assert_close(first(IDS).logits, logits_first, what="first adapter still active")
        first.set_adapter("second")
        assert_close(first(IDS).logits, logits_second, what="second adapter active")
        with first.disable_adapter():
            assert_close(first(IDS).logits, logits_stock, what="adapters disabled")
    assert not torch.equal(logits_first, logits_second)


def test_modules_to_save_train_and_save_beside_the_knocks(llama_base, tmp_path):
    peft_model = _adapter(llama_base, "linear_v", modules_to_save=["lm_head"])
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("lm_head.modules_to_save" in n for n in trainable) and any(".knock_sets." in n for n in trainable)
    with torch.no_grad():
        next(p for n, p in peft_model.named_parameters() if "lm_head.modules_to_save" in n).mul_(1.5)
        expected = peft_model(IDS).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    assert any("lm_head" in k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    with torch.no_grad():
        assert_close(PeftModel.from_pretrained(_stock(llama_base), tmp_path / "adapter")(IDS).logits, expected)


def test_linear_knocks_merge_into_a_stock_model_by_the_fold_rule(llama_base):
    peft_model = _adapter(llama_base, "linear_qkv")
    with torch.no_grad():
        expected = peft_model(IDS).logits
        q_knock = peft_model.base_model.model.model.layers[1].self_attn.q_proj.knock_sets["default"].q_knock.weight
        q_weight = peft_model.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight.clone()
    merged = peft_model.merge_and_unload()
    assert type(merged).__name__ == "LlamaForCausalLM" and not any("knock" in n for n, _ in merged.named_parameters())
    # the fold rule written out: head h's rows of q_proj become T^T-applied, i.e. knock.weight @ W_h
    head_dim = q_knock.shape[0]
    by_hand = torch.cat([q_knock.double() @ w.double() for w in q_weight.split(head_dim)]).float()
    assert_close(merged.model.layers[1].self_attn.q_proj.weight, by_hand, atol=1e-6, what="folded q_proj")
    with torch.no_grad():
        assert_close(merged(IDS).logits, expected, atol=1e-5, what="merged vs adapter")


def test_a_merge_that_overflows_float16_is_refused_before_the_layer_changes(llama_base):
    """A float16 knock (6e4 * I) and a float16 q_proj (entries 2) each fit, their fold (1.2e5) does not."""
    peft_model = _adapter(llama_base, "linear_qkv").to(torch.float16)
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        knock = q_proj.knock_sets["default"].q_knock.weight
        knock.copy_(6e4 * torch.eye(knock.shape[0]))
        q_proj.base_layer.weight.fill_(2.0)
    with pytest.raises(ValueError, match=r"adapter 'default': merging into torch.float16 weights: .* beyond the range"):
        peft_model.merge_and_unload()
    assert torch.equal(q_proj.base_layer.weight, torch.full_like(q_proj.base_layer.weight, 2.0))


def test_mlp_knocks_refuse_to_merge_and_convert_to_a_kha_model_instead(llama_base, tmp_path):
    peft_model = _adapter(llama_base, "mlp_v", scale=0.3)
    with torch.no_grad():
        expected = peft_model(IDS).logits
    before = {n: p.clone() for n, p in peft_model.named_parameters()}
    with pytest.raises(ValueError, match=r"MLP .*cannot be merged.*to_kha_model"):
        peft_model.merge_and_unload()
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters()), "a refused merge changed weights"
    kha = to_kha_model(peft_model)
    assert isinstance(kha, KHAForCausalLM)
    kha.save_pretrained(tmp_path / "kha")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "kha", attn_implementation="eager").eval()
    with torch.no_grad():
        assert_close(reloaded(IDS).logits, expected, what="KHA checkpoint of base + adapter")


def test_bad_configs_and_models_are_refused_in_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="'gpt2' is not one of"):
        get_peft_model(gpt2, KnockConfig())
    with pytest.raises(ValueError, match="unknown knock preset"):
        KnockConfig(knock="evil")
    with pytest.raises(ValueError, match="knock_v='quadratic'"):
        KnockConfig(knock_v="quadratic")
    with pytest.raises(ValueError, match="knock_layers must be"):
        KnockConfig(knock_layers=[0, 10**12])
    with pytest.raises(ValueError, match=r"knock_layers \[7\]"):
        get_peft_model(tiny_base_model("llama"), KnockConfig(knock_layers=[7]))
    with pytest.raises(ValueError, match="linear knocks only"):
        get_peft_model(tiny_base_model("deepseek_v3"), KnockConfig(knock="mlp_v"))
    kha = KHAForCausalLM.from_base(tiny_base_model("llama"))
    with pytest.raises(ValueError, match="has knocks already"):
        get_peft_model(kha, KnockConfig())


def test_bad_adapter_files_are_refused_before_loading(llama_base, tmp_path):
    folder = tmp_path / "adapter"
    _adapter(llama_base, "linear_qkv").save_pretrained(folder)
    weights = load_file(folder / "adapter_model.safetensors")
    key = sorted(weights)[0]
    cases = {
        "missing": {k: v for k, v in weights.items() if k != key},
        "unexpected": {**weights, key.replace("layers.0", "layers.0.extra"): weights[key].clone()},
        "shape": {**weights, key: torch.eye(weights[key].shape[0] + 1)},
        "finite": {**weights, key: torch.full_like(weights[key], float("nan"))},
    }
    for match, tensors in cases.items():
        save_file(tensors, folder / "adapter_model.safetensors")
        stock = _stock(llama_base)
        with pytest.raises(ValueError, match=match):
            PeftModel.from_pretrained(stock, folder)
    save_file(weights, folder / "adapter_model.safetensors")
    config = json.loads((folder / "adapter_config.json").read_text())
    qwen3 = tiny_base_model("qwen3")
    with pytest.raises(ValueError, match="made for a llama model, not qwen3"):
        PeftModel.from_pretrained(qwen3, folder)
    # a hostile config: targets elsewhere are ignored (derived from the model), bad values refused
    (folder / "adapter_config.json").write_text(json.dumps({**config, "target_modules": "lm_head|.*mlp.*"}))
    model = PeftModel.from_pretrained(_stock(llama_base), folder)
    assert {type(m).__name__ for n, m in model.named_modules() if "mlp" in n or n.endswith("lm_head")} >= {"Linear"}
    assert not any("mlp" in n for n, _ in model.named_parameters() if ".knock_sets." in n)
    (folder / "adapter_config.json").write_text(json.dumps({**config, "knock_layers": "0-999999999"}))
    with pytest.raises(ValueError, match="knock_layers must be"):
        PeftModel.from_pretrained(_stock(llama_base), folder)


def test_without_kha_hf_loading_an_adapter_fails_on_its_type(llama_base, tmp_path):
    """What a user without kha_hf meets: peft 0.21 knows no KNOCK type. The adapter's model card says where it
    comes from; peft itself raises KeyError('KNOCK') before any code of ours could run (documented in
    docs/guides/peft.md)."""
    _adapter(llama_base, "mlp_v").save_pretrained(tmp_path / "adapter")
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "kha-hf" in card
    script = (
        "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
        f"base = AutoModelForCausalLM.from_pretrained({str(llama_base)!r})\n"
        f"PeftModel.from_pretrained(base, {str(tmp_path / 'adapter')!r})\n"
    )
    result = run_python(script, tmp_path)
    assert result.returncode != 0 and "KeyError: 'KNOCK'" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("family", ["qwen3", "phi3", "deepseek_v3", "qwen3_next"])
def test_a_kha_models_knocks_become_an_adapter_and_back_exactly(family, tmp_path):
    kha = KHAForCausalLM.from_base(tiny_base_model(family), knock=presets(family)[-1]).eval()
    randomize_knocks(kha, scale=0.05)
    with torch.no_grad():
        expected = kha(IDS).logits
    peft_model = knock_adapter_from_kha(kha)
    assert type(peft_model.get_base_model()).__name__ == type(tiny_base_model(family)).__name__
    with torch.no_grad():
        assert_close(peft_model(IDS).logits, expected, what=f"{family}: adapter from a KHA model")
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_base_model(family), tmp_path / "adapter")
    # The reload runs on freshly allocated copies of equal tensors; on this CPU float32 matmuls over other buffers
    # round differently by up to ~2e-7 (seen on Phi-3 with every parameter, buffer and config entry equal).
    with torch.no_grad():
        assert_close(reloaded(IDS).logits, expected, atol=1e-5, what=f"{family}: reloaded adapter")
        back = to_kha_model(reloaded).eval()(IDS).logits
        assert_close(back, expected, atol=1e-5, what=f"{family}: back to a KHA model")
