"""One session's server events, numbered and kept (the last `max_events` / `max_bytes` of them),
so a client that resumes the session (`resume.lease`) gets what it missed, in order.

Every event the session emits gets the next sequence number and joins the tail; the oldest
fall out when either bound would pass. While the session is leased (no connection), the
events from `hold_from` on are owed to the client: evicting one of those would lose it, so
the append that would do it says so (`False`) and the lease ends instead (nothing is lost
silently). A resuming client names the last event it received (`last_event_id`); without
one, the server replays from the first event its old connection had not handed to the
transport.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from metronome.serve.protocol import ServerEvent, text_bytes

Sink = Callable[[ServerEvent, str, int], None]  # an event, its JSON, its number in the stream


@dataclass(frozen=True)
class MissedEvents:
    texts: list[str]  # the events to send again, oldest first
    first_seq: int  # the number of texts[0]
    missed_events: int  # owed but no longer held (0 unless the tail had to move on)


class EventLog:
    def __init__(self, max_events: int, max_bytes: int) -> None:
        assert max_events >= 1 and max_bytes >= 1, (max_events, max_bytes)
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.next_seq = 0  # the number the next event gets
        self.num_bytes = 0
        self._events: deque[tuple[str, str, int]] = deque()  # (event_id, text, bytes)
        self.hold_from: int | None = None  # leased: events from here on are owed

    @property
    def first_seq(self) -> int:
        """The number of the oldest event still held."""
        return self.next_seq - len(self._events)

    def append(self, event_id: str, text: str) -> bool:
        """Number and keep `text`; False when keeping it evicted an owed event (a lease that
        cannot be honoured). An event larger than `max_bytes` is kept alone."""
        size = text_bytes(text)
        self._events.append((event_id, text, size))
        self.next_seq += 1
        self.num_bytes += size
        kept = True
        while len(self._events) > 1 and (len(self._events) > self.max_events
                                         or self.num_bytes > self.max_bytes):
            if self.hold_from is not None and self.first_seq >= self.hold_from:
                kept = False  # the oldest is owed to a client that is away
            _, _, evicted = self._events.popleft()
            self.num_bytes -= evicted
        assert self.num_bytes >= 0 and len(self._events) <= max(1, self.max_events)
        return kept

    def seq_of(self, event_id: str) -> int | None:
        """The number of a held event, by its `event_id` (newest first: a resume names a
        recent one)."""
        for offset, (held_id, _, _) in enumerate(reversed(self._events)):
            if held_id == event_id:
                return self.next_seq - 1 - offset
        return None

    def since(self, seq: int) -> MissedEvents:
        """The held events numbered `seq` and later, and how many of those are gone."""
        seq = min(max(seq, 0), self.next_seq)
        start = max(seq, self.first_seq)
        skip = start - self.first_seq
        texts = [text for index, (_, text, _) in enumerate(self._events) if index >= skip]
        return MissedEvents(texts, start, start - seq)


class EventChannel:
    """Where one session's events go: numbered and kept in its event log, then to the attached
    connection's sink; while detached (its client dropped, the session leased), only kept.
    A failure of the session goes to the connection (which ends it), or, detached, ends the
    lease."""

    def __init__(self, log: EventLog, sink: Sink, on_failure: Callable[[], None]) -> None:
        self.log = log
        self._sink: Sink | None = sink
        self._failure = on_failure
        self._lost: Callable[[str], None] | None = None  # detached: ends the lease

    @property
    def attached(self) -> bool:
        return self._sink is not None

    def emit(self, event: ServerEvent) -> None:
        text = event.to_json()
        kept = self.log.append(event.event_id, text)
        if self._sink is not None:
            self._sink(event, text, self.log.next_seq - 1)
        elif not kept and self._lost is not None:
            self._lost("lease_overflow")  # an event owed to the client would be lost

    def fail(self) -> None:
        if self._lost is not None:
            self._lost("error")
        else:
            self._failure()

    def detach(self, resume_from_seq: int, on_lost: Callable[[str], None]) -> None:
        """The client is gone: events from `resume_from_seq` on are owed to it; `on_lost`
        ends the session when one cannot be kept, or the session fails."""
        assert 0 <= resume_from_seq <= self.log.next_seq, (resume_from_seq,
                                                              self.log.next_seq)
        self._sink, self._lost = None, on_lost
        self.log.hold_from = resume_from_seq

    def attach(self, sink: Sink, on_failure: Callable[[], None],
               last_event_id: str | None) -> MissedEvents:
        """A resumed client: the events it missed (after `last_event_id` when the log
        still holds it, else from where its old connection stopped); `sink` gets the rest."""
        assert self._sink is None and self.log.hold_from is not None
        start = self.log.hold_from
        if last_event_id is not None:
            seq = self.log.seq_of(last_event_id)
            start = start if seq is None else seq + 1
        missed = self.log.since(start)
        self.log.hold_from = None
        self._sink, self._failure, self._lost = sink, on_failure, None
        return missed
