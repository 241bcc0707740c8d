"""Loading paths that used to crash: disk offload of a base checkpoint, init_weights after from_base."""

import pytest
import torch

from kha_hf import KHAForCausalLM
from kha_hf.conversion import convert
from tests.helpers import tiny_base_model

IDS = torch.tensor([[3, 9, 27, 81, 5, 15, 45]])


def test_init_weights_after_from_base_keeps_the_base_weights():
    base = tiny_base_model("qwen3")
    with torch.no_grad():
        expected = base(IDS).logits
    kha = KHAForCausalLM.from_base(base, knock="mlp_v_linear_qk")
    kha.init_weights()
    with torch.no_grad():
        assert torch.equal(kha(IDS).logits, expected)
    assert torch.equal(kha.model.layers[0].self_attn.q_knock.weight, torch.eye(16))


def test_disk_offload_of_a_base_checkpoint_points_to_kha_convert(tmp_path):
    tiny_base_model("llama").save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="kha convert"):
        KHAForCausalLM.from_pretrained(
            tmp_path / "base", device_map="auto", max_memory={"cpu": "50KB"}, offload_folder=tmp_path / "offload"
        )


def test_disk_offload_of_a_converted_checkpoint_is_exact(tmp_path):
    base = tiny_base_model("llama")
    base.save_pretrained(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "kha", progress=False)
    model = KHAForCausalLM.from_pretrained(
        tmp_path / "kha",
        device_map="auto",
        # half the weights' bytes: some layers stay, the rest go to disk (transformers 5.16.1 refuses a budget
        # that would offload the whole model)
        max_memory={"cpu": sum(p.numel() * p.element_size() for p in base.parameters()) // 2},
        offload_folder=tmp_path / "offload",
        attn_implementation="eager",
    )
    assert any(p.device.type == "meta" for p in model.parameters()), "nothing was offloaded: the test tests nothing"
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, base(IDS).logits)


def test_saved_weights_get_normal_file_permissions(tmp_path):
    import os

    model = KHAForCausalLM.from_base(tiny_base_model("llama"))
    model.save_pretrained(tmp_path / "kha")
    umask = os.umask(0)
    os.umask(umask)
    mode = (tmp_path / "kha" / "model.safetensors").stat().st_mode & 0o777
    assert mode == 0o666 & ~umask, oct(mode)  # safetensors alone writes 0600
