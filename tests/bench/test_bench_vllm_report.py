"""`metronome bench vllm`'s report from a result (no vLLM needed): the step tables per step
kind with the plugin / sliding-window ratio, and a streaming table whose stall and
unanswered columns are separate and counted per arm."""

from __future__ import annotations

import pytest

from metronome.bench import vllm_bench
from metronome.bench.vllm.names import LABELS, NATIVE, PLUGIN, SLIDING, STOCK
from metronome.bench.vllm.stream import summarize_frames


def _cell(engine, step, ms, n=8, length=1024):
    rows = n * (1 if step == "decode" else 16)
    return {"engine": engine, "step": step, "sessions": n, "context_tokens": length,
            "step_ms_median": ms, "tokens_per_s": rows / ms * 1e3}


def test_step_tables_split_by_kind_with_the_plugin_ratio():
    cells = [_cell(STOCK, "decode", 60.0), _cell(SLIDING, "decode", 40.0),
             _cell(PLUGIN, "decode", 44.0), _cell(NATIVE, "decode", 38.0),
             _cell(SLIDING, "chunk", 200.0), _cell(PLUGIN, "chunk", 190.0)]
    decode = vllm_bench.step_table(cells, LABELS, "decode")
    chunk = vllm_bench.step_table(cells, LABELS, "chunk")
    assert "| 8 | 1,024 | 60.0 (133) | 40.0 (200) | 44.0 (182) | 38.0 (211) | 1.10x |" in decode
    assert "| 8 | 1,024 | 200.0 (640) | 190.0 (674) | 0.95x |" in chunk
    assert "stock vLLM" not in chunk  # only the systems measured at that step


def test_config_groups_are_checked():
    assert vllm_bench.Config().groups == [(STOCK,), (NATIVE, SLIDING, PLUGIN)]
    with pytest.raises(ValueError, match="unknown systems \\['nope'\\]"):
        _ = vllm_bench.Config(engine_groups=("vllm+nope",)).groups


def test_stream_table_counts_each_arm_from_its_frames():
    # arrivals 0..9 s, deadline 1 s, stopped at 10 s: frames 0..9 are due
    answered = [(float(t), t + 0.5, True) for t in range(5)]
    never = [(float(t), None, False) for t in range(5, 10)]
    stock = {"run": "stock vLLM", "sessions": 4, **summarize_frames(answered + never, 1.0, 10.0),
             "first_stall_arrival_s": None, "stalled_kv_frames": None}
    assert stock["frames"] == 10 and stock["never_answered"] == 5 and stock["goodput"] == 0.5
    beat = {"run": "Metronome on vLLM, unbounded", "sessions": 4,
            **summarize_frames([(float(t), t + 0.2, t < 7) for t in range(10)], 1.0, 10.0),
            "first_stall_arrival_s": 7.0, "stalled_kv_frames": 3}
    table = vllm_bench.stream_table([stock, beat])
    assert "| first stall (s) | first unanswered (s) |" in table
    assert "| 4 | stock vLLM | 10 | 5 | - | 5.0 | - | 0.500 |" in table
    assert "| 4 | Metronome on vLLM, unbounded | 10 | 0 | 7.0 | - | 3 | 0.700 |" in table
