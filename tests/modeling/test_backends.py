"""KHA works with every attention backend, gradient checkpointing, device_map, bf16 and torch.compile."""

import copy
import importlib.util

import pytest
import torch

from kha_hf import KHAForCausalLM
from tests.helpers import assert_close, randomize_knocks, tiny_base_model


def _trained_kha(family: str = "qwen3", attn: str = "eager"):
    kha = KHAForCausalLM.from_base(tiny_base_model(family, attn), knock="mlp_v_linear_qk")
    randomize_knocks(kha)
    return kha


def test_flex_attention_forward_on_cpu():
    kha = _trained_kha()
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        expected = kha(ids).logits
        kha.set_attn_implementation("flex_attention")
        got = kha(ids).logits
    assert kha.config._attn_implementation == "flex_attention"
    assert_close(got, expected, atol=1e-5, what="flex vs eager")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_attention_2_matches_sdpa_on_gpu():
    kha = _trained_kha(attn="sdpa").to("cuda", torch.bfloat16)
    ids = torch.randint(3, 128, (2, 16), device="cuda")
    with torch.no_grad():
        expected = kha(ids).logits.float()
        kha.set_attn_implementation("flash_attention_2")
        got = kha(ids).logits.float()
    assert_close(got, expected, atol=5e-2, what="flash_attention_2 vs sdpa (bf16)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_identity_parity():
    base = tiny_base_model("qwen3", "sdpa").to("cuda", torch.bfloat16)
    kha = KHAForCausalLM.from_base(copy.deepcopy(base), knock="mlp_v_linear_qk")
    ids = torch.randint(3, 128, (2, 16), device="cuda")
    with torch.no_grad():
        assert_close(kha(ids).logits, base(ids).logits)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_gradient_checkpointing_gives_same_gradients(family):
    kha = _trained_kha(family)
    kha.train()
    ids = torch.randint(3, 128, (2, 9))

    def grads(model):
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(kha)
    kha.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert kha.is_gradient_checkpointing
    checkpointed = grads(kha)
    assert set(plain) == set(checkpointed)
    assert any("_knock." in n for n in plain), "knocks received no gradient"
    for name in plain:
        assert_close(checkpointed[name], plain[name], atol=1e-6, what=name)


def test_device_map_auto_through_accelerate(tmp_path):
    # A CPU memory cap makes accelerate split the model and offload layers to disk, with its dispatch hooks;
    # each decoder layer (knocks included) must stay one unit.
    kha = _trained_kha()
    kha.save_pretrained(tmp_path / "kha")
    loaded = KHAForCausalLM.from_pretrained(
        tmp_path / "kha",
        device_map="auto",
        max_memory={"cpu": "400KB"},
        offload_folder=str(tmp_path / "offload"),
        attn_implementation="eager",
    )
    placement = loaded.hf_device_map
    assert "disk" in placement.values() and "cpu" in placement.values(), placement
    assert all(key.count(".") <= 2 for key in placement), f"a decoder layer was split: {placement}"
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        assert_close(loaded(ids).logits, kha(ids).logits)


def test_bf16_identity_parity_and_dtype():
    base = tiny_base_model("qwen3").to(torch.bfloat16)
    kha = KHAForCausalLM.from_base(copy.deepcopy(base), knock="mlp_v_linear_qk")
    assert all(p.dtype == torch.bfloat16 for p in kha.parameters())
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        assert_close(kha(ids).logits, base(ids).logits, what="bf16")


def test_torch_compile_forward_smoke():
    kha = _trained_kha(attn="sdpa")
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        expected = kha(ids).logits
        got = torch.compile(kha)(ids).logits
    assert_close(got, expected, atol=1e-4, what="compiled vs eager")
