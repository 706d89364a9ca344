"""Ray Serve's autoscaling policy for the replicas: `autoscale.decide` on their own
admission stats, through Ray Serve's custom-policy API (`AutoscalingConfig.policy`).

Each replica records its stats for the autoscaler (`record_autoscaling_stats` in
`cluster.replica`: `STATS`) every `autoscale_metrics_period_s`; Ray Serve pushes them to its
controller, which calls this policy each control-loop tick (0.1 s) with every running
replica's time series of the last `look_back_period_s` (`AutoscalingContext.raw_metrics`).
Ray's own delays and scaling factors are off (`launch.autoscaling_config`), so the count
returned is the count Ray applies; the rule's cool-down and sustained-spare period are
kept in the policy's state (`ctx.policy_state`), which Ray keeps between ticks.

Every decision is logged (Ray Serve's logger: the controller's log) and posted to the board
(`cluster.board`), with the latest look at the fleet at most once a metrics period: the
board feeds `GET /v1/cluster`'s `autoscaling`, the replicas' cluster metrics and the
launcher's output.
"""

from __future__ import annotations

import logging

import ray

from metronome.cluster.autoscale import HOLD, Decision, Memory, ReplicaLoad, Rules, decide
from metronome.cluster.board import BOARD_NAME, NAMESPACE

POLICY_PATH = "metronome.cluster.autoscaler.HeadroomAutoscaler"  # AutoscalingPolicy's
STAT_CAP, STAT_ACTIVE = "metronome_cap", "metronome_active_sessions"
STAT_REFUSED = "metronome_refused_sessions"  # since the replica started (a counter)
STAT_STARTED = "metronome_started_at_s"  # time.time() when its server started
STATS = (STAT_CAP, STAT_ACTIVE, STAT_REFUSED, STAT_STARTED)
STALE_PERIODS = 4  # a replica whose latest stats are older than this many periods: unknown
CHANGED_AT_KEY, SPARE_SINCE_KEY = "metronome_changed_at_s", "metronome_spare_since_s"

log = logging.getLogger("ray.serve")


def replica_load(series: dict, since_s: float, stale_before_s: float) -> ReplicaLoad | None:
    """One replica's load from its stats' time series (name -> [TimeStampedValue], oldest
    first): the latest cap and sessions, and the sessions it refused after `since_s`. None
    if it has not reported or its latest report is older than `stale_before_s`."""
    if any(not series.get(name) for name in STATS):
        return None
    latest = {name: series[name][-1] for name in STATS}
    if latest[STAT_CAP].timestamp < stale_before_s:
        return None
    refused = series[STAT_REFUSED]
    before = [p.value for p in refused if p.timestamp <= since_s]
    if before:
        baseline = before[-1]
    elif latest[STAT_STARTED].value > since_s:
        baseline = 0.0  # started since: all its refusals are
    else:
        baseline = refused[0].value  # older points were pruned: count what is seen
    return ReplicaLoad(cap=int(latest[STAT_CAP].value), active=int(latest[STAT_ACTIVE].value),
                       refused=int(latest[STAT_REFUSED].value - baseline))


class HeadroomAutoscaler:
    """Ray Serve instantiates it once in its controller, with `policy_kwargs`."""

    def __init__(self, headroom_sessions: int, refusal_window_s: float, cooldown_s: float,
                 down_after_s: float, metrics_period_s: float) -> None:
        self.headroom_sessions = headroom_sessions
        self.refusal_window_s = refusal_window_s
        self.cooldown_s = cooldown_s
        self.down_after_s = down_after_s
        self.metrics_period_s = metrics_period_s
        self._board = None
        self._posted_at_s = 0.0

    def __call__(self, ctx) -> tuple[int, dict]:
        now_s = ctx.current_time
        memory = Memory(ctx.policy_state.get(CHANGED_AT_KEY),
                        ctx.policy_state.get(SPARE_SINCE_KEY))
        rules = Rules(ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas,
                      self.headroom_sessions, self.cooldown_s, self.down_after_s)
        since_s = max(now_s - self.refusal_window_s, memory.changed_at_s or 0.0)
        raw = ctx.raw_metrics or {}
        loads = [replica_load({name: raw.get(name, {}).get(rid) for name in STATS}, since_s,
                              now_s - STALE_PERIODS * self.metrics_period_s)
                 for rid in ctx.running_replicas]
        decision, memory = decide(ctx.target_num_replicas, loads, rules, memory, now_s)
        self._post(ctx, rules, decision, now_s)
        return decision.replicas, {CHANGED_AT_KEY: memory.changed_at_s,
                                   SPARE_SINCE_KEY: memory.spare_since_s}

    def _post(self, ctx, rules: Rules, decision: Decision, now_s: float) -> None:
        event = None
        if decision.direction != HOLD:
            event = {"at_s": now_s, "direction": decision.direction,
                     "from": ctx.target_num_replicas, "to": decision.replicas,
                     "reason": decision.reason, "headroom": decision.headroom,
                     "refused": decision.refused}
            log.info("metronome autoscaler: %s %d -> %d replicas (%s)", decision.direction,
                     ctx.target_num_replicas, decision.replicas, decision.reason)
        elif now_s - self._posted_at_s < self.metrics_period_s:
            return
        self._posted_at_s = now_s
        look = {"min_replicas": rules.min_replicas, "max_replicas": rules.max_replicas,
                "running_replicas": len(ctx.running_replicas),
                "desired_replicas": decision.replicas, "headroom": decision.headroom,
                "refused_recent": decision.refused, "reason": decision.reason, "at_s": now_s}
        try:
            if self._board is None:
                self._board = ray.get_actor(BOARD_NAME, namespace=NAMESPACE)
            self._board.autoscaled.remote(look, event)
        except Exception:  # the board restarting: the decision stands, the log has it
            self._board = None
            log.warning("metronome autoscaler: could not post to the board", exc_info=True)
