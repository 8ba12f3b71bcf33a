"""Metrics across front processes (``MMGATE_PROCESSES`` > 1): each front reports its families as plain data,
the gate sums them series by series, and the merged families are exposed as one process's would be."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from proxy.admission.client import GateCounters

# Families merged by their smallest value (when the oldest front started), not summed.
MIN_FAMILIES = ("process_start_time_seconds",)
# Kinds whose values only grow: a front that stopped answering, or is gone, still counts with its last values,
# so that no sum ever goes down (Prometheus would read that as a counter reset).
COUNT_KINDS = ("counter", "histogram", "summary")


def counts_of(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` less what is only true now (gauges, ``extra``): what a front that no longer answers still
    adds to the totals."""
    return {"front": report["front"], "families": [family for family in report["families"]
                                                   if family[2] in COUNT_KINDS], "extra": {}}


def _summed(reports: list[dict[str, Any]]) -> dict[str, list[Any]]:
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
    return families


def _as_data(families: dict[str, list[Any]]) -> list[list[Any]]:
    return [[name, doc, kind, unit, [[sname, dict(labels), value] for (sname, labels), value in series.items()]]
            for name, (doc, kind, unit, series) in families.items()]


def departed(so_far: dict[str, Any] | None, report: dict[str, Any]) -> dict[str, Any]:
    """The counts of every front gone so far, ``report``'s (its last) added: one report, however many came
    and went."""
    return {"front": None, "families": _as_data(_summed([counts_of(report)] + ([so_far] if so_far else []))),
            "extra": {}}


def merge_reports(reports: list[dict[str, Any]], gate_counters: GateCounters,
                  silent: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every front's metric families summed series by series; the gate's own gauges from the gate;
    ``extra`` (requests in flight, being read, resident memory, decode workers) summed; ``fronts``: each
    front's own figures. ``silent``: the last reports of fronts that did not answer this time (hung) and of
    those gone (``departed``, no ``front``): only their counts are added, and a hung front is listed with
    ``answering`` false."""
    silent = [counts_of(report) for report in silent or []]
    families = _summed(reports + silent)
    for name, value in gate_counters.gauges().items():
        if name in families:
            families[name][3] = {(name, ()): value}
    extra: dict[str, float] = {}
    for report in reports:
        for key, value in report["extra"].items():
            extra[key] = extra.get(key, 0) + value
    fronts = [{**report["front"], "answering": True} for report in reports]
    fronts += [{**report["front"], "answering": False} for report in silent if report["front"] is not None]
    extra["processes"] = len(fronts)
    return {
        "fronts": sorted(fronts, key=lambda front: front["index"]),
        "families": _as_data(families),
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
