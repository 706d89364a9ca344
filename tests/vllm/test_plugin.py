"""How an engine asks for the bound, and what the plugin refuses (no engine, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                    reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

from metronome.vllm.config import SinksWindow, bound_from_vllm_config, parse_bound  # noqa: E402
from metronome.vllm.plugin import bounded_spec  # noqa: E402
from metronome.vllm.spec import SinksWindowSpec  # noqa: E402

FULL = FullAttentionSpec(block_size=32, num_kv_heads=3, head_size=64, dtype=torch.float32)


def vllm_config(**hf_overrides):
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf_overrides)))


def test_bound_comes_from_hf_overrides():
    assert bound_from_vllm_config(vllm_config()) is None  # plugin installed, not asked: stock
    config = vllm_config(metronome_residency="sinks_window:4:512")
    assert bound_from_vllm_config(config) == SinksWindow(4, 512)
    assert parse_bound("window:256@absolute") == SinksWindow(0, 256)
    assert parse_bound("unbounded") is None


@pytest.mark.parametrize("text", ["sinks_window:4:512@rolling", "sinks_window:4", "sinks:4:8"])
def test_bad_bounds_are_refused(text):
    with pytest.raises(ValueError):
        parse_bound(text)


def test_full_attention_layers_get_the_bounded_spec():
    spec = bounded_spec(FULL, SinksWindow(4, 512), "CPU_ATTN", "layers.0.attn", 256)
    assert isinstance(spec, SinksWindowSpec)
    assert (spec.sink_tokens, spec.window_tokens, spec.max_in_flight_tokens) == (4, 512, 256)
    assert spec.page_size_bytes == FULL.page_size_bytes  # same pages, same block table
    assert bounded_spec(FULL, None, "FLASH_ATTN", "layers.0.attn", 256) is FULL


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"])
def test_backends_without_the_mask_are_refused_on_cpu(backend):
    with pytest.raises(ValueError, match=f"backend {backend} is not supported on CPU"):
        bounded_spec(FULL, SinksWindow(4, 512), backend, "layers.0.attn", 256)


def test_layers_that_are_not_full_attention_are_refused():
    window = SlidingWindowSpec(block_size=32, num_kv_heads=3, head_size=64,
                               dtype=torch.float32, sliding_window=4096)
    with pytest.raises(ValueError, match="full-attention layers only"):
        bounded_spec(window, SinksWindow(4, 512), "CPU_ATTN", "layers.1.attn", 256)
