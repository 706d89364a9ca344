"""The transport guard: what uvicorn's protocols leave unbounded, bounded before the app runs.

uvicorn (0.54, httptools) arms no timer until a first response is done, and any byte that
arrives disarms its keep-alive timer, so a client that trickles a header line now and then
holds its socket forever (slowloris); `limit_concurrency` answers 503 only once a request's
headers are complete, so such sockets are never refused either. Here, per connection:

- a request (request line, headers, body) must arrive whole within `request_timeout_s` of
  its first byte, and a new connection must start its first one within `request_timeout_s`
  of the connect, or the transport is dropped (aborted: a client that does not read must
  not keep it either);
- the request line and headers may take `max_header_bytes`; past that, 431 and dropped;
- with `max_connections` connections open (WebSockets included), one more is answered 503
  at once, before it sends anything, and closed.

WebSockets:
- uvicorn parses all of one read (256 KiB) at once and queues every message in it: 32k
  two-byte messages, or 40k one-byte fragments, stall the loop 0.2-0.3 s, before any rate
  limit sees them. Here at most `PARSE_SLICE_BYTES` are parsed per loop callback, and the
  next slice only once the app has taken every message of the last, so a flood is parsed
  no faster than the app reads it, and not at all once the app has stopped reading.
- Control and continuation frames never reach the app (a message of 1-byte fragments is
  560k frames), and uvicorn answers every ping with a pong written past any flow control:
  pings, pongs and continuations take from a bucket of their own (`pings_per_s`,
  `ping_burst`); one past it, or a pong onto `MAX_WRITE_BACKLOG_BYTES` of unsent output (a
  client that pings but does not read), drops the transport.
- The ASGI extension `ABORT_EXTENSION`, `{"abort": callable}`, drops the transport at once:
  uvicorn's close waits for the socket to drain, so a close frame to a client that does
  not read would otherwise hold the socket open for good.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from metronome.serve import protocol as p
from metronome.serve.rate_limit import TokenBucket

ABORT_EXTENSION = "metronome.transport.abort"
MAX_WRITE_BACKLOG_BYTES = 1 << 20  # unsent output a pong may not add to
PARSE_SLICE_BYTES = 16 << 10  # ~13 ms of parsing for the worst frames (2-byte messages)


@dataclass(frozen=True)
class TransportLimits:
    request_timeout_s: float
    max_header_bytes: int
    max_connections: int
    pings_per_s: float  # WebSocket pings, pongs and continuation frames, per connection
    ping_burst: int


def _response(status_line: str, code: p.ErrorCode, message: str) -> bytes:
    error = p.ErrorDetail(type=p.ErrorType.SERVER, code=code, message=message)
    body = json.dumps({"error": error.model_dump(mode="json")}).encode()
    head = (f"HTTP/1.1 {status_line}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request timer, header cap and connection cap."""

    def __init__(self, *args, limits: TransportLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._request_timer: asyncio.TimerHandle | None = None
        self._reading_headers = True  # until a request's headers are complete
        self._header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport  # for connection_lost; never counted as open
            transport.write(_response("503 Service Unavailable", p.ErrorCode.AT_CAPACITY,
                                      f"{self.limits.max_connections} connections are open; "
                                      "retry later"))
            transport.close()
            return
        super().connection_made(transport)
        self._arm_request_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_request_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        super().data_received(data)
        if self._reading_headers and not self.transport.is_closing():
            self._header_bytes += len(data)  # all of it is request line and headers so far
            if self._header_bytes > self.limits.max_header_bytes:
                self.transport.write(_response(
                    "431 Request Header Fields Too Large", p.ErrorCode.MESSAGE_TOO_LARGE,
                    f"request line and headers exceed {self.limits.max_header_bytes} bytes"))
                self.transport.abort()

    # ---- parser callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        self._header_bytes = 0
        self._arm_request_timer()

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        super().on_headers_complete()
        if self.parser.should_upgrade() and self._should_upgrade():  # a WebSocket: its
            # protocol takes the transport over
            self._disarm_request_timer()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm_request_timer()

    # ---- the request timer -------------------------------------------------------------------
    def _arm_request_timer(self) -> None:
        if self._request_timer is None:  # a request still on its way keeps its deadline
            self._request_timer = self.loop.call_later(self.limits.request_timeout_s,
                                                       self._on_request_timeout)

    def _disarm_request_timer(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _on_request_timeout(self) -> None:
        self._request_timer = None
        self.transport.abort()


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, with `ABORT_EXTENSION` in the scope and pings bounded."""

    def __init__(self, *args, limits: TransportLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pings = TokenBucket.full(limits.pings_per_s, limits.ping_burst, self.loop.time())
        self._unparsed = bytearray()  # received, not yet parsed: about a slice and a read
        self._slice_scheduled = False

    # ---- parsing in slices ---------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._unparsed += data
        if len(self._unparsed) > PARSE_SLICE_BYTES:
            self.transport.pause_reading()  # idempotent; resumed once the backlog is parsed
        if len(self._unparsed) <= PARSE_SLICE_BYTES and self._app_took_everything():
            self._parse_slice()  # the usual case, at once: a message or so per read
        else:
            self._parse_when_due()

    async def receive(self):
        message = await super().receive()
        self._parse_when_due()
        return message

    def _app_took_everything(self) -> bool:
        # past the app's close, uvicorn discards messages instead of queueing them, and the
        # queued `websocket.disconnect` is never taken: parse on, or the client's close reply
        # waits for uvicorn's 10 s close timer (and holds the connection slot that long)
        return not self._slice_scheduled and (self.close_sent or self.queue.empty())

    def _parse_when_due(self) -> None:
        """The next slice, after the loop's other callbacks, once the app took the last."""
        if self._unparsed and self._app_took_everything():
            self._slice_scheduled = True
            self.loop.call_soon(self._parse_slice)

    def _parse_slice(self) -> None:
        self._slice_scheduled = False
        if self.transport.is_closing():
            self._unparsed.clear()
            return
        data = bytes(self._unparsed[:PARSE_SLICE_BYTES])
        del self._unparsed[:PARSE_SLICE_BYTES]
        super().data_received(data)
        if not (self._unparsed or self.read_paused or self.transport.is_closing()):
            self.transport.resume_reading()  # (uvicorn's pause, while its app queue holds a
            # message, stands)
        self._parse_when_due()

    def handle_connect(self, event) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # set only for a handshake that is accepted
        if scope is not None:
            scope["extensions"][ABORT_EXTENSION] = {"abort": self.transport.abort}

    # ---- frames the app never sees ----------------------------------------------------------
    def handle_ping(self) -> None:
        if self._control_frame_allowed():
            super().handle_ping()

    def handle_pong(self, event) -> None:
        if self._control_frame_allowed():
            super().handle_pong(event)

    def handle_cont(self, event) -> None:
        if self._control_frame_allowed():
            super().handle_cont(event)

    def _control_frame_allowed(self) -> bool:
        self._pings.refill(self.loop.time())
        backlog_bytes = self.transport.get_write_buffer_size()
        if self._pings.holds(1) and backlog_bytes < MAX_WRITE_BACKLOG_BYTES:
            self._pings.take(1)
            return True
        self.transport.abort()
        return False


def protocols(limits: TransportLimits) -> dict:
    """The `http` and `ws` arguments of `uvicorn.Config`."""
    return {"http": functools.partial(GuardedHttpProtocol, limits=limits),
            "ws": functools.partial(GuardedWebSocketProtocol, limits=limits)}
