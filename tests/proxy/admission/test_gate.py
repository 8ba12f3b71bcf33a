"""The Gate on its own: FIFO, byte budget, bounded queue, refusals, and a state machine that looks for leaks."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from preprocessors.errors import MmgateError
from proxy.admission.gate import Gate, Lease, Place


async def _queued(gate: Gate, count: int) -> None:
    """Let waiter tasks run until ``count`` of them are queued (each needs one loop turn to enqueue)."""
    while gate.waiting < count:  # noqa: ASYNC110 (Gate has no event for "n waiting"; each turn lets one enqueue)
        await asyncio.sleep(0)


async def test_fifo_order_and_slots() -> None:
    gate = Gate(limit=2, byte_budget=0, max_queue=10)
    first, second = await gate.acquire(1, 5), await gate.acquire(1, 5)
    order: list[int] = []

    async def wait(i: int) -> Lease:
        lease = await gate.acquire(1, 5)
        order.append(i)
        return lease

    tasks = [asyncio.create_task(wait(i)) for i in range(4)]
    await _queued(gate, 4)
    assert gate.in_use == 2 and gate.waiting == 4
    first.release()
    second.release()
    first.release()  # a second release changes nothing
    leases = [await tasks[0], await tasks[1]]
    assert order == [0, 1] and gate.in_use == 2 and gate.waiting == 2
    for lease in leases:
        lease.release()
    for lease in [await tasks[2], await tasks[3]]:
        lease.release()
    assert order == [0, 1, 2, 3]
    assert (gate.in_use, gate.waiting, gate.bytes_in_use) == (0, 0, 0)


async def test_big_request_holds_the_line() -> None:
    """Strict FIFO: a small request behind a big one waits even though it alone would fit."""
    gate = Gate(limit=10, byte_budget=100, max_queue=10)
    running = await gate.acquire(60, 5)
    big = asyncio.create_task(gate.acquire(80, 5))
    await _queued(gate, 1)
    small = asyncio.create_task(gate.acquire(10, 5))
    await _queued(gate, 2)
    assert not big.done() and not small.done()
    running.release()
    assert (await big).cost == 80
    assert (await small).cost == 10  # 80 + 10 fits the budget of 100: both admitted, in order
    assert gate.bytes_in_use == 90


async def test_token_budget_holds_the_line_beside_the_byte_budget() -> None:
    """Image tokens are a second budget: FIFO like bytes, either budget can make the head wait, a request over
    the whole token budget alone is 413 naming its count and the setting, and the queue's 429s still apply."""
    gate = Gate(limit=10, byte_budget=100, max_queue=2, token_budget=1000)
    running = await gate.acquire(10, 5, tokens=700)
    big = asyncio.create_task(gate.acquire(10, 5, tokens=400))  # 700 + 400 tokens: over, bytes fit
    await _queued(gate, 1)
    small = asyncio.create_task(gate.acquire(10, 5, tokens=10))  # would fit alone: waits behind the head
    await _queued(gate, 2)
    with pytest.raises(MmgateError) as caught:
        await gate.acquire(0, 5, tokens=1)
    assert (caught.value.status, caught.value.code) == (429, "queue_full")
    with pytest.raises(MmgateError) as caught:
        await gate.acquire(0, 5, tokens=1001)
    assert (caught.value.status, caught.value.code) == (413, "too_many_image_tokens")
    assert "1001" in caught.value.message and "MMGATE_MAX_INFLIGHT_IMAGE_TOKENS" in caught.value.message
    assert not big.done() and not small.done() and gate.tokens_in_use == 700
    running.release()
    leases = [await big, await small]
    assert [lease.tokens for lease in leases] == [400, 10] and gate.tokens_in_use == 410
    for lease in leases:
        lease.release()
    assert (gate.in_use, gate.bytes_in_use, gate.tokens_in_use) == (0, 0, 0)


async def test_queue_full_and_retry_after() -> None:
    gate = Gate(limit=1, byte_budget=0, max_queue=1)
    held = await gate.acquire(0, 5)
    waiter = asyncio.create_task(gate.acquire(0, 5))
    await _queued(gate, 1)
    with pytest.raises(MmgateError) as caught:
        await gate.acquire(0, 5)
    assert (caught.value.status, caught.value.code) == (429, "queue_full")
    assert 1 <= int(caught.value.headers["Retry-After"]) <= 60
    held.release()
    (await waiter).release()


async def test_queue_timeout() -> None:
    gate = Gate(limit=1, byte_budget=0, max_queue=5)
    held = await gate.acquire(0, 5)
    with pytest.raises(MmgateError) as caught:
        await gate.acquire(0, 0.01)
    assert (caught.value.status, caught.value.code) == (429, "queue_timeout")
    assert gate.waiting == 0
    held.release()


async def test_cost_over_whole_budget_is_413_and_draining_503() -> None:
    draining = False
    gate = Gate(limit=1, byte_budget=100, max_queue=5, refusing=lambda: draining)
    with pytest.raises(MmgateError) as caught:
        await gate.acquire(101, 5)
    assert (caught.value.status, caught.value.code) == (413, "media_too_large")
    draining = True
    with pytest.raises(MmgateError) as caught:
        await gate.acquire(1, 5)
    assert (caught.value.status, caught.value.code) == (503, "draining")


