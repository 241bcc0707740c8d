"""`kha serve`: transformers' serving stack (FastAPI + uvicorn, OpenAI-compatible), serving one model safely.

Classes of transformers' server (and uvicorn's config) are swapped for subclasses while `Serve` builds the server
(and only for that one constructor call, so nothing changes for other code in the process); each works around one
thing of transformers 5.24:

- `ModelManager._load_model` resolves a checkpoint's class as `getattr(transformers, config.architectures[0])`,
  so remote-code checkpoints (KHA included) fail even with --trust-remote-code. KHA checkpoints (model_type "kha")
  load through `AutoModelForCausalLM`, where kha_hf registered its classes: their code files never run, and their
  tokenizer loads without remote code too.
- `GenerationState` hands out generation managers without request limits: see `generation.py`.
- The chat, completion and response handlers render templates on the event loop and take a client's
  `chat_template_kwargs`: see `handlers.py`.
- `build_server` exposes model loading and unloading to any client and passes any field on: `guard.ServeGuard`
  (with the allowlists of `fields.py`) is put in front of it.
- `uvicorn.Config` has no read timeout and no connection cap: see `connections.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import socket
import time
import urllib.request
from pathlib import Path
from unittest import mock

from ..common.errors import KHAError
from ..common.loading import (
    TOKENIZER_FILES,
    check_device,
    check_model_ref,
    check_processor_needs_no_code,
    check_remote_code_allowed,
    has_processor_files,
    is_multimodal_checkpoint,
    read_config_dict,
)
from .errors import RequestError
from .guard import RequestRegistry, ServeGuard, ServeLimits, model_aliases

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# Continuous batching on a CPU. Without numbers, transformers 5.24 sizes its paged KV cache from free *device*
# memory, which on a CPU is 60-90 % of the machine's RAM, and allocates attention masks of max_batch_tokens x
# (cache + max_batch_tokens): 13.7 GiB for a 2-layer test model on a 23 GiB machine. On a CPU kha serve asks for
# 64 blocks of 256 tokens (16,384 tokens of cache; SmolLM2-135M in float32: about 0.7 GiB) and 512 tokens per
# batch (longer prompts are prefilled in chunks); on a GPU transformers' own sizing stays.
CPU_CB_NUM_BLOCKS = 64
CPU_CB_MAX_BATCH_TOKENS = 512


def cb_sizes(device: str, cb_num_blocks: int | None, cb_max_batch_tokens: int | None) -> dict:
    """transformers' `Serve` keywords for the continuous-batching cache: what was given, else the CPU defaults
    above on a CPU, else None (transformers sizes both from free accelerator memory)."""
    import torch

    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu:
        cb_num_blocks = CPU_CB_NUM_BLOCKS if cb_num_blocks is None else cb_num_blocks
        cb_max_batch_tokens = CPU_CB_MAX_BATCH_TOKENS if cb_max_batch_tokens is None else cb_max_batch_tokens
    return {"cb_num_blocks": cb_num_blocks, "cb_max_batch_tokens": cb_max_batch_tokens}


def kha_model_manager_class():
    """transformers' ModelManager, except that KHA checkpoints load through kha_hf's registered classes (a
    multimodal one through AutoModelForImageTextToText, with its processor: chat requests may hold images)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import Modality, split_revision

    def is_kha(model_id: str) -> bool:
        return Path(model_id).is_dir() and (read_config_dict(Path(model_id)) or {}).get("model_type") == "kha"

    class KHAModelManager(ModelManager):
        def _load_processor(self, model_id_and_revision, gguf_file=None):
            model_id, revision = split_revision(model_id_and_revision)
            if gguf_file is None and is_kha(model_id):  # the base model's tokenizer: no code of the folder runs
                folder = Path(model_id)
                if is_multimodal_checkpoint(folder) and has_processor_files(folder):
                    # the base model's processor, also without code (else the tokenizer: a text-only server)
                    return AutoProcessor.from_pretrained(model_id, revision=revision, trust_remote_code=False)
                return AutoTokenizer.from_pretrained(model_id, revision=revision, trust_remote_code=False)
            return super()._load_processor(model_id_and_revision, gguf_file=gguf_file)

        @staticmethod
        def get_model_modality(model, processor=None):
            # transformers 5.24 reads the modality from the class name, which for KHA is KHA<family class>
            config = model.config
            if getattr(config, "model_type", None) == "kha" and config.is_multimodal:
                if hasattr(processor, "image_processor"):
                    return Modality.VLM  # else a tokenizer alone (no processor files): text only, as transformers
            return ModelManager.get_model_modality(model, processor=processor)

        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            model_id, revision = split_revision(model_id_and_revision)
            if gguf_file is not None or not is_kha(model_id):
                return super()._load_model(model_id_and_revision, tqdm_class, progress_callback, gguf_file)
            multimodal = is_multimodal_checkpoint(Path(model_id))
            return (AutoModelForImageTextToText if multimodal else AutoModelForCausalLM).from_pretrained(
                model_id,
                revision=revision,
                attn_implementation=self.attn_implementation,
                dtype=self.dtype,
                device_map=self.device,
                trust_remote_code=False,  # the installed kha_hf classes: the folder's code files do not run
                tqdm_class=tqdm_class,
            )

    return KHAModelManager


