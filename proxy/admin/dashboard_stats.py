"""The small JSON view behind /mmgate/stats: what the dashboard page polls every second or two.

Counters and histogram buckets are *cumulative* (as in Prometheus): the page keeps the previous poll and
computes rates and percentiles from the deltas, so this module stays stateless and a page opened late
sees the same numbers as one opened at start-up. Everything is read from the app's own metric objects
(the same numbers /mmgate/metrics exposes), plus the effective settings. It costs a few microseconds per
metric family and one small /proc read: cheap enough to poll from several browser tabs.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import Metric

from proxy.ops.merged_metrics import MergedFamilies
from proxy.ops.metrics import FAST_BUCKETS, REQUEST_BUCKETS

if TYPE_CHECKING:
    from prometheus_client.metrics import MetricWrapperBase

    from proxy.ops.metrics import Metrics
    from proxy.state import AppState

SCHEMA_VERSION = 1
_IMPORTED_AT = time.time()  # fallback "start time" when the process collector cannot read /proc
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _samples(metric: MetricWrapperBase) -> Iterable[Any]:
    for family in metric.collect():
        yield from family.samples


def _counter_by(metric: MetricWrapperBase, *labels: str) -> dict[str, float]:
    """``{label value(s) joined by '/': total}`` of a labelled counter (``*_total`` samples only)."""
    out: dict[str, float] = {}
    for s in _samples(metric):
        if s.name.endswith("_total"):
            key = "/".join(s.labels.get(label, "") for label in labels)
            out[key] = out.get(key, 0.0) + s.value
    return out


def _gauge_value(metric: MetricWrapperBase) -> float:
    return sum(s.value for s in _samples(metric))


def _histograms(metric: MetricWrapperBase, group_by: str | None,
                buckets: Sequence[float]) -> tuple[list[float], dict[str, dict[str, Any]]]:
    """The bucket upper bounds ``metric`` was made with (``buckets``, without +Inf: a labelled histogram
    exposes none before its first observation) and, per value of ``group_by`` (or "all"), cumulative counts.

    ``counts`` has one more entry than ``le``: the last is the +Inf bucket (= count). Series with other
    labels (route, kind...) are summed, which is valid for cumulative bucket counts.
    """
    bounds = [float(b) for b in buckets if not math.isinf(b)]
    groups: dict[str, dict[str, Any]] = {}
    for s in _samples(metric):
        key = s.labels.get(group_by, "") if group_by else "all"
        group = groups.setdefault(key, {"buckets": {}, "sum": 0.0, "count": 0.0})
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            group["buckets"][le] = group["buckets"].get(le, 0.0) + s.value
        elif s.name.endswith("_sum"):
            group["sum"] += s.value
        elif s.name.endswith("_count"):
            group["count"] += s.value
    out: dict[str, dict[str, Any]] = {}
    for key, group in groups.items():
        by_bound = group["buckets"]
        out[key] = {
            "counts": [by_bound.get(b, 0.0) for b in bounds] + [by_bound.get(math.inf, group["count"])],
            "sum": group["sum"],
            "count": group["count"],
        }
    return bounds, out


def rss_bytes() -> int | None:
    """Resident memory from /proc/self/statm (what process_resident_memory_bytes reports), or None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


_start_time: float | None = None


def _process_start_time(state: AppState) -> float:
    """Process start (from the process collector, read once: it never changes), else module import time."""
    global _start_time
    if _start_time is None:
        _start_time = state.metrics.registry.get_sample_value("process_start_time_seconds") or _IMPORTED_AT
    return _start_time


class _MergedFamily:
    """One merged family where ``snapshot`` expects a metric object: its ``collect()``."""

    def __init__(self, family: Metric | None) -> None:
        self._family = family

    def collect(self) -> list[Metric]:
        return [self._family] if self._family is not None else []


class _MergedMetrics:
    """Every front process's metrics, summed (``merged_metrics.merge_reports``), read as ``Metrics`` is read."""

    def __init__(self, metrics: Metrics, merged: dict[str, Any]) -> None:
        self._metrics = metrics
        self._families = MergedFamilies(merged).by_name

    def __getattr__(self, name: str) -> _MergedFamily:
        metric: MetricWrapperBase = getattr(self._metrics, name)
        (described,) = metric.describe()  # the family's name, as the merged report keys it
        return _MergedFamily(self._families.get(described.name))

    def started(self) -> float | None:
        family = self._families.get("process_start_time_seconds")
        return family.samples[0].value if family is not None and family.samples else None


