"""The Grafana dashboard for Metronome, generated from code so that every query is built from
the metric-name constants of `observe.metrics` (via `observe.promql`).

The top row is the silent failure: goodput beside the deadline-met share (they part when the
KV pool runs dry), frames by status, the stall detector's verdict and the saturation ETA.
Then latency, the KV pool, sessions and admission, and the engine.

Queries use Grafana's `$__rate_interval` and a `datasource` variable (any Prometheus).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from metronome.observe import metrics as m
from metronome.observe import promql as q

W = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
UID = "metronome-operators"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat
    description: str = ""
    width: int = 12


def panels() -> list[Panel]:
    latency = m.FRAME_LATENCY_SECONDS
    return [
        Panel("Goodput vs deadline met (the silent cliff)", (
            Query(q.goodput(W), "goodput {{instance}}"),
            Query(q.deadline_met(W), "deadline met {{instance}}"),
            Query(m.GOODPUT_RATIO, "goodput, last 1000 frames {{instance}}"),
        ), unit="percentunit", description="When the KV pool runs dry, deadline met stays at "
              "100 % while goodput falls: frames go out on time but empty."),
        Panel("Frames by status", (
            Query(f"sum by (job, instance, status) (rate({m.FRAMES_TOTAL}[{W}]))",
                  "{{status}} {{instance}}"),), unit="reqps"),
        Panel("Stall detector (0 ok, 1 degraded, 2 critical)", (
            Query(m.HEALTH_STATE, "{{instance}}"),), kind="stat", width=6),
        Panel("KV pool full in (forecast)", (
            Query(m.KV_POOL_SATURATION_ETA_SECONDS, "{{instance}}"),), unit="s", kind="stat",
              description="+Inf: never (bounded sessions at steady state).", width=6),
        Panel("KV pool blocks", (
            Query(m.KV_POOL_BLOCKS, "{{state}} {{instance}}"),), width=12),
        Panel("Frame latency", tuple(
            Query(q.quantile(p, latency, W), f"p{round(p * 100)} {{{{instance}}}}")
            for p in (0.5, 0.95, 0.99)), unit="s"),
        Panel("Admission signal: latency / deadline", (
            Query(m.ADMISSION_SIGNAL, "p{{quantile}} {{instance}}"),), unit="percentunit"),
        Panel("Sessions, admission cap and memory ceiling", (
            Query(m.SESSIONS_ACTIVE, "active {{instance}}"),
            Query(m.ADMISSION_CAP, "cap {{instance}}"),
            Query(m.ADMISSION_MEMORY_CEILING, "memory ceiling {{instance}}"),),
              description="Admission never passes the memory ceiling (+Inf: unbounded KV, "
              "no ceiling: the cap alone cannot see the pool fill)."),
        Panel("Admission decisions", (
            Query(f"sum by (job, instance, decision) (rate({m.ADMISSION_DECISIONS_TOTAL}[{W}]))",
                  "{{decision}} {{instance}}"),), unit="reqps"),
        Panel("Sessions closed by outcome", (
            Query(f"sum by (job, instance, outcome) (rate({m.SESSIONS_TOTAL}[{W}]))",
                  "{{outcome}} {{instance}}"),), unit="reqps"),
        Panel("Engine steps", (
            Query(q.steps_rate(W), "steps/s {{instance}}"),
            Query(q.quantile(0.95, m.ENGINE_STEP_SECONDS, W), "p95 step s {{instance}}"),)),
        Panel("Frames per step (batch)", (
            Query(q.quantile(0.5, m.STEP_BATCH_FRAMES, W), "p50 {{instance}}"),
            Query(q.quantile(0.95, m.STEP_BATCH_FRAMES, W), "p95 {{instance}}"),)),
        Panel("Tokens per frame and late tokens", (
            Query(f"rate({m.FRAME_TOKENS}_sum[{W}]) / rate({m.FRAME_TOKENS}_count[{W}])",
                  "tokens per frame {{instance}}"),
            Query(f"rate({m.LATE_TOKENS_TOTAL}[{W}])", "late tokens/s {{instance}}"),)),
        Panel("Resumes and leases (clients that dropped)", (
            Query(f"sum by (job, instance, outcome) (rate({m.SESSION_RESUMES_TOTAL}[{W}]))",
                  "resume {{outcome}} {{instance}}"),
            Query(f"sum by (job, instance, outcome) (rate({m.SESSION_LEASES_ENDED_TOTAL}"
                  f"[{W}]))", "lease {{outcome}} {{instance}}"),
            Query(m.SESSIONS_LEASED, "leased now {{instance}}"),),
              description="A leased session's client dropped; it holds its KV and its "
              "admission slot for the resume grace. Expired leases: clients that never came "
              "back."),
        Panel("Resume latency and time away", (
            Query(q.quantile(0.95, m.SESSION_RESUME_SECONDS, W), "p95 resume {{instance}}"),
            Query(q.quantile(0.5, m.SESSION_AWAY_SECONDS, W), "p50 away {{instance}}"),
            Query(q.quantile(0.95, m.SESSION_AWAY_SECONDS, W), "p95 away {{instance}}"),
            Query(q.quantile(0.95, m.SESSION_CHECKPOINT_SECONDS, W),
                  "p95 checkpoint (engine thread) {{instance}}"),),
              unit="s"),
        Panel("Checkpoints and migrations (resumable on another replica)", (
            Query(f"sum by (job, instance, outcome) (rate({m.SESSION_CHECKPOINTS_TOTAL}[{W}]))",
                  "checkpoint {{outcome}} {{instance}}"),
            Query(f"rate({m.SESSION_MIGRATIONS_TOTAL}[{W}])", "migrated {{instance}}"),),
              description="A cluster's bounded sessions are checkpointed to the session store "
              "so another replica can resume them; refused: the store is full (or the session "
              "moved); migrated: a draining replica told the client to resume elsewhere."),
    ]


def queries() -> list[str]:
    """Every expression the dashboard runs."""
    return [query.expr for panel in panels() for query in panel.queries]


def dashboard() -> dict:
    """The dashboard as Grafana's JSON model (import it, or provision it from a file)."""
    grafana_panels, x, y = [], 0, 0
    for number, panel in enumerate(panels(), start=1):
        if x + panel.width > 24:
            x, y = 0, y + 8
        grafana_panels.append(_panel(number, panel, x, y))
        x += panel.width
    return {
        "uid": UID, "title": "Metronome: operators' view", "tags": ["metronome"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"}, "timezone": "browser",
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "annotations": {"list": []},
        "panels": grafana_panels,
    }


def _panel(number: int, panel: Panel, x: int, y: int) -> dict:
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": query.expr,
                "legendFormat": query.legend, "range": True}
               for i, query in enumerate(panel.queries)]
    return {"id": number, "type": panel.kind, "title": panel.title,
            "description": panel.description, "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y}, "targets": targets,
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {}}


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"
