"""Saturation forecast: exact block-level timing against a block pool that really runs dry."""

from __future__ import annotations

import math

from metronome.kv.block_pool import BlockPool
from metronome.kv.block_table import BlockTable
from metronome.kv.residency import ResidencyPolicy
from metronome.observe.forecast import Forecast, SaturationForecaster

BLOCK = 16
TICK_S = 0.125  # every session writes one token per tick: 8 tokens/s, exact in binary


def simulate(
    num_blocks: int, prompt_tokens: list[int], policy: ResidencyPolicy, num_ticks: int = 2000
) -> tuple[list[Forecast], list[int], float]:
    """Sessions write one token per tick until the pool refuses a block.

    Returns one forecast and the pool's used blocks per tick, and the time a block was first
    refused (inf if never).
    """
    pool = BlockPool(num_blocks)
    tables = [BlockTable(policy, BLOCK) for _ in prompt_tokens]
    for table, num_tokens in zip(tables, prompt_tokens, strict=True):
        assert all(write_token(table, pool) for _ in range(num_tokens))
    forecaster = SaturationForecaster(BLOCK, window_s=5.0)
    forecasts, used_blocks = [], []
    for tick in range(1, num_ticks + 1):
        if not all(write_token(table, pool) for table in tables):
            return forecasts, used_blocks, tick * TICK_S
        tokens = {sid: table.resident_tokens for sid, table in enumerate(tables)}
        forecasts.append(forecaster.observe(tick * TICK_S, pool.num_free_blocks, tokens))
        used_blocks.append(pool.num_used_blocks)
    return forecasts, used_blocks, math.inf


def write_token(table: BlockTable, pool: BlockPool) -> bool:
    if not table.append(1, pool):
        return False
    table.slide(pool)
    return True


def forecast_at_occupancy(num_blocks: int, prompt_tokens: list[int], fraction: float):
    forecasts, used_blocks, saturated_at_s = simulate(
        num_blocks, prompt_tokens, ResidencyPolicy.unbounded()
    )
    tick = next(i for i, used in enumerate(used_blocks) if used >= fraction * num_blocks)
    return forecasts[tick], saturated_at_s


def test_unbounded_growth_out_of_step_forecast_at_30_percent():
    forecast, saturated_at_s = forecast_at_occupancy(100, [0, 5, 9, 14, 3, 11], 0.30)
    true_eta_s = saturated_at_s - forecast.made_at_s
    assert forecast.num_growing_sessions == 6 and forecast.rate_tokens_per_s == 8.0
    # Block level is exact up to the one token (one tick) whose write is refused.
    assert forecast.block_level_s == true_eta_s - TICK_S
    assert abs(forecast.block_level_s - true_eta_s) <= 0.10 * true_eta_s
    assert forecast.token_level_s > forecast.block_level_s


def test_in_step_sessions_small_pool_token_level_overestimates():
    # 7 sessions in step, 41 blocks: each can hold floor(free / 7) more blocks, and the free
    # blocks left over (free % 7) are what the token-level formula wrongly counts in.
    forecast, saturated_at_s = forecast_at_occupancy(41, [0] * 7, 0.30)
    true_eta_s = saturated_at_s - forecast.made_at_s
    # At 2.125 s: 17 tokens each (slack 15), 14 blocks used, 27 free; divmod(27, 7) = (3, 6).
    assert (forecast.made_at_s, saturated_at_s) == (2.125, 10.125)
    assert forecast.block_level_s == (15 + 3 * BLOCK) / 8 == true_eta_s - TICK_S
    assert forecast.token_level_s == (27 * BLOCK + 7 * 15) / (7 * 8)  # 9.59 s: 20 % late
    assert abs(forecast.block_level_s - true_eta_s) <= 0.10 * true_eta_s


def test_formula_by_hand():
    # block 4, slacks 3, 1, 0 tokens, 2 tokens/s each, 7 free blocks:
    # rounds, j = divmod(7, 3) = 2, 1 -> (sorted slacks[1] + 2 * 4) / 2 = 4.5 s
    forecaster = SaturationForecaster(block_size_tokens=4, window_s=10.0)
    # session 4 is bounded at steady state (saw-tooth under one block): it is not growing
    forecaster.observe(0.0, 9, {1: 1, 2: 3, 3: 4, 4: 70})
    forecast = forecaster.observe(2.0, 7, {1: 5, 2: 7, 3: 8, 4: 67})
    assert forecast == Forecast(2.0, 4.5, (7 * 4 + 4) / (3 * 2), 3, 2.0)
    assert forecaster.predicted_saturation_time_s == 6.5
    assert forecaster.eta_s(3.0) == 3.5
    assert forecaster.eta_s(7.0) == 0.0


def test_bounded_steady_state_reads_never():
    policy = ResidencyPolicy.sinks_window(4, 64)
    forecasts, used_blocks, saturated_at_s = simulate(
        200, [0, 7, 13, 21, 30], policy, num_ticks=400
    )
    assert saturated_at_s == math.inf
    warm_tick = 100  # 12.5 s: every window full; each session now holds 6 or 5 blocks
    assert (min(used_blocks[warm_tick:]), max(used_blocks[warm_tick:])) == (28, 30)
    assert math.isfinite(forecasts[20].block_level_s)  # still growing during warm-up
    window_ticks = 5.0 / TICK_S
    assert all(f.block_level_s == math.inf for f in forecasts[warm_tick + int(window_ticks):])


def test_shrinking_reads_never():
    forecaster = SaturationForecaster(block_size_tokens=16, window_s=10.0)
    forecaster.observe(0.0, 10, {1: 100, 2: 100, 3: 100})
    forecaster.observe(1.0, 17, {1: 100, 2: 100})  # session 3 closed
    assert forecaster.observe(2.0, 20, {1: 60, 2: 100}).block_level_s == math.inf
    assert forecaster.eta_s(2.0) == math.inf


def test_no_sessions_reads_never():
    forecaster = SaturationForecaster(block_size_tokens=16)
    assert forecaster.eta_s(0.0) == math.inf
    assert forecaster.observe(1.0, 100, {}).block_level_s == math.inf
    assert forecaster.predicted_saturation_time_s == math.inf
