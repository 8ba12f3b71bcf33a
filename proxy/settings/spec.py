"""Every ``MMGATE_*`` variable: how its raw text is read and checked, its help text, where it lands in ``Settings``.

A bad value raises ``ConfigError`` whose text is the one line the CLI prints before exiting with status 2. The
environment is injectable (``Settings.from_env(environ)``) so tests never touch ``os.environ``. Help texts carry
no defaults: ``help_text`` appends the one the section's dataclass field declares.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Protocol

from proxy.settings.parsers import (
    AUTO_PROCESSES,
    base_url,
    choice,
    cidrs,
    concurrency,
    header_name,
    header_names,
    host_patterns,
    integer,
    jpeg_quality,
    model_name,
    on_off,
    path,
    path_prefixes,
    processes,
    seconds,
    text,
)
from proxy.settings.sections import (
    AUTO_CONCURRENCY,
    AUTO_JPEG_QUALITY,
    MIB,
    PRIORITY_MAX,
    PRIORITY_MIN,
    PROCESS_MODE_FROM_CPUS,
    SECTION_TYPES,
    BackendMetrics,
    DecodeMode,
    EventLoop,
    ImageFormat,
    LogFormat,
    LogLevel,
    MediaUrls,
    ReleaseAt,
    Validate,
    default_decode_mode,
    usable_cpus,
)


class Configured(Protocol):
    """What ``describe`` reads of a ``Settings`` (``frozen``, which builds on this module): its sections by
    name, and the worst-case memory they allow."""

    def worst_case_memory_bytes(self) -> dict[str, int]: ...


class ConfigError(ValueError):
    """A configuration value that mmgate refuses; ``str()`` is one line naming variable, value and rule."""


def auto_processes(cpus: int, decode_workers: int) -> int:
    """``MMGATE_PROCESSES=auto``: one front process per usable CPU (one event loop uses at most one CPU, and
    more loops than CPUs only add memory and context switches), at most one per decode worker (each front
    decodes with its share of ``MMGATE_DECODE_WORKERS``, at least one)."""
    return max(1, min(cpus, decode_workers))


@dataclass(frozen=True, slots=True)
class Spec:
    """One variable: the ``Settings`` section its field is in, its parser, and its help text without the default.

    ``shown`` describes a default that is no plain value (computed at start, or empty meaning "all" or
    "none"); "" shows no default at all."""

    section: str
    parse: Callable[[str], Any]
    help: str
    shown: str | None = None


# Field name -> its spec. The order is the order of `mmgate --help` and `--print-config`.
SPEC: dict[str, Spec] = {
    "upstream": Spec("backend", base_url, "backend base URL, e.g. http://127.0.0.1:8000 (required)", shown=""),
    "upstream_health_path": Spec("backend", path, "path /mmgate/ready probes on the upstream"),
    "host": Spec("listen", text, "listen address"),
    "port": Spec("listen", integer(0, 65535), "listen port"),
    "processes": Spec("listen", processes, "front processes accepting on the one port, sharing one gate, the "
                                            "decode workers and the cache; auto = usable CPUs, at most "
                                            "MMGATE_DECODE_WORKERS"),
    "process_timeout": Spec("listen", seconds(False), "with several processes: seconds a front or the supervisor "
                                                      "may leave the other unanswered before it counts as hung "
                                                      "(a front is killed and replaced; requests get 503)"),
    "admin_port": Spec("listen", integer(0, 65535), "serve /mmgate/* only on this port (0 = same port)"),
    "max_mm_concurrency": Spec("gate", concurrency, "media requests past admission at once, or auto: found from "
                                                     "the backend's latency"),
    "max_queue": Spec("gate", integer(0, 1_000_000), "media requests allowed to wait; beyond -> 429 queue_full"),
    "queue_timeout": Spec("timeouts", seconds(False), "seconds a media request may wait -> 429 queue_timeout"),
    "max_inflight_media_mb": Spec("gate", integer(0), "decoded inline media MiB past admission (0 = off)"),
    "max_inflight_image_tokens": Spec("gate", integer(0), "image tokens past admission, needs MMGATE_MODEL (0 = off)"),
    "fairness_header": Spec("gate", header_names, "comma-separated headers naming a media request's flow, the "
                                                   "first present wins; flows wait in turn"),
    "priority_header": Spec("gate", header_name, f"integer header: a media request's priority band, clamped to "
                                                  f"{PRIORITY_MIN}..{PRIORITY_MAX}; higher bands first"),
    "trust_flow_headers_from": Spec("gate", cidrs, "CIDRs of the TCP peers (the gateway in front) whose fairness "
                                                   "and priority headers are read; from others they are ignored "
                                                   "and a client's address is its flow", shown="none"),
    "max_queue_per_flow": Spec("gate", integer(0, 1_000_000), "places in line one flow may hold; beyond -> 429 "
                                                           "queue_full (0 = only MMGATE_MAX_QUEUE)"),
    "min_mm_concurrency": Spec("gate", integer(1, 100_000), "with MAX_MM_CONCURRENCY=auto: the lowest limit"),
    "max_mm_concurrency_auto": Spec("gate", integer(1, 100_000), "with MAX_MM_CONCURRENCY=auto: the highest limit"),
    "backend_metrics": Spec("backend", choice(BackendMetrics), "GET /metrics: the backend's as is, or with "
                                                                "mmgate's waiting media requests in its queue gauges "
                                                                "(merge-admin: on MMGATE_ADMIN_PORT only)"),
    "preprocess_timeout": Spec("timeouts", seconds(False), "seconds for one request's media work -> 504"),
    "request_timeout": Spec("timeouts", seconds(True), "end-to-end deadline in seconds (0 = off)"),
    "body_read_timeout": Spec("timeouts", seconds(False), "seconds for the whole request body -> 408"),
    "loop_lag_target": Spec("listen", seconds(True), "event-loop lag in seconds over which the reading of big "
                                                      "uploads is held back, so small requests and probes keep "
                                                      "their turn (0 = off)"),
    "header_timeout": Spec("timeouts", seconds(False), "seconds for the request line and headers -> 408, "
                                                        "connection closed"),
    "keepalive_timeout": Spec("timeouts", seconds(False), "seconds an idle client connection is kept open"),
    "loop": Spec("listen", choice(EventLoop), "event loop: auto = uvloop when installed (pip install "
                                              "'mmgate[uvloop]'), else asyncio's own"),
    "max_connections": Spec("listen", integer(1, 1_000_000), "open client connections; beyond -> 503 "
                                                          "too_many_connections"),
    "upstream_connect_timeout": Spec("timeouts", seconds(False), "upstream connect timeout -> 502"),
    "upstream_read_timeout": Spec("timeouts", seconds(False), "longest upstream silence -> 504"),
    "client_write_timeout": Spec("timeouts", seconds(True), "seconds a client may read nothing of its answer "
                                                            "before its connection is closed (0 = off)"),
    "upstream_max_connections": Spec("backend", integer(1, 1_000_000), "upstream connection pool size"),
    "decode_workers": Spec("decode", integer(0, 256), "decode workers (threads or processes)", shown="usable CPUs"),
    "decode_mode": Spec("decode", choice(DecodeMode), "decode workers are threads or processes",
                        shown=f"process from {PROCESS_MODE_FROM_CPUS} usable CPUs, else thread"),
    "worker_max_jobs": Spec("decode", integer(0), "process mode: a worker is replaced after this many items "
                                               "(0 = never)"),
    "worker_max_rss_mb": Spec("decode", integer(0), "process mode: a worker above this resident MiB after an item "
                                                 "is replaced (0 = never)"),
    "max_body_mb": Spec("limits", integer(1, 4096), "request body limit in MiB -> 413 body_too_large"),
    "max_media_per_request": Spec("limits", integer(1, 10_000), "media parts per request -> 400 too_many_media"),
    "max_json_depth": Spec("limits", integer(8, 10_000), "nesting of the JSON mmgate walks -> 400 json_too_deep"),
    "max_json_structure_kb": Spec("limits", integer(16, 1_048_576), "KiB of a media body's JSON outside its long "
                                                                 "strings, parsed on the event loop in one call "
                                                                 "-> 400 json_too_complex"),
    "max_media_item_mb": Spec("limits", integer(1, 4096), "one decoded media item in MiB -> 413 media_too_large"),
    "max_image_pixels": Spec("limits", integer(1), "decompression-bomb guard, from the header -> 400 "
                                                "image_too_large"),
    "max_frames": Spec("limits", integer(1, 100_000), "frames of an animated image -> 400 too_many_frames"),
    "max_audio_seconds": Spec("limits", seconds(False), "WAV duration limit -> 400 audio_invalid"),
    "max_video_pixels": Spec("limits", integer(1), "pixels of one video frame, from the container -> 400 "
                                                "video_too_large"),
    "max_video_frames": Spec("limits", integer(1, 10_000_000), "frames of a video, from its index or packets -> "
                                                            "400 video_too_large"),
    "max_video_seconds": Spec("limits", seconds(False), "duration of a video -> 400 video_too_large"),
    "validate": Spec("decode", choice(Validate), "header = format, size and frames from the header (the backend "
                                                "decodes the image anyway); full = also decode every image"),
    "resize_max_pixels": Spec("decode", integer(0), "downscale to at most this many pixels (0 = never)"),
    "resize_max_side": Spec("decode", integer(0), "downscale so the longer side fits (0 = never)"),
    "model": Spec("decode", model_name, "served model's folder or cached name: its resize and image tokens (needs "
                                    "the model extra)", shown="none"),
    "image_format": Spec("decode", choice(ImageFormat), "format of re-encoded images; auto = BMP with a model "
                                                         "(lossless, cheapest for the backend), else JPEG; PNG "
                                                         "where alpha must survive"),
    "jpeg_quality": Spec("decode", jpeg_quality, "JPEG/WebP quality of re-encoded images, or auto: 90 (4:2:0 "
                                                  "chroma), and with a model 100 with 4:4:4 chroma, its fidelity "
                                                  "bound"),
    "release_at": Spec("gate", choice(ReleaseAt), "when the gate lease ends"),
    "media_urls": Spec("fetch", choice(MediaUrls), "media URLs: forward (the backend fetches), reject (400), "
                                                    "fetch (mmgate fetches, checks, inlines)"),
    "fetch_allow_hosts": Spec("fetch", host_patterns, "with fetch: hosts and *.suffix patterns fetched from",
                              shown="any public host"),
    "fetch_allow_addresses": Spec("fetch", cidrs, "with fetch: CIDRs allowed although private/loopback/...",
                                  shown="none"),
    "fetch_max_redirects": Spec("fetch", integer(0, 20), "with fetch: redirects followed, each checked again"),
    "fetch_timeout": Spec("fetch", seconds(False), "with fetch: seconds for one fetch, redirects included -> 400"),
    "fetch_first_byte_timeout": Spec("fetch", seconds(False), "with fetch: seconds to a response head -> 400"),
    "fetch_max_connections": Spec("fetch", integer(1, 100_000), "with fetch: connections of the fetch client"),
    "cache_mb": Spec("memory", integer(0, 1 << 20), "processed-media cache in MiB: a media item seen before is not "
                                                 "decoded again (0 = off)"),
    "allow_paths": Spec("backend", path_prefixes, "comma-separated path prefixes forwarded; others -> 404",
                        shown="all"),
    "trim_idle": Spec("memory", seconds(True), "return freed heap to the OS after this many idle seconds "
                                                "(0 = off)"),
    "malloc_tuning": Spec("memory", on_off, "big buffers back to the OS when freed, no Pillow block cache (see "
                                           "README)"),
    "drain_grace": Spec("drain", seconds(True), "seconds to keep serving after SIGTERM while not ready"),
    "drain_timeout": Spec("drain", seconds(True), "seconds to wait for in-flight requests when draining"),
    "server_timing": Spec("logs", on_off, "add the Server-Timing header"),
    "access_log": Spec("logs", on_off, "log one line per request"),
    "log_level": Spec("logs", choice(LogLevel), "log level"),
    "log_format": Spec("logs", choice(LogFormat), "text or json (one object per line)"),
}

SECTIONS = SECTION_TYPES


def _check_spec() -> None:
    """Each section field has exactly one spec naming its section, so no setting is unreadable or unprinted."""
    declared = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls) if f.init}
    specified = {name: spec.section for name, spec in SPEC.items()}
    if declared != specified:
        raise RuntimeError(f"Settings sections and SPEC disagree: {set(declared.items()) ^ set(specified.items())}")


_check_spec()


def env_name(name: str) -> str:
    """``max_queue`` -> ``MMGATE_MAX_QUEUE``."""
    return "MMGATE_" + name.upper()


def flag_name(name: str) -> str:
    """``max_queue`` -> ``--max-queue``."""
    return "--" + name.replace("_", "-")


def setting_default(name: str) -> Any:
    """The default of setting ``name`` as its section's dataclass declares it (computed for a factory)."""
    for f in fields(SECTIONS[SPEC[name].section]):
        if f.name == name:
            return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[operator]
    raise KeyError(name)


