"""One WebSocket connection: auth and admission at the upgrade, then the receive loop
with its limits, the outbox to the client, and the close.

    upgrade ─► bearer key? (no: error, close 1008) ─► admitted? (no: HTTP 503 + Retry-After)
      ─► session.created ─► receive loop: size ─► JSON ─► typed event ─► session.handle
                              │  any ClientError ─► `error` event; the session lives on
                              └─ idle timeout / max duration / slow reader / disconnect ─► close
    close ─► engine session closed at once (blocks back), owed frames answered `cancelled`,
             queued events flushed (≤ 1 s), close frame with code and reason.

Server events go through a bounded outbox drained by a writer task, so frame results,
delivered from the beat's callbacks, never wait on a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from metronome.serve import protocol as p
from metronome.serve.auth import bearer_matches
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import ClientError, ErrorCode, ErrorType
from metronome.serve.session import RealtimeSession
from metronome.serve.state import ServerState

log = logging.getLogger(__name__)

DENIAL_EXTENSION = "websocket.http.response"
FLUSH_TIMEOUT_S = 1.0  # queued events, then the close frame, get this long each


class CloseCode(enum.IntEnum):
    NORMAL = 1000
    POLICY_VIOLATION = 1008  # bad API key, or a client that does not read its events
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013  # refused by admission after the upgrade


@dataclass(frozen=True)
class Ending:
    outcome: str  # metronome_sessions_total{outcome}
    code: CloseCode | None = None  # None: the client is gone, nothing to send
    reason: str = ""
    error: ClientError | None = None  # told to the client before the close frame
    flush: bool = True


class Connection:
    def __init__(self, websocket: WebSocket, state: ServerState) -> None:
        self.ws = websocket
        self.state = state
        self.config = state.config
        self.outbox: asyncio.Queue[str] = asyncio.Queue()
        self._ending: asyncio.Future[Ending] = asyncio.get_running_loop().create_future()

    async def serve(self) -> None:
        if not await self._authorized() or not await self._admitted():
            return
        session = RealtimeSession(self.state, self._emit, self._on_failure)
        self.state.add(session)  # before any await: admission counts it from now on
        ending = Ending("error", CloseCode.INTERNAL_ERROR, "internal error")
        writer = None
        try:
            await self.ws.accept()
            writer = asyncio.create_task(self._write())
            session.start()
            ending = await self._receive_loop(session)
        except Exception:  # one connection's failure never reaches the others
            log.exception("session %s failed", session.id)
        finally:
            self._end(ending)  # first: events of a gone client are dropped, not queued
            self.state.remove(session, ending.outcome)  # blocks back before any await
            await self._finish(ending, writer)

    # ---- before the upgrade ---------------------------------------------------------------
    async def _authorized(self) -> bool:
        if bearer_matches(self.ws.headers.get("authorization"), self.config.api_key):
            return True
        await self.ws.accept()
        error = ClientError(ErrorCode.INVALID_API_KEY, "missing or invalid bearer API key")
        await self.ws.send_text(p.ErrorEvent.of(error).to_json())
        await self.ws.close(CloseCode.POLICY_VIOLATION, "invalid api key")
        return False

    async def _admitted(self) -> bool:
        decision = self.state.admit()
        if decision.admitted:
            return True
        retry_after_s = max(1, math.ceil(decision.retry_after_s))
        error = ClientError(ErrorCode.AT_CAPACITY,
                            f"the server is at capacity ({decision.reason}); retry in "
                            f"{retry_after_s} s", error_type=ErrorType.SERVER)
        event = p.ErrorEvent.of(error)
        if DENIAL_EXTENSION in self.ws.scope.get("extensions", {}):
            response = JSONResponse({"error": event.error.model_dump(mode="json")},
                                    status_code=503, headers={"Retry-After": str(retry_after_s)})
            await self.ws.send_denial_response(response)
        else:  # the server cannot answer HTTP before the upgrade: refuse right after it
            await self.ws.accept()
            await self.ws.send_text(event.to_json())
            await self.ws.close(CloseCode.TRY_AGAIN_LATER, f"at capacity; retry in "
                                f"{retry_after_s} s")
        return False

    # ---- the session ------------------------------------------------------------------------
    async def _receive_loop(self, session: RealtimeSession) -> Ending:
        loop = asyncio.get_running_loop()
        expires_at = loop.time() + self.config.max_session_s
        while True:
            idle_at = loop.time() + self.config.idle_timeout_s
            receive = asyncio.ensure_future(self.ws.receive())
            done, _ = await asyncio.wait({receive, self._ending}, timeout=min(
                idle_at, expires_at) - loop.time(), return_when=asyncio.FIRST_COMPLETED)
            if receive not in done:
                receive.cancel()
                return self._ending.result() if self._ending.done() else _timeout_ending(
                    loop.time() >= expires_at, self.config)
            message = receive.result()
            if message["type"] == "websocket.disconnect":
                normal = message.get("code") in (1000, 1001)
                return Ending("completed" if normal else "disconnected")
            self._on_message(session, message)

    def _on_message(self, session: RealtimeSession, message: dict) -> None:
        text = message.get("text")
        if text is None:
            self._error(ClientError(ErrorCode.BINARY_NOT_SUPPORTED,
                                    "send events as JSON text messages, not binary"))
            return
        if len(text) > self.config.max_message_bytes or (
                len(text.encode()) > self.config.max_message_bytes):
            self._error(ClientError(ErrorCode.MESSAGE_TOO_LARGE, f"message exceeds "
                                    f"{self.config.max_message_bytes} bytes; split the audio"))
            return
        try:
            event = p.parse_client_event(text)
        except ClientError as err:
            self._error(err, p.client_event_id(text))
            return
        try:
            session.handle(event)
        except ClientError as err:
            self._error(err, event.event_id)

    def _error(self, err: ClientError, client_event_id: str | None = None) -> None:
        self._emit(p.ErrorEvent.of(err, client_event_id))

    # ---- the outbox -------------------------------------------------------------------------
    def _emit(self, event: p.ServerEvent) -> None:
        if self._ending.done():
            if self._ending.result().code is None:
                return  # the client is gone
        elif self.outbox.qsize() >= self.config.max_outbox_events:
            self._end(Ending("slow_consumer", CloseCode.POLICY_VIOLATION,
                             "client does not read its events", flush=False))
            return
        self.outbox.put_nowait(event.to_json())

    def _on_failure(self) -> None:
        self._end(Ending("error", CloseCode.INTERNAL_ERROR, "internal error"))

    def _end(self, ending: Ending) -> None:
        if not self._ending.done():
            self._ending.set_result(ending)

    async def _write(self) -> None:
        try:
            while True:
                text = await self.outbox.get()
                await self.ws.send_text(text)
                self.outbox.task_done()
        except Exception:  # disconnected mid-send: the receive loop ends the session
            self._end(Ending("disconnected"))
            _drain(self.outbox)

    async def _finish(self, ending: Ending, writer: asyncio.Task | None) -> None:
        if ending.code is not None and writer is not None:
            if ending.error is not None:
                self.outbox.put_nowait(p.ErrorEvent.of(ending.error).to_json())
            if ending.flush:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.outbox.join(), FLUSH_TIMEOUT_S)
        if writer is not None:
            writer.cancel()
        if ending.code is not None:  # a client that does not read would block the close
            with contextlib.suppress(Exception):  # or it is gone by now
                await asyncio.wait_for(self.ws.close(ending.code, ending.reason),
                                       FLUSH_TIMEOUT_S)


def _timeout_ending(expired: bool, config: ServerConfig) -> Ending:
    if expired:
        error = ClientError(ErrorCode.SESSION_EXPIRED, f"the session reached the maximum "
                            f"duration of {config.max_session_s:g} s")
        return Ending("expired", CloseCode.NORMAL, "session expired", error)
    error = ClientError(ErrorCode.IDLE_TIMEOUT,
                        f"no client event for {config.idle_timeout_s:g} s")
    return Ending("idle_timeout", CloseCode.NORMAL, "idle timeout", error)


def _drain(queue: asyncio.Queue) -> None:
    while not queue.empty():
        queue.get_nowait()
        queue.task_done()
