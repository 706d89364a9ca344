"""`metronome bench NAME` options are generated from the bench's Config: --smoke starts from
Config.smoke(), options given on the command line still apply, the rest keep the defaults."""

from __future__ import annotations

from typer.testing import CliRunner

import metronome.results.context as context
from metronome.bench.presets import vad as vad_bench
from metronome.cli import app
from metronome.cli.bench import BENCHES


def _config_run_with(monkeypatch, args: list[str], tmp_path):
    ran = []
    monkeypatch.setattr(context, "execute", lambda module, ctx, cfg: ran.append((ctx, cfg)))
    result = CliRunner().invoke(app, ["bench", "vad", *args, "--out", str(tmp_path / "v.json")])
    assert result.exit_code == 0, result.output
    (ctx, cfg), = ran
    return ctx, cfg


def test_smoke_starts_from_the_smoke_config(monkeypatch, tmp_path):
    ctx, cfg = _config_run_with(monkeypatch, ["--smoke"], tmp_path)
    assert cfg == vad_bench.Config.smoke()
    assert ctx.scale == "smoke"


def test_an_option_given_applies_on_top_of_smoke(monkeypatch, tmp_path):
    _, cfg = _config_run_with(monkeypatch, ["--smoke", "--append-ms", "40"], tmp_path)
    assert cfg.rates_hz == vad_bench.Config.smoke().rates_hz
    assert cfg.append_ms == 40


def test_without_smoke_every_default_is_the_configs(monkeypatch, tmp_path):
    ctx, cfg = _config_run_with(monkeypatch, [], tmp_path)
    assert cfg == vad_bench.Config()
    assert ctx.scale == "full"


def test_every_bench_lists_and_builds_its_options():
    """`metronome bench --help` lists every command (from their docstrings), and each one's
    own help builds from its preset (the vLLM ones too, where vLLM is missing). The names are
    spelled out so that a bench added or dropped is a decision this test sees."""
    runner = CliRunner()
    listed = runner.invoke(app, ["bench", "--help"])
    assert listed.exit_code == 0 and all(name in listed.output for name in BENCHES)
    assert sorted(BENCHES) == ["admission", "cluster", "ear", "endless", "engine", "engine-paths",
                               "engine-vs-vllm", "instructions", "plan", "prompt", "resume",
                               "runtime", "soak", "talkers", "vad", "vllm", "voice"]
    for name in BENCHES:
        shown = runner.invoke(app, ["bench", name, "--help"])
        assert shown.exit_code == 0 and "--smoke" in shown.output, (name, shown.output)


def test_an_invalid_knob_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(app, ["bench", "engine-paths", "--paths", "turbo", "--out",
                                      str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "paths" in result.output
