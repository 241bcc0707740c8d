"""`kha fold KHA_DIR OUT.gguf` on tiny random models of every exportable family, read back by transformers' GGUF loader.

Catches: a wrong fold (knocks perturbed at 0.3, so a missing or transposed fold moves the logits by far more than any
tolerance: checked against the base model), Llama's q/k permutation of weights and biases, Gemma 3's `1 + w` norms,
Phi-3's fused projections, a wrong RoPE / head / window setting, and each output type's rounding: float32 is exact to
float32 noise, f16 / bf16 / q8_0 within what their rounding allows (tolerances relative to the logits' scale).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kha_hf.cli import main
from tests.gguf.conftest import EXPORTABLE, tiny_base, tiny_kha, tiny_tokenizer

# max |Δlogit| / max |logit| allowed per output type (measured here: f32 ~5e-7, f16 ~1e-3, bf16 ~8e-3, q8_0 ~2.5e-2)
TOLERANCE = {"f32": 1e-5, "f16": 4e-3, "bf16": 2.5e-2, "q8_0": 6e-2}


def gguf_logits(folder, name, ids):
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", sorted(EXPORTABLE))
def test_folded_export_reads_back_with_the_kha_logits(family, tmp_path):
    model, base = tiny_kha(tmp_path / "kha", family)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, stock = model(ids).logits, base(ids).logits
    scale = expected.abs().max().item()
    fold_effect = (expected - stock).abs().max().item() / scale
    for outtype, tolerance in TOLERANCE.items():
        out = tmp_path / f"folded-{outtype}.gguf"
        assert main(["fold", str(tmp_path / "kha"), str(out), "--outtype", outtype]) == 0
        got = gguf_logits(tmp_path, out.name, ids)
        error = (got - expected).abs().max().item() / scale
        assert error <= tolerance, f"{family} {outtype}: relative error {error:.2e} > {tolerance}"
        assert fold_effect > 10 * tolerance, f"the knocks barely matter ({fold_effect:.2e}): the test proves nothing"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".kha-")]  # no temporary file left


def test_plain_base_checkpoint_exports_the_same_way(tmp_path):
    base = tiny_base("llama")
    base.save_pretrained(tmp_path / "base")
    tiny_tokenizer(tmp_path / "base")
    assert main(["fold", str(tmp_path / "base"), str(tmp_path / "base.gguf")]) == 0  # auto: float32 as stored
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = base(ids).logits
    assert (gguf_logits(tmp_path, "base.gguf", ids) - expected).abs().max().item() < 1e-5


def test_bf16_checkpoint_exports_as_bf16_by_default_and_metadata_is_complete(tmp_path, capsys):
    import gguf

    model, _ = tiny_kha(tmp_path / "kha", "qwen3")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "kha")
    capsys.readouterr()
    assert main(["fold", str(tmp_path / "kha"), str(tmp_path / "m.gguf")]) == 0
    printed = capsys.readouterr().out
    assert "architecture qwen3, bf16" in printed and "knock tensors folded" in printed
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    fields = {
        name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.t")
    }
    assert fields["general.architecture"] == "qwen3" and fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16
    assert fields["qwen3.context_length"] == 256 and fields["qwen3.attention.head_count_kv"] == 2
    assert fields["qwen3.attention.key_length"] == 128 and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.merges"]) > 0
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "BF16" and types["blk.0.attn_q_norm.weight"] == "F32"
    assert not any("knock" in name for name in types)
