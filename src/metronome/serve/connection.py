"""One WebSocket connection: auth and admission at the upgrade, then the receive loop
with its limits, the outbox to the client, and the close.

    upgrade ─► key? (no: HTTP 401) ─► admitted? (no: HTTP 503 + Retry-After), both before it
      ─► accept (echoing `realtime`) ─► session.created ─► receive loop:
           rate limit ─► size ─► bounded JSON ─► typed event ─► session.handle
              │  any ClientError ─► `error` event; the session lives on
              └─ idle timeout / max duration / rate limit / slow reader / disconnect ─► end
    end ─► nothing more is read; the server releases the session (`Serving.release`: a
           client that dropped, no close frame, may have it leased for a resume, else its
           stream is closed at once, blocks back, owed frames answered `cancelled`); queued
           events flushed (≤ 1 s) unless the client does not read; the close frame with code
           and reason (≤ 1 s) and the client's reply (≤ 1 s), or else the transport is
           dropped. A draining server (`Serving.drain`) refuses new sessions at the upgrade.

`?resume=<session id>` with the session's resume token: no admission (the session is still
counted); the session is the one `serve.resume` attaches to this connection, then on as
above; refused before the upgrade (404, or 503 when draining). Whoever ends a connection
from outside (a drain, a resume elsewhere) says how with `end`.

Server events go through a bounded outbox (events and bytes) drained by a writer task, so
frame results, delivered from the beat's callbacks, never wait on a socket. A full outbox
is a client that does not read: it is closed 1008 and nothing more is queued for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from metronome.serve import protocol as p
from metronome.serve.config import ServerConfig
from metronome.serve.edge.auth import (
    chosen_subprotocol,
    key_matches,
    offered_keys,
    unauthorized_response,
)
from metronome.serve.edge.guard import ABORT_EXTENSION, PEER_EXTENSION
from metronome.serve.edge.rate_limit import RateLimit, Verdict
from metronome.serve.outbox import Outbox
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol.errors import Refused
from metronome.serve.realtime.session import RealtimeSession
from metronome.serve.serving import Serving

log = logging.getLogger(__name__)

DENIAL_EXTENSION = "websocket.http.response"
# What uvicorn reports when the TCP connection just went (a FIN or a reset, no close frame):
# 1005 once the handshake is done, 1006 before or mid-send. (A close frame with no status
# also reads 1005: such a client is held for the grace as if dropped.)
NO_CLOSE_FRAME = (1005, 1006)
FLUSH_TIMEOUT_S = 1.0  # queued events, the close frame, the closing handshake: this long each


class CloseCode(enum.IntEnum):
    NORMAL = 1000
    POLICY_VIOLATION = 1008  # bad API key, a client that does not read, over the rate limit
    INTERNAL_ERROR = 1011


@dataclass(frozen=True)
class Ending:
    outcome: str  # metronome_sessions_total{outcome}
    code: int | None = None  # None: the client is gone, nothing to send
    reason: str = ""
    error: ClientError | None = None  # told to the client before the close frame
    flush: bool = True  # False: the client does not read; nothing more is queued
    dropped: bool = False  # the network lost the client (no close frame): it may resume

    @property
    def delivers(self) -> bool:
        """Events emitted from now on still go out, before the close frame."""
        return self.code is not None and self.flush


class Connection:
    def __init__(self, websocket: WebSocket, serving: Serving) -> None:
        self.ws = websocket
        self.serving = serving
        self.config = serving.config
        self.outbox = Outbox(self.config.max_outbox_events, self.config.max_outbox_bytes)
        self.subprotocols: list[str] = websocket.scope.get("subprotocols", [])
        self._ending: asyncio.Future[Ending] = asyncio.get_running_loop().create_future()
        self.attached_seq = 0  # the first session event this connection was to deliver
        key = self.config.api_key  # the key it is authorized with (the server has one, or
        self.api_key = "" if key is None else key.get_secret_value()  # none)

    async def serve(self) -> None:
        if not await self._authorized():
            return
        try:
            session, on_accepted = await self.serving.open(self)
        except Refused as refused:
            await self._refuse(refused, refused.http_status, refused.close_code,
                               refused.close_reason, refused.headers)
            return
        await self._run(session, on_accepted)

    async def _run(self, session: RealtimeSession, on_accepted) -> None:
        ending = Ending("error", CloseCode.INTERNAL_ERROR, "internal error")
        writer = None
        try:
            await self.ws.accept(subprotocol=chosen_subprotocol(self.subprotocols))
            writer = asyncio.create_task(self._write())
            on_accepted()
            ending = await self._receive_loop(session)
        except Exception:  # one connection's failure never reaches the others
            log.exception("session %s failed", session.id)
        finally:
            self._end(ending)  # first: events of a gone client are dropped, not queued
            # blocks back (or the session leased) before any await
            self.serving.release(session, self, ending.outcome, ending.dropped)
            await self._finish(ending, writer)

    def query(self, name: str) -> str | None:
        return self.ws.query_params.get(name)

    def header(self, name: str) -> str | None:
        return self.ws.headers.get(name)

    @property
    def extensions(self) -> bool:
        """`?metronome_events=true` on the URL: this client takes `metronome.*` events (and
        the session's `metronome` block); every other client sees OpenAI's events only."""
        return (self.query(p.EXTENSIONS_QUERY) or "").lower() in ("1", "true", "yes")

    def hold_lease(self, now_s: float):
        """Count the session this connection drops as held for its peer (`PeerSlot`), or say
        why it cannot be held (`Refused`); None: no peer to count (a Unix socket, an app
        served without `serve.server`'s transport)."""
        peer = self.ws.scope.get("extensions", {}).get(PEER_EXTENSION)
        return None if peer is None else peer["hold_lease"](now_s)

    def resume_from(self) -> int:
        """The first session event this connection did not hand to the transport."""
        delivered = self.outbox.delivered_seq
        return self.attached_seq if delivered is None else delivered + 1

    # ---- before the upgrade ---------------------------------------------------------------
    async def _authorized(self) -> bool:
        offered = offered_keys(self.ws.headers.get("authorization"), self.subprotocols)
        if key_matches(offered, self.config.api_key):
            return True
        if self._can_deny():
            await self.ws.send_denial_response(unauthorized_response())
            return False
        await self.ws.accept(subprotocol=chosen_subprotocol(self.subprotocols))
        error = ClientError(ErrorCode.INVALID_API_KEY, "missing or invalid API key")
        await self.ws.send_text(p.ErrorEvent.of(error).to_json())
        await self.ws.close(CloseCode.POLICY_VIOLATION, "invalid api key")
        return False

    async def _refuse(self, error: ClientError, http_status: int, code: int,
                      reason: str, headers: dict[str, str] | None = None) -> None:
        """Before the upgrade: HTTP `http_status` with the error; a server that cannot answer
        HTTP there: accept, the `error` event, close `code`."""
        event = p.ErrorEvent.of(error)
        if self._can_deny():
            response = JSONResponse({"error": event.error.model_dump(mode="json")},
                                    status_code=http_status, headers=headers)
            await self.ws.send_denial_response(response)
        else:  # the server cannot answer HTTP before the upgrade: refuse right after it
            await self.ws.accept(subprotocol=chosen_subprotocol(self.subprotocols))
            await self.ws.send_text(event.to_json())
            await self.ws.close(code, reason)

    def _can_deny(self) -> bool:
        return DENIAL_EXTENSION in self.ws.scope.get("extensions", {})

    # ---- the session ------------------------------------------------------------------------
    async def _receive_loop(self, session: RealtimeSession) -> Ending:
        loop = asyncio.get_running_loop()
        config = self.config
        age_s = self.serving.now_s() - session.opened_at_s  # a resumed session's too
        expires_at = loop.time() + config.max_session_s - age_s
        limit = RateLimit(config.rate_limit_messages_per_s, config.rate_limit_burst_messages,
                          config.rate_limit_bytes_per_s, config.rate_limit_burst_bytes,
                          loop.time())
        while not self._ending.done():
            paused = session.reading_paused()
            if paused is not None:  # its text being counted decides the next message's room
                waits: set[asyncio.Future[Any]] = {paused, self._ending}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                continue
            idle_at = math.inf if config.idle_timeout_s is None else (
                loop.time() + config.idle_timeout_s)
            receive = asyncio.ensure_future(self.ws.receive())
            waiting: set[asyncio.Future[Any]] = {receive, self._ending}
            await asyncio.wait(waiting, timeout=min(
                idle_at, expires_at) - loop.time(), return_when=asyncio.FIRST_COMPLETED)
            if self._ending.done() or not receive.done():
                # ended (a message that came at the same time is not read), or timed out
                receive.cancel()
                break
            message = receive.result()
            if message["type"] == "websocket.disconnect":
                code = message.get("code")
                if code in (1000, 1001):
                    return Ending("completed")
                return Ending("disconnected", dropped=code in NO_CLOSE_FRAME)
            self._on_message(session, message, limit, loop.time())
        if self._ending.done():
            return self._ending.result()
        return _timeout_ending(loop.time() >= expires_at, config)

    def _on_message(self, session: RealtimeSession, message: Mapping[str, Any], limit: RateLimit,
                    now_s: float) -> None:
        max_bytes = self.config.max_message_bytes
        text = message.get("text")
        if text is not None:  # chars <= bytes: a long text is too large without encoding it
            size = len(text) if len(text) > max_bytes else p.text_bytes(text)
        else:
            size = len(message.get("bytes") or b"")
        verdict = limit.admit(min(size, max_bytes), now_s)
        if verdict is not Verdict.ACCEPT:
            self._on_refused(verdict, limit, text)
            return
        if text is None:
            self._error(ClientError(ErrorCode.BINARY_NOT_SUPPORTED,
                                    "send events as JSON text messages, not binary"))
            return
        if size > max_bytes:
            self._error(ClientError(ErrorCode.MESSAGE_TOO_LARGE, f"message of {size} bytes "
                                    f"exceeds {max_bytes} bytes; split the audio"),
                        p.readable_event_id(text))
            return
        session.receive(text)

    def _on_refused(self, verdict: Verdict, limit: RateLimit, text: str | None) -> None:
        """One error per run of refused messages, echoing the first one's event_id (read
        from its leading members, never parsed: it is over the rate)."""
        if verdict is Verdict.REFUSE:
            self._error(ClientError(
                ErrorCode.RATE_LIMITED, f"over the rate limit of {limit.describe()}: this "
                "message is dropped, and so is every one until the rate falls back; a further "
                "burst over it closes the connection (1008)"),
                None if text is None else p.readable_event_id(text))
        elif verdict is Verdict.CLOSE:
            error = ClientError(ErrorCode.RATE_LIMITED, f"a further burst over the rate limit "
                                f"of {limit.describe()}: closing")
            self._end(Ending("rate_limited", CloseCode.POLICY_VIOLATION, "rate limit exceeded",
                             error))

    def _error(self, err: ClientError, client_event_id: str | None = None) -> None:
        self.send(p.ErrorEvent.of(err, client_event_id))

    def refuse(self, err: ClientError) -> None:
        """A client event the session refused: an `error` echoing its `event_id`."""
        self._error(err, err.event_id)

    # ---- the outbox -------------------------------------------------------------------------
    def send(self, event: p.ServerEvent) -> None:
        """The connection's own events (errors about messages, the resume's)."""
        self._queue(event.to_json(), None)

    def sink(self, event: p.ServerEvent, text: str, seq: int) -> None:
        """The session's events, numbered in its event log."""
        self._queue(text, seq)

    def send_numbered(self, text: str, seq: int) -> None:
        """A session event sent again (a resume's replay), with its number."""
        self._queue(text, seq)

    def _queue(self, text: str, seq: int | None) -> None:
        """An event's JSON (`seq`: its number in the session's stream, or None)."""
        ending = self._ending.result() if self._ending.done() else None
        if ending is not None and not ending.delivers:
            return  # the client is gone, or does not read: nothing more is queued for it
        if self.outbox.put(text, seq) or ending is not None:
            return  # once ended, what does not fit is dropped
        self._end(Ending("slow_consumer", CloseCode.POLICY_VIOLATION,
                         "client does not read its events", flush=False))

    def end(self, outcome: str, code: int | None, reason: str,
            error: ClientError | None = None, flush: bool = True) -> None:
        """End this connection from outside (a drain, a resume elsewhere): `error` told to the
        client and the close frame `code` (`flush`: queued events still go out first)."""
        self._end(Ending(outcome, code, reason, error, flush))

    def fail(self) -> None:
        """The session failed (a bug): close 1011."""
        self._end(Ending("error", CloseCode.INTERNAL_ERROR, "internal error"))

    def _end(self, ending: Ending) -> None:
        if not self._ending.done():
            self._ending.set_result(ending)

    async def _write(self) -> None:
        try:
            while True:
                text = await self.outbox.get()
                await self.ws.send_text(text)
                self.outbox.sent()
        except Exception:  # disconnected mid-send: the receive loop ends the session
            self._end(Ending("disconnected", dropped=True))
            self.outbox.clear()

    async def _finish(self, ending: Ending, writer: asyncio.Task | None) -> None:
        if ending.delivers and writer is not None:
            if ending.error is not None:
                self.outbox.put(p.ErrorEvent.of(ending.error).to_json())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.outbox.join(), FLUSH_TIMEOUT_S)
        if writer is not None:
            writer.cancel()
        if ending.code is None:
            return
        try:
            await asyncio.wait_for(self.ws.close(ending.code, ending.reason), FLUSH_TIMEOUT_S)
        except Exception:  # the close frame cannot go out (the client does not read), or
            self._abort()  # the client is gone: drop the transport, or the socket stays
            return
        # The frame is queued; a client that does not read never answers it, and uvicorn's
        # close waits for the socket to drain: past the handshake's time, drop the transport
        # (a client that answered is closed by then, and this does nothing).
        asyncio.get_running_loop().call_later(FLUSH_TIMEOUT_S, self._abort)

    def _abort(self) -> None:
        abort = self.ws.scope.get("extensions", {}).get(ABORT_EXTENSION)
        if abort is not None:  # absent: a server without serve.edge.guard; nothing to do
            abort["abort"]()


def _timeout_ending(expired: bool, config: ServerConfig) -> Ending:
    if expired:
        error = ClientError(ErrorCode.SESSION_EXPIRED, f"the session reached the maximum "
                            f"duration of {config.max_session_s:g} s")
        return Ending("expired", CloseCode.NORMAL, "session expired", error)
    error = ClientError(ErrorCode.IDLE_TIMEOUT,
                        f"no client event for {config.idle_timeout_s:g} s")
    return Ending("idle_timeout", CloseCode.NORMAL, "idle timeout", error)
