"""The project's one Realtime WebSocket client: `Connection` (one session's socket, from the
client's side: open or resume, send, read, ask, drop), what `metronome load` and every bench
that drives a server send and read through; and `SessionClient`, one load-generating session
on it.

A load session streams speech at real-time pace (a chunk is sent when its audio would have
been captured), and times every frame from the client's side: from sending the chunk that
holds the frame's last byte to receiving the frame's `metronome.frame` event. Refusals (HTTP
503 before the upgrade, or close 1013 after it) are recorded with their retry hint.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from metronome.serve.protocol import with_extensions
from metronome.serve.resume.lease import RESUME_QUERY, TOKEN_HEADER

OPEN_TIMEOUT_S = 10.0
REFUSED_CLOSE_CODE = 1013


class Connection:
    """One Realtime session's socket. `await Connection.open(url)` returns once the server's
    first event arrived (`opened`: session.created, or metronome.session.resumed when
    `resume` = (session id, token) is given); `metronome.*` events are asked for unless
    `extensions` is False. `async for event in conn` reads until the socket closes."""

    def __init__(self, ws, opened: dict) -> None:
        self.ws, self.opened = ws, opened

    @classmethod
    async def open(cls, url: str, api_key: str | None = None,
                   resume: tuple[str, str] | None = None, extensions: bool = True,
                   timeout_s: float = OPEN_TIMEOUT_S) -> Connection:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if extensions:
            url = with_extensions(url)
        if resume is not None:
            url += ("&" if "?" in url else "?") + f"{RESUME_QUERY}={resume[0]}"
            headers[TOKEN_HEADER] = resume[1]
        ws = await connect(url, additional_headers=headers, compression=None,
                           open_timeout=timeout_s, max_size=None)
        return cls(ws, json.loads(await asyncio.wait_for(ws.recv(), timeout_s)))

    @property
    def session(self) -> dict:
        """The session as the server last described it (created, or resumed)."""
        return self.opened["session"]

    async def send(self, event: dict | str | bytes) -> None:
        """An event (a dict), or any message as it is (a bad client's)."""
        await self.ws.send(json.dumps(event) if isinstance(event, dict) else event)

    async def append(self, pcm: bytes) -> None:
        await self.send({"type": "input_audio_buffer.append",
                         "audio": base64.b64encode(pcm).decode()})

    async def recv(self, timeout_s: float | None = None) -> dict:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout_s))

    async def until(self, event_type: str, timeout_s: float | None = None) -> dict:
        """The next `event_type` event (others read past); an error event raises."""
        while True:
            event = await self.recv(timeout_s)
            if event["type"] == event_type:
                return event
            if event["type"] == "error":
                raise ValueError(f"expected {event_type}, got error {event['error']}")

    async def update(self, session: dict) -> dict:
        """session.update; the session as session.updated describes it."""
        await self.send({"type": "session.update", "session": session})
        return (await self.until("session.updated"))["session"]

    async def ask(self, text: str, timeout_s: float = 600.0) -> dict:
        """A user message and response.create; the response.done event."""
        await self.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text",
                                                            "text": text}]}})
        await self.send({"type": "response.create"})
        return await self.until("response.done", timeout_s)

    async def __aiter__(self) -> AsyncIterator[dict]:
        try:
            async for message in self.ws:
                yield json.loads(message)
        except ConnectionClosed:
            return

    async def drop(self) -> None:
        """The socket goes without a close frame, as a lost connection does."""
        self.ws.transport.abort()
        await asyncio.sleep(0)  # the transport closes its socket on the loop's next turn

    async def close(self) -> None:
        await self.ws.close()


@dataclass
class FrameRecord:
    session: int
    index: int
    kind: str
    status: str
    num_tokens: int
    text_chars: int
    server_latency_ms: float
    client_latency_ms: float | None  # audio frames only: the client knows when it sent them
    deadline_ms: float
    deadline_met: bool  # on the server's clock
    good: bool  # the server's verdict: output within the deadline
    received_at_s: float  # since the run started
    gap_ms: float | None  # since this session's previous frame result arrived

    @property
    def client_on_time(self) -> bool | None:
        if self.client_latency_ms is None:
            return None
        return self.client_latency_ms <= self.deadline_ms


