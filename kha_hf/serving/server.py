"""`kha serve`: transformers' serving stack (FastAPI + uvicorn, OpenAI-compatible), serving one model safely.

Here: what is checked before anything loads (the model folder, its generation settings, the limits, the listen
address, the transformers release), and `start_server`, which starts `app.KHAServe` (transformers' `Serve`, built
from kha serve's subclasses of transformers' pieces: see `app.py`) and waits until it answers.

Dropped with 5.25: the swap of `GenerationState`, whose generation managers (5.24's `GenerateManager`,
`CBGenerateManager`) now run in the model's process, which transformers 5.25 spawns; kha serve's limits moved to
the API server's side (`generation.py`) and to what it asks of the model's process (`engine.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import socket
import time
import urllib.request
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.loading import (
    TOKENIZER_FILES,
    check_device,
    check_model_ref,
    check_processor_bounds,
    check_processor_needs_no_code,
    describe_error,
    has_processor_files,
    is_multimodal_checkpoint,
)
from ..checkpoint.reader import NoConfig, open_checkpoint
from ..common.errors import KHAError
from ..common.supported_versions import release
from .fields import MIN_TEMPERATURE, is_int, is_number
from .guard import ServeLimits, model_aliases

if TYPE_CHECKING:
    from .app import KHAServe

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# Continuous batching on a CPU. Without numbers, transformers sizes its paged KV cache from free *device* memory,
# which on a CPU is most of the machine's RAM (5.24: 60-90 %, and attention masks of max_batch_tokens x (cache +
# max_batch_tokens): 13.7 GiB for a 2-layer test model on a 23 GiB machine; 5.25 still takes 60 % of it). On a CPU
# kha serve asks for 64 blocks of 256 tokens (16,384 tokens of cache; SmolLM2-135M in float32: about 0.7 GiB) and
# 512 tokens per batch (longer prompts are prefilled in chunks); on a GPU transformers' own sizing stays.
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


# transformers' serving module is internal and changes between minor releases: 5.25.0 rewrote it (the model runs
# in a process of its own, split_revision and the 5.24 model manager's loaders are gone), so kha serve runs on the
# release its subclasses were written for and later ones (with a warning: they are untested)
SERVING_TRANSFORMERS = (5, 25)  # the oldest release kha serve supports: setup.cfg's [serve] extra must admit it
SERVING_TESTED = (5, 25)  # the newest release kha serve was tested with


class UntestedServingWarning(UserWarning):
    """The installed transformers is newer than any release kha serve was tested with."""


def check_serving_transformers(version: str | None = None) -> None:
    """One-line KHAError when the installed transformers (or VERSION) is older than SERVING_TRANSFORMERS; one
    warning when it is newer than SERVING_TESTED."""
    if version is None:
        import transformers

        version = transformers.__version__
    installed = release(version)[:2]
    if installed < SERVING_TRANSFORMERS:
        wanted = "transformers>={}.{}".format(*SERVING_TRANSFORMERS)
        raise KHAError(
            f"kha serve needs {wanted} (transformers' serving module changes between releases); installed: {version}: "
            f"pip install '{wanted}'"
        )
    if installed > SERVING_TESTED:
        warnings.warn(
            "kha serve is tested with transformers {}.{}; {} is newer and its serving module may have changed: please "
            "report what breaks".format(*SERVING_TESTED, version),
            UntestedServingWarning,
            stacklevel=2,
        )


# A request that names no sampling setting takes the model's (generation_config.json, else config.json, as
# transformers builds it): each must be one a request could be allowed, or one that no generation can survive is
# refused at start. `temperature: 1e-45` overflowed the logits (a 500, and a dead continuous batch), `typical_p: 0`
# and `num_beams: 64` failed every request.
UNIT = "above 0, at most 1"
SAMPLING_BOUNDS = {
    "temperature": (lambda t: t == 0 or MIN_TEMPERATURE <= t <= 100, f"0, or {MIN_TEMPERATURE} to 100"),
    "top_p": (lambda p: 0 < p <= 1, UNIT),
    "typical_p": (lambda p: 0 < p <= 1, UNIT),
    "min_p": (lambda p: 0 <= p <= 1, "0 to 1"),
    "epsilon_cutoff": (lambda p: 0 <= p < 1, "0 or more, below 1"),
    "eta_cutoff": (lambda p: 0 <= p < 1, "0 or more, below 1"),
    "repetition_penalty": (lambda r: 0.01 <= r <= 100, "0.01 to 100"),
    # contrastive search left transformers in 5.0 (a Hub custom_generate): every request failed with a 500
    "penalty_alpha": (lambda a: a == 0, "0: transformers 5 has no contrastive search"),
}
WHOLE_BOUNDS = {
    "top_k": (lambda k: k >= 0, "a whole number, 0 or more"),
    "num_beams": (lambda n: n == 1, "1: kha serve streams each token, which beam search cannot"),
    "num_beam_groups": (lambda n: n == 1, "1: kha serve streams each token, which beam search cannot"),
    "min_new_tokens": (lambda n: n >= 0, "a whole number, 0 or more"),
    "min_length": (lambda n: n >= 0, "a whole number, 0 or more"),
}


def check_generation_config(folder: Path, model_config: dict) -> None:
    """One-line KHAError for generation settings in FOLDER's generation_config.json (or, without one, its
    config.json, which transformers builds the generation config from) that no request could be allowed
    (SAMPLING_BOUNDS, WHOLE_BOUNDS; suppressed tokens that leave none to sample): the bounds of a request's own
    fields (`fields.py`), checked when the server starts. MODEL_CONFIG: config.json as `open_checkpoint` read it."""
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    from ..common.text_files import read_json_object

    path = folder / "generation_config.json"
    if path.is_file():
        config = read_json_object(path)
    else:  # MODEL_CONFIG: FOLDER's config.json, already read and checked
        path, config = folder / "config.json", model_config
    for name, value in config.items():
        whole = name in WHOLE_BOUNDS
        ok, bounds = WHOLE_BOUNDS[name] if whole else SAMPLING_BOUNDS.get(name, (None, None))
        if ok is not None and value is not None and not ((is_int if whole else is_number)(value) and ok(value)):
            raise KHAError(f"{path}: {name} {value!r} is outside what kha serve can generate with ({bounds})")
    cache = config.get("cache_implementation")  # an unknown one ended the start in a 48-line traceback (5.25)
    if cache is not None and cache not in ALL_CACHE_IMPLEMENTATIONS:
        raise KHAError(f"{path}: cache_implementation {cache!r} is not one of: {', '.join(ALL_CACHE_IMPLEMENTATIONS)}")
    vocab = model_config.get("vocab_size")
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        tokens = config.get(name)
        if tokens is None:
            continue
        if not isinstance(tokens, list) or not all(map(is_int, tokens)):
            raise KHAError(f"{path}: {name} must be a list of token ids")
        if isinstance(vocab, int) and len(set(tokens)) >= vocab - 1:
            raise KHAError(f"{path}: {name} suppresses {len(set(tokens))} of {vocab} tokens: nothing is left to say")


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
    counted = ("max_new_tokens", "max_request_bytes", "max_connections", "render_memory")
    counts = {name: getattr(limits, name) for name in counted}
    counts.update({name: value for name, value in (cache_sizes or {}).items() if value is not None})
    for name, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise KHAError(f"{name} must be a positive integer, got {value!r}")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's
    if isinstance(limits.render_memory, int) and limits.render_memory > memory:
        raise KHAError(
            f"--render-memory {limits.render_memory >> 20} MiB is more than this machine's memory ({memory >> 20} "
            "MiB): a render could then take it all"
        )
    for name in ("request_timeout", "read_timeout"):
        value = getattr(limits, name)
        if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise KHAError(f"{name} must be a positive number of seconds, got {value!r}")
    path = Path(model).expanduser()
    if not path.exists():
        return str(model)  # a Hub id
    try:  # read and checked: a folder that ships code it may not run, a task head served as a causal LM
        checkpoint = open_checkpoint(path, trust_remote_code=trust_remote_code, causal_lm=True)
    except NoConfig:
        raise KHAError(f"{model} is not a model folder (it has no readable config.json)") from None
    if checkpoint.is_kha:
        check_processor_needs_no_code(path)  # its processor loads without code (KHAModelManager._load_processor)
    check_processor_bounds(path)  # one small image resized to gigabytes (any checkpoint: its processor serves images)
    check_generation_config(path, checkpoint.config)
    if checkpoint.is_kha and not any((path / f).is_file() for f in TOKENIZER_FILES):
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
) -> KHAServe:
    """Load MODEL and start transformers' server on HOST:PORT in a background thread (the model in a process of its
    own); returns the running `app.KHAServe` (its `kill_server()` stops it). Blocks until /health answers. Only MODEL
    is ever served (see `guard.py`).

    CB_NUM_BLOCKS (blocks of 256 tokens) and CB_MAX_BATCH_TOKENS size continuous batching's paged KV cache and its
    batches (defaults: see `cb_sizes`).

    transformers (>= 5.25) spawns the model's process, which imports the caller's main module again: a script that
    calls this must do so under `if __name__ == "__main__":`."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise KHAError("serving needs transformers' serving extras: pip install 'kha-hf[serve]'")
    check_serving_transformers()
    from .app import KHAServe

    limits = limits or ServeLimits()
    cache_sizes = {"cb_num_blocks": cb_num_blocks, "cb_max_batch_tokens": cb_max_batch_tokens}
    served = check_serve_inputs(model, device, dtype, trust_remote_code, limits, cache_sizes)
    check_listen_address(host, port)
    folder = Path(model)
    if folder.is_dir() and is_multimodal_checkpoint(folder) and has_processor_files(folder):
        limits = dataclasses.replace(limits, images=True)  # chat messages may carry images for its processor
    try:
        running = KHAServe(
            served,
            aliases=model_aliases(str(model), served),
            limits=limits,
            continuous_batching=continuous_batching,
            **(cb_sizes(device, **cache_sizes) if continuous_batching else {}),
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            host=host,
            port=port,
        )
    except RuntimeError as err:  # the model's process failed to load the model (its log says why)
        raise KHAError(f"the server did not start: {describe_error(err)}") from err
    except OSError as err:  # its config could not be read: a Hub id that does not exist, no network (one line)
        raise KHAError(f"cannot load {model}: {describe_error(err)}") from err
    try:
        wait_until_ready(host, port, ready_timeout)
        running.renders.start()
    except BaseException:
        running.kill_server()
        raise
    return running


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """Serve MODEL until interrupted (Ctrl-C / SIGTERM) or until the model's process dies."""
    server = start_server(model, host=host, port=port, **kwargs)
    print(f"serving {model} at http://{host}:{port}/v1 (OpenAI-compatible: /v1/chat/completions, /v1/completions)")
    try:
        while server.is_alive():
            server.thread.join(timeout=1)
    except KeyboardInterrupt:
        print("stopping the server")
    finally:
        server.kill_server()
    if server.model_manager.is_dead:
        raise KHAError("the model's process died (see the log above): the server stopped")
