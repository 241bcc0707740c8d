"""What stands between a client and transformers' server under `kha serve`: one model, bounded requests.

transformers 5.24's server (`transformers serve`) is built for a trusted local user: `POST /load_model` loads any
folder or Hub id a client names (with the server's `trust_remote_code`), `POST /reset` unloads the pinned model, a
request may ask for any number of new tokens and any prompt length, and a non-streamed generation goes on after its
client has gone. `kha serve` keeps transformers' server and puts this ASGI middleware in front of it:

- **One model.** Only the generation endpoints, `/v1/models` and `/health` are reachable; everything else (model
  loading and unloading included) answers 403/404. A request's `model` may name the served model as the user typed
  it, by its absolute path or by its folder name; any other name answers 404 (the name is compared as text, never
  looked up on disk or on the Hub).
- **Bounded requests.** Bodies above `max_request_bytes` answer 413; `max_tokens` (and its aliases) must be an
  integer in [1, max_new_tokens]; fields transformers would turn into a 500 (a non-numeric temperature, messages
  that are not a list of role/content objects...) answer 400 in OpenAI's error format; `generation_config` (which
  would bypass every limit) is refused. Prompt length against the model's context is checked where the prompt is
  tokenised (`generation.py`).
- **Disconnects stop work.** Each request gets a fresh X-Request-ID; when its client disconnects, the request's
  generation is cancelled (`RequestRegistry`), streamed or not.
- **Health that tells the truth.** `/health` answers 503 while a generation has been running longer than its time
  limit allows (it is stuck), otherwise transformers' own answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
READ_PATHS = ("/health", "/v1/models")
REFUSED_PATHS = ("/load_model", "/reset")
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
REQUEST_ID_HEADER = b"x-request-id"


@dataclass
class ServeLimits:
    """Limits of one `kha serve` process (documented in `kha serve --help`)."""

    max_new_tokens: int = 1024  # largest max_tokens a request may ask for; also the default when it names none
    request_timeout: float = 300.0  # seconds one generation may run (transformers' max_time)
    max_request_bytes: int = 1 << 20  # largest request body


@dataclass
class RequestRegistry:
    """Requests in flight: how to cancel each one, and when each generation started (for /health)."""

    cancellers: dict[str, list[Callable[[], None]]] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    running: dict[int, float] = field(default_factory=dict)  # generation token -> start time (monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_cancel(self, request_id: str, cancel: Callable[[], None]) -> None:
        """Call CANCEL when REQUEST_ID's client disconnects (at once if it already has)."""
        with self.lock:
            if request_id in self.cancelled:
                already = True
            else:
                self.cancellers.setdefault(request_id, []).append(cancel)
                already = False
        if already:
            cancel()

    def cancel(self, request_id: str) -> None:
        with self.lock:
            self.cancelled.add(request_id)
            cancels = self.cancellers.pop(request_id, [])
        for cancel in cancels:
            cancel()

    def finish(self, request_id: str) -> None:
        with self.lock:
            self.cancellers.pop(request_id, None)
            self.cancelled.discard(request_id)

    def track(self, fn: Callable) -> Callable:
        """FN wrapped so that its run counts as a generation in flight."""

        def tracked(*args, **kwargs):
            token = id(tracked)
            with self.lock:
                self.running[token] = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.running.pop(token, None)

        return tracked

    def longest_running(self) -> float:
        """Seconds the oldest generation in flight has been running (0 when none)."""
        with self.lock:
            starts = list(self.running.values())
        return time.monotonic() - min(starts) if starts else 0.0


class RequestError(Exception):
    """A request the guard answers itself, in OpenAI's error format."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> bytes:
        error = {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()


def model_aliases(typed: str, served: str) -> set[str]:
    """Names a client may use for the served model: as typed, as served (absolute path), the folder's name."""
    names = {typed, served, typed.rstrip("/"), os.path.basename(served.rstrip("/"))}
    return {name for name in names if name}


