"""`metronome experiment all --scale smoke` end to end, as CI runs it: every experiment
writes a summary with its fields, its plots and a report. Values are the experiments' to
report (docs/results/paper.md), not the tests' to pin; only invariants that hold by
construction are checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from metronome.experiments import EXPERIMENTS, module
from metronome.experiments.common import COMMON_FIELDS

pytestmark = pytest.mark.model
SMOKE_LIMIT_S = 600  # the bound for the whole smoke run on this machine


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    folder = tmp_path_factory.mktemp("experiments")
    metronome = Path(sys.executable).parent / "metronome"
    done = subprocess.run([str(metronome), "experiment", "all", "--scale", "smoke", "--out",
                           str(folder)], capture_output=True, text=True, timeout=SMOKE_LIMIT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return folder


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_writes_summary_plots_and_report(out, name):
    summary = json.loads((out / name / "summary.json").read_text())
    missing = set(COMMON_FIELDS + module(name).REQUIRED_FIELDS) - set(summary)
    assert not missing, missing
    assert summary["experiment"] == name and summary["scale"] == "smoke"
    assert summary["plots"], "every experiment plots something"
    report = (out / name / "report.md").read_text()
    for plot in summary["plots"]:
        assert (out / name / plot).stat().st_size > 1000
        assert plot in report, f"{plot} is not shown in the report"
    assert summary["clock"] in report or summary["clock"].split(" ")[0] in report.lower()


def test_bounded_sessions_never_stall_in_the_cliff(out):
    summary = json.loads((out / "cliff" / "summary.json").read_text())
    bounded = [r for r in summary["runs"] if r["policy"] != "unbounded"]
    assert bounded and all(r["stalled_frames"] == 0 for r in bounded)


def test_unknown_experiment_is_a_clear_error():
    metronome = Path(sys.executable).parent / "metronome"
    done = subprocess.run([str(metronome), "experiment", "nope"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "unknown experiment" in done.stderr


def test_a_missing_step_cost_file_is_a_clear_error(tmp_path):
    metronome = Path(sys.executable).parent / "metronome"
    missing = tmp_path / "nope.json"
    done = subprocess.run([str(metronome), "experiment", "cliff", "--step-cost", str(missing)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such file" in done.stderr and "step-cost" in done.stderr
