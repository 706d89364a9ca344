"""A registry whose every sample carries constant labels (a cluster replica's `replica`).

prometheus_client has no constant labels: this registry adds them when it is collected, so
the metrics code (`observe.metrics`) registers on it like on any `CollectorRegistry` and
never knows it runs in a cluster.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric


class LabelledRegistry(CollectorRegistry):
    def __init__(self, labels: dict[str, str]) -> None:
        super().__init__()
        self.labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            for sample in metric.samples:
                labelled.samples.append(sample._replace(labels=sample.labels | self.labels))
            yield labelled