def _is_auto(name: str, value: Any) -> bool:
    return ((name == "max_mm_concurrency" and value == AUTO_CONCURRENCY)
            or (name == "jpeg_quality" and value == AUTO_JPEG_QUALITY))


def help_text(name: str) -> str:
    """The help of setting ``name``: its text, then its default in brackets, taken from the section field."""
    spec = SPEC[name]
    shown = spec.shown
    if shown is None:
        value = setting_default(name)
        if _is_auto(name, value):
            shown = "auto"
        elif isinstance(value, bool):
            shown = "on" if value else "off"
        elif isinstance(value, float):
            shown = f"{value:g}"
        elif isinstance(value, tuple):
            shown = ",".join(value)
        else:
            shown = str(value)
    return f"{spec.help} [{shown}]" if shown else spec.help


def sections_from_env(environ: Mapping[str, str], overrides: Mapping[str, str]) -> dict[str, Any]:
    """``Settings.from_env``'s sections by name: every value parsed and cross-checked, ``auto`` and unset computed
    defaults resolved (decode workers, decode mode, processes), then placed in its section."""
    values: dict[str, Any] = {}
    where: dict[str, str] = {}  # setting -> how the user spelt it, so an error names what they typed
    for name, spec in SPEC.items():
        raw = overrides.get(name)
        where[name] = flag_name(name) if raw is not None else env_name(name)
        if raw is None:
            raw = environ.get(env_name(name))
        if raw is None:
            continue
        try:
            values[name] = spec.parse(str(raw))
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
            and values.get("min_mm_concurrency", setting_default("min_mm_concurrency"))
            > values.get("max_mm_concurrency_auto", setting_default("max_mm_concurrency_auto"))):
        raise ConfigError(f"{where['min_mm_concurrency']} is above {where['max_mm_concurrency_auto']}: "
                          "the adaptive limit needs a range")
    if values.get("backend_metrics") == "merge-admin" and not values.get("admin_port"):
        raise ConfigError(f"{where['backend_metrics']}='merge-admin' needs MMGATE_ADMIN_PORT: the merged /metrics "
                          "is served on the admin port only")
    if "decode_mode" not in values:
        values["decode_mode"] = default_decode_mode(usable_cpus())
    if values.get("processes") == AUTO_PROCESSES:
        values["processes"] = auto_processes(usable_cpus(), values["decode_workers"])
    elif values.get("processes", setting_default("processes")) > values["decode_workers"]:
        raise ConfigError(f"{where['processes']}={values['processes']} is above MMGATE_DECODE_WORKERS="
                          f"{values['decode_workers']}: each front process decodes with its share of the decode "
                          "workers, at least one; raise MMGATE_DECODE_WORKERS or lower the processes")
    by_section: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for name, value in values.items():
        by_section[SPEC[name].section][name] = value
    return {section: SECTIONS[section](**kwargs) for section, kwargs in by_section.items()}


