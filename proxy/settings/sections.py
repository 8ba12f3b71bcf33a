"""The frozen sections the one ``Settings`` is made of (``frozen``), one per concern.

A field is named as its variable without the prefix: ``settings.limits.max_body_mb`` is ``MMGATE_MAX_BODY_MB``
and ``--max-body-mb``. Each field's default is the one place that default is written: the help texts and the
documentation insert it from here (``proxy.settings.spec``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import aiohttp

MIB = 1 << 20
# What one open client connection may hold outside any body: aiohttp's read buffer (256 KiB) and a
# request head (up to 64 KiB of header fields).
CONNECTION_BYTES = (256 + 64) << 10
# Connections allowed beyond MMGATE_MAX_CONNECTIONS at once, read for a liveness or readiness probe.
PROBE_RESERVE = 8
# From this many usable CPUs on, decode workers are processes by default (README "Decode mode" says why).
PROCESS_MODE_FROM_CPUS = 2
# A decode process before its first item: the interpreter, Pillow and pybase64 (measured RSS, rounded up).
WORKER_PROCESS_BYTES = 32 * MIB
# Priority bands (MMGATE_PRIORITY_HEADER): a value outside is clamped to the nearest end.
PRIORITY_MIN, PRIORITY_MAX = -8, 8
AUTO_CONCURRENCY = 0  # max_mm_concurrency when MMGATE_MAX_MM_CONCURRENCY=auto
AUTO_JPEG_QUALITY = 0  # jpeg_quality when MMGATE_JPEG_QUALITY=auto (preprocessors/image.py resolves it)

BackendMetrics = Literal["passthrough", "merge", "merge-admin"]
DecodeMode = Literal["thread", "process"]
Validate = Literal["full", "header"]
ImageFormat = Literal["auto", "jpeg", "png", "webp", "bmp"]
ReleaseAt = Literal["auto", "sent", "headers", "complete"]
MediaUrls = Literal["forward", "reject", "fetch"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]
EventLoop = Literal["auto", "asyncio", "uvloop"]


def usable_cpus() -> int:
    """CPUs this process may really use: affinity mask and cgroup v2 quota, not ``os.cpu_count()``."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        count = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            count = min(count, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


def default_decode_mode(cpus: int) -> DecodeMode:
    """``thread`` with one usable CPU, where one worker's GIL holds cost the loop little and a process is not
    worth its memory and copies; ``process`` from PROCESS_MODE_FROM_CPUS on, where the threads' holds add up
    and the event loop queues behind them (README, Tuning: the measurements behind the threshold)."""
    return "process" if cpus >= PROCESS_MODE_FROM_CPUS else "thread"


def _default_decode_mode() -> DecodeMode:
    return default_decode_mode(usable_cpus())


@dataclass(frozen=True, slots=True)
class Listen:
    """Where and how clients connect."""

    host: str = "0.0.0.0"
    port: int = 8080
    processes: int = 1
    process_timeout: float = 10.0
    admin_port: int = 0
    max_connections: int = 1024
    loop_lag_target: float = 0.005
    loop: EventLoop = "auto"


