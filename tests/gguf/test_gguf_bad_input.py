"""Bad input to `kha fold KHA_DIR OUT.gguf`: one line `kha fold: error: ...`, exit 2, and no file written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kha_hf.cli import main
from tests.cli.test_bad_input import one_line_error
from tests.gguf.conftest import tiny_kha, tiny_tokenizer
from tests.helpers import save_tiny_checkpoint


@pytest.fixture
def kha(tmp_path) -> Path:
    tiny_kha(tmp_path / "kha", "llama")
    return tmp_path / "kha"


def fold_error(capsys, *argv) -> str:
    return one_line_error(capsys, ["fold", *map(str, argv)], "fold")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".kha-") or p.suffix == ".gguf")


def test_existing_output_is_refused_without_overwrite_and_replaced_with_it(kha, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["fold", str(kha), str(out)]) == 0
    before = out.read_bytes()
    assert "already exists; pass --overwrite" in fold_error(capsys, kha, out)
    assert out.read_bytes() == before
    assert main(["fold", str(kha), str(out), "--overwrite", "--outtype", "q8_0"]) == 0
    assert out.read_bytes() != before and out.read_bytes()[:4] == b"GGUF"


def test_overwrite_replaces_gguf_files_only(kha, tmp_path, capsys):
    notes = tmp_path / "notes.gguf"
    notes.write_text("my notes, not a model")
    assert "is not a GGUF file" in fold_error(capsys, kha, notes, "--overwrite")
    assert notes.read_text() == "my notes, not a model"
    (tmp_path / "dir.gguf").mkdir()
    assert "is not a file" in fold_error(capsys, kha, tmp_path / "dir.gguf", "--overwrite")
    (tmp_path / "link.gguf").symlink_to(notes)
    assert "symbolic link" in fold_error(capsys, kha, tmp_path / "link.gguf", "--overwrite")
    assert "inside the source" in fold_error(capsys, kha, kha / "m.gguf")


def test_kha_mlp_is_refused_with_the_reason_and_the_way_out(tmp_path, capsys):
    tiny_kha(tmp_path / "mlp", "llama", knock="mlp_v")
    err = fold_error(capsys, tmp_path / "mlp", tmp_path / "m.gguf")
    assert "llama.cpp has no value-MLP graph" in err
    assert "linear_v or linear_qkv" in err and "kha serve" in err and "vLLM" in err
    err = fold_error(capsys, tmp_path / "mlp", tmp_path / "m.gguf", "--partial")
    assert "--partial keeps the value MLP" in err
    assert leftovers(tmp_path) == []


def test_a_family_llama_cpp_cannot_express(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path / "olmo2", "olmo2", knock="linear_qkv", vocab_size=320)
    tiny_tokenizer(tmp_path / "olmo2")
    err = fold_error(capsys, tmp_path / "olmo2", tmp_path / "m.gguf")
    assert "'olmo2'" in err and "gemma3_text" in err and "kha fold KHA_DIR OUT" in err
    save_tiny_checkpoint(tmp_path / "qwen2", "qwen2", knock="linear_v", vocab_size=320)  # sliding window on
    tiny_tokenizer(tmp_path / "qwen2")
    err = fold_error(capsys, tmp_path / "qwen2", tmp_path / "m.gguf")
    assert "sliding window (5 tokens" in err and "llama.cpp's qwen2 graph attends to the whole context" in err
    save_tiny_checkpoint(tmp_path / "mistral", "mistral", knock="linear_v", vocab_size=320)  # Mistral v0.1's window
    tiny_tokenizer(tmp_path / "mistral")
    assert "llama.cpp's llama graph attends to the whole context" in fold_error(
        capsys, tmp_path / "mistral", tmp_path / "m.gguf"
    )
    assert leftovers(tmp_path) == []


def test_a_tokenizer_without_what_gguf_needs(kha, tmp_path, capsys):
    (kha / "tokenizer.json").unlink()
    err = fold_error(capsys, kha, tmp_path / "m.gguf")
    assert "has no tokenizer.json (it has tokenizer_config.json)" in err and "carries its tokenizer" in err
    from kha_hf.training.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(["abc"], vocab_size=128).save_pretrained(kha)  # the 256 bytes only: no merge
    assert "has no merges" in fold_error(capsys, kha, tmp_path / "m.gguf")
    assert leftovers(tmp_path) == []


def test_an_unknown_pre_tokenizer_is_refused_unless_named(kha, tmp_path, capsys):
    spec = json.loads((kha / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    (kha / "tokenizer.json").write_text(json.dumps(spec))
    err = fold_error(capsys, kha, tmp_path / "m.gguf")
    assert "not one llama.cpp knows" in err and "--tokenizer-pre" in err
    assert main(["fold", str(kha), str(tmp_path / "m.gguf"), "--tokenizer-pre", "smollm"]) == 0


@pytest.mark.parametrize("where", ["projection", "knock"])
def test_non_finite_weights_are_refused_and_nothing_is_left(kha, tmp_path, capsys, where):
    path = kha / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.up_proj.weight" if where == "projection" else "model.layers.1.self_attn.k_knock.weight"
    tensors[name][0, 0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    err = fold_error(capsys, kha, tmp_path / "m.gguf")
    assert name in err and "NaN or infinite" in err
    assert leftovers(tmp_path) == []


def test_f16_overflow_is_refused_with_the_way_out(kha, tmp_path, capsys):
    path = kha / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6
    save_file(tensors, path, metadata={"format": "pt"})
    err = fold_error(capsys, kha, tmp_path / "m.gguf", "--outtype", "f16")
    assert "beyond what F16 stores" in err and "bf16 or f32" in err
    assert leftovers(tmp_path) == []


def test_gguf_only_options(kha, tmp_path, capsys):
    assert "apply to a GGUF output only" in fold_error(capsys, kha, tmp_path / "folder", "--outtype", "q8_0")
    assert "--link does not apply" in fold_error(capsys, kha, tmp_path / "m.gguf", "--link")
    assert "invalid choice" in fold_error(capsys, kha, tmp_path / "m.gguf", "--outtype", "q4_0")


def test_python_api_routes_gguf(kha, tmp_path):
    from kha_hf import fold

    result = fold(kha, tmp_path / "m.gguf", outtype="q8_0", progress=False)
    assert result.output == tmp_path / "m.gguf" and len(result.folded) == 9 and not result.kept_kha
    assert torch.tensor(list((tmp_path / "m.gguf").read_bytes()[:4])).tolist() == list(b"GGUF")


def test_q8_0_block_scale_overflow_is_refused(kha, tmp_path, capsys):
    path = kha / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e9  # its block's scale, 1e9 / 127, is beyond float16
    save_file(tensors, path, metadata={"format": "pt"})
    err = fold_error(capsys, kha, tmp_path / "m.gguf", "--outtype", "q8_0")
    assert "beyond what Q8_0 stores" in err and "bf16 or f32" in err
    assert main(["fold", str(kha), str(tmp_path / "m.gguf"), "--outtype", "bf16"]) == 0


@pytest.fixture
def plain(tmp_path) -> Path:
    from tests.gguf.conftest import tiny_base

    tiny_base("llama").save_pretrained(tmp_path / "plain")
    tiny_tokenizer(tmp_path / "plain")
    return tmp_path / "plain"


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": 4}, "the weights hold 3"),
        ({"num_hidden_layers": 10**9}, "is beyond any model's"),  # refused from config.json, nothing built
        ({"head_dim": 32}, "output features"),
        ({"num_attention_heads": 8}, "output features"),
        ({"num_key_value_heads": 3}, "output features"),
        ({"hidden_size": 128}, "the embedding"),
        ({"vocab_size": 1000}, "the embedding has"),
        (
            {"tie_word_embeddings": True},
            "says tie_word_embeddings, yet the weights hold an lm_head.weight that differs",
        ),
        ({"max_position_embeddings": 10**18}, "32-bit"),
        ({"rms_norm_eps": 1e300}, "rms_norm_eps"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"model_type": ["llama"]}, "unknown model_type"),
    ],
)
def test_a_config_that_does_not_describe_the_weights(plain, tmp_path, capsys, changes, message):
    _edit_config(plain, **changes)
    assert message in fold_error(capsys, plain, tmp_path / "m.gguf")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing"),
        (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}), "shape"),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].int()}),
            "int32",
        ),
    ],
)
def test_weights_the_config_does_not_describe(plain, tmp_path, capsys, edit, message):
    path = plain / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    assert message in fold_error(capsys, plain, tmp_path / "m.gguf")
    assert leftovers(tmp_path) == []


def test_an_unknown_tokenizer_pre_name_is_refused(kha, tmp_path, capsys):
    err = fold_error(capsys, kha, tmp_path / "m.gguf", "--tokenizer-pre", "xxxxxxxx")
    assert "not a pre-tokenizer type llama.cpp knows" in err and "smollm" in err


def test_a_fold_that_overflows_float16_is_refused(tmp_path, capsys):
    """The GGUF export folds by `kha fold`'s rule, in the checkpoint's dtype first: a float16 knock (6e4 * I) times a
    float16 projection (entries 2) does not fit float16 (tests/conversion/test_fold_inspect.py for the folder)."""
    model, _ = tiny_kha(tmp_path / "kha", "llama")
    attention = model.model.layers[1].self_attn
    with torch.no_grad():
        attention.k_knock.weight.copy_(6e4 * torch.eye(attention.k_knock.weight.shape[0]))
        attention.k_proj.weight.fill_(2.0)
    model.to(torch.float16).save_pretrained(tmp_path / "kha")
    error = fold_error(capsys, tmp_path / "kha", tmp_path / "m.gguf")
    assert "folding the knocks into model.layers.1.self_attn.k_proj.weight" in error, error
    assert "beyond the range of torch.float16" in error, error
    assert leftovers(tmp_path) == []
