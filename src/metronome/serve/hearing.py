"""One session's ears: its audio frames become the user's words in its KV, as they arrive.

A turn session's audio frames (`serve.audio_input` cuts them) go to the encoder thread as
before, but instead of the stand-in projection each is heard by Whisper
(`audio.whisper.StreamingTranscript`): the words two passes agree on are committed and
their tokens are that frame's input, so the user's message is already in the KV when the
turn ends; the turn's last frame (the commit) commits the rest and closes the message. A
frame that commits no word is withdrawn (no input, no slot in the stream).

The user message is ChatML like a text item: `<|im_start|>user\\n` before the turn's first
word, `<|im_end|>\\n` after its last (SmolLM2's byte-level BPE splits before each
space-led word, so words tokenized piece by piece are the tokens of the whole).

Loop side: the words heard become `conversation.item.input_audio_transcription.delta`
events of the turn's user item once it exists (a commit names it; words heard before are
held until then) and `.completed` with the turn's whole transcript after its last frame;
only for a client that asked (`audio.input.transcription`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from metronome.audio.pcm import decode_pcm16_array
from metronome.audio.whisper import StreamingTranscript, Whisper
from metronome.serve.text import ChatText

MESSAGE_FRAMING_TOKENS = 8  # <|im_start|>user\n ... <|im_end|>\n, with room
MAX_TOKENS_PER_SPEECH_S = 12  # ~4 words/s of fast speech at <= 3 tokens a word
PARTIAL_PASS_MAX_WAIT_S = 0.1  # a frame that waited longer for the encoder skips its partial pass


@dataclass
class Heard:
    """What one frame's pass committed (written on the encoder thread before its future
    resolves, read on the loop after)."""

    words: list[str] = field(default_factory=list)
    final: bool = False
    passed: bool = False  # a Whisper pass ran for it (not shed, not skipped)


class Hearing:
    def __init__(self, whisper: Whisper, chat: ChatText, sample_rate_hz: int) -> None:
        self.transcript = StreamingTranscript(whisper, sample_rate_hz)
        self.chat = chat
        self.sample_rate_hz = sample_rate_hz
        self._message_open = False  # encoder thread: a user message is open in the KV
        # ---- the loop's
        self.latest_cut_ms = 0.0  # the end of the newest frame queued
        self.speech_from_ms: float | None = None  # the turn's speech start (server VAD's)
        self.speech_end_ms: float | None = None  # and its end, once VAD stopped it
        self.turn_words: list[str] = []  # the turn's words heard so far
        self._sent_words = 0  # of them, in transcription deltas already
        self.turn_audio_s = 0.0  # the committed turn's audio
        self.item_id: str | None = None  # the turn's committed item, its transcript due

    @staticmethod
    def max_tokens(turn_audio_bytes: int, sample_rate_hz: int) -> int:
        """The most tokens a frame can commit when the turn holds this much audio not yet
        heard to the end: the room it reserves in the stream until it is heard."""
        seconds = turn_audio_bytes / (2 * sample_rate_hz)
        return MESSAGE_FRAMING_TOKENS + math.ceil(seconds * MAX_TOKENS_PER_SPEECH_S)

    # ---- on the encoder thread ---------------------------------------------------------------
    def hear(self, pcm: bytes, final: bool, audio_end_ms: float, speech_from_ms: float | None,
             heard: Heard, queued_at_s: float, speech_end_ms: float | None = None) -> list[int]:
        """One frame's audio heard: the token ids of the words it commits (framed), and the
        words in `heard`; `speech_from_ms`: where its turn's speech starts, as the loop knew
        when it queued the frame (None: no speech yet; `queued_at_s`: `time.monotonic()`
        then). A turn's partial pass is speculative work, shed first: skipped while a newer
        frame of the session is queued behind this one (it would hear the same turn with
        less audio), and while the encoder thread is behind (the frame waited longer than
        `PARTIAL_PASS_MAX_WAIT_S`), so a turn's last pass is never queued behind others'
        speculation. Under load the words arrive later, never wrong."""
        samples = decode_pcm16_array(pcm)
        waited_s = time.monotonic() - queued_at_s
        pass_now = final or (self.latest_cut_ms <= audio_end_ms
                             and waited_s <= PARTIAL_PASS_MAX_WAIT_S)
        passes = self.transcript.passes
        words = self.transcript.push(samples, audio_end_ms, final, speech_from_ms, pass_now,
                                     speech_end_ms)
        heard.words, heard.final = words, final
        heard.passed = self.transcript.passes > passes
        text = " ".join(words)
        opens = bool(words) and not self._message_open
        closes = final and (self._message_open or opens)
        if not (words or closes):
            return []
        piece = ("<|im_start|>user\n" + text) if opens else (" " + text if text else "")
        if closes:
            piece += "<|im_end|>\n"
        self._message_open = not closes and (self._message_open or opens)
        return self.chat.tokenizer.encode(piece).ids

    # ---- on the loop ---------------------------------------------------------------------------
    def heard_words(self, heard: Heard) -> tuple[str | None, str, str | None]:
        """The turn's item (None: not committed yet), the transcription delta due now (""
        for none) and, after the turn's last frame, its whole transcript (else None)."""
        self.turn_words += heard.words
        item_id = self.item_id
        if item_id is None:
            return None, "", None
        delta = self._unsent()
        if not heard.final:
            return item_id, delta, None
        transcript = " ".join(self.turn_words)
        self.turn_words, self.item_id, self._sent_words = [], None, 0
        return item_id, delta, transcript

    def committed(self, item_id: str, audio_s: float) -> str:
        """The turn's user item exists (`audio_s` of audio): the words heard before it, as
        one delta."""
        self.item_id, self.turn_audio_s = item_id, audio_s
        return self._unsent()

    def _unsent(self) -> str:
        """The turn's words not yet in a delta; deltas concatenate to the transcript."""
        new = self.turn_words[self._sent_words:]
        if not new:
            return ""
        text = (" " if self._sent_words else "") + " ".join(new)
        self._sent_words = len(self.turn_words)
        return text
