"""The in-place sinks+window kernel (`csrc/sinks_window_attention.cpp`) for vLLM's CPU cache.

`in_place_kernel(isa, block_size, head_size, dtype)` returns a callable that attends every
query token of a step over its visible keys straight out of the paged cache (no gather, no
mask tensor), or None when it cannot serve this layer: no compiler here (the reason is
logged once; `metronome.model.native` builds and caches it per CPU/venv/torch) or a cache
layout the kernel does not read (`metronome.vllm.layout`: keys dim-major or slot-major with
values slot-major, or the AMX writer's tiles; checked against vLLM's own cache writer).
Then the gather path of `metronome.vllm.attention` serves the layer, same results.

Set METRONOME_NATIVE_ATTENTION=0 to never build or load it (as for the native engine's).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from metronome.model.native import Extension
from metronome.vllm.config import SinksWindow
from metronome.vllm.layout import LAYOUT_CODES, cell_offsets, key_layout

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "sinks_window_attention.cpp"
KERNEL = Extension("vllm_sinks_window", SOURCE, "vLLM sinks+window attention kernel")
NULL_BLOCK_ID = 0  # vLLM's BlockPool keeps block 0 as the null block of freed table entries
LANES = 16  # the kernel tiles head_size and block_size by 16


@functools.cache
def in_place_kernel(isa: str, block_size: int, head_size: int, dtype: torch.dtype
                    ) -> Callable[..., None] | None:
    """fn(query, kv_cache, query_start_loc, seq_lens, block_table, bound, scale, output),
    or None (why: logged once per layout)."""
    if block_size % LANES or head_size % LANES or block_size > 256 or head_size > 256:
        log.warning("sinks+window: block_size %d / head_size %d are not multiples of %d up to "
                    "256; the gather path serves this layer", block_size, head_size, LANES)
        return None
    layout = key_layout(cell_offsets(isa, block_size, head_size, dtype))
    if layout is None:
        log.warning("sinks+window: vLLM's CPU cache layout for isa=%s is not one the in-place "
                    "kernel reads; the gather path serves this layer", isa)
        return None
    module = KERNEL.module()
    if module is None:
        log.warning("sinks+window: %s; the gather path serves the bounded layers",
                    KERNEL.reason())
        return None
    code = LAYOUT_CODES[layout]

    def attend(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor, bound: SinksWindow,
               scale: float, output: torch.Tensor) -> None:
        module.sinks_window_attention(
            query, kv_cache, query_start_loc, seq_lens, block_table, bound.sink_tokens,
            bound.window_tokens, scale, code, NULL_BLOCK_ID, output)

    return attend


def main() -> int:
    """`python -m metronome.vllm.kernel`: build (or find) the kernel; exit 0 either way."""
    module = KERNEL.module()
    if module is None:
        print(f"metronome: {KERNEL.reason()}; bounded vLLM layers will use the gather path")
    else:
        print(f"metronome: vLLM sinks+window kernel ready ({KERNEL.build_dir()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
