"""Metrics across front processes (``MMGATE_PROCESSES`` > 1): each front reports its families as plain data,
the gate sums them series by series, and the merged families are exposed as one process's would be."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from proxy.admission.shared import gate_values

# Families merged by their smallest value (when the oldest front started), not summed.
MIN_FAMILIES = ("process_start_time_seconds",)


def merge_reports(reports: list[dict[str, Any]], gate_counters: list[int]) -> dict[str, Any]:
    """Every front's metric families summed series by series; the gate's own gauges from the gate;
    ``extra`` (requests in flight, being read, resident memory, decode workers) summed; ``fronts``: each
    front's own figures."""
    families: dict[str, list[Any]] = {}
    for report in reports:
        for name, documentation, kind, unit, samples in report["families"]:
            family = families.setdefault(name, [documentation, kind, unit, {}])
            series = family[3]
            for sample_name, labels, value in samples:
                key = (sample_name, tuple(sorted(labels.items())))
                if key not in series:
                    series[key] = value
                elif name in MIN_FAMILIES:
                    series[key] = min(series[key], value)
                else:
                    series[key] += value
    for name, value in gate_values(gate_counters).items():
        if name in families:
            families[name][3] = {(name, ()): value}
    extra: dict[str, float] = {}
    for report in reports:
        for key, value in report["extra"].items():
            extra[key] = extra.get(key, 0) + value
    extra["processes"] = len(reports)
    return {
        "fronts": sorted((report["front"] for report in reports), key=lambda front: front["index"]),
        "families": [[name, doc, kind, unit,
                      [[sname, dict(labels), value] for (sname, labels), value in series.items()]]
                     for name, (doc, kind, unit, series) in families.items()],
        "extra": extra,
    }


def report_of(registry_families: list[Metric], extra: Mapping[str, float], front: Mapping[str, Any]) -> dict[str, Any]:
    """A front's answer to "report": its metric families as plain data, ``extra`` (summed over the fronts)
    and ``front`` (this one's own: index, pid, requests in flight)."""
    return {
        "front": front,
        "families": [[family.name, family.documentation, family.type, family.unit,
                      [[s.name, s.labels, s.value] for s in family.samples]] for family in registry_families],
        "extra": extra,
    }


class MergedFamilies(Collector):
    """The merged families as a prometheus_client collector: ``generate_latest`` writes them as it would
    one process's, and ``dashboard_stats`` reads them the same way."""

    def __init__(self, merged: dict[str, Any]) -> None:
        self.by_name: dict[str, Metric] = {}
        for name, documentation, kind, unit, samples in merged["families"]:
            family = Metric(name, documentation, kind, unit)
            for sample_name, labels, value in samples:
                family.add_sample(sample_name, labels, value)
            self.by_name[name] = family

    def collect(self) -> list[Metric]:
        return list(self.by_name.values())
