"""Task-head checkpoints where a language model is expected, and head configs that do not describe their weights
(an attack on #30's heads): every case ends in one line (exit 2), writes nothing, and never runs a reward model as a
causal LM with a newly initialised lm_head."""

from __future__ import annotations

import json

import pytest
import transformers
from safetensors.torch import load_file, save_file

from kha_hf.cli import main
from kha_hf.common.supported_versions import release
from tests.modeling.test_task_heads import _save_stock
from tests.peft.test_adapter_cli import trained_adapter


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A stock Qwen3 reward model (3 labels), its KHA conversion (linear_qkv), a stock Qwen3 QA model and its
    conversion, and a stock causal LM of the same family."""
    root = tmp_path_factory.mktemp("heads")
    _save_stock(root / "seq", "qwen3", "KHAForSequenceClassification")
    _save_stock(root / "qa", "qwen3", "KHAForQuestionAnswering")
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(root / "lm", "qwen3")
    for name in ("seq", "qa"):
        assert main(["convert", str(root / name), str(root / f"kha_{name}"), "--knock", "linear_qkv"]) == 0
    return root


def _edited(source, target, edit=None, tensors=None):
    """A copy of SOURCE with its config.json passed through EDIT and its weights through TENSORS."""
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    if edit:
        edit(config)
    (target / "config.json").write_text(json.dumps(config))
    if tensors:
        weights = next(f for f in sorted(target.glob("model*.safetensors")) if "knocks" not in f.name)
        state = load_file(weights)
        tensors(state)
        save_file(state, weights, metadata={"format": "pt"})
    return target


def _one_line_error(capsys, argv, *expected):
    capsys.readouterr()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(e in err for e in expected), (argv, err)


SERVE_RELEASE = release(transformers.__version__)[:2] >= (5, 25)


def test_language_model_commands_refuse_head_checkpoints(heads, tmp_path, capsys):
    for name in ("seq", "kha_seq", "kha_qa"):
        folder = str(heads / name)
        _one_line_error(
            capsys, ["train", folder, "--output", str(tmp_path / "t"), "--max-steps", "1"], "not a language"
        )
        # kha serve on transformers < 5.25 refuses the release first, in its own one line
        serve_refusal = "not a language model" if SERVE_RELEASE else "kha serve needs transformers>=5.25"
        _one_line_error(capsys, ["serve", folder, "--port", "1"], serve_refusal)
        _one_line_error(capsys, ["ab", "--from", folder, "--output", str(tmp_path / "ab")], "not a language model")
    _one_line_error(capsys, ["adapter", str(heads / "kha_qa"), str(tmp_path / "adapter")], "not a language model")
    _one_line_error(
        capsys,
        [
            "eval",
            "--candidate",
            str(heads / "kha_seq"),
            "--tasks",
            "copa",
            "--local-data",
            "--output",
            str(tmp_path / "e"),
        ],
        "not a language model",
    )
    assert not any((tmp_path / n).exists() for n in ("t", "ab", "adapter", "e"))


def test_a_head_hidden_from_architectures_is_found_in_the_weights(heads, tmp_path, capsys):
    null = _edited(heads / "kha_seq", tmp_path / "null", lambda c: c.update(architectures=None))
    eval_argv = ["--tasks", "copa", "--local-data", "--output", str(tmp_path / "e")]
    _one_line_error(capsys, ["eval", "--candidate", str(null), *eval_argv], "score.weight")
    text = _edited(
        heads / "kha_seq", tmp_path / "text", lambda c: c.update(architectures="KHAForSequenceClassification")
    )
    _one_line_error(capsys, ["eval", "--candidate", str(text), *eval_argv], "architectures must be a list")
    number = _edited(heads / "seq", tmp_path / "number", lambda c: c.update(architectures=5))
    _one_line_error(capsys, ["convert", str(number), str(tmp_path / "out")], "architectures must be a list")
    stock_null = _edited(heads / "seq", tmp_path / "stock_null", lambda c: c.update(architectures=None))
    _one_line_error(capsys, ["convert", str(stock_null), str(tmp_path / "out")], "score.weight", "causal LM")
    assert not (tmp_path / "out").exists() and not (tmp_path / "e").exists()


def test_convert_refuses_a_head_the_weights_do_not_hold(heads, tmp_path, capsys):
    out = str(tmp_path / "out")
    both = _edited(
        heads / "lm",
        tmp_path / "both",
        lambda c: c.update(architectures=["Qwen3ForCausalLM", "Qwen3ForSequenceClassification"]),
    )
    _one_line_error(capsys, ["convert", str(both), out], "lack score.weight")
    two = _edited(
        heads / "seq",
        tmp_path / "two",
        lambda c: c.update(architectures=["Qwen3ForTokenClassification", "Qwen3ForSequenceClassification"]),
    )
    _one_line_error(capsys, ["convert", str(two), out], "two different heads")
    no_score = _edited(heads / "seq", tmp_path / "no_score", tensors=lambda t: t.pop("score.weight"))
    _one_line_error(capsys, ["convert", str(no_score), out], "lack score.weight")
    labels = _edited(
        heads / "seq", tmp_path / "labels", lambda c: c.update(id2label={str(i): f"L{i}" for i in range(5)})
    )
    _one_line_error(capsys, ["convert", str(labels), out], "score.weight has shape [3, 64]", "[5, 64]")
    assert not (tmp_path / "out").exists()


def test_verify_and_fold_refuse_mismatched_heads(heads, tmp_path, capsys):
    _one_line_error(capsys, ["verify", str(heads / "lm"), str(heads / "kha_seq")], "not a checkpoint of that kind")
    fewer = _edited(heads / "seq", tmp_path / "fewer", lambda c: c.update(id2label={"0": "a", "1": "b", "2": "c"}))
    other = _edited(
        heads / "kha_seq",
        tmp_path / "other",
        lambda c: c.update(id2label={"0": "a", "1": "b"}),
        tensors=lambda t: t.update({"score.weight": t["score.weight"][:2].clone()}),
    )
    _one_line_error(capsys, ["verify", str(fewer), str(other)], "3 labels", "has 2")
    token = _edited(
        heads / "kha_seq", tmp_path / "token", lambda c: c.update(architectures=["KHAForTokenClassification"])
    )
    _one_line_error(capsys, ["fold", str(token), str(tmp_path / "folded")], "lack score.bias")
    assert not (tmp_path / "folded").exists()


def test_eval_adapter_of_another_family_fails_before_the_baseline_runs(heads, tmp_path, capsys):
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "llama", "llama")
    trained_adapter(tmp_path / "llama", tmp_path / "adapter")
    argv = ["eval", "--baseline", str(heads / "lm"), "--adapter", str(tmp_path / "adapter"), "--tasks", "copa"]
    capsys.readouterr()
    assert main([*argv, "--local-data", "--limit", "2", "--output", str(tmp_path / "e")]) == 2
    out, err = capsys.readouterr()
    assert "trained on a llama model" in err and "evaluating" not in out, (out, err)
    _one_line_error(capsys, ["eval", "--adapter", str(tmp_path / "adapter"), "--tasks", "copa"], "give --baseline")
    assert "not --candidate" not in capsys.readouterr().err
