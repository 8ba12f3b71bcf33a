"""One gate for several front processes (``MMGATE_PROCESSES`` > 1): the ``admission.gate.Gate`` runs in the
supervisor, and each front reaches it over a Unix socket pair (``processes.link``).

Why one place: a gate split across processes would admit N times its limits; a shared-memory counter
cannot keep one FIFO across processes, nor per-flow turns and priority bands. So the very ``Gate`` class
of a single process runs, unchanged, in the supervisor's event loop, and every guarantee it gives (exact
slots, byte and token budgets, one FIFO per flow, bands, deadlines, release exactly once) holds for all
fronts together. A front's ``RemoteGate`` is its ``GateClient``: ``take_place`` and ``acquire`` are one round
trip each; releases, hand-offs and samples are one message, never waited for.

Every answer carries the gate's ``GateCounters`` after the operation: a front mirrors them in its gauges. A
front that goes away (exit, crash, SIGKILL) closes its end: the gate cancels its waits and gives back its
places and leases at once. A gate that goes away (the supervisor died) tells a front to stop: it drains like
on SIGINT and exits.

Neither side waits on the other without a deadline (``MMGATE_PROCESS_TIMEOUT``, "the bound"). The supervisor
pings every front; one that leaves two pings in a row unanswered, each within half the bound, is hung: it is
killed, everything it held given back, and another started. A front's round trips: a place or the counters
within the bound; ``Collect`` within the gate's own bound on the fronts' reports plus it; ``Peek`` within
twice ``PEER_TIMEOUT`` (past it, no peer holds the item: the front decodes). A wait for a slot ends, if the
gate says nothing, at the first of two bounds, each waited once: the request's queue timeout, by when the gate
has refused or admitted it (the refusal is awaited past it only while the gate has been heard within
``GATE_SILENCE``: a running gate pings every front each ``PING_INTERVAL``), and the bound, counted from the
question or the gate's last message. A round trip past its deadline is 503 ``gate_unavailable``, its message
naming the bound that ended it, and /mmgate/ready fails until the gate answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from preprocessors.errors import GATE_UNAVAILABLE, MmgateError, draining, gate_unavailable
from preprocessors.job import Verdict
from proxy.admission.client import GateCounters, PeerLookup
from proxy.admission.flows import DEFAULT_FLOW, Flow
from proxy.admission.sample import Sample
from proxy.processes import messages
from proxy.processes.link import Link
from proxy.state import Lifecycle

log = logging.getLogger("mmgate")

A = TypeVar("A", bound=messages.Answer)
GiveBack = type[messages.Unplace] | type[messages.Release]  # what undoes a grant nobody waits for any more


@dataclass(eq=False)
class RemotePlace:
    """A place held at the supervisor's gate: giving it back is one message there."""

    gate: RemoteGate
    place_id: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate.link.send(messages.Unplace(self.place_id))


@dataclass(eq=False)
class RemoteLease:
    """A lease held at the supervisor's gate: releasing, lowering or handing it off is one message there."""

    gate: RemoteGate
    lease_id: int
    cost: int
    released: bool = False
    deferred: bool = False  # the release waits for work that has not stopped yet (``release_after``)
    forwarded: bool = False

    def handed_off(self) -> None:
        if not self.forwarded:
            self.forwarded = True
            if not self.released:
                self.gate.link.send(messages.HandedOff(self.lease_id))

    def release(self) -> None:
        if not self.released and not self.deferred:
            self._give_back()

    def lower(self, cost: int) -> None:
        if not self.released and 0 <= cost < self.cost:
            self.cost = cost
            self.gate.link.send(messages.Lower(self.lease_id, cost))

    def release_after(self, work: Awaitable[object]) -> None:
        """``Lease.release_after``: the slot is kept until ``work`` has really stopped."""
        if self.released or self.deferred:
            return
        self.deferred = True
        asyncio.ensure_future(work).add_done_callback(lambda _task: self._give_back())

    def _give_back(self) -> None:
        if not self.released:
            self.released = True
            self.gate.link.send(messages.Release(self.lease_id))


