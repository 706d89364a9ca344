"""Virtual-clock scenarios: N sessions for a whole run, the offline N* sweep, and runs under an
admission controller.

Real engine steps (any model: the tiny test model or SmolLM2), time from a `StepCostModel`
(e.g. fitted from `metronome bench engine`), so a run is deterministic and fast. Used by the
tests, `metronome bench admission` and the cliff, admission and predict experiments.
"""

from __future__ import annotations

from dataclasses import dataclass

from metronome.admission.controller import AdmissionController, CapSample
from metronome.admission.limits import ConcurrencyLimit
from metronome.engine.engine import Engine, EngineConfig
from metronome.kv.residency import ResidencyPolicy
from metronome.model.llama import LlamaModel
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionProfile
from metronome.sim.cost_model import StepCostModel
from metronome.sim.recorder import RunRecorder
from metronome.sim.search import largest_passing
from metronome.sim.virtual import VirtualDriver
from metronome.sim.workload import Workload, schedule
from metronome.stats import percentile
from metronome.stream import Frame, FrameStatus
from metronome.workload_defaults import (
    BLOCK_SIZE_TOKENS,
    FRAME_PERIOD_S,
    INPUT_TOKENS_PER_FRAME,
    OUTPUT_TOKENS_PER_FRAME,
    POLICY_SPEC,
    TARGET_FRACTION,
)


@dataclass(frozen=True)
class Scenario:
    model: LlamaModel
    cost: StepCostModel
    policy: str = POLICY_SPEC
    pool_tokens: int = 1 << 20  # big enough never to bind: these runs measure the deadline
    block_size: int = BLOCK_SIZE_TOKENS
    frame_period_s: float = FRAME_PERIOD_S
    tokens_per_frame: int = INPUT_TOKENS_PER_FRAME
    output_tokens: int = OUTPUT_TOKENS_PER_FRAME
    target_fraction: float = TARGET_FRACTION

    def profile(self) -> SessionProfile:
        return SessionProfile(frame_period_s=self.frame_period_s,
                              max_output_tokens_per_frame=self.output_tokens,
                              policy=ResidencyPolicy.parse(self.policy))

    def driver(self, listeners: Listeners) -> tuple[Engine, VirtualDriver]:
        engine = Engine(self.model, EngineConfig(block_size=self.block_size,
                                                 pool_tokens=self.pool_tokens))
        return engine, VirtualDriver(engine, self.cost, listeners)

    def source(self):
        vocab, n = self.model.config.vocab_size, self.tokens_per_frame
        return lambda sid, i: ([(sid * 131 + i * 17 + k) % (vocab - 1) + 1 for k in range(n)],
                               None)


def run_fixed(scenario: Scenario, sessions: int, duration_s: float = 40.0,
              warmup_s: float = 10.0) -> dict:
    """N sessions for the whole run (no admission): steady-state p95 of latency/deadline."""
    results: list[Frame] = []
    _, driver = scenario.driver(Listeners(on_result=results.append))
    workload = Workload(sessions, duration_s, arrival_spread_s=scenario.frame_period_s)
    schedule(workload, scenario.profile(), driver.beat, driver.clock, scenario.source())
    driver.run_until(workload.end_s + 2)
    steady = [r for r in results if r.arrival_s >= warmup_s]
    fractions = [r.latency_fraction for r in steady]
    return {"sessions": sessions, "p95_fraction": percentile(fractions, 95),
            "miss_rate": sum(not r.deadline_met for r in steady) / max(1, len(steady))}


def sweep_n_star(scenario: Scenario, n_max: int = 256, **run_args) -> tuple[int, list[dict]]:
    """Largest N whose steady p95 latency <= target x deadline (latency grows with N)."""
    table: dict[int, dict] = {}

    def ok(n: int) -> bool:
        table[n] = run_fixed(scenario, n, **run_args)
        return table[n]["p95_fraction"] <= scenario.target_fraction

    return largest_passing(ok, n_max), [table[n] for n in sorted(table)]



@dataclass
class ControlledRun:
    history: list[CapSample]
    results: list[Frame]
    counts: dict
    saturated_at_s: float | None = None  # first stalled_kv frame (unbounded runs)


def run_controlled(scenario: Scenario, limit: ConcurrencyLimit, duration_s: float,
                   arrival_every_s: float = 0.25, session_s: float = 30.0,
                   jitter: float = 0.3, interval_s: float = 2.0, seed: int = 0,
                   cost_change: tuple[float, StepCostModel] | None = None) -> ControlledRun:
    """Sessions arrive faster than capacity; the controller admits or refuses each.
    `cost_change` (at_s, cost): steps cost that from at_s on (a sudden loss of capacity)."""
    recorder = RunRecorder()
    controller = AdmissionController(limit, lambda: len(engine.sessions), interval_s)
    engine, driver = scenario.driver(Listeners.of(recorder, controller))
    results = recorder.results
    workload = Workload(int(duration_s / arrival_every_s), session_s,
                        arrival_spread_s=duration_s, duration_jitter=jitter, seed=seed)
    schedule(workload, scenario.profile(), driver.beat, driver.clock, scenario.source(),
             gate=controller.try_admit)
    controller.start(driver.clock)
    if cost_change is not None:
        at_s, cost = cost_change
        driver.clock.call_at(at_s, lambda _t: setattr(driver, "cost_model", cost))
    driver.run_until(duration_s)
    stalls = [r.finish_s for r in results if r.status is FrameStatus.STALLED_KV]
    return ControlledRun(controller.history, results, dict(controller.counts),
                         min(stalls) if stalls else None)
