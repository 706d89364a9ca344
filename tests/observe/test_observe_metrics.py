"""Prometheus metrics: exact values through an injected registry, and the exposition parses."""

from __future__ import annotations

import enum
import math

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from metronome.observe.metrics import Metrics
from metronome.observe.stall_detector import Health


class Status(enum.StrEnum):
    STALLED_KV = "stalled_kv"


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_every_metric_is_exposed_and_parses():
    metrics = Metrics(CollectorRegistry())
    text = metrics.render().decode()
    families = {
        family.name for family in text_string_to_metric_families(text)
        if not family.name.endswith("_created")  # prometheus_client's timestamps
    }
    assert families == {
        "metronome_frame_latency_seconds", "metronome_frames", "metronome_frame_tokens",
        "metronome_goodput_ratio", "metronome_good_frames", "metronome_late_tokens",
        "metronome_kv_pool_blocks", "metronome_kv_pool_saturation_eta_seconds",
        "metronome_sessions_active", "metronome_sessions", "metronome_admission_cap",
        "metronome_admission_memory_ceiling", "metronome_kv_pressure_bounded_sessions",
        "metronome_engine_step_seconds", "metronome_step_batch_frames",
        "metronome_health_state", "metronome_admission_latency_fraction",
        "metronome_admission_decisions", "metronome_session_resumes",
        "metronome_session_leases_ended", "metronome_sessions_leased",
        "metronome_session_resume_seconds", "metronome_session_away_seconds",
        "metronome_session_checkpoints", "metronome_session_checkpoint_bytes",
        "metronome_session_checkpoint_seconds", "metronome_session_migrations",
        "metronome_session_leases_refused", "metronome_voice_stage_seconds",
        "metronome_replies", "metronome_reply_gaps", "metronome_reply_gap_seconds",
        "metronome_input_behind", "metronome_input_behind_chunks",
    }  # counters are families without `_total`; their samples carry it
    assert value(metrics, "metronome_frames_total", status="context_full") == 0.0
    for outcome in ("stored", "generating", "refused", "unbounded"):  # declared at 0
        assert value(metrics, "metronome_session_checkpoints_total", outcome=outcome) == 0.0
    assert value(metrics, "metronome_kv_pool_saturation_eta_seconds") == math.inf
    assert math.isnan(value(metrics, "metronome_goodput_ratio"))
    assert value(metrics, "metronome_admission_memory_ceiling") == math.inf
    metrics.set_memory_ceiling(3)
    assert value(metrics, "metronome_admission_memory_ceiling") == 3


def test_frame_counters_histograms_and_goodput_are_exact():
    metrics = Metrics(CollectorRegistry(), goodput_window_frames=3)
    metrics.observe_frame("ok", 0.004, 3, good=True)
    metrics.observe_frame(Status.STALLED_KV, 0.003, 0, good=False)  # on time, empty
    metrics.observe_frame("late", 0.25, 5, good=False)
    metrics.observe_late_tokens(5)  # produced after the late frame went out
    metrics.observe_frame("ok", 0.002, 0, good=True)  # nothing asked, nothing owed
    got = samples(metrics)
    frames = {s: got[("metronome_frames_total", (("status", s),))]
              for s in ("ok", "late", "stalled_kv", "rejected", "cancelled", "context_full")}
    assert frames == {"ok": 2, "late": 1, "stalled_kv": 1, "rejected": 0, "cancelled": 0,
                      "context_full": 0}
    assert got[("metronome_good_frames_total", ())] == 2
    assert got[("metronome_late_tokens_total", ())] == 5
    assert got[("metronome_goodput_ratio", ())] == 1 / 3  # last 3 frames: bad, bad, good
    latency = "metronome_frame_latency_seconds"
    assert got[(latency + "_count", ())] == 4
    assert math.isclose(got[(latency + "_sum", ())], 0.259)
    buckets = {le: got[(latency + "_bucket", (("le", le),))] for le in ("0.002", "0.005", "0.2",
                                                                         "0.5", "+Inf")}
    assert buckets == {"0.002": 1, "0.005": 3, "0.2": 3, "0.5": 4, "+Inf": 4}
    tokens = "metronome_frame_tokens"
    assert got[(tokens + "_sum", ())] == 8
    assert [got[(tokens + "_bucket", (("le", le),))] for le in ("0.0", "4.0", "8.0")] == [2, 3, 4]


def test_step_pool_session_and_health_gauges_are_exact():
    metrics = Metrics(CollectorRegistry())
    metrics.observe_step(0.01, 3)
    metrics.observe_step(0.03, 5)
    metrics.set_pool(used_blocks=30, free_blocks=70, pinned_blocks=4)
    metrics.set_saturation_eta(12.5)
    metrics.set_sessions_active(3)
    for outcome in ("completed", "completed", "error"):
        metrics.session_closed(outcome)
    metrics.set_admission_cap(7)
    metrics.set_health(Health.DEGRADED)
    got = samples(metrics)
    assert got[("metronome_engine_step_seconds_count", ())] == 2
    assert math.isclose(got[("metronome_engine_step_seconds_sum", ())], 0.04)
    assert got[("metronome_step_batch_frames_bucket", (("le", "4.0"),))] == 1
    assert got[("metronome_step_batch_frames_sum", ())] == 8
    assert [got[("metronome_kv_pool_blocks", (("state", s),))]
            for s in ("used", "free", "pinned")] == [30, 70, 4]
    assert got[("metronome_kv_pool_saturation_eta_seconds", ())] == 12.5
    assert got[("metronome_sessions_active", ())] == 3
    assert got[("metronome_sessions_total", (("outcome", "completed"),))] == 2
    assert got[("metronome_sessions_total", (("outcome", "error"),))] == 1
    assert got[("metronome_admission_cap", ())] == 7
    assert got[("metronome_health_state", ())] == 1


def test_default_is_a_private_registry_never_the_global_one():
    first, second = Metrics(), Metrics()  # a shared registry would refuse the second
    first.set_sessions_active(5)
    assert value(first, "metronome_sessions_active") == 5
    assert value(second, "metronome_sessions_active") == 0
    assert REGISTRY.get_sample_value("metronome_sessions_active") is None


def test_the_door_is_exported_at_scrape_time():
    from metronome.serve.edge.guard import Door, TransportLimits
    from metronome.serve.edge.peers import PeerLimits

    door = Door(TransportLimits(request_timeout_s=1.0, max_header_bytes=2048,
                                max_connections=8, pings_per_s=10, ping_burst=8,
                                peers=PeerLimits(max_open=8, per_s=10.0, burst=10)))
    metrics = Metrics(CollectorRegistry())
    metrics.watch_door(door)
    assert value(metrics, "metronome_door_connections", listener="client") == 0
    assert value(metrics, "metronome_door_refusals_total", reason="evicted_half_open") == 0
    door.seat(health=False)
    door.seat(health=True)
    door.refusals["resume_rate"] += 3
    assert value(metrics, "metronome_door_connections", listener="client") == 1
    assert value(metrics, "metronome_door_connections", listener="health") == 1
    assert value(metrics, "metronome_door_refusals_total", reason="resume_rate") == 3
    assert value(metrics, "metronome_door_half_open_connections") == 0

