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
- the client door (`Door`) holds at most `max_connections` connections (WebSockets
  included). Once `near_cap_fraction` of them are open, a new connection must send its
  first request within `near_cap_handshake_s` (not `request_timeout_s`); with all of them
  open, a new one takes the place of the connection that has not completed its request's
  headers and has been quiet longest (half-open and slow upgrades go first: it is dropped),
  and only when every open connection has completed one is the new one answered 503 and
  closed. So a crowd of peers holding half-open sockets at the cap, each within its own
  limits, delays a real client by one eviction, never refuses it;
- the health listener (`--health-port`, `Door.health_ports`) is a second socket of the same
  server with a budget of its own (`health_max_connections`) that the client door's
  connections never take: it serves `HEALTH_PATHS` only (anything else 404) and counts
  against no peer. Probes (Kubernetes' liveness and readiness, a load balancer's health
  check) point there, as Envoy's admin listener and Istio's health port keep probes off the
  traffic listener: however the client door is crowded, a healthy server answers its
  probes. `/healthz` on the client port still works, as any request does;
- per peer (`serve.edge.peers`): one holding its `max_open` connections is answered 503, one
  connecting faster than its rate 429, both with `Retry-After`, and closed. A connection
  from a trusted proxy is counted at its upgrade, under the forwarded peer;
- a resume (an upgrade with `?resume=`) takes from its peer's resume bucket and from the
  server's (`resumes_per_s`); past either it is answered 429 with `Retry-After` once its
  headers are parsed, before the app runs (no token is hashed, no store is asked).
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
import collections
import functools
import json
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from metronome.serve import protocol as p
from metronome.serve.edge.limits import TransportLimits
from metronome.serve.edge.peers import PeerSlot, PeerTable, Refusal, Refused
from metronome.serve.edge.rate_limit import TokenBucket

ABORT_EXTENSION = "metronome.transport.abort"
PEER_EXTENSION = "metronome.transport.peer"  # {"hold_lease": (now_s) -> slot | refusal}
MAX_WRITE_BACKLOG_BYTES = 1 << 20  # unsent output a pong may not add to
PARSE_SLICE_BYTES = 16 << 10  # ~13 ms of parsing for the worst frames (2-byte messages)
LINGER_S = 1.0  # a refused request's socket stays this long at most for its answer to be read
REFUSAL_WAIT_S = 0.5  # a connection refused at its connect waits this long at most for its request
MAX_REFUSALS_WAITING = 256  # refused connections waiting for their request, at most, at once
HEALTH_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # what the health listener serves
RESUME_QUERY = b"resume"  # `serve.resume.lease.RESUME_QUERY`, as the URL's bytes


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
    code = refused.reason.http_status
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


@dataclass(eq=False)
class Seat:
    """One connection counted by the door (`health`: on the health listener); released once
    (its transport closes, or it is evicted; the WebSocket it became takes it over)."""

    door: Door
    health: bool
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.door._release(self)


