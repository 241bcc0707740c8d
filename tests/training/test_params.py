"""Knock parameter counts and optimizer groups that keep knocks out of weight decay."""

import pytest
import torch
from transformers import Qwen3Config

from kha_hf import KHAConfig, KHAForCausalLM, count_knock_parameters, knock_parameter_names, optimizer_param_groups
from tests.helpers import tiny_base_model


@pytest.mark.parametrize("preset", ["mlp_v", "linear_qkv"])
def test_knock_parameter_count_is_three_head_dim_squared_per_layer(preset):
    base = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_hidden_layers=3,
        intermediate_size=32,
        vocab_size=64,
    )
    model = KHAForCausalLM(KHAConfig.from_base(base, knock=preset))
    assert count_knock_parameters(model) == 3 * 24**2 * 3
    partial = KHAForCausalLM(KHAConfig.from_base(base, knock=preset, knock_layers=[1]))
    assert count_knock_parameters(partial) == 3 * 24**2


def test_optimizer_groups_keep_knocks_out_of_weight_decay():
    model = KHAForCausalLM.from_base(tiny_base_model("qwen3"), knock="mlp_v_linear_qk")
    groups = optimizer_param_groups(model, weight_decay=0.1, lr=1e-3, knock_lr=5e-3)
    knock_ids = {id(p) for n, p in model.named_parameters() if n in set(knock_parameter_names(model))}
    for group in groups:
        ids = {id(p) for p in group["params"]}
        if ids & knock_ids:
            assert ids == knock_ids and group["weight_decay"] == 0.0 and group["lr"] == 5e-3
        elif group["weight_decay"] > 0:
            assert all(p.ndim >= 2 for p in group["params"])
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    # Stepping AdamW with zero gradients leaves identity knocks untouched (decay would shrink them).
    optimizer = torch.optim.AdamW(groups)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    eye = torch.eye(16)
    assert torch.equal(model.model.layers[0].self_attn.q_knock.weight.detach(), eye)


def test_peft_wrapped_models_count_each_knock_once_and_lora_can_target_knocks():
    import copy

    from peft import LoraConfig, get_peft_model

    from kha_hf import knock_target_modules

    model = KHAForCausalLM.from_base(tiny_base_model("llama"), knock="mlp_v_linear_qk")
    n = count_knock_parameters(model)
    assert n == 3 * 3 * 16**2 + 2 * 3 * 16**2  # per layer: v MLP (3 maps) + q and k linear, 3 layers, head_dim 16
    saved = get_peft_model(
        copy.deepcopy(model), LoraConfig(target_modules=["v_proj"], modules_to_save=["q_knock", "k_knock", "v_knock"])
    )
    assert count_knock_parameters(saved) == n  # not 2n: PEFT's frozen original_module copies are not counted
    assert len(knock_parameter_names(saved)) == len(knock_parameter_names(model))
    targets = knock_target_modules(model)
    assert targets == ["k_knock", "q_knock", "v_knock.down", "v_knock.gate", "v_knock.up"]
    on_knocks = get_peft_model(copy.deepcopy(model), LoraConfig(target_modules=targets, r=4))
    assert count_knock_parameters(on_knocks) == n  # LoRA matrices on knocks are not knock weights
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(on_knocks(ids).logits, model(ids).logits)  # LoRA starts at zero


def test_kha_models_deep_copy():
    import copy

    model = KHAForCausalLM.from_base(tiny_base_model("qwen3"), knock="mlp_v")
    twin = copy.deepcopy(model)
    assert type(twin) is type(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
