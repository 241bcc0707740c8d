"""transformers' model client (`EngineClient`) with the limits of `kha serve`: context, new tokens, time, disconnects.

transformers 5.25 runs the model in a process of its own (its engine, see `engine.py`); the API server sends it each
request through an `EngineClient`, and a request whose handler is cancelled is cancelled there too. What 5.25 does
not do, kha serve adds here, in the API server, per request:

- the prompt must fit the model's context, else 400 in OpenAI's format (5.25 checks it too, `_check_prompt_length`,
  but answers `{"detail": ...}`); max_new_tokens is cut to --max-new-tokens and to what the context leaves (5.25
  asks for at least 1024 whatever the context), and under continuous batching to what its paged KV cache holds (a
  longer request still kills 5.25's batch loop for every client);
- a time limit (5.25 has none): the request's budget (--request-timeout less the time its prompt took to render),
  counted from its submission (time queued behind other requests counts), after which the request is cancelled in
  the model's process; it answers with the tokens made so far and finish_reason "length". One that has made no
  token by then gets FIRST_TOKEN_GRACE seconds more for its first (it may have reached the model just before), else
  answers 503 (its time ran out while it waited for the model);
- cancellation when the client disconnects: 5.25's own `CancelOnDisconnect` cancels the handler, and kha's guard
  cancels through `RequestRegistry` too;
- each generation is tracked for /health from its submission until the model's process has let it go: a request
  cancelled (by its time limit or its client) counts until the model's process shows it dropped it
  (`engine.engine_request_gone`), so a generation that never stops makes /health answer 503;
- an error inside the model answers 500 in OpenAI's format (5.25 answers a ValueError raised by `generate` as the
  client's 400 `{"detail": ...}`: kha serve has checked every field before, so what fails in the model is the
  server's).

Every request's tokens stream from the model's process, a non-streamed one's too, so that one cut by its time limit
still answers with what it made. `KHAEngineClient` is transformers' client of the model's process; the handlers
(`handlers.py`) hand transformers' response builders a `Generation`, that client bound to one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import cached_property

from starlette.exceptions import HTTPException
from transformers.cli.serving.model_manager import EngineClient
from transformers.cli.serving.utils import Detokenizer, EngineDeadError, Modality, _StreamError, prompt_length

from .engine import engine_cb_info, engine_request_gone
from .errors import RequestError
from .guard import RequestRegistry, ServeLimits

logger = logging.getLogger("kha_hf.serving")

CACHE_WHAT = "continuous batching's KV cache (--cb-num-blocks)"
WAITED = "the server was busy for this request's whole --request-timeout; retry later"
GONE_POLL_SECONDS = 0.5
WATCHERS: set[asyncio.Task] = set()  # `Generation._linger`'s tasks, kept until they end (the loop keeps weak ones)
# A request whose time runs out before its first token gets this long to make one (it may have started just
# before: transformers 5.24, where kha serve's limit was a stopping criterion, stopped it after its first token),
# else 503
FIRST_TOKEN_GRACE = 2.0


def model_context(config) -> int | None:
    """The number of positions the model of CONFIG was built for, or None when its config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def fit_request(
    config, prompt: int, asked: int | None, generation_kwargs: dict, limits: ServeLimits, cache_tokens=None
) -> None:
    """Set GENERATION_KWARGS' max_new_tokens: ASKED (the request's max_tokens, or None), cut to the limits; HTTP 400
    when the PROMPT tokens alone do not fit the context (or, under continuous batching, the CACHE_TOKENS its paged
    cache holds)."""
    allowed = limits.max_new_tokens
    for context, what in ((model_context(config), "this model's context"), (cache_tokens, CACHE_WHAT)):
        if context is None:
            continue
        if prompt >= context:
            raise RequestError(400, f"the prompt has {prompt} tokens; {what} is {context} tokens")
        allowed = min(allowed, context - prompt)
    generation_kwargs["max_new_tokens"] = min(asked or allowed, allowed)


