"""Task heads with KHA (#30, item 3): reward models, classifiers and extractive QA of every family that has them.

`KHAForSequenceClassification` / `KHAForTokenClassification` / `KHAForQuestionAnswering` build the family's own
transformers head class over the KHA body. Checked per family and head, against the stock transformers head model:
identity knocks bit-exact; random knocks equal to the stock head model with the knock math applied by hand to its
projections at the rows written out from the family's code (forward hooks, as in test_families.py); `kha convert` of
a head checkpoint keeps the head (it used to write a causal LM with a new random `lm_head`) and scores exactly as the
stock model, in this process, through the pipeline and as remote code without kha_hf; `kha fold` gives back the
family's stock head class.
"""

from __future__ import annotations

import copy
import json
import textwrap

import pytest
import torch
import transformers

import kha_hf
from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.modeling.configuration_kha import TASK_HEADS, family_heads
from tests.helpers import (
    ALL_FAMILIES,
    MLA_FAMILIES,
    assert_close,
    randomize_knocks,
    run_python,
    save_tiny_tokenizer,
    tiny_base_model,
    tiny_config,
)
from tests.modeling.expected_layouts import expected_rows
from tests.modeling.test_families import _knock_hook

IDS = torch.tensor([[3, 9, 27, 81, 5, 15, 45, 7, 21], [4, 8, 16, 32, 64, 1, 2, 11, 13]])
OUTPUTS = ("logits", "start_logits", "end_logits")


def _model_type(family: str) -> str:
    return tiny_config(family).model_type


CASES = [(family, head) for family in ALL_FAMILIES for head in family_heads(_model_type(family))]


def stock_head(family: str, head: str, seed: int = 0, **overrides):
    """The stock transformers head model of FAMILY (3 labels, pad id 0), random biases and norms as in helpers."""
    auto = getattr(transformers, TASK_HEADS[head][0])
    return tiny_base_model(family, "eager", seed=seed, auto=auto, **{"num_labels": 3, "pad_token_id": 0, **overrides})


def outputs(model, ids=IDS) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(ids)
    return {name: out[name] for name in OUTPUTS if out.get(name) is not None}


def test_every_family_has_the_heads_transformers_has():
    # 22 of 23 families have a sequence-classification head (granite and cohere2 have none in transformers 5.24)
    assert len(CASES) >= 50, len(CASES)
    seq = {f for f, h in CASES if h == "KHAForSequenceClassification"}
    assert {"llama", "qwen3", "gemma3_text", "deepseek_v3", "phi3", "gpt_oss"} <= seq


@pytest.mark.parametrize("family,head", CASES)
def test_identity_knocks_keep_the_stock_head_exact(family, head):
    stock = stock_head(family, head)
    public = getattr(kha_hf, head)
    kha = public.from_base(copy.deepcopy(stock), knock="linear_qkv" if family in MLA_FAMILIES else "mlp_v_linear_qk")
    assert isinstance(kha, public) and isinstance(kha, type(stock)), type(kha).__mro__
    assert type(kha).__name__ == f"KHA{type(stock).__name__}"
    body = getattr(kha, kha.base_model_prefix)
    assert type(body).__name__.startswith("KHA") and any("_knock." in n for n, _ in kha.named_parameters())
    expected, got = outputs(stock), outputs(kha)
    assert set(got) == set(expected) and expected
    for name in expected:
        assert_close(got[name], expected[name], what=f"{family}/{head}/{name}")


@pytest.mark.parametrize("family,head", CASES)
def test_random_knocks_reach_the_head_as_a_hand_written_reference(family, head):
    base = stock_head(family, head)
    expected_layout = expected_rows(base.config.model_type, base.config)
    stock = copy.deepcopy(base)
    kha = getattr(kha_hf, head).from_base(copy.deepcopy(base), knock="linear_qkv")
    randomize_knocks(kha)
    body, stock_body = getattr(kha, kha.base_model_prefix), getattr(stock, stock.base_model_prefix)
    for layer_idx in kha.config.knocked_layers:
        knocks = {t: getattr(body.layers[layer_idx].self_attn, f"{t}_knock") for t in "qkv"}
        for projection, rows in expected_layout.items():
            module = getattr(stock_body.layers[layer_idx].self_attn, projection, None)
            if module is not None:
                module.register_forward_hook(_knock_hook(rows, knocks))
    expected, got, unknocked = outputs(stock), outputs(kha), outputs(base)
    for name in expected:
        assert (got[name] - unknocked[name]).abs().max() > 1e-4, f"{family}/{head}: the knocks changed nothing"
        assert_close(got[name], expected[name], atol=2e-5, what=f"{family}/{head}/{name}")


def test_a_family_without_the_head_says_so():
    from kha_hf.modeling.modeling_kha import head_class

    with pytest.raises(ValueError, match="no SequenceClassification class for 'cohere2'"):
        head_class("cohere2", "KHAForSequenceClassification")


