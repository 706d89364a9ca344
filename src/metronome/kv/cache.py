"""KV tensors: one preallocated store per layer, addressed by (block id, offset) slots.

Owns the memory and nothing else; which blocks are free is `BlockPool`'s business.
Keys are stored after RoPE at their absolute position (see `model.llama` for why rolling
positions need nothing else). Layout per layer: `(kv_heads, num_blocks * block_size, head_dim)`:
kv head outermost, so a gather of whole blocks lands directly as `(kvh, B, context, hd)`,
the layout a batched matmul reads without another copy.
"""

from __future__ import annotations

import torch


def num_blocks_for(
    block_size: int,
    pool_tokens: int | None = None,
    memory_bytes: int | None = None,
    bytes_per_token: int | None = None,
) -> int:
    """Pool size in blocks from a token count or a memory budget (exactly one of them)."""
    if (pool_tokens is None) == (memory_bytes is None):
        raise ValueError(f"size the KV pool by exactly one of pool_tokens or memory_bytes, "
                         f"got pool_tokens={pool_tokens}, memory_bytes={memory_bytes}")
    if pool_tokens is None:
        assert bytes_per_token is not None
        pool_tokens = memory_bytes // bytes_per_token
    num_blocks = pool_tokens // block_size
    if num_blocks < 1:
        raise ValueError(f"KV pool of {pool_tokens} tokens holds no block of {block_size}")
    return num_blocks


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        # zeros, not empty: padding slots are read (then masked) and must not hold NaNs.
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        # grow-only scratch for gathered context: reused every step and every layer
        self._scratch = (torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. slot_ids: (T,); k, v: (T, kv_heads, head_dim)."""
        self.k[layer].index_copy_(1, slot_ids, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slot_ids, v.transpose(0, 1))

    def gather_buffers(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for one step's gathered context, shared by every layer and kept across
        steps (fresh tensors of tens of MB cost page faults on every touch)."""
        kv_heads, _, head_dim = self.k.shape[1:]
        shape = (kv_heads, block_ids.numel(), self.block_size * head_dim)
        numel = shape[0] * shape[1] * shape[2]
        if self._scratch[0].numel() < numel:
            grown = max(numel, self._scratch[0].numel() * 3 // 2)
            self._scratch = tuple(torch.empty(grown, dtype=self.k.dtype) for _ in range(2))
        return self._scratch[0][:numel].view(shape), self._scratch[1][:numel].view(shape)

    def gather(
        self, layer: int, block_ids: torch.Tensor, buffers: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context K/V of a batch. block_ids: (B, nb) -> k, v: (kvh, B, nb * block_size, hd)."""
        batch, nb = block_ids.shape
        flat = block_ids.reshape(-1)
        for store, buffer in zip((self.k[layer], self.v[layer]), buffers, strict=True):
            for head in range(store.shape[0]):
                # whole-block rows of one kv head: a contiguous copy per block
                by_block = store[head].view(self.num_blocks, -1)
                torch.index_select(by_block, 0, flat, out=buffer[head])
        kv_heads, head_dim = self.k.shape[1], self.k.shape[3]
        shape = (kv_heads, batch, nb * self.block_size, head_dim)
        return buffers[0].view(shape), buffers[1].view(shape)