@dataclass(frozen=True, slots=True)
class Backend:
    """The inference server behind mmgate and what is forwarded to it."""

    upstream: str = ""
    upstream_health_path: str = "/health"
    upstream_max_connections: int = 1024
    backend_metrics: BackendMetrics = "passthrough"
    allow_paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Gate:
    """Admission of media requests: the concurrency limit, the queue and its order, the budgets."""

    max_mm_concurrency: int = 4
    max_queue: int = 64
    max_inflight_media_mb: int = 1024
    max_inflight_image_tokens: int = 0
    fairness_header: tuple[str, ...] = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
    priority_header: str = "x-mmgate-priority"
    trust_flow_headers_from: tuple[str, ...] = ()
    max_queue_per_flow: int = 0
    min_mm_concurrency: int = 1
    max_mm_concurrency_auto: int = 64
    release_at: ReleaseAt = "auto"

    @property
    def adaptive_concurrency(self) -> bool:
        """MMGATE_MAX_MM_CONCURRENCY=auto: the limit moves between MIN_MM_CONCURRENCY and MAX_MM_CONCURRENCY_AUTO."""
        return self.max_mm_concurrency == AUTO_CONCURRENCY

    @property
    def mm_concurrency_ceiling(self) -> int:
        """The most media requests past admission: the fixed limit, or the adaptive limit's top."""
        return self.max_mm_concurrency_auto if self.adaptive_concurrency else self.max_mm_concurrency

    @property
    def max_inflight_media_bytes(self) -> int:
        return self.max_inflight_media_mb * MIB


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines in seconds, one per phase of a request (0 = off where allowed)."""

    header_timeout: float = 10.0
    keepalive_timeout: float = 75.0
    body_read_timeout: float = 30.0
    queue_timeout: float = 30.0
    preprocess_timeout: float = 30.0
    request_timeout: float = 0.0
    upstream_connect_timeout: float = 5.0
    upstream_read_timeout: float = 600.0
    client_write_timeout: float = 30.0
    upstream_client: aiohttp.ClientTimeout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once here: every forward uses it. No total: a stream may run as long as it keeps sending.
        object.__setattr__(self, "upstream_client", aiohttp.ClientTimeout(
            total=None, sock_connect=self.upstream_connect_timeout, sock_read=self.upstream_read_timeout))


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request and one media item may be."""

    max_body_mb: int = 64
    max_media_per_request: int = 16
    max_json_depth: int = 64
    max_json_structure_kb: int = 512
    max_media_item_mb: int = 32
    max_image_pixels: int = 64_000_000
    max_frames: int = 64
    max_audio_seconds: float = 600.0
    max_video_pixels: int = 8_294_400
    max_video_frames: int = 3600
    max_video_seconds: float = 600.0

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_mb * MIB

    @property
    def max_json_structure_bytes(self) -> int:
        return self.max_json_structure_kb * 1024

    @property
    def max_media_item_bytes(self) -> int:
        return self.max_media_item_mb * MIB


@dataclass(frozen=True, slots=True)
class Decode:
    """The decode workers and what they make of each media item."""

    decode_workers: int = field(default_factory=usable_cpus)
    decode_mode: DecodeMode = field(default_factory=_default_decode_mode)
    worker_max_jobs: int = 1000
    worker_max_rss_mb: int = 1024
    validate: Validate = "header"
    resize_max_pixels: int = 0
    resize_max_side: int = 0
    model: str = ""
    image_format: ImageFormat = "auto"
    jpeg_quality: int = AUTO_JPEG_QUALITY


@dataclass(frozen=True, slots=True)
class Fetch:
    """Media URLs: left to the backend, refused, or fetched by mmgate within these bounds."""

    media_urls: MediaUrls = "forward"
    fetch_allow_hosts: tuple[str, ...] = ()
    fetch_allow_addresses: tuple[str, ...] = ()
    fetch_max_redirects: int = 3
    fetch_timeout: float = 10.0
    fetch_first_byte_timeout: float = 5.0
    fetch_max_connections: int = 64


@dataclass(frozen=True, slots=True)
class Memory:
    """The processed-media cache and how freed memory goes back to the OS."""

    cache_mb: int = 256
    trim_idle: float = 1.0
    malloc_tuning: bool = True

    @property
    def cache_bytes(self) -> int:
        return self.cache_mb * MIB


@dataclass(frozen=True, slots=True)
class Drain:
    """Shutdown on SIGTERM."""

    drain_grace: float = 5.0
    drain_timeout: float = 30.0


@dataclass(frozen=True, slots=True)
class Logs:
    """What mmgate tells about each request and itself."""

    server_timing: bool = True
    access_log: bool = True
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"


# Section name -> its dataclass, in the order of ``Settings``' fields.
SECTION_TYPES: dict[str, type] = {
    "listen": Listen, "backend": Backend, "gate": Gate, "timeouts": Timeouts, "limits": Limits,
    "decode": Decode, "fetch": Fetch, "memory": Memory, "drain": Drain, "logs": Logs,
}
