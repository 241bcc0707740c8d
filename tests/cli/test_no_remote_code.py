"""Code shipped inside a model folder never runs unless the user passes --trust-remote-code.

Each folder's code writes a marker file when imported: the marker must not appear without the flag, and does appear
with it (so the test would notice if the code were never reachable at all).
"""

import json
from pathlib import Path

import pytest

from kha_hf import KHAForCausalLM
from kha_hf.checkpoint.loading import load_causal_lm
from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from tests.helpers import save_tiny_tokenizer, tiny_base_model

MARKER_CODE = "from pathlib import Path\nPath({marker!r}).write_text('ran')\n"


def custom_code_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A stock Llama checkpoint whose config says model_type 'evil' with auto_map into its own files."""
    folder, marker = tmp_path / "evil", tmp_path / "MARKER"
    tiny_base_model("llama").save_pretrained(folder)
    save_tiny_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="evil",
        auto_map={
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_evil.py").write_text(
        MARKER_CODE.format(marker=str(marker))
        + "from transformers import LlamaConfig\nclass EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
    )
    (folder / "modeling_evil.py").write_text(
        MARKER_CODE.format(marker=str(marker))
        + "from transformers import LlamaForCausalLM\nfrom .configuration_evil import EvilConfig\n"
        + "class EvilForCausalLM(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    return folder, marker


@pytest.mark.parametrize("command", ["verify", "eval"])
def test_cli_does_not_run_folder_code_without_the_flag(tmp_path, capsys, command):
    folder, marker = custom_code_folder(tmp_path)
    kha = tmp_path / "kha"
    KHAForCausalLM.from_base(tiny_base_model("llama")).save_pretrained(kha)
    save_tiny_tokenizer(kha)
    argv = {
        "verify": ["verify", str(folder), str(kha)],
        "eval": [
            "eval",
            "--candidate",
            str(folder),
            "--tasks",
            "arc_easy",
            "--local-data",
            "--limit",
            "1",
            "--output",
            str(tmp_path / "eval"),
        ],
    }[command]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--trust-remote-code" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists(), "code from the model folder ran without --trust-remote-code"


def test_loading_runs_folder_code_only_with_the_flag(tmp_path):
    folder, marker = custom_code_folder(tmp_path)
    with pytest.raises(KHAError, match="--trust-remote-code"):
        load_causal_lm(folder)
    assert not marker.exists()
    model, _ = load_causal_lm(folder, trust_remote_code=True)
    assert marker.read_text() == "ran" and type(model).__name__ == "EvilForCausalLM"


def test_a_kha_folder_with_changed_code_loads_with_the_installed_code(tmp_path, capsys):
    folder = tmp_path / "kha"
    KHAForCausalLM.from_base(tiny_base_model("llama")).save_pretrained(folder)
    marker = tmp_path / "MARKER"
    modeling = folder / "modeling_kha.py"
    modeling.write_text(MARKER_CODE.format(marker=str(marker)) + modeling.read_text())
    save_tiny_tokenizer(folder)
    model, _ = load_causal_lm(folder)
    assert isinstance(model, KHAForCausalLM)
    assert not marker.exists(), "the folder's modified modeling_kha.py ran"
    assert "differs from the installed kha_hf" in capsys.readouterr().out


def test_an_unchanged_kha_folder_loads_silently_with_the_installed_classes(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from kha_hf.checkpoint.loading import kha_code_matches_installed, remote_code_kwargs

    folder = tmp_path / "kha"
    KHAForCausalLM.from_base(tiny_base_model("qwen3")).save_pretrained(folder)
    assert kha_code_matches_installed(folder)
    kwargs = remote_code_kwargs(folder)
    assert kwargs == {"trust_remote_code": False} and "differs" not in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    assert isinstance(model, KHAForCausalLM) and not type(model).__module__.startswith("transformers_modules")
