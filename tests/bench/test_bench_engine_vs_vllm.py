"""engine-vs-vllm's pure parts: each system's step budget (its defaults unless both are
given one) and the memory floor of a decode step (weights once + resident KV once)."""

from __future__ import annotations

import pytest
import torch

from metronome.bench import engine_vs_vllm
from metronome.bench.engine.floor import decode_floor_ms, read_bandwidth_gbs, weight_bytes
from metronome.bench.vllm.names import OURS, SLIDING, STOCK
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import random_model


def test_unset_budgets_give_each_system_its_default_and_set_ones_give_both_the_same():
    assert engine_vs_vllm.Config().budgets() == {
        "ours": {}, "vllm": {"max_chunk_tokens": 4096, "max_step_tokens": 4096}}
    both = engine_vs_vllm.Config(max_chunk_tokens=512, max_step_tokens=2048).budgets()
    assert both == {"ours": {"max_chunk_tokens": 512, "max_step_tokens": 2048},
                    "vllm": {"max_chunk_tokens": 512, "max_step_tokens": 2048}}


def test_the_floor_is_the_weights_and_the_resident_kv_read_once():
    model = random_model(TINY_LLAMA, torch.bfloat16, seed=1)
    expected_weights = sum(w.numel() * 2 for layer in model.layers
                           for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert weight_bytes(model) == expected_weights + model.lm_head.numel() * 2
    kv = 8 * 100 * model.config.kv_bytes_per_token(torch.bfloat16)
    assert decode_floor_ms(model, 8, 100, 2.0) == pytest.approx(
        (weight_bytes(model) + kv) / 2e9 * 1e3)
    cfg = engine_vs_vllm.Config(sink_tokens=4, window_tokens=60)
    cells = [{"system": OURS, "pair": SLIDING, "sessions": 8, "context_tokens": 1000,
              "step_ms_median": 10.0},
             {"system": OURS, "pair": STOCK, "sessions": 8, "context_tokens": 100,
              "step_ms_median": 10.0},
             {"system": SLIDING, "pair": SLIDING, "sessions": 8, "context_tokens": 1000,
              "step_ms_median": 9.0}]
    engine_vs_vllm._add_floor(cells, model, cfg, 2.0)
    bounded, unbounded, theirs = cells
    assert bounded["floor_ms"] == pytest.approx(decode_floor_ms(model, 8, 64, 2.0))
    assert unbounded["floor_ms"] == pytest.approx(decode_floor_ms(model, 8, 100, 2.0))
    assert bounded["floor_multiple"] == pytest.approx(10.0 / bounded["floor_ms"])
    assert "floor_ms" not in theirs


def test_read_bandwidth_is_a_plausible_rate():
    assert 0.1 < read_bandwidth_gbs(repeats=1) < 10_000