class Door:
    """A server's connections as the guard counts them: the client door and the health
    listener, the peers behind them, the half-open connections (oldest-quiet first), the
    server's resume bucket, and what it refused or evicted (`refusals`, for /metrics)."""

    def __init__(self, limits: TransportLimits) -> None:
        self.limits = limits
        self.peers = PeerTable(limits.peers)
        self.refusals_waiting = RefusalsWaiting()
        self.health_ports: set[int] = set()  # local ports of the health listener's sockets
        self.num_open = 0  # the client door's connections
        self.num_health_open = 0
        self.half_open: collections.OrderedDict[GuardedHttpProtocol, None] = (
            collections.OrderedDict())  # no request's headers complete yet; quietest first
        self.resumes = TokenBucket.full(limits.resumes_per_s, limits.resume_burst, 0.0)
        self.refusals: collections.Counter[str] = collections.Counter()

    @property
    def near_cap(self) -> bool:
        return self.num_open >= self.limits.near_cap_fraction * self.limits.max_connections

    def seat(self, health: bool) -> Seat | None:
        """A place for a new connection (None: its budget is full, nothing to evict)."""
        if health:
            if self.num_health_open >= self.limits.health_max_connections:
                return None
            self.num_health_open += 1
            return Seat(self, True)
        if self.num_open >= self.limits.max_connections and not self._evict_half_open():
            return None
        self.num_open += 1
        assert self.num_open <= self.limits.max_connections, self.num_open
        return Seat(self, False)

    def _evict_half_open(self) -> bool:
        """Drop the quietest connection that has not completed a request's headers."""
        if not self.half_open:
            return False
        quietest, _ = self.half_open.popitem(last=False)
        quietest.evict()
        self.refusals["evicted_half_open"] += 1
        return True

    def _release(self, seat: Seat) -> None:
        if seat.health:
            assert self.num_health_open > 0
            self.num_health_open -= 1
        else:
            assert self.num_open > 0
            self.num_open -= 1

    def take_resume(self, peer: str, now_s: float) -> Refused | None:
        """One resume attempt from `peer`: None, or refused (over its rate or the server's)."""
        refused = self.peers.take_resume(peer, now_s)
        if refused is not None:
            return refused
        bucket = self.resumes
        bucket.refill(now_s)
        if not bucket.holds(1):
            return Refused(Refusal.RESUMES_TOO_FAST, 1, f"this server takes "
                           f"{bucket.rate_per_s:g} resume attempts per second (burst "
                           f"{bucket.burst:g}) from all clients; retry")
        bucket.take(1)
        return None


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request timer, the header cap, the connection
    caps (the door's, and per peer), the resume rate and the health listener's paths."""

    def __init__(self, *args, limits: TransportLimits, door: Door, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.door = door
        self.peers = door.peers
        self.refusals_waiting = door.refusals_waiting
        self._seat: Seat | None = None  # this connection, counted by the door
        self._on_health_listener = False
        self._request_timeout_s = limits.request_timeout_s  # shorter near the cap
        self._resume = False  # the request's URL asks to resume a session
        self._refused_at_connect: bytes | None = None  # its answer, until its request comes
        self._refusal_timer: asyncio.TimerHandle | None = None
        self._peer_slot: PeerSlot | None = None  # this connection, counted for its peer
        self._request_timer: asyncio.TimerHandle | None = None
        self._reading_headers = True  # until a request's headers are complete
        self._header_bytes_read = 0  # reads that ended with the headers still incomplete
        self._header_bytes_parsed = 0  # the request line and headers the parser has read
        self._refusal: bytes | None = None  # the answer to a refused request, once parsed
        self._lingering = False  # refused and answered: the rest is dropped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # (uvicorn's own override narrows it the same way: its protocols serve TCP transports)
        self._on_health_listener = _local_port(transport) in self.door.health_ports
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
        if not self._on_health_listener:
            self.door.half_open[self] = None
        self._arm_request_timer()

    def evict(self) -> None:
        """The door needs this half-open connection's place: it is dropped now."""
        self._release_seat()
        self._release_peer_slot()
        self._disarm_request_timer()
        self.transport.abort()

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
        connection is counted by the door, and for its peer unless that is a trusted proxy
        or it came to the health listener)."""
        door = self.door
        if self._on_health_listener:
            self._seat = door.seat(health=True)
            if self._seat is None:
                door.refusals["health_at_capacity"] += 1
                return _response("503 Service Unavailable", p.ErrorCode.AT_CAPACITY,
                                 f"{self.limits.health_max_connections} health connections "
                                 "are open; retry later", retry_after_s=1)
            return None
        address = _host(transport.get_extra_info("peername"))
        if address is not None and not self.peers.is_trusted_proxy(address):
            refusal = self._count_peer(address)  # before a seat: a refused peer evicts none
            if refusal is not None:
                door.refusals["peer_limit"] += 1
                return refusal
        if door.near_cap:
            self._request_timeout_s = min(self._request_timeout_s,
                                          self.limits.near_cap_handshake_s)
        self._seat = door.seat(health=False)
        if self._seat is None:
            self._release_peer_slot()
            door.refusals["at_capacity"] += 1
            return _response("503 Service Unavailable", p.ErrorCode.AT_CAPACITY,
                             f"{self.limits.max_connections} connections are open; retry "
                             "later", retry_after_s=1)
        return None

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
        self._release_seat()
        super().connection_lost(exc)

    def _release_seat(self) -> None:
        self.door.half_open.pop(self, None)
        if self._seat is not None:
            self._seat.release()
            self._seat = None

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
        if self in self.door.half_open:
            self.door.half_open.move_to_end(self)  # not quiet: evicted after quieter ones
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
        if self._refusal is not None:
            return
        parts = urlsplit(url)
        if self._on_health_listener and parts.path.decode("latin-1") not in HEALTH_PATHS:
            self._refusal = _response("404 Not Found", p.ErrorCode.NOT_FOUND,
                                      "the health listener serves "
                                      f"{', '.join(sorted(HEALTH_PATHS))} only")
        self._resume = RESUME_QUERY in parse_qs(parts.query)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._header_bytes_parsed += len(name) + len(value) + HEADER_LINE_OVERHEAD_BYTES
        self._check_header_bytes(self._header_bytes_parsed)

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        if self.door.half_open.pop(self, None) is not None:  # a first request: not half-open
            self._request_timeout_s = self.limits.request_timeout_s
        upgrade = self._refusal is None and not self._on_health_listener and self._is_upgrade()
        if upgrade and self._peer_slot is None:
            self._count_forwarded_peer()
        if upgrade and self._refusal is None and self._resume:
            self._take_resume()
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

    def _take_resume(self) -> None:
        """A resume upgrade: refused (429) past its peer's or the server's resume rate."""
        peer = self._peer_slot.peer if self._peer_slot is not None else _host(
            self.transport.get_extra_info("peername"))
        if peer is None:
            return  # a Unix socket: no peer to count
        refused = self.door.take_resume(peer, self.loop.time())
        if refused is not None:
            self.door.refusals["resume_rate"] += 1
            self._refusal = _peer_refusal(refused)

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
        assert isinstance(websocket, GuardedWebSocketProtocol), websocket
        websocket.peer_slot, self._peer_slot = self._peer_slot, None
        websocket.seat, self._seat = self._seat, None

    # ---- the request timer -------------------------------------------------------------------
    def _arm_request_timer(self) -> None:
        if self._request_timer is None:  # a request still on its way keeps its deadline
            self._request_timer = self.loop.call_later(self._request_timeout_s,
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
        self.seat: Seat | None = None  # the same
        self._gone_peer: tuple[PeerTable, str] | None = None  # its peer, once closed

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer_slot is not None:  # its session may be leased after this: for the peer
            self._gone_peer = (self.peer_slot.table, self.peer_slot.peer)
        for held in (self.peer_slot, self.seat):
            if held is not None:
                held.release()
        self.peer_slot = self.seat = None
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
            # (the peer's slot is handed over once this handshake has run: read when called)
            scope["extensions"][PEER_EXTENSION] = {"hold_lease": self._hold_lease}

    def _hold_lease(self, now_s: float) -> PeerSlot | Refused | None:
        """A session of this connection held for a resume, counted for its peer (None: no
        peer counted, a Unix socket or an uncounted proxy)."""
        slot = self.peer_slot
        peer = (slot.table, slot.peer) if slot is not None else self._gone_peer
        return None if peer is None else peer[0].hold_lease(peer[1], now_s)

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


def _local_port(transport: asyncio.Transport) -> int | None:
    sockname = transport.get_extra_info("sockname")
    return sockname[1] if isinstance(sockname, tuple) and len(sockname) > 1 else None


def protocols(door: Door) -> dict:
    """The `http` and `ws` arguments of `uvicorn.Config` (one door for the server)."""
    return {"http": functools.partial(GuardedHttpProtocol, limits=door.limits, door=door),
            "ws": functools.partial(GuardedWebSocketProtocol, limits=door.limits)}
