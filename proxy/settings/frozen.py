"""The effective configuration: one frozen ``Settings`` made of the frozen sections of ``sections``.

A field is named as its variable without the prefix: ``settings.limits.max_body_mb`` is ``MMGATE_MAX_BODY_MB``
and ``--max-body-mb``. ``spec`` reads each variable into its section; this module puts the sections together and
answers the questions about the whole (the worst-case memory, a front process's share). Its fields are the
sections of ``sections.SECTIONS``, in that order, each named as its class in lower case.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from proxy.settings.declare import env_name
from proxy.settings.sections import (
    CONNECTION_BYTES,
    MIB,
    PROBE_RESERVE,
    SECTIONS,
    WORKER_PROCESS_BYTES,
    Backend,
    Decode,
    Drain,
    Fetch,
    GateSettings,
    Limits,
    Listen,
    Logs,
    Memory,
    Timeouts,
)
from proxy.settings.spec import section_title, sections_from_env, setting_value, settings_of, spelt


@dataclass(frozen=True, slots=True)
class Settings:
    """Effective configuration: ``Settings.from_env`` builds it from the environment and CLI flags."""

    backend: Backend = field(default_factory=Backend)
    listen: Listen = field(default_factory=Listen)
    gate: GateSettings = field(default_factory=GateSettings)
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    decode: Decode = field(default_factory=Decode)
    fetch: Fetch = field(default_factory=Fetch)
    memory: Memory = field(default_factory=Memory)
    drain: Drain = field(default_factory=Drain)
    logs: Logs = field(default_factory=Logs)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: str) -> Settings:
        """Read ``MMGATE_*`` from ``environ`` (default ``os.environ``); ``overrides`` (raw strings, CLI, keyed
        by the field's name, e.g. ``max_queue``) win. A bad value raises ``ConfigError``."""
        return cls(**sections_from_env(os.environ if environ is None else environ, overrides))

    def worst_case_memory_bytes(self) -> dict[str, int]:
        """Upper bound of request payload memory the limits allow (docs/tuning.md).

        queued:      every waiting request holds its raw body    = MAX_QUEUE × MAX_BODY_MB
        admitted:    requests past the gate hold body + output   = MAX_MM_CONCURRENCY × 2 × MAX_BODY_MB
                     (the body they forward: refused over
                     MAX_BODY_MB from the image headers, before
                     any decode; ``media.forwarded``)
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
        gate, limits, decode = self.gate, self.limits, self.decode
        queued = gate.max_queue * limits.max_body_bytes
        admitted = gate.mm_concurrency_ceiling * 2 * limits.max_body_bytes
        decoding = decode.decode_workers * limits.max_image_pixels * 4
        processes = 0
        if decode.decode_mode == "process":
            processes = decode.decode_workers * (WORKER_PROCESS_BYTES + 2 * limits.max_media_item_bytes * 4 // 3)
        connections = (self.listen.max_connections + PROBE_RESERVE * self.listen.processes) * CONNECTION_BYTES
        fetched = 0
        if self.fetch.media_urls == "fetch":
            charged = gate.mm_concurrency_ceiling * limits.max_media_per_request * limits.max_media_item_bytes
            if gate.max_inflight_media_bytes:
                charged = min(charged, gate.max_inflight_media_bytes)
            fetched = charged * 7 // 3
        cache = self.memory.cache_bytes
        return {"queued": queued, "admitted": admitted, "decoding": decoding, "processes": processes,
                "connections": connections, "fetched": fetched, "cache": cache,
                "total": queued + admitted + decoding + processes + connections + fetched + cache}

    def for_front(self, index: int) -> Settings:
        """What front process ``index`` of ``processes`` runs with: its share of the decode workers, the cache
        and the client connections, so that the totals, and the worst case above, stay those configured."""
        processes = self.listen.processes

        def share(total: int) -> int:
            return total // processes + (1 if index < total % processes else 0)

        return replace(self, decode=replace(self.decode, decode_workers=share(self.decode.decode_workers)),
                       memory=replace(self.memory, cache_mb=share(self.memory.cache_mb)),
                       listen=replace(self.listen, max_connections=max(1, share(self.listen.max_connections))))

    def describe(self) -> str:
        """``--print-config``: every effective setting as ``MMGATE_X=value``, section by section, followed by
        ``  # default: Y`` where it differs from its default; then the worst-case memory, always the last line."""
        lines: list[str] = []
        for section in SECTIONS:
            lines += ["", f"# {section_title(section)}"] if lines else [f"# {section_title(section)}"]
            for setting in settings_of(section):
                value = setting_value(self, setting.name)
                line = f"{env_name(setting.name)}={spelt(value)}"
                if setting.info.required:  # no default to differ from
                    line += "" if value else "  # not set: required to serve"
                elif value != (default := setting.default):
                    line += f"  # default: {spelt(default) or setting.info.shown or 'none'}"
                lines.append(line)
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
