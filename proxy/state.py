"""The state one mmgate app shares between its handlers, under a typed ``web.AppKey``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from preprocessors.base import AudioPolicy, ImagePolicy, VideoPolicy
from preprocessors.pool import DecodePool
from proxy.admission.gate import Gate
from proxy.edge.connections import ConnectionGuard
from proxy.edge.pacing import Pacer
from proxy.edge.upstream_health import UpstreamHealth
from proxy.fetch.fetcher import Fetcher
from proxy.media.buffers import BufferLedger
from proxy.media.cache import MediaCache
from proxy.media.model import Model
from proxy.ops.metrics import Metrics
from proxy.payload.locate import Limits
from proxy.serve.lifecycle import Lifecycle
from proxy.serve.memory import IdleTrimmer
from proxy.settings import Settings


@dataclass
class AppState:
    """Everything a request handler needs, built once per app."""

    settings: Settings
    metrics: Metrics
    gate: Gate
    image_policy: ImagePolicy
    audio_policy: AudioPolicy
    trimmer: IdleTrimmer
    connections: ConnectionGuard
    buffers: BufferLedger = field(default_factory=BufferLedger)
    session: aiohttp.ClientSession | None = None
    pool: DecodePool | None = None
    fetcher: Fetcher | None = None  # MMGATE_MEDIA_URLS=fetch only
    cache: MediaCache | None = None  # MMGATE_CACHE_MB > 0
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # shared with the gate
    model: Model | None = None  # MMGATE_MODEL with a supported family: image tokens are counted
    video_policy: VideoPolicy = field(default_factory=VideoPolicy)
    pacer: Pacer = field(default_factory=lambda: Pacer(0.0))  # big uploads held while the loop lags
    in_flight: int = 0
    reading: int = 0  # requests whose body is still being read (the read stage), text and media
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    ready_cache: tuple[float, bool, str] = (0.0, False, "not probed yet")
    upstream: UpstreamHealth = field(init=False)  # from settings: known to be down, re-checked until it answers
    plan_limits: Limits = field(init=False)  # from settings: what every media body's plan is checked against

    def __post_init__(self) -> None:
        self.upstream = UpstreamHealth(self.settings.backend.upstream, self.settings.backend.upstream_health_path)
        self.plan_limits = plan_limits(self.settings)

    def request_started(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()


STATE = web.AppKey("mmgate_state", AppState)


def plan_limits(settings: Settings) -> Limits:
    """The bounds a media body's plan is checked against, from the limits and the media URL mode."""
    limits, media_urls = settings.limits, settings.fetch.media_urls
    return Limits(limits.max_media_per_request, limits.max_media_item_bytes, media_urls == "reject",
                  limits.max_json_depth, fetch_urls=media_urls == "fetch",
                  max_structure=limits.max_json_structure_bytes)
