"""One connection's outbox: server events (JSON text) waiting for the writer task, bounded in
events and in bytes. An event that does not fit is not queued: `put` says so, and the
connection treats a full outbox as a client that does not read. An event counts until the
writer has handed it to the transport (`sent`), so a writer stuck on a full socket keeps
its event in the count. A session's events carry their number in the session's stream
(`serve.realtime.emitter`): the outbox remembers the last one handed to the transport
(`delivered_seq`), where a resumed session's replay starts when its client does not say."""

from __future__ import annotations

import asyncio
from collections import deque

from metronome.serve.protocol import text_bytes


class Outbox:
    def __init__(self, max_events: int, max_bytes: int) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._texts: deque[str] = deque()
        self._sizes: deque[int] = deque()  # of _texts, then of the one being sent
        self._seqs: deque[int | None] = deque()  # beside _sizes: a session event's number
        self.delivered_seq: int | None = None  # the last session event sent
        self._ready = asyncio.Event()  # set while _texts holds an event
        self._empty = asyncio.Event()  # set while nothing is queued or being sent
        self._empty.set()

    @property
    def num_events(self) -> int:
        return len(self._sizes)

    def put(self, text: str, seq: int | None = None) -> bool:
        """Queue `text` (a session event numbered `seq`, or a connection's own: None); False
        (and nothing queued) when it would pass either bound."""
        size = text_bytes(text)
        if self.num_events >= self.max_events or self.num_bytes + size > self.max_bytes:
            return False
        self._texts.append(text)
        self._sizes.append(size)
        self._seqs.append(seq)
        self.num_bytes += size
        self._ready.set()
        self._empty.clear()
        return True

    async def get(self) -> str:
        """The oldest queued event; it still counts until `sent()`."""
        while not self._texts:
            await self._ready.wait()
        text = self._texts.popleft()
        if not self._texts:
            self._ready.clear()
        return text

    def sent(self) -> None:
        """The event `get` returned has gone to the transport."""
        self.num_bytes -= self._sizes.popleft()
        seq = self._seqs.popleft()
        if seq is not None:
            self.delivered_seq = seq
        if not self._sizes:
            self._empty.set()

    async def join(self) -> None:
        """Wait until every queued event has been sent."""
        await self._empty.wait()

    def clear(self) -> None:
        """Forget every event, the one being sent too (the writer has stopped)."""
        self._texts.clear()
        self._sizes.clear()
        self._seqs.clear()
        self.num_bytes = 0
        self._ready.clear()
        self._empty.set()
