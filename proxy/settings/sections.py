"""The frozen sections the one ``Settings`` is made of (``frozen``), one per concern, and every setting in them.

A field is named as its variable without the prefix: ``settings.limits.max_body_mb`` is ``MMGATE_MAX_BODY_MB``
and ``--max-body-mb``. Each field is the one declaration of its setting (``declare.setting``): type, default,
parser, help text, what ``0`` and ``auto`` mean, and what it changes of the media (``policy=PolicyField(...)``:
a field of the policy the decode workers receive; ``shapes_verdict``); reading, ``--help``, ``--print-config``,
docs/configuration.md, the workers' policies and the cache's key are made from it. ``SECTIONS`` lists the
sections in the order ``Settings`` holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import aiohttp

from proxy.settings.cpus import (
    MIN_DEFAULT_MM_CONCURRENCY,
    PROCESS_MODE_FROM_CPUS,
    DecodeMode,
    usable_cpus,
    usable_decode_mode,
    usable_mm_concurrency,
)
from proxy.settings.declare import AUTO, Auto, PolicyField, setting
from proxy.settings.parsers import (
    MAX_PROCESSES,
    Choice,
    base_url,
    cidrs,
    folders,
    header_name,
    header_names,
    host_patterns,
    integer,
    json_object,
    model_name,
    on_off,
    path,
    path_prefixes,
    peer_cidrs,
    seconds,
    text,
)

MIB = 1 << 20
# What one open client connection may hold outside any body: aiohttp's read buffer (256 KiB) and a
# request head (up to 64 KiB of header fields).
CONNECTION_BYTES = (256 + 64) << 10
# Connections allowed beyond MMGATE_MAX_CONNECTIONS at once, read for a liveness or readiness probe.
PROBE_RESERVE = 8
# A decode process before its first item: the interpreter, Pillow and pybase64 (measured RSS, rounded up).
WORKER_PROCESS_BYTES = 32 * MIB
# Priority bands (MMGATE_PRIORITY_HEADER): a value outside is clamped to the nearest end.
PRIORITY_MIN, PRIORITY_MAX = -8, 8

BackendMetrics = Literal["passthrough", "merge", "merge-admin"]
Validate = Literal["full", "header"]
ImageFormat = Literal["auto", "jpeg", "png", "webp", "bmp"]
ReleaseAt = Literal["auto", "sent", "headers", "complete"]
MediaUrls = Literal["forward", "reject", "fetch"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]
EventLoop = Literal["auto", "asyncio", "uvloop"]


@dataclass(frozen=True, slots=True)
class Backend:
    """The inference server behind mmgate and what is forwarded to it."""

    upstream: str = setting("", parse=base_url, required=True, essential=True,
                            help="backend base URL, e.g. http://127.0.0.1:8000",
                            details="the server's own address, without `/v1`: clients send `/v1/...` paths and "
                                    "mmgate forwards them as they come")
    upstream_health_path: str = setting("/health", parse=path, help="path /mmgate/ready probes on the upstream")
    upstream_max_connections: int = setting(1024, parse=integer(1, 1_000_000), help="upstream connection pool size",
                                            details="a low limit would be a hidden second gate")
    backend_metrics: BackendMetrics = setting(
        "passthrough", parse=Choice(BackendMetrics),
        help="GET /metrics: the backend's as is, or with mmgate's waiting media requests in its queue gauges "
             "(merge-admin: on MMGATE_ADMIN_PORT only)",
        details="with `merge-admin` the proxy port forwards `/metrics` as any other path; the backend's exposition "
                "is scraped at most once a second, concurrent scrapes sharing one fetch (see [fleet](fleet.md))")
    allow_paths: tuple[str, ...] = setting(
        (), parse=path_prefixes, shown="all", help="comma-separated path prefixes forwarded; others -> 404",
        details="matched on segment boundaries after normalisation (see [security](security.md))")


@dataclass(frozen=True, slots=True)
class Listen:
    """Where and how clients connect."""

    host: str = setting("0.0.0.0", parse=text, help="listen address",
                        details="0.0.0.0 is every interface, 127.0.0.1 this machine only")
    port: int = setting(8080, parse=integer(0, 65535), help="listen port")
    processes: int = setting(
        1, parse=integer(1, MAX_PROCESSES), auto="usable CPUs, at most MMGATE_DECODE_WORKERS",
        help="front processes accepting on the one port, sharing one gate, the decode workers and the cache",
        details="they behave as one mmgate: one gate (exact limits, one FIFO), `MMGATE_DECODE_WORKERS`, "
                "`MMGATE_CACHE_MB` and `MMGATE_MAX_CONNECTIONS` split between them, metrics and `/mmgate/stats` "
                "summed (see [tuning](tuning.md))")
    process_timeout: float = setting(
        10.0, parse=seconds(False),
        help="with several processes: seconds a front or the supervisor may leave the other unanswered before "
             "it counts as hung (a front is killed and replaced; requests get 503)",
        details="a front's request to a hung supervisor gets 503 `gate_unavailable`")
    admin_port: int = setting(0, parse=integer(0, 65535), zero="same port", essential=True,
                              help="serve /mmgate/* only on this port")
    max_connections: int = setting(
        1024, parse=integer(1, 1_000_000), help="open client connections; beyond -> 503 too_many_connections",
        details="at the cap the one idle the longest is closed to make room; when all are busy the 503 carries "
                "`Retry-After` and the connection is closed (`/mmgate/health` and `/mmgate/ready` still answer). "
                "At start the soft `RLIMIT_NOFILE` is raised to what the cap needs, up to the hard limit; a hard "
                "limit too low lowers the cap to what fits, with a warning naming both")
    loop_lag_target: float = setting(
        0.005, parse=seconds(True), zero="off",
        help="event-loop lag in seconds over which the reading of big uploads is held back, so small requests "
             "and probes keep their turn",
        details="big uploads are bodies over 64 KiB still arriving; TCP pushes back on the held clients, nothing "
                "is refused (see [architecture](architecture.md))")
    loop: EventLoop = setting(
        "auto", parse=Choice(EventLoop),
        help="the event loop: auto = uvloop when installed (pip install 'mmgate[uvloop]'), else asyncio's own",
        details="the start-up line names the loop in use; uvloop costs less CPU per request (see "
                "[benchmarks](benchmarks.md), passthrough)")


@dataclass(frozen=True, slots=True)
class GateSettings:
    """Admission of media requests: the concurrency limit, the queue and its order, the budgets."""

    max_mm_concurrency: int | Auto = setting(
        default_factory=usable_mm_concurrency, parse=integer(1, 100_000), essential=True,
        shown=f"MMGATE_DECODE_WORKERS, at least {MIN_DEFAULT_MM_CONCURRENCY}",
        auto="found from the backend's completions per second and latency",
        help="media requests past admission at once", details="see [fleet](fleet.md) for `auto`")
    max_queue: int = setting(64, parse=integer(0, 1_000_000), essential=True,
                             help="media requests allowed to wait; beyond -> 429 queue_full")
    max_inflight_media_mb: int = setting(1024, parse=integer(0), zero="off",
                                         help="decoded inline media MiB past admission, and the base64 forwarded "
                                              "in place of each rewritten image",
                                         details="a request's cost is known before anything is decoded: from its "
                                                 "base64 lengths and image headers, a cached rewrite from its "
                                                 "verdict")
    max_inflight_image_tokens: int = setting(
        0, parse=integer(0), zero="off", help="image tokens past admission, needs MMGATE_MODEL",
        details="counted for the served model; one request over it alone -> 413 `too_many_image_tokens`")
    fairness_header: tuple[str, ...] = setting(
        ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"), parse=header_names,
        help="comma-separated headers naming a media request's flow, the first present wins; flows wait in turn",
        details="read only from `MMGATE_TRUST_FLOW_HEADERS_FROM`")
    priority_header: str = setting(
        "x-mmgate-priority", parse=header_name,
        help=f"integer header: a media request's priority band, clamped to {PRIORITY_MIN}..{PRIORITY_MAX}; "
             "higher bands first",
        details="a request without it is in band 0; not an integer -> 400 `invalid_priority_header`; read only "
                "from `MMGATE_TRUST_FLOW_HEADERS_FROM`")
    trust_flow_headers_from: tuple[str, ...] = setting(
        (), parse=peer_cidrs, shown="none",
        help="CIDRs of the TCP peers (the gateway in front) whose fairness and priority headers are read; from "
             "others they are ignored and a client's address is its flow", details="see [fleet](fleet.md)")
    max_queue_per_flow: int = setting(0, parse=integer(0, 1_000_000), zero="only MMGATE_MAX_QUEUE",
                                      help="places in line one flow may hold; beyond -> 429 queue_full")
    min_mm_concurrency: int = setting(1, parse=integer(1, 100_000),
                                      help="with MAX_MM_CONCURRENCY=auto: the lowest limit")
    max_mm_concurrency_auto: int = setting(64, parse=integer(1, 100_000),
                                           help="with MAX_MM_CONCURRENCY=auto: the highest limit")
    release_at: ReleaseAt = setting(
        "auto", parse=Choice(ReleaseAt), help="when the gate lease ends",
        details="`auto`: at the headers when streaming, else once the body is sent; with "
                "`MMGATE_MAX_MM_CONCURRENCY=auto`, `auto` means `complete`, and `sent` or `headers` are refused")

    @property
    def adaptive_concurrency(self) -> bool:
        """MMGATE_MAX_MM_CONCURRENCY=auto: the limit moves between MIN_MM_CONCURRENCY and MAX_MM_CONCURRENCY_AUTO."""
        return self.max_mm_concurrency is AUTO

    @property
    def mm_concurrency_ceiling(self) -> int:
        """The most media requests past admission: the fixed limit, or the adaptive limit's top."""
        return self.max_mm_concurrency_auto if self.max_mm_concurrency is AUTO else self.max_mm_concurrency

    @property
    def max_inflight_media_bytes(self) -> int:
        return self.max_inflight_media_mb * MIB


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines in seconds, one per phase of a request (0 = off where allowed)."""

    header_timeout: float = setting(
        10.0, parse=seconds(False), help="seconds for the request line and headers -> 408, connection closed",
        details="counted from the connection opening, or from the first byte after a keep-alive pause")
    keepalive_timeout: float = setting(75.0, parse=seconds(False),
                                       help="seconds an idle client connection is kept open")
    body_read_timeout: float = setting(30.0, parse=seconds(False), help="seconds for the whole request body -> 408")
    queue_timeout: float = setting(30.0, parse=seconds(False), essential=True,
                                   help="seconds a media request may wait -> 429 queue_timeout")
    preprocess_timeout: float = setting(30.0, parse=seconds(False),
                                        help="seconds for one request's media work -> 504",
                                        details="the answer's message names this deadline")
    request_timeout: float = setting(0.0, parse=seconds(True), zero="off", help="end-to-end deadline in seconds",
                                     details="a request's `X-MMGate-Timeout: <s>` may lower it, never raise it")
    upstream_connect_timeout: float = setting(5.0, parse=seconds(False), help="upstream connect timeout -> 502")
    upstream_read_timeout: float = setting(600.0, parse=seconds(False), help="longest upstream silence -> 504",
                                           details="a stream already begun ends instead")
    client_write_timeout: float = setting(
        30.0, parse=seconds(True), zero="off",
        help="a client that reads nothing of the answer for this long loses its connection (like nginx "
             "send_timeout)",
        details="never longer than `MMGATE_UPSTREAM_READ_TIMEOUT`, which keeps running while mmgate waits on "
                "the client; the cut is logged with code `client_write_timeout`")
    upstream_client: aiohttp.ClientTimeout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once here: every forward uses it. No total: a stream may run as long as it keeps sending.
        object.__setattr__(self, "upstream_client", aiohttp.ClientTimeout(
            total=None, sock_connect=self.upstream_connect_timeout, sock_read=self.upstream_read_timeout))


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request and one media item may be."""

    max_body_mb: int = setting(64, parse=integer(1, 4096), essential=True,
                               help="request body limit in MiB, as received and as forwarded -> 413 body_too_large",
                               details="a body that the images mmgate resizes and re-encodes would take past it is "
                                       "refused from their headers, before any decode")
    max_media_per_request: int = setting(16, parse=integer(1, 10_000),
                                         help="media parts per request -> 400 too_many_media",
                                         details="inline and URL parts alike")
    max_json_depth: int = setting(64, parse=integer(8, 10_000),
                                  help="nesting of the JSON mmgate walks -> 400 json_too_deep",
                                  details="e.g. `/generate` batches, Anthropic `tool_result`")
    max_json_structure_kb: int = setting(
        512, parse=integer(16, 1_048_576),
        help="KiB of a media body's JSON outside its long strings, parsed on the event loop in one call -> 400 "
             "json_too_complex",
        details="keys, numbers, short strings, brackets, and at most one object or array per 8 bytes of it. A "
                "chat of thousands of messages fits; a body of tens of thousands of tiny parts does not. Raising "
                "it lets one request hold the loop longer")
    max_media_item_mb: int = setting(32, parse=integer(1, 4096), shapes_verdict=True,
                                     help="one decoded media item in MiB -> 413 media_too_large")
    max_image_pixels: int = setting(64_000_000, parse=integer(1), policy=PolicyField("image", "max_pixels"),
                                    help="decompression-bomb guard, from the header -> 400 image_too_large")
    max_frames: int = setting(64, parse=integer(1, 100_000), policy=PolicyField("image"),
                              help="frames of an animated image -> 400 too_many_frames")
    max_audio_seconds: float = setting(600.0, parse=seconds(False), policy=PolicyField("audio", "max_seconds"),
                                       help="WAV duration limit -> 400 audio_invalid")
    max_video_pixels: int = setting(8_294_400, parse=integer(1), policy=PolicyField("video", "max_pixels"),
                                    help="pixels of one video frame, from the container -> 400 video_too_large",
                                    details="the default is 3840×2160")
    max_video_frames: int = setting(3600, parse=integer(1, 10_000_000), policy=PolicyField("video", "max_frames"),
                                    help="frames of a video, from its index or packets -> 400 video_too_large")
    max_video_seconds: float = setting(600.0, parse=seconds(False), policy=PolicyField("video", "max_seconds"),
                                       help="duration of a video -> 400 video_too_large")

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

    decode_workers: int = setting(default_factory=usable_cpus, parse=integer(0, 256), shown="usable CPUs",
                                  help="decode workers (threads or processes)",
                                  details="usable CPUs: the affinity mask and the cgroup quota, not "
                                          "`os.cpu_count()`")
    decode_mode: DecodeMode = setting(default_factory=usable_decode_mode, parse=Choice(DecodeMode),
                                      shown=f"process from {PROCESS_MODE_FROM_CPUS} usable CPUs, else thread",
                                      help="decode workers are threads or processes",
                                      details="threads of mmgate, or processes of their own (see "
                                              "[tuning](tuning.md))")
    worker_max_jobs: int = setting(1000, parse=integer(0), zero="never",
                                   help="process mode: a worker is replaced after this many items")
    worker_max_rss_mb: int = setting(1024, parse=integer(0), zero="never",
                                     help="process mode: a worker whose peak resident MiB went above this is "
                                          "replaced after its item")
    # A policy made by hand (a benchmark, the warm-up, a library user) decodes every image: the header-only
    # judgement is what a server in front of a decoding backend can afford, not what a preprocessor alone should.
    validate: Validate = setting(
        "header", parse=Choice(Validate), policy=PolicyField("image", default="full"),
        help="header = format, size and frames from the header (the backend decodes the image anyway); full = "
             "also decode every image",
        details="`header` judges each image from the head of its base64 and keeps every bound, and refuses a "
                "truncated file from its last bytes (`image_truncated`); a file corrupt in its middle is left to "
                "the backend. `full` catches that at the cost of a second decode (see [tuning](tuning.md))")
    resize_max_pixels: int = setting(0, parse=integer(0), zero="never", policy=PolicyField("image"),
                                     help="downscale to at most this many pixels", details="the aspect is kept")
    resize_max_side: int = setting(0, parse=integer(0), zero="never", policy=PolicyField("image"),
                                   help="downscale so the longer side fits", details="the aspect is kept")
    model: str = setting("auto", parse=model_name, shapes_verdict=True,
                         help="served model: its resize and image tokens; auto = ask the upstream which it serves, "
                              "none = off, or the model's folder or cached name",
                         details="auto looks for the upstream's model in the Hugging Face cache and MMGATE_MODEL_DIRS, "
                                 "never downloading, and keeps the generic rule while none is found; a folder or "
                                 "name given here stops start-up when missing (see [model](model.md))")
    model_dirs: tuple[str, ...] = setting(
        (), parse=folders, shown="none",
        help="with MMGATE_MODEL=auto: folders the server's model may lie in (where `vllm serve /models/x` loads it)",
        details="a path the upstream names is read only inside these or the Hugging Face cache, symlinks resolved")
    mm_processor_kwargs: str = setting(
        "", parse=json_object, shown="none", shapes_verdict=True,
        help="the server's --mm-processor-kwargs as JSON (e.g. {\"max_pixels\": 1003520}), written onto the "
             "model's image processor configuration",
        details="so that mmgate and the server agree on the geometry (see [model](model.md))")
    image_format: ImageFormat = setting(
        "auto", parse=Choice(ImageFormat), policy=PolicyField("image", "output_format"),
        help="format of re-encoded images; auto = BMP with a model (lossless, cheapest for the backend), else "
             "JPEG; PNG where alpha must survive")
    jpeg_quality: int | Auto = setting(
        AUTO, parse=integer(1, 100), policy=PolicyField("image"),
        auto="90 (4:2:0 chroma), and with a model 100 with 4:4:4 chroma, its fidelity bound",
        help="JPEG/WebP quality of re-encoded images", details="see [tuning](tuning.md)")


