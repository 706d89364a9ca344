"""The transport guard: what uvicorn's protocols leave unbounded, bounded before the app runs.

uvicorn (0.54, httptools) arms no timer until a first response is done, and any byte that
arrives disarms its keep-alive timer, so a client that trickles a header line now and then
holds its socket forever (slowloris); `limit_concurrency` answers 503 only once a request's
headers are complete, so such sockets are never refused either. Here, per connection:

- a request (request line, headers, body) must arrive whole within `request_timeout_s` of
  its first byte, and a new connection must start its first one within `request_timeout_s`
  of the connect, or the transport is dropped (aborted: a client that does not read must
  not keep it either);
- the request line and headers may take `max_header_bytes`; past that, 431 and closed,
  however the bytes arrive: counted as the parser reads them (all of them in one read) and,
  for headers not complete yet, as they are read (one byte at a time). Nothing of a refused
  request runs (no app call, no upgrade), and its socket lingers at most `LINGER_S` (what
  the client still sends is dropped) so that the answer is read, not reset;
- with `max_connections` connections open (WebSockets included), one more is answered 503
  and closed, never counted as open;
- per peer (`serve.edge.peers`): one holding its `max_open` connections is answered 503, one
  connecting faster than its rate 429, both with `Retry-After`, and closed. A connection
  from a trusted proxy is counted at its upgrade, under the forwarded peer.
- Those refusals are decided at the connect and answered when the request's first bytes
  arrive (at most `REFUSAL_WAIT_S` later): an HTTP client reads a response only to a
  request it has sent, and one answered before it sent its own (the `websockets` client,
  among others) reports a connection closed in its handshake instead of the 503/429 and
  its `Retry-After`. Nothing of the request is parsed. At most `MAX_REFUSALS_WAITING`
  refused connections wait at once (a flood past that is answered and closed at once).

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
from metronome.serve.edge.peers import PeerLimits, PeerSlot, PeerTable, Refused
from metronome.serve.edge.rate_limit import TokenBucket

ABORT_EXTENSION = "metronome.transport.abort"
MAX_WRITE_BACKLOG_BYTES = 1 << 20  # unsent output a pong may not add to
PARSE_SLICE_BYTES = 16 << 10  # ~13 ms of parsing for the worst frames (2-byte messages)
LINGER_S = 1.0  # a refused request's socket stays this long at most for its answer to be read
REFUSAL_WAIT_S = 0.5  # a connection refused at its connect waits this long at most for its request
MAX_REFUSALS_WAITING = 256  # refused connections waiting for their request, at most, at once


@dataclass(frozen=True)
class TransportLimits:
    request_timeout_s: float
    max_header_bytes: int
    max_connections: int
    pings_per_s: float  # WebSocket pings, pongs and continuation frames, per connection
    ping_burst: int
    peers: PeerLimits


HEADER_LINE_OVERHEAD_BYTES = 4  # ": " and CRLF of each header line, which the parser drops
_STATUS_LINES = {503: "503 Service Unavailable", 429: "429 Too Many Requests"}


def _response(status_line: str, code: p.ErrorCode, message: str,
              retry_after_s: int | None = None) -> bytes:
    error = p.ErrorDetail(type=p.ErrorType.SERVER, code=code, message=message)
    body = json.dumps({"error": error.model_dump(mode="json")}).encode()
    retry = "" if retry_after_s is None else f"retry-after: {retry_after_s}\r\n"
    head = (f"HTTP/1.1 {status_line}\r\ncontent-type: application/json\r\n{retry}"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def _peer_refusal(refused: Refused) -> bytes:
    code = refused.reason.value
    error_code = p.ErrorCode.AT_CAPACITY if code == 503 else p.ErrorCode.RATE_LIMITED
    return _response(_STATUS_LINES[code], error_code, refused.message, refused.retry_after_s)


@dataclass
class RefusalsWaiting:
    """The refused connections of one server still waiting for their request."""

    count: int = 0

    def take(self) -> bool:
        if self.count >= MAX_REFUSALS_WAITING:
            return False
        self.count += 1
        return True

    def give_back(self) -> None:
        assert self.count > 0, "a waiting refusal given back twice"
        self.count -= 1


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request timer, the header cap, and the
    connection caps (all connections, and per peer)."""

    def __init__(self, *args, limits: TransportLimits, peers: PeerTable,
                 refusals_waiting: RefusalsWaiting, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.peers = peers
        self.refusals_waiting = refusals_waiting
        self._refused_at_connect: bytes | None = None  # its answer, until its request comes
        self._refusal_timer: asyncio.TimerHandle | None = None
        self._peer_slot: PeerSlot | None = None  # this connection, counted for its peer
        self._request_timer: asyncio.TimerHandle | None = None
        self._reading_headers = True  # until a request's headers are complete
        self._header_bytes_read = 0  # reads that ended with the headers still incomplete
        self._header_bytes_parsed = 0  # the request line and headers the parser has read
        self._refusal: bytes | None = None  # the answer to a refused request, once parsed
        self._lingering = False  # refused and answered: the rest is dropped

    def connection_made(self, transport: asyncio.Transport) -> None:
        refusal = self._connection_refusal(transport)
        if refusal is not None:
            self.transport = transport  # for connection_lost; never counted as open
            if not self.refusals_waiting.take():  # a flood: no waiting for its request
                transport.write(refusal)
                transport.close()
                return
            self._refused_at_connect = refusal
            self._refusal_timer = self.loop.call_later(REFUSAL_WAIT_S,
                                                       self._answer_refused_at_connect)
            return
        super().connection_made(transport)
        self._arm_request_timer()

    def _answer_refused_at_connect(self) -> None:
        """Answer a connection refused at its connect (its request arrived, or the wait is
        over) and close it; what it sent is dropped unparsed."""
        refusal, self._refused_at_connect = self._refused_at_connect, None
        if refusal is None:
            return
        self._stop_waiting_for_refused_request()
        self.transport.write(refusal)
        self.transport.close()

    def _stop_waiting_for_refused_request(self) -> None:
        if self._refusal_timer is not None:
            self._refusal_timer.cancel()
            self._refusal_timer = None
            self.refusals_waiting.give_back()

    def _connection_refusal(self, transport: asyncio.Transport) -> bytes | None:
        """The answer to a connection refused before it sends anything, else None (and the
        connection is counted for its peer, unless that is a trusted proxy)."""
        if len(self.connections) >= self.limits.max_connections:
            return _response("503 Service Unavailable", p.ErrorCode.AT_CAPACITY,
                             f"{self.limits.max_connections} connections are open; retry "
                             "later", retry_after_s=1)
        address = _host(transport.get_extra_info("peername"))
        if address is None or self.peers.is_trusted_proxy(address):
            return None  # a Unix socket; a proxy: counted at the upgrade, per forwarded peer
        return self._count_peer(address)

    def _count_peer(self, address: str) -> bytes | None:
        opened = self.peers.open(address, self.loop.time())
        if isinstance(opened, Refused):
            return _peer_refusal(opened)
        self._peer_slot = opened
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._refused_at_connect = None
        self._stop_waiting_for_refused_request()
        self._disarm_request_timer()
        self._release_peer_slot()
        super().connection_lost(exc)

    def _release_peer_slot(self) -> None:
        if self._peer_slot is not None:
            self._peer_slot.release()
            self._peer_slot = None

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing() or self._lingering:
            return  # (lingering: read and dropped)
        if self._refused_at_connect is not None:
            self._answer_refused_at_connect()
            return
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._reading_headers and self._refusal is None:
            self._header_bytes_read += len(data)  # all of it is request line and headers
            self._check_header_bytes(self._header_bytes_read)
        if self._refusal is not None:
            self._answer_and_linger(self._refusal)

    def _answer_and_linger(self, response: bytes) -> None:
        """Answer a refused request and close, lingering: what the client still sends is
        read and dropped until it closes or `LINGER_S` passes (a socket closed with unread
        bytes is reset, and the client may lose the answer before it reads it)."""
        self._lingering = True
        self.transport.write(response)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()  # after the answer; the client's EOF then closes it
        self.loop.call_later(LINGER_S, self.transport.abort)

    def _check_header_bytes(self, num_bytes: int) -> None:
        if num_bytes > self.limits.max_header_bytes and self._refusal is None:
            self._refusal = _response(
                "431 Request Header Fields Too Large", p.ErrorCode.MESSAGE_TOO_LARGE,
                f"request line and headers exceed {self.limits.max_header_bytes} bytes")

    # ---- parser callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        self._header_bytes_read = self._header_bytes_parsed = 0
        self._arm_request_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._header_bytes_parsed += len(url)
        self._check_header_bytes(self._header_bytes_parsed)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._header_bytes_parsed += len(name) + len(value) + HEADER_LINE_OVERHEAD_BYTES
        self._check_header_bytes(self._header_bytes_parsed)

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        if self._refusal is None and self._peer_slot is None and self._is_upgrade():
            self._count_forwarded_peer()
        if self._refusal is not None:
            return  # nothing of a refused request runs
        super().on_headers_complete()
        if self._is_upgrade():  # a WebSocket: its protocol takes the transport over
            self._disarm_request_timer()

    def _is_upgrade(self) -> bool:
        return self.parser.should_upgrade() and self._should_upgrade()

    def _count_forwarded_peer(self) -> None:
        """An upgrade through a trusted proxy: counted for the peer it forwards (a proxy
        that names none: for itself)."""
        proxy = _host(self.transport.get_extra_info("peername"))
        if proxy is None:
            return
        self._refusal = self._count_peer(self.peers.forwarded_peer(self.headers) or proxy)

    def on_body(self, body: bytes) -> None:
        if self._refusal is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refusal is not None:
            return
        super().on_message_complete()
        self._disarm_request_timer()

    def handle_websocket_upgrade(self) -> None:
        if self._refusal is not None:
            return
        super().handle_websocket_upgrade()
        websocket = self.transport.get_protocol()  # holds this connection from now on
        websocket.peer_slot, self._peer_slot = self._peer_slot, None

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
        self.peer_slot: PeerSlot | None = None  # the HTTP protocol's, handed over

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer_slot is not None:
            self.peer_slot.release()
            self.peer_slot = None
        super().connection_lost(exc)

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


def _host(peername) -> str | None:
    """The address of a transport's peer (None: not an IP socket)."""
    return peername[0] if isinstance(peername, tuple) and peername else None


def protocols(limits: TransportLimits) -> dict:
    """The `http` and `ws` arguments of `uvicorn.Config` (one peer table for the server)."""
    peers = PeerTable(limits.peers)
    return {"http": functools.partial(GuardedHttpProtocol, limits=limits, peers=peers,
                                      refusals_waiting=RefusalsWaiting()),
            "ws": functools.partial(GuardedWebSocketProtocol, limits=limits)}
