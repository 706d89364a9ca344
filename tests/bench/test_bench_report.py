"""The one writer (`metronome.results.report`): a fixed result in, the exact markdown out,
and the plots drawn from the result and listed in it."""

from __future__ import annotations

from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, cell, derived, get

RESULT = {
    "name": "demo", "command": "metronome bench demo --smoke", "scale": "smoke",
    "elapsed_s": 12.4, "plots": ["demo.png"],
    "provenance": {"commit": "abc123", "machine": {
        "cpu_model": "Some CPU", "cpu_generation": None, "vector_isa": "avx2",
        "logical_cpus": 2, "memory_gib": 8.0, "torch": "2.13", "torch_threads": 2},
        "dtype": "bfloat16"},
    "config": {"sessions": [1, 4], "fast": True},
    "derived": derived("speed-up of b over a", 1.23456),
    "rows": [{"arm": "a", "n": 1, "ms": 10.0, "note": None, "every": [1, 2, 3, 4, 5]},
             {"arm": "b", "n": 1, "ms": 8.125, "note": "x", "every": [1]},
             {"arm": "a", "n": 4, "ms": 30.5, "note": None, "every": []}],
    "one": {"fixed_s": 0.0123456, "path": "out.json"},
}
REPORT = Report("Demo", spec=".2f", tables=(
    Table("Arm a", "rows", (("arm", "arm", ""), ("N", "n", ""), ("ms", "ms", ".1f")),
          where=(("arm", "a"),)),
    Table("All rows, every key", "rows"),
    Table("One dict", "one"),
    Table("Absent", "nothing")),
    plots=(Plot("{stem}.png", "rows", x="n", ys=("ms",), series="arm"),))


def test_the_markdown_reads_every_number_from_the_result():
    assert REPORT.markdown(RESULT).splitlines() == [
        "# Demo", "",
        "Machine: Some CPU (avx2), 2 logical CPUs, 8.0 GiB, torch 2.13 (2 threads); dtype "
        "bfloat16; commit `abc123`.", "",
        "Command: `metronome bench demo --smoke` (smoke size, 12 s). Written by the command; "
        "do not edit by hand.", "",
        "**speed-up of b over a: 1.23**", "",
        "Knobs: `sessions` 1, 4, `fast` yes.", "",
        "## Arm a", "",
        "| arm | N | ms |", "|---|---|---|", "| a | 1 | 10.0 |", "| a | 4 | 30.5 |", "",
        "## All rows, every key", "",
        "| arm | n | ms | note |", "|---|---|---|---|",  # a list over 4 values: the JSON's
        "| a | 1 | 10 | - |", "| b | 1 | 8.125 | x |", "| a | 4 | 30.5 | - |", "",
        "## One dict", "",
        "| fixed_s | path |", "|---|---|", "| 0.01235 | out.json |", "",
        "## Absent", "", "(not measured in this run)", "",
        "![demo.png](demo.png)"]


def test_cells_and_paths():
    assert [cell(None), cell(True), cell([1.5, None], ".1f"), cell({"a": 2}), cell(7, "+d"),
            cell(0.123456), cell("s", ".1f")] == ["-", "yes", "1.5, -", "a 2", "+7", "0.1235",
                                                   "s"]
    assert get(RESULT, "rows.1.arm") == "b" and get(RESULT, "rows.9.arm") is None
    assert get(RESULT, "provenance.machine.logical_cpus") == 2 and get(RESULT, "x.y") is None


def test_finish_draws_the_plots_from_the_result_and_lists_them(tmp_path):
    ctx = RunContext("demo", tmp_path / "run.json")
    result = REPORT.finish(ctx, {"rows": RESULT["rows"]})
    assert result == {"rows": RESULT["rows"]}
    assert ctx.plots == ["run.png"] and (tmp_path / "run.png").stat().st_size > 5_000
    REPORT.finish(ctx, {"rows": []})  # nothing to draw: no figure
    assert ctx.plots == ["run.png"]
