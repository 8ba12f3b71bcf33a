"""Admission control for media requests: slots, a decoded-bytes budget, a bounded FIFO queue, deadlines.

A request is admitted when a slot is free *and* its cost (decoded media bytes and the base64 forwarded in place
of each rewritten image, known from the base64 lengths and image headers before anything is decoded:
``media.step``) fits the remaining byte budget *and*, with a token budget
(``MMGATE_MAX_INFLIGHT_IMAGE_TOKENS``), its image tokens (counted from the image headers with the served
model's processor) fit the tokens left. Waiting is strictly FIFO: the head of
the queue holds the line even if a smaller request behind it would fit, so a big request is never starved.
Refusals are immediate and honest: queue full → 429 ``queue_full``; waited too long → 429
``queue_timeout``; a cost larger than the whole budget → 413 ``media_too_large``, more image tokens than the
whole token budget → 413 ``too_many_image_tokens`` (it could never fit); draining → 503. Every 429 carries
``Retry-After`` estimated from how long slots are held.

A ``lease.Lease`` is released exactly once whatever path the request takes; ``release()`` is idempotent.

Bodies still arriving count too. Admission needs the whole body (the cost is in it), but a burst of N big
media bodies read at once would hold N bodies in memory however short the queue, far past the bound the
queue is meant to set. So a request whose body is big and whose first bytes (``body.HEAD_BYTES``) name
media takes a ``Place`` before the rest is read; places count against the same
``limit + max_queue`` as admitted and queued requests, and the request that finds them all taken gets
429 ``queue_full`` at once, its body unread. ``acquire(place=...)`` turns the place into a queue entry.

Fair and prioritised waiting (GIE's flow control): each request belongs to a ``Flow``, a flow id from
``MMGATE_FAIRNESS_HEADER`` or else its client's address, and a priority band from ``MMGATE_PRIORITY_HEADER``
(the headers are read from trusted peers only: ``flows.flow_for``). Waiters queue per flow; the
next request served is the head of the first flow of the highest band that has waiters, and a flow served
goes to the back of its band's turn, so flows within a band take turns and a higher band always goes first.
The head-of-line rule holds for that next request: it holds the line until it fits. A flow may hold at most
``max_queue_per_flow`` places in line (waiting or reading); its 429 names the flow and its Retry-After counts
what is ahead of that flow only. The requests of one client without a fairness id are one flow: one FIFO.
Every other guarantee (budgets, deadlines, release exactly once) is per request and so per flow.

With ``MMGATE_MAX_MM_CONCURRENCY=auto`` an ``adaptive.AdaptiveLimit`` moves ``limit``: it hears of every change
of the counters, of each hand-off to the backend and each lease given back after one (so it knows how long the
requests still at the backend have been there), of a tick every ``adaptive.TICK_S``, and ``observe`` hands it
the ``sample.Sample`` of each request that completed normally (a release alone teaches it nothing); budgets
apply as ever.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from preprocessors.errors import (
    MEDIA_TOO_LARGE,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    TOO_MANY_IMAGE_TOKENS,
    ErrorCode,
    MmgateError,
    draining,
)
from proxy.admission.adaptive import TICK_S, AdaptiveLimit
from proxy.admission.flows import DEFAULT_FLOW, Flow
from proxy.admission.lease import Lease
from proxy.admission.sample import Sample

RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1, 60


@dataclass(eq=False, slots=True)
class _Waiter:
    cost: int
    future: asyncio.Future[None]
    tokens: int = 0
    flow: Flow = DEFAULT_FLOW
    phase: int = 0  # the adaptive limit's phase when it was granted ...
    held_since: float = 0.0  # ... and when, on its clock


@dataclass(eq=False)
class Place:
    """A place in line held while a big media body is still being read. ``release()`` is idempotent."""

    gate: Gate
    released: bool = False
    flow: Flow = DEFAULT_FLOW

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate.reading -= 1
            self.gate._reading_by_flow[self.flow.key] -= 1
            if not self.gate._reading_by_flow[self.flow.key]:
                del self.gate._reading_by_flow[self.flow.key]
            self.gate._on_change(self.gate)


class Gate:
    """Slots + byte budget + token budget + bounded queue, FIFO per flow, flows in turn, bands strict. All
    methods run on the event loop (no locks needed)."""

    def __init__(
        self,
        limit: int,
        byte_budget: int,
        max_queue: int,
        on_change: Callable[[Gate], None] = lambda gate: None,
        refusing: Callable[[], bool] = lambda: False,
        token_budget: int = 0,
        max_queue_per_flow: int = 0,
        adaptive: AdaptiveLimit | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.adaptive = adaptive
        self.clock = clock
        self.limit = adaptive.limit if adaptive is not None else limit
        self.byte_budget = byte_budget  # 0 = no byte budget
        self.token_budget = token_budget  # 0 = no token budget
        self.tokens_in_use = 0
        self.max_queue = max_queue
        self.max_queue_per_flow = max_queue_per_flow  # 0 = only max_queue
        self.in_use = 0
        self.preparing = 0  # admitted and not yet handed to the backend (being fetched, decoded, spliced)
        self.bytes_in_use = 0
        self.reading = 0  # places held by requests whose body is still arriving
        self.refusing = refusing  # true once the process drains: new arrivals are refused
        # band -> flow key -> that flow's waiters; a dict keeps the flows' turn order (served: to the back)
        self._bands: dict[int, dict[tuple[str, str], deque[_Waiter]]] = {}
        self._waiting = 0
        self._reading_by_flow: dict[tuple[str, str], int] = {}
        self._on_change = on_change
        self._hold_seconds = 1.0  # moving average of how long a lease is held; seeds Retry-After
        self._ticking: asyncio.TimerHandle | None = None  # the adaptive limit's timer, while requests are about
        on_change(self)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def waiting_media(self) -> int:
        """Media requests mmgate accepted and has not forwarded yet: queued, being read (holding a place),
        being fetched or decoded. What a backend's queue gauge does not see."""
        return self._waiting + self.reading + self.preparing

    def flow_waiting(self, flow: Flow) -> int:
        """Places one flow holds in line: its waiters in every band, and its bodies still arriving."""
        return sum(len(flows.get(flow.key, ())) for flows in self._bands.values()) + self._reading_by_flow.get(
            flow.key, 0)

    def _fits(self, cost: int, tokens: int) -> bool:
        if self.in_use >= self.limit:
            return False
        if self.token_budget and self.tokens_in_use + tokens > self.token_budget:
            return False
        return not self.byte_budget or self.bytes_in_use + cost <= self.byte_budget

    def _ahead_of(self, flow: Flow) -> int:
        """Requests served before a new arrival of ``flow``: every waiter in a higher band, and in its own
        band, as the flows take turns, each other flow's waiters up to one more than ``flow`` has. Bodies
        still arriving count as ahead. With one flow this is the whole line."""
        mine = len(self._bands.get(flow.band, {}).get(flow.key, ()))
        ahead = self.reading + mine
        for band, flows in self._bands.items():
            if band > flow.band:
                ahead += sum(map(len, flows.values()))
            elif band == flow.band:
                ahead += sum(min(len(queue), mine + 1) for key, queue in flows.items() if key != flow.key)
        return ahead

    def retry_after(self, flow: Flow = DEFAULT_FLOW) -> int:
        """Seconds until a new arrival of ``flow`` could plausibly be admitted: the line ahead of it over
        slots, times hold time."""
        rounds = (self._ahead_of(flow) + 1) / self.limit
        return max(RETRY_AFTER_MIN, min(RETRY_AFTER_MAX, math.ceil(rounds * self._hold_seconds)))

    def _reject(self, refusal: ErrorCode[MmgateError], message: str, flow: Flow = DEFAULT_FLOW,
                named: bool = False) -> MmgateError:
        """A refusal whose Retry-After is ``flow``'s wait. The message names a flow its fairness id named, or
        one whose own share refused it (``named``); a client's address flow is not news to the client."""
        if named or flow.id:
            message = f"{flow.named()}: {message}"
        return refusal.error(message, headers={"Retry-After": str(self.retry_after(flow))})

    def _flow_full(self, flow: Flow) -> MmgateError | None:
        if self.max_queue_per_flow and self.flow_waiting(flow) >= self.max_queue_per_flow:
            reading = self._reading_by_flow.get(flow.key, 0)
            return self._reject(QUEUE_FULL, f"this flow's share of the media queue is full "
                                            f"(MMGATE_MAX_QUEUE_PER_FLOW={_places(self.max_queue_per_flow)}): "
                                            f"{_held_by(None, self.flow_waiting(flow) - reading, reading)}; "
                                            "retry later", flow, named=True)
        return None

    def take_place(self, flow: Flow = DEFAULT_FLOW) -> Place:
        """Reserve a place in line for a request whose body is still arriving, or refuse it now (429)."""
        if self.refusing():
            raise draining()
        if self.in_use + self.waiting + self.reading >= self.limit + self.max_queue:
            slots = f"{self.limit} slot" if self.limit == 1 else f"{self.limit} slots"
            raise self._reject(QUEUE_FULL, f"the media queue is full ({_places(self.limit + self.max_queue)}: "
                                         f"{slots} + MMGATE_MAX_QUEUE={self.max_queue}): "
                                         f"{_held_by(self.in_use, self.waiting, self.reading)}; retry later", flow)
        if (refusal := self._flow_full(flow)) is not None:
            raise refusal
        self.reading += 1
        self._reading_by_flow[flow.key] = self._reading_by_flow.get(flow.key, 0) + 1
        self._on_change(self)
        return Place(self, flow=flow)

    async def acquire(self, cost: int, timeout: float, place: Place | None = None, tokens: int = 0,
                      flow: Flow = DEFAULT_FLOW) -> Lease:
        """Wait (FIFO, at most ``timeout`` s) until a slot, ``cost`` bytes and ``tokens`` image tokens are free;
        return the Lease.

        With a ``place`` (taken while the body was read) the request is not refused for a full queue: its
        place was counted when the line was checked."""
        if place is not None:
            place.release()
        if self.refusing():
            raise draining()
        if self.adaptive is not None and self._ticking is None:  # the first request, or the first after a lull
            self._ticking = asyncio.get_running_loop().call_later(TICK_S, self._tick, self.adaptive)
        if self.byte_budget and cost > self.byte_budget:
            raise MEDIA_TOO_LARGE.error(
                f"the request's media weigh {cost} bytes (decoded, and forwarded in place of rewritten images), "
                f"more than the whole in-flight budget of "
                f"{self.byte_budget} bytes (MMGATE_MAX_INFLIGHT_MEDIA_MB): send smaller or fewer media",
            )
        if self.token_budget and tokens > self.token_budget:
            raise TOO_MANY_IMAGE_TOKENS.error(
                f"the request's images make {tokens} image tokens for the served model, more than the whole "
                f"in-flight budget of {self.token_budget} (MMGATE_MAX_INFLIGHT_IMAGE_TOKENS): send smaller or "
                "fewer images",
            )
        if not self._waiting and self._fits(cost, tokens):
            return self._grant(cost, tokens)
        if place is None:
            if self._waiting + self.reading >= self.max_queue:  # places count as queued
                raise self._reject(QUEUE_FULL, f"the media queue is full (MMGATE_MAX_QUEUE="
                                               f"{_places(self.max_queue)}): "
                                               f"{_held_by(None, self.waiting, self.reading)}, behind "
                                               f"{self.in_use} running; retry later", flow)
            if (refusal := self._flow_full(flow)) is not None:
                raise refusal
        waiter = _Waiter(cost, asyncio.get_running_loop().create_future(), tokens, flow)
        self._enqueue(waiter)
        self._on_change(self)
        try:
            async with asyncio.timeout(timeout):
                await waiter.future
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                # Granted in the same instant we timed out or were cancelled: hand the slot back.
                self._give_back(self._lease(cost, tokens, waiter.phase, waiter.held_since))
            else:
                waiter.future.cancel()
                self._dequeue(waiter)
                self._wake()  # the head may have been the one blocking smaller requests behind it
            self._on_change(self)
            if isinstance(exc, TimeoutError):
                raise self._reject(QUEUE_TIMEOUT, f"waited {timeout:g} s in the media queue, the longest "
                                                  f"allowed (MMGATE_QUEUE_TIMEOUT={timeout:g}), behind "
                                                  f"{self.in_use} running; retry later", flow) from None
            raise
        return self._lease(cost, tokens, waiter.phase, waiter.held_since)

    def _enqueue(self, waiter: _Waiter) -> None:
        flows = self._bands.get(waiter.flow.band)
        if flows is None:
            # bands kept highest first, so the next request is always in the first band
            self._bands[waiter.flow.band] = flows = {}
            self._bands = dict(sorted(self._bands.items(), reverse=True))
        flows.setdefault(waiter.flow.key, deque()).append(waiter)
        self._waiting += 1
        if self._load():
            self._wake()  # the limit grew

    def _dequeue(self, waiter: _Waiter) -> None:
        """Take a waiter out of line wherever it stands (it timed out or was cancelled)."""
        flows = self._bands.get(waiter.flow.band)
        queue = flows.get(waiter.flow.key) if flows is not None else None
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        self._waiting -= 1
        self._forget_if_empty(waiter.flow)
        self._load()

    def _forget_if_empty(self, flow: Flow) -> None:
        flows = self._bands[flow.band]
        if not flows[flow.key]:
            del flows[flow.key]
            if not flows:
                del self._bands[flow.band]

    def observe(self, lease: Lease, sample: Sample) -> None:
        """``lease``'s request completed normally (its ``Sample``): the adaptive limit learns from it. Only a
        request that reached the backend, and still held its slot, says anything about it: one never forwarded,
        or given back already (its client stalled), is ignored."""
        if (self.adaptive is not None and lease.forwarded and not lease.released
                and self.adaptive.observe(sample, lease.phase, lease.held_since)):
            self.limit = self.adaptive.limit
            self._wake()
            self._on_change(self)

    def _load(self) -> bool:
        """Tell the adaptive limit the counters changed; whether its limit changed (then ``limit`` follows)."""
        if self.adaptive is None or not self.adaptive.load(self.in_use, self._waiting):
            return False
        self.limit = self.adaptive.limit
        return True

    def _lease(self, cost: int, tokens: int, phase: int, held_since: float) -> Lease:
        return Lease(self, cost, tokens, granted_at=self.clock(), phase=phase, held_since=held_since)

    def _grant(self, cost: int, tokens: int) -> Lease:
        phase, held_since = self._take(cost, tokens)
        self._on_change(self)
        return self._lease(cost, tokens, phase, held_since)

    def _take(self, cost: int, tokens: int) -> tuple[int, float]:
        """Take a slot, ``cost`` bytes and ``tokens``; the adaptive limit's phase they were granted in, and when
        on its clock."""
        self.in_use += 1
        self.preparing += 1
        self.bytes_in_use += cost
        self.tokens_in_use += tokens
        phase, held_since = (self.adaptive.phase, self.adaptive.granted()) if self.adaptive is not None else (0, 0.0)
        self._load()  # a limit that grows here lets ``_wake`` go on granting
        return phase, held_since

    def _tick(self, adaptive: AdaptiveLimit) -> None:
        """The adaptive limit looks at the requests still at the backend every ``TICK_S`` while any is held or
        waiting, whether or not the counters change: answers that stopped coming say as much as answers that
        come."""
        # idle, it sleeps: the next request wakes it (``acquire``)
        busy = self.in_use or self._waiting
        self._ticking = asyncio.get_running_loop().call_later(TICK_S, self._tick, adaptive) if busy else None
        if adaptive.tick():
            self.limit = adaptive.limit
            self._wake()
            self._on_change(self)

    def _give_back(self, lease: Lease) -> None:
        if self.adaptive is not None:
            if lease.forwarded:
                self.adaptive.ended(lease.phase, lease.at_backend_since)
            self.adaptive.given_back(lease.held_since)
        self.in_use -= 1
        if not lease.forwarded:
            self.preparing -= 1
        self.bytes_in_use -= lease.cost
        self.tokens_in_use -= lease.tokens
        self._hold_seconds = 0.8 * self._hold_seconds + 0.2 * (self.clock() - lease.granted_at)
        self._load()
        self._wake()
        self._on_change(self)

    def _lower(self, lease: Lease, cost: int) -> None:
        self.bytes_in_use -= lease.cost - cost
        lease.cost = cost
        self._wake()
        self._on_change(self)

    def _wake(self) -> None:
        """Grant the next request while it fits: the head of the first flow of the highest band; a flow
        served goes to the back of its band's turn."""
        while self._bands:
            flows = next(iter(self._bands.values()))
            key, queue = next(iter(flows.items()))
            head = queue[0]
            if head.future.done():  # its task was cancelled or timed out: it no longer holds the line
                queue.popleft()
                self._waiting -= 1
                self._forget_if_empty(head.flow)
                continue
            if not self._fits(head.cost, head.tokens):
                break
            queue.popleft()
            self._waiting -= 1
            del flows[key]
            if queue:
                flows[key] = queue  # to the back of the band's turn
            elif not flows:
                del self._bands[head.flow.band]
            head.phase, head.held_since = self._take(head.cost, head.tokens)
            head.future.set_result(None)


def _held_by(running: int | None, waiting: int, arriving: int) -> str:
    """Who holds the places of a full queue, in words: a request whose body is still arriving holds its place
    before it can wait, so a full queue may show none waiting."""
    held = [] if running is None else [f"{running} running"]
    held.append(f"{waiting} waiting")
    if arriving:
        held.append(f"{arriving} still arriving (a body being read holds its place)")
    return ", ".join(held[:-1]) + " and " + held[-1] if len(held) > 1 else held[0]


def _places(count: int) -> str:
    return f"{count} place" if count == 1 else f"{count} places"
