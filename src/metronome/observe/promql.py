"""PromQL over Metronome's metrics: the expressions the alert rules and the dashboard share,
built from the metric-name constants of `observe.metrics` (never spelled twice), and the
check that an expression names only series Metronome exports.

Rates aggregate `without` the metric's own label (status, decision), so every expression
keeps the scrape's `job` and `instance`: one server's numbers are never mixed with
another's, and the two sides of a ratio or an `and` match on those labels.
"""

from __future__ import annotations

import re

from metronome.observe import metrics as m

_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
             "histogram": ("_bucket", "_sum", "_count", "_created")}


def exported_series() -> frozenset[str]:
    """Every series name /metrics exposes (read from the families a `Metrics` registry
    declares, so a metric added to `observe.metrics` is known here at once)."""
    families = m.Metrics().registry.collect()
    return frozenset(f.name + suffix for f in families for suffix in _SUFFIXES[f.type])


# Series Prometheus itself writes for every target (not Metronome's).
PROMETHEUS_SERIES = frozenset({"up"})


def frames_rate(window: str, status: str | None = None) -> str:
    """Frames answered per second (of one status), per server."""
    selector = m.FRAMES_TOTAL if status is None else f'{m.FRAMES_TOTAL}{{status="{status}"}}'
    return f"sum without (status) (rate({selector}[{window}]))"


def goodput(window: str) -> str:
    """Share of frames that produced their output within the deadline."""
    return f"rate({m.GOOD_FRAMES_TOTAL}[{window}]) / {frames_rate(window)}"


def deadline_met(window: str) -> str:
    """Share of frames that met their deadline (every frame but a `late` one: a stalled
    frame goes out on the beat, empty, and meets it)."""
    return f"1 - {frames_rate(window, 'late')} / {frames_rate(window)}"


def status_share(window: str, status: str) -> str:
    return f"{frames_rate(window, status)} / {frames_rate(window)}"


def steps_rate(window: str) -> str:
    return f"rate({m.ENGINE_STEP_SECONDS}_count[{window}])"


def refusals_rate(window: str) -> str:
    return (f'sum without (decision) (rate({m.ADMISSION_DECISIONS_TOTAL}'
            f'{{decision=~"refused_.*"}}[{window}]))')


def quantile(q: float, histogram: str, window: str) -> str:
    """The q-quantile of a histogram per server (`job`, `instance`)."""
    return (f"histogram_quantile({q:g}, sum by (job, instance, le) "
            f"(rate({histogram}_bucket[{window}])))")


# ---- checking expressions -------------------------------------------------------------------
_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                       "group_right", "offset", "bool", "inf", "nan"})
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACES = re.compile(r"\{[^}]*\}")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?")
_GRAFANA_VARIABLE = re.compile(r"\$\{?\w+\}?")


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (functions, keywords, label names and
    Grafana variables such as $__rate_interval left out)."""
    text = _GRAFANA_VARIABLE.sub("1m", expr)
    for pattern in (_STRINGS, _BRACES, _BRACKETS, _GROUPING):
        text = pattern.sub(" ", text)
    names = set()
    for name, call in _IDENTIFIER.findall(text):
        if not call and name.lower() not in _KEYWORDS and not re.fullmatch(r"\d", name):
            names.add(name)
    return names


def unknown_series(expr: str) -> set[str]:
    """Names in `expr` that neither Metronome nor Prometheus exports (empty: all exist)."""
    return metric_names(expr) - exported_series() - PROMETHEUS_SERIES
