"""What of a session's latest reply the client heard, for `conversation.item.truncate`.

OpenAI's semantics: the part of an assistant item the user did not hear leaves the
conversation. Here it leaves the KV too, exactly (`Engine.rewind_reply`): the session goes on
token for token as one that never generated the unheard tokens. The engine can do that for the
session's latest reply until it reads its next input (its rewind horizon: it holds the blocks
a rewind needs until then), so that is the reply a truncate may name.

Where the played audio ends, in tokens: Piper speaks the reply sentence by sentence, so the
audio of each sentence is known; inside the sentence the cut falls where the time does in its
characters, moved back to the last whole word. The kept tokens are the most whose text has no
more (non-space) characters than that. A text reply has no audio: `audio_end_ms` 0 drops all of
it, anything more is past its end (as OpenAI answers).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from metronome.serve import protocol as p
from metronome.serve.conversation import Conversation
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol import server as se


@dataclass
class Reply:
    item_id: str
    token_ids: list[int]  # as sampled, the stop token included when it came
    said: list[tuple[str, float]] = field(default_factory=list)  # (sentence, audio ms)

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

    def kept_tokens(self, audio_end_ms: float, decode) -> int:
        """How many of the reply's tokens were heard by `audio_end_ms` (`decode`: ids -> text)."""
        if audio_end_ms >= self.audio_ms > 0:
            return len(self.token_ids)
        heard = self.heard_chars(audio_end_ms)
        keep = 0
        while keep < len(self.token_ids) and _visible(decode(self.token_ids[:keep + 1])) <= heard:
            keep += 1
        return keep


def _visible(text: str) -> int:
    return sum(not c.isspace() for c in text)


class Truncating(Protocol):
    """What `truncate` uses of a session (`serve.session.RealtimeSession`)."""

    id: str
    conversation: Conversation
    last_reply: Reply | None
    closed: bool
    serving: object  # its `beat.engine` and `on_engine`

    def emit(self, event: se.ServerEvent) -> None: ...


def truncate(session: Truncating, event: p.ConversationItemTruncate, decode) -> None:
    """Cut an assistant item where the client's audio stopped: its unheard tokens leave the
    item and the KV; `conversation.item.truncated` once the engine has rewound. Errors as
    OpenAI's: an unknown item, a user item, a content index or time past the item's end; and
    here, an item that is not the latest reply any more (`ClientError`, nothing changed)."""
    item = session.conversation.get(event.item_id)
    if item.role != "assistant":
        raise ClientError(ErrorCode.INVALID_VALUE, f"item {item.id!r} is a {item.role} item: "
                          "only assistant items can be truncated", "item_id")
    if event.content_index >= max(1, len(item.content)):
        raise ClientError(ErrorCode.INVALID_VALUE, f"item {item.id!r} has "
                          f"{len(item.content)} content part(s); content_index "
                          f"{event.content_index} is past them", "content_index")
    engine = session.serving.beat.engine
    if not hasattr(engine, "rewind_reply"):
        raise ClientError(ErrorCode.UNSUPPORTED, "this server's engine (vLLM) cannot rewind a "
                          "streaming request: its KV only grows (vLLM would have to abort the "
                          "request and prefill the whole context again)", "item_id")
    reply = session.last_reply
    if reply is None or reply.item_id != item.id:
        raise ClientError(ErrorCode.INVALID_VALUE, f"item {item.id!r} can no longer be "
                          "truncated: only the session's latest reply can, until its next "
                          "input is in the context", "item_id")
    if event.audio_end_ms > reply.audio_ms:
        raise ClientError(ErrorCode.INVALID_VALUE, f"audio_end_ms {event.audio_end_ms} is past "
                          f"the end of the item's audio ({reply.audio_ms:.0f} ms)",
                          "audio_end_ms")
    keep = reply.kept_tokens(event.audio_end_ms, decode)
    sid = session.id

    def rewound(done: asyncio.Future) -> None:
        if session.closed or done.cancelled():
            return
        if done.exception() is not None:  # input was read meanwhile: the horizon passed
            session.emit(p.ErrorEvent.of(ClientError(
                ErrorCode.INVALID_VALUE, f"item {item.id!r} can no longer be truncated: "
                f"{done.exception()}", "item_id"), event.event_id))
            return
        reply.token_ids = reply.token_ids[:keep]
        session.conversation.update(_cut(session.conversation.get(item.id),
                                         decode(reply.token_ids)))
        session.emit(se.ConversationItemTruncated(item_id=item.id,
                                                  content_index=event.content_index,
                                                  audio_end_ms=event.audio_end_ms))

    session.serving.on_engine(lambda: engine.rewind_reply(sid, keep)).add_done_callback(rewound)


def _cut(item: se.ItemOut, text: str) -> se.ItemOut:
    """`item` with its content's words cut to `text` (a transcript, or the text)."""
    content = [part.model_copy(update={"transcript": text} if part.type == "output_audio"
                               else {"text": text}) for part in item.content[:1]]
    return item.model_copy(update={"content": content})