@dataclass
class SessionOutcome:
    session: int
    outcome: str  # completed | refused | failed | closed_by_server
    detail: str = ""
    retry_after_s: float | None = None
    close_code: int | None = None
    frame_period_s: float | None = None  # as the server announced it
    frames: int = 0
    errors: Counter = field(default_factory=Counter)  # error event codes


@dataclass(frozen=True)
class ClientSettings:
    url: str
    mode: str
    sample_rate_hz: int
    chunk_ms: float
    api_key: str | None


class SessionClient:
    def __init__(self, settings: ClientSettings, index: int, pcm: bytes, origin_s: float,
                 on_frame: Callable[[FrameRecord], None]) -> None:
        self.settings = settings
        self.index = index
        self.pcm = pcm
        self.origin_s = origin_s  # time.monotonic() at the start of the run
        self.on_frame = on_frame
        self.outcome = SessionOutcome(index, "failed")
        self._sent_end_ms: list[float] = []  # per chunk sent: stream position after it
        self._sent_at_s: list[float] = []
        self._text_chars: Counter = Counter()  # response id -> delta characters
        self._last_frame_at_s: float | None = None
        self._expected_frames = 0
        self._answered_audio_frames = 0
        self._deadline_ms = 1000.0

    async def run(self) -> SessionOutcome:
        try:
            conn = await Connection.open(self.settings.url, self.settings.api_key)
            try:
                await self._converse(conn)
            finally:
                await conn.close()
        except InvalidStatus as err:
            self._refused_http(err)
        except ConnectionClosed as err:
            self._closed(err)
        except (OSError, TimeoutError, ValueError) as err:
            self.outcome.outcome, self.outcome.detail = "failed", repr(err)
        return self.outcome

    async def _converse(self, conn: Connection) -> None:
        session = (await conn.update({
            "type": "realtime", "output_modalities": ["text"],
            "audio": {"input": {"format": {"type": "audio/pcm",
                                           "rate": self.settings.sample_rate_hz}}},
            "metronome": {"mode": self.settings.mode},
        }))["metronome"]
        period_s = self.outcome.frame_period_s = session["frame_period_s"]
        self._deadline_ms = session["deadline_s"] * 1e3
        frame_bytes = round(self.settings.sample_rate_hz * period_s) * 2
        self._expected_frames = len(self.pcm) // frame_bytes
        sender = asyncio.create_task(self._send_audio(conn))
        try:
            await asyncio.wait_for(self._receive(conn), self._receive_budget_s())
        except TimeoutError:
            self.outcome.detail = "timed out waiting for frame results"
        finally:
            sender.cancel()
        self.outcome.outcome = "completed"

    def _receive_budget_s(self) -> float:
        return len(self.pcm) / (2 * self.settings.sample_rate_hz) + 2 * self._deadline_ms / 1e3 + 5

    async def _send_audio(self, conn: Connection) -> None:
        rate = self.settings.sample_rate_hz
        chunk_bytes = round(rate * self.settings.chunk_ms / 1000) * 2
        start_s = time.monotonic()
        for offset in range(0, len(self.pcm), chunk_bytes):
            chunk = self.pcm[offset: offset + chunk_bytes]
            end_ms = (offset + len(chunk)) / (2 * rate) * 1e3
            # a microphone delivers a chunk when its last sample has been captured
            await asyncio.sleep(max(0.0, start_s + end_ms / 1e3 - time.monotonic()))
            self._sent_end_ms.append(end_ms)  # before the send: its answer may come first
            self._sent_at_s.append(time.monotonic())
            await conn.append(chunk)

    async def _receive(self, conn: Connection) -> None:
        while self._answered_audio_frames < self._expected_frames:
            event = await conn.recv()
            received_s = time.monotonic()
            if event["type"] == "metronome.frame":
                self._on_frame(event, received_s)
            elif event["type"] == "response.output_text.delta":
                self._text_chars[event["response_id"]] += len(event["delta"])
            elif event["type"] == "error":
                self.outcome.errors[event["error"]["code"]] += 1

    def _on_frame(self, event: dict, received_s: float) -> None:
        frame = event["frame"]
        client_latency_ms = None
        if frame["audio_end_ms"] is not None:
            self._answered_audio_frames += 1
            chunk = bisect.bisect_left(self._sent_end_ms, frame["audio_end_ms"] - 1e-6)
            client_latency_ms = (received_s - self._sent_at_s[chunk]) * 1e3
        gap_ms = None if self._last_frame_at_s is None else (
            received_s - self._last_frame_at_s) * 1e3
        self._last_frame_at_s = received_s
        self.outcome.frames += 1
        self.on_frame(FrameRecord(
            self.index, frame["index"], frame["kind"], frame["status"], frame["num_tokens"],
            self._text_chars.pop(event["response_id"], 0), frame["latency_ms"],
            client_latency_ms, self._deadline_ms, frame["deadline_met"], frame["good"],
            received_s - self.origin_s, gap_ms,
        ))

    def _refused_http(self, err: InvalidStatus) -> None:
        response = err.response
        self.outcome.outcome = "refused" if response.status_code == 503 else "failed"
        self.outcome.detail = f"HTTP {response.status_code}"
        retry_after = response.headers.get("Retry-After")
        self.outcome.retry_after_s = float(retry_after) if retry_after else None

    def _closed(self, err: ConnectionClosed) -> None:
        code = err.rcvd.code if err.rcvd is not None else None
        self.outcome.close_code = code
        self.outcome.outcome = "refused" if code == REFUSED_CLOSE_CODE else "closed_by_server"
        self.outcome.detail = err.rcvd.reason if err.rcvd is not None else str(err)


