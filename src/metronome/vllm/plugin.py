"""The vLLM entry point (`vllm.general_plugins`): wires the bound into every process.

vLLM calls `register()` in the front-end, the engine-core and every worker process
(`vllm.plugins.load_general_plugins`). It does three idempotent things:

1. scheduler side: map `SinksWindowSpec` to `SinksWindowManager` in vLLM's KV-cache spec
   registry (the engine core receives the spec from the workers and looks its manager up);
2. worker side: full-attention layers report `SinksWindowSpec` when the engine has a bound
   (`metronome.vllm.config`), and refuse attention backends that would ignore its mask
   (`metronome.vllm.backends`);
3. worker side, CPU: the CPU backend's attention becomes `SinksWindowCPUImpl`; on GPUs the
   Triton, FlexAttention and FlashAttention metadata builders get the prefix S (and Triton a
   compacted block table) for bounded layers (`metronome.vllm.gpu_metadata`).

Nothing changes for an engine started without `metronome_residency` in `hf_overrides`.
"""

from __future__ import annotations

from vllm.model_executor.layers.attention import Attention
from vllm.v1.kv_cache_interface import FullAttentionSpec

from metronome.vllm.backends import (
    UnsupportedBackend,
    check_backend,
    check_layer_features,
    check_parallelism,
    check_window_config,
)
from metronome.vllm.config import HF_OVERRIDE_KEY, SinksWindow, bound_from_vllm_config
from metronome.vllm.spec import SinksWindowSpec, register_spec

_stock_get_kv_cache_spec = Attention.get_kv_cache_spec


def bounded_spec(spec, bound: SinksWindow | None, backend: str, layer_name: str,
                 max_in_flight_tokens: int, on_cpu: bool = True,
                 flash_attn_version: int | None = None):
    """The spec a layer reports: `spec` itself without a bound, else `SinksWindowSpec`
    (after `metronome.vllm.backends` accepted the layer's attention backend)."""
    if bound is None or spec is None:
        return spec
    if type(spec) is not FullAttentionSpec:
        raise ValueError(
            f"{HF_OVERRIDE_KEY}: layer {layer_name} has a {type(spec).__name__}; "
            "the sinks+window bound applies to full-attention layers only"
        )
    try:
        check_backend(backend, on_cpu, flash_attn_version)
    except UnsupportedBackend as refused:
        raise UnsupportedBackend(f"{HF_OVERRIDE_KEY}: {refused}") from None
    return SinksWindowSpec.from_full_attention(
        spec, bound.sink_tokens, bound.window_tokens, max_in_flight_tokens
    )


def bounded_kv_cache_spec(layer: Attention, vllm_config):
    """`Attention.get_kv_cache_spec`, bounded when the engine asks for it."""
    from vllm.platforms import current_platform

    register_spec()
    bound = bound_from_vllm_config(vllm_config)
    on_cpu = current_platform.is_cpu()
    if bound is not None:
        check_window_config(vllm_config.model_config.rswa_window, bound.window_tokens, on_cpu)
        if not on_cpu:  # the CPU impl checks its own (metronome.vllm.attention)
            check_layer_features(layer.impl, layer.layer_name)
            parallel = vllm_config.parallel_config
            check_parallelism(getattr(parallel, "decode_context_parallel_size", 1),
                              getattr(parallel, "prefill_context_parallel_size", 1))
    return bounded_spec(
        _stock_get_kv_cache_spec(layer, vllm_config), bound,
        layer.attn_backend.get_name(), layer.layer_name, vllm_config.max_in_flight_tokens,
        on_cpu, getattr(layer.impl, "vllm_flash_attn_version", None),
    )


def _patch_cpu_backend() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from metronome.vllm.attention import SinksWindowCPUImpl

    CPUAttentionBackend.get_impl_cls = staticmethod(lambda: SinksWindowCPUImpl)


def register() -> None:
    from vllm.platforms import current_platform

    register_spec()
    Attention.get_kv_cache_spec = bounded_kv_cache_spec
    if current_platform.is_cpu():
        _patch_cpu_backend()
    else:
        from metronome.vllm import gpu_metadata

        gpu_metadata.install()
