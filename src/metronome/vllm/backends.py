"""Which vLLM attention backends can run the sinks+window bound, and what none of them can.

The bound is one mask: a query at position p sees key j iff j <= p and (j < S or p - j < W).
On CPU our own implementation applies it (`metronome.vllm.attention`). On GPUs vLLM 0.32
already carries exactly that mask as reference sliding-window attention (R-SWA):
`causal & (kv < prefix | q - kv < rswa_window)`, applied by the Triton unified-attention
kernel, FlexAttention and FlashAttention 4 from each request's `rswa_prefix_lens` and the
model config's `rswa_window`. With the window set to W (`rswa_window` in `hf_overrides`) and
the prefix fixed at S for every request (`metronome.vllm.gpu_metadata`), R-SWA is our rule.

Every other backend would attend the freed gap (its table entries point at vLLM's null block
or at blocks another request now owns) without an error, so it is refused by name, with the
fix in the message.
"""

from __future__ import annotations

CPU_BACKENDS = ("CPU_ATTN",)
GPU_BACKENDS = ("TRITON_ATTN", "FLEX_ATTENTION", "FLASH_ATTN")  # FLASH_ATTN: version 4 only
FIX = ("start the engine with attention_config={'backend': 'TRITON_ATTN'} "
       "(vllm serve: --attention-backend TRITON_ATTN) or FLEX_ATTENTION")
_REFUSED_WHY = {
    "FLASH_ATTN": "FlashAttention {version} takes a plain sliding window only and ignores "
                  "R-SWA's prefix (on Hopper FA3 is vLLM's default); only FA4 applies it",
    "FLASHINFER": "FlashInfer takes a plain sliding window only and ignores R-SWA's prefix",
}
_OTHER_WHY = "it does not apply R-SWA's per-request prefix (rswa_prefix_lens)"


class UnsupportedBackend(ValueError):
    """An attention backend or layer feature the bound cannot run on (the message says why
    and how to start the engine instead)."""


def check_backend(backend: str, on_cpu: bool, flash_attn_version: int | None = None) -> None:
    """Raise `UnsupportedBackend` unless `backend` applies the sinks+window mask exactly.

    `flash_attn_version` is the FlashAttention version the layer's implementation picked
    (`vllm_flash_attn_version`); only 4 applies R-SWA's prefix.
    """
    allowed = CPU_BACKENDS if on_cpu else GPU_BACKENDS
    if backend in allowed and (backend != "FLASH_ATTN" or flash_attn_version == 4):
        return
    if on_cpu:
        raise UnsupportedBackend(
            f"attention backend {backend} is not supported on CPU (supported: CPU_ATTN): "
            "only the plugin's CPU attention knows the freed gap")
    version = f"FA{flash_attn_version}" if flash_attn_version else "FA2/FA3"
    why = _REFUSED_WHY.get(backend, _OTHER_WHY).format(version=version)
    raise UnsupportedBackend(
        f"attention backend {backend} is not supported with the sinks+window bound: {why}, "
        f"so it would silently attend the freed gap. Fix: {FIX}.")


UNQUANTIZED_KV_DTYPES = frozenset({"auto", "bfloat16", "float16", "half", "float32", "float"})


def refused_features(impl, any_explicit_kv_dtype: bool = True) -> list[str]:
    """Layer features no backend runs under the bound, read off an attention impl. The CPU
    attention reads the cache in the model's dtype only (`any_explicit_kv_dtype`: refuse
    every kv_cache_dtype but "auto"); the GPU kernels take any unquantized one."""
    kv_cache_dtype = getattr(impl, "kv_cache_dtype", "auto")
    allowed = {"auto"} if any_explicit_kv_dtype else UNQUANTIZED_KV_DTYPES
    found = {
        "ALiBi": getattr(impl, "alibi_slopes", None) is not None,
        "logit soft-capping": bool(getattr(impl, "logits_soft_cap", None)),
        "learned attention sinks": getattr(impl, "sinks", None) is not None,
        f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype not in allowed,
    }
    return [name for name, present in found.items() if present]


def check_parallelism(decode_context_parallel: int, prefill_context_parallel: int) -> None:
    """Context parallelism splits a request's KV over ranks; vLLM 0.32's DCP path (e.g.
    FlashAttention's `_forward_with_dcp`) never applies R-SWA's mask: refused."""
    if decode_context_parallel > 1 or prefill_context_parallel > 1:
        raise UnsupportedBackend(
            f"context parallelism (decode {decode_context_parallel}, prefill "
            f"{prefill_context_parallel}) is not supported with the sinks+window bound: its "
            "attention path ignores R-SWA's prefix. Fix: decode/prefill_context_parallel_size=1")


def check_layer_features(impl, layer_name: str) -> None:
    found = refused_features(impl, any_explicit_kv_dtype=False)
    if found:
        raise UnsupportedBackend(
            f"layer {layer_name}: the sinks+window bound does not support {', '.join(found)}")


def check_window_config(rswa_window: int | None, window_tokens: int, on_cpu: bool) -> None:
    """On GPUs the backends read W from the model config's `rswa_window`: it must be W
    (on CPU it must be unset: CPU_ATTN has no R-SWA, and our CPU attention needs none)."""
    if on_cpu:
        if rswa_window is not None:
            raise UnsupportedBackend(
                f"rswa_window={rswa_window} is set, but vLLM's CPU attention has no R-SWA: "
                "drop rswa_window from hf_overrides on CPU (the plugin applies the window)")
        return
    if rswa_window != window_tokens:
        raise UnsupportedBackend(
            f"on GPUs the bound's window reaches the attention backend as the model config's "
            f"rswa_window, which is {rswa_window}, not W = {window_tokens}: add "
            f"\"rswa_window\": {window_tokens} to hf_overrides (VllmEngine does it for you)")
