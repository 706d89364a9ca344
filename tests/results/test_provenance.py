"""The commit a result records: "-dirty" for changed code, not for the results a run writes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from metronome.results.provenance import RESULTS_DIR, git_commit


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
