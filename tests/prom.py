"""Prometheus and promtool for tests: find them, run promtool on rule files, start a real
Prometheus on loopback, query it, and record its series in promtool's test format."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from metronome.observe.alerts import AlertRule, Timings, rules_yaml
from metronome.observe.monitoring import prometheus_yml

MISSING = ("the Debian package `prometheus` (promtool, prometheus) is not installed: "
           "`make test` installs it (apt-get install prometheus), or install it by hand")
# Seconds, for a run that fires within a minute: 1 s scrapes, 1 s evaluations.
FAST = Timings(window="10s", for_short="5s", for_long="5s", evaluation_interval="1s",
               saturation_eta_s=300.0)


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(MISSING)
    return path


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([need("promtool"), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def write_rules(folder: Path, timings: Timings) -> Path:
    path = folder / "metronome_rules.yml"
    path.write_text(rules_yaml(timings))
    return path


def alert_expectation(rule: AlertRule, **labels: str) -> dict:
    """One entry of promtool's `exp_alerts` for `rule` firing with these series labels."""
    return {"exp_labels": {"severity": rule.severity, **labels},
            "exp_annotations": {"summary": rule.summary, "description": rule.description}}


def unit_test_file(folder: Path, rules: Path, interval: str, evaluation_interval: str,
                   series: dict[str, str], checks: list[dict]) -> Path:
    """promtool's test format (JSON is YAML): `series` maps a series to its values notation."""
    doc = {"rule_files": [rules.name], "evaluation_interval": evaluation_interval,
           "tests": [{"interval": interval,
                      "input_series": [{"series": s, "values": v} for s, v in series.items()],
                      "alert_rule_test": checks}]}
    path = folder / "test_rules.yml"
    path.write_text(json.dumps(doc, indent=1))
    return path


@contextmanager
def prometheus(folder: Path, target: str, port: int) -> Iterator[str]:
    """A real Prometheus on 127.0.0.1:`port` scraping `target` every second with the FAST
    rules; yields its URL."""
    binary = need("prometheus")
    rules = write_rules(folder, FAST)
    config = folder / "prometheus.yml"
    config.write_text(prometheus_yml(target, FAST, scrape_interval="1s", rules_path=rules.name))
    log = (folder / "prometheus.log").open("w")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, cwd=folder)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _ready(url):
            assert process.poll() is None, (folder / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "prometheus did not come up"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def api(url: str, path: str, **params) -> dict:
    response = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=10)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


def firing_alerts(url: str) -> dict[str, str]:
    """alertname -> state (pending | firing) of every active alert."""
    return {a["labels"]["alertname"]: a["state"] for a in api(url, "alerts")["alerts"]}


def record_series(url: str, names: list[str], start_s: float, end_s: float,
                  step_s: int = 1) -> dict[str, str]:
    """Every series of `names` from `start_s` to `end_s` in promtool's values notation
    ('_' where a step has no sample), labels as scraped (job, instance and the metric's)."""
    series = {}
    for name in names:
        data = api(url, "query_range", query=name, start=start_s, end=end_s, step=step_s)
        for result in data["result"]:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(result["metric"].items())
                              if k != "__name__")
            values = dict((round((float(t) - start_s) / step_s), v)
                          for t, v in result["values"])
            steps = round((end_s - start_s) / step_s) + 1
            series[f"{name}{{{labels}}}"] = " ".join(values.get(i, "_") for i in range(steps))
    return series
