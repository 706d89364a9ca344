"""The cluster's board: every replica's latest report, behind `GET /v1/cluster`.

One small Ray actor (`BOARD_NAME`, no CPU of its own) holds what each replica reported at
its last stats period (`cluster.replica`); any replica answers `GET /v1/cluster` from it.
A replica whose report is older than `stale_after_s` (killed, its node lost) is listed as
`unreachable` until Ray's replacement has reported and `forget_after_s` has passed.
The verdicts, the stall detector's and the server's, are per replica and, worst first, for
the cluster.
"""

from __future__ import annotations

import time

BOARD_NAME = "metronome-cluster-board"
SEVERITY = ("ok", "degraded", "critical", "unreachable")  # best to worst


class ClusterBoard:
    """A plain class: `launch` runs it as a named Ray actor (`ray.remote(ClusterBoard)`)."""

    def __init__(self, stale_after_s: float, forget_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self.forget_after_s = forget_after_s
        self._reports: dict[str, dict] = {}  # replica id -> its latest report

    def report(self, replica_id: str, report: dict) -> None:
        self._reports[replica_id] = report | {"reported_at_s": time.time()}

    def leave(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)

    def view(self) -> dict:
        now_s = time.time()
        self._reports = {rid: r for rid, r in self._reports.items()
                         if now_s - r["reported_at_s"] <= self.forget_after_s}
        return cluster_view(self._reports, now_s, self.stale_after_s)


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
