"""Saved KHA folders carry self-contained code: they load with trust_remote_code where kha_hf is absent."""

import ast
import json
import os
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

import kha_hf
from kha_hf import KHAForCausalLM
from tests.helpers import randomize_knocks, run_python, save_tiny_tokenizer, tiny_base_model

CODE_FILES = {"configuration_kha.py", "modeling_kha.py", "knocks.py"}


def _save_trained(tmp_path, family="qwen3"):
    kha = KHAForCausalLM.from_base(tiny_base_model(family), knock="mlp_v_linear_qk")
    randomize_knocks(kha)
    kha.save_pretrained(tmp_path / "kha")
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        torch.save({"ids": ids, "logits": kha(ids).logits}, tmp_path / "expected.pt")
    return tmp_path / "kha"


def test_save_writes_auto_map_and_self_contained_code(tmp_path):
    folder = _save_trained(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_kha.KHAConfig",
        "AutoModel": "modeling_kha.KHAModel",
        "AutoModelForCausalLM": "modeling_kha.KHAForCausalLM",
        # the task heads Qwen3 has in transformers (tests/modeling/test_task_heads.py)
        "AutoModelForSequenceClassification": "modeling_kha.KHAForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_kha.KHAForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_kha.KHAForQuestionAnswering",
    }
    assert config["architectures"] == ["KHAForCausalLM"]
    assert config["base_model_type"] == "qwen3" and config["knock_v"] == "mlp"
    assert CODE_FILES <= set(os.listdir(folder))
    for name in CODE_FILES:
        tree = ast.parse((folder / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{name}: only single-dot relative imports travel"
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(n.startswith("kha_hf") for n in names), f"{name} imports kha_hf"


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_fresh_process_without_kha_hf_loads_with_trust_remote_code(tmp_path, family):
    # mixtral: its checkpoint layout conversion must also be registered by the remote code itself
    folder = _save_trained(tmp_path, family)
    script = textwrap.dedent(
        f"""
        try:
            import kha_hf
            raise SystemExit("kha_hf is importable")
        except ImportError:
            pass
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(
            {str(folder)!r}, trust_remote_code=True, attn_implementation="eager"
        )
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            logits = model(expected["ids"]).logits
        assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
        print("REMOTE_OK", type(model).__name__)
        """
    )
    result = run_python(script, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "REMOTE_OK" in result.stdout


def test_with_kha_hf_imported_loads_without_trust_remote_code(tmp_path):
    folder = _save_trained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    assert isinstance(model, kha_hf.KHAForCausalLM)
    expected = torch.load(tmp_path / "expected.pt")
    with torch.no_grad():
        assert torch.equal(model(expected["ids"]).logits, expected["logits"])


PROMPTS = ("Do you wish to run the custom code", "to instantiate a model of type")


def _converted_with_tokenizer(tmp_path):
    """A `kha convert` output of a tiny Llama folder that has a tokenizer: its card is the one users see."""
    tiny_base_model("llama").save_pretrained(tmp_path / "base")
    save_tiny_tokenizer(tmp_path / "base")
    kha_hf.convert(tmp_path / "base", tmp_path / "kha", progress=False)
    return tmp_path / "kha"


def _run_fresh(script: str, tmp_path, block_kha_hf: bool) -> str:
    """SCRIPT's stdout + stderr from a fresh process (stdin closed); it must succeed."""
    result = run_python(script, tmp_path, without_kha_hf=block_kha_hf)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_card_snippet_loads_model_and_tokenizer_without_kha_hf_or_a_prompt(tmp_path):
    folder = _converted_with_tokenizer(tmp_path)
    card = (folder / "README.md").read_text()
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0].replace("PATH_OR_REPO", str(folder))
    assert "AutoTokenizer.from_pretrained" in snippet
    check = '\nassert type(model).__module__.startswith("transformers_modules")\n'
    check += 'print("IDS", tokenizer("to be").input_ids)\n'
    output = _run_fresh(snippet + check, tmp_path, block_kha_hf=True)
    assert "IDS [" in output
    assert not any(prompt in output for prompt in PROMPTS), output


UPSTREAM_PROMPT = (
    "transformers 5.24's AutoTokenizer loads the model config first (tokenization_auto.py, "
    "AutoConfig.from_pretrained), and without kha_hf a KHA config is remote code: it prompts. "
    "Passing here means transformers changed: drop the limitation in docs/limitations.md and this mark."
)


@pytest.mark.parametrize(
    "with_kha_hf", [True, pytest.param(False, marks=pytest.mark.xfail(strict=True, reason=UPSTREAM_PROMPT))]
)
def test_the_tokenizer_alone_loads_without_trust_remote_code_or_a_prompt(tmp_path, with_kha_hf):
    folder = _converted_with_tokenizer(tmp_path)
    script = "import kha_hf\n" if with_kha_hf else ""
    script += f"from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained({str(folder)!r})\n"
    output = _run_fresh(script + 'print("LOADED")', tmp_path, block_kha_hf=not with_kha_hf)
    assert "LOADED" in output
    assert not any(prompt in output for prompt in PROMPTS), output