def _save_stock(folder, family, head):
    model = stock_head(family, head, vocab_size=300)  # the tiny tokenizer's ids all fit
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return model


@pytest.mark.parametrize(
    "family,head",
    [
        ("qwen3", "KHAForSequenceClassification"),
        ("llama", "KHAForTokenClassification"),
        ("mistral", "KHAForQuestionAnswering"),
    ],
)
def test_convert_keeps_the_head_and_scores_exactly_as_the_stock_model(family, head, tmp_path, capsys):
    stock = _save_stock(tmp_path / "stock", family, head)
    assert main(["convert", str(tmp_path / "stock"), str(tmp_path / "kha"), "--verify"]) == 0
    assert "verified" in capsys.readouterr().out
    config = json.loads((tmp_path / "kha" / "config.json").read_text())
    assert config["architectures"] == [head] and config["auto_map"][TASK_HEADS[head][0]] == f"modeling_kha.{head}"
    if head != "KHAForQuestionAnswering":
        assert len(config["id2label"]) == 3  # the labels the head was trained for
    auto = getattr(transformers, TASK_HEADS[head][0])
    kha = auto.from_pretrained(tmp_path / "kha", attn_implementation="eager").eval()  # as the stock model
    assert type(kha).__name__ == f"KHA{type(stock).__name__}"
    expected, got = outputs(stock), outputs(kha)
    for name in expected:
        assert_close(got[name], expected[name], what=f"converted {head}/{name}")


def test_a_converted_reward_model_scores_through_the_pipeline_and_as_remote_code(tmp_path):
    stock = _save_stock(tmp_path / "stock", "qwen3", "KHAForSequenceClassification")
    assert main(["convert", str(tmp_path / "stock"), str(tmp_path / "kha"), "--knock", "linear_qkv"]) == 0
    text = "the quick brown fox"
    classify = [
        transformers.pipeline("text-classification", model=str(tmp_path / n), top_k=None) for n in ("stock", "kha")
    ]
    assert type(classify[1].model).__name__ == "KHAQwen3ForSequenceClassification"
    stock_scores, kha_scores = (sorted((d["label"], d["score"]) for d in c([text])[0]) for c in classify)
    assert stock_scores == kha_scores
    expected = outputs(stock)["logits"].tolist()
    script = textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForSequenceClassification
        model = AutoModelForSequenceClassification.from_pretrained(
            {str(tmp_path / "kha")!r}, trust_remote_code=True, attn_implementation="eager"
        )
        assert type(model).__name__ == "KHAQwen3ForSequenceClassification", type(model)
        with torch.no_grad():
            logits = model(torch.tensor({IDS.tolist()})).logits
        print(float((logits - torch.tensor({expected})).abs().max()))
    """)
    done = run_python(script, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) == 0.0


def test_fold_gives_back_the_family_head_class(tmp_path):
    from kha_hf.conversion.fold import fold

    stock = stock_head("qwen3", "KHAForSequenceClassification")
    kha = kha_hf.KHAForSequenceClassification.from_base(stock, knock="linear_qkv")
    randomize_knocks(kha, scale=0.2)
    kha.save_pretrained(tmp_path / "kha")
    fold(tmp_path / "kha", tmp_path / "folded", progress=False)
    config = json.loads((tmp_path / "folded" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"] and "auto_map" not in config
    folded = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "folded", attn_implementation="eager"
    ).eval()
    assert type(folded) is transformers.Qwen3ForSequenceClassification
    assert_close(outputs(folded)["logits"], outputs(kha)["logits"], atol=1e-4, what="folded reward model")


def test_a_head_kha_has_no_class_for_is_refused_not_dropped(tmp_path, capsys):
    _save_stock(tmp_path / "stock", "qwen3", "KHAForSequenceClassification")
    config_path = tmp_path / "stock" / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["Qwen3ForProcessRewardModel"]
    config_path.write_text(json.dumps(config))
    capsys.readouterr()  # the save's progress bar
    assert main(["convert", str(tmp_path / "stock"), str(tmp_path / "kha")]) != 0
    err = capsys.readouterr().err
    assert "Qwen3ForProcessRewardModel" in err and "drop its head" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "kha").exists()


def test_commands_that_need_a_language_model_refuse_a_head_checkpoint(tmp_path):
    from kha_hf.checkpoint.loading import load_causal_lm
    from kha_hf.conversion.gguf_export import export_gguf

    _save_stock(tmp_path / "stock", "qwen3", "KHAForSequenceClassification")
    assert main(["convert", str(tmp_path / "stock"), str(tmp_path / "kha"), "--knock", "linear_qkv"]) == 0
    for folder in ("stock", "kha"):
        with pytest.raises(KHAError, match="ForSequenceClassification, not a language model"):
            load_causal_lm(tmp_path / folder)
    with pytest.raises(KHAError, match="not a causal LM"):
        export_gguf(tmp_path / "kha", tmp_path / "out.gguf", "f32")
    assert not (tmp_path / "out.gguf").exists()
