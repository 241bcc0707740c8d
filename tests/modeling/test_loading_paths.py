"""Loading paths that used to crash: disk offload of a base checkpoint, init_weights after from_base."""

import pytest
import torch

from kha_hf import KHAForCausalLM
from kha_hf.conversion import convert
from tests.helpers import run_python, tiny_base_model

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


def test_a_whole_model_saved_with_torch_save_loads_in_a_new_process(tmp_path):
    """Unpickling looks the family's class (`KHAQwen3ForCausalLM`, `KHALlamaForSequenceClassification`) up by name
    before anything in the new process has built it: it was an AttributeError."""
    from transformers import AutoModelForSequenceClassification

    from kha_hf import KHAForSequenceClassification

    lm = KHAForCausalLM.from_base(tiny_base_model("qwen3"), knock="mlp_v")
    head = tiny_base_model("llama", auto=AutoModelForSequenceClassification, pad_token_id=0)
    head = KHAForSequenceClassification.from_base(head)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.save({"lm": lm(ids).logits, "head": head(ids).logits}, tmp_path / "expected.pt")
    torch.save(lm, tmp_path / "lm.pt")
    torch.save(head, tmp_path / "head.pt")
    script = (
        "import torch\n"
        "expected = torch.load('expected.pt')\n"
        "for name in ('lm', 'head'):\n"
        "    model = torch.load(name + '.pt', weights_only=False)\n"
        "    with torch.no_grad():\n"
        "        assert torch.equal(model(torch.tensor([[1, 2, 3, 4]])).logits, expected[name]), name\n"
        "    print(type(model).__name__)\n"
    )
    out = run_python(script, tmp_path, without_kha_hf=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["KHAQwen3ForCausalLM", "KHALlamaForSequenceClassification"]
