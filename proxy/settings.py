"""One frozen Settings, built from ``MMGATE_*`` environment variables and CLI flags of the same names.

Every ``MMGATE_*`` variable is here, with its default, unit and what is allowed. A bad value raises
``ConfigError`` whose text is the one line the CLI prints before exiting with status 2. The environment is
injectable (``Settings.from_env(environ)``) so tests never touch ``os.environ``.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import urlsplit

MIB = 1 << 20
# What one open client connection may hold outside any body: aiohttp's read buffer (256 KiB) and a
# request head (up to 64 KiB of header fields).
CONNECTION_BYTES = (256 + 64) << 10
# Connections allowed beyond MMGATE_MAX_CONNECTIONS at once, read for a liveness or readiness probe.
PROBE_RESERVE = 8


class ConfigError(ValueError):
    """A configuration value that mmgate refuses; ``str()`` is one line naming variable, value and rule."""


# From this many usable CPUs on, decode workers are processes by default (README "Decode mode" says why).
PROCESS_MODE_FROM_CPUS = 2
# A decode process before its first item: the interpreter, Pillow and pybase64 (measured RSS, rounded up).
WORKER_PROCESS_BYTES = 32 * MIB


def default_decode_mode(cpus: int) -> str:
    """``thread`` with one usable CPU, where one worker's GIL holds cost the loop little and a process is not
    worth its memory and copies; ``process`` from PROCESS_MODE_FROM_CPUS on, where the threads' holds add up
    and the event loop queues behind them (README, Tuning: the measurements behind the threshold)."""
    return "process" if cpus >= PROCESS_MODE_FROM_CPUS else "thread"


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


# --- parsers: each takes the raw string and returns the value or raises ValueError("what is allowed") ---


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise ValueError(f"an integer {'>= ' + str(lo) if hi is None else f'from {lo} to {hi}'}")
        return value

    return parse


def _seconds(allow_zero: bool) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not (value > 0 or (allow_zero and value == 0)) or value == float("inf"):
            raise ValueError("a number of seconds " + (">= 0 (0 = off)" if allow_zero else "> 0"))
        return value

    return parse


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError("one of " + ", ".join(allowed))
        return value

    return parse


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("on or off")


def _upstream(raw: str) -> str:
    parts = urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError("an http(s) base URL such as http://127.0.0.1:8000")
    return raw.strip().rstrip("/")


def _path(raw: str) -> str:
    if not raw.startswith("/"):
        raise ValueError("a path starting with /")
    return raw


def _prefixes(raw: str) -> tuple[str, ...]:
    items = tuple(p.strip() for p in raw.split(",") if p.strip())
    if any(not p.startswith("/") for p in items):
        raise ValueError("comma-separated path prefixes, each starting with /")
    return items


# Priority bands (MMGATE_PRIORITY_HEADER): a value outside is clamped to the nearest end.
PRIORITY_MIN, PRIORITY_MAX = -8, 8
AUTO_CONCURRENCY = 0  # max_mm_concurrency when MMGATE_MAX_MM_CONCURRENCY=auto
AUTO_PROCESSES = 0  # processes when MMGATE_PROCESSES=auto, until from_env resolves it
MAX_PROCESSES = 64


def _processes(raw: str) -> int:
    if raw.strip().lower() == "auto":
        return AUTO_PROCESSES
    try:
        return _int(1, MAX_PROCESSES)(raw)
    except ValueError:
        raise ValueError(f"an integer from 1 to {MAX_PROCESSES}, or auto") from None


def auto_processes(cpus: int, decode_workers: int) -> int:
    """``MMGATE_PROCESSES=auto``: one front process per usable CPU (one event loop uses at most one CPU, and
    more loops than CPUs only add memory and context switches), at most one per decode worker (each front
    decodes with its share of ``MMGATE_DECODE_WORKERS``, at least one)."""
    return max(1, min(cpus, decode_workers))


def _concurrency(raw: str) -> int:
    if raw.strip().lower() == "auto":
        return AUTO_CONCURRENCY
    try:
        return _int(1, 100_000)(raw)
    except ValueError:
        raise ValueError("an integer from 1 to 100000, or auto") from None


AUTO_JPEG_QUALITY = 0  # jpeg_quality when MMGATE_JPEG_QUALITY=auto (preprocessors/image.py resolves it)


def _jpeg_quality(raw: str) -> int:
    if raw.strip().lower() == "auto":
        return AUTO_JPEG_QUALITY
    try:
        return _int(1, 100)(raw)
    except ValueError:
        raise ValueError("an integer from 1 to 100, or auto") from None


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 section 5.1: a field name is a token


def _header_name(raw: str) -> str:
    value = raw.strip().lower()
    if not _TOKEN.fullmatch(value):
        raise ValueError("an HTTP header name (RFC 9110 section 5.1)")
    return value


def _text(raw: str) -> str:
    return raw


_HOST_NAME = re.compile(r"[a-z0-9_][a-z0-9_.-]{0,252}")


def _host_patterns(raw: str) -> tuple[str, ...]:
    items = tuple(p.strip().lower() for p in raw.split(",") if p.strip())
    for item in items:
        name = item[2:] if item.startswith("*.") else item
        try:
            ipaddress.ip_address(name.strip("[]"))
            continue
        except ValueError:
            pass
        try:
            ascii_name = name.encode("idna").decode("ascii")
        except UnicodeError:
            ascii_name = ""
        if not _HOST_NAME.fullmatch(ascii_name):
            raise ValueError("comma-separated host names and *.suffix patterns, e.g. images.example.com,*.cdn.net")
    return items


def _cidrs(raw: str) -> tuple[str, ...]:
    try:
        return tuple(str(ipaddress.ip_network(p.strip(), strict=False)) for p in raw.split(",") if p.strip())
    except ValueError:
        raise ValueError("comma-separated addresses or CIDR networks, e.g. 127.0.0.1/32,10.1.0.0/16") from None


def _model(raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ValueError("a model folder or a model name in the Hugging Face cache")
    return value


@dataclass(frozen=True, slots=True)
class Settings:
    """Effective configuration. Field ``max_queue`` is ``MMGATE_MAX_QUEUE`` and ``--max-queue``."""

    upstream: str = ""
    upstream_health_path: str = "/health"
    host: str = "0.0.0.0"
    port: int = 8080
    processes: int = 1
    admin_port: int = 0
    max_mm_concurrency: int = 4
    max_queue: int = 64
    queue_timeout: float = 30.0
    max_inflight_media_mb: int = 1024
    max_inflight_image_tokens: int = 0
    fairness_header: str = "x-gateway-inference-fairness-id"
    priority_header: str = "x-mmgate-priority"
    max_queue_per_flow: int = 0
    min_mm_concurrency: int = 1
    max_mm_concurrency_auto: int = 64
    backend_metrics: str = "passthrough"
    preprocess_timeout: float = 30.0
    request_timeout: float = 0.0
    body_read_timeout: float = 30.0
    loop_lag_target: float = 0.005
    header_timeout: float = 10.0
    keepalive_timeout: float = 75.0
    max_connections: int = 1024
    upstream_connect_timeout: float = 5.0
    upstream_read_timeout: float = 600.0
    upstream_max_connections: int = 1024
    decode_workers: int = 0  # 0 until resolved: from_env fills in usable_cpus()
    decode_mode: str = ""  # "" until resolved: from_env fills in default_decode_mode()
    worker_max_jobs: int = 1000
    worker_max_rss_mb: int = 1024
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
    validate: str = "full"
    resize_max_pixels: int = 0
    resize_max_side: int = 0
    model: str = ""
    image_format: str = "auto"
    jpeg_quality: int = AUTO_JPEG_QUALITY
    release_at: str = "auto"
    media_urls: str = "forward"
    fetch_allow_hosts: tuple[str, ...] = ()
    fetch_allow_addresses: tuple[str, ...] = ()
    fetch_max_redirects: int = 3
    fetch_timeout: float = 10.0
    fetch_first_byte_timeout: float = 5.0
    fetch_max_connections: int = 64
    cache_mb: int = 256
    allow_paths: tuple[str, ...] = ()
    trim_idle: float = 1.0
    malloc_tuning: bool = True
    drain_grace: float = 5.0
    drain_timeout: float = 30.0
    server_timing: bool = True
    access_log: bool = True
    log_level: str = "info"
    log_format: str = "text"

    # ----- construction -----

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: str) -> Settings:
        """Read ``MMGATE_*`` from ``environ`` (default ``os.environ``); ``overrides`` (raw strings, CLI) win."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        where: dict[str, str] = {}  # setting -> how the user spelt it, so an error names what they typed
        for name, (parse, _help) in _SPEC.items():
            raw = overrides.get(name)
            where[name] = flag_name(name) if raw is not None else env_name(name)
            if raw is None:
                raw = environ.get(env_name(name))
            if raw is None:
                continue
            try:
                values[name] = parse(str(raw))
            except ValueError as exc:
                raise ConfigError(f"{where[name]}={raw!r} is not allowed: expected {exc}") from None
        if "decode_workers" not in values:
            values["decode_workers"] = usable_cpus()
        elif values["decode_workers"] == 0:
            raise ConfigError(
                f"{where['decode_workers']}='0' is not allowed: expected an integer from 1 to 256 "
                "(0 = decode on the event loop exists only as a benchmark baseline)"
            )
        if values.get("max_inflight_image_tokens") and not values.get("model"):
            raise ConfigError(f"{where['max_inflight_image_tokens']} needs MMGATE_MODEL: image tokens are counted "
                              "with the served model's processor")
        if (values.get("max_mm_concurrency") == AUTO_CONCURRENCY
                and values.get("min_mm_concurrency", 1) > values.get("max_mm_concurrency_auto", 64)):
            raise ConfigError(f"{where['min_mm_concurrency']} is above {where['max_mm_concurrency_auto']}: "
                              "the adaptive limit needs a range")
        if "decode_mode" not in values:
            values["decode_mode"] = default_decode_mode(usable_cpus())
        if values.get("processes") == AUTO_PROCESSES:
            values["processes"] = auto_processes(usable_cpus(), values["decode_workers"])
        elif values.get("processes", 1) > values["decode_workers"]:
            raise ConfigError(f"{where['processes']}={values['processes']} is above MMGATE_DECODE_WORKERS="
                              f"{values['decode_workers']}: each front process decodes with its share of the decode "
                              "workers, at least one; raise MMGATE_DECODE_WORKERS or lower the processes")
        return cls(**values)

    # ----- derived values -----

    @property
    def adaptive_concurrency(self) -> bool:
        """MMGATE_MAX_MM_CONCURRENCY=auto: the limit moves between MIN_MM_CONCURRENCY and MAX_MM_CONCURRENCY_AUTO."""
        return self.max_mm_concurrency == AUTO_CONCURRENCY

    @property
    def mm_concurrency_ceiling(self) -> int:
        """The most media requests past admission: the fixed limit, or the adaptive limit's top."""
        return self.max_mm_concurrency_auto if self.adaptive_concurrency else self.max_mm_concurrency

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_mb * MIB

    @property
    def max_json_structure_bytes(self) -> int:
        return self.max_json_structure_kb * 1024

    @property
    def max_media_item_bytes(self) -> int:
        return self.max_media_item_mb * MIB

    @property
    def max_inflight_media_bytes(self) -> int:
        return self.max_inflight_media_mb * MIB

    @property
    def cache_bytes(self) -> int:
        return self.cache_mb * MIB

    def worst_case_memory_bytes(self) -> dict[str, int]:
        """Upper bound of request payload memory the limits allow (README "Tuning").

        queued:      every waiting request holds its raw body    = MAX_QUEUE × MAX_BODY_MB
        admitted:    requests past the gate hold body + output   = MAX_MM_CONCURRENCY × 2 × MAX_BODY_MB
        decoding:    decode workers each hold one decoded image  = DECODE_WORKERS × MAX_IMAGE_PIXELS × 4 B
        processes:   process mode only: each worker process, its  = DECODE_WORKERS × (WORKER_PROCESS_BYTES
                     interpreter, and the payload twice: in the      + 2 × MAX_MEDIA_ITEM_MB × 4/3)
                     memfd and as the worker's decoded copy
        connections: each open connection, its read buffer and   = (MAX_CONNECTIONS + PROBE_RESERVE × PROCESSES)
                     a head (aiohttp's, outside the bodies); a few     × CONNECTION_BYTES
                     more over the cap for probes
        fetched:     with MEDIA_URLS=fetch, fetched bodies and     = 7/3 × MAX_MM_CONCURRENCY × MAX_MEDIA_PER_REQUEST
                     their base64 in the spliced body; each URL      × MAX_MEDIA_ITEM_MB (at most 7/3 × the
                     is charged the per-item cap at admission        byte budget when MAX_INFLIGHT_MEDIA_MB is set)
        cache:       processed media kept for reuse             = CACHE_MB

        Bodies still arriving are inside the first two terms: a big body whose head names media holds a
        place in line while it is read, and finds none when slots and queue are taken (429, rest unread).
        Outside the bound: bodies under 64 KiB (``body.HEAD_BYTES``) and media hidden behind more than
        64 KiB of other JSON, which are read before admission decides.
        """
        queued = self.max_queue * self.max_body_bytes
        admitted = self.mm_concurrency_ceiling * 2 * self.max_body_bytes
        decoding = self.decode_workers * self.max_image_pixels * 4
        processes = 0
        if self.decode_mode == "process":
            processes = self.decode_workers * (WORKER_PROCESS_BYTES + 2 * self.max_media_item_bytes * 4 // 3)
        connections = (self.max_connections + PROBE_RESERVE * self.processes) * CONNECTION_BYTES
        fetched = 0
        if self.media_urls == "fetch":
            charged = self.mm_concurrency_ceiling * self.max_media_per_request * self.max_media_item_bytes
            if self.max_inflight_media_bytes:
                charged = min(charged, self.max_inflight_media_bytes)
            fetched = charged * 7 // 3
        cache = self.cache_bytes
        return {"queued": queued, "admitted": admitted, "decoding": decoding, "processes": processes,
                "connections": connections, "fetched": fetched, "cache": cache,
                "total": queued + admitted + decoding + processes + connections + fetched + cache}

    def for_front(self, index: int) -> Settings:
        """What front process ``index`` of ``processes`` runs with: its share of the decode workers, the cache
        and the client connections, so that the totals, and the worst case above, stay those configured."""
        def share(total: int) -> int:
            return total // self.processes + (1 if index < total % self.processes else 0)

        return replace(self, decode_workers=share(self.decode_workers), cache_mb=share(self.cache_mb),
                       max_connections=max(1, share(self.max_connections)))

    def describe(self) -> str:
        """``--print-config``: every effective setting as ``MMGATE_X=value`` and the worst-case memory."""
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = ",".join(value)
            elif ((f.name == "max_mm_concurrency" and value == AUTO_CONCURRENCY)
                  or (f.name == "jpeg_quality" and value == AUTO_JPEG_QUALITY)):
                value = "auto"
            elif isinstance(value, bool):
                value = "on" if value else "off"
            lines.append(f"MMGATE_{f.name.upper()}={value}")
        memory = self.worst_case_memory_bytes()
        mib = {k: v / MIB for k, v in memory.items()}
        lines.append(
            f"# worst-case payload memory: {mib['total']:.0f} MiB = queued {mib['queued']:.0f} MiB"
            f" + admitted {mib['admitted']:.0f} MiB + decoding {mib['decoding']:.0f} MiB"
            + (f" + worker processes {mib['processes']:.0f} MiB" if memory["processes"] else "")
            + f" + connections {mib['connections']:.0f} MiB + cache {mib['cache']:.0f} MiB"
            + (f" + fetched {mib['fetched']:.0f} MiB" if memory["fetched"] else "")
        )
        return "\n".join(lines)


# name -> (parser, help). The order is the order of `mmgate --help` and `--print-config`.
_SPEC: dict[str, tuple[Callable[[str], Any], str]] = {
    "upstream": (_upstream, "backend base URL, e.g. http://127.0.0.1:8000 (required)"),
    "upstream_health_path": (_path, "path /mmgate/ready probes on the upstream [/health]"),
    "host": (_text, "listen address [0.0.0.0]"),
    "port": (_int(0, 65535), "listen port [8080]"),
    "processes": (_processes, "front processes accepting on the one port, sharing one gate, the decode workers "
                              "and the cache; auto = usable CPUs, at most MMGATE_DECODE_WORKERS [1]"),
    "admin_port": (_int(0, 65535), "serve /mmgate/* only on this port (0 = same port) [0]"),
    "max_mm_concurrency": (_concurrency, "media requests past admission at once, or auto: found from the "
                                         "backend's latency [4]"),
    "max_queue": (_int(0, 1_000_000), "media requests allowed to wait; beyond -> 429 queue_full [64]"),
    "queue_timeout": (_seconds(False), "seconds a media request may wait -> 429 queue_timeout [30]"),
    "max_inflight_media_mb": (_int(0), "decoded inline media MiB past admission (0 = off) [1024]"),
    "max_inflight_image_tokens": (_int(0), "image tokens past admission, needs MMGATE_MODEL (0 = off) [0]"),
    "fairness_header": (_header_name, "header naming a media request's flow; flows wait in turn "
                                      "[x-gateway-inference-fairness-id]"),
    "priority_header": (_header_name, f"integer header: a media request's priority band, clamped to "
                                      f"{PRIORITY_MIN}..{PRIORITY_MAX}; higher bands first [x-mmgate-priority]"),
    "max_queue_per_flow": (_int(0, 1_000_000), "places in line one flow may hold; beyond -> 429 queue_full "
                                               "(0 = only MMGATE_MAX_QUEUE) [0]"),
    "min_mm_concurrency": (_int(1, 100_000), "with MAX_MM_CONCURRENCY=auto: the lowest limit [1]"),
    "max_mm_concurrency_auto": (_int(1, 100_000), "with MAX_MM_CONCURRENCY=auto: the highest limit [64]"),
    "backend_metrics": (_choice("passthrough", "merge"), "GET /metrics: the backend's as is, or with mmgate's "
                                                         "waiting media requests in its queue gauges [passthrough]"),
    "preprocess_timeout": (_seconds(False), "seconds for one request's media work -> 504 [30]"),
    "request_timeout": (_seconds(True), "end-to-end deadline in seconds (0 = off) [0]"),
    "body_read_timeout": (_seconds(False), "seconds for the whole request body -> 408 [30]"),
    "loop_lag_target": (_seconds(True), "event-loop lag in seconds over which the reading of big uploads is "
                                        "held back, so small requests and probes keep their turn (0 = off) "
                                        "[0.005]"),
    "header_timeout": (_seconds(False), "seconds for the request line and headers -> 408, connection closed [10]"),
    "keepalive_timeout": (_seconds(False), "seconds an idle client connection is kept open [75]"),
    "max_connections": (_int(1, 1_000_000), "open client connections; beyond -> 503 too_many_connections [1024]"),
    "upstream_connect_timeout": (_seconds(False), "upstream connect timeout -> 502 [5]"),
    "upstream_read_timeout": (_seconds(False), "longest upstream silence -> 504 [600]"),
    "upstream_max_connections": (_int(1, 1_000_000), "upstream connection pool size [1024]"),
    "decode_workers": (_int(0, 256), "decode workers (threads or processes) [usable CPUs]"),
    "decode_mode": (_choice("thread", "process"),
                    f"decode workers are threads or processes [process from {PROCESS_MODE_FROM_CPUS} usable CPUs, "
                    "else thread]"),
    "worker_max_jobs": (_int(0), "process mode: a worker is replaced after this many items (0 = never) [1000]"),
    "worker_max_rss_mb": (_int(0), "process mode: a worker above this resident MiB after an item is replaced "
                                   "(0 = never) [1024]"),
    "max_body_mb": (_int(1, 4096), "request body limit in MiB -> 413 body_too_large [64]"),
    "max_media_per_request": (_int(1, 10_000), "media parts per request -> 400 too_many_media [16]"),
    "max_json_depth": (_int(8, 10_000), "nesting of the JSON mmgate walks -> 400 json_too_deep [64]"),
    "max_json_structure_kb": (_int(16, 1_048_576), "KiB of a media body's JSON outside its long strings, parsed on "
                                                   "the event loop in one call -> 400 json_too_complex [512]"),
    "max_media_item_mb": (_int(1, 4096), "one decoded media item in MiB -> 413 media_too_large [32]"),
    "max_image_pixels": (_int(1), "decompression-bomb guard, from the header -> 400 image_too_large [64000000]"),
    "max_frames": (_int(1, 100_000), "frames of an animated image -> 400 too_many_frames [64]"),
    "max_audio_seconds": (_seconds(False), "WAV duration limit -> 400 audio_invalid [600]"),
    "max_video_pixels": (_int(1), "pixels of one video frame, from the container -> 400 video_too_large "
                                  "[8294400]"),
    "max_video_frames": (_int(1, 10_000_000), "frames of a video, from its index or packets -> 400 "
                                              "video_too_large [3600]"),
    "max_video_seconds": (_seconds(False), "duration of a video -> 400 video_too_large [600]"),
    "validate": (_choice("full", "header"), "full = decode every image; header = header only [full]"),
    "resize_max_pixels": (_int(0), "downscale to at most this many pixels (0 = never) [0]"),
    "resize_max_side": (_int(0), "downscale so the longer side fits (0 = never) [0]"),
    "model": (_model, "served model's folder or cached name: its resize and image tokens (needs the model "
                      "extra) [none]"),
    "image_format": (_choice("auto", "jpeg", "png", "webp"), "format of re-encoded images [auto]"),
    "jpeg_quality": (_jpeg_quality, "JPEG/WebP quality of re-encoded images, or auto: 90 (4:2:0 chroma), and "
                                    "with a model 100 with 4:4:4 chroma, its fidelity bound [auto]"),
    "release_at": (_choice("auto", "sent", "headers", "complete"), "when the gate lease ends [auto]"),
    "media_urls": (_choice("forward", "reject", "fetch"),
                   "media URLs: forward (the backend fetches), reject (400), fetch (mmgate fetches, checks, "
                   "inlines) [forward]"),
    "fetch_allow_hosts": (_host_patterns, "with fetch: hosts and *.suffix patterns fetched from [any public host]"),
    "fetch_allow_addresses": (_cidrs, "with fetch: CIDRs allowed although private/loopback/... [none]"),
    "fetch_max_redirects": (_int(0, 20), "with fetch: redirects followed, each checked again [3]"),
    "fetch_timeout": (_seconds(False), "with fetch: seconds for one fetch, redirects included -> 400 [10]"),
    "fetch_first_byte_timeout": (_seconds(False), "with fetch: seconds to a response head -> 400 [5]"),
    "fetch_max_connections": (_int(1, 100_000), "with fetch: connections of the fetch client [64]"),
    "cache_mb": (_int(0, 1 << 20), "processed-media cache in MiB: a media item seen before is not decoded again "
                                   "(0 = off) [256]"),
    "allow_paths": (_prefixes, "comma-separated path prefixes forwarded; others -> 404 [all]"),
    "trim_idle": (_seconds(True), "return freed heap to the OS after this many idle seconds (0 = off) [1]"),
    "malloc_tuning": (_bool, "big buffers back to the OS when freed, no Pillow block cache (see README) [on]"),
    "drain_grace": (_seconds(True), "seconds to keep serving after SIGTERM while not ready [5]"),
    "drain_timeout": (_seconds(True), "seconds to wait for in-flight requests when draining [30]"),
    "server_timing": (_bool, "add the Server-Timing header [on]"),
    "access_log": (_bool, "log one line per request [on]"),
    "log_level": (_choice("debug", "info", "warning", "error"), "log level [info]"),
    "log_format": (_choice("text", "json"), "text or json (one object per line) [text]"),
}


# ``MMGATE_*`` variables the project reads outside Settings (tests, benchmarks, the real-vLLM suite). They are
# not settings of the proxy, but they are not typos either: the unknown-variable warning leaves them alone.
# Add a name here when a test or benchmark starts reading a new one (tests/test_cli.py checks the repository).
TOOLING_VARIABLES: frozenset[str] = frozenset({
    "MMGATE_E2E",  # tests/e2e: run the real-vLLM suite
    "MMGATE_E2E_DIR",
    "MMGATE_E2E_PYTHON",
    "MMGATE_E2E_SETUP_TIMEOUT",
    "MMGATE_E2E_VLLM_START_TIMEOUT",
    "MMGATE_E2E_VLLM_URL",
    "MMGATE_FUZZ_SAVE",  # testkit/fuzzing.py: save a failing example to the corpus
    "MMGATE_FUZZ_SEED",  # testkit/fuzzing.py: the hypothesis seed
    "MMGATE_REQUIRE_HEAVY",  # CI: a skipped heavy test fails instead
    "MMGATE_UPDATE_SCREENSHOT",  # tests/test_dashboard.py: rewrite docs/dashboard.png
})


def env_name(name: str) -> str:
    """``max_queue`` -> ``MMGATE_MAX_QUEUE``."""
    return "MMGATE_" + name.upper()


def flag_name(name: str) -> str:
    """``max_queue`` -> ``--max-queue``."""
    return "--" + name.replace("_", "-")


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning per ``MMGATE_*`` variable that is no setting, with the closest name when there is one.

    A misspelt variable would otherwise be ignored without a word, and the default it meant to change would
    silently stay in force. Only a warning: an unknown name must not stop a rollout.
    """
    known = [name.upper() for name in _SPEC]
    warnings = []
    for variable in sorted(environ):
        if not variable.startswith("MMGATE_") or variable[7:] in known or variable in TOOLING_VARIABLES:
            continue
        # Compared without the prefix every name shares, which would make any two names look alike.
        close = difflib.get_close_matches(variable[7:], known, n=1)
        warnings.append(f"unknown variable {variable}" + (f" (did you mean MMGATE_{close[0]}?)" if close else ""))
    return warnings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--kebab-name`` flag per setting; values stay raw strings so one parser validates both sources."""
    for name, (_parse, help_text) in _SPEC.items():
        parser.add_argument(flag_name(name), dest=name, default=None, metavar="V", help=help_text)


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    return {name: value for name in _SPEC if (value := getattr(args, name, None)) is not None}
