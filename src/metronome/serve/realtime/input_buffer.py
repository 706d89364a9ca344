"""A session's input buffer: the audio its client appends, cut into frames as it arrives and
committed as the user's turns, and the text items it creates.

    append  base64 checked against the room (from its length), decoded; each complete
            frame of `frame_period_s` queued at once (`Intake.queue`): its input is the
            turn's words as Whisper hears them (a session that hears), else the embedding
            front end's audio tokens
    commit  the partial frame queued as the turn's last (`final`: Whisper's last pass), the
            user item (`input_audio_buffer.committed`, the item added and done)
    clear   the partial frame dropped; frames already in the stream are the conversation's
            (a KV is written in order)
    text    `conversation.item.create`: a user or assistant text message, a frame of its
            tokens and an item

A turn that is heard is one user message, written as it is heard (`chat.HeardMessage`, on
the hear stage); its words become `conversation.item.input_audio_transcription.delta`
events of the turn's item once the item exists (a commit names it; words heard before are
held until then) and `.completed` with the turn's transcript after its last frame, for a
client that asked (`audio.input.transcription`). A frame that commits no word is
withdrawn (no input, no slot in the stream).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from metronome.audio.whisper import SEGMENT_MAX_S
from metronome.runtime.profile import SessionMode
from metronome.serve import protocol as p
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol import server as se
from metronome.serve.realtime.audio_input import AudioFramer, decode_pcm16, decoded_bytes
from metronome.serve.realtime.chat import HeardMessage
from metronome.serve.realtime.context import Context
from metronome.serve.realtime.conversation import Conversation
from metronome.serve.realtime.emitter import EventChannel
from metronome.serve.realtime.intake import Intake, token_tensor
from metronome.serve.voice.hearing import Heard, Hearing

ItemContent = se.ContentOut
log = logging.getLogger(__name__)


@dataclass
class TurnWords:
    """A heard turn's words on the loop: held until the turn's item exists, then sent as
    transcription deltas that concatenate to its transcript."""

    words: list[str] = field(default_factory=list)  # the turn's words heard so far
    sent: int = 0  # of them, in deltas already
    item_id: str | None = None  # the turn's committed item, its transcript due
    audio_s: float = 0.0  # the committed turn's audio

    def heard(self, heard: Heard) -> tuple[str | None, str, str | None]:
        """The turn's item (None: not committed yet), the delta due now ("" for none) and,
        after the turn's last frame, its whole transcript (else None)."""
        self.words += heard.words
        item_id = self.item_id
        if item_id is None:
            return None, "", None
        delta = self._unsent()
        if not heard.final:
            return item_id, delta, None
        transcript = " ".join(self.words)
        self.words, self.item_id, self.sent = [], None, 0
        return item_id, delta, transcript

    def committed(self, item_id: str, audio_s: float) -> str:
        """The turn's user item exists (`audio_s` of audio): the words heard before it, as
        one delta."""
        self.item_id, self.audio_s = item_id, audio_s
        return self._unsent()

    def _unsent(self) -> str:
        new = self.words[self.sent:]
        if not new:
            return ""
        text = (" " if self.sent else "") + " ".join(new)
        self.sent = len(self.words)
        return text


