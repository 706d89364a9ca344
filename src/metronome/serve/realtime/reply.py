"""One reply: a response of the session, from `response.created` to `response.done`.

A `Reply` is the one record of a response, as LiveKit's `SpeechHandle` is of a turn's
speech: its ids, the frame that answers it (whose `tag` it is), its voice when it is spoken,
the tokens the model said, what of them was spoken (each sentence with its audio), how it
was cancelled. It opens when it is created (`open`: its assistant item joins the
conversation, `response.created` and the item's and part's `added` events go out) and
closes in one place (`_close`), once both are true: its frame is answered (`answered`, by
the beat) and its voice is done (`on_voice_done`; at once for a reply that is not spoken).
Its events are rendered here (`serve.realtime.rendering`); its owner (the session) hears
`reply_closed` after the last one.

    text reply      each step's tokens ─► decoded ─► output_text.delta
                    answered ─► the rest, its item done, response.done
    spoken reply    each step's tokens ─► decoded ─► the voice (sentences, on the speak
                    stage) ─► on_said: output_audio_transcript.delta + output_audio.delta
                    answered ─► the rest flushed to the voice; the voice done ─►
                    output_audio.done ... response.done

**Length and pace.** A turn's reply is as long as its budget (`max_output_tokens`, within
the server's `--max-response-tokens`) or the model's stop: its frame is paced (the beat
never cuts it at a deadline; its deadline is its first output's). What it sends is played by
its listener (`Playback`: audio at real time, text at the server's reading pace); a piece
sent after the listener ran dry is a gap, counted here and told at its close (the metrics,
and `metronome.reply` to a client that opted in).

`cancel` (`response.cancel`, a barge-in) cancels its frame in the beat (now, or once its
input arrives); a reply whose frame was answered and whose voice still speaks stops at once.

**Truncate.** OpenAI's semantics: the part of an assistant item the user did not hear leaves
the conversation. Here it leaves the KV too, exactly (`Beat.rewind_reply`): the session goes
on token for token as one that never generated the unheard tokens. The engine can do that for
the session's latest reply until it reads its next input (its rewind horizon), so that is
the reply a truncate may name. Where the played audio ends, in tokens: Piper speaks the
reply sentence by sentence, so the audio of each sentence is known; inside the sentence the
cut falls where the time does in its characters, moved back to the last whole word. The kept
tokens are the most whose text has no more (non-space) characters than that. A text reply
has no audio: `audio_end_ms` 0 drops all of it, anything more is past its end (as OpenAI
answers).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any, Protocol

from metronome.runtime.ports import Answer
from metronome.serve import protocol as p
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol import server as se
from metronome.serve.realtime.conversation import Conversation
from metronome.serve.realtime.pacing import Playback
from metronome.serve.realtime.rendering import (
    assistant_item,
    response_opened,
    result_events,
    spoken_close_events,
)
from metronome.serve.voice.speaking import Speaking
from metronome.stream import Frame, FrameStatus

AUDIO_DELTA_MS = 500  # the largest piece of audio in one delta (24 KB of PCM16 at 24 kHz)


class ReplyOwner(Protocol):
    """What a reply uses of its session (`serve.realtime.session.RealtimeSession`)."""

    @property
    def extensions(self) -> bool:
        """Its client takes `metronome.*` events."""

    @property
    def conversation(self) -> Conversation: ...

    @property
    def closed(self) -> bool: ...

    def emit(self, event: p.ServerEvent) -> None: ...

    def text_of(self, token_ids: list[int], flush: bool) -> str:
        """The model's tokens as text, decoded on from the session's last ones."""

    def cancel_frame(self, frame: Frame[Any], reason: str) -> None:
        """Cancel `frame` in the beat (now, or once its input is submitted)."""

    def rewind(self, keep_tokens: int) -> Answer[int]:
        """All but `keep_tokens` of the latest reply out of the KV (`Beat.rewind_reply`)."""

    def observe_lm(self, seconds: float) -> None:
        """A spoken reply's frame took `seconds` of the engine (the `lm` voice stage)."""

    def observe_reply(self, reply: Reply) -> None:
        """`reply` closed: its listener's account (`reply.playback`) for the metrics."""

    def now_s(self) -> float:
        """The server's clock."""

    def observe_output_gap(self, gap_s: float) -> None:
        """Its listener just ran dry for `gap_s` (admission's signal)."""

    @property
    def text_pace_tokens_per_s(self) -> float:
        """The reading pace a text reply is played at (`Playback`)."""

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens the model stops a reply with."""

    def reply_closed(self, reply: Reply) -> None:
        """`reply`'s last event went out."""

    def on_failure(self) -> None: ...


