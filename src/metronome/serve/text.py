"""Text in and out: ChatML framing of text items, and incremental detokenization.

Text items are framed with ChatML markers (`<|im_start|>role\\n...<|im_end|>\\n`), SmolLM2's
and Qwen's chat format, and a response starts with the assistant header, so the bundled
model answers text turns as the chat model it is. A model with another chat format still
gets text through, framed in markers it was not trained on.
"""

from __future__ import annotations

from metronome.serve.protocol import text_bytes

CHATML_MARKERS = 2  # <|im_start|> and <|im_end|>: special tokens, one each
CHATML_NEWLINES = 2  # after the role and after the end marker
REPLACEMENT_CHAR = "\ufffd"
MAX_HELD_TOKENS = 8  # a UTF-8 character spans at most 4 byte-level tokens; hold no longer


class ChatText:
    def __init__(self, tokenizer) -> None:  # a tokenizers.Tokenizer
        self.tokenizer = tokenizer
        self.response_prefix_ids: list[int] = tokenizer.encode("<|im_start|>assistant\n").ids

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

    def decoder(self) -> DeltaDecoder:
        return DeltaDecoder(self.tokenizer)


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
