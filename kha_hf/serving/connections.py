"""Connection limits of `kha serve`, below the HTTP requests: read timeouts, idle sockets, a cap on connections.

transformers starts uvicorn with its defaults (5.25: `uvicorn.Config(app, host, port, log_level)` and a callback
that stops the server when the model's process died); kha serve builds that Config itself (`app.KHAServe.run`), as
`KHAUvicornConfig`. uvicorn (0.54, 0.55) offers:

- `timeout_keep_alive` (5 s): closes a connection idle *after* a response. Used as is.
- `h11_max_incomplete_event_size` (16 KiB): the most header bytes buffered before a 400. Set explicitly.
- `ws="none"`: no WebSocket upgrades (kha serve has no WebSocket endpoint).
- `http=`: the HTTP protocol class, here `GuardedH11Protocol`.
- `limit_concurrency`: not used. It accepts every socket and answers 503 only once a request on it is complete,
  so sockets that never finish a request still pile up (3,000 held at once in issue #28).

What uvicorn does not offer is a deadline for *receiving* a request: a socket that sends nothing, trickles its
headers a byte every few seconds, or never finishes its body stays open for ever (the keep-alive timer is armed
only after a response). `GuardedH11Protocol` subclasses uvicorn's h11 protocol to add, per connection:

- a read deadline: from the connection's start (or the first byte of its next request) the whole request,
  headers and body, must arrive within `read_timeout` seconds, else 408 and the socket is closed (an app waiting
  for the rest of the body sees a disconnect). It does not run while the server works on a complete request;
- a cap: a connection accepted while `max_connections` are open gets 503 and is closed at once.
"""

from __future__ import annotations

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .guard import MAX_HEADER_BYTES

TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
FULL_RESPONSE = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class OneFramingConnection(h11.Connection):
    """h11's Connection (h11 0.16) refusing a request that carries both Content-Length and Transfer-Encoding. h11
    reads such a body as chunked, as RFC 9112 allows; a proxy in front that reads it by its Content-Length would take
    the rest as a second request on the same connection (request smuggling). uvicorn answers the
    RemoteProtocolError with a 400 and closes the connection."""

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                raise h11.RemoteProtocolError(
                    "a request may not carry both Content-Length and Transfer-Encoding", error_status_hint=400
                )
        return event


class KHAUvicornConfig(uvicorn.Config):
    """uvicorn.Config with kha serve's connection limits (see the module doc)."""

    def __init__(self, app, *, read_timeout: float, max_connections: int, **kwargs) -> None:
        kwargs.update(http=GuardedH11Protocol, ws="none", h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        super().__init__(app, **kwargs)
        self.kha_read_timeout, self.kha_max_connections = read_timeout, max_connections


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read deadline per request and a cap on open connections (its limits: those of
    its `KHAUvicornConfig`)."""

    config: KHAUvicornConfig
    read_deadline = None  # asyncio.TimerHandle while a request is being received

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = OneFramingConnection(h11.SERVER, MAX_HEADER_BYTES)  # as uvicorn's, with KHAUvicornConfig's size

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.config.kha_max_connections:
            transport.write(FULL_RESPONSE)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.read_deadline is None and not self._request_received():
            self._arm()  # the first bytes of a request after a response
        super().data_received(data)
        if self._request_received():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request from buffered bytes
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.more_body:
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _request_received(self) -> bool:
        """Whether a complete request is in hand (the server is working on it, or answering)."""
        cycle = self.cycle
        return cycle is not None and not cycle.more_body and not cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self.read_deadline = self.loop.call_later(self.config.kha_read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _read_timed_out(self) -> None:
        self.read_deadline = None
        if self._request_received() or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:  # nothing answered yet
            self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()  # an app reading the body gets http.disconnect