@dataclass(frozen=True, slots=True)
class Fetch:
    """Media URLs: left to the backend, refused, or fetched by mmgate within these bounds."""

    media_urls: MediaUrls = setting(
        "forward", parse=Choice(MediaUrls),
        help="media URLs: forward (the backend fetches), reject (400), fetch (mmgate fetches, checks, inlines)",
        details="mmgate fetches image and audio URLs within its limits")
    fetch_allow_hosts: tuple[str, ...] = setting(
        (), parse=host_patterns, shown="any public host",
        help="with fetch: hosts and *.suffix patterns fetched from", details="others -> 400 `fetch_host_not_allowed`")
    fetch_allow_addresses: tuple[str, ...] = setting(
        (), parse=cidrs, shown="none", help="with fetch: CIDRs allowed although private/loopback/...",
        details="others of these kinds -> 400 `fetch_address_forbidden`")
    fetch_max_redirects: int = setting(3, parse=integer(0, 20),
                                       help="with fetch: redirects followed, each checked again",
                                       details="more -> 400 `fetch_too_many_redirects`")
    fetch_timeout: float = setting(10.0, parse=seconds(False),
                                   help="with fetch: seconds for one fetch, redirects included -> 400",
                                   details="the code is `fetch_timeout`")
    fetch_first_byte_timeout: float = setting(5.0, parse=seconds(False),
                                              help="with fetch: seconds to a response head -> 400",
                                              details="the code is `fetch_timeout`")
    fetch_max_connections: int = setting(64, parse=integer(1, 100_000),
                                         help="with fetch: connections of the fetch client",
                                         details="a pool apart from the upstream's")


