"""The supervisor's side of the shared gate: the one ``admission.Gate`` of all front processes, served over
each front's socket pair (the protocol is drawn in ``processes.remote_gate``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from functools import partial
from typing import Any

from preprocessors.errors import MmgateError
from proxy.admission.flows import Flow
from proxy.admission.gate import Gate, Lease, Place
from proxy.processes.merged_metrics import departed, merge_reports
from proxy.processes.remote_gate import PEER_TIMEOUT, REPORT_TIMEOUT, Link, counters

log = logging.getLogger("mmgate")


def _refusal(error: MmgateError) -> list[Any]:
    return [error.status, error.code, error.message, error.headers]


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

    def _handle(self, front: _Front, message: list[Any]) -> None:
        op = message[0]
        gate = self.gate
        if op == "acquire":
            _, rid, cost, timeout, place_id, tokens, flow_id, band, client = message
            place = front.places.pop(place_id, None) if place_id is not None else None
            task = front.waits[rid] = asyncio.create_task(
                self._acquire(front, rid, cost, timeout, place, tokens, Flow(flow_id, band, client)))
            task.add_done_callback(partial(self._wait_ended, front, rid, place))
        elif op == "release":
            if (lease := front.leases.pop(message[1], None)) is not None:
                lease.release()
        elif op == "lower":
            if (lease := front.leases.get(message[1])) is not None:
                lease.lower(message[2])
        elif op == "handed_off":
            if (lease := front.leases.get(message[1])) is not None:
                lease.handed_off()
        elif op == "place":
            _, rid, flow_id, band, client = message
            try:
                place = gate.take_place(Flow(flow_id, band, client))
            except MmgateError as error:
                front.link.send(["err", rid, *_refusal(error), counters(gate)])
                return
            place_id = next(self._ids)
            front.places[place_id] = place
            front.link.send(["ok", rid, place_id, counters(gate)])
        elif op == "unplace":
            if (place := front.places.pop(message[1], None)) is not None:
                place.release()
        elif op == "cancel":
            if (wait := front.waits.get(message[1])) is not None:
                wait.cancel()
        elif op == "collect":
            task = asyncio.create_task(self._collect(front, message[1]))
            self._collecting.add(task)
            task.add_done_callback(self._collecting.discard)
        elif op in ("report", "found", "pong"):
            found = self._reports.get(message[1])
            if found is not None and not found[0].done():
                found[0].set_result(message[2] if len(message) > 2 else None)
        elif op == "peek":
            task = asyncio.create_task(self._peek(front, message[1], message[2]))
            self._collecting.add(task)
            task.add_done_callback(self._collecting.discard)
        elif op == "counters":
            front.link.send(["ok", message[1], None, counters(gate)])
        elif op == "ready":
            front.ready.set()

    async def _acquire(self, front: _Front, rid: int, cost: int, timeout: float, place: Place | None,
                       tokens: int, flow: Flow) -> None:
        try:
            lease = await self.gate.acquire(cost, timeout, place, tokens, flow)
        except MmgateError as error:
            front.link.send(["err", rid, *_refusal(error), counters(self.gate)])
            return
        if front.closed:
            lease.release()
            return
        lease_id = next(self._ids)
        front.leases[lease_id] = lease
        front.link.send(["ok", rid, lease_id, counters(self.gate)])

    def _wait_ended(self, front: _Front, rid: int, place: Place | None, task: asyncio.Task[None]) -> None:
        front.waits.pop(rid, None)
        if task.cancelled():  # the front's request gave up, or the front is gone
            if place is not None:
                place.release()  # a wait cancelled before it began still held its place; else a no-op
            front.link.send(["err", rid, 499, "cancelled", "", {}, counters(self.gate)])

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

    async def _ask_fronts(self, fronts: list[_Front], message: list[Any],
                          timeout: float) -> list[tuple[_Front, Any]]:
        """Send ``message`` (its id filled in per front) to ``fronts``; the answers that came within
        ``timeout``, each with its front. A front that did not answer is marked not ``answering``."""
        loop = asyncio.get_running_loop()
        pending = []
        for front in fronts:
            query_id = next(self._ids)
            future: asyncio.Future[Any] = loop.create_future()
            self._reports[query_id] = (future, front.index)
            pending.append((query_id, future, front))
            front.link.send([message[0], query_id, *message[1:]])
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
        answered = await self._ask_fronts([front for front in serving if front.answering], ["report"],
                                          REPORT_TIMEOUT)
        for front, report in answered:
            front.last_report = report
        reported = {front for front, _ in answered}
        silent = [front.last_report for front in serving if front not in reported and front.last_report is not None]
        if self._departed is not None:
            silent.append(self._departed)
        merged = merge_reports([report for _, report in answered], counters(self.gate), silent)
        asking.link.send(["ok", rid, merged, counters(self.gate)])

    async def _peek(self, asking: _Front, rid: int, keys: list[str]) -> None:
        """Ask every other answering front which of ``keys`` its cache holds; send ``asking`` the first of each
        found. A hung front is asked once: until it speaks again, a miss does not wait on it."""
        others = [front for front in self._fronts
                  if front is not asking and front.ready.is_set() and front.answering]
        found: dict[str, Any] = {}
        for _, answer in await self._ask_fronts(others, ["lookup", keys], PEER_TIMEOUT):
            for key, verdict in answer.items():
                found.setdefault(key, verdict)
        asking.link.send(["ok", rid, found, counters(self.gate)])

    async def ping(self, index: int, timeout: float) -> bool | None:
        """Whether front ``index`` answers a ping within ``timeout`` (its event loop runs); None if it is gone."""
        front = self._front(index)
        if front is None:
            return None
        return bool(await self._ask_fronts([front], ["ping"], timeout))

    def drop(self, index: int) -> None:
        """Give back at once everything front ``index`` holds: it is being killed."""
        if (front := self._front(index)) is not None:
            self._forget(front)

    def _front(self, index: int) -> _Front | None:
        return next((front for front in self._fronts if front.index == index), None)

    @property
    def fronts(self) -> int:
        return len(self._fronts)

