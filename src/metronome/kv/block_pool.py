"""The KV block pool: owns which physical block ids are free and which are in use.

Only ids live here; the tensors that hold K/V are owned by `kv.cache.KVCache`, and which
session holds which block is owned by that session's `kv.block_table.BlockTable`.
Running out of blocks is a return value (`None`), never an exception; handing back a block
that is not in use is a bug and asserts.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # FIFO reuse keeps recently freed blocks cold for a while, which makes
        # use-after-free bugs show up as wrong numbers in tests instead of hiding.
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._used_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used_ids)

    def allocate(self, num: int) -> list[int] | None:
        """Take `num` blocks, all or nothing. Returns None when the pool cannot supply them."""
        assert num >= 0, num
        if num > len(self._free_ids):
            return None
        block_ids = [self._free_ids.popleft() for _ in range(num)]
        self._used_ids.update(block_ids)
        self._check()
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert block_id in self._used_ids, f"block {block_id} freed but not in use"
            self._used_ids.remove(block_id)
            self._free_ids.append(block_id)
        self._check()

    def _check(self) -> None:
        assert len(self._free_ids) + len(self._used_ids) == self.num_blocks