async def persistent(settings: ClientSettings, index: int, pcm: bytes, origin_s: float,
                     span: tuple[float, float], on_frame: Callable[[FrameRecord], None],
                     min_left_s: float = 3.0) -> dict:
    """A user who keeps trying over `span` (s from `origin_s`, monotonic): refused, it tries
    again after the Retry-After while `min_left_s` of the span is left, streaming `pcm`'s
    start for what is left. Its wait from the span's start, refusals and outcome."""
    (start_s, end_s), refusals = span, 0
    await asyncio.sleep(max(0.0, origin_s + start_s - time.monotonic()))
    while (left_s := end_s - (time.monotonic() - origin_s)) >= min_left_s:
        tried_s = time.monotonic() - origin_s
        outcome = await SessionClient(settings, index, pcm[:round(
            left_s * settings.sample_rate_hz) * 2], origin_s, on_frame).run()
        if outcome.outcome != "refused":
            return {"wait_s": tried_s - start_s, "refusals": refusals,
                    "outcome": outcome.outcome}
        refusals += 1
        await asyncio.sleep(outcome.retry_after_s or 2.0)
    return {"wait_s": None, "refusals": refusals, "outcome": "gave_up"}


BAD_KINDS = ("abrupt", "garbage", "oversized", "no_read", "silent")


async def misbehave(url: str, kind: str, chunk: bytes) -> str:
    """One bad session of `kind` (of `BAD_KINDS`): it vanishes mid-stream, sends malformed
    events, sends over the input bound and the size cap, floods audio without reading, or
    says nothing until the server's idle timeout; what became of it."""
    try:
        conn = await Connection.open(url)
        if kind in ("abrupt", "no_read"):
            for _ in range(15 if kind == "abrupt" else 60):
                await conn.append(chunk)
                await asyncio.sleep(0.1 if kind == "abrupt" else 0)
        elif kind == "silent":
            await asyncio.wait_for(conn.until("(none)"), 15)
        text = {"type": "input_text", "text": "é世😀 " * 2000}
        for message in {"garbage": ["{not json", {"type": "nope"}, b"\x00\x01", {
                "type": "session.update", "session": {"x": 1}}], "oversized": [{
                "type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": [text]}},
                {"type": "input_audio_buffer.append", "audio": "A" * (2 << 20)}]}.get(kind, []):
            await conn.send(message)
        await asyncio.sleep(1.0)
        await conn.drop()
        return "done"
    except (ConnectionClosed, InvalidStatus, OSError, TimeoutError, ValueError) as err:
        return type(err).__name__  # the server closed it, refused it, or sent an error
