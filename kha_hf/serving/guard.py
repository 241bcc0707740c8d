"""What stands between a client and transformers' server under `kha serve`: one model, bounded requests.

transformers' server (`transformers serve`, 5.24 and 5.25) is built for a trusted local user: `POST /load_model`
loads any folder or Hub id a client names (with the server's `trust_remote_code`), `POST /reset` unloads the pinned
model, a request may ask for any number of new tokens and any prompt length, and (5.24) a non-streamed generation
goes on after its client has gone. `kha serve` keeps transformers' server and puts this ASGI middleware in front of
it:

- **One model.** Only the generation endpoints, `/v1/models` and `/health` are reachable; everything else (model
  loading and unloading included) answers 403/404. A request's `model` may name the served model as the user typed
  it, by its absolute path or by its folder name; any other name answers 404 (the name is compared as text, never
  looked up on disk or on the Hub).
- **Only what it supports.** Bodies above `max_request_bytes` answer 413; every field of a generation request is
  checked against its endpoint's allowlist (`fields.py`: type, range, size, nesting), and anything else answers
  400 in OpenAI's error format, naming the field. `max_tokens` (and its aliases) must be an integer in
  [1, max_new_tokens]. What depends on the loaded model (prompt length against the context, token ids of
  `logit_bias`, sampling settings under continuous batching) is checked by the handlers (`handlers.py`).
- **Not a web page's.** On a loopback address only loopback Host headers are answered (421 otherwise: DNS
  rebinding), and a generation request's body must be declared `application/json` (415 otherwise: a page may send
  text/plain or a form to the loopback server without a preflight, CSRF).
- **Disconnects stop work.** Each request gets a fresh X-Request-ID; when its client disconnects, the request's
  generation is cancelled (`RequestRegistry`), streamed or not (5.25's own `CancelOnDisconnect` cancels it as well;
  the guard's stays, as the one that does not depend on transformers' release).
- **Health that tells the truth.** `/health` answers 503 while a generation (or a prompt's rendering) has been
  running longer than its time limit allows (it is stuck), otherwise transformers' own answer.

Connections (read timeouts, a cap on open sockets) are bounded below this, in the HTTP protocol (`connections.py`).
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

from .errors import RequestError
from .fields import checked_fields

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
READ_PATHS = ("/health", "/v1/models")
REFUSED_PATHS = ("/load_model", "/reset")
REQUEST_ID_HEADER = b"x-request-id"
MAX_HEADER_BYTES = 16 * 1024  # request headers (uvicorn buffers no more: `connections.KHAUvicornConfig`)


@dataclass
class ServeLimits:
    """Limits of one `kha serve` process (documented in `kha serve --help`)."""

    max_new_tokens: int = 1024  # largest max_tokens a request may ask for; also the default when it names none
    request_timeout: float = 300.0  # seconds one generation may run (transformers' max_time)
    max_request_bytes: int = 1 << 20  # largest request body
    read_timeout: float = 30.0  # seconds a client has to send a request's headers and body
    max_connections: int = 64  # open client connections; more are answered 503 and closed at once
    images: bool = False  # chat messages may carry images (set for a multimodal model with its processor)
    render_memory: int = 1 << 30  # bytes one prompt's render may take (its worker's address space beyond its own)


@dataclass
class RequestRegistry:
    """Requests in flight: how to cancel each one, and when each generation started (for /health)."""

    cancellers: dict[str, list[Callable[[], None]]] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    running: dict[int, float] = field(default_factory=dict)  # generation token -> start time (monotonic)
    lingering: dict[int, Callable[[], bool]] = field(default_factory=dict)  # cancelled, not yet gone
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_cancel(self, request_id: str, cancel: Callable[[], None]) -> None:
        """Call CANCEL when REQUEST_ID's client disconnects (at once if it already has)."""
        with self.lock:
            already = request_id in self.cancelled
            if not already:
                self.cancellers.setdefault(request_id, []).append(cancel)
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

    def begin(self, key: object) -> None:
        """A generation run elsewhere (continuous batching's thread) starts: it counts until `end(KEY)`."""
        with self.lock:
            self.running[id(key)] = time.monotonic()

    def end(self, key: object, still_running: Callable[[], bool] | None = None) -> None:
        """KEY's generation is over, or, with STILL_RUNNING, over once STILL_RUNNING() says False (a cancelled
        request leaves continuous batching's scheduler only when its loop next runs: a loop that never does is
        a stuck server)."""
        with self.lock:
            if still_running is None:
                self.running.pop(id(key), None)
                self.lingering.pop(id(key), None)
            elif id(key) in self.running:
                self.lingering[id(key)] = still_running

    def longest_running(self) -> float:
        """Seconds the oldest generation in flight has been running (0 when none)."""
        with self.lock:
            for token, still_running in list(self.lingering.items()):
                if not still_running():
                    del self.lingering[token]
                    self.running.pop(token, None)
            starts = list(self.running.values())
        return time.monotonic() - min(starts) if starts else 0.0


def model_aliases(typed: str, served: str) -> set[str]:
    """Names a client may use for the served model: as typed, as served (absolute path), the folder's name."""
    names = {typed, served, typed.rstrip("/"), os.path.basename(served.rstrip("/"))}
    return {name for name in names if name}


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def allowed_host_headers(host: str | None, port: int | None) -> set[bytes] | None:
    """The Host headers a server bound to HOST:PORT answers: on a loopback address, its loopback names (alone or with
    PORT), so that a web page whose name was rebound to 127.0.0.1 (DNS rebinding) cannot read its answers; None (any
    Host) when it is bound to another address (0.0.0.0, a LAN address: reached under names kha serve cannot know)."""
    if host is None or not (host.strip("[]") in LOOPBACK_NAMES or host.startswith("127.")):
        return None
    names = {"127.0.0.1", "localhost", "[::1]", host if ":" not in host else f"[{host.strip('[]')}]"}
    allowed = names | {f"{name}:{port}" for name in names if port is not None}
    return {name.encode() for name in allowed}


