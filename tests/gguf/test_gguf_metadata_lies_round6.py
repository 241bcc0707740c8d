"""GGUF metadata that lies about the attention, the norm epsilon, the context or the RoPE base is refused in one line
naming the field, before transformers builds a model from it (safety round 6).

Before: `llama.attention.key_length 8` on a model of head size 16 and a negative norm epsilon converted with exit 0;
a NaN epsilon failed in 16-19 lines naming a temporary `config.json`; `head_count_kv 3` on 2 KV heads was a raw numpy
reshape error, `head_count 8` a 20-line report after the model was built, `head_count 0` "integer modulo by zero";
`context_length 0` and an infinite `rope.freq_base` were 16-19 lines. The files are `kha fold` exports of a tiny Llama
(hidden 64, 4 heads and 2 KV heads of 16) with one metadata value rewritten in place (`tampered`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kha_hf import KHAError
from kha_hf.checkpoint.loading import load_causal_lm
from tests.cli.test_bad_input import one_line_error
from tests.conversion.test_gguf_header import tampered, tiny_gguf  # noqa: F401 (a fixture)


@pytest.fixture
def no_model_built(monkeypatch):
    """transformers' GGUF loader must not be reached: the header check refuses first."""
    from transformers import AutoModelForCausalLM

    def built(*args, **kwargs):
        raise RuntimeError("a model was built from the lying metadata")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", built)


def refused(gguf: Path, tmp_path: Path, capsys, key: str, value) -> str:
    """`kha convert` of TINY_GGUF with KEY set to VALUE: exit 2, one line (checked by `one_line_error`), no output
    folder and no hidden partial one left, and the loader of verify, eval and serve refuses it with the same words;
    returns the line after its file name."""
    bad = tampered(gguf, tmp_path, key, value)
    err = one_line_error(capsys, ["convert", str(bad), str(tmp_path / "out")], "convert")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".kha-")] == []
    prefix = f"kha convert: error: {bad.name}: "
    assert err.startswith(prefix), err
    with pytest.raises(KHAError, match=re.escape(err.removeprefix("kha convert: error: "))):
        load_causal_lm(bad)
    return err.removeprefix(prefix)


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "llama.attention.key_length",
            8,
            "llama.attention.key_length 8 differs from the tensors' head size 16 "
            "(blk.0.attn_q.weight: 64 outputs, 4 heads)",
        ),
        (
            "llama.attention.value_length",
            8,
            "llama.attention.value_length 8 differs from the tensors' head size 16 "
            "(blk.0.attn_v.weight: 32 outputs, 2 KV heads)",
        ),
        (
            "llama.rope.dimension_count",
            8,
            "llama.rope.dimension_count 8 differs from the tensors' head size 16 "
            "(blk.0.attn_q.weight: 64 outputs, 4 heads; transformers builds llama heads of that size)",
        ),
    ],
)
def test_a_head_size_the_tensors_do_not_have(tiny_gguf, tmp_path, capsys, no_model_built, key, value, message):  # noqa: F811
    assert refused(tiny_gguf, tmp_path, capsys, key, value) == message


@pytest.mark.parametrize("value, shown", [(-1e-5, "-1e-05"), (0.0, "0"), (float("nan"), "nan"), (float("inf"), "inf")])
def test_a_norm_epsilon_that_is_not_a_positive_finite_number(tiny_gguf, tmp_path, capsys, no_model_built, value, shown):  # noqa: F811
    key = "llama.attention.layer_norm_rms_epsilon"
    assert refused(tiny_gguf, tmp_path, capsys, key, value) == f"{key} {shown} must be a positive finite number"


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "llama.attention.head_count_kv",
            3,
            "llama.attention.head_count_kv 3 does not divide blk.0.attn_k.weight's 32 outputs",
        ),
        (
            "llama.attention.head_count",
            8,
            "llama.attention.head_count 8 and llama.attention.head_count_kv 2 disagree with the tensors: "
            "blk.0.attn_q.weight's 64 outputs make heads of 8, blk.0.attn_k.weight's 32 heads of 16",
        ),
        (
            "llama.attention.head_count_kv",
            1,
            "llama.attention.head_count 4 and llama.attention.head_count_kv 1 disagree with the tensors: "
            "blk.0.attn_q.weight's 64 outputs make heads of 16, blk.0.attn_k.weight's 32 heads of 32",
        ),
        (
            "llama.attention.head_count",
            3,
            "llama.attention.head_count 3 does not divide blk.0.attn_q.weight's 64 outputs",
        ),
        ("llama.attention.head_count", 0, "llama.attention.head_count 0 must be a positive integer"),
        ("llama.attention.head_count_kv", 0, "llama.attention.head_count_kv 0 must be a positive integer"),
    ],
)
def test_head_counts_the_tensors_do_not_have(tiny_gguf, tmp_path, capsys, no_model_built, key, value, message):  # noqa: F811
    assert refused(tiny_gguf, tmp_path, capsys, key, value) == message


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("llama.context_length", 0, "llama.context_length 0 must be a positive integer"),
        ("llama.rope.freq_base", float("inf"), "llama.rope.freq_base inf must be a positive finite number"),
        ("llama.rope.freq_base", float("nan"), "llama.rope.freq_base nan must be a positive finite number"),
        ("llama.rope.freq_base", 0.0, "llama.rope.freq_base 0 must be a positive finite number"),
        ("llama.rope.freq_base", -10000.0, "llama.rope.freq_base -10000 must be a positive finite number"),
    ],
)
def test_a_context_or_rope_base_that_is_no_number_of_a_model(
    tiny_gguf,  # noqa: F811
    tmp_path,
    capsys,
    no_model_built,
    key,
    value,
    message,  # noqa: F811
):
    assert refused(tiny_gguf, tmp_path, capsys, key, value) == message
