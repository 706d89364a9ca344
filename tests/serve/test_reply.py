"""One `Reply` per response (`serve.realtime.reply`): it closes in one place, once its frame is
answered *and* its voice is done, whichever comes last; and a spoken reply cut because its
client dropped (the session held for a resume) closes `cancelled` like any other.

A fake owner (the session's side: events, conversation, decoding) and a speak stage that is
a `call_soon` on the test's loop; no model, no socket."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from metronome.serve.realtime.conversation import Conversation
from metronome.serve.realtime.reply import Reply
from metronome.serve.realtime.session import HELD_REASON
from metronome.serve.voice.speaking import Speaking
from metronome.stream import Frame, FrameStatus


class Owner:
    extensions = False
    closed = False

    def __init__(self) -> None:
        self.conversation = Conversation()
        self.events: list = []
        self.closed_replies: list[Reply] = []
        self.observed: list = []
        self.gaps_s: list[float] = []  # told as each happened (admission's signal)
        self.clock_s = 0.0

    def emit(self, event) -> None:
        self.events.append(event)

    def text_of(self, token_ids: list[int], flush: bool) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)

    def observe_lm(self, seconds: float) -> None:
        pass

    def observe_reply(self, reply: Reply) -> None:
        self.observed.append(reply.playback)

    def now_s(self) -> float:
        return self.clock_s

    def observe_output_gap(self, gap_s: float) -> None:
        self.gaps_s.append(gap_s)

    text_pace_tokens_per_s = 10.0
    stop_token_ids = frozenset({0})

    def reply_closed(self, reply: Reply) -> None:
        self.closed_replies.append(reply)

    def types(self) -> list[str]:
        return [e.type for e in self.events]


class OneCharVoice:
    def speak(self, text: str, to_rate_hz: int) -> bytes:
        return bytes(2 * len(text))


def _spoken_reply(loop: asyncio.AbstractEventLoop, owner: Owner) -> Reply:
    def run_model(work, due_s):
        future = loop.create_future()
        loop.call_soon(lambda: future.done() or future.set_result(work(OneCharVoice())))
        return future

    stage = SimpleNamespace(run_model=run_model, observe=lambda seconds: None)
    reply = Reply(owner, "resp_1", "item_1", None)
    reply.voice = Speaking(stage, 24000, reply)
    reply.open()
    return reply


def _answered(reply: Reply, status: FrameStatus, reason: str = "") -> Frame[Reply]:
    frame: Frame[Reply] = Frame("sess_1", 0.0, True, "response", reply, index=0)
    frame.status, frame.reason, frame.finish_s = status, reason, 0.5
    frame.token_ids = [7, 4, 11, 11, 14]
    return frame


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_spoken_reply_closes_once_its_frame_is_answered_and_its_voice_is_done():
    async def scenario():
        owner = Owner()
        reply = _spoken_reply(asyncio.get_running_loop(), owner)
        reply.on_tokens([7, 4, 11, 11, 14])  # "hello": no sentence end yet, nothing said
        reply.answered(_answered(reply, FrameStatus.OK))  # the rest goes to the voice
        assert not reply.closed and owner.closed_replies == []  # the voice still speaks
        await _settle()
        return owner, reply

    owner, reply = asyncio.run(scenario())
    assert reply.closed and owner.closed_replies == [reply]  # closed once, when both were done
    assert owner.types()[-1] == "response.done"
    assert owner.types().count("response.done") == 1
    done = owner.events[-1].response
    assert done.status == "completed" and done.output[0].content[0].transcript == "hello"
    assert reply.said == [("hello", 5 / 24000 * 1000)] and reply.token_ids == [7, 4, 11, 11, 14]


def test_a_spoken_reply_cut_because_its_client_dropped_closes_cancelled():
    """A held session's reply frame is answered `cancelled` with the hold's reason, which is
    no reason of OpenAI's: the response is `cancelled` without one (it failed validation
    before, and the failure ended the lease it was held for)."""
    async def scenario():
        owner = Owner()
        reply = _spoken_reply(asyncio.get_running_loop(), owner)
        reply.answered(_answered(reply, FrameStatus.CANCELLED, HELD_REASON))
        await _settle()
        return owner, reply

    owner, reply = asyncio.run(scenario())
    assert owner.closed_replies == [reply]
    details = owner.events[-1].response.status_details
    assert (details.type, details.reason) == ("cancelled", None)


def _text_reply(owner: Owner, n: int = 2) -> Reply:
    reply = Reply(owner, f"resp_{n}", f"item_{n}", None)
    reply.open()
    return reply


def test_a_text_reply_streams_its_text_and_counts_the_gaps_its_reader_had():
    """Each step's tokens go out as a delta at once; read at 10 tokens/s, the 2 tokens sent
    at 0 s last to 0.2 s, so the next step at 0.5 s left the reader waiting 0.3 s."""
    owner = Owner()
    reply = _text_reply(owner)
    reply.frame = _queued(reply, paced=True)  # a turn's reply, as the session queues it
    reply.on_tokens([7, 4])  # "he" at 0 s
    owner.clock_s = 0.1
    reply.on_tokens([11])  # "l", in time (0.2 s buffered)
    owner.clock_s = 0.6
    assert owner.gaps_s == []
    reply.on_tokens([11, 14])  # "lo": 0.3 s after the reader ran dry
    assert owner.gaps_s == [pytest.approx(0.3)]  # told at once, not at the reply's end
    frame = _answered(reply, FrameStatus.OK)
    frame.max_new_tokens = 64  # it stopped before its budget: completed
    reply.answered(frame)
    deltas = [e.delta for e in owner.events if e.type == "response.output_text.delta"]
    assert deltas == ["he", "l", "lo"]
    done = owner.events[-1].response
    assert done.status == "completed" and done.output[0].content[0].text == "hello"
    [playback] = owner.observed
    assert playback.gap_ms == [pytest.approx(300.0)]
    assert reply.pacing().gap_count == 1 and reply.pacing().pace_tokens_per_s == 10.0


def test_a_duplex_frames_gaps_are_counted_but_not_told_to_admission():
    """A duplex frame is not paced: it is judged by its deadline (its result is admission's
    signal already, where a self-paced client is excused); its reader's gaps are its own
    account only."""
    owner = Owner()
    reply = _text_reply(owner)
    reply.frame = _queued(reply, paced=False)
    reply.on_tokens([7, 4])
    owner.clock_s = 0.6
    reply.on_tokens([11])  # 0.4 s after the reader ran dry
    assert owner.gaps_s == []
    assert reply.playback.gap_ms == [pytest.approx(400.0)]


def _queued(reply: Reply, paced: bool) -> Frame[Reply]:
    frame: Frame[Reply] = Frame("sess_1", 0.0, True, "response", reply, index=0)
    frame.paced = paced
    return frame


def test_a_reply_that_spent_its_budget_is_incomplete_for_max_output_tokens():
    owner = Owner()
    reply = _text_reply(owner)
    reply.on_tokens([7, 4, 11, 11, 14])
    frame = _answered(reply, FrameStatus.OK)
    frame.paced, frame.max_new_tokens = True, 5  # a turn's reply, its budget all spent on
    # text: the model had not stopped
    reply.answered(frame)
    details = owner.events[-1].response.status_details
    assert (details.type, details.reason) == ("incomplete", "max_output_tokens")

    stopped = _text_reply(owner, 3)
    stopped.on_tokens([7, 4, 11, 11, 0])
    frame = _answered(stopped, FrameStatus.OK)
    frame.token_ids, frame.max_new_tokens = [7, 4, 11, 11, 0], 5  # its last token a stop
    frame.paced = True
    stopped.answered(frame)
    assert owner.events[-1].response.status == "completed"
