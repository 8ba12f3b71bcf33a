"""The supervisor's side of the shared gate: the one ``admission.gate.Gate`` of all front processes, served over
each front's socket pair (``processes.link``; why one gate: ``processes.remote_gate``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from preprocessors.errors import MmgateError
from proxy.admission.client import GateCounters
from proxy.admission.flows import Flow
from proxy.admission.gate import Gate, Lease, Place
from proxy.ops.merged_metrics import departed, merge_reports
from proxy.processes import messages
from proxy.processes.link import Link

log = logging.getLogger("mmgate")


class _Front:
    """What one front holds at the gate; all of it is given back when its link closes."""

    def __init__(self, index: int, link: Link) -> None:
        self.index = index
        self.link = link
        self.places: dict[int, Place] = {}
        self.leases: dict[int, Lease] = {}
        self.waits: dict[int, asyncio.Task[None]] = {}
        self.closed = False
        self.ready = asyncio.Event()
        # False once it left a question ("ping", "report", "lookup") unanswered, until it sends anything:
        # a hung front is not asked again (nobody waits on it), and its last report stands in for it.
        self.answering = True
        self.last_report: dict[str, Any] | None = None


class GateServer:
    """Serves one ``Gate`` to every front. Runs in the supervisor's event loop, like the Gate itself."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._fronts: set[_Front] = set()
        self._ids = itertools.count(1)
        self._reports: dict[int, tuple[asyncio.Future[Any], int]] = {}
        self._collecting: set[asyncio.Task[None]] = set()
        self._departed: dict[str, Any] | None = None  # the counts of every front gone (``merged_metrics.departed``)

    async def serve(self, index: int, sock: socket.socket, ready: asyncio.Event) -> None:
        """Serve one front until its link closes, then free everything it held."""
        front = _Front(index, await Link.over(sock))
        front.ready = ready
        self._fronts.add(front)
        try:
            while (message := await front.link.receive()) is not None:
                front.answering = True
                self._handle(front, message)
        finally:
            self._forget(front)

    def _counters(self) -> GateCounters:
        return GateCounters.of(self.gate)

    def _handle(self, front: _Front, message: messages.Message) -> None:
        match message:
            case messages.Acquire(rid, cost, timeout, place_id, tokens, flow):
                place = front.places.pop(place_id, None) if place_id is not None else None
                task = front.waits[rid] = asyncio.create_task(
                    self._acquire(front, rid, cost, timeout, place, tokens, flow))
                task.add_done_callback(partial(self._wait_ended, front, rid, place))
            case messages.Release(lease_id):
                if (lease := front.leases.pop(lease_id, None)) is not None:
                    lease.release()
            case messages.Lower(lease_id, cost):
                if (lease := front.leases.get(lease_id)) is not None:
                    lease.lower(cost)
            case messages.HandedOff(lease_id):
                if (lease := front.leases.get(lease_id)) is not None:
                    lease.handed_off()
            case messages.Observe(lease_id, sample):
                if (lease := front.leases.get(lease_id)) is not None:
                    self.gate.observe(lease, sample)
            case messages.TakePlace(rid, flow):
                self._take_place(front, rid, flow)
            case messages.Unplace(place_id):
                if (place := front.places.pop(place_id, None)) is not None:
                    place.release()
            case messages.Cancel(rid):
                if (wait := front.waits.get(rid)) is not None:
                    wait.cancel()
            case messages.Collect(rid):
                self._in_background(self._collect(front, rid))
            case messages.Peek(rid, keys):
                self._in_background(self._peek(front, rid, keys))
            case messages.Report(qid, answer) | messages.Found(qid, answer):
                self._heard_back(qid, answer)
            case messages.Pong(qid):
                self._heard_back(qid, None)
            case messages.AskCounters(rid):
                front.link.send(messages.Counted(rid, self._counters()))
            case messages.Ready():
                front.ready.set()

    def _take_place(self, front: _Front, rid: int, flow: Flow) -> None:
        try:
            place = self.gate.take_place(flow)
        except MmgateError as error:
            front.link.send(messages.Refused.of(rid, error, self._counters()))
            return
        place_id = next(self._ids)
        front.places[place_id] = place
        front.link.send(messages.Placed(rid, self._counters(), place_id))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._collecting.add(task)
        task.add_done_callback(self._collecting.discard)

    def _heard_back(self, qid: int, answer: Any) -> None:
        """A front's answer to the gate's question ``qid`` (``_ask_fronts``)."""
        found = self._reports.get(qid)
        if found is not None and not found[0].done():
            found[0].set_result(answer)

    async def _acquire(self, front: _Front, rid: int, cost: int, timeout: float, place: Place | None,
                       tokens: int, flow: Flow) -> None:
        try:
            lease = await self.gate.acquire(cost, timeout, place, tokens, flow)
        except MmgateError as error:
            front.link.send(messages.Refused.of(rid, error, self._counters()))
            return
        if front.closed:
            lease.release()
            return
        lease_id = next(self._ids)
        front.leases[lease_id] = lease
        front.link.send(messages.Admitted(rid, self._counters(), lease_id))

    def _wait_ended(self, front: _Front, rid: int, place: Place | None, task: asyncio.Task[None]) -> None:
        front.waits.pop(rid, None)
        if task.cancelled():  # the front's request gave up, or the front is gone
            if place is not None:
                place.release()  # a wait cancelled before it began still held its place; else a no-op
            front.link.send(messages.WaitCancelled(rid, self._counters()))

    def _forget(self, front: _Front) -> None:
        if front.closed:
            return
        front.closed = True
        if front.last_report is not None:
            self._departed = departed(self._departed, front.last_report)
        self._fronts.discard(front)
        for task in front.waits.values():
            task.cancel()
        for place in front.places.values():
            place.release()
        for lease in front.leases.values():
            lease.release()
        held = len(front.places) + len(front.leases)
        if held:
            log.warning("front process %d went away holding %d lease(s) and place(s): given back", front.index,
                        held)
        front.places.clear()
        front.leases.clear()
        front.link.close()

    async def _ask_fronts(self, fronts: list[_Front], question: Callable[[int], messages.Message],
                          timeout: float) -> list[tuple[_Front, Any]]:
        """Send ``question`` (made with its id, one per front) to ``fronts``; the answers that came within
        ``timeout``, each with its front. A front that did not answer is marked not ``answering``."""
        loop = asyncio.get_running_loop()
        pending = []
        for front in fronts:
            query_id = next(self._ids)
            future: asyncio.Future[Any] = loop.create_future()
            self._reports[query_id] = (future, front.index)
            pending.append((query_id, future, front))
            front.link.send(question(query_id))
        if not pending:
            return []
        try:
            done, _ = await asyncio.wait([future for _, future, _ in pending], timeout=timeout)
        finally:
            for query_id, _, _ in pending:
                self._reports.pop(query_id, None)
        for _, future, front in pending:
            if future not in done:
                front.answering = False
        return [(front, future.result()) for _, future, front in pending if future in done]

    async def _collect(self, asking: _Front, rid: int) -> None:
        """Ask every answering front for its metrics and send ``asking`` the merge. A front that does not
        answer (hung) counts with its last report, as does every front gone, so no total ever goes down."""
        serving = [front for front in self._fronts if front.ready.is_set()]
        answered = await self._ask_fronts([front for front in serving if front.answering], messages.AskReport,
                                          messages.REPORT_TIMEOUT)
        for front, report in answered:
            front.last_report = report
        reported = {front for front, _ in answered}
        silent = [front.last_report for front in serving if front not in reported and front.last_report is not None]
        if self._departed is not None:
            silent.append(self._departed)
        counters = self._counters()
        merged = merge_reports([report for _, report in answered], counters, silent)
        asking.link.send(messages.Collected(rid, counters, merged))

    async def _peek(self, asking: _Front, rid: int, keys: list[str]) -> None:
        """Ask every other answering front which of ``keys`` its cache holds; send ``asking`` the first of each
        found. A hung front is asked once: until it speaks again, a miss does not wait on it."""
        others = [front for front in self._fronts
                  if front is not asking and front.ready.is_set() and front.answering]
        found: dict[str, Any] = {}
        answers = await self._ask_fronts(others, lambda qid: messages.Lookup(qid, keys), messages.PEER_TIMEOUT)
        for _, answer in answers:
            for key, verdict in answer.items():
                found.setdefault(key, verdict)
        asking.link.send(messages.Peeked(rid, self._counters(), found))

    async def ping(self, index: int, timeout: float) -> bool | None:
        """Whether front ``index`` answers a ping within ``timeout`` (its event loop runs); None if it is gone."""
        front = self._front(index)
        if front is None:
            return None
        return bool(await self._ask_fronts([front], messages.Ping, timeout))

    def drop(self, index: int) -> None:
        """Give back at once everything front ``index`` holds: it is being killed."""
        if (front := self._front(index)) is not None:
            self._forget(front)

    def _front(self, index: int) -> _Front | None:
        return next((front for front in self._fronts if front.index == index), None)

    @property
    def fronts(self) -> int:
        return len(self._fronts)

