"""`pipeline("text-generation")` takes KHA models without logging "not supported", with kha_hf and as remote code."""

import textwrap

import torch
from transformers import AutoModelForCausalLM, pipeline

from kha_hf import KHAForCausalLM
from tests.helpers import run_python, save_tiny_tokenizer, tiny_configs


def tiny_kha_folder(path):
    config = tiny_configs()["qwen3"]
    config.vocab_size = 300
    torch.manual_seed(0)
    KHAForCausalLM.from_base(AutoModelForCausalLM.from_config(config)).save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


def test_pipeline_with_kha_hf_installed(tmp_path, caplog):
    folder = tiny_kha_folder(tmp_path / "kha")
    generator = pipeline("text-generation", model=str(folder))
    out = generator("the quick", max_new_tokens=3, do_sample=False)
    assert isinstance(generator.model, KHAForCausalLM) and out[0]["generated_text"].startswith("the quick")
    assert "is not supported for text-generation" not in caplog.text


def test_pipeline_as_remote_code_without_kha_hf(tmp_path):
    folder = tiny_kha_folder(tmp_path / "kha")
    script = textwrap.dedent(
        f"""
        from transformers import pipeline
        generator = pipeline("text-generation", model={str(folder)!r}, trust_remote_code=True)
        assert type(generator.model).__module__.startswith("transformers_modules")
        print(generator("the quick", max_new_tokens=3, do_sample=False)[0]["generated_text"])
        """
    )
    proc = run_python(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is not supported for text-generation" not in proc.stderr + proc.stdout
    assert proc.stdout.strip().startswith("the quick")