class ServeGuard:
    """ASGI middleware; `app` is transformers' FastAPI application."""

    def __init__(self, app, served: str, aliases: set[str], limits: ServeLimits, registry: RequestRegistry) -> None:
        self.app = app
        self.served = served
        self.aliases = aliases
        self.limits = limits
        self.registry = registry
        self.cwd = os.getcwd()  # a relative name in a request means what it meant where the server started

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # lifespan events
            return
        path, method = scope["path"].rstrip("/") or "/", scope["method"]
        try:
            if path == "/health" and method == "GET":
                stuck = self.registry.longest_running()
                if stuck > self.limits.request_timeout + 30:
                    raise RequestError(503, f"a generation has been running for {stuck:.0f} s: the server is stuck")
            if path in READ_PATHS and method in ("GET", "OPTIONS", "HEAD"):
                await self.app(scope, receive, send)
                return
            if path in REFUSED_PATHS:
                raise RequestError(403, f"kha serve serves {self.served} only; it does not load or unload models")
            if path not in GENERATION_PATHS:
                raise RequestError(404, f"no such endpoint {path}; kha serve answers {', '.join(GENERATION_PATHS)}")
            if method != "POST":
                raise RequestError(405, f"{path} takes POST requests")
            body = await self._read_body(scope, receive)
        except RequestError as err:
            await _answer(send, err)
            return
        await self._generate(scope, receive, send, body)

    async def _read_body(self, scope, receive) -> bytes:
        limit = self.limits.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(413, f"request body of {int(declared)} bytes; the limit is {limit}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestError(400, "the client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"request body over {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _generate(self, scope, receive, send, raw: bytes) -> None:
        try:
            body = self.checked_body(raw, scope["path"].rstrip("/"))
        except RequestError as err:
            await _answer(send, err)
            return
        data = json.dumps(body).encode()
        request_id = uuid.uuid4().hex
        headers = [(k, v) for k, v in scope["headers"] if k not in (REQUEST_ID_HEADER, b"content-length")]
        headers += [(REQUEST_ID_HEADER, request_id.encode()), (b"content-length", str(len(data)).encode())]
        scope = {**scope, "headers": headers}

        disconnected = asyncio.Event()
        delivered = False

        async def app_receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": data, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
            self.registry.cancel(request_id)  # stops the generation, streamed or not

        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, app_receive, send)
        finally:
            watcher.cancel()
            self.registry.finish(request_id)

    def checked_body(self, raw: bytes, path: str) -> dict:
        """The request body, validated, with `model` set to the served name; RequestError otherwise."""
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, UnicodeDecodeError):
            raise RequestError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        requested = body.get("model")
        if requested is not None:
            if not isinstance(requested, str) or not self._names_served_model(requested):
                raise RequestError(
                    404,
                    f"model {requested!r} is not served here; this server serves {self.served}",
                    "model",
                    "model_not_found",
                )
        body["model"] = self.served
        if "generation_config" in body:
            raise RequestError(
                400,
                "generation_config is not accepted by kha serve: use max_tokens, temperature, top_p, seed",
                "generation_config",
            )
        for name in TOKEN_FIELDS:
            if body.get(name) is not None:
                value = body[name]
                if not _is_int(value) or not 1 <= value <= self.limits.max_new_tokens:
                    raise RequestError(
                        400,
                        f"{name} must be an integer from 1 to {self.limits.max_new_tokens} (this server's "
                        f"--max-new-tokens), got {value!r}",
                        name,
                    )
        _check_number(body, "temperature", 0.0, 2.0, low_open=False)
        _check_number(body, "top_p", 0.0, 1.0, low_open=True)
        if body.get("seed") is not None and not _is_int(body["seed"]):
            raise RequestError(400, f"seed must be an integer, got {body['seed']!r}", "seed")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise RequestError(400, f"stream must be true or false, got {body['stream']!r}", "stream")
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, str) and not _list_of(stop, str):
            raise RequestError(400, "stop must be a string or a list of strings", "stop")
        if path == "/v1/chat/completions":
            _check_messages(body.get("messages"))
        elif path == "/v1/completions" and not isinstance(body.get("prompt"), str):
            raise RequestError(400, "prompt must be a string", "prompt")
        elif path == "/v1/responses" and not isinstance(body.get("input"), (str, list)):
            raise RequestError(400, "input must be a string or a list of input items", "input")
        return body

    def _names_served_model(self, name: str) -> bool:
        if name in self.aliases:
            return True
        # the same path written differently (./x, x/, an absolute path): compared as text, the disk is not read
        return os.path.normpath(os.path.join(self.cwd, name)) == os.path.normpath(self.served)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list_of(value, kind) -> bool:
    return isinstance(value, list) and all(isinstance(item, kind) for item in value)


def _check_number(body: dict, name: str, low: float, high: float, low_open: bool) -> None:
    value = body.get(name)
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise RequestError(400, f"{name} must be a number in {bound}, got {value!r}", name)


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        ok = isinstance(message, dict) and isinstance(message.get("role"), str)
        ok = ok and (content is None or isinstance(content, str) or _list_of(content, dict))
        if ok and isinstance(content, list):  # content parts: {"type": "text", "text": "..."}, images...
            ok = all(
                isinstance(part.get("type"), str)
                and (part["type"] not in ("text", "input_text", "output_text") or isinstance(part.get("text"), str))
                for part in content
            )
        if not ok:
            raise RequestError(
                400, f"messages[{i}] must be an object with a string role and a string or list content", "messages"
            )


async def _answer(send, err: RequestError) -> None:
    body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
