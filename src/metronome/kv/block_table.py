"""A session's block table: which physical block holds each of its resident logical blocks.

Logical block `k` covers absolute positions `[k * block_size, (k + 1) * block_size)`.
The table owns only the mapping and the session's token count; it asks the `BlockPool` for
ids and hands them back. Everything else (resident tokens, pinned blocks) is derived.
"""

from __future__ import annotations

from metronome.kv.block_pool import BlockPool
from metronome.kv.residency import ResidencyPolicy


class BlockTable:
    def __init__(self, policy: ResidencyPolicy, block_size: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.num_tokens = 0  # tokens written so far (the next position to write)
        # logical block index -> physical block id, in increasing logical order
        self.logical_to_block_id: dict[int, int] = {}
        # The rewind horizon: while set, the blocks a query at this position would see stay
        # resident though later queries no longer see them, so the session can go back to it
        # (`rewind`). Visibility is unchanged: only residency lags.
        self.hold_from: int | None = None

    @property
    def block_ids(self) -> list[int]:
        return list(self.logical_to_block_id.values())

    @property
    def num_sink_blocks(self) -> int:
        return self.policy.num_sink_blocks(self.block_size)

    @property
    def num_pinned_blocks(self) -> int:
        sinks = self.num_sink_blocks
        return sum(1 for k in self.logical_to_block_id if k < sinks)

    def visible_tokens(self, position: int) -> int:
        """How many keys a query at `position` attends to (itself included)."""
        start = self.policy.window_start(position, self.block_size)
        sinks = min(self.policy.sink_tokens, start)
        return sinks + position - start + 1

    @property
    def resident_tokens(self) -> int:
        """Keys the next query will attend to before its own: the session's live KV."""
        if self.num_tokens == 0:
            return 0
        return self.visible_tokens(self.num_tokens) - 1

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Physical blocks to add before writing `num_new_tokens` more tokens."""
        if num_new_tokens == 0:
            return 0
        last_position = self.num_tokens + num_new_tokens - 1
        last_block = last_position // self.block_size
        first_new_block = -(-self.num_tokens // self.block_size)
        return max(0, last_block - first_new_block + 1)

    def append(self, num_new_tokens: int, pool: BlockPool) -> bool:
        """Reserve room for `num_new_tokens`. False (and nothing changed) if the pool is dry."""
        block_ids = pool.allocate(self.blocks_needed(num_new_tokens))
        if block_ids is None:
            return False
        first_new_block = -(-self.num_tokens // self.block_size)
        for offset, block_id in enumerate(block_ids):
            self.logical_to_block_id[first_new_block + offset] = block_id
        self.num_tokens += num_new_tokens
        return True

    @property
    def first_held_block(self) -> int:
        """The first logical window block still needed: by the next query, or by one at the
        rewind horizon while there is one."""
        start = self.policy.window_start(self.num_tokens, self.block_size)
        if self.hold_from is not None:
            start = min(start, self.policy.window_start(self.hold_from, self.block_size))
        return start // self.block_size

    def slide(self, pool: BlockPool) -> int:
        """Return blocks no future query can see (nor one at the rewind horizon) to the pool.
        Returns how many were freed."""
        start_block = self.first_held_block
        sinks = self.num_sink_blocks  # once: a property over the policy, not per block
        stale = [k for k in self.logical_to_block_id if sinks <= k < start_block]
        pool.free([self.logical_to_block_id.pop(k) for k in stale])
        self._check()
        return len(stale)

    def rewind(self, num_tokens: int, pool: BlockPool) -> int:
        """Go back to `num_tokens` written (at or after the rewind horizon): the blocks of
        later positions go back to `pool`. Returns how many."""
        assert self.hold_from is not None and self.hold_from <= num_tokens <= self.num_tokens, (
            self.hold_from, num_tokens, self.num_tokens)
        last_block = (num_tokens - 1) // self.block_size  # -1: none left
        later = [k for k in self.logical_to_block_id if k > last_block]
        pool.free([self.logical_to_block_id.pop(k) for k in later])
        self.num_tokens = num_tokens
        self._check()
        return len(later)

    def blocks_freed_by(self, policy: ResidencyPolicy) -> int:
        """How many of its blocks `slide` would return if this table were under `policy`."""
        sinks = policy.num_sink_blocks(self.block_size)
        start_block = policy.window_start(self.num_tokens, self.block_size) // self.block_size
        return sum(1 for k in self.logical_to_block_id if sinks <= k < start_block)

    def release(self, pool: BlockPool) -> None:
        pool.free(self.block_ids)
        self.logical_to_block_id.clear()

    def _check(self) -> None:
        bound = self.policy.max_resident_tokens(self.block_size)
        assert bound is None or self.resident_tokens <= bound, (self.resident_tokens, bound)