def snapshot(state: AppState, merged: dict[str, Any] | None = None) -> dict[str, Any]:
    """Cumulative counters, histogram buckets, current gauges and effective limits, as one JSON-able dict.

    ``merged``: with several front processes, every front's metrics and totals (``Fleet.collect``):
    the numbers are mmgate's as a whole, not those of the process that answers."""
    m: Any = state.metrics if merged is None else _MergedMetrics(state.metrics, merged)
    s = state.settings
    now = time.time()
    totals: dict[str, float] = merged["extra"] if merged is not None else {
        "in_flight": state.in_flight, "reading": state.reading, "rss_bytes": rss_bytes() or 0,
        "decode_workers": state.pool.workers,
        "cache_mb": s.memory.cache_mb, "processes": 1}
    started = m.started() if merged is not None else None

    by_code = {code: v for code, v in _counter_by(m.requests, "code").items()}
    by_class: dict[str, float] = {}
    for code, value in by_code.items():
        cls = (code[:1] + "xx") if code[:1].isdigit() else "other"
        by_class[cls] = by_class.get(cls, 0.0) + value

    req_le, req_all = _histograms(m.request_duration, None, REQUEST_BUCKETS)
    _, req_kind = _histograms(m.request_duration, "kind", REQUEST_BUCKETS)
    stage_le, stages = _histograms(m.stage_duration, "stage", FAST_BUCKETS)
    lag_le, lag = _histograms(m.event_loop_lag, None, FAST_BUCKETS)

    media_bytes = _counter_by(m.media_bytes, "direction")
    bytes_in, bytes_out = media_bytes.get("in", 0.0), media_bytes.get("out", 0.0)

    return {
        "v": SCHEMA_VERSION,
        "time": now,
        "uptime_seconds": max(0.0, now - (started or _process_start_time(state))),
        "processes": int(totals["processes"]),
        # each front process's own (MMGATE_PROCESSES > 1): index, pid, requests in flight
        "fronts": merged["fronts"] if merged is not None else [],
        "requests": {
            "total": sum(by_code.values()),
            "by_class": by_class,
            "by_code": by_code,
            "by_kind": _counter_by(m.requests, "kind"),
            "by_route": _counter_by(m.requests, "route"),
            "status_429": by_code.get("429", 0.0),
        },
        "rejected": _counter_by(m.rejected, "reason"),
        "upstream_errors": _counter_by(m.upstream_errors, "kind"),
        "latency": {
            "request": {"le": req_le, "all": req_all.get("all"), "by_kind": req_kind},
            "stages": {"le": stage_le, "by_stage": stages},
        },
        "event_loop_lag": {"le": lag_le, **(lag.get("all") or {"counts": [], "sum": 0.0, "count": 0.0})},
        "gate": {
            "in_use": _gauge_value(m.gate_in_use),
            "limit": _gauge_value(m.gate_limit),
            "adaptive": s.gate.adaptive_concurrency,  # MMGATE_MAX_MM_CONCURRENCY=auto: the limit moves
            "waiting": _gauge_value(m.gate_waiting),
            "reading": _gauge_value(m.gate_reading),  # media bodies still arriving, each holding a place in line
            "max_queue": s.gate.max_queue,
        },
        "media": {
            "bytes_inflight": _gauge_value(m.media_bytes_inflight),
            "bytes_inflight_limit": s.gate.max_inflight_media_bytes,
            "bytes_live": _gauge_value(m.media_bytes_live),
            "buffers_live": _gauge_value(m.media_buffers_live),
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "bytes_saved": max(0.0, bytes_in - bytes_out),
            "items": _counter_by(m.media_items, "type", "outcome"),
        },
        "tokens": {
            "inflight": _gauge_value(m.image_tokens_inflight),
            "inflight_limit": s.gate.max_inflight_image_tokens,
            "model": state.model.family if state.model is not None else None,
        },
        "cache": {
            "hits": _gauge_value(m.cache_hits),
            "misses": _gauge_value(m.cache_misses),
            "evictions": _gauge_value(m.cache_evictions),
            "bytes": _gauge_value(m.cache_bytes),
            "entries": _gauge_value(m.cache_entries),
            "waiting": _gauge_value(m.cache_waiting),
            "limit_bytes": totals["cache_mb"] * (1 << 20),
        },
        "pool": {
            "workers": int(totals["decode_workers"]),
            "queue_depth": _gauge_value(m.pool_queue_depth),
            "stuck_workers": _gauge_value(m.pool_stuck_workers),
        },
        "process": {"rss_bytes": int(totals["rss_bytes"]) or None, "in_flight": int(totals["in_flight"]),
                    "reading": int(totals["reading"]), "draining": not state.lifecycle.ready},
        "limits": {
            "max_mm_concurrency": "auto" if s.gate.adaptive_concurrency else s.gate.max_mm_concurrency,
            "max_queue": s.gate.max_queue,
            "queue_timeout": s.timeouts.queue_timeout,
            "max_inflight_media_mb": s.gate.max_inflight_media_mb,
            "decode_workers": int(totals["decode_workers"]),
            "max_body_mb": s.limits.max_body_mb,
            "max_media_item_mb": s.limits.max_media_item_mb,
            "resize_max_pixels": s.decode.resize_max_pixels,
            "resize_max_side": s.decode.resize_max_side,
            "image_format": s.decode.image_format,
            "preprocess_timeout": s.timeouts.preprocess_timeout,
            "request_timeout": s.timeouts.request_timeout,
            "upstream_read_timeout": s.timeouts.upstream_read_timeout,
            "release_at": s.gate.release_at,
            "cache_mb": int(totals["cache_mb"]),
        },
    }
