"""The `kha` command: help for the command and every subcommand, with examples; one-line errors."""

import shutil
import subprocess
import sys

import pytest

from kha_hf.cli import SUBCOMMANDS, build_parser, main

NAMES = ["convert", "verify", "train", "ab", "eval", "inspect", "fold", "push", "demo"]


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
