"""`metronome bench cluster` without Ray: the capacity ladder's rule and the report, from
canned load summaries (the command itself takes minutes: Ray starts twice)."""

from __future__ import annotations

from dataclasses import asdict

from metronome.bench.cluster_bench import plot, report
from metronome.bench.served.cluster import capacity, capacity_step
from metronome.results.context import RunContext


def load_summary(completed: int, refused: int, goodput: float) -> dict:
    return {"sessions": {"completed": completed, "refused": refused}, "frames": 10 * completed,
            "goodput_server": goodput, "latency_ms": {"client": {"p95": 100.0}}}


def test_the_ladder_stops_at_the_first_step_over_one_percent_or_refused():
    by_offered = {8: load_summary(8, 0, 1.0), 12: load_summary(12, 0, 0.995),
                  16: load_summary(14, 2, 1.0), 20: load_summary(20, 0, 1.0)}
    result = capacity((8, 12, 16, 20), 2, lambda n: capacity_step(by_offered[n], n, 0.01))
    # 16 offered: AIMD refused 2, the 14 admitted held; the ladder stops there
    assert [s["offered"] for s in result["steps"]] == [8, 12, 16]
    assert result["held_sessions"] == 14


def test_past_the_first_step_that_misses_it_bisects_back():
    result = capacity((4, 8, 12, 16), 2, lambda n: capacity_step(load_summary(
        n, 0, 1.0 if n <= 9 else 0.98), n, 0.01))  # holds up to 9 sessions
    assert [(s["offered"], s["holds"]) for s in result["steps"]] == [
        (4, True), (8, True), (12, False), (10, False), (9, True)]
    assert result["held_sessions"] == 9


def canned_result() -> dict:
    runs = {"plain": [{"p50_ms": 25.0, "p95_ms": 30.0}],
            "ray_serve": [{"p50_ms": 29.5, "p95_ms": 38.0}]}
    summary = {name: {f"{q}_{a}": rs[0][f"{q}_ms"] for q in ("p50", "p95")
                      for a in ("min", "median")} for name, rs in runs.items()}
    summary["added"] = {k: summary["ray_serve"][k] - summary["plain"][k]
                        for k in summary["plain"]}
    step = {"offered": 20, "admitted": 20, "refused": 0, "failed": 0, "frames": 400,
            "miss_share": 0.0, "client_p95_ms": 120.0, "holds": True}
    return {
        "command": "metronome bench cluster", "elapsed_s": 600.0, "scale": "full",
        "plots": ["cluster.png"],
        "provenance": {"commit": "abc", "ray": "2.60.0", "machine": {
            "cpu_model": "cpu", "logical_cpus": 2, "memory_gib": 24.0, "torch": "2",
            "torch_threads": 2}},
        "config": {"repeats": 1, "output_tokens_per_frame": 32, "miss_limit_share": 0.01,
                   "ladder": [20], "bisect_steps": 2, "step_duration_s": 20.0, "ramp_s": 4.0,
                   "goal_ratio": 1.8},
        "server_commands": {"plain": "metronome serve", "1": "metronome serve --replicas 1"},
        "workload": {"admission_cap_start": 57, "frame_period_s": 1.0,
                     "admission_interval_s": 2.0, "torch_threads_per_server": 1,
                     "torch_threads_per_replica": 1, "load_chunk_ms": 100.0,
                     "load_sample_rate_hz": 24000},
        "proxy_hop": {"runs": runs, "summary": summary, "sessions": 4, "duration_s": 15.0,
                      "ramp_s": 1.0, "repeats": 1},
        "capacity": [{"replicas": 1, "steps": [step], "held_sessions": 20},
                     {"replicas": 2, "steps": [step | {"offered": 38, "admitted": 38}],
                      "held_sessions": 38}],
        "capacity_ratio": 1.9,
        "footprint": {"start_s": 19.0, "processes": 13, "rss_mib": 2000.0,
                      "rss_mib_by_process": {"ServeReplica": 750.0, "launcher": 330.0},
                      "idle_window_s": 5.0, "idle_cpu_share_of_machine": 0.125, "exit_s": 4.4},
    }


def test_report_puts_the_hop_the_capacity_and_the_footprint_side_by_side(tmp_path):
    result = canned_result()
    text = report(result)
    assert "| p50, median of runs | 25.0 | 29.5 | +4.5 |" in text
    assert "| p95, min of runs | 30.0 | 38.0 | +8.0 |" in text
    assert "Held: 20 sessions with 1 replica, 38 with 2: 1.90x (goal >= 1.8x)." in text
    assert "| 2 | 38 | 38 | 0 | 400 | 0.0% | 120 | yes |" in text
    assert "2,000 MiB: ServeReplica 750, launcher 330" in text
    assert "## Close reason on replica death" in text and "Smoke size" not in text
    assert text.splitlines()[2].startswith("Machine: cpu, 2 logical CPUs")
    plot(RunContext("cluster", out_json=tmp_path / "cluster.json"), result["proxy_hop"],
          result["capacity"])
    assert (tmp_path / "cluster.png").stat().st_size > 10_000