class Reply:
    def __init__(self, owner: ReplyOwner, response_id: str, item_id: str,
                 previous_item_id: str | None, metadata: dict[str, str] | None = None,
                 token_ids: list[int] | None = None,
                 said: list[tuple[str, float]] | None = None) -> None:
        self.owner = owner
        self.response_id = response_id
        self.item_id = item_id  # its assistant item
        self.previous_item_id = previous_item_id  # the conversation's last item when it opened
        self.metadata = metadata
        self.frame: Frame[Reply] | None = None  # the frame that answers it, once queued
        self.voice: Speaking | None = None  # spoken: its voice (`speak`)
        self.token_ids: list[int] = token_ids or []  # as sampled (the stop token included
        # when it came), once its frame is answered; cut by a truncate
        self.said: list[tuple[str, float]] = said or []  # sentences spoken, with audio ms
        self.spoken = ""  # the transcript of what was spoken
        self.audio_bytes = 0
        self.cancel_reason: str | None = None  # why its voice was stopped (None: not, or
        # by the session's close)
        self.answered_frame: Frame[Reply] | None = None  # its frame, once answered
        self.closed = False
        self.text = ""  # a text reply's text, as streamed
        self.playback = Playback()  # its listener

    @classmethod
    def saved_reply(cls, owner: ReplyOwner, saved: dict) -> Reply:
        """A session's latest reply as a checkpoint kept it (`saved`): closed, truncatable."""
        reply = cls(owner, saved.get("response_id", ""), saved["item_id"], None, None,
                    saved["token_ids"], [(text, ms) for text, ms in saved["said"]])
        reply.closed = True
        return reply

    def saved(self) -> dict:
        return {"response_id": self.response_id, "item_id": self.item_id,
                "token_ids": list(self.token_ids), "said": [list(s) for s in self.said]}

    # ---- its life ---------------------------------------------------------------------------
    def open(self) -> None:
        """Its item joins the conversation; `response.created` and what it adds go out."""
        self.owner.conversation.add(assistant_item(self, "in_progress", None))
        for event in response_opened(self, spoken=self.voice is not None):
            self.owner.emit(event)

    def on_tokens(self, token_ids: list[int]) -> None:
        """A step's tokens of its frame: a spoken reply's voice hears them now; a text
        reply's client reads them now (played at the reading pace)."""
        text = self.owner.text_of(token_ids, flush=False)
        if self.voice is not None:
            self.voice.push(text)
            return
        self._stream_text(text, len(token_ids))

    def _stream_text(self, text: str, num_tokens: int) -> None:
        owner = self.owner
        if text:
            owner.emit(se.ResponseOutputTextDelta(response_id=self.response_id,
                                                  item_id=self.item_id, delta=text))
            self.text += text
        if num_tokens:
            self._played(num_tokens / owner.text_pace_tokens_per_s)

    def answered(self, frame: Frame[Reply]) -> None:
        """The beat answered its frame: its text is all written. A text reply closes now;
        a spoken one once its voice has said the rest."""
        self.answered_frame = frame
        owner, voice = self.owner, self.voice
        if voice is None:
            self._stream_text(owner.text_of([], flush=frame.kind == "response"), 0)
            self._close(result_events(frame, self, self.text, owner.extensions,
                                      budget_spent=self.budget_spent(frame),
                                      pacing=self.pacing() if owner.extensions else None))
            return
        if frame.start_s is not None:
            owner.observe_lm(frame.finish_s - frame.start_s)
        voice.push(owner.text_of([], flush=True))
        for event in result_events(frame, self, "", owner.extensions, spoken=True):
            owner.emit(event)
        if frame.status is FrameStatus.CANCELLED:
            self.stop_voice(frame.reason)
        voice.finish()  # its voice done: `on_voice_done` closes it

    def cancel(self, reason: str) -> None:
        """Cancel it (`response.cancel`, a barge-in): its frame in the beat, or, its frame
        answered and its voice still speaking, the voice at once."""
        if self.voice is not None and self.voice.finishing:
            self.stop_voice(reason)
        elif self.frame is not None:
            self.owner.cancel_frame(self.frame, reason)

    def stop_voice(self, reason: str | None) -> None:
        """Nothing more of it is said; it closes `cancelled` (`reason`, the first one given)
        once its frame is answered."""
        if self.voice is not None and not self.voice.cancelled:
            self.cancel_reason = reason
            self.voice.cancel()

    @property
    def speaking(self) -> bool:
        """Its frame is answered and only its voice is still at work."""
        return self.voice is not None and self.voice.finishing

    def budget_spent(self, frame: Frame[Reply]) -> bool:
        """Its output budget ran out before the model stopped (`incomplete`,
        `max_output_tokens`): a paced reply's only (a duplex frame's budget is its frame's)."""
        ids = frame.token_ids
        return (frame.paced and frame.status is FrameStatus.OK
                and 0 < frame.max_new_tokens <= len(ids)
                and ids[-1] not in self.owner.stop_token_ids)

    def pacing(self) -> se.ReplyOut:
        """Its listener's account so far (`metronome.reply`)."""
        playback, frame = self.playback, self.answered_frame
        first_ms = None
        if playback.started_s is not None and frame is not None:
            first_ms = (playback.started_s - frame.arrival_s) * 1e3
        return se.ReplyOut(
            first_output_ms=first_ms, output_tokens=0 if frame is None else len(frame.token_ids),
            played_ms=playback.played_s * 1e3,
            pace_tokens_per_s=None if self.voice is not None
            else self.owner.text_pace_tokens_per_s,
            gap_count=playback.gap_count, gap_ms=playback.total_gap_ms,
            max_gap_ms=max(playback.gap_ms, default=0.0))

    def _close(self, events: list[p.ServerEvent]) -> None:
        """Its closing events out (its item's final form kept in the conversation); the
        owner hears it is over."""
        assert not self.closed, self.response_id
        owner = self.owner
        owner.observe_reply(self)
        for event in events:
            if isinstance(event, se.ResponseOutputItemDone):
                owner.conversation.update(event.item)
            owner.emit(event)
        frame = self.answered_frame
        self.token_ids = [] if frame is None else list(frame.token_ids)
        self.closed = True
        owner.reply_closed(self)

    # ---- its voice (`SpeechListener`) ---------------------------------------------------------
    def on_said(self, sentence: str, pcm: bytes) -> None:
        """A sentence spoken: its transcript, then its audio in pieces of `AUDIO_DELTA_MS`."""
        voice = self.voice
        assert voice is not None
        emit, rid, item_id = self.owner.emit, self.response_id, self.item_id
        piece = (" " if self.spoken else "") + sentence
        self.spoken += piece
        emit(se.ResponseOutputAudioTranscriptDelta(response_id=rid, item_id=item_id,
                                                   delta=piece))
        step = voice.rate_hz * 2 * AUDIO_DELTA_MS // 1000
        for start in range(0, len(pcm), step):
            emit(se.ResponseOutputAudioDelta(response_id=rid, item_id=item_id,
                                             delta=base64.b64encode(pcm[start:start + step])
                                             .decode()))
        self.audio_bytes += len(pcm)
        audio_ms = len(pcm) / (2 * voice.rate_hz) * 1000
        self.said.append((sentence, audio_ms))
        self._played(audio_ms / 1000)

    def _played(self, duration_s: float) -> None:
        """A piece of `duration_s` of playing time sent now; a gap it ends is told now, if
        its frame is paced (a turn's reply: the server alone sets its pace). A duplex frame
        is judged by its own deadline, as every frame is: its result is already admission's
        signal, and a client flooding its own input is excused there (`admission.pacing`);
        its gaps told too would count its lateness twice and past that excuse (a text flood
        in duplex mode cut the cap 8 -> 5 after it left, the attack-admission test)."""
        gap_s = self.playback.add(self.owner.now_s(), duration_s)
        frame = self.frame
        if gap_s > 0 and frame is not None and frame.paced:
            self.owner.observe_output_gap(gap_s)

    def on_voice_done(self) -> None:
        frame = self.answered_frame
        assert frame is not None, "a voice is done only once its frame was answered"
        self._close(spoken_close_events(
            frame, self, self.spoken, self.cancel_reason, self.budget_spent(frame),
            self.pacing() if self.owner.extensions else None))

    def on_voice_failed(self) -> None:
        self.owner.on_failure()

    def sentence_due_s(self, queued_audio_s: float) -> float:
        """Its listener runs dry `queued_audio_s` after what it was sent runs out; before its
        first audio, its first audio is due now: at its frame's arrival (the speak stage's
        order, `Speaking`)."""
        playback = self.playback
        if playback.started_s is not None:
            return playback.ends_at_s + queued_audio_s
        frame = self.frame
        return (self.owner.now_s() if frame is None else frame.arrival_s) + queued_audio_s

    # ---- truncate ----------------------------------------------------------------------------
    @property
    def audio_ms(self) -> float:
        return sum(ms for _, ms in self.said)

    def heard_chars(self, audio_end_ms: float) -> int:
        """Non-space characters of the spoken text heard by `audio_end_ms`."""
        heard, elapsed = 0, 0.0
        for sentence, ms in self.said:
            if audio_end_ms >= elapsed + ms:
                heard += _visible(sentence)
                elapsed += ms
                continue
            cut = int(len(sentence) * max(0.0, audio_end_ms - elapsed) / ms) if ms else 0
            if cut < len(sentence) and not sentence[cut].isspace():
                cut = sentence.rfind(" ", 0, cut) + 1  # back to the last whole word
            return heard + _visible(sentence[:cut])
        return heard

    def kept_tokens(self, audio_end_ms: float, decode: Callable[[list[int]], str]) -> int:
        """How many of its tokens were heard by `audio_end_ms` (`decode`: ids -> text)."""
        if audio_end_ms >= self.audio_ms > 0:
            return len(self.token_ids)
        heard = self.heard_chars(audio_end_ms)
        keep = 0
        while keep < len(self.token_ids) and _visible(decode(self.token_ids[:keep + 1])) <= heard:
            keep += 1
        return keep

    def truncate(self, event: p.ConversationItemTruncate,
                 decode: Callable[[list[int]], str]) -> None:
        """Cut its item where the client's audio stopped (`event`, checked by the session to
        name this reply's item and part): its unheard tokens leave the item and the KV;
        `conversation.item.truncated` once the engine has rewound, else an `error` (input
        was read meanwhile: the horizon passed)."""
        if event.audio_end_ms > self.audio_ms:
            raise ClientError(ErrorCode.INVALID_VALUE, f"audio_end_ms {event.audio_end_ms} is "
                              f"past the end of the item's audio ({self.audio_ms:.0f} ms)",
                              "audio_end_ms")
        keep = self.kept_tokens(event.audio_end_ms, decode)
        owner = self.owner

        def rewound(done: Answer[int]) -> None:
            if owner.closed or done.cancelled():
                return
            error = done.exception()
            if error is not None:
                owner.emit(p.ErrorEvent.of(ClientError(
                    ErrorCode.INVALID_VALUE, f"item {self.item_id!r} can no longer be "
                    f"truncated: {error}", "item_id"), event.event_id))
                return
            self.token_ids = self.token_ids[:keep]
            owner.conversation.update(_cut(owner.conversation.get(self.item_id),
                                           decode(self.token_ids)))
            owner.emit(se.ConversationItemTruncated(item_id=self.item_id,
                                                    content_index=event.content_index,
                                                    audio_end_ms=event.audio_end_ms))

        owner.rewind(keep).add_done_callback(rewound)


def _visible(text: str) -> int:
    return sum(not c.isspace() for c in text)


def _cut(item: se.ItemOut, text: str) -> se.ItemOut:
    """`item` with its content's words cut to `text` (a transcript, or the text)."""
    content = [part.model_copy(update={"transcript": text} if part.type == "output_audio"
                               else {"text": text}) for part in item.content[:1]]
    return item.model_copy(update={"content": content})
