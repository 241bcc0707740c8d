"""`kha convert`: streaming, byte-identical shards, atomic output, clear errors, and exact parity after loading."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from kha_hf import KHAForCausalLM
from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.conversion import convert
from kha_hf.conversion.converter import KNOCKS_FILE
from tests.helpers import assert_close, tiny_base_model

EXTRA_FILES = {
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": '{"model_max_length": 256}',
    "chat_template.jinja": "{{ messages }}",
    "special_tokens_map.json": "{}",
}


def sha256_tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def make_checkpoint(folder: Path, family: str = "llama", sharded: bool = True, seed: int = 0):
    model = tiny_base_model(family, seed=seed)
    model.save_pretrained(folder, max_shard_size="60KB" if sharded else "1GB")
    for name, text in EXTRA_FILES.items():
        (folder / name).write_text(text)
    return model


@pytest.fixture
def sharded_llama(tmp_path):
    folder = tmp_path / "llama"
    model = make_checkpoint(folder)
    assert (folder / "model.safetensors.index.json").exists(), "fixture should be sharded"
    return folder, model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_copy_mode_is_byte_identical_and_complete(sharded_llama, tmp_path):
    src, base = sharded_llama
    before = sha256_tree(src)
    result = convert(src, tmp_path / "out", knock="mlp_v_linear_qk", progress=False)
    out = result.output
    after_out = sha256_tree(out)
    shards = [n for n in before if n.endswith(".safetensors")]
    assert len(shards) > 1
    for name in shards:
        assert after_out[name] == before[name], f"{name} is not byte-identical"
    assert sha256_tree(src) == before, "SRC was modified"
    for name in [*EXTRA_FILES, "generation_config.json"]:
        assert after_out[name] == before[name], f"{name} not carried over"
    for name in ("configuration_kha.py", "modeling_kha.py", "knocks.py", "README.md", KNOCKS_FILE):
        assert (out / name).is_file(), name

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    held = {}
    for shard in {*index.values()}:
        held.update(dict.fromkeys(load_file(out / shard), shard))
    assert index == held, "index must list every tensor with its file"
    knocks = load_file(out / KNOCKS_FILE)
    assert len(knocks) == 3 * 5  # 3 layers x (q, k, up, gate, down)
    for name, tensor in knocks.items():
        expected = torch.zeros(16, 16) if name.endswith("gate.weight") else torch.eye(16)
        assert torch.equal(tensor, expected), name

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kha" and config["base_model_type"] == "llama"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kha.KHAForCausalLM"
    card = (out / "README.md").read_text()
    # a local folder name is not a Hub id, so no base_model (tests/conversion/test_model_card.py has the others)
    assert "base_model:" not in card and "library_name: transformers" in card and "mlp_v_linear_qk" in card

    model, info = KHAForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(3, 128, (2, 9))
    assert_close(_logits(model, ids), _logits(base, ids))


def test_link_mode_hard_links_and_leaves_src_untouched(sharded_llama, tmp_path):
    src, base = sharded_llama
    before = sha256_tree(src)
    out = convert(src, tmp_path / "out", knock="linear_v", link=True, progress=False).output
    for shard in src.glob("*.safetensors"):
        assert os.path.samefile(shard, out / shard.name), f"{shard.name} is not linked"
    assert sha256_tree(src) == before
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ids = torch.randint(3, 128, (2, 9))
    assert_close(_logits(model, ids), _logits(base, ids))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral"])
def test_single_file_sources_of_every_family_convert_with_parity(family, tmp_path):
    src = tmp_path / family
    base = make_checkpoint(src, family, sharded=False)
    out = convert(src, tmp_path / "out", knock="mlp_v_linear_qk", progress=False).output
    model, info = KHAForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(3, 128, (2, 9))
    assert_close(_logits(model, ids), _logits(base, ids))


def test_dtype_cast_rewrites_shards(sharded_llama, tmp_path):
    src, _ = sharded_llama
    out = convert(src, tmp_path / "out", dtype="bfloat16", progress=False).output
    for shard in out.glob("*.safetensors"):
        assert all(t.dtype == torch.bfloat16 for t in load_file(shard).values()), shard.name
    model = KHAForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert model.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, attn_implementation="eager")
    ids = torch.randint(3, 128, (2, 9))
    assert_close(_logits(model, ids), _logits(reference, ids))


def test_existing_dst_refused_then_overwritten(sharded_llama, tmp_path):
    src, _ = sharded_llama
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    (dst / "config.json").write_text("{}")
    (dst / ".kha-output").write_text("{}")  # a folder kha wrote: --overwrite may replace it
    with pytest.raises(KHAError, match=r"already exists.*--overwrite \(overwrite=True from Python\)"):
        convert(src, dst, progress=False)
    assert (dst / "keep.txt").read_text() == "mine"
    convert(src, dst, overwrite=True, progress=False)
    assert not (dst / "keep.txt").exists() and (dst / KNOCKS_FILE).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kha-")], "temporary folders left behind"


def test_failure_mid_way_leaves_no_dst(sharded_llama, tmp_path, monkeypatch):
    src, _ = sharded_llama
    import kha_hf.conversion.converter as convert_module

    calls = []

    def failing_place(*args):
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk full")
        return original(*args)

    original = convert_module.place_file
    monkeypatch.setattr(convert_module, "place_file", failing_place)
    with pytest.raises(OSError, match="disk full"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out.", ".kha-"))]


def test_kill_mid_way_leaves_dst_absent_and_src_intact(sharded_llama, tmp_path):
    src, _ = sharded_llama
    before = sha256_tree(src)
    script = textwrap.dedent(
        f"""
        import os, signal
        import kha_hf.conversion.converter as m
        from kha_hf.cli import main
        original, calls = m.place_file, []
        def place_then_die(*args):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args)
        m.place_file = place_then_die
        main(["convert", {str(src)!r}, {str(tmp_path / "out")!r}])
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert not (tmp_path / "out").exists()
    assert sha256_tree(src) == before
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".kha-")], "SIGKILL leaves the temporary folder"
    convert(src, tmp_path / "out", progress=False)  # the rerun removes it: its owner is gone
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kha-")]


