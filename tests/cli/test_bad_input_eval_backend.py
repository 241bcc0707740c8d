"""`kha eval --backend vllm` on inputs it cannot take: one line, exit 2, no output folder. No vLLM needed: each case
is refused before an engine starts, or by the worker in an environment without vLLM (this one)."""

import sys

import pytest

from tests.cli.test_bad_input import llama, one_line_error  # noqa: F401 - llama is a fixture

VLLM = ["--backend", "vllm", "--vllm-python", sys.executable]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--perplexity", "{tmp}/text.txt", *VLLM], "--perplexity runs in transformers"),
        (["--vllm-args", "enforce_eager=True"], "--vllm-python and --vllm-args are for --backend vllm"),
        (["--vllm-python", sys.executable], "--vllm-python and --vllm-args are for --backend vllm"),
        ([*VLLM, "--vllm-args", "dtype=float16"], "--vllm-args cannot set dtype: kha eval sets it from --dtype"),
        ([*VLLM, "--vllm-args", "pretrained=/x"], "cannot set pretrained"),
        ([*VLLM, "--vllm-args", "trust_remote_code=True"], "from --trust-remote-code"),
        ([*VLLM, "--vllm-args", "enforce_eager"], "expected key=value pairs"),
        ([*VLLM, "--vllm-args", "=1"], "expected key=value pairs"),
        (["--backend", "vllm", "--vllm-python", "{tmp}/no-python"], "no such executable"),
        (["--backend", "vllm", "--vllm-python", "{tmp}"], "no such executable"),
        (["--backend", "vllm"], "--backend vllm needs vLLM and lm-eval in some environment"),
        # the worker starts in this environment, which has lm-eval but no vLLM
        (VLLM, "this environment cannot run lm-eval's vllm model (ModuleNotFoundError: No module named 'vllm')"),
    ],
)
def test_vllm_backend_bad_input(llama, tmp_path, capsys, monkeypatch, extra, message):  # noqa: F811
    monkeypatch.delenv("KHA_VLLM_PYTHON", raising=False)
    (tmp_path / "text.txt").write_text("some text\n")
    extra = [arg.replace("{tmp}", str(tmp_path)) for arg in extra]
    out = tmp_path / "out"
    argv = ["eval", "--candidate", str(llama), "--tasks", "copa", "--limit", "2", "--local-data", "--output", str(out)]
    assert message in one_line_error(capsys, argv + extra, "eval")
    assert not out.exists()


def test_vllm_backend_refuses_an_adapter_and_gguf(llama, tmp_path, capsys):  # noqa: F811
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    argv = ["eval", "--baseline", str(llama), "--adapter", str(adapter), "--tasks", "copa", *VLLM]
    assert "kha convert BASE DST --adapter DIR" in one_line_error(capsys, argv, "eval")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    argv = ["eval", "--baseline", str(gguf), "--candidate", str(llama), "--tasks", "copa", *VLLM]
    assert "use --backend hf for GGUF files" in one_line_error(capsys, argv, "eval")
