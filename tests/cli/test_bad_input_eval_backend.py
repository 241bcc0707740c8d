"""`kha eval --backend vllm` on inputs it cannot take: one line, exit 2, no output folder. No vLLM needed: each case
is refused before an engine starts, or by the worker in an environment without vLLM (this one)."""

import os
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
        # lm-eval passes extra arguments over its own pretrained: model=X scored X as both models (the attack)
        ([*VLLM, "--vllm-args", "enforce_eager=True,model=/x"], "cannot set model: it would change which model"),
        ([*VLLM, "--vllm-args", "tokenizer=/x"], "cannot set tokenizer"),
        ([*VLLM, "--vllm-args", "revision=main"], "cannot set revision"),
        ([*VLLM, "--vllm-args", "lora_local_path=/x"], "cannot set lora_local_path"),
        ([*VLLM, "--vllm-args", "hf_overrides=x"], "cannot set hf_overrides"),
        ([*VLLM, "--vllm-args", "trust_remote_code =True"], "expected key=value pairs"),
        ([*VLLM, "--device", "cuda"], "--device is for --backend hf"),
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


# Programs given as --vllm-python that do not speak the worker's protocol (argv: WORKER, MODEL_ARGS, REQUEST_FD,
# REPLY_FD): found by the attack on --backend vllm, where each ended in a traceback.
READY = '{"ready": {"versions": {}}}'
FAKE_WORKERS = {
    "garbage": ["not json"],
    "list": ["[1, 2]"],
    "ready-null": ['{"ready": null}'],
    "no-ready": ['{"results": []}'],
    "results-not-numbers": [READY, '{"results": [["x", true], ["y", false]]}'],
    "results-nan": [READY, '{"results": [[NaN, true], [NaN, false]]}'],
    "results-short": [READY, '{"results": []}'],
    "results-not-a-list": [READY, '{"results": {"a": 1}}'],
}


@pytest.mark.parametrize("case", sorted(FAKE_WORKERS))
def test_vllm_backend_worker_that_does_not_speak_the_protocol(case, llama, tmp_path, capsys):  # noqa: F811
    fake = tmp_path / "fake-python"
    lines = "".join(f"echo '{line}' >&$4\n" for line in FAKE_WORKERS[case])
    fake.write_text(f"#!/bin/sh\n{lines}sleep 2\n")  # answers, then reads nothing
    fake.chmod(0o755)
    out = tmp_path / "out"
    argv = ["eval", "--candidate", str(llama), "--tasks", "copa", "--limit", "2", "--local-data", "--output", str(out)]
    err = one_line_error(capsys, [*argv, "--backend", "vllm", "--vllm-python", str(fake)], "eval")
    assert "the vLLM worker" in err or "--backend vllm:" in err, err
    assert not out.exists()


def test_vllm_backend_ends_the_workers_process_group(llama, tmp_path, capsys):  # noqa: F811
    """A worker that dies mid-load leaves the engine processes it started (vLLM's EngineCore and workers, which
    outlived kha eval in the attack): kha eval ends its whole process group. Here the fake worker starts a child
    that would sleep for 10 minutes, then exits without an answer."""
    fake, pid_file = tmp_path / "fake-python", tmp_path / "child.pid"
    fake.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {pid_file}\nexit 3\n")
    fake.chmod(0o755)
    argv = ["eval", "--candidate", str(llama), "--tasks", "copa", "--limit", "2", "--local-data"]
    argv += ["--output", str(tmp_path / "out"), "--backend", "vllm", "--vllm-python", str(fake)]
    assert "stopped while loading the model (exit code 3)" in one_line_error(capsys, argv, "eval")
    child = int(pid_file.read_text())
    try:
        os.kill(child, 0)
    except ProcessLookupError:
        return
    # a zombie (not yet reaped by init) counts as ended
    assert open(f"/proc/{child}/stat").read().split()[2] == "Z", "the worker's child outlived kha eval"