@dataclass(frozen=True, slots=True)
class Memory:
    """The processed-media cache and how freed memory goes back to the OS."""

    cache_mb: int = setting(256, parse=integer(0, 1 << 20), zero="off", essential=True,
                            help="processed-media cache in MiB: a media item seen before is not decoded again",
                            details="seen before: the same bytes, with the same settings (see [tuning](tuning.md))")
    trim_idle: float = setting(1.0, parse=seconds(True), zero="off",
                               help="return freed heap to the OS after this many idle seconds",
                               details="`malloc_trim`, once no media work has run for that long")
    malloc_tuning: bool = setting(True, parse=on_off,
                                  help="big buffers back to the OS when freed, no Pillow block cache (see "
                                       "docs/tuning.md)",
                                  details="glibc's mmap and trim thresholds at 1 MiB; Pillow's block cache only 2 "
                                          "blocks per decode thread, emptied by the idle trim")

    @property
    def cache_bytes(self) -> int:
        return self.cache_mb * MIB


@dataclass(frozen=True, slots=True)
class Drain:
    """Shutdown on SIGTERM."""

    drain_grace: float = setting(5.0, parse=seconds(True),
                                 help="seconds to keep serving after SIGTERM while not ready")
    drain_timeout: float = setting(30.0, parse=seconds(True),
                                   help="seconds to wait for in-flight requests when draining")


@dataclass(frozen=True, slots=True)
class Logs:
    """What mmgate tells about each request and itself."""

    server_timing: bool = setting(True, parse=on_off, help="add the Server-Timing header")
    access_log: bool = setting(True, parse=on_off, help="log one line per request")
    log_level: LogLevel = setting("info", parse=Choice(LogLevel), help="log level")
    log_format: LogFormat = setting("text", parse=Choice(LogFormat), help="text or json (one object per line)")


# In the order of ``Settings``' fields, each named there as its class in lower case (``spec.section_name``;
# ``GateSettings`` is ``gate``, since ``Gate`` is admission's class): the order of --help, --print-config and
# docs/configuration.md.
SECTIONS: tuple[type, ...] = (Backend, Listen, GateSettings, Timeouts, Limits, Decode, Fetch, Memory, Drain, Logs)
