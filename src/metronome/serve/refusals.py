"""The GA client events this server parses and cannot carry out, each refused by name
(`ErrorCode.UNSUPPORTED`) with why; the README's protocol table lists the same."""

from __future__ import annotations

from metronome.serve import protocol as p
from metronome.serve.protocol import ClientError, ErrorCode

_WHY = {
    "conversation.item.delete": (
        "an item cannot leave the model's context once it is in the session's KV (written "
        "in order; it leaves as the window slides past it)", "item_id"),
    "conversation.item.truncate": (
        "the served model produces no audio, so there is no played position to truncate at: "
        "every word of the item was sent to the client and stays in its context",
        "audio_end_ms"),
    "output_audio_buffer.clear": (
        "no audio is produced, so there is no output audio buffer (OpenAI has it on WebRTC "
        "and SIP only)", None),
}
UNSUPPORTED_EVENT_TYPES = frozenset(_WHY)


def unsupported(event: p.ClientEvent) -> ClientError:
    message, param = _WHY[event.type]
    return ClientError(ErrorCode.UNSUPPORTED, f"{event.type} is not supported here: {message}",
                       param)
