"""The commit a result records: "-dirty" for changed code, not for the results a run writes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from metronome.results.provenance import (
    RESULTS_DIR,
    cpu_generation,
    describe,
    git_commit,
    vector_isa,
)


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_dirty_means_changed_code_not_regenerated_results(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    results = tmp_path / RESULTS_DIR
    results.mkdir(parents=True)
    (results / "run.json").write_text("{}\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_commit(tmp_path) == head
    (results / "run.json").write_text('{"rewritten": true}\n')  # a bench regenerating it
    (tmp_path / "scratch.txt").write_text("untracked\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"


def test_outside_git_the_commit_is_unknown(tmp_path):
    assert git_commit(tmp_path / "nowhere") is None


def test_the_machine_names_its_cpu_generation_and_vector_isa():
    zen1 = ["processor\t: 0", "vendor_id\t: AuthenticAMD", "cpu family\t: 23", "model\t\t: 1",
            "model name\t: AMD EPYC", "flags\t\t: fpu sse4_2 avx fma avx2"]
    assert cpu_generation(zen1) == "family 23 model 1"
    assert cpu_generation(["model name\t: AMD EPYC"]) is None  # "model name" is not "model"
    assert vector_isa("fpu sse4_2 avx fma avx2".split()) == "avx2+fma"
    assert vector_isa("avx avx2 avx512f avx512_bf16".split()) == "avx512f"
    assert vector_isa("fp asimd".split()) == "asimd"
    assert vector_isa([]) == "none"


def test_describe_puts_the_generation_beside_the_model_name():
    machine = {"cpu_model": "AMD EPYC", "cpu_generation": "family 23 model 1",
               "vector_isa": "avx2+fma", "logical_cpus": 2, "memory_gib": 23.5,
               "torch": "2.13.0+cpu", "torch_threads": 2}
    line = describe({"commit": "abc", "machine": machine, "dtype": "float32"})
    assert line.startswith("Machine: AMD EPYC (family 23 model 1, avx2+fma), 2 logical CPUs")
    assert "dtype float32" in line and "`abc`" in line
    older = {k: v for k, v in machine.items() if k not in ("cpu_generation", "vector_isa")}
    assert describe({"commit": None, "machine": older}).startswith("Machine: AMD EPYC, 2 ")
