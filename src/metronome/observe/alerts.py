"""Prometheus alert rules for Metronome: owns what pages an operator and why.

The failure Metronome exists for is silent: when unbounded sessions fill the KV pool the
engine stalls, yet every frame still goes out on the beat (empty, `stalled_kv`), so latency
and deadline-miss alerts stay quiet while goodput collapses. The rules therefore watch
output, not latency:

| alert | fires when | severity |
|---|---|---|
| MetronomeSilentCliff | goodput < 0.8 while >= 95 % of frames meet the deadline | critical |
| MetronomeKvStalls | any frame stalled on KV | warning |
| MetronomeHealthCritical | the server's health verdict (`/healthz`) reads critical | critical |
| MetronomeKvSaturationSoon | the pool is forecast full within `saturation_eta_s` | warning |
| MetronomeAdmissionRefusing | admission refuses sessions | warning |
| MetronomeDeadlineMisses | > 1 % of frames miss the deadline (the visible failure) | warning |
| MetronomeEngineNotStepping | frames time out while the engine makes no step | critical |
| MetronomeDown | the scrape fails | critical |
| MetronomeResumesRefused | resumes refused for their token (client bug, or guessing) | warning |
| MetronomeLeasesHoldCapacity | > 25 % of open sessions are leased (clients gone) | warning |
| MetronomeCheckpointsRefused | the session store refuses checkpoints (full, or moved) | warning |

No metric says the engine thread failed: `/healthz` reports it (`status: critical`,
`engine_error`), but `metronome_health_state` is the stall detector's verdict only. A failed
or dead engine thread makes no steps while the beat answers every frame `late` at its
deadline, and that is what MetronomeEngineNotStepping watches.

`Timings` sets the rate window and the `for` durations: the defaults suit a 15 s scrape;
tests use seconds. Rendered as a Prometheus rule file by `rules_yaml`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from metronome.observe import metrics as m
from metronome.observe import promql as q


@dataclass(frozen=True)
class Timings:
    window: str = "2m"  # rate() window: at least 4 scrapes
    for_short: str = "1m"  # how long a condition holds before it fires
    for_long: str = "2m"
    evaluation_interval: str = "30s"  # the rule group's
    saturation_eta_s: float = 300.0  # X: page when the pool is forecast full this soon
    job: str = "metronome"  # the scrape job's name (for MetronomeDown)


DEFAULT_TIMINGS = Timings()


@dataclass(frozen=True)
class AlertRule:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str


def alert_rules(t: Timings = DEFAULT_TIMINGS) -> list[AlertRule]:
    w = t.window
    return [
        AlertRule(
            "MetronomeSilentCliff",
            f"({q.goodput(w)}) < 0.8 and ({q.deadline_met(w)}) >= 0.95", t.for_short,
            "critical", "Frames go out on time but empty: goodput collapsed",
            "Goodput is below 80 % while at least 95 % of frames meet their deadline: the "
            "silent failure (KV pool exhausted, the engine stalls, empty frames on the beat). "
            "Latency and deadline dashboards look healthy. Check the KV pool and stalled_kv "
            "frames; bound sessions (sinks_window) or admit fewer."),
        AlertRule(
            "MetronomeKvStalls", f"{q.frames_rate(w, 'stalled_kv')} > 0", t.for_short,
            "warning", "Frames stall on KV: the block pool is exhausted",
            "Some frames were answered stalled_kv (no KV block for their work). Sessions "
            "stop producing output while their frames still meet the deadline."),
        AlertRule(
            "MetronomeHealthCritical", f"{m.HEALTH_STATE} >= 2", t.for_short,
            "critical", "The server's health verdict reads critical",
            "metronome_health_state = 2, the verdict /healthz reports: most recent frames "
            "stalled on KV (the stall detector). /healthz says why."),
        AlertRule(
            "MetronomeKvSaturationSoon",
            f"{m.KV_POOL_SATURATION_ETA_SECONDS} < {t.saturation_eta_s:g}", t.for_short,
            "warning", f"KV pool forecast full within {t.saturation_eta_s:g} s",
            "The saturation forecast (whole blocks, growing sessions) says the pool runs dry "
            "soon; with unbounded sessions that is the cliff. Bounded sessions at steady "
            "state read +Inf and never fire this."),
        AlertRule(
            "MetronomeAdmissionRefusing", f"{q.refusals_rate(w)} > 0", t.for_short,
            "warning", "Admission refuses sessions",
            "The admission controller is at its cap (or the server at a limit) and refuses "
            "new sessions with 503 + Retry-After. Capacity, not a fault: add capacity if "
            "it persists."),
        AlertRule(
            "MetronomeDeadlineMisses", f"{q.status_share(w, 'late')} > 0.01", t.for_long,
            "warning", "More than 1 % of frames miss their deadline",
            "Frames are late: the engine is compute-bound (more sessions than the deadline "
            "ceiling N*), or it stopped stepping."),
        AlertRule(
            "MetronomeEngineNotStepping",
            f"{q.frames_rate(w, 'late')} > 0 and {q.steps_rate(w)} == 0", t.for_short,
            "critical", "Frames time out and the engine makes no steps",
            "The engine thread failed or died: frames are answered late at their deadlines "
            "and no engine step completes. /healthz has the error (engine_error)."),
        AlertRule(
            "MetronomeDown", f'up{{job="{t.job}"}} == 0', t.for_short, "critical",
            "Metronome's /metrics cannot be scraped",
            "The server process is down or unreachable."),
        AlertRule(
            "MetronomeResumesRefused",
            f'sum without (outcome) (rate({m.SESSION_RESUMES_TOTAL}{{outcome="refused_token"}}'
            f"[{w}])) > 0", t.for_long, "warning",
            "Session resumes are refused for their token",
            "Clients try to resume with a wrong, used or expired token (each resume issues a "
            "new one; a lease lasts --resume-grace-s): a client that does not keep the latest "
            "token, reconnects too late, or someone guessing session ids and tokens."),
        AlertRule(
            "MetronomeLeasesHoldCapacity",
            f"{m.SESSIONS_LEASED} / {m.SESSIONS_ACTIVE} > 0.25", t.for_long, "warning",
            "More than a quarter of the open sessions are leased",
            "Their clients dropped and have not resumed: each still holds its KV and its "
            "admission slot until its lease expires. Many at once: a network problem between "
            "clients and the server, or a grace (--resume-grace-s) too long for this traffic."),
        AlertRule(
            "MetronomeCheckpointsRefused",
            f'sum without (outcome) (rate({m.SESSION_CHECKPOINTS_TOTAL}{{outcome="refused"}}'
            f"[{w}])) > 0", t.for_long, "warning",
            "The session store refuses checkpoints",
            "A cluster's session store (--session-store-bytes) is full, so the sessions whose "
            "checkpoints it refuses cannot resume on another replica if theirs dies or drains "
            "(a replica whose session another one claimed is refused once: a refusal that "
            "lasts is the store's bound)."),
    ]


def rules_yaml(t: Timings = DEFAULT_TIMINGS) -> str:
    """A Prometheus rule file (YAML; every string JSON-quoted, which YAML reads as is)."""
    lines = ["# Generated by `metronome monitoring` from metronome.observe.alerts: edit that.",
             "groups:", "  - name: metronome", f"    interval: {t.evaluation_interval}",
             "    rules:"]
    for rule in alert_rules(t):
        lines += [f"      - alert: {rule.name}", f"        expr: {json.dumps(rule.expr)}",
                  f"        for: {rule.for_}", "        labels:",
                  f"          severity: {rule.severity}", "        annotations:",
                  f"          summary: {json.dumps(rule.summary)}",
                  f"          description: {json.dumps(rule.description)}"]
    return "\n".join(lines) + "\n"
