"""The presets: each small one end to end at its smoke size (its JSON, report and derived
number), and the pure parts of the ones whose smoke size takes minutes (plan, admission,
cluster) or needs vLLM (vllm, engine-vs-vllm), which `metronome bench NAME --smoke` runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from metronome.bench.presets import (
    cluster,
    ear,
    endless,
    engine,
    engine_paths,
    engine_vs_vllm,
    instructions,
    plan,
    prompt,
    resume,
    soak,
    vad,
    vllm,
    voice,
)
from metronome.results.context import RunContext, execute
from metronome.sim.cost_model import StepCostModel


def smoke(module, tmp_path, **changes):
    js = tmp_path / f"{module.NAME}.json"
    ctx = RunContext(module.NAME, js, command=f"metronome bench {module.NAME} --smoke")
    returned = execute(module, ctx, module.Config(**module.Config.SMOKE | changes))
    written = json.loads(js.read_text())
    assert json.loads(json.dumps(returned)) == written  # what it returns is what it wrote
    text = js.with_suffix(".md").read_text()
    assert f"`metronome bench {module.NAME} --smoke`" in text and "Machine:" in text
    assert f"**{written['derived']['label']}: " in text
    return written, text


def test_vad_boundaries_and_cost(tmp_path):
    res, text = smoke(vad, tmp_path)
    assert {r["fixture"] for r in res["boundaries"]} == {"booking", "station", "weather"}
    assert all(r["rate_hz"] == 16000 and r["vad_start_ms"] is not None
               for r in res["boundaries"])
    assert res["cost"]["chunks"] > 100 and res["derived"]["value"] == res["cost"][
        "push_ms_per_chunk"] > 0
    assert "| booking | 0 |" in text


def test_word_error_rate_counts_edits_over_the_reference():
    assert voice.wer("What is the capital of France?", "what is the capital of france") == 0
    assert voice.wer("front center", "Front Centre.") == 0.5  # one substitution
    assert voice.wer("a b c", "a c") == 1 / 3 and voice.wer("a", "a b c") == 2.0


def test_a_long_answer_counts_whole_when_the_model_stopped_or_its_budget_ran_out():
    assert voice.ended_as_a_reply_may({"status": "completed"})
    assert voice.ended_as_a_reply_may({"status": "incomplete", "status_details": {
        "type": "incomplete", "reason": "max_output_tokens"}})
    assert not voice.ended_as_a_reply_may({"status": "incomplete", "status_details": {
        "type": "incomplete", "reason": "turn_detected"}})
    assert not voice.ended_as_a_reply_may({"status": "cancelled", "status_details": None})


@pytest.mark.model
def test_the_ear_by_window_against_thirty_seconds(tmp_path):
    res, text = smoke(ear, tmp_path)
    assert {r["window"] for r in res["wer"]} == {ear.REFERENCE, "10 s"}
    assert {r["source"] for r in res["wer"]} >= {"Piper (the served voice)", "espeak-ng"}
    reference = {r["source"]: r for r in res["wer"] if r["window"] == ear.REFERENCE}
    assert all(r["wer_rise"] == r["wer"] - reference[r["source"]]["wer"] for r in res["wer"])
    assert reference["Piper (the served voice)"]["wer"] < 0.15  # it hears the served voice
    times = {(r["window"], r["clip_s"]): r["pass_ms"] for r in res["pass_times"]}
    assert times[("10 s", 1.0)] < times[(ear.REFERENCE, 1.0)]  # the point of the window
    assert res["derived"]["value"] in (None, 10.0) and "| 10 s |" in text


@pytest.mark.model
def test_voice_stages_and_one_spoken_session(tmp_path):
    res, text = smoke(voice, tmp_path)
    stages = res["stages"]
    assert [m["what"] for m in stages["memory"]][1:] == [
        "+ SmolLM2-135M (the LM)", "+ Whisper tiny.en (int8)", "+ Piper en_US joe medium"]
    assert all(p["pass_ms"] > 0 for p in stages["whisper_passes"])
    assert all(0 < p["real_time_factor"] < 1 for p in stages["piper"])
    piper_wer = next(w["wer"] for w in stages["wer"] if w["source"] == "Piper (synthesized)")
    assert piper_wer < 0.3  # Whisper hears the voice it is served with
    (row,) = res["sessions"]
    assert (row["arm"], row["sessions"], row["errors"]) == ("voice", 1, 0)
    assert row["replies"] == 1 and row["ttfa_p50_ms"] > 0
    assert res["derived"]["value"] in (0, 1) and "time to first output" in text


@pytest.mark.model
def test_engine_rows_fit_the_step_cost_and_carry_their_provenance(tmp_path):
    res, _ = smoke(engine, tmp_path)
    assert res["provenance"]["omp_wait_policy"] in ("PASSIVE", "from the environment: "
                                                    + os.environ.get("OMP_WAIT_POLICY", ""))
    assert {(r["system"], r["sessions"], r["session_tokens"]) for r in res["rows"]} == {
        (p, n, length) for p in ("unbounded", "sinks_window:4:32") for n in (1, 4)
        for length in (64, 256)}
    bounded = [r for r in res["rows"] if r["system"] != "unbounded"]
    assert all(r["status"] == "ok" and r["step_ms_median"] > 0 for r in res["rows"])
    assert max(r["attended_tokens"] for r in bounded) < 64  # the window, not the history
    model, calibration = StepCostModel.load(tmp_path / "engine_step_cost.json")
    assert model.fixed_s == res["step_cost"]["fixed_s"]
    assert calibration.command == res["command"] and calibration.dtype == res[
        "provenance"]["dtype"] and calibration.engine_path == res["provenance"]["engine_path"]
    assert res["derived"]["label"] == "unbounded / sinks_window:4:32 median step at N=4, L=256"


@pytest.mark.model
def test_engine_paths_time_each_path_and_its_speed_up(tmp_path):
    res, _ = smoke(engine_paths, tmp_path, policies=("sinks_window:4:32",),
                   paths=("fast-onednn", "fast"))
    assert [r["path"] for r in res["rows"]] == ["fast-onednn", "fast"]
    assert res["rows"][0]["speed_up"] == 1.0 and res["rows"][1]["speed_up"] > 0
    assert "few-row kernel" not in res["provenance"]["engine_path"].split(" vs ")[0]
    for bad in (("fast",), ("fast", "fast"), ("fast", "turbo")):
        with pytest.raises(ValueError, match="paths"):
            engine_paths.Config(paths=bad)


@pytest.mark.model
def test_resume_snapshot_step_cost_and_both_resumes(tmp_path):
    res, _ = smoke(resume, tmp_path)
    assert res["snapshot"]["bytes"] > res["snapshot"]["kv_bytes"] > 100_000
    assert [r["arm"] for r in res["step_cost"]] == ["no snapshots", "snapshots"]
    assert [(r["arm"], r["n"]) for r in res["resumes"]] == [("same server", 3),
                                                             ("other server", 3)]
    assert res["derived"]["value"] == res["resumes"][1]["median_ms"] > 0


@pytest.mark.model
def test_prompt_both_arms_answer(tmp_path):
    res, text = smoke(prompt, tmp_path)
    assert [r["prefill_chunk_tokens"] for r in res["rows"]] == [64, 256]
    assert all(150 <= r["prompt_tokens"] <= 200 and len(r["rounds_s"]) == 1
               for r in res["rows"])
    assert "--prefill-chunk-tokens 256" in text


@pytest.mark.model
def test_soak_is_flat_when_idle_and_counts_every_client(tmp_path):
    res, _ = smoke(soak, tmp_path)
    phases = [s["phase"] for s in res["samples"]]
    assert phases[:3] == ["idle_start"] * 3 and "load" in phases and phases[-1] == "idle_end"
    flat = {v["what"].split(" ")[0]: v for v in res["verdict"]}
    assert flat["used_blocks"]["end"] == 0 and flat["used_blocks"]["flat"]
    assert flat["open_fds"]["flat"], flat
    seen = {c["what"]: c["count"] for c in res["clients"]}
    assert seen.get("good sessions completed", 0) >= 1
    assert any(k.startswith("bad abrupt") for k in seen)
    assert (tmp_path / "soak.png").stat().st_size > 1000


def test_plan_reads_its_error_both_ways():
    assert plan.error(11, 10) == pytest.approx(0.1) and plan.error(9, 10) == pytest.approx(-0.1)
    assert plan.error(5, 0) is None and plan.error(None, 10) is None


def test_cluster_ladder_stops_at_the_first_step_that_misses_or_is_refused():
    def summary(completed, refused, goodput):
        return {"sessions": {"completed": completed, "refused": refused},
                "frames": 10 * completed, "goodput_server": goodput,
                "latency_ms": {"client": {"p95": 100.0}}}

    canned = {8: summary(8, 0, 1.0), 12: summary(12, 0, 0.995), 16: summary(14, 2, 1.0),
              20: summary(20, 0, 1.0)}
    cfg = cluster.Config(ladder=(8, 12, 16, 20))
    steps = cluster.ladder_steps(cfg, canned.__getitem__)
    assert [(s["offered"], s["admitted"], s["holds"]) for s in steps] == [
        (8, 8, True), (12, 12, True), (16, 14, True)]  # refused at 16: stop there
    missing = {**canned, 12: summary(12, 0, 0.98)}
    assert [s["offered"] for s in cluster.ladder_steps(cfg, missing.__getitem__)] == [8, 12]
    assert cluster.schedule((1, 3, 2, 0), 10.0) == [(0.0, 30.0), (10.0, 20.0), (10.0, 30.0)]
    with pytest.raises(ValueError, match="runs"):
        cluster.Config(runs=("both",))


def test_vllm_configs_refuse_what_they_cannot_run():
    assert vllm.Config.smoke().stream_arms == vllm.ARMS
    with pytest.raises(ValueError, match="unknown stream arms"):
        vllm.Config(stream_arms=("turbo",))
    with pytest.raises(ValueError, match="unknown parts"):
        vllm.Config(parts=("grid",))
    with pytest.raises(ValueError, match="unknown vLLM mode"):
        vllm.Config(vllm_mode="turbo")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        vllm.Config(repeats=0)


def test_vllm_capacity_is_the_most_sessions_every_run_held():
    runs = [{"arm": "a", "sessions": n, "goodput": g} for n, g in (
        (16, 1.0), (16, 0.995), (24, 1.0), (24, 0.98), (32, 0.999), (32, 1.0))] + [
        {"arm": "b", "sessions": 16, "goodput": 0.5}, {"arm": "b", "sessions": 32,
                                                       "goodput": None}]
    rows = {(r["arm"], r["sessions"]): r for r in vllm.capacity(runs)}
    # a point held only if every run held it: 24 did not, 32 did (capacity is the most held)
    assert [rows[("a", n)]["held"] for n in (16, 24, 32)] == [True, False, True]
    assert rows[("a", 24)]["goodput_min"] == 0.98 and rows[("a", 24)]["runs"] == 2
    assert {r["capacity"] for r in vllm.capacity(runs) if r["arm"] == "a"} == {32}
    assert {r["capacity"] for r in vllm.capacity(runs) if r["arm"] == "b"} == {0}
    # runs at another GIL switch interval are their own series
    slow = [{"arm": "a", "sessions": 16, "goodput": 0.9, "gil_switch_ms": 5.0}]
    by_switch = {(r["arm"], r["gil_switch_ms"]): r["capacity"] for r in vllm.capacity(
        runs + slow)}
    assert by_switch == {("a", None): 32, ("a", 5.0): 0, ("b", None): 0}
    with pytest.raises(ValueError, match="gil_switch_ms must be > 0"):
        vllm.Config(gil_switch_ms=(0.0,))


def test_the_memory_floor_reads_the_steps_own_pages_once(tiny_model):
    pages = engine_vs_vllm.step_pages(tiny_model)
    assert len(pages) == 4 * len(tiny_model.layers) + 1
    qkv = tiny_model.projections[0].qkv  # the copy the step reads: the few-row kernel's
    assert pages[0].data_ptr() == (qkv.weight if qkv.small is None else qkv.small_weight
                                   ).data_ptr()
    assert all(p.dtype == torch.float32 and p.dim() == 1 for p in pages)  # read as words
    weights = sum(p.numel() * 4 for p in pages)
    kv = 8 * 100 * tiny_model.config.kv_bytes_per_token(torch.float32)
    assert engine_vs_vllm.floor_ms(tiny_model, pages, 8, 100, 2.0) == pytest.approx(
        (weights + kv) / 2e9 * 1e3)
    assert 0.1 < engine_vs_vllm.read_gbs(pages) < 10_000
    assert engine_vs_vllm.Config(sessions=(8, 64), lengths=(1024,)).sessions_at(1024) == [8, 64]
    assert engine_vs_vllm.Config(sessions=(8, 128)).sessions_at(1024) == [8]


def test_the_engine_bench_measures_passive_unless_the_environment_chose():
    assert engine.wait_policy({"HOME": "/root"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine.wait_policy({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert engine.wait_policy({"GOMP_SPINCOUNT": "7"}) == {}


def test_importing_the_presets_changes_no_environment_variable():
    code = ("import os; before = dict(os.environ); import metronome.bench.presets.engine, "
            "metronome.bench.presets.vllm, metronome.bench.presets.engine_vs_vllm; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_endless_session_rolls_and_stays_bounded(tmp_path):
    """The smoke size: 8 s of frames, a 64-token position limit the session passes in ~4 s."""
    res, text = smoke(endless, tmp_path)
    (stopped,) = res["stopped"]
    assert stopped["arm"] == "native" and stopped["rolled_at_s"] is not None
    assert stopped["session_tokens"] > 64  # went on past the position limit
    rows = res["buckets"]
    assert sum(r["frames"] for r in rows) >= 6 and all(r["answered"] == r["frames"] for r in rows)
    bound_blocks = endless.ResidencyPolicy.parse(res["config"]["policy"]).max_blocks(16, 64)
    assert max(s["used_blocks"] for s in res["samples"]) <= bound_blocks
    assert "By session age" in text


def test_instructions_arms_and_repin_cost(tmp_path):
    res, text = smoke(instructions, tmp_path)
    arms = {row["arm"]: row for row in res["arms"]}
    assert set(arms) == {"pinned", "window", "fresh"}
    assert all(row["prompts"] == 3 for row in arms.values())
    assert arms["pinned"]["policy"].startswith("sinks_window sinks_window:")
    assert arms["window"]["context_tokens"] > 3 * 64 > arms["fresh"]["context_tokens"]
    assert res["repin"][0]["pinned_tokens"] == 32 and res["repin"][0]["median_ms"] > 0
    assert "Every reply" in text
