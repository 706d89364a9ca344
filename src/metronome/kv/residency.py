"""Residency policies: which of a session's tokens stay resident (and are attended to).

Token regions of a bounded session after `n` tokens (positions 0..n-1), block size 4,
`sinks_window(S=2, W=6)`, n = 15:

    logical block:   0         1         2         3
    positions:     0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 .
                   S S x x   freed      window ---------------
    pinned sink block (0)    returned   window_start(next query 15) = 8

Semantics (the contract the masked dense reference in the tests reproduces):

* A query at absolute position `p` attends key `j` iff `j <= p` and
  (`j < sink_tokens` or `j >= window_start(p)`).
* `window_start(p)` is block-aligned: the start of the block holding `p - W + 1`
  (0 for `unbounded`). So a query sees at most `S + W + block_size - 1` keys, and a block
  leaves the pool exactly when no future query can see it: visibility and residency agree.
  With `slide_tokens` D (a multiple of the block size; a session's `retention_ratio`), the
  window moves in steps of D instead: `window_start(p)` is the multiple of D at or below
  `p - W + 1`, a query sees between W and `W + D - 1` window keys, and D / block_size
  blocks leave at once.
* Sink tokens live in the first `ceil(S / block_size)` blocks, which are pinned. Their slots
  beyond `S` are held but never attended once the window has passed them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PolicyKind(enum.StrEnum):
    UNBOUNDED = "unbounded"
    WINDOW = "window"
    SINKS_WINDOW = "sinks_window"


class Positions(enum.StrEnum):
    # A key keeps the position it was written at (it may exceed the model's trained range).
    ABSOLUTE = "absolute"
    # StreamingLLM: positions are assigned by slot in the cache at attention time.
    ROLLING = "rolling"


@dataclass(frozen=True)
class ResidencyPolicy:
    kind: PolicyKind
    sink_tokens: int = 0
    window_tokens: int | None = None
    positions: Positions = Positions.ABSOLUTE
    slide_tokens: int | None = None  # the window's step (None: one block)

    def __post_init__(self) -> None:
        if self.slide_tokens is not None and (self.slide_tokens < 1 or self.window_tokens
                                              is None):
            raise ValueError(f"slide_tokens must be >= 1 and needs a window, got "
                             f"{self.slide_tokens}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.kind is PolicyKind.UNBOUNDED:
            if self.window_tokens is not None or self.sink_tokens:
                raise ValueError(f"unbounded takes no window or sinks, got window_tokens="
                                 f"{self.window_tokens}, sink_tokens={self.sink_tokens}")
            return
        if self.window_tokens is None or self.window_tokens < 1:
            raise ValueError(f"{self.kind} needs window_tokens >= 1, got {self.window_tokens}")
        if self.kind is PolicyKind.WINDOW and self.sink_tokens:
            raise ValueError(f"window takes no sinks (got {self.sink_tokens}); use "
                             "sinks_window")

    @classmethod
    def unbounded(cls) -> ResidencyPolicy:
        return cls(PolicyKind.UNBOUNDED)

    @classmethod
    def window(cls, window_tokens: int, positions: Positions | str = Positions.ABSOLUTE):
        return cls(PolicyKind.WINDOW, 0, window_tokens, Positions(positions))

    @classmethod
    def sinks_window(
        cls, sink_tokens: int, window_tokens: int, positions: Positions | str = Positions.ABSOLUTE,
        slide_tokens: int | None = None,
    ) -> ResidencyPolicy:
        return cls(PolicyKind.SINKS_WINDOW, sink_tokens, window_tokens, Positions(positions),
                   slide_tokens)

    @classmethod
    def parse(cls, text: str) -> ResidencyPolicy:
        """Parse `unbounded`, `window:W`, `sinks_window:S:W`, optionally `/D` (the window's
        step, `slide_tokens`) and `@rolling`."""
        body, _, positions = text.partition("@")
        body, _, slide = body.partition("/")
        parts = body.split(":")
        try:
            pos = Positions(positions or "absolute")
            step = int(slide) if slide else None
            if parts == ["unbounded"] and not positions and not slide:
                return cls.unbounded()
            if parts[0] == "window" and len(parts) == 2:
                return cls(PolicyKind.WINDOW, 0, int(parts[1]), pos, step)
            if parts[0] == "sinks_window" and len(parts) == 3:
                return cls.sinks_window(int(parts[1]), int(parts[2]), pos, step)
        except ValueError as err:
            raise ValueError(f"bad residency policy {text!r}: {err}") from None
        raise ValueError(
            f"bad residency policy {text!r}: expected unbounded | window:W | sinks_window:S:W"
            " (optionally /D, the window's step, and @absolute or @rolling)"
        )

    @property
    def bounded(self) -> bool:
        return self.kind is not PolicyKind.UNBOUNDED

    def __str__(self) -> str:
        if self.kind is PolicyKind.UNBOUNDED:
            return "unbounded"
        head = f"window:{self.window_tokens}" if self.kind is PolicyKind.WINDOW else (
            f"sinks_window:{self.sink_tokens}:{self.window_tokens}"
        )
        step = "" if self.slide_tokens is None else f"/{self.slide_tokens}"
        return f"{head}{step}@{self.positions}"

    def slide(self, block_size: int) -> int:
        """The window's step in tokens: `slide_tokens`, or one block."""
        step = self.slide_tokens or block_size
        if step % block_size:
            raise ValueError(f"the window's step ({step} tokens) must be a multiple of the "
                             f"block size ({block_size})")
        return step

    def window_start(self, position: int, block_size: int) -> int:
        """First window position visible to a query at `position` (block-aligned)."""
        if self.window_tokens is None:
            return 0
        first = position - self.window_tokens + 1
        step = self.slide(block_size)
        return max(0, first // step * step)

    def num_sink_blocks(self, block_size: int) -> int:
        return -(-self.sink_tokens // block_size)

    def max_blocks(self, block_size: int, chunk_tokens: int = 1) -> int | None:
        """Most physical blocks a session under this bound holds at once (None: unbounded):
        its sink blocks plus the window's blocks while a chunk of `chunk_tokens` is written
        (a step allocates the chunk's blocks before it slides the window). With
        `chunk_tokens=1` this is the steady-state bound, e.g. 34 blocks of 16 for
        `sinks_window:4:512`; a 64-token chunk adds up to 4 more."""
        if self.window_tokens is None:
            return None
        # Past the first window, window blocks no longer overlap the sink blocks and the
        # count repeats with the block period: one period of positions covers every case.
        step = self.slide(block_size)
        first = (self.sink_tokens + self.window_tokens + chunk_tokens + step) * 2
        window = max((n + chunk_tokens - 1) // block_size
                     - self.window_start(n, block_size) // block_size + 1
                     for n in range(first, first + step))
        return self.num_sink_blocks(block_size) + window

    def max_resident_tokens(self, block_size: int) -> int | None:
        """Most keys any query can see: S + W + D - 1, D the window's step (one block unless
        `slide_tokens`; None when unbounded)."""
        if self.window_tokens is None:
            return None
        return self.sink_tokens + self.window_tokens + self.slide(block_size) - 1
