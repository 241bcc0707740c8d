"""`kha eval --baseline BASE --adapter DIR` (#29, item 4): base vs base + knock adapter through lm-eval, paired per
document, as `kha eval` compares two checkpoints.

Reference: the same comparison with the candidate written out as a KHA checkpoint (`kha convert BASE DST --adapter
DIR`, itself checked against PEFT's own model in test_adapter_cli.py): every per-document score must be the same.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kha_hf import KHAForCausalLM
from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.peft.adapter_files import apply_knock_adapter
from tests.helpers import assert_close, save_tiny_checkpoint
from tests.peft.test_adapter_cli import IDS, trained_adapter

EVAL = ["--tasks", "copa,arc_easy", "--limit", "12", "--local-data", "--batch-size", "4"]


@pytest.fixture
def base_and_adapter(tmp_path):
    save_tiny_checkpoint(tmp_path / "base", "llama")
    trained_adapter(tmp_path / "base", tmp_path / "adapter", knock="mlp_v_linear_qk", seed=5, scale=1.0)
    return tmp_path / "base", tmp_path / "adapter"


def _records(folder):
    return [json.loads(line) for line in (folder / "per_document.jsonl").read_text().splitlines()]


def test_the_adapter_candidate_scores_as_its_kha_checkpoint(base_and_adapter, tmp_path):
    base, adapter = base_and_adapter
    assert main(["convert", str(base), str(tmp_path / "kha"), "--adapter", str(adapter)]) == 0
    with torch.no_grad():  # the model kha eval builds is PEFT's model of the adapter, the KHA checkpoint's logits
        peft_model = apply_knock_adapter(AutoModelForCausalLM.from_pretrained(base).eval(), adapter)
        kha = KHAForCausalLM.from_pretrained(tmp_path / "kha").eval()
        assert_close(peft_model(IDS).logits, kha(IDS).logits, atol=1e-5, what="adapter vs KHA checkpoint")

    common = ["eval", "--baseline", str(base), *EVAL]
    assert main([*common, "--adapter", str(adapter), "--output", str(tmp_path / "with_adapter")]) == 0
    assert main([*common, "--candidate", str(tmp_path / "kha"), "--output", str(tmp_path / "with_kha")]) == 0
    summary = json.loads((tmp_path / "with_adapter" / "summary.json").read_text())
    assert summary["adapter"] == str(adapter) and summary["candidate"] == f"{base} + adapter {adapter}"
    by_adapter, by_kha = _records(tmp_path / "with_adapter"), _records(tmp_path / "with_kha")
    assert len(by_adapter) == len(by_kha) >= 24  # two tasks, 12 documents each, paired
    assert by_adapter == by_kha
    assert any(r["baseline"] != r["candidate"] for r in by_adapter), "the adapter changed no document's score"
    for row in summary["rows"]:
        assert row["paired"]["n"] == 12 and row["paired"]["p_value"] is not None
    assert main(["eval", "--recompute", str(tmp_path / "with_adapter")]) == 0


def test_bad_adapter_arguments_fail_in_one_line_before_any_evaluation(base_and_adapter, tmp_path, capsys):
    base, adapter = base_and_adapter
    cases = [
        (["--baseline", str(base), "--candidate", str(base), "--adapter", str(adapter)], "not --candidate"),
        (["--adapter", str(adapter)], "give --baseline"),
        (["--baseline", str(base), "--adapter", str(tmp_path / "missing")], "not a folder"),
        (["--baseline", str(base), "--adapter", str(base)], "no adapter_config.json"),
        (["--baseline", str(base), "--adapter", str(adapter), "--output", str(adapter / "out")], str(adapter)),
    ]
    for argv, expected in cases:
        capsys.readouterr()
        assert main(["eval", *argv, *EVAL, "--output", str(tmp_path / "out"), *argv[-2:]]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert expected in err and len(err.splitlines()) == 1, (argv, err)
        assert not (tmp_path / "out").exists()


def test_an_adapter_of_another_model_is_refused(base_and_adapter, tmp_path):
    base, _ = base_and_adapter
    save_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    trained_adapter(tmp_path / "qwen3", tmp_path / "qwen3_adapter", knock="mlp_v")
    with pytest.raises(KHAError, match="trained on a qwen3 model"):
        apply_knock_adapter(AutoModelForCausalLM.from_pretrained(base), tmp_path / "qwen3_adapter")
    save_tiny_checkpoint(tmp_path / "wide", "llama", head_dim=32)  # same family, another head size
    with pytest.raises(KHAError, match="does not fit this model"):
        apply_knock_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "wide"), base_and_adapter[1])


def test_lm_evals_own_peft_route_loads_a_knock_adapter_once_kha_hf_is_imported(tmp_path):
    """`HFLM(pretrained=BASE, peft=DIR)` (`lm_eval --model hf --model_args pretrained=BASE,peft=DIR`) in this
    process, where kha_hf registered the KNOCK type with peft; the `lm_eval` console script does not import kha_hf,
    and peft then fails on the unknown type (docs/guides/peft.md: the one-line launcher that does)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    save_tiny_checkpoint(tmp_path / "probe", "llama")
    vocab = len(AutoTokenizer.from_pretrained(tmp_path / "probe"))
    # lm-eval resizes the embeddings of a model whose vocabulary differs from its tokenizer's when it loads an
    # adapter (lm_eval 0.4.13, huggingface.py): the tiny base gets exactly the tokenizer's size, as real models have
    save_tiny_checkpoint(tmp_path / "base", "llama", vocab_size=vocab)
    trained_adapter(tmp_path / "base", tmp_path / "adapter", knock="mlp_v", scale=1.0)
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "kha"), "--adapter", str(tmp_path / "adapter")]) == 0
    requests = [
        Instance("loglikelihood", {}, ("the quick brown", " fox jumps"), 0),
        Instance("loglikelihood", {}, ("over the", " lazy dog"), 1),
    ]
    lm_peft = HFLM(pretrained=str(tmp_path / "base"), peft=str(tmp_path / "adapter"), device="cpu", batch_size=1)
    assert type(lm_peft.model).__name__ == "PeftModelForCausalLM"
    lm_kha = HFLM(pretrained=str(tmp_path / "kha"), device="cpu", batch_size=1)
    lm_base = HFLM(pretrained=str(tmp_path / "base"), device="cpu", batch_size=1)
    with_adapter, as_kha, base = (lm.loglikelihood(requests) for lm in (lm_peft, lm_kha, lm_base))
    for (a, _), (k, _), (b, _) in zip(with_adapter, as_kha, base, strict=True):
        assert abs(a - k) < 1e-4 and abs(a - b) > 1e-3, (a, k, b)
