"""The limits on one session's input, each checked before anything of it is accepted: a
refusal is a `ClientError` with the numbers, and the input is refused whole (nothing of it
lost, nothing half-done). The session's `Stream` counts what it has queued; these read it
and never count on their own.

- frames: audio and text frames not answered yet, at most `max_buffered_audio_s` of them;
- queued input tokens: at most the profile's `max_queued_input_tokens` (`Stream.fits`),
  for text before it is tokenized by the most tokens it can make (`ChatText.max_item_tokens`);
- text: at most `max_text_chars` characters a text.
"""

from __future__ import annotations

from metronome.serve.audio_input import AudioFramer
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.stream import Stream


def unanswered_s(stream: Stream, frame_period_s: float) -> float:
    """Input the beat has not answered yet, counting every frame as one period."""
    return stream.unanswered_frames * frame_period_s


def check_room_for_a_frame(stream: Stream, frame_period_s: float,
                           max_buffered_audio_s: float) -> None:
    if unanswered_s(stream, frame_period_s) + frame_period_s > max_buffered_audio_s:
        raise ClientError(ErrorCode.TOO_MANY_PENDING, f"{stream.unanswered_frames} frames "
                          f"are still unanswered (limit {max_buffered_audio_s:g} s of "
                          "frames); retry later")


def check_input_room(stream: Stream, num_tokens: int, what: str, code: ErrorCode,
                     param: str | None = None, upper_bound: bool = False) -> None:
    """Refuse input that would leave more of the session's input unprocessed than its bound
    allows. `upper_bound`: `num_tokens` is the most the input can make (text, before it is
    tokenized: one token per UTF-8 byte at most)."""
    if stream.fits(num_tokens):
        return
    limit, queued = stream.profile.max_queued_input_tokens, stream.queued_input_tokens
    if num_tokens <= limit:
        advice = "retry once the engine has caught up"
    elif upper_bound:
        advice = ("it alone may exceed the limit (text counts one token per UTF-8 byte until "
                  f"it is tokenized): send it in parts of at most {limit} bytes")
    else:
        advice = f"it alone exceeds the limit: send it in parts of at most {limit} tokens"
    size = f"up to {num_tokens}" if upper_bound else f"{num_tokens}"
    raise ClientError(code, f"{what} of {size} tokens refused: {queued} tokens of this "
                      f"session's input are not processed yet (limit {limit}); {advice}", param)


def check_audio_room(stream: Stream, framer: AudioFramer, config: ServerConfig,
                     num_bytes: int) -> None:
    """Room for `num_bytes` more of PCM audio: under the buffered-audio bound (unanswered
    frames' audio, the framer's pending bytes, these) and in the queued-input bound."""
    buffered_s = unanswered_s(stream, config.frame_period_s) + (
        framer.pending_bytes + num_bytes) / framer.bytes_per_s
    if buffered_s > config.max_buffered_audio_s:
        raise ClientError(ErrorCode.BUFFER_OVERFLOW, f"audio is arriving faster than real "
                          f"time: {buffered_s:.2f} s would be unanswered (limit "
                          f"{config.max_buffered_audio_s} s); this chunk was dropped", "audio")
    check_input_room(stream, framer.tokens(framer.pending_bytes + num_bytes), "audio",
                     ErrorCode.BUFFER_OVERFLOW, "audio")


def check_text_length(text: str, max_text_chars: int, param: str) -> None:
    if len(text) > max_text_chars:
        raise ClientError(ErrorCode.TEXT_TOO_LONG, f"text has {len(text)} characters; the "
                          f"limit is {max_text_chars}", param)
