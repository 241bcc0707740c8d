"""`kha serve`: transformers' serving stack (FastAPI + uvicorn, OpenAI-compatible) with KHA models resolved.

transformers 5.24's `ModelManager._load_model` resolves a checkpoint's class as `getattr(transformers,
config.architectures[0])`, so any checkpoint whose class is not part of transformers (every remote-code model, KHA
included) fails with AttributeError even with --trust-remote-code. The workaround is the smallest we found: a
ModelManager subclass that loads KHA checkpoints (model_type "kha") through `AutoModelForCausalLM`, where kha_hf has
registered its classes, so their own code files are not run. transformers' `Serve` builds its ModelManager by name
inside its constructor; the subclass is swapped in for that one constructor call only (`non_blocking`, then we join
the server thread), so nothing changes for other models or other code in the process.
"""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.request
from pathlib import Path
from unittest import mock

from ..common.errors import KHAError
from ..common.loading import check_model_ref, read_config_dict


def kha_model_manager_class():
    """transformers' ModelManager, except that KHA checkpoints load through kha_hf's registered classes."""
    from transformers import AutoModelForCausalLM
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import split_revision

    class KHAModelManager(ModelManager):
        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            model_id, revision = split_revision(model_id_and_revision)
            config = read_config_dict(Path(model_id)) if Path(model_id).is_dir() else None
            if gguf_file is not None or (config or {}).get("model_type") != "kha":
                return super()._load_model(model_id_and_revision, tqdm_class, progress_callback, gguf_file)
            return AutoModelForCausalLM.from_pretrained(
                model_id,
                revision=revision,
                attn_implementation=self.attn_implementation,
                dtype=self.dtype,
                device_map=self.device,
                trust_remote_code=False,  # the installed kha_hf classes: the folder's code files do not run
                tqdm_class=tqdm_class,
            )

    return KHAModelManager


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as err:
            raise KHAError(f"cannot listen on {host}:{port}: {err.strerror or err} (pick another --port)") from err


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


def start_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    continuous_batching: bool = False,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    ready_timeout: float = 300.0,
):
    """Load MODEL and start transformers' server on HOST:PORT in a background thread; returns the `Serve` object
    (its `kill_server()` stops it). Blocks until /health answers."""
    from transformers.cli import serve as serve_module
    from transformers.cli.serving import model_manager
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise KHAError("serving needs transformers' serving extras: pip install 'kha-hf[serve]'")
    check_model_ref(model)
    check_port_free(host, port)
    path = Path(model).expanduser()
    name = str(path.resolve()) if path.exists() else str(model)
    with mock.patch.object(model_manager, "ModelManager", kha_model_manager_class()):
        server = serve_module.Serve(
            force_model=name,
            continuous_batching=continuous_batching,
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            host=host,
            port=port,
            non_blocking=True,
        )
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