def test_report_numbers_come_from_the_result():
    """Workload constants are read from the result, not baked into the prose."""
    result = canned_result()
    result["config"] |= {"miss_limit_share": 0.05, "output_tokens_per_frame": 7,
                         "goal_ratio": 1.5}
    result["workload"] |= {"admission_interval_s": 3.0, "frame_period_s": 0.5}
    result["footprint"]["idle_window_s"] = 9.0
    result["provenance"]["ray"] = "2.61.0"
    text = report(result)
    assert "<= 5% deadline misses" in text and "7 output tokens a frame" in text
    assert "control interval (3 s)" in text and "0.5 s frames" in text
    assert "(goal >= 1.5x)" in text and "CPU while idle (9 s)" in text
    assert "this run used Ray 2.61.0: a different version" in text


# ---- the autoscaling run ---------------------------------------------------------------------
def test_the_schedule_starts_sessions_on_a_step_up_and_ends_the_newest_on_a_step_down():
    from metronome.bench.served.autoscale import schedule

    assert schedule((1, 3, 2, 0), 10.0) == [(0.0, 30.0), (10.0, 20.0), (10.0, 30.0)]
    assert schedule((2,), 5.0) == [(0.0, 5.0), (0.0, 5.0)]


def canned_autoscaling_raw() -> dict:
    sample = {"replicas_serving": 1, "replicas_draining": 0, "desired_replicas": 1,
              "headroom": 1, "cap": 2, "active_sessions": 1}
    return {
        "sessions": [
            {"session": 0, "start_s": 0.0, "end_s": 20.0, "refused_at_s": [],
             "admitted_at_s": 0.1, "outcome": "completed", "frames": 19, "close_code": None},
            {"session": 1, "start_s": 10.0, "end_s": 20.0, "refused_at_s": [10.0, 12.0],
             "admitted_at_s": 14.0, "outcome": "completed", "frames": 5, "close_code": None}],
        "samples": [sample | {"t_s": 1.0}, sample | {"t_s": 11.0, "headroom": 0},
                    sample | {"t_s": 13.0, "desired_replicas": 2},
                    sample | {"t_s": 15.0, "replicas_serving": 2, "cap": 4},
                    sample | {"t_s": 25.0, "replicas_draining": 1},
                    sample | {"t_s": 27.0}],
        "events": [{"t_s": 11.5, "direction": "up", "from": 1, "to": 2, "headroom": 0,
                    "refused": 1, "reason": "1 session(s) refused"},
                   {"t_s": 24.0, "direction": "down", "from": 2, "to": 1, "headroom": 4,
                    "refused": 0, "reason": "headroom 4 exceeds one replica's cap by 2"}],
        "frames": [{"t_s": 1.0 + k, "good": k != 15} for k in range(19)],
    }


def test_timeline_and_summary_count_per_step_and_time_each_decision():
    from metronome.bench.served.autoscale import binned, summary, timeline

    raw = canned_autoscaling_raw()
    rows = timeline(raw, (1, 2), 10.0)
    assert [(r["offered"], r["replicas_min"], r["replicas_max"], r["headroom_min"],
             r["refusals"], r["frames"], r["misses"]) for r in rows] == [
        (1, 1, 1, 1, 0, 9, 0), (2, 1, 2, 0, 2, 10, 1)]
    total = summary(raw)
    assert (total["admitted"], total["refusals"], total["refused_sessions"],
            total["wait_s_max"], total["closed_by_server"], total["misses"]) == (
        2, 2, 1, 4.0, 0, 1)
    assert [d["effect_s"] for d in total["decisions"]] == [3.5, 3.0]  # serving 2; drained
    assert [b["refusals"] for b in binned(raw, 5.0)][:3] == [0, 0, 2]


def test_the_autoscaling_report_and_figure_read_only_the_result(tmp_path):
    from metronome.bench.cluster_bench import Config, plot_autoscaling, report
    from metronome.bench.served.autoscale import binned, summary, timeline

    raw, cfg = canned_autoscaling_raw(), Config(autoscale_levels=(1, 2), autoscale_step_s=10.0)
    auto = {"command": "metronome serve --replicas 1..3", "samples": raw["samples"],
            "sessions": raw["sessions"], "timeline": timeline(raw, (1, 2), 10.0),
            "binned": binned(raw, 5.0), "summary": summary(raw),
            "defaults": {"autoscale_headroom_sessions": 1, "autoscale_refusal_window_s": 10.0}}
    result = canned_result()
    result["config"] = asdict(cfg)
    for key in ("proxy_hop", "capacity", "footprint"):
        del result[key]
    text = report(result | {"autoscaling": auto})
    assert "## Autoscaling (`--replicas 1..3`)" in text and "## The proxy hop" not in text
    assert "| 1 | 10 | 2 | 1..2 | 0 | 2 | 10 | 1 |" in text
    assert "| 11.5 | up 1 -> 2 | 1 session(s) refused | 0 | 1 | 3.5 |" in text
    assert "2 admitted (1 after at least one refusal, 2 refusals in all" in text
    plot_autoscaling(RunContext("cluster", out_json=tmp_path / "c.json"), auto, 10.0, (1, 2))
    assert (tmp_path / "cluster_autoscaling.png").stat().st_size > 10_000
