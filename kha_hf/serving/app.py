"""`kha serve`'s server: transformers' `Serve` (FastAPI + uvicorn, OpenAI-compatible) built from kha serve's pieces.

`KHAServe` subclasses transformers' `Serve` and overrides its `run`, which builds the server, with what closes the
gaps of transformers 5.25, all passed in where transformers' and uvicorn's APIs take them (nothing of transformers
or uvicorn is replaced outside these objects):

- the model loader, `engine.KHAModelLoader` (pickled into the model's process): KHA checkpoints load through the
  classes kha_hf registered, so their code files never run (5.25 cannot resolve a KHA class);
- the model manager, `KHAModelManager`, whose client of the model's process is `generation.KHAEngineClient`, for the
  served model only (5.25 pins it, `force_model`, and the guard names it in every request);
- the chat, completion and response handlers (`handlers.py`): 5.25's render on one thread without a time limit,
  and apply none of kha serve's limits (context, new tokens, time, disconnects, /health tracking, sampling checks);
- the app of transformers' `build_server`, which exposes model loading and unloading to any client and passes any
  field on: `guard.ServeGuard` (with the allowlists of `fields.py`) is put in front of it, and its errors
  (`{"detail": ...}`) are answered in OpenAI's error format;
- uvicorn's Config, `connections.KHAUvicornConfig`: uvicorn has no read timeout and no connection cap;
- uvicorn's Server runs on a thread of its own (5.25's `Serve.run` serves until stopped), so that `start_server`
  gets the running `KHAServe` back.
"""

from __future__ import annotations

import threading

import uvicorn
from starlette.exceptions import HTTPException
from transformers.cli.serve import Serve
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.server import build_server
from transformers.cli.serving.utils import EngineDeadError, canonical_model_id

from .connections import KHAUvicornConfig
from .engine import KHAModelLoader
from .errors import RequestError
from .generation import KHAEngineClient, engine_error
from .guard import RequestRegistry, ServeGuard, ServeLimits
from .handlers import KHAChatCompletionHandler, KHACompletionHandler, KHAResponseHandler
from .render_pool import RenderPool

LOADER_KEYWORDS = ("device", "dtype", "trust_remote_code", "continuous_batching")  # `Serve`'s, for its ModelLoader


class KHAModelManager(ModelManager):
    """transformers' ModelManager, whose model (the one it was started with) is followed through a
    `generation.KHAEngineClient`."""

    def preload_engine(self, force_model: str, engine_connection: tuple | None) -> None:
        # As transformers 5.25.0's ModelManager.preload_engine, with kha serve's client of the model's process
        model_id = canonical_model_id(force_model)
        engine = KHAEngineClient(model_id, self.loader, self.generation_state, connection=engine_connection)
        self.engines[model_id] = engine
        if engine_connection is None:
            engine.start()


async def openai_error(_request, err: Exception):
    """ERR answered in OpenAI's error format (see `generation.engine_error`)."""
    return engine_error(err, in_model=False).response()


class KHAServe(Serve):
    """transformers' `Serve`, serving SERVED (a model id or folder, also named by ALIASES) under kha serve's LIMITS
    on a thread of its own: `kill_server()` stops it. Its uvicorn server (`server`), the thread (`thread`), the
    model in a process of its own (`model_manager`), the requests in flight (`kha_registry`: tests and monitoring
    read it) and the render workers (`renders`) are attributes. Other keywords: `Serve`'s."""

    def __init__(self, served: str, *, aliases: set[str], limits: ServeLimits, **kwargs) -> None:
        self.kha_aliases, self.kha_limits, self.kha_registry = aliases, limits, RequestRegistry()
        self.kha_loading = {key: kwargs[key] for key in LOADER_KEYWORDS if key in kwargs}  # for kha serve's loader
        super().__init__(served, **kwargs)  # runs `run`

    def run(self, socket=None, engine_connection: tuple | None = None) -> None:
        # As transformers 5.25.0's Serve.run, with kha serve's pieces (see the module doc), serving on a thread of its
        # own. Workaround: 5.25.0's Serve.__init__ takes no loader and builds a ModelLoader; kha serve's replaces it
        limits = self.kha_limits
        self.loader = KHAModelLoader(**self.kha_loading)
        manager = self.model_manager = KHAModelManager(
            self.loader, self.generation_state, force_model=self.force_model, engine_connection=engine_connection
        )
        try:
            # the render workers start once the server answers (`start_server`), or with the first render
            self.renders = RenderPool(manager.get_engine(None).processor, memory=limits.render_memory)
            shared = {"model_manager": manager, "generation_state": self.generation_state, "renders": self.renders}
            shared.update(limits=limits, registry=self.kha_registry, chat_template_kwargs=self.chat_template_kwargs)
            app = build_server(
                manager,
                KHAChatCompletionHandler(**shared),
                completion_handler=KHACompletionHandler(**shared),  # renders no template: its kwargs go unused
                response_handler=KHAResponseHandler(**shared),
                transcription_handler=None,  # not served: the guard answers their paths 404
                systemone_handler=None,
                enable_cors=self.enable_cors,
            )
            for error in (RequestError, ValueError, EngineDeadError, HTTPException, Exception):
                app.add_exception_handler(error, openai_error)
            app.add_middleware(
                ServeGuard,
                served=self.force_model,
                aliases=self.kha_aliases,
                limits=limits,
                registry=self.kha_registry,
                host=self.host,
                port=self.port,
            )

            async def stop_if_the_model_died() -> None:
                if manager.is_dead:
                    self.server.should_exit = True

            # uvicorn calls `callback_notify` on the event loop every `timeout_notify` seconds (as 5.25 asks)
            config = KHAUvicornConfig(
                app, host=self.host, port=self.port, log_level="info", callback_notify=stop_if_the_model_died,
                timeout_notify=5, read_timeout=limits.read_timeout, max_connections=limits.max_connections,
            )  # fmt: skip
            self.server = uvicorn.Server(config)
            sockets = None if socket is None else [socket]
            self.thread = threading.Thread(
                target=self.server.run, kwargs={"sockets": sockets}, name="kha-serve", daemon=True
            )
            self.thread.start()
        except BaseException:
            manager.shutdown()
            raise

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def kill_server(self, timeout: float = 10) -> None:
        """Stop serving (requests in flight end first, for TIMEOUT seconds at most) and the model's process."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)
        self.model_manager.shutdown()  # the app's shutdown did it already, unless it never ran
        self.renders.close()
