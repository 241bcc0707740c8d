"""A GGUF file whose metadata contradicts its tensors is refused before transformers builds a model from it.

Safety round 5, item 1: a 0.5 MB GGUF of a folded tiny model with `llama.block_count` set to 200000 made
`kha convert` grow by about 20 MB/s without end. The tampered files here are real GGUF exports of a tiny model
(`kha fold KHA_DIR OUT.gguf`) with one metadata value rewritten in place, as gguf's own `gguf_set_metadata` does.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kha_hf import KHAError
from kha_hf.checkpoint.loading import load_causal_lm
from kha_hf.cli import main
from tests.cli.test_bad_input import one_line_error
from tests.gguf.conftest import tiny_kha

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    tiny_kha(folder / "kha", "llama")
    assert main(["fold", str(folder / "kha"), str(folder / "t.gguf")]) == 0
    return folder / "t.gguf"


def tampered(source: Path, folder: Path, key: str, value: int) -> Path:
    """A copy of SOURCE whose integer metadata KEY holds VALUE."""
    from gguf import GGUFReader

    out = folder / f"{key.replace('.', '-')}.gguf"
    out.write_bytes(source.read_bytes())
    reader = GGUFReader(out, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()
    del reader
    return out


def peak_rss_mb(argv: list[str], timeout: float) -> tuple[int, str, float]:
    """(exit code, stderr, peak RSS in MB) of `kha ARGV` run as the only child of a fresh interpreter."""
    probe = (
        "import resource, subprocess, sys, json\n"
        "p = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=float(sys.argv[1]))\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "print(json.dumps([p.returncode, p.stderr, peak]))\n"
    )
    command = [sys.executable, "-c", probe, str(timeout), sys.executable, "-m", "kha_hf_entry", *argv]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout + 30)
    assert done.returncode == 0, done.stderr[-3000:]
    return tuple(json.loads(done.stdout))


def test_a_layer_count_beyond_the_tensors_is_one_line_in_bounded_memory(tiny_gguf, tmp_path):
    bad = tampered(tiny_gguf, tmp_path, "llama.block_count", 200_000)
    rc, err, peak = peak_rss_mb(["convert", str(bad), str(tmp_path / "out")], timeout=300)
    assert rc == 2, err
    assert err.strip().splitlines()[-1:] == [  # the last line: an environment's packages may warn before it
        f"kha convert: error: {bad.name}: llama.block_count 200000 is not a layer count (1 to 4096)"
    ]
    assert peak < 1500, f"peak RSS {peak:.0f} MB"  # the interpreter with torch and transformers: about 600 MB
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("llama.block_count", 5, "llama.block_count says 5 layers, its tensors hold layers 0 to 2"),
        ("llama.embedding_length", 1 << 20, "llama.embedding_length 1048576 differs from attn_norm's width 64"),
        ("llama.feed_forward_length", 1 << 22, "llama.feed_forward_length 4194304 differs from its tensors'"),
        ("llama.attention.head_count", 100_000, "llama.attention.head_count 100000 is beyond any model's"),
        ("llama.context_length", 1 << 30, "llama.context_length 1073741824 is beyond any model's"),
    ],
)
def test_numbers_that_contradict_the_tensors(tiny_gguf, tmp_path, capsys, key, value, message):
    bad = tampered(tiny_gguf, tmp_path, key, value)
    assert message in one_line_error(capsys, ["convert", str(bad), str(tmp_path / "out")], "convert")
    with pytest.raises(KHAError, match=re.escape(message)):  # the loader of verify, eval and serve
        load_causal_lm(bad)


def test_the_untouched_file_still_converts(tiny_gguf, tmp_path):
    assert main(["convert", str(tiny_gguf), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 3


def rebuilt(source: Path, out: Path, drop: tuple[str, ...] = (), extra: dict | None = None, **values) -> Path:
    """SOURCE written again without the tensors whose names start with DROP, plus EXTRA (name -> shape, zeros), with
    integer metadata VALUES (key with dots as __)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    overrides = {key.replace("__", "."): value for key, value in values.items()}
    writer = GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in overrides:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), GGUFValueType.ARRAY, sub_type=field.types[1])
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    for key, value in overrides.items():
        writer.add_key_value(key, value, GGUFValueType.UINT32)
    for tensor in reader.tensors:
        if not tensor.name.startswith(drop):
            shape = list(reversed([int(n) for n in tensor.shape]))
            writer.add_tensor(tensor.name, np.array(tensor.data).reshape(shape), raw_dtype=tensor.tensor_type)
    for name, shape in (extra or {}).items():
        writer.add_tensor(name, np.zeros(list(reversed(shape)), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_file_without_its_real_tensors_is_refused_in_bounded_memory(tiny_gguf, tmp_path):
    """The round-5 attack's bypass: no token_embd, no real layer tensors, one `blk.0.junk.weight`, and widths of
    8192 / 32768 in the metadata: transformers built every missing tensor at those sizes (3.57 GB) and the convert
    exited 0 with random weights."""
    bad = rebuilt(
        tiny_gguf,
        tmp_path / "hollow.gguf",
        drop=("token_embd", "output", "blk."),
        extra={"blk.0.junk.weight": [4]},
        llama__embedding_length=8192,
        llama__feed_forward_length=32768,
        llama__block_count=1,
    )
    rc, err, peak = peak_rss_mb(["convert", str(bad), str(tmp_path / "out")], timeout=300)
    assert rc == 2, err
    assert "layer 0 has no attn_norm.weight tensor: not a complete model" in err.strip().splitlines()[-1]
    assert peak < 1500 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "drop, message",
    [
        (("token_embd",), "has no token_embd.weight matrix"),
        (("blk.1.attn_q",), "layer 1 has no attn_q.weight or attn_qkv.weight or attn_q_a.weight tensor"),
        (("blk.0.ffn_down", "blk.1.ffn_down", "blk.2.ffn_down"), "layer 0 has no ffn_down.weight or ffn_down_exps"),
    ],
)
def test_missing_tensors_are_refused(tiny_gguf, tmp_path, drop, message):
    with pytest.raises(KHAError, match=re.escape(message)):
        load_causal_lm(rebuilt(tiny_gguf, tmp_path / "bad.gguf", drop=drop))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "gemma3_text"])
def test_every_exportable_family_passes_the_check(family, tmp_path):
    """The check refuses nothing real: kha's own exports of each family (Phi-3's fused gate_up included)."""
    from kha_hf.checkpoint.gguf_header import check_gguf_header

    tiny_kha(tmp_path / "kha", family)
    assert main(["fold", str(tmp_path / "kha"), str(tmp_path / "m.gguf")]) == 0
    check_gguf_header(tmp_path / "m.gguf")