def engine_error(err: BaseException, in_model: bool = True) -> RequestError:
    """ERR in OpenAI's error format, for the model's process failing a request and for the app's exception handlers
    (`app.KHAServe.run`): kha serve's own refusals as they are, transformers' EngineDeadError a 503, FastAPI's
    HTTPException (`{"detail"}`) with its status, a ValueError a 400 when transformers raised it in the API server
    (the request's fault, `{"detail"}` in 5.25; not IN_MODEL), anything else a 500 (logged here)."""
    if isinstance(err, RequestError):
        return err
    if isinstance(err, EngineDeadError):
        return RequestError(503, f"the model's process died: {err}"[:300], kind="server_error")
    if isinstance(err, HTTPException):
        kind = "server_error" if err.status_code >= 500 else "invalid_request_error"
        return RequestError(err.status_code, str(err.detail)[:1000], kind=kind)
    if isinstance(err, ValueError) and not in_model:
        return RequestError(400, str(err)[:1000])
    logger.error("kha serve: the model failed on a request: %s: %s", type(err).__name__, err)
    return RequestError(500, "the model failed on this request (see the server log)", kind="server_error")


class Generation:
    """One request's generation in the model's process, as the API server follows it: ENGINE bound to the request
    (its id, its DEADLINE in time.monotonic(), tracked in REGISTRY), whose `generate_streaming` /
    `generate_non_streaming` transformers' response builders call; the rest is ENGINE's. Followed here: its tokens as
    they come (transformers' EngineClient calls `put_token`), its time limit, its cancellation, its tracking for
    /health. `on_token(token)` gets each token; `on_end(outcome)` runs once, `outcome` being "done", "cut" (its time
    ran out), "cancelled" (its client left) or the error that failed it; so is `outcome`, a future."""

    on_token: Callable[[int], None] | None = None
    on_end: Callable[[object], None] | None = None
    task: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None

    def __init__(self, engine: KHAEngineClient, request_id: str, deadline: float, registry: RequestRegistry) -> None:
        self.engine, self.request_id, self.deadline, self.registry = engine, request_id, deadline, registry
        self.tokens: list[int] = []
        self.over = False
        self.outcome: asyncio.Future = asyncio.get_running_loop().create_future()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def start(self, inputs: dict, generation_kwargs: dict, on_token=None, on_end=None) -> None:
        """Send the request (its tokens streamed here), to be cut at the deadline."""
        budget = self.deadline - time.monotonic()
        if budget <= 0:
            raise RequestError(503, WAITED, kind="server_error")
        self.on_token, self.on_end = on_token, on_end
        loop = asyncio.get_running_loop()
        self.registry.begin(self)
        # copies: the requests queue pickles its items later, in its feeder thread
        args = (dict(inputs), dict(generation_kwargs))
        self.task = asyncio.ensure_future(self.engine._send_request("generate", args=args, streamer=self))
        self.task.add_done_callback(self._ended)
        self.timer = loop.call_later(budget, self._time_up)
        self.registry.on_cancel(self.request_id, lambda: loop.call_soon_threadsafe(self.stop, False))

    def put_token(self, token: int) -> None:
        if self.over:
            return  # cut or cancelled: what still arrives is nobody's
        self.tokens.append(token)
        if self.on_token is not None:
            self.on_token(token)
        if self.overdue:
            self.stop(True)

    overdue = False  # its time ran out before its first token

    def _time_up(self) -> None:
        if self.tokens or self.overdue:
            self.stop(True)
            return
        self.overdue = True
        self.timer = asyncio.get_running_loop().call_later(FIRST_TOKEN_GRACE, self.stop, True)

    def stop(self, time_up: bool) -> None:
        """Cancel the request in the model's process: its time ran out (TIME_UP) or its client left."""
        if self.over or self.task is None:
            return
        if self.task.done():  # it ended; its callback has not run yet
            self._ended(self.task)
            return
        self.over = True
        self.timer.cancel()
        pending = list(self.engine.pending_requests.items())
        engine_id = next((key for key, (_, streamer) in pending if streamer is self), None)
        self.task.cancel()  # transformers' client then sends the model's process a "cancel"
        self._linger(engine_id)
        self._resolve("cut" if time_up else "cancelled")

    def _ended(self, task: asyncio.Task) -> None:
        if self.over:
            return
        self.over = True
        self.timer.cancel()
        self.registry.end(self)
        error = None if task.cancelled() else task.exception()
        self._resolve("cancelled" if task.cancelled() else error if error is not None else "done")

    def _resolve(self, outcome) -> None:
        if not self.outcome.done():
            self.outcome.set_result(outcome)  # an error as a result: nobody may be left to retrieve it
        if self.on_end is not None:
            self.on_end(outcome)

    def _linger(self, engine_id: int | None) -> None:
        """The generation counts as running until the model's process shows it has dropped the request."""
        if engine_id is None:  # it never reached the model's process (or has left it)
            self.registry.end(self)
            return
        gone = False

        async def watch() -> None:
            nonlocal gone
            with contextlib.suppress(Exception):  # the model's process failed or stopped: nothing of the request runs
                while not await self.engine.submit(engine_request_gone, str(engine_id)):
                    await asyncio.sleep(GONE_POLL_SECONDS)
            gone = True

        self.registry.end(self, still_running=lambda: not gone)
        watcher = asyncio.ensure_future(watch())
        WATCHERS.add(watcher)
        watcher.add_done_callback(WATCHERS.discard)

    def _failure(self, outcome, generation_kwargs: dict) -> RequestError | None:
        """What OUTCOME answers in place of the tokens made (None: they are the answer). A generation cut by its time
        limit has max_new_tokens (of this request's own settings) set to the tokens it made: transformers' response
        builders then report finish_reason "length"."""
        if isinstance(outcome, BaseException):
            return engine_error(outcome)
        if outcome == "cancelled":
            return RequestError(499, "the client disconnected")
        if outcome == "cut":
            if not self.tokens:
                return RequestError(503, WAITED, kind="server_error")
            generation_kwargs["max_new_tokens"] = len(self.tokens)
        return None

    def generate_streaming(self, inputs: dict, generation_kwargs: dict, response_parser=None):
        """As transformers' `EngineClient.generate_streaming`: (the queue of the answer's items, its streamer)."""
        queue: asyncio.Queue = asyncio.Queue()
        processor = self.engine.processor
        streamer = Stream(getattr(processor, "tokenizer", processor)._tokenizer, queue, response_parser=response_parser)

        def ended(outcome) -> None:
            failure = None if outcome == "cancelled" else self._failure(outcome, generation_kwargs)
            if failure is None:
                streamer.end()  # the stream ends with its finish_reason (and usage)
            else:
                queue.put_nowait(_StreamError(failure.message))

        streamer.generation = self
        self.start(inputs, generation_kwargs, streamer.put_token, ended)
        return queue, streamer

    async def generate_non_streaming(self, inputs: dict, generation_kwargs: dict) -> tuple[str, int, list[int]]:
        """As transformers' `EngineClient.generate_non_streaming`: (the text, the prompt's length, the tokens)."""
        self.start(inputs, generation_kwargs)
        try:
            outcome = await asyncio.shield(self.outcome)
        except asyncio.CancelledError:  # the handler is cancelled: its client left
            self.stop(False)
            raise
        failure = self._failure(outcome, generation_kwargs)
        if failure is not None:
            raise failure
        ids = list(self.tokens)
        text = self.engine.processor.decode(ids, skip_special_tokens=True)
        return text, prompt_length(inputs), ids


class Stream(Detokenizer):
    """transformers' Detokenizer of a streamed request, whose `cancel` (the client left) stops its `Generation`."""

    generation: Generation

    def cancel(self) -> None:
        self.generation.stop(False)


class KHAEngineClient(EngineClient):
    """transformers' client of the model's process, bound to each request by a `Generation` (see the module doc).
    Also reads a multimodal KHA checkpoint's modality: transformers 5.25 reads it from the class name, which for KHA
    is KHA<family class>, unknown to its tables."""

    kha_cb: asyncio.Task | None = None  # continuous batching's numbers, asked once (`cb_info`)

    @cached_property
    def modality(self) -> Modality:
        config = self.model_config
        if getattr(config, "model_type", None) == "kha" and getattr(config, "is_multimodal", False):
            if hasattr(self.processor, "image_processor"):
                return Modality.VLM  # else a tokenizer alone (no processor files): text only, as transformers
        return EngineClient.modality.func(self)

    async def cb_info(self) -> dict:
        """Continuous batching's numbers (`engine.engine_cb_info`), asked of the model's process once."""
        if self.kha_cb is None:
            self.kha_cb = asyncio.ensure_future(self.submit(engine_cb_info))
        return await asyncio.shield(self.kha_cb) or {}
