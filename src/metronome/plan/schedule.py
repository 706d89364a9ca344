"""What one frame asks of the engine: its steps, the tokens each writes, the keys it reads.

The engine (`engine.session`) feeds a frame's work as chunks, one chunk per step:

    input        the last token sampled for the previous frame (the carry, 1 token), then
                 the frame's k input tokens, together, in chunks of at most
                 `max_chunk_tokens` (`Session.next_chunk` takes consecutive pending input
                 in one chunk); the last input chunk samples the first output token
    decode       one step per further output token (m - 1), each feeding the last token

so a frame with k input and m >= 1 output tokens takes ceil((k + 1) / c) + m - 1 steps and
writes k + m KV entries (a listening frame, m = 0, has no carry: ceil(k / c) steps, k
entries; a session's very first frame has no carry either, which this steady-state view
ignores). Each step charges its session, under `runtime.cost_model.StepCostModel`, per token
it feeds and per key its last query attends to (its visible context).
"""

from __future__ import annotations

from dataclasses import dataclass

from metronome.kv.residency import ResidencyPolicy


@dataclass(frozen=True)
class FrameSchedule:
    input_tokens: int  # k
    output_tokens: int  # m
    max_chunk_tokens: int  # c: the engine's per-session, per-step input limit

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0 or self.max_chunk_tokens < 1:
            raise ValueError(f"need input_tokens >= 0, output_tokens >= 0, max_chunk_tokens "
                             f">= 1, got {self.input_tokens}, {self.output_tokens}, "
                             f"{self.max_chunk_tokens}")
        if self.input_tokens + self.output_tokens == 0:
            raise ValueError("a frame must have input or output tokens")

    @property
    def chunks(self) -> list[int]:
        """Tokens fed in each of the frame's steps, in order."""
        k, m, c = self.input_tokens, self.output_tokens, self.max_chunk_tokens
        fed = k + (1 if m else 0)  # the carry goes in with the input
        inputs = [min(c, fed - start) for start in range(0, fed, c)]
        return inputs + [1] * max(0, m - 1)

    @property
    def num_steps(self) -> int:
        """s = ceil((k + 1) / c) + m - 1 (ceil(k / c) when m = 0): one step per chunk."""
        return len(self.chunks)

    @property
    def tokens_written(self) -> int:
        """KV entries one frame adds: k + m."""
        return self.input_tokens + self.output_tokens


def mean_visible_context_tokens(policy: ResidencyPolicy, block_size: int,
                                session_tokens: int) -> float:
    """Keys a query attends to, averaged over positions, for the context a deadline must
    survive: a bounded session past its window sees S + W + (b - 1) / 2 on average (its
    window holds W to W + b - 1 keys); an unbounded one, at the end of its session, all of
    its `session_tokens` (the worst frame of the session)."""
    if not policy.bounded:
        return float(session_tokens)
    steady = policy.sink_tokens + policy.window_tokens + (block_size - 1) / 2
    return min(steady, float(session_tokens))
