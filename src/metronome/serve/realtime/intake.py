"""The one way into a session's `Stream`: accept a frame, prepare its input on the hear stage,
submit it to the beat.

    queue ─► limits checked (here, once) ─► Frame accepted in the stream (Beat.accept: it
             counts from now on, at the most tokens its input can make)          [loop]
          ─► hear stage: prepare its input (Whisper's words, the embedding front
             end's audio, text tokenized), in the order the client sent it       [audio]
          ─► the owner hears it is prepared (a duplex frame opens its reply) ─►
             Beat.submit (or withdrawn: no input came)                           [loop]

Every frame passes the hear stage's queue, text too, so frames reach the stream in the order
the client sent them and no encoding or tokenizing runs on the loop. A frame arrives when
it is queued (audio: when its last byte did), so preparing it counts in its latency.

The stage is shared by every session and goes by deadline (`on_stage`): a session's work is
due when it arrives, a turn's end (the pass that answers it, or the one heard ahead at a
pause) `TURN_END_AHEAD_S` sooner, so it goes before other sessions' partial passes queued
with it; a session's own work is due no sooner than its earlier work, so it stays in order.
One talker's stream of passes thus cannot hold a neighbour's turn end behind it.

The limits on the session's input, each checked before anything of it is accepted: a
refusal is a `ClientError` with the numbers, and the input is refused whole (nothing of it
lost, nothing half-done). The stream counts what the session has queued; the limits read it
and never count on their own:

- frames: audio and text frames not answered yet, at most `max_buffered_audio_s` of them;
- queued input tokens: at most the profile's `max_queued_input_tokens` (`Stream.fits`),
  for text before it is tokenized by the most tokens it can make (`ChatText.max_item_tokens`);
- audio: its unanswered frames, its partial frame and a new chunk within
  `max_buffered_audio_s`, checked from the chunk's base64 length before it is decoded --
  for a client whose audio is ahead of real time (`RealTimePace`). A client sending at real
  time is never refused there: the server fell behind, not the client, so its audio is kept
  (up to `max_behind_audio_s`, a memory bound, then refused `server_behind`), the owner is
  told (`input_behind`: a notice to the client, a metric, admission's signal);
- text: at most `max_text_chars` characters a text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from metronome.runtime.beat import Beat
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.realtime.audio_input import AudioFramer
from metronome.serve.realtime.chat import ChatText
from metronome.serve.realtime.reply import Reply
from metronome.serve.voice.stage import Stage
from metronome.stream import Frame, FrameKind, Stream

log = logging.getLogger(__name__)
T = TypeVar("T")

Prepare = Callable[[], torch.Tensor]  # a frame's input, made on the hear stage
TURN_END_AHEAD_S = 2.0  # a turn's end goes before others' work that arrived this much sooner


class IntakeOwner(Protocol):
    """The session whose input this is (`serve.realtime.session.RealtimeSession`)."""

    @property
    def closed(self) -> bool: ...

    def input_prepared(self, frame: Frame[Reply]) -> None:
        """`frame`'s input is ready and goes to the beat next (a duplex frame opens its
        reply here)."""

    def on_failure(self) -> None:
        """Preparing a frame's input raised (logged): the session cannot go on."""

    def input_behind(self, unanswered_s: float, ahead_s: float, first: bool) -> None:
        """A chunk of real-time audio was kept past `max_buffered_audio_s` unanswered: the
        server is behind (`first`: the first chunk of this stretch behind)."""


REAL_TIME_SLACK_S = 2.0  # audio this far ahead of the wall clock, its latest chunk included,
# is still real time: chunks of up to ~1.5 s and network jitter (OpenAI's SDKs send 20-100 ms
# chunks); one chunk larger than this is a burst, ahead by itself
MAX_CATCH_UP_S = 2.0  # audio sent after a quiet spell may catch up this much, no more


