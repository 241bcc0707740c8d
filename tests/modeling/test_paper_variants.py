"""The paper's ablation rows beyond the value MLP: MLP knocks on Q and K, the gate-only value control, random knock
initialisation; and every tool that takes a KHA model either takes them exactly or refuses them in one line.

(Identity bit-exactness and the hand-written reference for every family: tests/modeling/test_families.py, whose
presets include mlp_qkv and gate_v.)
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kha_hf import KHAConfig, KHAForCausalLM, KnockConfig
from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.conversion.fold import fold
from tests.cli.test_bad_input import one_line_error
from tests.helpers import assert_close, randomize_knocks, save_tiny_checkpoint, tiny_base_model

IDS = torch.tensor([[3, 9, 27, 81, 5, 15, 45, 7, 21]])


def _saved(folder, knock="mlp_q", scale=0.3, **types):
    kha = KHAForCausalLM.from_base(tiny_base_model("qwen3"), knock=knock, **types)
    randomize_knocks(kha, scale)
    kha.save_pretrained(folder)
    return kha


def test_the_mlp_on_q_sits_before_the_q_norm_and_rope():
    """A hook on q_norm sees the MLP-knocked projection output: the knock acts after q_proj and before the norm."""
    kha = KHAForCausalLM.from_base(tiny_base_model("qwen3"), knock="mlp_q")
    randomize_knocks(kha)
    attention = kha.model.layers[0].self_attn
    seen = {}
    attention.q_norm.register_forward_hook(lambda m, args, out: seen.setdefault("norm_in", args[0]))
    attention.q_proj.register_forward_hook(lambda m, args, out: seen.setdefault("proj_out", out))
    with torch.no_grad():
        kha(IDS)
    heads = seen["proj_out"].unflatten(-1, (-1, attention.head_dim))
    knock = attention.q_knock
    expected = 2 * ((heads @ knock.up.weight.T) * torch.sigmoid(heads @ knock.gate.weight.T)) @ knock.down.weight.T
    assert_close(seen["norm_in"], expected, atol=1e-6)


def test_random_initialisation_is_seeded_changes_the_outputs_and_survives_a_reload(tmp_path):
    base = tiny_base_model("qwen3")
    torch.manual_seed(5)
    first = KHAForCausalLM.from_base(copy.deepcopy(base), knock="mlp_v", knock_init="random")
    torch.manual_seed(5)
    again = KHAForCausalLM.from_base(copy.deepcopy(base), knock="mlp_v", knock_init="random")
    knock = first.model.layers[0].self_attn.v_knock
    assert torch.equal(knock.up.weight, again.model.layers[0].self_attn.v_knock.up.weight)  # seeded
    assert not torch.equal(knock.up.weight, torch.eye(knock.up.weight.shape[0]))
    assert knock.gate.weight.abs().max() > 0  # every map random, the gate too
    with torch.no_grad():
        assert (first(IDS).logits - base(IDS).logits).abs().max() > 1e-3
    first.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["knock_init"] == "random"
    loaded = KHAForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.layers[0].self_attn.v_knock.up.weight, knock.up.weight)  # loaded, not redrawn
    # a config built from scratch draws its knocks at random too (kha ab's from-scratch arms)
    config = KHAConfig.from_base(base.config, knock="linear_v", knock_init="random")
    scratch = KHAForCausalLM(config)
    weight = scratch.model.layers[0].self_attn.v_knock.weight
    assert not torch.equal(weight, torch.eye(weight.shape[0]))
    # an identity model's config does not mention it (every earlier checkpoint means identity)
    assert "knock_init" not in KHAConfig.from_base(base.config).to_diff_dict()


def test_fold_refuses_an_mlp_on_any_target_and_partial_fold_keeps_it(tmp_path, capsys):
    kha = _saved(tmp_path / "kha", knock="mlp_q", knock_k="linear", knock_v="linear")
    err = one_line_error(capsys, ["fold", str(tmp_path / "kha"), str(tmp_path / "out")], "fold")
    assert "the query knock is an MLP (KHA-MLP)" in err and "q_proj" in err and "--partial" in err
    result = fold(tmp_path / "kha", tmp_path / "out", partial=True, progress=False)
    config = json.loads((result.output / "config.json").read_text())
    assert (config["knock_q"], config["knock_k"], config["knock_v"]) == ("mlp", "none", "none")
    partial = KHAForCausalLM.from_pretrained(result.output)
    with torch.no_grad():
        assert_close(partial(IDS).logits, kha(IDS).logits, atol=1e-5)
    _saved(tmp_path / "qkv", knock="mlp_qkv")
    err = one_line_error(capsys, ["fold", str(tmp_path / "qkv"), str(tmp_path / "o2")], "fold")
    assert "the query/key/value knocks are MLPs" in err
    with pytest.raises(KHAError, match="nothing to fold.*Q/K/V MLP"):
        fold(tmp_path / "qkv", tmp_path / "o3", partial=True, progress=False)


@pytest.mark.parametrize(
    ("knock", "extra", "says"),
    [
        ("gate_v", {}, "gate-only control (gate_v)"),
        ("linear_v", {"knock_init": "random"}, "initialised at random"),
    ],
)
def test_fold_and_gguf_refuse_the_controls_in_one_line(tmp_path, capsys, knock, extra, says):
    _saved(tmp_path / "kha", knock=knock, **extra)
    for out in ("out", "m.gguf"):
        err = one_line_error(capsys, ["fold", str(tmp_path / "kha"), str(tmp_path / out)], "fold")
        assert says in err and "one of the paper's controls" in err and "kha ab --variants" in err
        assert not (tmp_path / out).exists()


def test_gguf_refuses_an_mlp_on_the_keys(tmp_path, capsys):
    _saved(tmp_path / "kha", knock="mlp_k")
    err = one_line_error(capsys, ["fold", str(tmp_path / "kha"), str(tmp_path / "m.gguf")], "fold")
    assert "the key knock is an MLP (KHA-MLP): llama.cpp has no key-MLP graph" in err and "k_proj" in err


def test_convert_refuses_the_gate_control_before_reading_anything(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path / "base", "qwen3")
    argv = ["convert", str(tmp_path / "base"), str(tmp_path / "out"), "--knock", "gate_v"]
    err = one_line_error(capsys, argv, "convert")
    assert "--knock gate_v is the gate-only value knock" in err and "kha ab --variants" in err
    argv[-1] = "mlp_v_random"  # kha ab's random-init variant: it changes the outputs
    err = one_line_error(capsys, argv, "convert")
    assert "mlp_v_random draws the knocks at random, which changes the model's outputs" in err
    with pytest.raises(KHAError, match="draws the knocks at random"):
        from kha_hf.conversion.converter import convert

        convert(tmp_path / "base", tmp_path / "out", knock="linear_v_random")
    assert not (tmp_path / "out").exists()


def test_the_knock_adapter_takes_mlp_q_and_k_and_refuses_the_gate():
    from peft import get_peft_model

    base = tiny_base_model("qwen3")
    with torch.no_grad():
        expected = base(IDS).logits
    model = get_peft_model(copy.deepcopy(base), KnockConfig(knock="mlp_qkv"))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)  # identity at init, MLPs on Q and K included
    names = [n for n, _ in model.named_parameters() if "q_knock" in n]
    assert any(n.endswith("q_knock.up.weight") for n in names)
    randomize_knocks(model)
    with torch.no_grad():
        adapted = model(IDS).logits
    with pytest.raises(ValueError, match="query knock is an MLP.*cannot be merged"):
        model.merge_and_unload()
    # its knocks in a KHA model compute what the adapter computes
    from kha_hf.peft import to_kha_model

    with torch.no_grad():
        assert_close(to_kha_model(model)(IDS).logits, adapted, atol=1e-5)
    with pytest.raises(ValueError, match=r"knock='gate_v' is the gate-only control.*a knock adapter takes"):
        KnockConfig(knock="gate_v")
    with pytest.raises(ValueError, match="knock_v='gate' is not valid; choose one of none, linear, mlp$"):
        KnockConfig(knock_v="gate")


def test_convert_verify_and_inspect_take_the_mlp_on_q_and_k(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path / "base", "qwen3")
    out = tmp_path / "kha"
    assert main(["convert", str(tmp_path / "base"), str(out), "--knock", "mlp_qkv", "--verify"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["knock_q"], config["knock_k"], config["knock_v"]) == ("mlp", "mlp", "mlp")
    assert "knock_init" not in config
    assert main(["verify", str(tmp_path / "base"), str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    text = json.dumps(stats)
    for label in ("q.up", "q.gate", "k.down", "v.up"):
        assert label in text, label  # every map of every target, each at its start (distance 0)
    assert main(["inspect", str(out), "--plot", str(tmp_path / "knocks.png")]) == 0
    assert (tmp_path / "knocks.png").read_bytes()[:4] == b"\x89PNG"
    # a gate_v model (trained from scratch by kha ab) is inspected too: its one map per layer
    _saved(tmp_path / "gate", knock="gate_v")
    assert main(["inspect", str(tmp_path / "gate"), "--json"]) == 0
    assert "v.gate" in capsys.readouterr().out
