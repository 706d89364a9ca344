"""engine-vs-vllm's pure parts: each system's step budget (its defaults unless both are
given one), the memory floor of a decode step (weights once + resident KV once), and the
repeated prefills (alternating, on fresh sessions) with their table."""

from __future__ import annotations

import pytest
import torch

from metronome.bench import engine_vs_vllm
from metronome.bench.engine import floor as engine_vs_vllm_floor
from metronome.bench.engine.floor import decode_floor_ms, read_bandwidth_gbs, weight_bytes
from metronome.bench.engine.flops import linear_weights
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


def test_a_step_is_compared_with_the_floor_of_its_own_rounds_bandwidth():
    """Bandwidth measured next to each round: each round's step over its own floor, and the
    median of those (a neighbour that halves the box's speed for one round moves both)."""
    model = random_model(TINY_LLAMA, torch.bfloat16, seed=1)
    cfg = engine_vs_vllm.Config(sink_tokens=4, window_tokens=60)
    cell = {"system": OURS, "pair": SLIDING, "sessions": 8, "context_tokens": 1000,
            "step_ms_median": 20.0, "round_medians_ms": [10.0, 20.0, 40.0],
            "round_bandwidth_gbs": [4.0, 2.0, 1.0]}
    engine_vs_vllm._add_floor([cell], model, cfg, 100.0)  # the run's own: not used here
    floors = [decode_floor_ms(model, 8, 64, gbs) for gbs in (4.0, 2.0, 1.0)]
    assert cell["round_floor_multiples"] == pytest.approx(
        [10.0 / floors[0], 20.0 / floors[1], 40.0 / floors[2]])
    assert cell["floor_multiple"] == pytest.approx(10.0 / floors[0])  # all equal: 4x apart
    assert cell["floor_ms"] == pytest.approx(floors[1])  # at the median bandwidth
    assert cell["run_floor_multiple"] == pytest.approx(
        20.0 / decode_floor_ms(model, 8, 64, 100.0))  # shown beside: the run's one reading
    assert "rounds" in engine_vs_vllm.decode_lines([{
        "pair": SLIDING, "sessions": 8, "context_tokens": 1000, "speed_ratio": 1.5,
        "min_ratio": 1.4, "ours": cell | {"decode_tokens_per_s": 400.0},
        "vllm": {"step_ms_median": 30.0, "decode_tokens_per_s": 266.0,
                 "round_medians_ms": [30.0]}}])[2]


def test_a_probe_of_given_tensors_reads_their_bytes_as_words():
    bf16 = torch.ones(1000, 1000, dtype=torch.bfloat16)
    odd = torch.ones(3, dtype=torch.bfloat16)  # 6 bytes: not a whole number of words
    probe = engine_vs_vllm_floor.BandwidthProbe([bf16, odd])
    words, kept = probe._tensors
    assert words.dtype == torch.float32 and words.numel() == 500_000
    assert words.data_ptr() == bf16.data_ptr()  # a view: the same pages, not a copy
    assert kept is odd
    assert 0.1 < probe.gbs(repeats=1) < 10_000


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_probe_reads_the_weights_the_step_reads(dtype):
    """The few-row kernel's own copy where a decode step runs it (bf16 packs one), else the
    weight: one tensor per projection and lm_head, in `linear_weights`' order."""
    from metronome.model import native

    model = random_model(TINY_LLAMA, dtype, seed=1)
    plain = linear_weights(model)
    read = engine_vs_vllm_floor.decode_step_weights(model)
    assert len(read) == len(plain) == 4 * len(model.layers) + 1
    small = native.small_linear(dtype) if model.packed_linear else None
    for tensor, weight in zip(read, plain, strict=True):
        if small is not None and dtype == torch.bfloat16:  # the packed copy, not the weight
            assert tensor is not weight and torch.equal(tensor, small.pack_bf16(weight))
        else:
            assert tensor is weight
    model.use_packed_linear(False)  # the reference: the plain weights
    assert all(t is w for t, w in zip(engine_vs_vllm_floor.decode_step_weights(model), plain,
                                      strict=True))


def test_read_bandwidth_is_a_plausible_rate():
    assert 0.1 < read_bandwidth_gbs(repeats=1) < 10_000


class _FakeEngine:
    """What `prefill` and `_timed_prefills` use of an engine; logs opens, prefills, closes."""

    def __init__(self, name: str, events: list) -> None:
        self.name, self.events, self.next_id, self.pending = name, events, 100, []

    def open_session(self, spec) -> int:
        self.next_id += 1
        return self.next_id

    def close(self, sid: int) -> None:
        self.events.append((self.name, "close", sid))

    def prepare_input(self, ids, _audio):
        return list(ids)

    def submit_prepared(self, sid: int, prepared, _max_new: int) -> None:
        self.pending.append((sid, len(prepared)))

    @property
    def has_work(self) -> bool:
        return bool(self.pending)

    def step(self) -> None:
        self.events.append((self.name, "prefill", tuple(sid for sid, _ in self.pending)))
        self.pending = []


