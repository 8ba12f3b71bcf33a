"""The gate as the rest of mmgate sees it: ``GateClient``, one interface whether the ``Gate`` runs in this process
(``LocalGate``) or in the supervisor of several front processes (``processes.remote_gate.RemoteGate``). Which one
serves is chosen once, when the app's state is built (``app.build_state``); nothing else asks.

``GateClient`` is admission only: take a place, acquire, observe, the counters. What only several processes
have (a link to start and close, a gate that may not answer, every front's metrics to merge, the other fronts'
caches) is the ``Fleet``, which is absent (None) in one process: one process is the whole.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol, TypeVar

from preprocessors.job import Verdict
from proxy.admission.adaptive import START, AdaptiveLimit
from proxy.admission.flows import DEFAULT_FLOW, Flow
from proxy.admission.gate import Gate, Lease, Place
from proxy.admission.sample import Sample
from proxy.settings.sections import GateSettings


class GateCounters(NamedTuple):
    """What the gate holds now: what every front's gauges show, and what the backend's queue does not see."""

    in_use: int
    waiting: int
    reading: int
    preparing: int
    bytes_in_use: int
    tokens_in_use: int
    limit: int

    @classmethod
    def of(cls, gate: Gate) -> GateCounters:
        return cls(gate.in_use, gate.waiting, gate.reading, gate.preparing, gate.bytes_in_use, gate.tokens_in_use,
                   gate.limit)

    @property
    def waiting_media(self) -> int:
        """``Gate.waiting_media``: accepted and not forwarded yet (queued, being read, being prepared)."""
        return self.waiting + self.reading + self.preparing

    def gauges(self) -> dict[str, float]:
        """The counters as the gauges that show them."""
        return {"mmgate_gate_in_use": self.in_use, "mmgate_gate_waiting": self.waiting,
                "mmgate_gate_reading": self.reading, "mmgate_media_bytes_inflight": self.bytes_in_use,
                "mmgate_image_tokens_inflight": self.tokens_in_use, "mmgate_gate_limit": self.limit}


class GatePlace(Protocol):
    """A place in line held while a big media body is still arriving (``Gate.take_place``)."""

    def release(self) -> None:
        """Give the place back; calling it again does nothing."""


class GateLease(Protocol):
    """One admitted request's slot, bytes and image tokens (``lease.Lease``)."""

    def release(self) -> None: ...

    def handed_off(self) -> None: ...

    def lower(self, cost: int) -> None: ...

    def release_after(self, work: Awaitable[object]) -> None: ...


PeerLookup = Callable[[list[bytes]], Awaitable[dict[bytes, Verdict]]]
PlaceT = TypeVar("PlaceT", bound=GatePlace)
LeaseT = TypeVar("LeaseT", bound=GateLease)


class GateClient(Protocol[PlaceT, LeaseT]):
    """Admission as a request handler uses it. A place or a lease goes back to the gate that gave it out (the
    type parameters say which kind each gate gives)."""

    def counters(self) -> GateCounters:
        """The gate's counters (a remote gate's as of its last answer: ``Fleet.refresh`` asks it)."""

    async def take_place(self, flow: Flow = DEFAULT_FLOW) -> PlaceT:
        """``Gate.take_place``: a place in line for a body still arriving, or the refusal (429, 503)."""

    async def acquire(self, cost: int, timeout: float, place: PlaceT | None = None, tokens: int = 0,
                      flow: Flow = DEFAULT_FLOW) -> LeaseT:
        """``Gate.acquire``: the lease once admitted, or the refusal."""

    def observe(self, lease: LeaseT, sample: Sample) -> None:
        """``Gate.observe``: the request ``lease`` admitted completed normally (its ``Sample``), for
        ``MMGATE_MAX_MM_CONCURRENCY=auto``; before the lease is released."""

    def controller(self) -> dict[str, object] | None:
        """With ``MMGATE_MAX_MM_CONCURRENCY=auto`` in one process, the controller's phase and why the limit last
        moved (``AdaptiveLimit.explain``); None otherwise (a supervisor's controller is not this process's)."""


class Fleet(Protocol):
    """The front processes around the supervisor's gate, as one front sees them; None in one process."""

    def start(self) -> None:
        """Once the event loop runs, before the first request."""

    def ready(self) -> None:
        """This process listens: requests may come."""

    async def close(self) -> None:
        """After the last request."""

    async def reachable(self, timeout: float) -> bool:
        """Whether the gate answers within ``timeout`` seconds (/mmgate/ready)."""

    async def refresh(self) -> None:
        """The gate's ``counters`` as of now."""

    async def collect(self) -> dict[str, Any]:
        """Every front process's metrics merged (``ops.merged_metrics``)."""

    def share_cache(self, lookup: Callable[[bytes], Verdict | None]) -> PeerLookup:
        """Let the other front processes read this one's cache through ``lookup``; how a miss here asks theirs."""


def configured_limit(settings: GateSettings) -> tuple[int, AdaptiveLimit | None]:
    """The limit the gate starts with, and with ``MMGATE_MAX_MM_CONCURRENCY=auto`` the controller that moves it."""
    if settings.adaptive_concurrency:
        adaptive = AdaptiveLimit(settings.min_mm_concurrency, settings.max_mm_concurrency_auto, initial=START)
        return adaptive.limit, adaptive
    return settings.mm_concurrency_ceiling, None


def gate_from_settings(settings: GateSettings, on_change: Callable[[GateCounters], None] = lambda counters: None,
                       refusing: Callable[[], bool] = lambda: False) -> Gate:
    """The one ``Gate`` of mmgate (of this process, or of the supervisor of several), as the settings say;
    ``on_change`` sees its counters after every change."""
    limit, adaptive = configured_limit(settings)
    return Gate(limit, settings.max_inflight_media_bytes, settings.max_queue,
                lambda gate: on_change(GateCounters.of(gate)), refusing,
                token_budget=settings.max_inflight_image_tokens, max_queue_per_flow=settings.max_queue_per_flow,
                adaptive=adaptive)


class LocalGate:
    """The ``Gate`` of this process behind the client interface."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def counters(self) -> GateCounters:
        return GateCounters.of(self.gate)

    async def take_place(self, flow: Flow = DEFAULT_FLOW) -> Place:
        return self.gate.take_place(flow)

    async def acquire(self, cost: int, timeout: float, place: Place | None = None, tokens: int = 0,
                      flow: Flow = DEFAULT_FLOW) -> Lease:
        return await self.gate.acquire(cost, timeout, place, tokens, flow)

    def observe(self, lease: Lease, sample: Sample) -> None:
        self.gate.observe(lease, sample)

    def controller(self) -> dict[str, object] | None:
        return self.gate.adaptive.explain() if self.gate.adaptive is not None else None
