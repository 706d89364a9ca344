"""The cluster's board: every replica's latest report, behind `GET /v1/cluster`.

One small Ray actor (`BOARD_NAME`, no CPU of its own) holds what each replica reported at
its last stats period (`cluster.replica`); any replica answers `GET /v1/cluster` from it.
A replica whose report is older than `stale_after_s` (killed, its node lost) is listed as
`unreachable` until Ray's replacement has reported and `forget_after_s` has passed.
The verdicts, the stall detector's and the server's, are per replica and, worst first, for
the cluster. With `--replicas MIN..MAX` the autoscaler (`cluster.autoscaler`, in Ray
Serve's controller) posts what it last saw and each decision here too: the view's
`autoscaling`, the replicas' cluster metrics and the launcher's log read it.
"""

from __future__ import annotations

import time
from collections import Counter

BOARD_NAME = "metronome-cluster-board"
NAMESPACE = "metronome"  # the board's Ray namespace
SEVERITY = ("ok", "degraded", "critical", "unreachable")  # best to worst
EVENTS_KEPT = 100  # the autoscaler's latest decisions, oldest dropped first


class ClusterBoard:
    """A plain class: `launch` runs it as a named Ray actor (`ray.remote(ClusterBoard)`)."""

    def __init__(self, stale_after_s: float, forget_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self.forget_after_s = forget_after_s
        self._reports: dict[str, dict] = {}  # replica id -> its latest report
        self._autoscaling: dict | None = None  # the autoscaler's latest look (None: fixed)
        self._decisions: Counter = Counter()  # up / down -> decisions made
        self._events: list[dict] = []  # its decisions, each with its sequence number `seq`

    def report(self, replica_id: str, report: dict) -> dict | None:
        """Take a replica's report; answer the autoscaler's state (its cluster metrics)."""
        self._reports[replica_id] = report | {"reported_at_s": time.time()}
        return self.autoscaling()

    def autoscaled(self, look: dict, event: dict | None) -> None:
        """The autoscaler's latest look (bounds, desired count, headroom, reason) and, when
        it changed the count, that decision (`direction`, `from`, `to`, `reason`, `at_s`)."""
        self._autoscaling = look
        if event is not None:
            self._decisions[event["direction"]] += 1
            seq = self._events[-1]["seq"] + 1 if self._events else 1
            self._events = [*self._events[-(EVENTS_KEPT - 1):], event | {"seq": seq}]

    def autoscaling(self) -> dict | None:
        if self._autoscaling is None:
            return None
        return self._autoscaling | {"decisions": dict(self._decisions)}

    def events_after(self, seq: int) -> list[dict]:
        """The decisions kept whose sequence number is above `seq`, oldest first."""
        return [e for e in self._events if e["seq"] > seq]

    def leave(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)

    def view(self) -> dict:
        now_s = time.time()
        self._reports = {rid: r for rid, r in self._reports.items()
                         if now_s - r["reported_at_s"] <= self.forget_after_s}
        view = cluster_view(self._reports, now_s, self.stale_after_s)
        autoscaling = self.autoscaling()
        if autoscaling is not None:
            view["autoscaling"] = autoscaling | {"events": self._events[-20:]}
        return view


def cluster_view(reports: dict[str, dict], now_s: float, stale_after_s: float) -> dict:
    replicas = []
    for replica_id, report in sorted(reports.items()):
        age_s = now_s - report["reported_at_s"]
        stale = age_s > stale_after_s
        replicas.append(report | {
            "replica": replica_id, "report_age_s": round(age_s, 3),
            "status": "unreachable" if stale else report["status"],
            "kv_stall": "unreachable" if stale else report["kv_stall"]})
    live = [r for r in replicas if r["status"] != "unreachable"]
    return {
        "object": "cluster",
        "status": _worst(r["status"] for r in replicas),
        "kv_stall": _worst(r["kv_stall"] for r in replicas),
        "replicas_live": len(live),
        "cap": sum(r["cap"] for r in live),
        "active_sessions": sum(r["active_sessions"] for r in live),
        "replicas": replicas,
    }


def _worst(states) -> str:
    states = list(states)
    return max(states, key=SEVERITY.index) if states else "unreachable"
