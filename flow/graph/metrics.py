"""A small Prometheus text-format registry: counters, gauges and histograms with labels.

``GET /metrics`` renders it. Values that live elsewhere (engine counters,
store sizes) are read at render time through *collectors*, so nothing on the
per-token path pays for metrics.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]
Sample = tuple[str, Labels, float]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34)).replace(chr(10), " ")}"'
               for k, v in labels)
    return "{" + ",".join(escaped) + "}"


def _value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


@dataclass
class Metric:
    name: str
    help: str
    kind: str  # counter | gauge | histogram
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def samples(self) -> Iterable[Sample]:
        for labels, value in sorted(self.values.items()):
            yield self.name, labels, value


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    kind: str = "histogram"
    series: dict[Labels, list[float]] = field(default_factory=dict)  # bucket counts…, sum, count

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        row = self.series.setdefault(key, [0.0] * (len(self.buckets) + 2))
        for i in range(bisect.bisect_left(self.buckets, value), len(self.buckets)):
            row[i] += 1
        row[-2] += value
        row[-1] += 1

    def samples(self) -> Iterable[Sample]:
        for labels, row in sorted(self.series.items()):
            for bound, count in zip(self.buckets, row):
                yield f"{self.name}_bucket", (*labels, ("le", _value(bound))), count
            yield f"{self.name}_bucket", (*labels, ("le", "+Inf")), row[-1]
            yield f"{self.name}_sum", labels, row[-2]
            yield f"{self.name}_count", labels, row[-1]


class Registry:
    def __init__(self) -> None:
        self._metrics: list[Metric | Histogram] = []
        self._collectors: list[Callable[[], Iterable[Metric]]] = []

    def counter(self, name: str, help: str) -> Metric:
        metric = Metric(name, help, "counter")
        self._metrics.append(metric)
        return metric

    def gauge(self, name: str, help: str) -> Metric:
        metric = Metric(name, help, "gauge")
        self._metrics.append(metric)
        return metric

    def histogram(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        metric = Histogram(name, help, buckets)
        self._metrics.append(metric)
        return metric

    def collector(self, fn: Callable[[], Iterable[Metric]]) -> None:
        """Metrics computed at render time (e.g. read from an engine's counters)."""
        self._collectors.append(fn)

    def render(self) -> str:
        lines: list[str] = []
        for metric in [*self._metrics, *(m for fn in self._collectors for m in fn())]:
            lines.append(f"# HELP {metric.name} {metric.help}")
            lines.append(f"# TYPE {metric.name} {metric.kind}")
            lines.extend(f"{name}{_labels(labels)} {_value(value)}" for name, labels, value in metric.samples())
        return "\n".join(lines) + "\n"