def _cli_error(capsys, argv) -> str:
    capsys.readouterr()  # drop what fixtures printed
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1, f"expected a one-line error, got:\n{err}"
    return err


def test_error_unsupported_architecture(tmp_path, capsys):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    err = _cli_error(capsys, ["convert", str(tmp_path / "gpt2"), str(tmp_path / "out")])
    assert "unsupported base model type 'gpt2'" in err and "llama, mistral, ministral, qwen2, qwen2_moe" in err


def test_error_already_kha(sharded_llama, tmp_path, capsys):
    src, _ = sharded_llama
    convert(src, tmp_path / "kha", progress=False)
    err = _cli_error(capsys, ["convert", str(tmp_path / "kha"), str(tmp_path / "again")])
    assert "already a KHA checkpoint" in err


def test_error_missing_shard(sharded_llama, tmp_path, capsys):
    src, _ = sharded_llama
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    err = _cli_error(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert f"shard {victim.name} is named in model.safetensors.index.json but missing" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_error_truncated_or_corrupt_safetensors(tmp_path, capsys, damage):
    src = tmp_path / "src"
    make_checkpoint(src, sharded=False)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        data[: len(data) // 2] if damage == "truncate" else b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + data[20:]
    )
    err = _cli_error(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert "model.safetensors" in err and ("truncated" in err or "corrupt" in err)


def test_error_config_missing_fields(tmp_path, capsys):
    src = tmp_path / "src"
    make_checkpoint(src, sharded=False)
    config = json.loads((src / "config.json").read_text())
    del config["hidden_size"], config["num_hidden_layers"]
    (src / "config.json").write_text(json.dumps(config))
    err = _cli_error(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert "lacks required fields: hidden_size, num_hidden_layers" in err


def test_error_config_disagrees_with_weights(tmp_path, capsys):
    src = tmp_path / "src"
    make_checkpoint(src, sharded=False)
    config = json.loads((src / "config.json").read_text())
    config["num_attention_heads"] = 8
    (src / "config.json").write_text(json.dumps(config))
    err = _cli_error(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert "q_proj.weight has shape [64, 64]" in err and "give 128 output features" in err


def test_error_unknown_preset(sharded_llama, tmp_path, capsys):
    src, _ = sharded_llama
    with pytest.raises(SystemExit) as exit_info:  # argparse rejects it with its usage line
        main(["convert", str(src), str(tmp_path / "out"), "--knock", "mlp_everything"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'mlp_everything'" in capsys.readouterr().err
    with pytest.raises(KHAError, match="unknown knock preset 'mlp_everything'"):
        convert(src, tmp_path / "out", knock="mlp_everything")


def test_error_pickle_checkpoint_is_refused(tmp_path, capsys):
    src = tmp_path / "src"
    model = tiny_base_model("llama")
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    err = _cli_error(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert "pickle weights (pytorch_model.bin)" in err and "safetensors" in err


def test_error_unreachable_hub_id_names_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = _cli_error(capsys, ["convert", "someone/not-a-real-model-kha", str(tmp_path / "out")])
    assert "cannot fetch 'someone/not-a-real-model-kha' from the Hugging Face Hub" in err


def test_push_to_hub_hands_the_finished_folder_to_the_upload(sharded_llama, tmp_path, monkeypatch):
    src, _ = sharded_llama
    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, **kwargs):
            calls["create_repo"] = (repo_id, kwargs)

        def upload_folder(self, **kwargs):
            calls["upload_folder"] = kwargs
            calls["files"] = sorted(os.listdir(kwargs["folder_path"]))
            return "https://huggingface.co/me/tiny-kha/commit/abc"

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert main(["convert", str(src), str(tmp_path / "out"), "--push-to-hub", "me/tiny-kha", "--private"]) == 0
    assert calls["create_repo"] == ("me/tiny-kha", {"repo_type": "model", "private": True, "exist_ok": True})
    upload = calls["upload_folder"]
    assert upload["repo_id"] == "me/tiny-kha" and upload["repo_type"] == "model"
    assert Path(upload["folder_path"]) == (tmp_path / "out").absolute()
    assert calls["files"] == sorted(os.listdir(tmp_path / "out"))
    assert {KNOCKS_FILE, "config.json", "modeling_kha.py", "README.md"} <= set(calls["files"])


def test_verify_passes_for_conversion_and_fails_for_changed_knocks(sharded_llama, tmp_path, capsys):
    src, _ = sharded_llama
    (src / "tokenizer.json").unlink()  # the verify step needs a real tokenizer: give the fixture one
    (src / "tokenizer_config.json").unlink()
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(127)} | {"[UNK]": 127}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="w2").save_pretrained(src)
    out = convert(src, tmp_path / "out", knock="linear_qkv", verify=True, progress=False).output
    said = capsys.readouterr().out  # a line before each phase: loading, and each prompt (seconds each when large)
    assert "verifying: loading" in said and "verifying prompt 3/3" in said and "max |Δlogit|" in said
    assert main(["verify", str(src), str(out)]) == 0
    assert "0.000e+00" in capsys.readouterr().out
    knocks = load_file(out / KNOCKS_FILE)
    from safetensors.torch import save_file

    save_file({k: v + 0.2 * torch.randn_like(v) for k, v in knocks.items()}, out / KNOCKS_FILE)
    assert main(["verify", str(src), str(out)]) == 2
    assert "verification failed" in capsys.readouterr().err


@pytest.mark.slow
def test_real_smollm2_gguf_converts_with_identical_logits(tmp_path, capsys):
    from kha_hf.common.assets import smollm2_gguf

    gguf = smollm2_gguf()
    out = convert(gguf, tmp_path / "smollm2-kha", knock="mlp_v", verify=True, progress=True).output
    said = capsys.readouterr().out  # what the CLI prints: the GGUF is dequantised once, verify says what it does
    assert said.count("dequantising") == 1 and "verifying: loading" in said and "verified" in said, said
    config = json.loads((out / "config.json").read_text())
    assert config["base_model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()


def test_knock_layers_limit_the_knock_tensors(sharded_llama, tmp_path):
    src, base = sharded_llama
    assert main(["convert", str(src), str(tmp_path / "out"), "--knock", "linear_v", "--knock-layers", "0,2"]) == 0
    knocks = load_file(tmp_path / "out" / KNOCKS_FILE)
    assert sorted(knocks) == ["model.layers.0.self_attn.v_knock.weight", "model.layers.2.self_attn.v_knock.weight"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["knock_layers"] == [0, 2]
    model, info = KHAForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and model.model.layers[1].self_attn.v_knock is None
    ids = torch.randint(3, 128, (2, 9))
    assert_close(_logits(model, ids), _logits(base, ids))
