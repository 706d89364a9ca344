"""Client events a taken-over session applies again (`serve.checkpointing`), in their order
and at their place in the conversation.

Each logged event carries how many frames the session had answered when it was first
applied; the new server applies it once the restored session has answered as many. So a
client that waited for a response before its next message (the turn protocol: item, then
`response.create`, then `response.done`, then the next item) is replayed exactly: every
event lands after the replayed response it followed, not in the middle of it. Events the
client sends on the new connection while a replay is pending queue behind it, since the
client sent them after everything before. (A duplex audio stream is replayed at the new
server's pace: its frames are cut where the appends land there.)
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable

# apply(text, logged): logged events are in the store's log already; a live one is not
Apply = Callable[[str, bool], None]


def log_entry(frames_answered: int, event_text: str) -> str:
    """An event as the store's log keeps it."""
    return json.dumps([frames_answered, event_text])


def read_entry(entry: str) -> tuple[int, str]:
    frames_answered, event_text = json.loads(entry)
    return int(frames_answered), event_text


def held_events(client_seq: int, last_event_id: str | None,
                owed: list[str]) -> tuple[int, str | None]:
    """The client events a session holds, for `metronome.session.resumed`: the `client_seq`
    it applied (the last one's id `last_event_id`) and the `owed` ones a replay will apply;
    with the last one's `event_id`."""
    if owed:
        try:
            last = json.loads(owed[-1])
        except ValueError:  # a live event queued behind the replay, not parsed yet
            last = None
        last_event_id = last.get("event_id") if isinstance(last, dict) else None
    return client_seq + len(owed), last_event_id


class Replay:
    def __init__(self, logged: list[tuple[int, str]], apply: Apply) -> None:
        self.apply = apply
        self._queue: deque[tuple[int, str, bool]] = deque(
            (after, text, True) for after, text in logged)

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    @property
    def owed(self) -> list[str]:
        """The events still to apply, in order."""
        return [text for _, text, _ in self._queue]

    def offer(self, text: str) -> None:
        """A live event that arrived while the replay is pending: applied after it."""
        self._queue.append((-1, text, False))

    def due(self, frames_answered: Callable[[], int], quiescent: Callable[[], bool]) -> None:
        """Apply every queued event whose place the session has reached; and the next ones
        while the session is quiescent (no frame will come without input: a frame count
        the replay does not reproduce, e.g. audio cut into frames at another pace, must
        not hold the session's input back for good)."""
        while self._queue and (self._queue[0][0] <= frames_answered() or quiescent()):
            _, text, logged = self._queue.popleft()
            self.apply(text, logged)
