"""The cluster's own metrics, beside each replica's (`observe.metrics`): the autoscaler's
decisions and what it wants, as every replica's `/metrics` shows them.

The autoscaler runs in Ray Serve's controller, which serves no `/metrics`; it posts to the
board (`cluster.board`), and each replica keeps the board's latest answer
(`ClusterMetrics.autoscaling`, refreshed each stats period). These series are the fleet's,
not one replica's, so they carry no `replica` label: whichever replica a scrape reaches
shows the same numbers (up to one stats period apart).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from metronome.cluster.autoscale import DIRECTIONS
from metronome.observe.labelled_registry import LabelledRegistry

AUTOSCALE_DECISIONS_TOTAL = "metronome_cluster_autoscale_decisions"  # (+ _total)
AUTOSCALE_DESIRED_REPLICAS = "metronome_cluster_autoscale_desired_replicas"
AUTOSCALE_HEADROOM = "metronome_cluster_autoscale_headroom_sessions"


class ClusterMetrics:
    """A prometheus collector of the board's autoscaling state (none while not
    autoscaled or before the autoscaler's first look)."""

    def __init__(self) -> None:
        self.autoscaling: dict | None = None  # the board's `autoscaling()` answer

    def collect(self) -> Iterator[Metric]:
        state = self.autoscaling
        if state is None:
            return
        decisions = CounterMetricFamily(AUTOSCALE_DECISIONS_TOTAL, "The autoscaler's "
                                        "decisions by direction (up: a replica added, down: "
                                        "one removed).", labels=["direction"])
        for direction in DIRECTIONS:
            decisions.add_metric([direction], state["decisions"].get(direction, 0))
        yield decisions
        yield GaugeMetricFamily(AUTOSCALE_DESIRED_REPLICAS, "Replicas the autoscaler wants.",
                                value=state["desired_replicas"])
        if state["headroom"] is not None:
            yield GaugeMetricFamily(AUTOSCALE_HEADROOM, "Free sessions in the fleet (caps "
                                    "less active), as the autoscaler last saw them.",
                                    value=state["headroom"])


class ReplicaRegistry(LabelledRegistry):
    """A replica's registry: its own metrics labelled `replica`, then the cluster's."""

    def __init__(self, labels: dict[str, str], cluster: ClusterMetrics) -> None:
        super().__init__(labels)
        self.cluster = cluster

    def collect(self) -> Iterator[Metric]:
        yield from super().collect()
        yield from self.cluster.collect()
