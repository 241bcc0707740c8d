"""Safety round 6 (#58 items 5 and 6, and a cosmetic one): checkpoints that lie are refused in one line by every tool.

- A safetensors header whose `__metadata__` holds an object passed kha's header reader; safetensors refuses it, so
  `kha convert` wrote a checkpoint nothing could load (and `kha verify` printed a 28-line traceback).
- `tie_word_embeddings: true` with a stored `lm_head` that differs from the embeddings: convert and fold wrote it,
  GGUF export refused it, and transformers, vLLM and llama.cpp would give different logits.
- A string `rms_norm_eps` gave a two-line "one-line" error.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from kha_hf.cli import main
from tests.cli.test_bad_input import one_line_error
from tests.helpers import save_tiny_checkpoint


def _set_metadata(path, metadata) -> None:
    """Rewrite PATH's header with __metadata__ = METADATA (an object safetensors refuses), padded to 8 bytes."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def test_a_metadata_object_is_refused_by_convert_and_by_every_kha_tool(tmp_path, capsys):
    base = tmp_path / "base"
    save_tiny_checkpoint(base, "llama")
    _set_metadata(base / "model.safetensors", {"format": {"pt": 1}})
    err = one_line_error(capsys, ["convert", str(base), str(tmp_path / "out")], "convert")
    assert "__metadata__ must map names to strings" in err, err
    assert not (tmp_path / "out").exists()
    kha = tmp_path / "kha"
    save_tiny_checkpoint(kha, "llama", knock="linear_qkv")
    _set_metadata(kha / "model.safetensors", {"format": {"pt": 1}})
    for argv, command in (
        (["inspect", str(kha)], "inspect"),
        (["fold", str(kha), str(tmp_path / "folded")], "fold"),
        (["adapter", str(kha), str(tmp_path / "adapter")], "adapter"),
        (["verify", str(tmp_path / "stock"), str(kha)], "verify"),
    ):
        if command == "verify":
            save_tiny_checkpoint(tmp_path / "stock", "llama")
        err = one_line_error(capsys, argv, command)
        assert "__metadata__ must map names to strings" in err, (command, err)
        assert "changed since" not in err


def _untied_lie(folder, family: str = "llama", knock: str | None = None, same: bool = False) -> None:
    """A checkpoint whose config ties the output while its weights hold an lm_head (SAME: equal to the embeddings)."""
    save_tiny_checkpoint(folder, family, knock=knock, tie_word_embeddings=False)
    tensors = load_file(folder / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding.clone() if same else embedding + 0.5
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    if "text_config" in config:
        config["text_config"]["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))


TIED_LIE = "says tie_word_embeddings, yet the weights hold an lm_head.weight that differs from the embeddings ("


def test_a_tied_embedding_lie_is_refused_by_convert_fold_and_gguf_export_alike(tmp_path, capsys):
    base = tmp_path / "base"
    _untied_lie(base)
    err = one_line_error(capsys, ["convert", str(base), str(tmp_path / "out")], "convert")
    assert TIED_LIE in err, err
    kha = tmp_path / "kha"
    _untied_lie(kha, knock="linear_qkv")
    for target in ("folded", "folded.gguf"):
        err = one_line_error(capsys, ["fold", str(kha), str(tmp_path / target)], "fold")
        assert TIED_LIE in err, (target, err)
        assert not (tmp_path / target).exists()
    assert not (tmp_path / "out").exists()


def test_a_stored_head_equal_to_the_embeddings_is_accepted_everywhere(tmp_path, capsys):
    """Some checkpoints store the tied head as well: bit for bit the embeddings, it describes the same model."""
    base = tmp_path / "base"
    _untied_lie(base, same=True)
    assert main(["convert", str(base), str(tmp_path / "out")]) == 0
    kha = tmp_path / "kha"
    _untied_lie(kha, knock="linear_qkv", same=True)
    assert main(["fold", str(kha), str(tmp_path / "folded")]) == 0
    # GGUF export's own check (the tiny tokenizer has no merges for a whole export): the head is the tied output
    from kha_hf.checkpoint.reader import open_checkpoint
    from kha_hf.conversion.gguf_export import check_checkpoint_tensors

    check_checkpoint_tensors(open_checkpoint(tmp_path / "folded"))


@pytest.mark.parametrize("value", ["1e-5", [1e-5]])
def test_a_config_value_of_the_wrong_type_is_one_line(tmp_path, capsys, value):
    base = tmp_path / "base"
    save_tiny_checkpoint(base, "llama")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "rms_norm_eps": value}))
    err = one_line_error(capsys, ["convert", str(base), str(tmp_path / "out")], "convert")
    assert "rms_norm_eps" in err, err


def test_the_lie_check_reads_rows_not_the_whole_head(tmp_path, monkeypatch):
    """Compared TIED_ROWS rows at a time: a vocabulary of several chunks still shows a difference in its last row."""
    from kha_hf.checkpoint import checks
    from kha_hf.checkpoint.reader import open_checkpoint
    from kha_hf.common.errors import KHAError

    monkeypatch.setattr(checks, "TIED_ROWS", 7)
    base = tmp_path / "base"
    _untied_lie(base, same=True)
    tensors = load_file(base / "model.safetensors")
    head = tensors["lm_head.weight"].clone()
    head[-1, 0] += torch.tensor(1.0, dtype=head.dtype)
    tensors["lm_head.weight"] = head
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KHAError, match="differs from the embeddings"):
        open_checkpoint(base)  # checked as it is opened
