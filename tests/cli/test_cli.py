"""The `kha` command: help for the command and every subcommand, with examples; one-line errors."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kha_hf.cli import SUBCOMMANDS, build_parser, main

NAMES = [
    "convert",
    "verify",
    "tokenize",
    "train",
    "ab",
    "eval",
    "inspect",
    "fold",
    "adapter",
    "push",
    "serve",
    "demo",
    "assets",
]


def test_every_subcommand_is_registered():
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert sorted(choices) == sorted(NAMES) and len(SUBCOMMANDS) == len(NAMES)


def test_kha_help_runs_as_installed_console_script():
    exe = shutil.which("kha")
    cmd = [exe, "--help"] if exe else [sys.executable, "-m", "kha_hf", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "typical workflow" in out.stdout
    for name in NAMES:
        assert name in out.stdout


@pytest.mark.parametrize("name", NAMES)
def test_subcommand_help_shows_examples(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kha {name}")
    assert "example" in out and f"kha {name}" in out.split("example", 1)[1]


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "usage: kha" in capsys.readouterr().out


def test_push_uploads_the_folder(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kwargs):
            calls["repo"] = (repo_id, kwargs)

        def upload_folder(self, **kwargs):
            calls["upload"] = kwargs
            return "https://huggingface.co/me/x/commit/1"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    (tmp_path / "config.json").write_text("{}")
    assert main(["push", str(tmp_path), "me/x"]) == 0
    assert calls["repo"] == ("me/x", {"repo_type": "model", "private": False, "exist_ok": True})
    assert calls["upload"]["folder_path"] == str(tmp_path)
    assert main(["push", str(tmp_path / "missing"), "me/x"]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err


def test_assets_prints_real_paths(capsys):
    assert main(["assets"]) == 0
    lines = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert lines["smollm2_gguf"].endswith(".gguf") and Path(lines["smollm2_gguf"]).is_file()
    assert (Path(lines["eval_datasets"]) / "hellaswag").is_dir() and Path(lines["shakespeare"]).is_dir()
    assert main(["assets", "--gguf"]) == 0
    assert capsys.readouterr().out.strip() == lines["smollm2_gguf"]


def test_help_and_argument_errors_import_no_heavy_libraries():
    # Checked by sys.modules in a fresh process, not by timing: through the `kha` entry point, help and argument
    # errors must not pay for lm-eval, PEFT, datasets or transformers' modeling stack.
    heavy = ("lm_eval", "peft", "datasets", "kha_hf.modeling.modeling_kha", "transformers.modeling_utils")
    script = (
        "import sys\n"
        "import kha_hf_entry\n"
        "from kha_hf.cli import main\n"
        f"for argv in [['--help']] + [[n, '--help'] for n in {NAMES!r}] + [['train', 'x', '--max-steps', '0']]:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


def test_python_m_kha_hf_entry_defers_the_modeling_stack_too():
    # `python -m kha_hf_entry` (the tests' and benchmarks' way to run `kha`) runs the file as __main__: it imported
    # transformers' modeling stack before parsing, 2 s more per `--help` than the console script.
    script = (
        "import runpy, sys\n"
        "sys.argv = ['kha_hf_entry', '--help']\n"
        "try:\n"
        "    runpy.run_module('kha_hf_entry', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('kha_hf.modeling.modeling_kha', 'transformers.modeling_utils')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "usage: kha" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


def test_import_kha_hf_still_registers_the_auto_classes():
    script = (
        "import kha_hf\n"
        "from transformers import AutoConfig\n"
        "from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING\n"
        "assert AutoConfig.for_model('kha', base_model_type='llama').model_type == 'kha'\n"
        "assert kha_hf.KHAForCausalLM in MODEL_FOR_CAUSAL_LM_MAPPING[kha_hf.KHAConfig]\n"
        "print('REGISTERED')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "REGISTERED" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("name", NAMES)
def test_every_option_has_help_and_shows_its_default(name, capsys):
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    for action in sub._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help, f"kha {name}: {action.option_strings or action.dest} has no help"
    with pytest.raises(SystemExit):
        main([name, "--help"])
    out = capsys.readouterr().out
    for action in sub._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            shown = "".join(out.split())  # argparse wraps long lines, also inside words with hyphens
            assert f"default:{action.default}".replace(" ", "") in shown, f"kha {name} {action.option_strings}"


def test_call_with_passes_every_option_by_name_and_refuses_one_without_a_parameter():
    """`cli._common.call_with`: the positional options in order, the rest by name (a renamed one under its
    parameter); an option the function has no parameter for is an error, never dropped."""
    import argparse

    from kha_hf.cli._common import call_with

    def target(src, dst, link=False, trained_knocks=None):
        return src, dst, link, trained_knocks

    args = argparse.Namespace(command="x", func=None, src="a", dst="b", link=True, adapter="ad")
    assert call_with(target, args, "src", "dst", trained_knocks="adapter") == ("a", "b", True, "ad")
    with pytest.raises(TypeError, match="has no parameter for the option"):
        call_with(target, args, "src", "dst")  # --adapter with no parameter of that name
    assert args.adapter == "ad"  # ARGS itself is left as it was
