"""What the quality experiment runs: the model, the text, the five policies, and the sizes of
each scale (`Config`, `Config.smoke()`). Everything here is a constant or a pure function of
one."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from metronome.kv.residency import ResidencyPolicy

CLOCK = "none (quality is measured in tokens, not time)"
MODEL = "bundled"
DTYPE = torch.float32  # quality numbers in full precision: bf16 rounding would blur them
PLAY = "hamlet"
BLOCK_SIZE = 16
SINK_TOKENS = 4
FRAME_TOKENS = 64  # turn-based text per frame
REPLY_TOKENS = 4  # greedy reply after each frame, kept in the context
SEGMENT_TOKENS = 64  # free-running: recompute_window re-prefills every this many tokens
SCORE_CHUNK_TOKENS = 64  # reference scorer: tokens scored per fresh session
SCORE_SESSIONS = 8  # scorer sessions batched per engine run
RECOMPUTE = "recompute_window"
HAMLET_TEXT = "hamlet_text"  # the play itself beside the free-running policies


@dataclass(frozen=True)
class Config:
    text_tokens: int = field(default=20480, metadata={
        "help": "turn-based text stream, a multiple of the 64-token frame"})
    turn_window_tokens: int = field(default=512, metadata={
        "help": "W for (i), a multiple of the block size"})
    free_window_tokens: int = field(default=256, metadata={"help": "W for (ii)"})
    measured_tokens: int = field(default=4096, metadata={
        "help": "free-running tokens measured at least, counted after the slide"})
    bucket_tokens: int = field(default=1024, metadata={
        "help": "perplexity table: one row per this many stream positions"})
    plot_bucket_tokens: int = field(default=256, metadata={
        "help": "NLL plot: mean over this many stream positions"})
    prompt_tokens: int = field(default=128, metadata={"help": "free-running prompt"})
    temperature: float = field(default=0.8, metadata={"help": "free-running sampling"})
    top_p: float = field(default=0.95, metadata={"help": "free-running sampling"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(768, 128, 64, 128, 128, 64)  # shapes only, ~1 min


def engine_policies(window_tokens: int) -> dict[str, ResidencyPolicy]:
    """The four policies the engine runs itself (recompute_window is driven from here)."""
    w, s = window_tokens, SINK_TOKENS
    return {
        "dense": ResidencyPolicy.unbounded(),
        "window": ResidencyPolicy.parse(f"window:{w}"),
        "sinks_window_absolute": ResidencyPolicy.parse(f"sinks_window:{s}:{w}@absolute"),
        "sinks_window_rolling": ResidencyPolicy.parse(f"sinks_window:{s}:{w}@rolling"),
    }


POLICIES = (*engine_policies(BLOCK_SIZE), RECOMPUTE)


def slide_position(window_tokens: int) -> int:
    """First stream position whose prediction no longer sees position 0 under `window`:
    the token at p is predicted by the query at p - 1, whose window starts at a block edge."""
    return window_tokens + BLOCK_SIZE
