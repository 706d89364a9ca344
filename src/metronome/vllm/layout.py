"""Where vLLM's CPU cache writer puts each K/V element, learned from the writer itself.

vLLM's CPU backend stores each (block, kv head) as one region of 2 * block_size * head_size
cells in an ISA-specific order (for "vec", keys transposed: dim-major). Rather than hard-code
that order, `cell_offsets` learns it once from `ops.cpu_attn_reshape_and_cache`, so both the
gather path and the in-place kernel read exactly what vLLM's kernel would.
"""

from __future__ import annotations

import functools

import torch
from vllm import _custom_ops as ops

_DIGIT = 16  # probe digits 1..16 (keys) and 17..32 (values): exact in fp32, bf16 and fp16


@functools.cache
def cell_offsets(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(2, block_size, head_size) int64: where the cache writer puts key (0) / value (1)
    element [slot, dim] inside a (block, head) region of 2 * block_size * head_size cells."""
    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    region = cache.view(-1)  # (2 * block_size * head_size,) cells
    slot = torch.arange(block_size)[:, None].expand(block_size, head_size)
    dim = torch.arange(head_size)[None, :].expand(block_size, head_size)
    decoded = {"kind": None, "slot": torch.zeros_like(region, dtype=torch.int64),
               "dim": torch.zeros_like(region, dtype=torch.int64)}
    for name, target in (("slot", slot), ("dim", dim)):
        place = 1
        while place <= int(target.max()):
            digit = (target // place) % _DIGIT
            cache.zero_()
            ops.cpu_attn_reshape_and_cache(
                (digit + 1).to(dtype)[:, None, :], (digit + 1 + _DIGIT).to(dtype)[:, None, :],
                key_cache, value_cache, torch.arange(block_size), isa,
                k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
            )
            read = region.float().round().long()
            if int(read.min()) < 1:
                raise RuntimeError(f"CPU KV layout for isa={isa!r} leaves cells unwritten")
            decoded["kind"] = (read > _DIGIT).long()
            decoded[name] += ((read - 1) % _DIGIT) * place
            place *= _DIGIT
    offsets = torch.full((2, block_size, head_size), -1, dtype=torch.int64)
    offsets[decoded["kind"], decoded["slot"], decoded["dim"]] = torch.arange(region.numel())
    if int(offsets.min()) < 0:
        raise RuntimeError(f"CPU KV layout for isa={isa!r} is not a permutation of cells")
    return offsets


# The layouts the in-place kernel reads, by its code (csrc/sinks_window_attention.cpp)
LAYOUT_CODES = {"slot_major": 0, "dim_major": 1, "amx_tiles": 2}


def key_layout(offsets: torch.Tensor) -> str | None:
    """Which of the kernel's layouts `cell_offsets`' (2, block_size, head_size) map is:
    'dim_major' / 'slot_major' (keys; values slot-major: vLLM's "vec"/"vec16" writers),
    'amx_tiles' (the "amx" writer's, bf16 on a CPU with AMX: tiles of 16 key slots, each
    pairs of dims x 16 slots x 2; tiles of 16 value dims, each pairs of slots x 16 dims x 2:
    the VNNI pairs AMX tiles multiply), or None for any other."""
    _, block_size, head_size = offsets.shape
    slot = torch.arange(block_size)[:, None]
    dim = torch.arange(head_size)[None, :]
    keys_end = block_size * head_size
    if block_size % 16 == 0 and head_size % 16 == 0 and torch.equal(
            offsets[0], (slot // 16) * 16 * head_size + (dim // 2) * 32 + (slot % 16) * 2
            + dim % 2) and torch.equal(
            offsets[1], keys_end + (dim // 16) * 16 * block_size + (slot // 2) * 32
            + (dim % 16) * 2 + slot % 2):
        return "amx_tiles"
    if not torch.equal(offsets[1], keys_end + slot * head_size + dim):
        return None
    if torch.equal(offsets[0], dim * block_size + slot):
        return "dim_major"
    if torch.equal(offsets[0], slot * head_size + dim):
        return "slot_major"
    return None