class InputBuffer:
    def __init__(self, intake: Intake, context: Context, conversation: Conversation,
                 channel: EventChannel, framer: AudioFramer, hearing: Hearing | None,
                 accepts_audio: bool) -> None:
        self.intake = intake
        self.context = context  # its settings: mode, rate, transcription asked
        self.conversation = conversation
        self.channel = channel
        self.accepts_audio = accepts_audio  # the engine takes the embedding front end's
        self.framer = framer
        self.hearing = hearing  # Whisper hears a turn session's audio (None: embeddings)
        self.message = HeardMessage()  # the hear stage's: the turn's user message
        self.turn = TurnWords()
        self.appended_since_commit_bytes = 0
        self.committed_ms = 0.0  # input stream position of the last commit
        # server VAD's, for the turn under way: where its speech starts and ends, its item
        self.speech_from_ms: float | None = None
        self.speech_end_ms: float | None = None
        self.speech_item_id: str | None = None

    def reconfigured(self, framer: AudioFramer, hearing: Hearing | None) -> None:
        """A new input format before any input: framing and ears for it."""
        self.framer, self.hearing = framer, hearing

    @property
    def holds_audio(self) -> bool:
        """Audio appended since the last commit (a heard turn not committed yet)."""
        return bool(self.appended_since_commit_bytes)

    # ---- audio -------------------------------------------------------------------------------
    def append(self, audio_b64: str) -> bytes:
        """`input_audio_buffer.append`: its PCM, every frame it completes queued."""
        if not self.accepts_audio and self.hearing is None:
            raise ClientError(ErrorCode.AUDIO_UNSUPPORTED, "this server's engine takes text "
                              "only (vLLM's streaming input refuses embeddings): send text "
                              "items with conversation.item.create", "audio")
        # checked from its length, before it is decoded (~3 ms of loop time per MiB)
        self.intake.check_audio_room(self.framer, decoded_bytes(audio_b64))
        pcm = decode_pcm16(audio_b64)
        self.appended_since_commit_bytes += len(pcm)
        for chunk, audio_end_ms in self.framer.cut(pcm):
            self._queue_audio(chunk, audio_end_ms, final=False,
                              turn_bytes=self.appended_since_commit_bytes)
        return pcm

    def commit(self, item_id: str | None = None) -> None:
        """The buffer becomes a user item: `item_id` (a turn's), the speech under way's, or a
        new one."""
        if not self.appended_since_commit_bytes:
            raise ClientError(ErrorCode.COMMIT_EMPTY, "no audio appended since the last commit")
        turn_bytes, self.appended_since_commit_bytes = self.appended_since_commit_bytes, 0
        self._queue_audio(*self.framer.cut_rest(), final=True, turn_bytes=turn_bytes)
        self.committed_ms = self.framer.received_ms
        # a commit mid-speech takes the turn's item id with it
        turn_item_id, self.speech_item_id = self.speech_item_id, None
        item_id = item_id or turn_item_id or p.new_id("item")
        item = se.ItemOut(id=item_id, role="user", content=[ItemContent(type="input_audio")])
        self.channel.emit(se.InputAudioBufferCommitted(
            item_id=item.id, previous_item_id=self.conversation.last_item_id))
        self.add_item(item)
        if self.hearing is not None:
            # the next turn's speech is still to come
            self.speech_from_ms = self.speech_end_ms = None
            audio_s = turn_bytes / self.framer.bytes_per_s
            self._transcribed(item_id, self.turn.committed(item_id, audio_s), None)

    def clear(self) -> None:
        """Audio appended and not yet cut into a frame is dropped; frames already in the
        stream are the conversation's (a KV is written in order)."""
        self.framer.clear_pending()
        self.appended_since_commit_bytes = 0
        self.channel.emit(se.InputAudioBufferCleared())

    def _queue_audio(self, pcm: bytes, audio_end_ms: float, final: bool,
                     turn_bytes: int) -> None:
        if self.hearing is not None:
            self._queue_heard(self.hearing, pcm, audio_end_ms, final, turn_bytes)
            return
        framer = self.framer
        self.intake.queue("audio", lambda: framer.encode(pcm, final), framer.tokens(len(pcm)),
                          respond=self.context.settings.mode is SessionMode.DUPLEX,
                          audio_end_ms=audio_end_ms)

    def _queue_heard(self, hearing: Hearing, pcm: bytes, audio_end_ms: float, final: bool,
                     turn_bytes: int) -> None:
        """A turn's audio frame, heard by Whisper on the hear stage (`voice.hearing`): its
        input is the words it commits, as the turn's user message goes on. It reserves the
        most tokens the turn's audio not yet heard to the end can make."""
        hearing.latest_cut_ms = audio_end_ms
        speech_from_ms = self.speech_from_ms if self.context.settings.turns is not None else (
            self.committed_ms)
        speech_end_ms = self.speech_end_ms if final else None
        queued_at_s = time.monotonic()
        stage, message, chat = self.intake.stage, self.message, self.context.chat
        assert chat is not None, "a session that hears has a tokenizer"
        heard = Heard()  # the stage's pass, read on the loop once the frame is prepared

        def hear() -> torch.Tensor:  # on the hear stage
            nonlocal heard
            start = time.perf_counter()
            heard = hearing.hear(pcm, final, audio_end_ms, speech_from_ms, queued_at_s,
                                 speech_end_ms)
            if heard.passed:
                stage.observe(time.perf_counter() - start)
            piece = message.piece(heard.words, final)
            return token_tensor(chat.ids(piece) if piece else [])

        # a frame commits words of its turn's segment at most (`StreamingTranscript`: a long
        # turn is settled in segments), so a long turn's frames reserve no more than that
        framer = self.framer
        heard_s = min(turn_bytes, SEGMENT_MAX_S * framer.bytes_per_s + 2 * framer.frame_bytes)
        max_tokens = HeardMessage.max_tokens(heard_s / framer.bytes_per_s)
        self.intake.queue("audio", hear, max_tokens, audio_end_ms=audio_end_ms,
                          on_prepared=lambda: self._transcribed(*self.turn.heard(heard)),
                          turn_end=final)

    def hear_ahead(self) -> None:
        """Server VAD heard a pause in the turn's speech: its last pass runs now on the hear
        stage, behind the turn's frames queued there, on their audio and the bytes not cut
        into a frame yet (`Hearing.hear_ahead`); nothing reaches the stream or the client."""
        hearing, speech_from_ms = self.hearing, self.speech_from_ms
        if hearing is None or speech_from_ms is None or not self.appended_since_commit_bytes:
            return
        pcm, end_ms, queued_at_s = self.framer.pending(), self.framer.received_ms, time.monotonic()
        stage = self.intake.stage

        def ahead() -> None:  # on the hear stage
            start = time.perf_counter()
            if hearing.hear_ahead(pcm, end_ms, speech_from_ms, queued_at_s):
                stage.observe(time.perf_counter() - start)

        self.intake.on_stage(ahead, turn_end=True).add_done_callback(_log_failure)

    def _transcribed(self, item_id: str | None, delta: str, transcript: str | None) -> None:
        """The user's words as they are heard: transcription events for a client that asked,
        and the item's transcript once the turn is heard to the end."""
        if item_id is None:
            return
        asked = self.context.settings.transcription is not None
        if delta and asked:
            self.channel.emit(se.InputAudioTranscriptionDelta(item_id=item_id, delta=delta))
        if transcript is not None:
            if asked:
                self.channel.emit(se.InputAudioTranscriptionCompleted(
                    item_id=item_id, transcript=transcript,
                    usage=se.DurationUsage(seconds=round(self.turn.audio_s, 3))))
            self.conversation.set_transcript(item_id, transcript)

    # ---- text items --------------------------------------------------------------------------
    def create_item(self, event: p.ConversationItemCreate) -> None:
        """`conversation.item.create`: a user or assistant text message."""
        item = event.item
        if item.type != "message":
            raise ClientError(ErrorCode.UNSUPPORTED, f"{item.type} items are not served: the "
                              "served model calls no tools", "item.type")
        served: Literal["output_text", "input_text"] = (
            "output_text" if item.role == "assistant" else "input_text")
        for index, part in enumerate(item.content):
            if part.type != served or part.text is None:
                raise ClientError(ErrorCode.UNSUPPORTED, f"a {item.role} item's content is "
                                  f"{served} with text here (got {part.type}); send audio with "
                                  "input_audio_buffer.append", f"item.content[{index}]")
        self.conversation.check_append(event.previous_item_id, item.id)
        chat = self.context.chat
        if chat is None:
            raise no_text()
        text = "".join(part.text or "" for part in item.content)
        self.intake.queue_text(chat, item.role, text, "item.content")
        self.add_item(se.ItemOut(id=item.id or p.new_id("item"), role=item.role,
                                 content=[ItemContent(type=served, text=text)]))

    def add_item(self, item: se.ItemOut) -> None:
        """A complete item (the client's): added and done at once."""
        previous = self.conversation.add(item)
        self.channel.emit(se.ConversationItemAdded(previous_item_id=previous, item=item))
        self.channel.emit(se.ConversationItemDone(previous_item_id=previous, item=item))

    # ---- a checkpoint ------------------------------------------------------------------------
    def saved(self) -> dict:
        return {"framer": self.framer.saved(), "committed_ms": self.committed_ms,
                "appended_since_commit_bytes": self.appended_since_commit_bytes}

    def load(self, saved: dict) -> None:
        self.framer.load(saved["framer"])
        self.committed_ms = saved["committed_ms"]
        self.appended_since_commit_bytes = saved["appended_since_commit_bytes"]


def no_text() -> ClientError:
    return ClientError(ErrorCode.TEXT_UNSUPPORTED, "this model has no tokenizer: text items "
                       "and text responses are not available")


def _log_failure(done: asyncio.Future[None]) -> None:
    """A pass that hears ahead is speculative: if it fails, the turn's own passes still run."""
    if not done.cancelled() and done.exception() is not None:
        log.error("a pass that hears ahead failed", exc_info=done.exception())
