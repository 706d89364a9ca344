"""The capacity planner: exact arithmetic (block rounding, the schedule, which binds, t_sat),
and its N* against a virtual-clock sweep."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from metronome.cli import app
from metronome.kv.residency import ResidencyPolicy
from metronome.model.config import TINY_LLAMA
from metronome.plan.budget import KvBudget, kv_budget, parameter_count, parse_bytes
from metronome.plan.deadline import DeadlineModel
from metronome.plan.memory import (
    peak_blocks,
    peak_blocks_bound,
    sessions_that_fit,
    t_sat_block_level_s,
    t_sat_token_level_s,
)
from metronome.plan.planner import PlanInputs, make_plan
from metronome.plan.schedule import FrameSchedule, mean_visible_context_tokens
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.sim.scenario import Scenario, sweep_n_star

SW = ResidencyPolicy.sinks_window


def test_frame_schedule_chunks_steps_and_tokens():
    frame = FrameSchedule(12, 4, 64)  # carry + input (samples token 1), 3 decodes
    assert (frame.chunks, frame.num_steps, frame.tokens_written) == ([13, 1, 1, 1], 4, 16)
    long_prompt = FrameSchedule(100, 2, 64)
    assert (long_prompt.chunks, long_prompt.num_steps) == ([64, 37, 1], 3)
    assert FrameSchedule(63, 1, 64).chunks == [64]  # the carry fills the chunk exactly
    assert FrameSchedule(0, 3, 64).chunks == [1, 1, 1]  # the carry samples the first token
    assert FrameSchedule(12, 0, 64).chunks == [12]  # listening: no carry, no output
    with pytest.raises(ValueError):
        FrameSchedule(0, 0, 64)


def test_peak_block_bound_rounds_to_whole_blocks():
    assert peak_blocks_bound(SW(4, 512), 16, 1) == 34  # 1 sink block + 32 + 1
    assert peak_blocks_bound(SW(4, 512), 16, 64) == 38  # a 64-token chunk: 4 more
    assert peak_blocks_bound(ResidencyPolicy.window(8), 4, 1) == 3  # ceil(7/4) + 1
    assert peak_blocks_bound(SW(20, 128), 16, 12) == 2 + 9 + 1  # two sink blocks
    with pytest.raises(ValueError):
        peak_blocks_bound(ResidencyPolicy.unbounded(), 16, 1)


def test_peak_blocks_replays_the_chunk_pattern():
    # 16 tokens a frame in blocks of 16: every 12-token chunk starts one past a block
    # boundary and never spans two new blocks, so the bound's worst case (11) never happens
    assert peak_blocks(SW(4, 128), 16, [1, 12, 1, 1, 1], 40) == 10
    # 15 tokens a frame: chunk starts cycle through every offset, and the bound is reached
    assert peak_blocks(SW(4, 128), 16, [1, 12, 1, 1], 60) == 11
    assert peak_blocks(SW(4, 512), 16, [1], 2000) == 34
    # a session too short to fill its window holds what it wrote: 3 frames x 16 = 3 blocks
    assert peak_blocks(SW(4, 128), 16, [1, 12, 1, 1, 1], 3) == 3
    assert peak_blocks(ResidencyPolicy.unbounded(), 16, [1, 12, 1, 1, 1], 10) == 10


@settings(max_examples=40, deadline=None)
@given(sinks=st.integers(0, 40), window=st.integers(1, 200), block=st.sampled_from([1, 4, 16]),
       chunk=st.integers(1, 40))
def test_peak_never_exceeds_the_bound_and_single_tokens_reach_it(sinks, window, block, chunk):
    policy = SW(sinks, window) if sinks else ResidencyPolicy.window(window)
    frames = (sinks + window) // chunk + 3 * block + 4
    assert peak_blocks(policy, block, [chunk], frames) <= peak_blocks_bound(policy, block, chunk)
    assert peak_blocks(policy, block, [1], sinks + window + 3 * block) == (
        peak_blocks_bound(policy, block, 1))


def test_sessions_that_fit_is_whole_sessions():
    assert sessions_that_fit(4096, 34) == 120  # 4080 blocks used, 16 left over
    assert sessions_that_fit(33, 34) == 0
    assert sessions_that_fit(-5, 34) == 0


def test_t_sat_token_and_block_level():
    # the paper's form: (1 - 0.25) * 4096 tokens / (8 sessions * 16 tokens/s)
    assert t_sat_token_level_s(0.25, 4096, 8, 16.0) == 24.0
    # 100 free blocks over 8 sessions: 12 blocks each, 12 * 16 tokens at 16 tokens/s
    assert t_sat_block_level_s(100, 16, 8, 16.0, None) == 12.0
    assert t_sat_block_level_s(100, 16, 8, 16.0, 13) == 12.0  # a peak above 12 still stalls
    assert t_sat_block_level_s(100, 16, 8, 16.0, 12) == math.inf  # bounded, and it fits
    assert t_sat_token_level_s(0.0, 4096, 0, 16.0) == math.inf


def test_deadline_ceilings_exact():
    cost = StepCostModel(fixed_s=0.01, per_token_s=0.001, per_context_token_s=0.0)
    model = DeadlineModel(cost, FrameSchedule(12, 4, 64), context_tokens=100.0,
                          frame_period_s=1.0, deadline_s=1.0, target_fraction=0.8)
    assert model.work_per_frame_s == pytest.approx(0.016)  # 16 tokens x 1 ms
    # 4 steps a frame: floor((1 / 0.016) * (1 - 5 * 0.01 / 0.8)) = floor(58.59375)
    assert model.n_star() == 58
    # floor((0.8 - 4 * 0.01) / 0.016) = floor(47.5)
    assert model.n_star_aligned() == 47
    assert model.latency_s(58) <= 0.8 < model.latency_s(59)
    assert model.latency_aligned_s(47) <= 0.8 < model.latency_aligned_s(48)
    keys = DeadlineModel(StepCostModel(0.01, 0.0, 1e-4), FrameSchedule(12, 4, 64), 100.0,
                         1.0, 1.0, 0.8)
    assert keys.work_per_frame_s == pytest.approx(4 * 100 * 1e-4)  # 4 steps x 100 keys


def test_visible_context():
    assert mean_visible_context_tokens(SW(4, 128), 16, 640) == 4 + 128 + 7.5
    assert mean_visible_context_tokens(SW(4, 128), 16, 100) == 100  # never fills the window
    assert mean_visible_context_tokens(ResidencyPolicy.unbounded(), 16, 640) == 640


def _inputs(num_blocks: int, **kw) -> PlanInputs:
    budget = KvBudget(num_blocks, 512, 16, f"{num_blocks} blocks")
    cost = StepCostModel(fixed_s=0.01, per_token_s=0.001, per_context_token_s=0.0)
    return PlanInputs("tiny", budget, kw.pop("policy", SW(4, 128)), cost, "test",
                      session_s=40.0, **kw)


def test_which_binds():
    # 10 blocks per session at its peak, N* = 58 (as above)
    assert make_plan(_inputs(10 * 58)).binds == "both"
    deadline = make_plan(_inputs(10 * 58 + 10))
    assert (deadline.binds, deadline.memory_ceiling, deadline.capacity) == ("deadline", 59, 58)
    memory = make_plan(_inputs(10 * 58 - 1))
    assert (memory.binds, memory.memory_ceiling, memory.capacity) == ("memory", 57, 57)
    assert memory.aimd.max_cap == 57 and memory.aimd.initial_cap == 47
    assert memory.aimd.min_cap == 23


def test_the_servers_admission_ceiling_reserves_a_full_chunk():
    # `metronome serve` counts 1 + ceil((128 + 64 - 2) / 16) + 1 = 14 blocks per session
    plan = make_plan(_inputs(10 * 57))
    assert (plan.memory_ceiling, plan.server_admission_ceiling) == (57, 570 // 14)
    assert any("admits at most 40" in note for note in plan.notes)
    assert make_plan(_inputs(570, policy=ResidencyPolicy.unbounded())
                     ).server_admission_ceiling is None


def test_plan_t_sat_and_prior_occupancy():
    plan = make_plan(_inputs(400, policy=ResidencyPolicy.unbounded(), sessions=8,
                             prior_fraction=0.5))
    assert plan.free_blocks == 200
    assert plan.t_sat_unbounded_block_level_s == 25 * 16 / 16.0  # 200 // 8 blocks each
    assert plan.t_sat_unbounded_token_level_s == 0.5 * 6400 / (8 * 16.0)
    assert plan.t_sat_policy_s == plan.t_sat_unbounded_block_level_s
    assert plan.cliff_within_session  # 25 s < 40 s
    assert plan.blocks_per_session == 40 and plan.memory_ceiling == 5  # 640 tokens each
    assert make_plan(_inputs(400, sessions=8)).t_sat_policy_s == math.inf  # bounded fits


def test_budget_units_weights_and_gpu_memory():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("141GiB") == 141 * 2**30
    assert parse_bytes("1.5e9") == 1_500_000_000
    assert parse_bytes("12 MiB") == 12 * 2**20
    with pytest.raises(ValueError):
        parse_bytes("12 parsecs")
    smollm2 = replace(TINY_LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                      tie_word_embeddings=True)
    assert parameter_count(smollm2) == 134_515_008  # SmolLM2-135M's published count
    assert TINY_LLAMA.kv_bytes_per_token(torch.float32) == 512
    # 1 MB x 0.5 - 100 kB of weights = 400 kB of KV: 781 tokens, 48 whole blocks
    budget = kv_budget(TINY_LLAMA, torch.float32, 16, gpu_memory_bytes=10**6, utilization=0.5,
                       weights_bytes=100_000)
    assert (budget.num_blocks, budget.pool_tokens) == (48, 768)
    with pytest.raises(ValueError):
        kv_budget(TINY_LLAMA, torch.float32, 16, pool_tokens=64, pool_bytes=10**6)


def test_cli_json_for_a_preset():
    result = CliRunner().invoke(app, [
        "plan", "--model", "preset:moshi-7b", "--gpu-memory", "180GB", "--frame-period-s",
        "0.08", "--tokens-in", "1", "--tokens-out", "1", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2
    assert plan["blocks_per_session"] == 34 and plan["binds"] in ("memory", "deadline", "both")
    bad = CliRunner().invoke(app, ["plan", "--model", "preset:moshi-7b", "--pool-tokens",
                                   "4096", "--gpu-memory", "80GB"])
    assert bad.exit_code != 0


N_STAR_TOLERANCE = 0.10  # measured on 5 profiles: docs/results/plan.md


def test_predicted_n_star_matches_the_virtual_clock_sweep(tiny_model):
    cost = StepCostModel.load(PACKAGED_STEP_COST)[0]
    scenario = Scenario(tiny_model, cost, policy="sinks_window:4:64", frame_period_s=0.5,
                        tokens_per_frame=6, output_tokens=2)
    swept, table = sweep_n_star(scenario, n_max=64, duration_s=30.0)
    budget = kv_budget(TINY_LLAMA, torch.float32, 16, pool_tokens=scenario.pool_tokens)
    plan = make_plan(PlanInputs("tiny", budget, SW(4, 64), cost, "packaged",
                                frame_period_s=0.5, input_tokens=6, output_tokens=2,
                                session_s=30.0))
    print(f"predicted N* {plan.deadline_ceiling}, swept {swept}")
    assert abs(plan.deadline_ceiling - swept) <= N_STAR_TOLERANCE * swept, table
