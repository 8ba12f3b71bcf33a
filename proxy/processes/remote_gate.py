"""One gate for several front processes (``MMGATE_PROCESSES`` > 1): the ``admission.Gate`` runs in the
supervisor, and each front reaches it over a Unix socket pair with a tiny protocol.

Why one place: a gate split across processes would admit N times its limits; a shared-memory counter
cannot keep one FIFO across processes, nor per-flow turns and priority bands. So the very ``Gate`` class
of a single process runs, unchanged, in the supervisor's event loop, and every guarantee it gives (exact
slots, byte and token budgets, one FIFO per flow, bands, deadlines, release exactly once) holds for all
fronts together. A front's ``SharedGate`` stands in for it: ``take_place`` and ``acquire`` are one round
trip each; releases and hand-offs are one message, never waited for.

Frames: a 4-byte big-endian length, then an orjson array whose first element names the message.

front -> gate::

    ["ready"]                                          the front listens
    ["place", rid, flow id, band, client]              Gate.take_place
    ["acquire", rid, cost, timeout, place, tokens, flow id, band, client]
    ["cancel", rid]                                    the request gave up waiting
    ["unplace", place]    ["release", lease]    ["handed_off", lease]
    ["lower", lease, cost]                             Lease.lower: the lease weighs fewer bytes from now on
    ["collect", rid]                                   every front's metrics, merged
    ["counters", rid]                                  the gate's counters now
    ["peek", rid, [key, ...]]                          cache entries another front holds (hex keys)
    ["found", qid, {key: verdict}]                     the answer to the gate's "lookup"
    ["report", rid, report]                            the answer to the gate's "report"
    ["pong", qid]                                      the answer to the gate's "ping"

gate -> front::

    ["ok", rid, value, counters]    ["err", rid, status, code, message, headers, counters]
    ["report", rid]                                    this front's metrics, please
    ["lookup", qid, [key, ...]]                        which of these cache entries do you hold?
    ["ping", qid]                                      are you there? (answered by the front's event loop)

``counters`` is the gate's ``[in_use, waiting, reading, preparing, bytes_in_use, tokens_in_use, limit]``
after the operation: a front mirrors them in its gauges. A front that goes away (exit, crash, SIGKILL)
closes its end: the gate cancels its waits and gives back its places and leases at once. A gate that goes
away (the supervisor died) tells a front to stop: it drains like on SIGINT and exits.

Neither side waits on the other without a deadline (``MMGATE_PROCESS_TIMEOUT``, "the bound"). The supervisor
pings every front; one that leaves two pings in a row unanswered, each within half the bound, is hung: it is
killed, everything it held given back, and another started. A front's round trips: a place or the counters
within the bound; ``collect`` within the gate's own bound on the fronts' reports plus it; ``peek`` within
twice ``PEER_TIMEOUT`` (past it, no peer holds the item: the front decodes); a wait for a slot may last its
queue timeout, but once the gate has been silent for the bound the front asks it for its counters, and
unanswered the wait is called off. A round trip past its deadline is 503 ``gate_unavailable``, and
/mmgate/ready fails until the gate answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from preprocessors.errors import MmgateError, draining, gate_unavailable, rebuild
from preprocessors.job import Refusal, Verdict
from proxy.admission.flows import DEFAULT_FLOW, Flow
from proxy.admission.gate import Gate, Lease, Place
from proxy.serve.lifecycle import Lifecycle

log = logging.getLogger("mmgate")

# Seconds a front has to answer "report"; one that does not counts with its last report and is not asked again
# until it answers a ping.
REPORT_TIMEOUT = 2.0
# Seconds the other fronts have to say which cache entries they hold: a busy front's answer may come later
# than a decode would take, and then the asking front decodes.
PEER_TIMEOUT = 0.5

_LENGTH = struct.Struct(">I")
MAX_FRAME = 64 << 20  # a report of every metric series is well under this; anything bigger is a fault


def counters(gate: Gate) -> list[int]:
    return [gate.in_use, gate.waiting, gate.reading, gate.preparing, gate.bytes_in_use, gate.tokens_in_use,
            gate.limit]


def gate_values(snapshot: list[int]) -> dict[str, float]:
    """``counters`` as the gauges that show them."""
    in_use, waiting, reading, _preparing, bytes_in_use, tokens_in_use, limit = snapshot
    return {"mmgate_gate_in_use": in_use, "mmgate_gate_waiting": waiting, "mmgate_gate_reading": reading,
            "mmgate_media_bytes_inflight": bytes_in_use, "mmgate_image_tokens_inflight": tokens_in_use,
            "mmgate_gate_limit": limit}


class Link:
    """One end of a front's socket pair: framed orjson messages, written at once, read by ``receive``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def over(cls, sock: socket.socket) -> Link:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    def send(self, message: list[Any]) -> None:
        if self.writer.is_closing():
            return
        data = orjson.dumps(message)
        self.writer.write(_LENGTH.pack(len(data)) + data)

    async def receive(self) -> list[Any] | None:
        """The next message, or None once the other end is gone."""
        try:
            head = await self.reader.readexactly(_LENGTH.size)
            (length,) = _LENGTH.unpack(head)
            if length > MAX_FRAME:
                raise ValueError(f"a frame of {length} bytes")
            message = orjson.loads(await self.reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return None
        return message if isinstance(message, list) and message else None

    def close(self) -> None:
        self.writer.close()


# --- the gate's side (in the supervisor) --------------------------------------------------------------------


# --- a front's side -----------------------------------------------------------------------------------------


@dataclass(eq=False)
class SharedLease(Lease):
    """A lease held at the supervisor's gate: releasing or handing it off is one message there."""

    lease_id: int = 0

    def handed_off(self) -> None:
        if not self.forwarded:
            self.forwarded = True
            if not self.released:
                assert isinstance(self.gate, SharedGate)
                self.gate.link.send(["handed_off", self.lease_id])


@dataclass(eq=False)
class SharedPlace(Place):
    place_id: int = 0

    def release(self) -> None:
        if not self.released:
            self.released = True
            assert isinstance(self.gate, SharedGate)
            self.gate.link.send(["unplace", self.place_id])


class SharedGate(Gate):
    """A front's stand-in for the supervisor's Gate. Its counters mirror the gate's as of the last answer
    (for this front's gauges); every decision is the gate's."""

    def __init__(self, link: Link, limit: int, byte_budget: int, max_queue: int,
                 on_change: Callable[[Gate], None], lifecycle: Lifecycle, token_budget: int,
                 max_queue_per_flow: int, report: Callable[[], dict[str, Any]],
                 on_lost: Callable[[], None], answer_timeout: float = 10.0) -> None:
        super().__init__(limit, byte_budget, max_queue, on_change, lifecycle, token_budget=token_budget,
                         max_queue_per_flow=max_queue_per_flow)
        self.link = link
        self._report = report
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._answers: dict[int, asyncio.Future[list[Any]]] = {}
        # rid -> what to send back if the gate's grant finds nobody waiting for it ("release", "unplace")
        self._give_backs: dict[int, str] = {}
        self.lost = False
        # MMGATE_PROCESS_TIMEOUT: how long the gate may take to answer a question that needs no wait
        self.answer_timeout = answer_timeout
        # False from a round trip past its deadline until the gate's next message: the gate is hung
        self.answering = True
        self._heard = 0.0  # the loop's time of the gate's last message
        self._reader: asyncio.Task[None] | None = None
        # hex keys -> the wire form of the verdicts this front's cache holds (``app.build_state`` sets it)
        self.cached: Callable[[list[str]], dict[str, list[Any]]] | None = None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        self.link.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def _read(self) -> None:
        while (message := await self.link.receive()) is not None:
            self.answering = True
            self._heard = asyncio.get_running_loop().time()
            op = message[0]
            if op == "ping":
                self.link.send(["pong", message[1]])
                continue
            if op == "report":
                try:
                    report = self._report()
                except Exception:  # a front that cannot report is left out of the totals, not stopped
                    log.exception("metrics report failed")
                    continue
                self.link.send(["report", message[1], report])
                continue
            if op == "lookup":
                held = self.cached(message[2]) if self.cached is not None else {}
                self.link.send(["found", message[1], held])
                continue
            self._answered(message)
        self.lost = True
        for future in self._answers.values():
            if not future.done():
                future.set_exception(draining())
        self._answers.clear()
        self._give_backs.clear()
        self._on_lost()

    def _answered(self, message: list[Any]) -> None:
        """The gate's answer (``ok`` or ``err``) to one of this front's questions."""
        rid = message[1]
        self._mirror(message[-1])
        future = self._answers.pop(rid, None)
        give_back = self._give_backs.pop(rid, None)
        if future is not None:
            # Still asked for. If the request was cancelled meanwhile, ``_given_up`` (on the task's next step)
            # finds the future done and gives the grant back.
            future.set_result(message)
        elif message[0] == "ok" and give_back is not None:
            # Granted after the request gave up (or after its deadline): given back here.
            self.link.send([give_back, message[2]])

    def _mirror(self, snapshot: list[int]) -> None:
        (self.in_use, self._waiting, self.reading, self.preparing, self.bytes_in_use, self.tokens_in_use,
         self.limit) = snapshot
        self._on_change(self)

    def _send(self, message: list[Any], give_back: str | None) -> tuple[int, asyncio.Future[list[Any]]]:
        """Put ``message`` on the wire now (its id filled in); the future its answer will resolve."""
        if self.lost:
            raise draining()
        rid = next(self._ids)
        message[1] = rid
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._answers[rid] = future
        if give_back is not None:
            self._give_backs[rid] = give_back
        self.link.send(message)
        return rid, future

    async def _ask(self, message: list[Any], give_back: str | None, deadline: float) -> list[Any]:
        """Send ``message`` and await the gate's answer; 503 ``gate_unavailable`` if none came within
        ``deadline`` seconds (what the gate grants later is given back, as for a request that gave up)."""
        rid, future = self._send(message, give_back)
        try:
            await asyncio.wait([future], timeout=deadline)
        except asyncio.CancelledError:
            self._given_up(rid, future, give_back)
            raise
        if not future.done():
            self._given_up(rid, future, give_back)
            raise self._silent(message[0], deadline)
        return self._outcome(future)

    async def _wait(self, message: list[Any], give_back: str, deadline: float) -> list[Any]:
        """``_ask`` for a wait at the gate, which may rightly last up to the queue timeout: meanwhile, once the
        gate has been silent for ``answer_timeout``, it is asked for its counters; if that goes unanswered the
        gate is hung, and the wait ends at once with 503 ``gate_unavailable``, not at its deadline."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        rid, future = self._send(message, give_back)
        try:
            while not future.done() and (left := end - loop.time()) > 0:
                await asyncio.wait([future], timeout=min(left, self.answer_timeout))
                if (not future.done() and loop.time() - self._heard >= self.answer_timeout
                        and not await self.reachable(self.answer_timeout)):
                    break
        except asyncio.CancelledError:
            self._given_up(rid, future, give_back)
            raise
        if not future.done():
            self._given_up(rid, future, give_back)
            raise self._silent(message[0], deadline)
        return self._outcome(future)

    def _given_up(self, rid: int, future: asyncio.Future[list[Any]], give_back: str | None) -> None:
        """The asking request gave up (its client left, or the gate was silent past the deadline)."""
        self._answers.pop(rid, None)
        if future.done():
            # Answered in the same instant the request gave up: what the gate granted goes back.
            granted = future.result() if future.exception() is None else None
            if granted is not None and granted[0] == "ok" and give_back is not None:
                self.link.send([give_back, granted[2]])
        elif give_back == "release" and rid in self._give_backs:
            # Still waiting at the gate: stop the wait there. A grant that crosses this message is given
            # back by ``_read``, which still knows what to send for it.
            self.link.send(["cancel", rid])

    def _silent(self, op: str, deadline: float) -> MmgateError:
        if self.answering:  # once per silence, not once per request
            log.warning("the shared gate did not answer %r within %g s", op, deadline)
        self.answering = False
        return gate_unavailable()

    @staticmethod
    def _outcome(future: asyncio.Future[list[Any]]) -> list[Any]:
        answer = future.result()  # draining() once the gate is gone
        if answer[0] == "err":
            _, _, status, code, text, headers, _ = answer
            raise rebuild(status, code, text, headers=headers)
        return answer

    async def take_shared_place(self, flow: Flow = DEFAULT_FLOW) -> Place:
        """``Gate.take_place``, at the gate."""
        if self.lifecycle.refusing:
            raise draining()
        answer = await self._ask(["place", 0, flow.id, flow.band, flow.client], "unplace", self.answer_timeout)
        return SharedPlace(self, flow=flow, place_id=answer[2])

    def take_place(self, flow: Flow = DEFAULT_FLOW) -> Place:
        raise TypeError("a front process takes its place at the shared gate: await take_shared_place()")

    async def acquire(self, cost: int, timeout: float, place: Place | None = None, tokens: int = 0,
                      flow: Flow = DEFAULT_FLOW) -> Lease:
        place_id = None
        if isinstance(place, SharedPlace) and not place.released:
            place.released = True  # the gate turns it into a queue entry
            place_id = place.place_id
        if self.lifecycle.refusing:
            if place_id is not None:
                self.link.send(["unplace", place_id])
            raise draining()
        answer = await self._wait(["acquire", 0, cost, timeout, place_id, tokens, flow.id, flow.band, flow.client],
                                  "release", timeout + self.answer_timeout)
        return SharedLease(self, cost, tokens, lease_id=answer[2])

    def _give_back(self, lease: Lease, sample: bool = True) -> None:
        assert isinstance(lease, SharedLease)
        self.link.send(["release", lease.lease_id])

    def _lower(self, lease: Lease, cost: int) -> None:
        assert isinstance(lease, SharedLease)
        lease.cost = cost
        self.link.send(["lower", lease.lease_id, cost])

    def ready(self) -> None:
        self.link.send(["ready"])

    async def collect(self) -> dict[str, Any]:
        """Every front's metrics, merged by the gate (``merge_reports``)."""
        answer = await self._ask(["collect", 0], None, REPORT_TIMEOUT + self.answer_timeout)
        merged: dict[str, Any] = answer[2]
        return merged

    async def peer_verdicts(self, keys: list[bytes]) -> dict[bytes, Verdict]:
        """What the other fronts' caches hold of ``keys``: a miss here need not be a decode."""
        if self.lost or not self.answering:
            return {}
        try:
            answer = await self._ask(["peek", 0, [key.hex() for key in keys]], None, 2 * PEER_TIMEOUT)
        except MmgateError:  # the gate is hung or gone: this front decodes
            return {}
        return {bytes.fromhex(key): verdict_from_wire(wire) for key, wire in answer[2].items()}

    async def refresh(self) -> None:
        """The gate's counters as of now, mirrored here (``waiting_media`` for ``MMGATE_BACKEND_METRICS``)."""
        await self._ask(["counters", 0], None, self.answer_timeout)

    async def reachable(self, timeout: float) -> bool:
        """Whether the gate answers within ``timeout`` (for /mmgate/ready)."""
        try:
            await self._ask(["counters", 0], None, timeout)
        except MmgateError:
            return False
        return True


def verdict_to_wire(verdict: Verdict) -> list[Any]:
    refusal = verdict.refusal
    return [verdict.size_in, verdict.size_out, verdict.sniffed_mime.decode("latin-1"), verdict.mime.decode("latin-1"),
            verdict.encoded.decode("latin-1") if verdict.encoded is not None else None,
            [refusal.status, refusal.code, refusal.message] if refusal is not None else None,
            list(verdict.video) if verdict.video is not None else None]


def verdict_from_wire(wire: list[Any]) -> Verdict:
    size_in, size_out, sniffed, mime, encoded, refusal, video = wire
    return Verdict(size_in, size_out, sniffed.encode("latin-1"), mime.encode("latin-1"),
                   encoded.encode("latin-1") if encoded is not None else None,
                   Refusal(*refusal) if refusal is not None else None,
                   (video[0], video[1], video[2]) if video is not None else None)


