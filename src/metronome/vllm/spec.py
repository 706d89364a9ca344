"""The bound on the scheduler side: a KV cache spec and the manager that frees the gap.

Block regions of one request, block size 4, S = 2, W = 6, 15 tokens computed (the next
query sits at position 15 and sees keys j < 2 or 15 - j < 6, i.e. j >= 10):

    block:      0         1         2           3
    positions:  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 .
                S S . .   null      . . W  W    W  W  W
                pinned    freed     window (block 2 holds 10, so it stays)

* The first ceil(S / block_size) blocks are pinned: never freed while the request lives.
  Their slots past S stay allocated but are seen only while inside the window.
* A block between the sinks and the window goes back to the pool (its table entry becomes
  vLLM's null block) once no future query can see it: all its positions are below
  `processed - W + 1`, where `processed` counts tokens whose KV is computed and settled.
* Visibility is token-exact (vLLM's sliding-window rule), not block-aligned like
  `metronome.kv.residency` at block size > 1; the two coincide at block size 1.

Stock R-SWA (`RSWASpec` / `RSWAManager`) pins the *prompt* instead of S tokens. A
streaming session's prompt is its whole history, so it would free nothing; here the pinned
prefix is fixed at S whatever the prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


@dataclass(frozen=True, kw_only=True)
class SinksWindowSpec(FullAttentionSpec):
    """A full-attention layer whose KV is bounded to S pinned sink tokens + a W window.

    Grouped with full attention (same page layout, same block table, same prefix-cache
    hit logic); only the manager differs.
    """

    sink_tokens: int
    window_tokens: int
    # Tokens scheduled but not yet settled (`VllmConfig.max_in_flight_tokens`, taken where
    # the spec is built): their steps still read blocks below the window, so a request
    # holds them on top of the window. Sizes the per-request reservation.
    max_in_flight_tokens: int

    @property
    def num_sink_blocks(self) -> int:
        return cdiv(self.sink_tokens, self.block_size)

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Most blocks one request ever holds: its sink blocks, the blocks of the last
        W - 1 settled tokens plus the in-flight ones, and one more because the window
        rarely starts on a block boundary (block size 4: the 4 tokens CDEF can span
        [xxCD][EFxx]). Never more than max_model_len needs.
        """
        window_blocks = cdiv(self.window_tokens - 1 + max_in_flight_tokens, self.block_size) + 1
        return min(self.num_sink_blocks + window_blocks, cdiv(max_model_len, self.block_size))

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # Bounded, so max_model_len may exceed the pool (the parent charges max_model_len).
        # vLLM sizes the pool with this in the engine-core process, before any request:
        # the place to catch a process where the plugin was not loaded, whose registry
        # would hand this spec to FullAttentionManager (found by MRO) and free nothing.
        manager = KVCacheSpecRegistry.get_manager_class(self)
        if manager is not SinksWindowManager:
            raise RuntimeError(
                f"SinksWindowSpec is managed by {manager} here: the metronome vLLM plugin "
                "was not loaded in this process (is VLLM_PLUGINS excluding it?)"
            )
        blocks = self.max_admission_blocks_per_request(
            vllm_config.max_in_flight_tokens, vllm_config.model_config.max_model_len
        )
        return blocks * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[SinksWindowSpec]) -> SinksWindowSpec:
        # The parent rebuilds with cls(...) from its own fields: it would drop ours.
        bounds = {(s.sink_tokens, s.window_tokens, s.max_in_flight_tokens) for s in specs}
        if not all(isinstance(s, SinksWindowSpec) for s in specs) or len(bounds) != 1:
            raise AssertionError(f"one KV cache group needs one sinks+window bound, got {bounds}")
        base = FullAttentionSpec.merge(specs)
        inherited = {f.name: getattr(base, f.name) for f in fields(FullAttentionSpec) if f.init}
        sink_tokens, window_tokens, in_flight = bounds.pop()
        return cls(**inherited, sink_tokens=sink_tokens, window_tokens=window_tokens,
                   max_in_flight_tokens=in_flight)

    @classmethod
    def from_full_attention(
        cls, spec: FullAttentionSpec, sink_tokens: int, window_tokens: int,
        max_in_flight_tokens: int,
    ) -> SinksWindowSpec:
        inherited = {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}
        return cls(**inherited, sink_tokens=sink_tokens, window_tokens=window_tokens,
                   max_in_flight_tokens=max_in_flight_tokens)


class SinksWindowManager(FullAttentionManager):
    """Frees a request's gap blocks as its window slides; never frees its sink blocks."""

    def __init__(self, kv_cache_spec: SinksWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sink_tokens = kv_cache_spec.sink_tokens
        self.window_tokens = kv_cache_spec.window_tokens
        self.num_sink_blocks = cdiv(self.sink_tokens, self.block_size)
        # vLLM passes this cap only to the sliding-window family; set it ourselves so
        # admission reserves what the startup pool check sized (no max_model_len term).
        self.max_admission_blocks_per_request = (
            kv_cache_spec.max_admission_blocks_per_request(
                kv_cache_spec.max_in_flight_tokens, max_model_len=1 << 62
            )
        )

    def first_visible_window_position(self, processed_tokens: int) -> int:
        """The lowest non-sink key any query at position >= `processed_tokens` can see."""
        return max(0, processed_tokens - self.window_tokens + 1)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        # num_prompt_tokens is what stock R-SWA pins; the bound pins S tokens instead.
        del num_prompt_tokens
        first_gap_block = self.num_sink_blocks
        end_gap_block = self.first_visible_window_position(processed_computed_tokens) // (
            self.block_size
        )
        self._remove_blocks_in_range(request_id, first_gap_block, end_gap_block)

    def live_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks that are held (not the null block), in table order."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ()) if not b.is_null]


def register_spec() -> None:
    """Map SinksWindowSpec to its manager (idempotent; safe in every process)."""
    # The registry fills in vLLM's built-in specs only while it is empty: fill it first,
    # or registering ours would leave FullAttentionSpec & co. unregistered.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(
        SinksWindowSpec, SinksWindowManager, uniform_type_base_spec=FullAttentionSpec
    )
