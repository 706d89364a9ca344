"""The autoscaler without a cluster: the rule (`cluster.autoscale.decide`, exact), the
replicas' stats read as Ray Serve hands them over, the policy through Ray Serve's own
wrapper (what Ray applies is what it returns), the options, the board and the metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from metronome.cluster.autoscale import DOWN, HOLD, UP, Memory, ReplicaLoad, Rules, decide
from metronome.cluster.board import ClusterBoard
from metronome.cluster.config import ClusterConfig, parse_replicas
from metronome.cluster.metrics import ClusterMetrics, ReplicaRegistry

RULES = Rules(min_replicas=1, max_replicas=3, headroom_sessions=1, cooldown_s=5.0,
              down_after_s=30.0)


def load(cap: int, active: int, refused: int = 0) -> ReplicaLoad:
    return ReplicaLoad(cap, active, refused)


def test_a_refusal_adds_one_replica_and_starts_the_cooldown():
    decision, memory = decide(1, [load(2, 1, refused=1)], RULES, Memory(), now_s=100.0)
    assert (decision.replicas, decision.direction, decision.reason) == (
        2, UP, "1 session(s) refused")
    assert (decision.headroom, decision.refused) == (1, 1)
    assert memory == Memory(changed_at_s=100.0)


def test_headroom_below_the_threshold_adds_one_up_to_the_max():
    assert decide(1, [load(2, 2)], RULES, Memory(), 0.0)[0].replicas == 2
    at_max, _ = decide(3, [load(2, 2)] * 3, RULES, Memory(), 0.0)
    assert (at_max.replicas, at_max.direction, at_max.reason) == (
        3, HOLD, "headroom 0 < 1, at the max")


def test_holds_while_a_replica_starts_or_has_not_reported_and_within_the_cooldown():
    starting, memory = decide(2, [load(2, 2)], RULES, Memory(), 7.0)  # Ray starts one
    assert (starting.replicas, starting.direction) == (2, HOLD)
    assert memory == Memory(changed_at_s=7.0)  # the change is still taking effect
    silent, _ = decide(2, [load(2, 2), None], RULES, Memory(), 0.0)
    assert (silent.direction, silent.reason) == (HOLD, "2 of 2 replicas running and reporting")
    cooling, _ = decide(2, [load(2, 2), load(2, 2)], RULES, Memory(changed_at_s=96.0), 100.0)
    assert (cooling.direction, cooling.reason) == (HOLD, "cooling down")
    assert decide(2, [load(2, 2), load(2, 2)], RULES, Memory(changed_at_s=95.0),
                  100.0)[0].direction == UP  # 5 s on: the cooldown is over


def test_spare_beyond_one_replica_removes_one_only_after_the_period_without_a_break():
    idle = [load(2, 0), load(2, 1)]  # headroom 3 = one cap (2) + H (1)
    memory = Memory()
    for now_s, direction in ((0.0, HOLD), (10.0, HOLD), (29.0, HOLD), (30.0, DOWN)):
        decision, memory = decide(2, idle, RULES, memory, now_s)
        assert decision.direction == direction
    assert decision.replicas == 1 and memory == Memory(changed_at_s=30.0)
    assert decision.reason == "headroom 3 exceeds one replica's cap by 1 for 30 s"
    # a break (a session opened: headroom 2) restarts the period
    _, memory = decide(2, idle, RULES, Memory(), 0.0)
    _, memory = decide(2, [load(2, 1), load(2, 1)], RULES, memory, 20.0)
    assert memory.spare_since_s is None
    assert decide(2, idle, RULES, memory, 35.0)[0].direction == HOLD


def test_never_below_the_min_and_removal_never_triggers_an_addition():
    assert decide(1, [load(8, 0)], RULES, Memory(spare_since_s=0.0), 100.0)[0].direction == (
        HOLD)
    # after removing one of two idle replicas of cap 2 the fleet keeps 2 >= H free
    after, _ = decide(1, [load(2, 0)], RULES, Memory(), 0.0)
    assert after.direction == HOLD and after.reason == "steady"


def test_over_cap_replicas_lend_no_negative_room_and_an_unhealthy_one_none():
    decision, _ = decide(2, [load(2, 3), load(0, 0)], RULES, Memory(), 0.0)
    assert (decision.headroom, decision.direction) == (0, UP)


def test_replicas_option_takes_a_count_or_a_range():
    assert parse_replicas("3") == (3, None) and parse_replicas("1..4") == (1, 4)
    for bad in ("1-4", "..4", "a"):
        with pytest.raises(ValueError):
            parse_replicas(bad)
    with pytest.raises(ValueError, match="MAX < MIN"):
        ClusterConfig(replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="--autoscale-cooldown-s: only with --replicas"):
        ClusterConfig(replicas=2, autoscale_cooldown_s=1.0)
    assert ClusterConfig(replicas=1, max_replicas=2, autoscale_cooldown_s=1.0).autoscaled


def test_board_counts_decisions_and_hands_them_out_in_order():
    board = ClusterBoard(stale_after_s=2.0, forget_after_s=60.0)
    assert board.autoscaling() is None and "autoscaling" not in board.view()
    look = {"desired_replicas": 2, "headroom": 0}
    board.autoscaled(look, {"direction": UP, "from": 1, "to": 2})
    board.autoscaled(look | {"desired_replicas": 1}, {"direction": DOWN, "from": 2, "to": 1})
    board.autoscaled(look | {"desired_replicas": 1}, None)
    assert board.autoscaling() == {"desired_replicas": 1, "headroom": 0,
                                   "decisions": {UP: 1, DOWN: 1}}
    assert [e["seq"] for e in board.events_after(0)] == [1, 2]
    assert [e["to"] for e in board.events_after(1)] == [1]
    replica = {"status": "ok", "kv_stall": "ok", "cap": 2, "active_sessions": 0}
    assert board.report("r1", replica) == board.autoscaling()  # the answer to a report
    assert board.view()["autoscaling"]["events"][0]["direction"] == UP


def test_cluster_metrics_are_unlabelled_beside_the_replicas_labelled_ones():
    cluster = ClusterMetrics()
    registry = ReplicaRegistry({"replica": "r1"}, cluster)
    assert b"autoscale" not in generate_latest(registry)  # fixed count: none
    cluster.autoscaling = {"desired_replicas": 2, "headroom": 1, "decisions": {UP: 1}}
    text = generate_latest(registry).decode()
    assert 'metronome_cluster_autoscale_decisions_total{direction="up"} 1.0' in text
    assert 'metronome_cluster_autoscale_decisions_total{direction="down"} 0.0' in text
    assert "metronome_cluster_autoscale_desired_replicas 2.0" in text
    assert "metronome_cluster_autoscale_headroom_sessions 1.0" in text


# ---- the policy as Ray Serve calls it -----------------------------------------------------
def series(*points: tuple[float, float]) -> list:
    from ray.serve._private.common import TimeStampedValue

    return [TimeStampedValue(t, v) for t, v in points]


def stats(cap: int, active: int, refused: list[tuple[float, float]], started_at_s: float = 0.0,
          at_s: float = 100.0) -> dict:
    from metronome.cluster.autoscaler import STAT_ACTIVE, STAT_CAP, STAT_REFUSED, STAT_STARTED

    return {STAT_CAP: series((at_s, cap)), STAT_ACTIVE: series((at_s, active)),
            STAT_REFUSED: series(*refused), STAT_STARTED: series((at_s, started_at_s))}


def test_refusals_are_counted_after_the_window_start_from_the_replicas_counter():
    from metronome.cluster.autoscaler import replica_load

    refused = [(90.0, 4.0), (95.0, 4.0), (99.0, 6.0)]
    assert replica_load(stats(2, 2, refused), 95.0, 0.0) == ReplicaLoad(2, 2, refused=2)
    assert replica_load(stats(2, 2, refused), 99.0, 0.0).refused == 0
    # started after the window start: every refusal it counted is recent
    assert replica_load(stats(2, 2, [(99.0, 3.0)], started_at_s=98.0), 97.0, 0.0).refused == 3
    # its earlier points pruned: only what is seen
    assert replica_load(stats(2, 2, [(96.0, 3.0), (99.0, 5.0)]), 94.0, 0.0).refused == 2
    assert replica_load({}, 95.0, 0.0) is None  # not reported yet
    assert replica_load(stats(2, 2, refused), 95.0, 100.5) is None  # stale


class FakeBoard:
    def __init__(self) -> None:
        self.posted: list[tuple[dict, dict | None]] = []
        self.autoscaled = self  # board.autoscaled.remote(look, event)

    def remote(self, look: dict, event: dict | None) -> None:
        self.posted.append((look, event))


def context(config, target: int, replicas: dict[str, dict], now_s: float,
            policy_state: dict):
    from ray.serve.config import AutoscalingContext

    raw: dict = {}
    for rid, by_name in replicas.items():
        for name, points in by_name.items():
            raw.setdefault(name, {})[rid] = points
    return AutoscalingContext(
        deployment_id=None, deployment_name="d", app_name="a", current_num_replicas=len(
            replicas), target_num_replicas=target, running_replicas=list(replicas),
        total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics={},
        raw_metrics=raw, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state=policy_state,
        last_scale_up_time=None, last_scale_down_time=None, current_time=now_s, config=config)


def test_through_ray_serves_wrapper_ray_applies_the_rules_count_at_once():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    from metronome.cluster.launch import autoscaling_config

    cluster = ClusterConfig(replicas=1, max_replicas=2, autoscale_down_after_s=10.0)
    config = autoscaling_config(cluster)
    policy = _resolve_policy_callable(config.policy)  # HeadroomAutoscaler(**policy_kwargs)
    policy._board = board = FakeBoard()
    applied = _apply_autoscaling_config(policy)  # Ray's delays, factors: what Ray applies
    full = {"r1": stats(2, 2, [(95.0, 0.0), (99.0, 1.0)])}
    replicas, state = applied(context(config, 1, full, 100.0, {}))
    assert replicas == 2  # at once: no upscale delay
    look, event = board.posted[-1]
    assert (event["direction"], event["from"], event["to"], event["refused"]) == (UP, 1, 2, 1)
    assert look["desired_replicas"] == 2 and look["max_replicas"] == 2
    # the second replica starting: held, whatever the first says (users retry meanwhile)
    still_full = {"r1": stats(2, 2, [(99.0, 1.0), (102.0, 3.0)], at_s=103.0)}
    replicas, state = applied(context(config, 2, still_full, 103.0, state))
    assert replicas == 2
    # it reported: the refusals while it started count no more, nor does the cool-down
    # start before now
    both = {"r1": stats(2, 2, [(102.0, 3.0), (108.9, 3.0)], at_s=108.9),
            "r2": stats(2, 1, [(108.9, 0.0)], started_at_s=103.5, at_s=108.9)}
    assert applied(context(config, 2, both, 107.9, state))[0] == 2  # cooling down
    assert board.posted[-1][0]["reason"] == "cooling down"
    replicas, state = applied(context(config, 2, both, 109.0, state))
    assert replicas == 2 and board.posted[-1][0]["reason"] == "steady"
    def idle(at_s: float) -> dict:  # both replicas empty, reported at `at_s`
        return {"r1": stats(2, 0, [(99.0, 1.0)], at_s=at_s),
                "r2": stats(2, 0, [(at_s, 0.0)], started_at_s=103.0, at_s=at_s)}

    replicas, state = applied(context(config, 2, idle(120.0), 120.0, state))
    assert replicas == 2  # spare from now on: 10 s to go
    assert applied(context(config, 2, idle(129.0), 129.0, state))[0] == 2
    assert applied(context(config, 2, idle(130.0), 130.0, state))[0] == 1
    assert board.posted[-1][1]["direction"] == DOWN
