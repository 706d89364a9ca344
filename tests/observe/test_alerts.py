"""Alert rules and the dashboard: generated from the metric-name constants, shipped as
generated, valid for promtool, and firing (or not) on synthetic and recorded series."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metronome.observe import metrics as m
from metronome.observe.alerts import Timings, alert_rules
from metronome.observe.dashboard import dashboard, queries
from metronome.observe.monitoring import monitoring_files
from metronome.observe.promql import exported_series, metric_names, unknown_series
from tests import prom

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).with_name("fixtures") / "cliff_recorded.json"
RULES = {rule.name: rule for rule in alert_rules()}
LABELS = {"job": "metronome", "instance": "127.0.0.1:8000"}
# The metrics an operator needs in view (each panel's reason: observe.dashboard)
ON_THE_DASHBOARD = (
    m.FRAME_LATENCY_SECONDS, m.FRAMES_TOTAL, m.FRAME_TOKENS, m.GOODPUT_RATIO,
    m.GOOD_FRAMES_TOTAL, m.LATE_TOKENS_TOTAL, m.KV_POOL_BLOCKS, m.KV_POOL_SATURATION_ETA_SECONDS,
    m.SESSIONS_ACTIVE, m.SESSIONS_TOTAL, m.ADMISSION_CAP, m.ADMISSION_MEMORY_CEILING,
    m.ADMISSION_SIGNAL,
    m.ADMISSION_DECISIONS_TOTAL, m.ENGINE_STEP_SECONDS, m.STEP_BATCH_FRAMES, m.HEALTH_STATE,
    m.SESSION_RESUMES_TOTAL, m.SESSION_LEASES_ENDED_TOTAL, m.SESSIONS_LEASED,
    m.SESSION_RESUME_SECONDS, m.SESSION_AWAY_SECONDS)


def test_shipped_files_are_the_generated_ones():
    for relative, text in monitoring_files().items():
        shipped = ROOT / "deploy" / relative
        assert shipped.read_text() == text, f"{shipped} is stale: run `metronome monitoring`"


def test_every_query_names_a_metric_that_exists():
    exprs = [rule.expr for rule in alert_rules()] + queries()
    for expr in exprs:
        assert metric_names(expr), expr
        assert not unknown_series(expr), (expr, unknown_series(expr))
    named = set().union(*(metric_names(e) for e in queries()))
    for metric in ON_THE_DASHBOARD:
        assert any(n == metric or n.startswith(metric + "_") for n in named), metric


def test_name_check_catches_a_typo():
    assert unknown_series("rate(metronome_frame_total[1m])") == {"metronome_frame_total"}
    assert metric_names('sum by (le) (rate(metronome_frame_latency_seconds_bucket'
                        '{status="ok"}[$__rate_interval]))') == {
        "metronome_frame_latency_seconds_bucket"}
    assert "metronome_frame_latency_seconds_bucket" in exported_series()
    assert "metronome_frames_total" in exported_series()


def test_dashboard_is_a_grafana_model():
    board = dashboard()
    assert board["schemaVersion"] >= 36 and board["panels"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["targets"] and panel["gridPos"]["w"] <= 24
        assert all(t["expr"] and t["refId"] for t in panel["targets"])
    json.dumps(board)


def test_promtool_checks_the_shipped_rules():
    result = prom.promtool("check", "rules", str(ROOT / "deploy/prometheus/metronome_rules.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(RULES)} rules found" in result.stdout
    config = prom.promtool("check", "config", str(ROOT / "deploy/prometheus/prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr


def _series(name: str, values: str, **labels: str) -> tuple[str, str]:
    all_labels = {**LABELS, **labels}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in all_labels.items()) + "}", values


def _frames(ok: str, stalled: str, late: str) -> dict[str, str]:
    return dict([_series(m.FRAMES_TOTAL, ok, status="ok"),
                 _series(m.FRAMES_TOTAL, stalled, status="stalled_kv"),
                 _series(m.FRAMES_TOTAL, late, status="late")])


def _run_unit_test(tmp_path, timings: Timings, interval: str, series: dict[str, str],
                   checks: list[dict]) -> None:
    rules = prom.write_rules(tmp_path, timings)
    test = prom.unit_test_file(tmp_path, rules, interval, timings.evaluation_interval, series,
                               checks)
    result = prom.promtool("test", "rules", test.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _expect(at: str, name: str, firing: bool = True) -> dict:
    alerts = [prom.alert_expectation(RULES[name], alertname=name, **LABELS)] if firing else []
    for alert in alerts:
        alert["exp_labels"].pop("alertname")
    return {"eval_time": at, "alertname": name, "exp_alerts": alerts}


def test_silent_cliff_fires_when_frames_go_out_on_time_but_empty(tmp_path):
    # 15 s scrapes, one frame a second: 10 min healthy, then every frame stalls on KV,
    # answered on the beat (nothing late); the stall detector turns critical
    series = _frames(ok="0+15x40 600+0x40", stalled="0x40 0+15x40", late="0x80")
    series.update([_series(m.GOOD_FRAMES_TOTAL, "0+15x40 600+0x40"),
                   _series(m.HEALTH_STATE, "0x40 2x40"),
                   _series(m.ENGINE_STEP_SECONDS + "_count", "0+60x80")])
    checks = [_expect("9m", "MetronomeSilentCliff", firing=False),
              _expect("9m", "MetronomeKvStalls", firing=False),
              _expect("15m", "MetronomeSilentCliff"), _expect("15m", "MetronomeKvStalls"),
              _expect("15m", "MetronomeHealthCritical"),
              _expect("15m", "MetronomeDeadlineMisses", firing=False),
              _expect("15m", "MetronomeEngineNotStepping", firing=False)]
    _run_unit_test(tmp_path, Timings(), "15s", series, checks)


def test_visible_overload_is_not_the_silent_cliff(tmp_path):
    # frames go late (the compute-bound failure): goodput falls, deadline met falls with it
    series = _frames(ok="0+15x40 600+3x40", stalled="0x80", late="0x40 0+12x40")
    series.update([_series(m.GOOD_FRAMES_TOTAL, "0+15x40 600+3x40"),
                   _series(m.ENGINE_STEP_SECONDS + "_count", "0+30x80")])
    checks = [_expect("15m", "MetronomeSilentCliff", firing=False),
              _expect("15m", "MetronomeDeadlineMisses"),
              _expect("15m", "MetronomeEngineNotStepping", firing=False)]
    _run_unit_test(tmp_path, Timings(), "15s", series, checks)


def test_dead_engine_saturation_refusals_and_down(tmp_path):
    # the engine stops stepping at 5 min; the beat answers every frame late from then on
    series = _frames(ok="0+15x20 300+0x20", stalled="0x40", late="0x20 0+15x20")
    series.update([
        _series(m.GOOD_FRAMES_TOTAL, "0+15x20 300+0x20"),
        _series(m.ENGINE_STEP_SECONDS + "_count", "0+60x20 1200+0x20"),
        _series(m.KV_POOL_SATURATION_ETA_SECONDS, "+Inf+0x20 600-40x20"),
        _series(m.ADMISSION_DECISIONS_TOTAL, "0+1x40", decision="admitted"),
        _series(m.ADMISSION_DECISIONS_TOTAL, "0x20 0+2x20", decision="refused_at_capacity"),
        _series("up", "1x20 0x20"),
    ])
    checks = [_expect("4m", "MetronomeEngineNotStepping", firing=False),
              _expect("9m", "MetronomeEngineNotStepping"),
              _expect("9m", "MetronomeSilentCliff", firing=False),  # late: not silent
              _expect("4m", "MetronomeKvSaturationSoon", firing=False),
              _expect("9m", "MetronomeKvSaturationSoon"),  # 40 s less a scrape: < 300 at 7 min
              _expect("4m", "MetronomeAdmissionRefusing", firing=False),
              _expect("9m", "MetronomeAdmissionRefusing"),
              _expect("9m", "MetronomeDown")]
    _run_unit_test(tmp_path, Timings(), "15s", series, checks)


def test_silent_cliff_fires_on_series_recorded_from_a_live_cliff(tmp_path):
    """Series Prometheus scraped from `metronome serve` while unbounded sessions filled a
    1024-token pool (recorded by tests/observe/test_alerts_live.py; see docs/results/alerts.md)."""
    recorded = json.loads(RECORDED.read_text())
    checks = [_expect(f"{recorded['healthy_at_s']}s", "MetronomeSilentCliff", firing=False),
              {"eval_time": f"{recorded['cliff_at_s']}s", "alertname": "MetronomeSilentCliff",
               "exp_alerts": [prom.alert_expectation(RULES["MetronomeSilentCliff"],
                                                     **recorded["labels"])]}]
    _run_unit_test(tmp_path, prom.FAST, "1s", recorded["series"], checks)


@pytest.mark.parametrize("timings", [Timings(), prom.FAST])
def test_promtool_accepts_rules_at_any_timing(tmp_path, timings):
    result = prom.promtool("check", "rules", str(prom.write_rules(tmp_path, timings)))
    assert result.returncode == 0, result.stdout + result.stderr
