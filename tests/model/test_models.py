"""Model sources: presets' KV bytes per token (the memory ceiling), the bundled model's shape."""

from __future__ import annotations

import pytest
import torch

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model.weights import load_model, parse_preset
from metronome.stream import Stream
from tests.steps import by_session


@pytest.mark.parametrize(
    ("preset", "kv_bytes_bf16"),
    [
        ("qwen2.5-omni-7b", 2 * 28 * 4 * 128 * 2),  # 57,344 B/token
        ("moshi-7b", 2 * 32 * 32 * 128 * 2),  # 524,288 B/token: no GQA
        ("minicpm-o-4.5", 2 * 36 * 8 * 128 * 2),  # 147,456 B/token
        ("qwen3-omni-30b-a3b", 2 * 48 * 4 * 128 * 2),  # 98,304 B/token
    ],
)
def test_preset_kv_bytes_per_token(preset, kv_bytes_bf16):
    assert parse_preset(f"preset:{preset}").kv_bytes_per_token(torch.bfloat16) == kv_bytes_bf16


def test_a_few_layers_of_a_preset_run_in_the_engine():
    model = load_model("preset:minicpm-o-4.5:1", torch.bfloat16)
    assert model.config.num_layers == 1 and model.config.qk_norm
    engine = Engine(model, EngineConfig(block_size=16, pool_memory_bytes=64 * 2**20,
                                        pool_tokens=None))
    assert engine.pool.num_blocks == 64 * 2**20 // (2 * 8 * 128 * 2) // 16
    sid = engine.open_session(Stream.of(SessionSpec(policy=ResidencyPolicy.sinks_window(4, 32))))
    engine.submit(sid, list(range(40)), max_new_tokens=3)
    new = []
    while engine.has_work:
        new += by_session(engine.step())[sid].new_token_ids
    assert len(new) == 3


def test_bundled_model_is_smollm2(smollm2):
    cfg = smollm2.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings


def test_unknown_model_sources_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="unknown preset"):
        load_model("preset:gpt-5")
