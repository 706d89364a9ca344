"""Text in and out of the model: the ChatML framing of the conversation's messages (text
items, instructions, a spoken turn's words as they are heard) and incremental
detokenization of its replies.

Messages are framed with ChatML markers (`<|im_start|>role\\n...<|im_end|>\\n`), SmolLM2's
and Qwen's chat format, and a response starts with the assistant header, so the bundled
model answers as the chat model it is. A model with another chat format still gets text
through, framed in markers it was not trained on.

A spoken turn is one user message written as it is heard (`HeardMessage`): the words the
hearing stage commits, piece by piece, the header before the turn's first word and the end
marker after its last (SmolLM2's byte-level BPE splits before each space-led word, so words
tokenized piece by piece are the tokens of the whole message).
"""

from __future__ import annotations

import math

from metronome.serve.protocol import text_bytes

CHATML_MARKERS = 2  # <|im_start|> and <|im_end|>: special tokens, one each
CHATML_NEWLINES = 2  # after the role and after the end marker
REPLACEMENT_CHAR = "\ufffd"
MAX_HELD_TOKENS = 8  # a UTF-8 character spans at most 4 byte-level tokens; hold no longer
MESSAGE_FRAMING_TOKENS = 8  # <|im_start|>user\n ... <|im_end|>\n, with room
MAX_TOKENS_PER_SPEECH_S = 12  # ~4 words/s of fast speech at <= 3 tokens a word


class ChatText:
    def __init__(self, tokenizer) -> None:  # a tokenizers.Tokenizer
        self.tokenizer = tokenizer
        self.response_prefix_ids: list[int] = tokenizer.encode("<|im_start|>assistant\n").ids
        # what ends a reply: the message's end, or the text's (what the model stops at)
        self.stop_token_ids = frozenset(
            i for i in (tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
            if i is not None)

    def item_ids(self, role: str, text: str) -> list[int]:
        """The text's tokens, framed (costly: ~2 us per byte; the encoder thread's work)."""
        return self.tokenizer.encode(f"<|im_start|>{role}\n{text}<|im_end|>\n").ids

    @staticmethod
    def max_item_tokens(role: str, text: str) -> int:
        """The most tokens `item_ids(role, text)` can make, without tokenizing: the two
        markers are one token each, and every other token covers at least one UTF-8 byte
        (byte-level BPE: a character of 2-4 bytes can be 2-4 tokens, so counting characters
        would not be a bound; SentencePiece with byte fallback: a piece is at least one
        character, a fallback token one byte). O(1) for ASCII text."""
        return CHATML_MARKERS + text_bytes(role) + text_bytes(text) + CHATML_NEWLINES

    def ids(self, text: str) -> list[int]:
        """A piece of a message, tokenized as it stands (costly: the stage's work)."""
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def decoder(self) -> DeltaDecoder:
        return DeltaDecoder(self.tokenizer)


class HeardMessage:
    """One spoken turn as the user message it becomes, piece by piece, on the stage that
    hears it (see the module docstring)."""

    def __init__(self) -> None:
        self._open = False  # the turn's message is open in the KV

    @staticmethod
    def max_tokens(turn_audio_s: float) -> int:
        """The most tokens a frame can commit when the turn holds this much audio not yet
        heard to the end: the room it reserves in the stream until it is heard."""
        return MESSAGE_FRAMING_TOKENS + math.ceil(turn_audio_s * MAX_TOKENS_PER_SPEECH_S)

    def piece(self, words: list[str], final: bool) -> str:
        """The text `words` add to the message ("" for none): the header before the turn's
        first word, the end marker after the turn's last (`final`)."""
        text = " ".join(words)
        opens = bool(words) and not self._open
        closes = final and (self._open or opens)
        if not (words or closes):
            return ""
        piece = ("<|im_start|>user\n" + text) if opens else (" " + text if text else "")
        if closes:
            piece += "<|im_end|>\n"
        self._open = not closes and (self._open or opens)
        return piece


class DeltaDecoder:
    """Token ids in pieces -> text deltas that concatenate to the decoded whole.

    Byte-level BPE decodes each token on its own, except a multi-byte character split
    across tokens: its leading tokens decode to U+FFFD, so they are held back until the
    character completes (or `MAX_HELD_TOKENS` pass, when they go out as they are).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._held_ids: list[int] = []

    def push(self, token_ids: list[int]) -> str:
        ids = self._held_ids + list(token_ids)
        text = self.tokenizer.decode(ids)
        if text.endswith(REPLACEMENT_CHAR) and len(ids) < MAX_HELD_TOKENS:
            self._held_ids = ids
            return ""
        self._held_ids = []
        return text

    @property
    def held_ids(self) -> list[int]:
        """Tokens held back (a character not complete yet): a checkpoint keeps them."""
        return list(self._held_ids)

    def hold(self, token_ids: list[int]) -> None:
        """Hold `token_ids` as a checkpoint had them (a fresh decoder only)."""
        assert not self._held_ids
        self._held_ids = list(token_ids)

    def flush(self) -> str:
        """Whatever is held, as it decodes now (the end of a response)."""
        ids, self._held_ids = self._held_ids, []
        return self.tokenizer.decode(ids) if ids else ""