def check_listen_address(host: str, port: int) -> None:
    """One-line KHAError unless HOST:PORT can be listened on here."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise KHAError(f"cannot resolve --host {host!r}: {err.strerror or err}") from err
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise KHAError(f"cannot listen on {host}:{port}: the port is in use (pick another --port)") from err
            raise KHAError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err


# the old name, kept for callers of 0.2
check_port_free = check_listen_address


def wait_until_ready(host: str, port: int, timeout: float) -> None:
    """Poll GET /health until the server answers; KHAError after TIMEOUT seconds."""
    url = f"http://{host}:{port}/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.2)
    raise KHAError(f"the server did not answer on {url} within {timeout:.0f} s")


# transformers' serving module is internal and changes between minor releases: 5.25.0 rewrote it (split_revision and
# the model manager's loaders are gone), so kha serve runs on the releases its subclasses were written and tested for
SERVING_TRANSFORMERS = ((5, 24), (5, 25))  # [lowest, first unsupported): setup.cfg's range


def check_serving_transformers(version: str | None = None) -> None:
    """One-line KHAError unless the installed transformers (or VERSION) is in SERVING_TRANSFORMERS."""
    if version is None:
        import transformers

        version = transformers.__version__
    low, high = SERVING_TRANSFORMERS
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if not low <= release < high:
        wanted = f"transformers>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
        raise KHAError(
            f"kha serve needs {wanted} (its serving module changes between releases); installed: {version}: "
            f"pip install '{wanted}'"
        )


def check_serve_inputs(
    model: str,
    device: str,
    dtype: str,
    trust_remote_code: bool,
    limits: ServeLimits,
    cache_sizes: dict[str, int | None] | None = None,
) -> str:
    """Bad inputs fail here, in one line, before anything is loaded; returns the name the server serves under.
    CACHE_SIZES: the continuous-batching numbers given (name -> value or None for the default)."""
    check_model_ref(model)
    if dtype not in DTYPE_CHOICES:
        raise KHAError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPE_CHOICES)}")
    if device != "auto":
        check_device(device)
    counts = {
        "max_new_tokens": limits.max_new_tokens,
        "max_request_bytes": limits.max_request_bytes,
        "max_connections": limits.max_connections,
    }
    counts.update({name: value for name, value in (cache_sizes or {}).items() if value is not None})
    for name, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise KHAError(f"{name} must be a positive integer, got {value!r}")
    for name in ("request_timeout", "read_timeout"):
        value = getattr(limits, name)
        if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise KHAError(f"{name} must be a positive number of seconds, got {value!r}")
    path = Path(model).expanduser()
    if not path.exists():
        return str(model)  # a Hub id
    config = read_config_dict(path) if path.is_dir() else None
    if config is None:
        raise KHAError(f"{model} is not a model folder (it has no readable config.json)")
    is_kha = config.get("model_type") == "kha"
    check_remote_code_allowed(path, trust_remote_code)
    if is_kha:
        check_processor_needs_no_code(path)  # its processor loads without code (KHAModelManager._load_processor)
    from ..common.checks import check_checkpoint_against_config, check_not_task_head

    check_not_task_head(path)  # served as a causal LM, a reward model would answer with a random lm_head
    check_checkpoint_against_config(path)
    if is_kha and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise KHAError(f"{model} has no tokenizer files: copy the base model's tokenizer into it to serve it")
    return str(path.resolve())


def start_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    continuous_batching: bool = False,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    ready_timeout: float = 300.0,
    limits: ServeLimits | None = None,
    cb_num_blocks: int | None = None,
    cb_max_batch_tokens: int | None = None,
):
    """Load MODEL and start transformers' server on HOST:PORT in a background thread; returns the `Serve` object
    (its `kill_server()` stops it). Blocks until /health answers. Only MODEL is ever served (see `guard.py`).

    CB_NUM_BLOCKS (blocks of 256 tokens) and CB_MAX_BATCH_TOKENS size continuous batching's paged KV cache and its
    batches (defaults: see `cb_sizes`)."""
    from transformers.cli import serve as serve_module
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise KHAError("serving needs transformers' serving extras: pip install 'kha-hf[serve]'")
    check_serving_transformers()
    import uvicorn
    from fastapi.responses import Response
    from transformers.cli.serving import chat_completion, completion, model_manager, response
    from transformers.cli.serving import server as server_module
    from transformers.cli.serving import utils as serving_utils

    from .connections import kha_uvicorn_config_class
    from .generation import kha_generation_state_class
    from .handlers import kha_handler_classes

    limits = limits or ServeLimits()
    cache_sizes = {"cb_num_blocks": cb_num_blocks, "cb_max_batch_tokens": cb_max_batch_tokens}
    served = check_serve_inputs(model, device, dtype, trust_remote_code, limits, cache_sizes)
    check_listen_address(host, port)
    folder = Path(model)
    if folder.is_dir() and is_multimodal_checkpoint(folder) and has_processor_files(folder):
        limits = dataclasses.replace(limits, images=True)  # chat messages may carry images for its processor
    registry = RequestRegistry()
    build_server = server_module.build_server

    def guarded_build_server(*args, **kwargs):
        app = build_server(*args, **kwargs)

        async def request_error(_request, err: RequestError):  # a handler's refusal, in OpenAI's error format
            return Response(err.body(), status_code=err.status, media_type="application/json")

        app.add_exception_handler(RequestError, request_error)

        async def server_error(_request, _err: Exception):  # an unexpected failure: JSON too, the traceback is logged
            error = {"message": "the model failed on this request (see the server log)", "type": "server_error"}
            return Response(json.dumps({"error": error}), status_code=500, media_type="application/json")

        app.add_exception_handler(Exception, server_error)
        app.add_middleware(
            ServeGuard, served=served, aliases=model_aliases(str(model), served), limits=limits, registry=registry
        )
        return app

    handlers = kha_handler_classes(limits, registry)
    with (
        mock.patch.object(model_manager, "ModelManager", kha_model_manager_class()),
        mock.patch.object(serving_utils, "GenerationState", kha_generation_state_class(limits, registry)),
        mock.patch.object(chat_completion, "ChatCompletionHandler", handlers["ChatCompletionHandler"]),
        mock.patch.object(completion, "CompletionHandler", handlers["CompletionHandler"]),
        mock.patch.object(response, "ResponseHandler", handlers["ResponseHandler"]),
        mock.patch.object(server_module, "build_server", guarded_build_server),
        mock.patch.object(uvicorn, "Config", kha_uvicorn_config_class(limits.read_timeout, limits.max_connections)),
    ):
        server = serve_module.Serve(
            force_model=served,
            continuous_batching=continuous_batching,
            **(cb_sizes(device, **cache_sizes) if continuous_batching else {}),
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            host=host,
            port=port,
            non_blocking=True,
        )
    server.kha_registry = registry  # the requests in flight (tests and monitoring read it)
    wait_until_ready(host, port, ready_timeout)
    return server


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """Serve MODEL until interrupted (Ctrl-C / SIGTERM)."""
    server = start_server(model, host=host, port=port, **kwargs)
    print(f"serving {model} at http://{host}:{port}/v1 (OpenAI-compatible: /v1/chat/completions, /v1/completions)")
    try:
        while server._thread.is_alive():
            server._thread.join(timeout=1)
    except KeyboardInterrupt:
        print("stopping the server")
    finally:
        server.kill_server()
