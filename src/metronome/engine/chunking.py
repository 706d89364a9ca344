"""How much input each session may put into one step: its chunk limit.

A step pads nothing on the paged path, but its time is every session's latency: a session
decoding, or a streamer's short frame, waits for the longest chunk in the step. So a chunk
is `max_chunk_tokens` (a few frames' worth) in any step where someone's latency rides on
it. In a step of **long prefills only** (every session with work has more than
`max_chunk_tokens` of input pending: nobody is decoding or streaming a frame) a chunk may
grow to `max_prefill_chunk_tokens`, the step's token budget shared evenly: fewer, larger
steps, each reading the weights and the sessions' context once for more tokens (measured
on the bundled model, 2 sessions x 4k tokens bounded: 1,022 tok/s at 64-token chunks,
1,149 at 256; 840 at 512, so the default is 256).

A larger chunk holds more blocks until the step slides the window, beyond the peak that
sizes the pool's memory ceiling (`engine.blocks_per_session`). So it is taken only when the
pool's free blocks cover it and still leave every bounded session the blocks it may need
to reach its own peak: a session admitted under the ceiling never stalls on KV because
another prefilled in larger chunks.
"""

from __future__ import annotations

from collections.abc import Iterable

from metronome.engine.session import Session


def chunk_limit(ready: list[Session], sessions: Iterable[Session], free_blocks: int,
                max_chunk_tokens: int, max_prefill_chunk_tokens: int, step_tokens: int,
                block_size: int) -> int:
    """The chunk limit of a step of `ready` sessions (those with work; `sessions`: all the
    engine holds), from a pool with `free_blocks` free and a budget of `step_tokens`."""
    if max_prefill_chunk_tokens <= max_chunk_tokens or not ready:
        return max_chunk_tokens
    boosted = min(max_prefill_chunk_tokens, step_tokens // len(ready))
    if boosted <= max_chunk_tokens:
        return max_chunk_tokens  # too many sessions to share the budget in larger chunks
    if any(s.unread_tokens <= max_chunk_tokens for s in ready):
        return max_chunk_tokens  # someone decodes or streams a frame: keep the step short
    reserved = 0  # what bounded sessions may still take, up to their peak
    for s in sessions:
        peak_blocks = s.spec.policy.max_blocks(block_size, max_chunk_tokens)
        if peak_blocks is not None:  # bounded
            reserved += max(0, peak_blocks - len(s.table.logical_to_block_id))
    needed = sum(s.table.blocks_needed(boosted) for s in ready)
    return boosted if needed <= free_blocks - reserved else max_chunk_tokens
