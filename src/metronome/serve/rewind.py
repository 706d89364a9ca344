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

from dataclasses import dataclass, field


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