def test_prefill_repeats_alternate_on_fresh_sessions_and_end_on_the_kept_ones():
    from metronome.bench.vllm.pair import _timed_prefills

    events: list = []
    engines = {"ours": _FakeEngine("ours", events), "vllm": _FakeEngine("vllm", events)}
    kept = {"ours": [1, 2, 3], "vllm": [11, 12, 13]}
    cfg = engine_vs_vllm.Config(prefill_sessions=2, prefill_repeats=3)
    runs = _timed_prefills(cfg, engines, kept, {"ours": None, "vllm": None},
                           {"ours": 1, "vllm": 1}, 64, list(range(200)), lambda _line: None)
    assert {name: len(r) for name, r in runs.items()} == {"ours": 3, "vllm": 3}
    prefills = [(name, sids) for name, kind, sids in events if kind == "prefill"]
    assert [name for name, _ in prefills] == ["ours", "vllm", "vllm", "ours", "ours", "vllm"]
    # the last repeat prefills the kept sessions (the first prefill_sessions of them) ...
    assert prefills[-2:] == [("ours", (1, 2)), ("vllm", (11, 12))]
    # ... the others fresh ones, each closed right after its prefill
    fresh = [sids for _, sids in prefills[:4]]
    assert all(sid > 100 for sids in fresh for sid in sids)
    closed = [sid for _, kind, sid in events if kind == "close"]
    assert sorted(closed) == sorted(sid for sids in fresh for sid in sids)


def test_prefill_table_gives_the_medians_and_every_run():
    cells = [{"system": OURS, "pair": STOCK, "sessions": 8, "context_tokens": 1024,
              "prefill_s": 6.0, "prefill_runs_s": [6.0, 7.0, 5.0], "prefill_sessions": 8},
             {"system": STOCK, "pair": STOCK, "sessions": 8, "context_tokens": 1024,
              "prefill_s": 8.0, "prefill_runs_s": [8.0, 9.0, 7.5], "prefill_sessions": 8}]
    table = engine_vs_vllm.prefill_table(cells)
    assert "| 6.0 | 8.0 | 0.75x | 6.0 / 8.0, 7.0 / 9.0, 5.0 / 7.5 |" in table


def test_a_grid_whose_kv_pools_do_not_fit_the_memory_is_named_before_it_runs():
    from metronome.bench.vllm.pair import PROCESS_HEADROOM_BYTES, pairs_needing_too_much

    model = random_model(TINY_LLAMA, torch.float32, seed=1)
    per_token = model.config.kv_bytes_per_token(torch.float32)
    cfg = engine_vs_vllm.Config(sessions=(8, 64), lengths=(1024,), window_tokens=512)
    bounded_pool = 64 * (4 + 512 + 1024 + 64)  # window + vLLM's in-flight reserve each
    bounded_pool = -(-bounded_pool // 32) * 32
    plenty = 4 * bounded_pool * per_token + PROCESS_HEADROOM_BYTES + (1 << 30)
    assert pairs_needing_too_much(cfg, model, plenty) == []
    weights = 2 * weight_bytes(model)  # both engines' copies
    tight = 2 * bounded_pool * per_token + weights + PROCESS_HEADROOM_BYTES - 1  # 1 short
    lines = pairs_needing_too_much(cfg, model, tight)
    assert len(lines) == 1 and "sinks_window" in lines[0] and "N=64" in lines[0]
    assert len(pairs_needing_too_much(cfg, model, 1 << 20)) == 2  # both pairs named
    assert pairs_needing_too_much(cfg, model, tight + 1) == []
    small = engine_vs_vllm.Config(sessions=(8,), lengths=(1024,), window_tokens=512)
    assert pairs_needing_too_much(small, model, tight) == []
    # the in-flight reserve is the step budget where the context is longer
    long = engine_vs_vllm.Config(sessions=(8,), lengths=(8192,), window_tokens=512,
                                 max_prefill_tokens=65536)
    pool = -(-8 * (4 + 512 + 4096 + 64) // 32) * 32
    fits = 2 * pool * per_token + weights + PROCESS_HEADROOM_BYTES

    def bounded(available):
        return [line for line in pairs_needing_too_much(long, model, available)
                if "sinks_window" in line]

    assert bounded(fits) == [] and len(bounded(fits - 1)) == 1