def setting_value(settings: Configured, name: str) -> Any:
    """The effective value of setting ``name``, e.g. ``setting_value(settings, "max_queue")``."""
    return getattr(getattr(settings, SPEC[name].section), name)


def describe(settings: Configured) -> str:
    """``--print-config``: every effective setting as ``MMGATE_X=value`` and the worst-case memory."""
    lines = []
    for name in SPEC:
        shown = setting_value(settings, name)
        if isinstance(shown, tuple):
            shown = ",".join(shown)
        elif _is_auto(name, shown):
            shown = "auto"
        elif isinstance(shown, bool):
            shown = "on" if shown else "off"
        lines.append(f"{env_name(name)}={shown}")
    memory = settings.worst_case_memory_bytes()
    mib = {k: v / MIB for k, v in memory.items()}
    lines.append(
        f"# worst-case payload memory: {mib['total']:.0f} MiB = queued {mib['queued']:.0f} MiB"
        f" + admitted {mib['admitted']:.0f} MiB + decoding {mib['decoding']:.0f} MiB"
        + (f" + worker processes {mib['processes']:.0f} MiB" if memory["processes"] else "")
        + f" + connections {mib['connections']:.0f} MiB + cache {mib['cache']:.0f} MiB"
        + (f" + fetched {mib['fetched']:.0f} MiB" if memory["fetched"] else "")
    )
    return "\n".join(lines)


def unknown_variables(environ: Mapping[str, str], also_known: Collection[str] = ()) -> list[str]:
    """One warning per ``MMGATE_*`` variable that is no setting, with the closest name when there is one.
    ``also_known``: names a caller reads itself (the tests' and benchmarks' own switches), left alone.

    A misspelt variable would otherwise be ignored without a word, and the default it meant to change would
    silently stay in force. Only a warning: an unknown name must not stop a rollout.
    """
    known = [name.upper() for name in SPEC]
    warnings = []
    for variable in sorted(environ):
        if not variable.startswith("MMGATE_") or variable[7:] in known or variable in also_known:
            continue
        # Compared without the prefix every name shares, which would make any two names look alike.
        close = difflib.get_close_matches(variable[7:], known, n=1)
        warnings.append(f"unknown variable {variable}" + (f" (did you mean MMGATE_{close[0]}?)" if close else ""))
    return warnings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--kebab-name`` flag per setting; values stay raw strings so one parser validates both sources."""
    for name in SPEC:
        parser.add_argument(flag_name(name), dest=name, default=None, metavar="V", help=help_text(name))


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    return {name: value for name in SPEC if (value := getattr(args, name, None)) is not None}
