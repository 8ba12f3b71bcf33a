"""Prometheus metrics (one registry per app), the event-loop lag monitor and the Server-Timing header.

Names follow Prometheus conventions: base units (seconds, bytes), ``_total`` counters,
label values from fixed sets only (never a path, a request id or a client value).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
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
        r = self.registry
        self.requests = Counter(
            "mmgate_requests", "Requests answered, by route, kind (text|media) and status code",
            ["route", "kind", "code"], registry=r,
        )
        self.request_duration = Histogram(
            "mmgate_request_duration_seconds", "Time from arrival to the last response byte",
            ["route", "kind"], buckets=REQUEST_BUCKETS, registry=r,
        )
        self.stage_duration = Histogram(
            "mmgate_stage_duration_seconds", "Time spent in each stage of a request",
            ["stage"], buckets=FAST_BUCKETS, registry=r,
        )
        self.rejected = Counter("mmgate_rejected", "Requests refused by mmgate, by error code", ["reason"], registry=r)
        self.upstream_errors = Counter(
            "mmgate_upstream_errors", "Upstream failures: connect, timeout, reset", ["kind"], registry=r
        )
        self.gate_in_use = Gauge("mmgate_gate_in_use", "Media requests past admission", registry=r)
        self.gate_waiting = Gauge("mmgate_gate_waiting", "Media requests waiting for admission", registry=r)
        self.gate_reading = Gauge(
            "mmgate_gate_reading", "Media requests holding a place in line while their body still arrives",
            registry=r,
        )
        self.requests_reading = Gauge(
            "mmgate_requests_reading", "Requests whose body is still being read (text and media, before any gate)",
            registry=r,
        )
        self.image_tokens_inflight = Gauge(
            "mmgate_image_tokens_inflight", "Image tokens (MMGATE_MODEL) charged to the gate's token budget", registry=r
        )
        self.image_tokens = Histogram(
            "mmgate_image_tokens", "Image tokens per inline image for the served model (MMGATE_MODEL), from its header",
            buckets=(16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384), registry=r,
        )
        self.gate_limit = Gauge(
            "mmgate_gate_limit", "The gate's limit: MMGATE_MAX_MM_CONCURRENCY, or where auto finds it now", registry=r)
        self.media_bytes_inflight = Gauge(
            "mmgate_media_bytes_inflight", "Decoded media bytes charged to the gate's byte budget", registry=r
        )
        self.media_bytes_live = Gauge(
            "mmgate_media_bytes_live", "Media bytes this process holds for requests (0 after handoff)", registry=r
        )
        self.media_buffers_live = Gauge(
            "mmgate_media_buffers_live", "Media buffer owners not yet freed (weakref-counted; 0 when idle)", registry=r
        )
        self.media_items = Counter(
            "mmgate_media_items", "Media items seen, by type and outcome", ["type", "outcome"], registry=r
        )
        self.media_type_corrected = Counter(
            "mmgate_media_type_corrected", "Media forwarded with its true type in place of a different declared one",
            ["type"], registry=r,
        )
        self.client_connections = Gauge("mmgate_client_connections", "Open client connections", registry=r)
        self.idle_connections_closed = Counter(
            "mmgate_idle_connections_closed", "Idle keep-alive client connections closed to make room for a new "
            "one at MMGATE_MAX_CONNECTIONS", registry=r,
        )
        self.client_write_timeouts = Counter(
            "mmgate_client_write_timeouts", "Client connections cut for reading nothing of their answer for "
            "MMGATE_CLIENT_WRITE_TIMEOUT", registry=r,
        )
        self.media_bytes = Counter(
            "mmgate_media_bytes", "Decoded media bytes in (from clients) and out (to the upstream)",
            ["direction"], registry=r,
        )
        self.pool_queue_depth = Gauge("mmgate_pool_queue_depth", "Media items waiting for a decode worker", registry=r)
        self.pool_stuck_workers = Gauge(
            "mmgate_pool_stuck_workers", "Decode workers still busy for a request that already ended", registry=r
        )
        self.decode_worker_exits = Counter(
            "mmgate_decode_worker_exits", "Decode worker processes ended and replaced (MMGATE_DECODE_MODE=process): "
            "recycled (MMGATE_WORKER_MAX_JOBS/_RSS_MB), killed (its request gave up), crashed (a fault signal on "
            "an item), lost (ended from outside, e.g. SIGKILL by the OOM killer, on an item or idle)",
            ["reason"], registry=r,
        )
        self.event_loop_lag = Histogram(
            "mmgate_event_loop_lag_seconds", "How late the event loop runs a timer (loop blocked)",
            buckets=FAST_BUCKETS, registry=r,
        )
        self.uploads_held = Gauge(
            "mmgate_uploads_held", "Big request bodies whose reading is held while the event loop lags "
            "(MMGATE_LOOP_LAG_TARGET)", registry=r,
        )
        self.upload_holds = Counter(
            "mmgate_upload_holds", "Times the reading of a big request body was held because the event loop "
            "lagged (MMGATE_LOOP_LAG_TARGET)", registry=r,
        )
        self.fetches = Counter(
            "mmgate_fetches",
            "Media URLs fetched (MMGATE_MEDIA_URLS=fetch), by outcome: ok, cancelled or the refusal code",
            ["outcome"], registry=r,
        )
        self.fetched_bytes = Counter(
            "mmgate_fetched_bytes", "Body bytes read from media URLs, refused fetches included", registry=r
        )
        self.cache_hits = Counter(
            "mmgate_cache_hits", "Media items answered from the processed-media cache, without a decode", registry=r
        )
        self.cache_misses = Counter(
            "mmgate_cache_misses", "Media items decoded because the cache did not hold them (MMGATE_CACHE_MB)",
            registry=r,
        )
        self.cache_evictions = Counter(
            "mmgate_cache_evictions", "Cache entries dropped, least recently used first, to stay within the bound",
            registry=r,
        )
        self.cache_bytes = Gauge("mmgate_cache_bytes", "Bytes the processed-media cache holds", registry=r)
        self.cache_entries = Gauge("mmgate_cache_entries", "Entries the processed-media cache holds", registry=r)
        self.cache_waiting = Gauge(
            "mmgate_cache_waiting", "Requests waiting for another request's decode of the same media", registry=r
        )
        self.cache_limit_bytes = Gauge("mmgate_cache_limit_bytes", "MMGATE_CACHE_MB in bytes (0 = off)", registry=r)
        self.memory_trims = Counter(
            "mmgate_memory_trims", "malloc_trim calls after media work went idle (MMGATE_TRIM_IDLE)", registry=r
        )
        ProcessCollector(registry=r)
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