class RemoteGate:
    """A front's ``GateClient`` for the supervisor's Gate. Its counters mirror the gate's as of the last answer
    (for this front's gauges); every decision is the gate's."""

    def __init__(self, link: Link, limit: int, on_change: Callable[[GateCounters], None], lifecycle: Lifecycle,
                 report: Callable[[], dict[str, Any]], on_lost: Callable[[], None],
                 answer_timeout: float = 10.0) -> None:
        self.link = link
        self.lifecycle = lifecycle
        self._on_change = on_change
        self._report = report
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._answers: dict[int, asyncio.Future[messages.Answer]] = {}
        # rid -> what to send back if the gate's grant finds nobody waiting for it
        self._give_backs: dict[int, GiveBack] = {}
        self.lost = False
        # MMGATE_PROCESS_TIMEOUT: how long the gate may take to answer a question that needs no wait
        self.answer_timeout = answer_timeout
        # False from a round trip past its deadline until the gate's next message: the gate is hung
        self.answering = True
        self._heard = 0.0  # the loop's time of the gate's last message
        self._reader: asyncio.Task[None] | None = None
        # hex keys -> what this front's cache holds of them (``share_cache``)
        self._cached: Callable[[bytes], Verdict | None] = lambda key: None
        self._counters = GateCounters(0, 0, 0, 0, 0, 0, limit)
        on_change(self._counters)

    def start(self) -> None:
        self._heard = asyncio.get_running_loop().time()
        self._reader = asyncio.create_task(self._read())

    def ready(self) -> None:
        self.link.send(messages.Ready())

    async def close(self) -> None:
        self.link.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    def counters(self) -> GateCounters:
        return self._counters

    async def _read(self) -> None:
        while (message := await self.link.receive()) is not None:
            self.answering = True
            self._heard = asyncio.get_running_loop().time()
            match message:
                case messages.Ping(qid):
                    self.link.send(messages.Pong(qid))
                case messages.AskReport(qid):
                    try:
                        report = self._report()
                    except Exception:  # a front that cannot report is left out of the totals, not stopped
                        log.exception("metrics report failed")
                        continue
                    self.link.send(messages.Report(qid, report))
                case messages.Lookup(qid, keys):
                    self.link.send(messages.Found(qid, {key: messages.verdict_to_wire(verdict) for key in keys
                                               if (verdict := self._cached(bytes.fromhex(key))) is not None}))
                case messages.Answer():
                    self._answered(message)
        self.lost = True
        for future in self._answers.values():
            if not future.done():
                future.set_exception(draining())
        self._answers.clear()
        self._give_backs.clear()
        self._on_lost()

    def _answered(self, answer: messages.Answer) -> None:
        """The gate's answer to one of this front's questions."""
        self._counters = answer.counters
        self._on_change(answer.counters)
        future = self._answers.pop(answer.rid, None)
        give_back = self._give_backs.pop(answer.rid, None)
        if future is not None:
            # Still asked for. If the request was cancelled meanwhile, ``_given_up`` (on the task's next step)
            # finds the future done and gives the grant back.
            future.set_result(answer)
        elif give_back is not None:
            # Granted after the request gave up (or after its deadline): given back here.
            self._undo(answer, give_back)

    def _undo(self, answer: messages.Answer, give_back: GiveBack | None) -> None:
        match answer:
            case messages.Placed(place=granted) | messages.Admitted(lease=granted) if give_back is not None:
                self.link.send(give_back(granted))

    async def _ask(self, question: Callable[[int], messages.Message], expected: type[A], give_back: GiveBack | None,
                   deadline: float, *, queue_timeout: float | None = None) -> A:
        """Send ``question`` (made with its id) and await the gate's answer; 503 ``gate_unavailable`` if none
        came within ``deadline`` seconds (what the gate grants later is given back, as for a request that gave
        up). ``queue_timeout``: the question is a wait in the queue, which the gate ends itself by then; the
        answer is awaited until then or until the gate has been silent for ``deadline``, whichever comes first
        (``_until_silent``)."""
        if self.lost:
            raise draining()
        rid = next(self._ids)
        sent = question(rid)
        future: asyncio.Future[messages.Answer] = asyncio.get_running_loop().create_future()
        self._answers[rid] = future
        if give_back is not None:
            self._give_backs[rid] = give_back
        self.link.send(sent)
        bound = f"MMGATE_PROCESS_TIMEOUT ({deadline:g} s)"
        try:
            if queue_timeout is not None:
                bound = await self._until_silent(future, queue_timeout, deadline)
            else:
                await asyncio.wait([future], timeout=deadline)
        except asyncio.CancelledError:
            self._given_up(rid, future, give_back)
            raise
        if not future.done():
            self._given_up(rid, future, give_back)
            raise self._silent(sent.TAG, bound)
        answer = future.result()  # draining() once the gate is gone
        match answer:
            case messages.Refused():
                raise answer.error()
            case messages.WaitCancelled():  # only for a wait this front called off itself, or a front that is gone
                raise gate_unavailable()
        if not isinstance(answer, expected):
            raise RuntimeError(f"the gate answered {sent.TAG!r} with {answer.TAG!r}")
        return answer

    async def _until_silent(self, future: asyncio.Future[messages.Answer], queue_timeout: float,
                            bound: float) -> str:
        """Wait for the answer to a wait in the queue, asked now. Unanswered, the bound that ended the wait: the
        gate silent for ``bound`` (from now or its last message) before the queue timeout, or the queue
        timeout passed with the gate silent for ``GATE_SILENCE`` (its refusal is not on its way). One wait,
        and no question of its own: a running gate is heard anyway (its pings)."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        queue_ends = asked + queue_timeout
        ended_by = ""
        while not future.done():
            heard = max(self._heard, asked)
            if heard + bound < queue_ends:
                silent_at, ended_by = heard + bound, f"MMGATE_PROCESS_TIMEOUT ({bound:g} s)"
            else:
                silent_at = max(queue_ends, heard + min(bound, messages.GATE_SILENCE))
                ended_by = f"the request's queue timeout ({queue_timeout:g} s)"
            if (left := silent_at - loop.time()) <= 0:
                break
            await asyncio.wait([future], timeout=left)
        return ended_by

    def _given_up(self, rid: int, future: asyncio.Future[messages.Answer], give_back: GiveBack | None) -> None:
        """The asking request gave up (its client left, or the gate was silent past the deadline)."""
        self._answers.pop(rid, None)
        if future.done():
            # Answered in the same instant the request gave up: what the gate granted goes back.
            if future.exception() is None:
                self._undo(future.result(), give_back)
        elif give_back is messages.Release and rid in self._give_backs:
            # Still waiting at the gate: stop the wait there. A grant that crosses this message is given
            # back by ``_read``, which still knows what to send for it.
            self.link.send(messages.Cancel(rid))

    def _silent(self, op: str, bound: str) -> MmgateError:
        if self.answering:  # once per silence, not once per request
            log.warning("the shared gate did not answer %r within %s", op, bound)
        self.answering = False
        unavailable = gate_unavailable()
        return GATE_UNAVAILABLE.error(f"mmgate's admission gate did not answer within {bound}; retry shortly",
                                      headers=unavailable.headers)

    async def take_place(self, flow: Flow = DEFAULT_FLOW) -> RemotePlace:
        if self.lifecycle.refusing:
            raise draining()
        placed = await self._ask(lambda rid: messages.TakePlace(rid, flow), messages.Placed, messages.Unplace,
                                 self.answer_timeout)
        return RemotePlace(self, placed.place)

    async def acquire(self, cost: int, timeout: float, place: RemotePlace | None = None, tokens: int = 0,
                      flow: Flow = DEFAULT_FLOW) -> RemoteLease:
        place_id = None
        if place is not None and not place.released:
            place.released = True  # the gate turns it into a queue entry
            place_id = place.place_id
        if self.lifecycle.refusing:
            if place_id is not None:
                self.link.send(messages.Unplace(place_id))
            raise draining()
        admitted = await self._ask(lambda rid: messages.Acquire(rid, cost, timeout, place_id, tokens, flow),
                                   messages.Admitted, messages.Release, self.answer_timeout, queue_timeout=timeout)
        return RemoteLease(self, admitted.lease, cost)

    def controller(self) -> dict[str, object] | None:
        """The supervisor's controller is not shown by a front (``/mmgate/stats`` of one process only)."""
        return None

    def observe(self, lease: RemoteLease, sample: Sample) -> None:
        """``Gate.observe`` at the supervisor's gate: one message, sent before the lease's release."""
        if not lease.released:
            self.link.send(messages.Observe(lease.lease_id, sample))

    async def collect(self) -> dict[str, Any]:
        """Every front's metrics, merged by the gate (``merge_reports``)."""
        collected = await self._ask(messages.Collect, messages.Collected, None,
                                    messages.REPORT_TIMEOUT + self.answer_timeout)
        return collected.merged

    def share_cache(self, lookup: Callable[[bytes], Verdict | None]) -> PeerLookup:
        self._cached = lookup
        return self.peer_verdicts

    async def peer_verdicts(self, keys: list[bytes]) -> dict[bytes, Verdict]:
        """What the other fronts' caches hold of ``keys``: a miss here need not be a decode."""
        if self.lost or not self.answering:
            return {}
        try:
            peeked = await self._ask(lambda rid: messages.Peek(rid, [key.hex() for key in keys]), messages.Peeked,
                                     None, 2 * messages.PEER_TIMEOUT)
        except MmgateError:  # the gate is hung or gone: this front decodes
            return {}
        return {bytes.fromhex(key): messages.verdict_from_wire(wire) for key, wire in peeked.found.items()}

    async def refresh(self) -> None:
        """The gate's counters as of now, mirrored here (``waiting_media`` for ``MMGATE_BACKEND_METRICS``)."""
        await self._ask(messages.AskCounters, messages.Counted, None, self.answer_timeout)

    async def reachable(self, timeout: float) -> bool:
        """Whether the gate answers within ``timeout`` (for /mmgate/ready)."""
        try:
            await self._ask(messages.AskCounters, messages.Counted, None, timeout)
        except MmgateError:
            return False
        return True
