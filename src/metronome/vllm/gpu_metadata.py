"""On GPUs: every attention-metadata build of a sinks+window layer carries a prefix of S.

vLLM's model runners fill `CommonAttentionMetadata.rswa_prefix_lens` with each request's
prompt length (stock R-SWA keeps the prompt visible). For a streaming session the "prompt"
is the whole history, so that would bound nothing. The wrapped `build` of the Triton,
FlexAttention and FlashAttention metadata builders replaces it, for builders whose layers
have a `SinksWindowSpec`, with S for every request, before the stock build copies it into
its persistent buffer (so CUDA graphs keep replaying the same addresses). Builders of other
layers, and every engine without the bound, are untouched.

Triton's kernel scans every tile of the sequence under R-SWA, so the Triton build also
compacts each request's block table to its sink blocks + window blocks
(`metronome.vllm.compaction`): its decode reads O(S + W) keys, never the gap's blocks.
FlexAttention needs no compaction: its direct block mask already drops blocks that lie
wholly in the gap once the prefix is S. FlashAttention 4 applies the mask per token.
"""

from __future__ import annotations

import logging

import torch

from metronome.vllm.backends import UnsupportedBackend
from metronome.vllm.compaction import compact_block_table, max_compacted_len
from metronome.vllm.spec import SinksWindowSpec

_BUILDERS = (  # (module, class, compact the block table)
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionMetadataBuilder", True),
    ("vllm.v1.attention.backends.flex_attention", "FlexAttentionMetadataBuilder", False),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder", False),
)
_WRAPPED = "_metronome_stock_build"
log = logging.getLogger(__name__)


class SinksWindowBuffers:
    """A builder's persistent inputs for its bounded builds: the prefix (S per request) and,
    when it compacts, the compacted table and lengths. Allocated once per builder."""

    def __init__(self, spec: SinksWindowSpec, max_num_reqs: int, device, compact: bool) -> None:
        self.spec = spec
        self.compact = compact
        self.prefix_lens = torch.full((max_num_reqs,), spec.sink_tokens, dtype=torch.int32,
                                      device=device)
        self.table: torch.Tensor | None = None  # shaped on first use (the runner's width)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device) if (
            compact) else None

    def bounded(self, common):
        """`common` (a `CommonAttentionMetadata`) with the prefix at S, compacted if asked."""
        num_reqs = common.num_reqs
        assert num_reqs <= self.prefix_lens.shape[0], (
            f"{num_reqs} requests in a step, buffers for {self.prefix_lens.shape[0]}")
        changes: dict = {"rswa_prefix_lens": self.prefix_lens[:num_reqs]}
        if self.compact:
            source = common.block_table_tensor
            if self.table is None:  # once: CUDA graphs replay its address from then on
                self.table = torch.zeros(self.prefix_lens.shape[0], source.shape[1],
                                         dtype=source.dtype, device=source.device)
            assert source.shape[1] <= self.table.shape[1], (
                f"block table widened from {self.table.shape[1]} to {source.shape[1]} columns "
                "after the compacted buffer was allocated")
            spec = self.spec
            table, seq_lens = compact_block_table(
                source[:num_reqs], common.seq_lens, common.query_start_loc, spec.sink_tokens,
                spec.window_tokens, spec.block_size, self.table, self.seq_lens)
            bound = max_compacted_len(common.max_seq_len, common.max_query_len,
                                      spec.sink_tokens, spec.window_tokens, spec.block_size)
            upper = common.seq_lens_cpu_upper_bound
            changes.update(block_table_tensor=table, seq_lens=seq_lens, max_seq_len=bound,
                           seq_lens_cpu_upper_bound=None if upper is None else
                           upper.clamp(max=bound),
                           _num_computed_tokens_cache=None)  # computed from the old lengths
        return common.replace(**changes)


def _bounded_build(stock_build, compact: bool):
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        spec = getattr(self, "kv_cache_spec", None)
        if not isinstance(spec, SinksWindowSpec):
            return stock_build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        window = getattr(self, "rswa_window", None)
        if window != spec.window_tokens:
            # without R-SWA the stock build would drop the prefix: plain causal attention over
            # the freed gap (or, compacted, over the sink blocks' slots past S)
            raise UnsupportedBackend(
                f"{type(self).__name__} has rswa_window={window}, "
                f"not W = {spec.window_tokens}: add \"rswa_window\": {spec.window_tokens} to "
                "hf_overrides")
        buffers = getattr(self, "_metronome_buffers", None)
        if buffers is None:
            max_num_reqs = self.vllm_config.scheduler_config.max_num_seqs
            buffers = SinksWindowBuffers(spec, max_num_reqs,
                                         common_attn_metadata.seq_lens.device, compact)
            self._metronome_buffers = buffers
        # cascade attention would share a prefix across requests in the gap: never
        return stock_build(self, 0, buffers.bounded(common_attn_metadata), *args, **kwargs)

    build.__doc__ = "The stock build with the sinks+window prefix (metronome.vllm.gpu_metadata)."
    setattr(build, _WRAPPED, stock_build)
    return build


def wrap_builder(cls, compact: bool) -> None:
    """Wrap `cls.build` once (idempotent: `register()` runs in every process, maybe twice)."""
    if hasattr(cls.build, _WRAPPED):
        return
    cls.build = _bounded_build(cls.build, compact)


def install() -> list[str]:
    """Wrap every GPU builder vLLM has here; returns the names wrapped (a backend whose
    module does not import on this platform is skipped: it cannot be selected either)."""
    import importlib

    wrapped = []
    for module_name, class_name, compact in _BUILDERS:
        try:
            module = importlib.import_module(module_name)
        except Exception as missing:  # noqa: BLE001 - e.g. an extension that fails to load
            log.info("sinks+window: %s not wrapped (%s cannot be imported here: %s)",
                     class_name, module_name, missing)
            continue
        wrap_builder(getattr(module, class_name), compact)
        wrapped.append(class_name)
    return wrapped
