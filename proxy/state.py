"""The state one mmgate app shares between its handlers, in two typed ``web.AppKey``\\ s.

``AppBase`` is what exists as soon as the app is built (settings, metrics, gate, policies, the request
counters): ``build_app`` stores it under ``BASE``. ``AppState`` is that base completed with the resources
that exist only once the event loop runs (the upstream session, and the media step with the decode pool, the
media cache and the fetch client it works with): the start-up context that builds them stores it under
``STATE`` and closes them at shutdown. Every field is what it says from the moment the object exists; an
optional one (``model``, ``fetcher``) is None because a setting turns it off, never because start-up has not
happened yet.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import cached_property
from typing import Any

import aiohttp
from aiohttp import web

from preprocessors.base import AudioPolicy, ImagePolicy, VideoPolicy
from preprocessors.pool import DecodePool
from proxy.admission.client import Fleet, GateClient
from proxy.admission.flows import FlowRules
from proxy.edge.buffers import BufferLedger
from proxy.edge.connections import ConnectionGuard
from proxy.edge.pacing import Pacer
from proxy.edge.upstream_health import UpstreamHealth
from proxy.fetch.fetcher import Fetcher
from proxy.media.cache import VerdictCache
from proxy.media.discovery import ServedModel
from proxy.media.model import Model
from proxy.media.step import MediaStep
from proxy.ops.backend_scrapes import BackendScrapes
from proxy.ops.metrics import Metrics
from proxy.payload.locate import Limits
from proxy.runtime.memory import IdleTrimmer
from proxy.settings import PRIORITY_MAX, PRIORITY_MIN, Settings


class Phase(Enum):
    """Where the process is in its life. One state instead of flags kept in step: readiness fails from the grace
    on (the load balancer is told to stop sending), new requests and new media admissions are refused only once
    the drain proper starts (the requests already accepted keep their place). ``server.drain`` moves it forward;
    nothing moves it back."""

    SERVING = "serving"
    GRACE = "grace"  # SIGTERM received: readiness fails, requests are still served
    DRAINING = "draining"  # new requests get 503 draining; those in flight may finish


class Lifecycle:
    """The app's phase, shared by the handlers, the admin routes and the gate."""

    def __init__(self) -> None:
        self.phase = Phase.SERVING

    @property
    def ready(self) -> bool:
        """Whether readiness may pass (the upstream is asked only then)."""
        return self.phase is Phase.SERVING

    @property
    def refusing(self) -> bool:
        """Whether new requests and new admissions are refused."""
        return self.phase is Phase.DRAINING

    def start_grace(self) -> None:
        if self.phase is Phase.SERVING:
            self.phase = Phase.GRACE

    def start_draining(self) -> None:
        self.phase = Phase.DRAINING


@dataclass
class Traffic:
    """The requests in flight now, and those whose body is still being read; ``idle`` is set when none is in
    flight (the drain waits for it)."""

    in_flight: int = 0
    reading: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


@dataclass(kw_only=True)
class AppBase:
    """Everything built with the app, before start-up (``app.build_state``)."""

    settings: Settings
    metrics: Metrics
    gate: GateClient  # this process's, or with several front processes the supervisor's
    fleet: Fleet | None  # the other front processes, through the supervisor; None in one process
    image_policy: ImagePolicy
    audio_policy: AudioPolicy
    video_policy: VideoPolicy
    trimmer: IdleTrimmer
    connections: ConnectionGuard
    lifecycle: Lifecycle  # shared with the gate
    model: Model | None  # MMGATE_MODEL with a supported family: image tokens are counted
    pacer: Pacer  # big uploads held while the loop lags
    upstream: UpstreamHealth  # known to be down, re-checked until it answers
    served: ServedModel  # the model in force and why (MMGATE_MODEL=auto: what the upstream was found to serve)
    buffers: BufferLedger = field(default_factory=BufferLedger)
    traffic: Traffic = field(default_factory=Traffic)
    backend_scrapes: BackendScrapes = field(default_factory=BackendScrapes)  # the backend's /metrics, reused briefly

    @property
    def in_flight(self) -> int:
        return self.traffic.in_flight

    @property
    def reading(self) -> int:
        return self.traffic.reading

    @property
    def idle(self) -> asyncio.Event:
        return self.traffic.idle

    def request_started(self) -> None:
        self.traffic.in_flight += 1
        self.traffic.idle.clear()

    def request_finished(self) -> None:
        self.traffic.in_flight -= 1
        if self.traffic.in_flight == 0:
            self.traffic.idle.set()

    @cached_property
    def plan_limits(self) -> Limits:
        """What every media body's plan is checked against, built once from the settings."""
        return plan_limits(self.settings)

    @cached_property
    def flow_rules(self) -> FlowRules:
        """How every media request's flow is found, built once from the settings."""
        gate = self.settings.gate
        return FlowRules.of(gate.fairness_header, gate.priority_header, (PRIORITY_MIN, PRIORITY_MAX),
                            gate.trust_flow_headers_from)

    def parts(self) -> dict[str, Any]:
        """The base's fields, to complete into an ``AppState`` (the same objects, shared)."""
        return {f.name: getattr(self, f.name) for f in fields(AppBase)}


@dataclass(kw_only=True)
class AppState(AppBase):
    """Everything a request handler needs: the base and the resources built at start-up."""

    session: aiohttp.ClientSession  # to the upstream
    media: MediaStep  # the media step, with the decode pool, the media cache and the fetch client
    ready_cache: tuple[float, bool, str] = (0.0, False, "not probed yet")

    @classmethod
    def completing(cls, base: AppBase, *, session: aiohttp.ClientSession, media: MediaStep) -> AppState:
        """``base`` (its very objects, shared with whatever already holds them) and the resources."""
        return cls(**base.parts(), session=session, media=media)

    @property
    def pool(self) -> DecodePool:
        """The media step's decode pool, its workers started and ready."""
        return self.media.pool

    @pool.setter
    def pool(self, pool: DecodePool) -> None:  # a bench swaps in a pool of its own (testkit.variants)
        self.media.pool = pool

    @property
    def cache(self) -> VerdictCache:
        """The media step's cache: a ``cache.NoCache`` when MMGATE_CACHE_MB is 0."""
        return self.media.cache

    @property
    def fetcher(self) -> Fetcher | None:
        """The media step's fetch client: None unless MMGATE_MEDIA_URLS=fetch."""
        return self.media.fetcher


BASE = web.AppKey("mmgate_base", AppBase)
STATE = web.AppKey("mmgate_state", AppState)


def plan_limits(settings: Settings) -> Limits:
    """The bounds a media body's plan is checked against, from the limits and the media URL mode."""
    limits, media_urls = settings.limits, settings.fetch.media_urls
    return Limits(max_parts=limits.max_media_per_request, max_item_bytes=limits.max_media_item_bytes,
                  max_depth=limits.max_json_depth, max_structure=limits.max_json_structure_bytes,
                  reject_urls=media_urls == "reject", fetch_urls=media_urls == "fetch")
