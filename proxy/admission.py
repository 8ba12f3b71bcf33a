"""Admission control for media requests: slots, a decoded-bytes budget, a bounded FIFO queue, deadlines.

A request is admitted when a slot is free *and* its cost (decoded media bytes, known from the base64
lengths before anything is decoded) fits the remaining byte budget *and*, with a token budget
(``MMGATE_MAX_INFLIGHT_IMAGE_TOKENS``), its image tokens (counted from the image headers with the served
model's processor) fit the tokens left. Waiting is strictly FIFO: the head of
the queue holds the line even if a smaller request behind it would fit, so a big request is never starved.
Refusals are immediate and honest: queue full → 429 ``queue_full``; waited too long → 429
``queue_timeout``; a cost larger than the whole budget → 413 ``media_too_large``, more image tokens than the
whole token budget → 413 ``too_many_image_tokens`` (it could never fit); draining → 503. Every 429 carries
``Retry-After`` estimated from how long slots are held.

A ``Lease`` is released exactly once whatever path the request takes; ``release()`` is idempotent.

Bodies still arriving count too. Admission needs the whole body (the cost is in it), but a burst of N big
media bodies read at once would hold N bodies in memory however short the queue, far past the bound the
queue is meant to set. So a request whose body is big and whose first bytes (``body.HEAD_BYTES``) name
media takes a ``Place`` before the rest is read; places count against the same
``limit + max_queue`` as admitted and queued requests, and the request that finds them all taken gets
429 ``queue_full`` at once, its body unread. ``acquire(place=...)`` turns the place into a queue entry.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .errors import MmgateError, draining
from .lifecycle import Lifecycle

RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1, 60


@dataclass(eq=False, slots=True)
class _Waiter:
    cost: int
    future: asyncio.Future[None]
    tokens: int = 0


@dataclass(eq=False)
class Lease:
    """One admitted request's slot, bytes and image tokens. ``release()`` gives them back; calling it again does
    nothing."""

    gate: Gate
    cost: int
    tokens: int = 0
    granted_at: float = field(default_factory=time.monotonic)
    released: bool = False
    deferred: bool = False  # the release waits for work that has not stopped yet

    def release(self) -> None:
        if not self.released and not self.deferred:
            self._give_back()

    def release_after(self, work: Awaitable[object]) -> None:
        """Keep the slot until ``work`` (a decode batch) has really stopped, whatever calls ``release()``
        meanwhile: the answer may go out at once, but the slot stands for work still running."""
        if self.released or self.deferred:
            return
        self.deferred = True
        task = asyncio.ensure_future(work)
        task.add_done_callback(lambda _task: self._give_back())

    def _give_back(self) -> None:
        if not self.released:
            self.released = True
            self.gate._give_back(self)


@dataclass(eq=False)
class Place:
    """A place in line held while a big media body is still being read. ``release()`` is idempotent."""

    gate: Gate
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate.reading -= 1
            self.gate._on_change(self.gate)


class Gate:
    """Slots + byte budget + token budget + bounded FIFO queue. All methods run on the event loop (no locks
    needed)."""

    def __init__(
        self,
        limit: int,
        byte_budget: int,
        max_queue: int,
        on_change: Callable[[Gate], None] = lambda gate: None,
        lifecycle: Lifecycle | None = None,
        token_budget: int = 0,
    ) -> None:
        self.limit = limit
        self.byte_budget = byte_budget  # 0 = no byte budget
        self.token_budget = token_budget  # 0 = no token budget
        self.tokens_in_use = 0
        self.max_queue = max_queue
        self.in_use = 0
        self.bytes_in_use = 0
        self.reading = 0  # places held by requests whose body is still arriving
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle()  # refuses new arrivals once draining
        self._waiters: deque[_Waiter] = deque()
        self._on_change = on_change
        self._hold_seconds = 1.0  # moving average of how long a lease is held; seeds Retry-After
        on_change(self)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, cost: int, tokens: int) -> bool:
        if self.in_use >= self.limit:
            return False
        if self.token_budget and self.tokens_in_use + tokens > self.token_budget:
            return False
        return not self.byte_budget or self.bytes_in_use + cost <= self.byte_budget

    def retry_after(self) -> int:
        """Seconds until a new arrival could plausibly be admitted: queue ahead over slots, times hold time."""
        rounds = (self.waiting + self.reading + 1) / self.limit
        return max(RETRY_AFTER_MIN, min(RETRY_AFTER_MAX, math.ceil(rounds * self._hold_seconds)))

    def _reject(self, code: str, message: str) -> MmgateError:
        return MmgateError(429, code, message, headers={"Retry-After": str(self.retry_after())})

    def take_place(self) -> Place:
        """Reserve a place in line for a request whose body is still arriving, or refuse it now (429)."""
        if self.lifecycle.refusing:
            raise draining()
        if self.in_use + self.waiting + self.reading >= self.limit + self.max_queue:
            raise self._reject("queue_full", f"{self.in_use} media requests running, {self.waiting} waiting and "
                                             f"{self.reading} arriving; retry later")
        self.reading += 1
        self._on_change(self)
        return Place(self)

    async def acquire(self, cost: int, timeout: float, place: Place | None = None, tokens: int = 0) -> Lease:
        """Wait (FIFO, at most ``timeout`` s) until a slot, ``cost`` bytes and ``tokens`` image tokens are free;
        return the Lease.

        With a ``place`` (taken while the body was read) the request is not refused for a full queue: its
        place was counted when the line was checked."""
        if place is not None:
            place.release()
        if self.lifecycle.refusing:
            raise draining()
        if self.byte_budget and cost > self.byte_budget:
            raise MmgateError(
                413, "media_too_large",
                f"the request's media decode to {cost} bytes, more than the whole in-flight budget of "
                f"{self.byte_budget} bytes (MMGATE_MAX_INFLIGHT_MEDIA_MB): send smaller or fewer media",
            )
        if self.token_budget and tokens > self.token_budget:
            raise MmgateError(
                413, "too_many_image_tokens",
                f"the request's images make {tokens} image tokens for the served model, more than the whole "
                f"in-flight budget of {self.token_budget} (MMGATE_MAX_INFLIGHT_IMAGE_TOKENS): send smaller or "
                "fewer images",
            )
        if not self._waiters and self._fits(cost, tokens):
            return self._grant(cost, tokens)
        if place is None and len(self._waiters) + self.reading >= self.max_queue:  # places count as queued
            raise self._reject("queue_full",
                               f"{self.in_use} media requests running and {self.waiting} waiting; retry later")
        waiter = _Waiter(cost, asyncio.get_running_loop().create_future(), tokens)
        self._waiters.append(waiter)
        self._on_change(self)
        try:
            async with asyncio.timeout(timeout):
                await waiter.future
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                # Granted in the same instant we timed out or were cancelled: hand the slot back.
                self._give_back(Lease(self, cost, tokens))
            else:
                waiter.future.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                self._wake()  # the head may have been the one blocking smaller requests behind it
            self._on_change(self)
            if isinstance(exc, TimeoutError):
                raise self._reject("queue_timeout", f"waited {timeout:g} s for admission; retry later") from None
            raise
        return Lease(self, cost, tokens)

    def _grant(self, cost: int, tokens: int) -> Lease:
        self.in_use += 1
        self.bytes_in_use += cost
        self.tokens_in_use += tokens
        self._on_change(self)
        return Lease(self, cost, tokens)

    def _give_back(self, lease: Lease) -> None:
        self.in_use -= 1
        self.bytes_in_use -= lease.cost
        self.tokens_in_use -= lease.tokens
        held = time.monotonic() - lease.granted_at
        self._hold_seconds = 0.8 * self._hold_seconds + 0.2 * held
        self._wake()
        self._on_change(self)

    def _wake(self) -> None:
        """Grant waiters strictly in order while the head fits."""
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():  # its task was cancelled or timed out: it no longer holds the line
                self._waiters.popleft()
                continue
            if not self._fits(head.cost, head.tokens):
                break
            self._waiters.popleft()
            self.in_use += 1
            self.bytes_in_use += head.cost
            self.tokens_in_use += head.tokens
            head.future.set_result(None)