class RealTimePace:
    """How far a client's audio is ahead of real time: each chunk adds its duration, the wall
    clock takes it away; credit for being behind (a client quiet for a while, as push-to-talk
    ones are) is capped at `MAX_CATCH_UP_S`, so a burst after a pause is still seen. The same
    running account as `admission.pacing.SelfPacing`'s per frame, kept here per chunk as it
    arrives (before it is a frame) and capped before the chunk is added, not after: a 5 s
    burst after a long quiet spell is 3 s ahead here, where SelfPacing's cap would forgive
    it whole."""

    def __init__(self) -> None:
        self._ahead_s = 0.0
        self._at_s: float | None = None

    def ahead_s(self, now_s: float, audio_s: float = 0.0) -> float:
        """Ahead of real time once `audio_s` more arrives now (not recorded: `add`)."""
        if self._at_s is None:
            return audio_s
        return max(self._ahead_s - (now_s - self._at_s), -MAX_CATCH_UP_S) + audio_s

    def add(self, now_s: float, audio_s: float) -> None:
        self._ahead_s, self._at_s = self.ahead_s(now_s, audio_s), now_s


class Intake:
    def __init__(self, owner: IntakeOwner, beat: Beat, stage: Stage, now_s: Callable[[], float],
                 stream: Stream, frame_period_s: float, max_buffered_audio_s: float,
                 max_text_chars: int, max_behind_audio_s: float | None = None) -> None:
        self.owner = owner
        self.beat = beat
        self.stage = stage  # the hear stage: every frame's input is prepared there
        self.now_s = now_s
        self.stream = stream
        self.frame_period_s = frame_period_s
        self.max_buffered_audio_s = max_buffered_audio_s
        self.max_behind_audio_s = max(max_buffered_audio_s, max_behind_audio_s or 0.0)
        self.max_text_chars = max_text_chars
        self.pace = RealTimePace()  # the client's audio against the wall clock
        self.behind = False  # in a stretch of real-time audio kept past the buffer bound
        self.started = False  # input has reached the stream: mode and rate are fixed
        self._counted: asyncio.Future[None] | None = None  # `reading_paused`'s
        self._due_s = -float("inf")  # the latest deadline its work was given on the stage

    def on_stage(self, work: Callable[[], T], turn_end: bool = False) -> asyncio.Future[T]:
        """`work` on the hear stage, due now (`turn_end`: `TURN_END_AHEAD_S` sooner), never
        before the session's earlier work."""
        ahead_s = TURN_END_AHEAD_S if turn_end else 0.0
        self._due_s = max(self._due_s, self.now_s() - ahead_s)
        return self.stage.run(work, self._due_s)

    # ---- frames ------------------------------------------------------------------------------
    def queue(self, kind: FrameKind, prepare: Prepare, num_tokens: int, respond: bool = False,
              audio_end_ms: float | None = None, reply: Reply | None = None,
              on_prepared: Callable[[], None] | None = None,
              output_budget_tokens: int | None = None, paced: bool = False,
              turn_end: bool = False) -> Frame[Reply]:
        """A frame accepted now, counted at `num_tokens` (the most its input can make; the
        caller checked the room), its input `prepare`d on the stage, then submitted;
        `reply`: the reply it answers (None: a duplex frame's is opened once its input is
        ready); `on_prepared`: run on the loop once its input is ready;
        `output_budget_tokens`, `paced`: a turn's reply's (`Frame`); `turn_end`: its turn's
        last audio (`on_stage`)."""
        self.started = True
        frame: Frame[Reply] = Frame(self.stream.id, self.now_s(), respond, kind, reply,
                                    audio_end_ms, input_tokens=num_tokens,
                                    output_budget_tokens=output_budget_tokens, paced=paced)
        self.beat.accept(self.stream, frame)
        self.on_stage(prepare, turn_end).add_done_callback(
            lambda done: self._prepared(done, frame, on_prepared))
        return frame

    def queue_text(self, chat: ChatText, role: str, text: str, param: str) -> None:
        """A text message into the model's context. Nothing is tokenized on the loop: the
        room is checked against the most tokens the text can make (`ChatText.max_item_tokens`,
        from its UTF-8 size: O(1) for ASCII), which is reserved in the stream's queued input
        until the stage has tokenized it. So a text that may not fit costs no tokenizer time
        at all, and one session's tokenizing is bounded by what the engine takes of its own
        input."""
        self.check_text(text, param)
        max_tokens = chat.max_item_tokens(role, text)
        self._queue_context(lambda: token_tensor(chat.item_ids(role, text)), max_tokens,
                            "text item", param, upper_bound=True)

    def queue_ids(self, role: str, ids: list[int], param: str) -> None:
        """A message tokenized already (instructions) into the model's context."""
        self._queue_context(lambda: token_tensor(ids), len(ids), f"{role} message", param)

    @property
    def input_is_context(self) -> bool:
        """Whether input that asks for no answer is context (`Beat.append_context`): in a
        turn session; a duplex session answers every frame, text too."""
        return self.stream.profile.output_tokens_for(False) == 0

    def _queue_context(self, prepare: Prepare, max_tokens: int, what: str, param: str,
                       upper_bound: bool = False) -> None:
        """Input that asks for no answer: in a turn session context, limited only by the
        session's queued input (a burst of history is what clients restore); in a duplex
        one a frame (answered, so counted among the frames)."""
        context = self.input_is_context
        if not context:
            self.check_room_for_a_frame()
        self.check_input_room(max_tokens, what, ErrorCode.TOO_MANY_PENDING, param,
                              upper_bound=upper_bound)
        if not context:
            self.queue("text", prepare, max_tokens)
            return
        self.started = True
        self.beat.accept_context(self.stream, max_tokens)
        self.on_stage(prepare).add_done_callback(
            lambda done: self._context_prepared(done, max_tokens))

    def reading_paused(self) -> asyncio.Future[None] | None:
        """While context being prepared is counted at its most and that fills over half the
        session's bound, the client's next message waits (its connection reads no further)
        until the stage has counted what it holds: a burst of history is then checked at the
        tokens it makes, not at one per byte (50 items of 200 words: 28 accepted without the
        wait, as the loop read them all before any was tokenized). The future is done when
        the next piece of context is counted; None: read on."""
        stream = self.stream
        limit = stream.profile.max_queued_input_tokens
        if (stream.preparing_context_tokens == 0 or limit is None
                or 2 * stream.queued_input_tokens <= limit):
            return None
        if self._counted is None or self._counted.done():
            self._counted = asyncio.get_running_loop().create_future()
        return self._counted

    def _context_prepared(self, done: asyncio.Future[torch.Tensor], max_tokens: int) -> None:
        if self._counted is not None and not self._counted.done():
            self._counted.set_result(None)  # the connection may read the next message
        if self.owner.closed or done.cancelled():
            return  # the session ended (its stream with it) or the server is stopping
        error = done.exception()
        ids = None if error is not None else done.result()
        refusal = self.beat.append_context(self.stream, max_tokens, ids, self.now_s())
        if error is not None:
            log.error("session %s: preparing its context failed", self.stream.id,
                      exc_info=error)
            self.owner.on_failure()
        elif refusal:  # only an engine's limit or an ended session: never the client's doing
            log.warning("session %s: context refused by the engine: %s", self.stream.id,
                        refusal)

    def _prepared(self, done: asyncio.Future[torch.Tensor], frame: Frame[Reply],
                  on_prepared: Callable[[], None] | None) -> None:
        if self.owner.closed or done.cancelled():
            return  # the session ended (its stream with it) or the server is stopping
        error = done.exception()
        if error is not None:
            log.error("session %s: preparing a frame failed", self.stream.id, exc_info=error)
            self.beat.withdraw(frame)
            self.owner.on_failure()
            return
        if on_prepared is not None:
            on_prepared()
        data = done.result()
        if frame.kind == "audio" and len(data) == 0:
            self.beat.withdraw(frame)  # a commit with less than a token of audio left
            return
        self.owner.input_prepared(frame)
        audio = data.is_floating_point()
        self.beat.submit(frame, self.now_s(), token_ids=None if audio else data,
                         embeddings=data if audio else None)  # may answer it at once

    # ---- the limits --------------------------------------------------------------------------
    @property
    def unanswered_s(self) -> float:
        """Input the beat has not answered yet, counting every frame as one period."""
        return self.stream.unanswered_frames * self.frame_period_s

    def check_room_for_a_frame(self) -> None:
        if self.unanswered_s + self.frame_period_s > self.max_buffered_audio_s:
            raise ClientError(ErrorCode.TOO_MANY_PENDING, f"{self.stream.unanswered_frames} "
                              f"frames are still unanswered (limit {self.max_buffered_audio_s:g}"
                              " s of frames); retry later")

    def check_input_room(self, num_tokens: int, what: str, code: ErrorCode,
                         param: str | None = None, upper_bound: bool = False) -> None:
        """Refuse input that would leave more of the session's input unprocessed than its
        bound allows. `upper_bound`: `num_tokens` is the most the input can make (text,
        before it is tokenized: one token per UTF-8 byte at most)."""
        stream = self.stream
        if stream.fits(num_tokens):
            return
        limit, queued = stream.profile.max_queued_input_tokens, stream.queued_input_tokens
        if limit is not None and num_tokens <= limit:
            room = max(0, limit - queued)
            fits = f"{room} tokens fit now" + (
                " (a text counts one per UTF-8 byte until it is tokenized)" if upper_bound
                else "")
            advice = f"{fits}; retry once the engine has caught up"
        elif upper_bound:
            advice = ("it alone may exceed the limit (text counts one token per UTF-8 byte "
                      f"until it is tokenized): send it in parts of at most {limit} bytes")
        else:
            advice = f"it alone exceeds the limit: send it in parts of at most {limit} tokens"
        size = f"up to {num_tokens}" if upper_bound else f"{num_tokens}"
        raise ClientError(code, f"{what} of {size} tokens refused: {queued} tokens of this "
                          f"session's input are not processed yet (limit {limit}); {advice}",
                          param)

    def check_audio_room(self, framer: AudioFramer, num_bytes: int) -> None:
        """Room for `num_bytes` more of PCM audio, arriving now: under the buffered-audio
        bound (unanswered frames' audio, the framer's pending bytes, these) if the client is
        ahead of real time, under `max_behind_audio_s` if it is not (the server is behind:
        the owner is told), and in the queued-input bound. The chunk counts in the client's
        pace whether it is taken or not (it was sent)."""
        now_s, chunk_s = self.now_s(), num_bytes / framer.bytes_per_s
        ahead_s = self.pace.ahead_s(now_s, chunk_s)
        self.pace.add(now_s, chunk_s)
        buffered_s = self.unanswered_s + (framer.pending_bytes + num_bytes) / framer.bytes_per_s
        if buffered_s <= self.max_buffered_audio_s:
            self.behind = False
        elif ahead_s > REAL_TIME_SLACK_S:
            raise ClientError(ErrorCode.BUFFER_OVERFLOW, f"audio is arriving faster than real "
                              f"time ({ahead_s:.1f} s ahead of it): {buffered_s:.2f} s would be "
                              f"unanswered (limit {self.max_buffered_audio_s:g} s for audio "
                              f"ahead of real time); this chunk was dropped: send audio at "
                              f"the pace it plays", "audio")
        elif buffered_s > self.max_behind_audio_s:
            raise ClientError(ErrorCode.SERVER_BEHIND, f"the server is behind: {buffered_s:.1f}"
                              f" s of this session's audio, sent at real time, would be "
                              f"unanswered (the most it keeps: {self.max_behind_audio_s:g} s); "
                              f"this chunk was dropped: the server is overloaded, not your "
                              f"client", "audio")
        else:
            self.owner.input_behind(buffered_s, ahead_s, first=not self.behind)
            self.behind = True
        self.check_input_room(framer.tokens(framer.pending_bytes + num_bytes), "audio",
                              ErrorCode.BUFFER_OVERFLOW, "audio")

    def check_text(self, text: str, param: str) -> None:
        if len(text) > self.max_text_chars:
            raise ClientError(ErrorCode.TEXT_TOO_LONG, f"text has {len(text)} characters; the "
                              f"limit is {self.max_text_chars}", param)


def token_tensor(token_ids: list[int]) -> torch.Tensor:
    """Token ids as an int64 tensor, made on the stage: the loop's check of a frame
    (`check_token_ids`) is then a min and a max, not a conversion of each id (~0.3-0.9 ms on
    the loop for a 4,000-character text's ~2,600 ids)."""
    return torch.tensor(token_ids, dtype=torch.int64)