@dataclass(eq=False)  # compared and hashed as itself, as the middleware object it is
class ServeGuard:
    """ASGI middleware; `app` is transformers' FastAPI application. HOST, PORT: the address the server is bound to
    (its Host headers are checked on a loopback one, `allowed_host_headers`); None: any Host."""

    app: Callable
    served: str
    aliases: set[str]
    limits: ServeLimits
    registry: RequestRegistry
    host: str | None = None
    port: int | None = None

    def __post_init__(self) -> None:
        self.allowed_hosts = allowed_host_headers(self.host, self.port)
        self.cwd = os.getcwd()  # a relative name in a request means what it meant where the server started

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # lifespan events
            return
        path, method = scope["path"].rstrip("/") or "/", scope["method"]
        if path != scope["path"]:  # the app sees the path the guard checked (FastAPI would redirect `x/` with a 307)
            scope = {**scope, "path": path, "raw_path": path.encode("latin-1", "replace")}
        if method == "HEAD":
            send = _without_body(send)  # a HEAD answer carries no body, whatever its status (RFC 9110 9.3.2)
        try:
            header_bytes = sum(len(name) + len(value) for name, value in scope["headers"])
            if header_bytes > MAX_HEADER_BYTES:  # uvicorn caps only headers still arriving, not a block read at once
                raise RequestError(431, f"request headers of {header_bytes} bytes; the limit is {MAX_HEADER_BYTES}")
            headers = dict(scope["headers"])
            if self.allowed_hosts is not None and (headers.get(b"host") or b"").lower() not in self.allowed_hosts:
                # DNS rebinding: a page whose name now points at 127.0.0.1 would read the answers
                shown = (headers.get(b"host") or b"").decode("latin-1")[:100]
                raise RequestError(421, f"Host {shown!r} is not this server's: it answers its loopback address only")
            if path == "/health" and method in ("GET", "HEAD"):
                stuck = self.registry.longest_running()
                if stuck > self.limits.request_timeout + 30:
                    raise RequestError(503, f"a generation has been running for {stuck:.0f} s: the server is stuck")
            if path in READ_PATHS and method in ("GET", "HEAD", "OPTIONS"):
                # transformers' FastAPI routes take GET only and answer HEAD with 405 (transformers 5.24, 5.25); load
                # balancers probe with HEAD, which is GET without the body
                await self.app({**scope, "method": "GET" if method == "HEAD" else method}, receive, send)
                return
            if path in REFUSED_PATHS:
                raise RequestError(403, f"kha serve serves {self.served} only; it does not load or unload models")
            if path not in GENERATION_PATHS:
                raise RequestError(404, f"no such endpoint {path}; kha serve answers {', '.join(GENERATION_PATHS)}")
            if method != "POST":
                raise RequestError(405, f"{path} takes POST requests")
            if (headers.get(b"content-type") or b"").split(b";")[0].strip().lower() != b"application/json":
                # a web page may POST text/plain or a form to the loopback server without asking (CSRF); JSON it may
                # send only after a preflight (OPTIONS), which these paths refuse
                raise RequestError(415, f"{path} takes a JSON body: send Content-Type: application/json")
            body = self.checked_body(await self._read_body(scope, receive), path)
        except RequestError as err:
            await err.response()(scope, receive, send)
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

    async def _generate(self, scope, receive, send, body: dict) -> None:
        data = json.dumps(body).encode()
        request_id = uuid.uuid4().hex
        # the body passed on is the checked JSON (its content type was checked: application/json, maybe a charset)
        replaced = {
            REQUEST_ID_HEADER: request_id.encode(),
            b"content-length": str(len(data)).encode(),
            b"content-type": b"application/json",
        }
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k not in replaced] + [*replaced.items()]}

        disconnected = asyncio.Event()
        undelivered = [{"type": "http.request", "body": data, "more_body": False}]

        async def app_receive():
            if undelivered:
                return undelivered.pop()
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
        """The request body, validated against PATH's allowlist, with `model` set to the served name;
        RequestError otherwise."""
        try:
            body = json.loads(raw or b"{}", parse_constant=_finite_float, parse_float=_finite_float)
        except RecursionError:  # C json raises it past ~1,000 levels; nothing deep reaches transformers
            raise RequestError(400, "the request body is nested too deeply") from None
        except (ValueError, UnicodeDecodeError):
            raise RequestError(400, "the request body is not valid JSON (numbers must be finite)") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        requested = body.get("model")
        if requested is not None and not (isinstance(requested, str) and self._names_served_model(requested)):
            shown = repr(requested) if len(repr(requested)) <= 200 else repr(requested)[:197] + "..."
            raise RequestError(
                404, f"model {shown} is not served here; this server serves {self.served}", "model", "model_not_found"
            )
        body = checked_fields(body, path, self.limits.max_new_tokens, self.limits.images)
        body["model"] = self.served
        return body

    def _names_served_model(self, name: str) -> bool:
        if name in self.aliases:
            return True
        # the same path written differently (./x, x/, an absolute path): compared as text, the disk is not read
        return os.path.normpath(os.path.join(self.cwd, name)) == os.path.normpath(self.served)


def _finite_float(text: str) -> float:
    """TEXT, a JSON number or a constant Python's json accepts (NaN, Infinity), as a finite float; else ValueError."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _without_body(send):
    """SEND, passing every response's start (status, headers: content-length stays the GET's) and no body bytes."""

    async def send_head(message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_head
