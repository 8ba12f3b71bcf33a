"""Prometheus metrics (one registry per app), the event-loop lag monitor and the Server-Timing header.

Names follow Prometheus conventions: base units (seconds, bytes), ``_total`` counters,
label values from fixed sets only (never a path, a request id or a client value).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from functools import partial
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # the *_created series double the exposition and no dashboard reads them

# Sub-millisecond resolution where waits are usually short (queue, loop lag, parse) ...
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# ... and minutes for whole requests (non-streaming generations are long).
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)

STAGES = ("read", "parse", "queue", "fetch", "preprocess", "splice", "upstream", "total")


class Metrics:
    """Every mmgate metric, registered in its own registry so several apps (tests) never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        counter = partial(Counter, registry=self.registry)
        gauge = partial(Gauge, registry=self.registry)
        histogram = partial(Histogram, registry=self.registry)
        self.requests = counter(
            "mmgate_requests", "Requests answered, by route, kind (text|media) and status code",
            ["route", "kind", "code"])
        self.request_duration = histogram(
            "mmgate_request_duration_seconds", "Time from arrival to the last response byte", ["route", "kind"],
            buckets=REQUEST_BUCKETS)
        self.stage_duration = histogram(
            "mmgate_stage_duration_seconds", "Time spent in each stage of a request", ["stage"], buckets=FAST_BUCKETS)
        self.rejected = counter("mmgate_rejected", "Requests refused by mmgate, by error code", ["reason"])
        self.upstream_errors = counter("mmgate_upstream_errors", "Upstream failures: connect, timeout, reset", ["kind"])
        self.gate_in_use = gauge("mmgate_gate_in_use", "Media requests past admission")
        self.gate_waiting = gauge("mmgate_gate_waiting", "Media requests waiting for admission")
        self.gate_reading = gauge(
            "mmgate_gate_reading", "Media requests holding a place in line while their body still arrives")
        self.requests_reading = gauge(
            "mmgate_requests_reading", "Requests whose body is still being read (text and media, before any gate)")
        self.image_tokens_inflight = gauge(
            "mmgate_image_tokens_inflight", "Image tokens (MMGATE_MODEL) charged to the gate's token budget")
        self.image_tokens = histogram(
            "mmgate_image_tokens", "Image tokens per inline image for the served model (MMGATE_MODEL), from its header",
            buckets=(16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
        self.gate_limit = gauge(
            "mmgate_gate_limit", "The gate's limit: MMGATE_MAX_MM_CONCURRENCY, or where auto finds it now")
        self.media_bytes_inflight = gauge(
            "mmgate_media_bytes_inflight", "Decoded media bytes charged to the gate's byte budget")
        self.media_bytes_live = gauge(
            "mmgate_media_bytes_live", "Media bytes this process holds for requests (0 after handoff)")
        self.media_buffers_live = gauge(
            "mmgate_media_buffers_live", "Media buffer owners not yet freed (weakref-counted; 0 when idle)")
        self.media_items = counter("mmgate_media_items", "Media items seen, by type and outcome", ["type", "outcome"])
        self.media_type_corrected = counter(
            "mmgate_media_type_corrected", "Media forwarded with its true type in place of a different declared one",
            ["type"])
        self.client_connections = gauge("mmgate_client_connections", "Open client connections")
        self.idle_connections_closed = counter(
            "mmgate_idle_connections_closed",
            "Idle keep-alive client connections closed to make room for a new one at MMGATE_MAX_CONNECTIONS")
        self.client_write_timeouts = counter(
            "mmgate_client_write_timeouts",
            "Client connections cut for reading nothing of their answer for MMGATE_CLIENT_WRITE_TIMEOUT")
        self.media_bytes = counter(
            "mmgate_media_bytes", "Decoded media bytes in (from clients) and out (to the upstream)", ["direction"])
        self.pool_queue_depth = gauge("mmgate_pool_queue_depth", "Media items waiting for a decode worker")
        self.pool_stuck_workers = gauge(
            "mmgate_pool_stuck_workers", "Decode workers still busy for a request that already ended")
        self.decode_worker_exits = counter(
            "mmgate_decode_worker_exits", "Decode worker processes ended and replaced (MMGATE_DECODE_MODE=process): "
            "recycled (MMGATE_WORKER_MAX_JOBS/_RSS_MB), killed (its request gave up), crashed (a fault signal on "
            "an item), lost (ended from outside, e.g. SIGKILL by the OOM killer, on an item or idle)", ["reason"])
        self.event_loop_lag = histogram(
            "mmgate_event_loop_lag_seconds",
            "How late the event loop runs a timer (loop blocked)", buckets=FAST_BUCKETS)
        self.uploads_held = gauge(
            "mmgate_uploads_held",
            "Big request bodies whose reading is held while the event loop lags (MMGATE_LOOP_LAG_TARGET)")
        self.upload_holds = counter(
            "mmgate_upload_holds",
            "Times the reading of a big request body was held because the event loop lagged (MMGATE_LOOP_LAG_TARGET)")
        self.fetches = counter(
            "mmgate_fetches",
            "Media URLs fetched (MMGATE_MEDIA_URLS=fetch), by outcome: ok, cancelled or the refusal code", ["outcome"])
        self.fetched_bytes = counter(
            "mmgate_fetched_bytes", "Body bytes read from media URLs, refused fetches included")
        self.cache_hits = counter(
            "mmgate_cache_hits", "Media items answered from the processed-media cache, without a decode")
        self.cache_misses = counter(
            "mmgate_cache_misses", "Media items decoded because the cache did not hold them (MMGATE_CACHE_MB)")
        self.cache_evictions = counter(
            "mmgate_cache_evictions", "Cache entries dropped, least recently used first, to stay within the bound")
        self.cache_bytes = gauge("mmgate_cache_bytes", "Bytes the processed-media cache holds")
        self.cache_entries = gauge("mmgate_cache_entries", "Entries the processed-media cache holds")
        self.cache_waiting = gauge(
            "mmgate_cache_waiting", "Requests waiting for another request's decode of the same media")
        self.cache_limit_bytes = gauge("mmgate_cache_limit_bytes", "MMGATE_CACHE_MB in bytes (0 = off)")
        self.backend_metrics_merges = counter(
            "mmgate_backend_metrics_merges",
            "Merged /metrics expositions made (MMGATE_BACKEND_METRICS=merge): one per scrape of the backend, "
            "served to every scrape of mmgate until the next")
        self.memory_trims = counter(
            "mmgate_memory_trims", "malloc_trim calls after media work went idle (MMGATE_TRIM_IDLE)")
        ProcessCollector(registry=self.registry)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: prometheus_client validates and locks on every ``labels()``
        call, a cost the request path would otherwise pay several times per request. Every label set here is
        bounded (routes, kinds, status codes, stages)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


async def watch_loop_lag(metrics: Metrics, interval: float = 0.05) -> None:
    """Sleep ``interval`` again and again; how late each wake-up comes is how long the loop was blocked.

    50 ms: a stall shorter than the interval is only seen when it overlaps a wake-up, so a coarse interval
    under-samples exactly the short stalls the 5-100 ms buckets are for; 20 wake-ups/s cost nothing."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(interval)
        metrics.event_loop_lag.observe(max(0.0, loop.time() - started - interval))


def server_timing(stages: Iterable[tuple[str, float]]) -> str:
    """``Server-Timing`` value (W3C Server Timing): ``queue;dur=1.2, preprocess;dur=35.0`` in milliseconds."""
    return ", ".join(f"{name};dur={seconds * 1000:.1f}" for name, seconds in stages)


class Stopwatch:
    """Stage timings of one request, for the histogram and Server-Timing."""

    __slots__ = ("stages", "started")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.stages: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