async def test_cancelled_head_lets_the_next_in() -> None:
    gate = Gate(limit=1, byte_budget=100, max_queue=5)
    held = await gate.acquire(50, 5)
    head = asyncio.create_task(gate.acquire(90, 5))  # blocks: 50 + 90 > 100
    await _queued(gate, 1)
    behind = asyncio.create_task(gate.acquire(0, 5))
    await _queued(gate, 2)
    head.cancel()
    with pytest.raises(asyncio.CancelledError):
        await head
    assert gate.waiting == 1
    held.release()
    (await behind).release()
    assert (gate.in_use, gate.bytes_in_use, gate.waiting) == (0, 0, 0)


class GateMachine(RuleBasedStateMachine):
    """Random acquire / cancel / timeout / release, and places taken while a body arrives (then used for
    acquire, or dropped): limits hold and nothing leaks."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.gate = Gate(limit=3, byte_budget=100, max_queue=4)
        self.pending: list[asyncio.Task[Lease]] = []
        self.leases: list[Lease] = []
        self.places: list[Place] = []

    def _turn(self) -> None:
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))
        for task in [t for t in self.pending if t.done()]:
            self.pending.remove(task)
            if not task.cancelled() and task.exception() is None:
                self.leases.append(task.result())

    @rule(cost=st.integers(0, 120), timeout=st.sampled_from([0.0, 60.0]))
    def acquire(self, cost: int, timeout: float) -> None:
        self.pending.append(self.loop.create_task(self.gate.acquire(cost, timeout)))
        self._turn()

    @rule()
    def take_place(self) -> None:
        try:
            self.places.append(self.gate.take_place())
        except MmgateError as refused:
            assert refused.code == "queue_full"

    @precondition(lambda self: self.places)
    @rule(index=st.integers(0, 100), cost=st.integers(0, 120), use=st.booleans())
    def body_arrived(self, index: int, cost: int, use: bool) -> None:
        place = self.places.pop(index % len(self.places))
        if use:  # media found: the place becomes a queue entry
            self.pending.append(self.loop.create_task(self.gate.acquire(cost, 60.0, place)))
        else:  # no media after all, or the client left
            place.release()
            place.release()
        self._turn()

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 100))
    def cancel_waiter(self, index: int) -> None:
        self.pending[index % len(self.pending)].cancel()
        self._turn()

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 100), twice=st.booleans())
    def release(self, index: int, twice: bool) -> None:
        lease = self.leases.pop(index % len(self.leases))
        lease.release()
        if twice:
            lease.release()
        self._turn()

    @invariant()
    def within_limits(self) -> None:
        gate = self.gate
        assert 0 <= gate.in_use <= gate.limit
        assert 0 <= gate.bytes_in_use <= gate.byte_budget
        assert gate.reading == len(self.places)
        # Bodies held = in use + waiting + reading <= 2 x limit + max_queue: README's memory bound.
        assert gate.waiting + gate.reading <= gate.max_queue + gate.limit
        assert gate.in_use == len(self.leases) + sum(
            1 for t in self.pending if t.done() and not t.cancelled() and t.exception() is None
        )
        assert gate.bytes_in_use == sum(lease.cost for lease in self.leases)

    def teardown(self) -> None:
        for task in self.pending:
            task.cancel()
        self._turn()
        for lease in self.leases:
            lease.release()
        for place in self.places:
            place.release()
        assert (self.gate.in_use, self.gate.bytes_in_use, self.gate.waiting, self.gate.reading) == (0, 0, 0, 0)
        self.loop.close()


async def test_places_count_against_the_line() -> None:
    gate = Gate(limit=1, byte_budget=0, max_queue=1)
    first, second = gate.take_place(), gate.take_place()
    with pytest.raises(MmgateError) as refused:
        gate.take_place()  # slot + queue place both taken by bodies still arriving
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert refused.value.message == ("the media queue is full (2 places: 1 slot + MMGATE_MAX_QUEUE=1): 0 running, "
                                     "0 waiting and 2 still arriving (a body being read holds its place); retry "
                                     "later")
    assert "Retry-After" in refused.value.headers
    small = await gate.acquire(1, 5)  # a small request, ready now, takes the free slot: ready first, served first
    with pytest.raises(MmgateError):
        await gate.acquire(1, 5)  # but another one without a place finds the line full
    waiting = [asyncio.create_task(gate.acquire(1, 5, place)) for place in (first, second)]
    await _queued(gate, 2)  # places turn into queue entries, never refused: they were counted
    assert (gate.in_use, gate.waiting, gate.reading) == (1, 2, 0)
    small.release()
    (await waiting[0]).release()
    (await waiting[1]).release()
    first.release()  # idempotent: already given back by acquire
    assert (gate.in_use, gate.waiting, gate.reading) == (0, 0, 0)


TestGateMachine = GateMachine.TestCase
TestGateMachine.settings = hsettings(max_examples=150, stateful_step_count=40, deadline=None)
