"""The gate shared by several front processes: a front's RemoteGate and the supervisor's GateServer over a
real Unix socket pair, in this process. Grants and cancels that cross on the socket leak nothing, and no side
waits on a silent other without a deadline."""

from __future__ import annotations

import asyncio
import random
import socket
from typing import Any

import pytest

from preprocessors.errors import MmgateError
from preprocessors.job import Verdict
from proxy.admission.adaptive import AdaptiveLimit
from proxy.admission.client import GateCounters
from proxy.admission.flows import Flow
from proxy.admission.gate import Gate
from proxy.admission.sample import Sample
from proxy.processes.gate_server import GateServer
from proxy.processes.link import Link
from proxy.processes.messages import (
    Acquire,
    Admitted,
    AskCounters,
    Cancel,
    Counted,
    Found,
    Lookup,
    Message,
    Ping,
    Placed,
    Pong,
    Ready,
    Refused,
    Release,
    TakePlace,
    Unplace,
    WaitCancelled,
    verdict_to_wire,
)
from proxy.processes.remote_gate import RemoteGate, RemoteLease
from proxy.state import Lifecycle

POLLS = 600  # bounded polls of the gate's counters, 10 ms apart: far more than a message over the socket needs


def _remote(link: Link, limit: int, answer_timeout: float = 10.0) -> RemoteGate:
    return RemoteGate(link, limit, lambda counters: None, Lifecycle(), report=dict, on_lost=lambda: None,
                      answer_timeout=answer_timeout)


def _counters(in_use: int = 0, reading: int = 0) -> GateCounters:
    return GateCounters(in_use, 0, reading, in_use, in_use, 0, 1)


async def _gate_over_a_socket_pair(limit: int, max_queue: int, byte_budget: int = 0) -> tuple[Gate, RemoteGate]:
    """The supervisor's side (a Gate behind a GateServer) and a front's (a RemoteGate), in this process, over a
    real Unix socket pair."""
    gate = Gate(limit, byte_budget, max_queue)
    server_end, front_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    task = asyncio.create_task(GateServer(gate).serve(0, server_end, asyncio.Event()))
    shared = _remote(await Link.over(front_end), limit)
    shared.start()
    shared.serving = task  # type: ignore[attr-defined]  # kept referenced for the test's length
    return gate, shared


async def _until(condition: Any, what: str) -> None:
    for _ in range(POLLS):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_a_grant_that_crosses_a_cancelled_wait_is_given_back() -> None:
    """The gate grants a waiting request just as the front gives up on it: the grant, arriving for a wait
    nobody holds any more, is released at once, not leaked."""
    gate, shared = await _gate_over_a_socket_pair(limit=1, max_queue=4)
    first = await shared.acquire(1, 30)
    waiting = asyncio.create_task(shared.acquire(1, 30))
    await _until(lambda: gate.waiting == 1, "the second request queued at the gate")
    first.release()  # the gate will grant the waiter ...
    waiting.cancel()  # ... which has already given up
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await _until(lambda: (gate.in_use, gate.waiting) == (0, 0), "the crossed grant given back")
    again = await shared.acquire(1, 30)
    assert gate.in_use == 1
    again.release()
    await _until(lambda: gate.in_use == 0, "released")
    await shared.close()


async def test_a_grant_read_before_the_cancelled_wait_runs_again_is_given_back() -> None:
    """The front's request is cancelled (its future at once, its except clause on the task's next step) and
    the gate's grant is read in between: the grant is given back, not dropped. The supervisor's end is played
    by the test over the real socket pair, so the order of the two is the test's own."""
    server_end, front_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    supervisor = await Link.over(server_end)
    shared = _remote(await Link.over(front_end), 1)
    waiting = asyncio.create_task(shared.acquire(1, 30))
    asked = await supervisor.receive()
    assert isinstance(asked, Acquire)
    waiting.cancel()
    shared._answered(Admitted(asked.rid, _counters(in_use=1), 42))  # the reader runs before the task does
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await supervisor.receive() == Release(42)
    supervisor.close()
    await shared.close()


async def test_refusals_cross_the_socket_in_the_gates_own_words() -> None:
    gate, shared = await _gate_over_a_socket_pair(limit=1, max_queue=0)
    held = await shared.acquire(1, 30)
    with pytest.raises(Exception) as refused:
        await shared.acquire(1, 30)
    assert (refused.value.status, refused.value.code) == (429, "queue_full")  # type: ignore[attr-defined]
    assert refused.value.headers["Retry-After"]  # type: ignore[attr-defined]
    held.release()
    await _until(lambda: gate.in_use == 0, "released")
    await shared.close()


async def test_a_flow_crosses_the_socket_whole() -> None:
    """The supervisor's gate keeps the flow a front found: the client's address and the band as well as an id."""
    gate, shared = await _gate_over_a_socket_pair(limit=1, max_queue=4)
    held = await shared.acquire(1, 30)
    waiting = [asyncio.create_task(shared.acquire(1, 30, flow=flow))
               for flow in (Flow(client="192.0.2.7"), Flow("192.0.2.7", 2))]
    place = await shared.take_place(Flow(client="192.0.2.8"))
    await _until(lambda: gate.waiting == 2, "both queued")
    assert sorted(gate._bands) == [0, 2] and list(gate._bands[0]) == [("", "192.0.2.7")]
    assert list(gate._bands[2]) == [("192.0.2.7", "")] and list(gate._reading_by_flow) == [("", "192.0.2.8")]
    place.release()
    held.release()
    for task in reversed(waiting):  # the higher band first
        (await task).release()
    await _until(lambda: gate.in_use == gate.reading == 0, "released")
    await shared.close()


async def test_a_wait_cancelled_before_it_began_gives_its_place_back() -> None:
    """The front sends acquire (with the place its body held) and, its client gone at once, cancel: both
    reach the gate in one read, before the wait has run. The place is given back all the same."""
    gate, shared = await _gate_over_a_socket_pair(limit=1, max_queue=4)
    place = await shared.take_place()
    await _until(lambda: gate.reading == 1, "the place held at the gate")
    waiting = asyncio.create_task(shared.acquire(1, 30, place))
    await asyncio.sleep(0)  # the acquire is written ...
    waiting.cancel()  # ... and the cancel right behind it
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await _until(lambda: (gate.reading, gate.in_use, gate.waiting) == (0, 0, 0), "place and slot given back")
    await shared.close()


async def test_a_wait_called_off_is_answered_without_a_refusal() -> None:
    """A front's request gives up waiting at the gate: the gate ends the wait and says so, with no status of its
    own (nobody is told: the front's request is gone)."""
    gate = Gate(1, 0, 4)
    held = await gate.acquire(1, 30)
    server_end, front_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    serving = asyncio.create_task(GateServer(gate).serve(0, server_end, asyncio.Event()))
    front = await Link.over(front_end)
    front.send(Acquire(5, 1, 30, None, 0, Flow()))
    await _until(lambda: gate.waiting == 1, "the wait at the gate")
    front.send(Cancel(5))
    assert await _next(front) == WaitCancelled(5, GateCounters(1, 0, 0, 1, 1, 0, 1))
    held.release()
    front.close()
    await serving


async def test_a_lease_lowered_at_a_front_gives_its_bytes_back_at_the_supervisors_gate() -> None:
    """A front learns, once a URL's bytes are fetched, that its lease weighs less (a cache hit): the bytes it
    no longer needs are given back at the supervisor's gate, so a request waiting there for budget goes in."""
    gate, shared = await _gate_over_a_socket_pair(limit=4, max_queue=4, byte_budget=100)
    first = await shared.acquire(80, 30)
    waiting = asyncio.create_task(shared.acquire(50, 30))
    await _until(lambda: gate.waiting == 1, "the second request waits for byte budget")
    first.lower(20)
    await _until(lambda: gate.in_use == 2, "the waiting request admitted with the bytes given back")
    second = await waiting
    assert gate.bytes_in_use == 70 and first.cost == 20
    first.lower(30)  # a lease never weighs more than it was granted
    first.release()
    second.release()
    await _until(lambda: (gate.in_use, gate.bytes_in_use) == (0, 0), "both released, every byte given back")
    await shared.close()


async def _next(link: Link) -> Message:
    """The next message on ``link``, which must come."""
    message = await link.receive()
    assert message is not None
    return message


async def _front_and_a_silent_gate(answer_timeout: float) -> tuple[Link, RemoteGate]:
    """A front's RemoteGate over a real socket pair whose other end (the supervisor's) the test plays: it
    answers only when the test says so, as a hung supervisor would not."""
    server_end, front_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    supervisor = await Link.over(server_end)
    shared = _remote(await Link.over(front_end), 1, answer_timeout)
    shared.start()
    return supervisor, shared


async def test_a_place_the_gate_does_not_answer_is_503_and_a_late_grant_is_given_back() -> None:
    supervisor, shared = await _front_and_a_silent_gate(answer_timeout=0.2)
    with pytest.raises(MmgateError) as refused:
        await shared.take_place()
    assert (refused.value.status, refused.value.code) == (503, "gate_unavailable")
    assert refused.value.headers["Retry-After"]
    asked = await _next(supervisor)
    assert isinstance(asked, TakePlace)
    assert not await shared.reachable(0.2)  # what /mmgate/ready asks
    supervisor.send(Placed(asked.rid, _counters(reading=1), 7))  # the gate, resumed, grants it after all
    assert isinstance(await _next(supervisor), AskCounters)  # reachable's question
    assert await supervisor.receive() == Unplace(7)
    supervisor.close()
    await shared.close()


async def test_a_wait_at_a_silent_gate_ends_503_at_the_bound_once_and_a_late_grant_is_released() -> None:
    """The gate takes the wait, then says nothing: the wait ends with 503 once the gate has been silent for the
    bound (not after its queue timeout of an hour), with no second question (a second wait) before it, and is
    called off there; the grant the gate sends once it runs again is released."""
    supervisor, shared = await _front_and_a_silent_gate(answer_timeout=0.2)
    async with asyncio.timeout(60):  # a test runner's patience: far below the queue timeout
        with pytest.raises(MmgateError) as refused:
            await shared.acquire(1, 3600)
    assert (refused.value.status, refused.value.code) == (503, "gate_unavailable")
    assert "within MMGATE_PROCESS_TIMEOUT (0.2 s)" in str(refused.value)
    asked = [await _next(supervisor) for _ in range(2)]
    assert [type(message) for message in asked] == [Acquire, Cancel]
    assert isinstance(asked[0], Acquire)
    supervisor.send(Admitted(asked[0].rid, _counters(in_use=1), 9))
    assert await supervisor.receive() == Release(9)
    supervisor.close()
    await shared.close()


async def test_a_wait_at_a_silent_gate_ends_at_its_queue_timeout_when_that_comes_before_the_bound() -> None:
    """A queue timeout shorter than the bound: a gate that says nothing (no refusal on its way, no ping) ends
    the wait at the queue timeout, not at the bound of an hour."""
    supervisor, shared = await _front_and_a_silent_gate(answer_timeout=3600)
    async with asyncio.timeout(60):  # a test runner's patience: far below the bound
        with pytest.raises(MmgateError) as refused:
            await shared.acquire(1, 0.1)
    assert (refused.value.status, refused.value.code) == (503, "gate_unavailable")
    assert "within the request's queue timeout (0.1 s)" in str(refused.value)
    assert refused.value.headers["Retry-After"]
    assert [type(await _next(supervisor)) for _ in range(2)] == [Acquire, Cancel]
    supervisor.close()
    await shared.close()


async def test_a_refusal_that_comes_after_the_queue_timeout_from_a_gate_heard_meanwhile_is_the_answer() -> None:
    """A running gate answers a wait after the request's queue timeout (the gate's own deadline counts from when
    it read the question): the front, hearing the gate meanwhile (its pings), still waits for the gate's
    refusal, and the client gets that, not gate_unavailable."""
    supervisor, shared = await _front_and_a_silent_gate(answer_timeout=3600)
    waiting = asyncio.create_task(shared.acquire(1, 0))  # the queue timeout has passed as soon as it is asked
    asked = await _next(supervisor)
    assert isinstance(asked, Acquire)
    for qid in range(1, 4):  # pings, each answered: the gate is heard after the queue timeout
        supervisor.send(Ping(qid))
        assert await _next(supervisor) == Pong(qid)
    assert not waiting.done()
    supervisor.send(Refused(asked.rid, _counters(), 429, "queue_timeout", "timed out in the media queue", {}))
    with pytest.raises(MmgateError) as refused:
        await waiting
    assert (refused.value.status, refused.value.code) == (429, "queue_timeout")
    supervisor.close()
    await shared.close()


async def test_a_peer_that_leaves_a_lookup_unanswered_is_not_asked_again_until_it_speaks() -> None:
    """Two fronts at one gate: the asking one (a RemoteGate) and a hung peer, played by the test over its own
    socket pair. A miss asks the peer once; the next miss does not wait on it; once the peer speaks again it
    is asked again, and its answer is the asking front's."""
    server = GateServer(Gate(4, 0, 4))
    serving = []
    ends = []
    for index in range(2):
        server_end, front_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        serving.append(asyncio.create_task(server.serve(index, server_end, asyncio.Event())))
        ends.append(front_end)
    shared = _remote(await Link.over(ends[0]), 4)
    shared.start()
    peer = await Link.over(ends[1])
    shared.ready()
    peer.send(Ready())
    await _until(lambda: server.fronts == 2, "both fronts at the gate")
    await shared.refresh()  # the asking front's "ready" has been read
    peer.send(AskCounters(1))
    assert (await _next(peer)) == Counted(1, GateCounters(0, 0, 0, 0, 0, 0, 4))  # and the peer's
    key = bytes(32)
    assert await shared.peer_verdicts([key]) == {}  # the peer never answered
    assert isinstance(await _next(peer), Lookup)
    assert await shared.peer_verdicts([key]) == {}
    peer.send(AskCounters(2))  # the peer speaks: the next message it gets is the answer, no second lookup
    assert isinstance(await _next(peer), Counted)
    asking = asyncio.create_task(shared.peer_verdicts([key]))
    lookup = await _next(peer)
    assert isinstance(lookup, Lookup) and lookup.keys == [key.hex()]
    verdict = Verdict(3, 3, b"image/png", b"image/png", None, None, None)
    peer.send(Found(lookup.qid, {key.hex(): verdict_to_wire(verdict)}))
    assert await asking == {key: verdict}
    peer.close()
    await shared.close()
    for task in serving:
        task.cancel()


async def test_a_sample_crosses_the_socket_and_moves_the_supervisors_limit() -> None:
    """MMGATE_MAX_MM_CONCURRENCY=auto with several fronts: a front's normal completion reaches the controller of
    the supervisor's gate (before its lease's release), which grows the limit while demand fills it; a release
    alone teaches it nothing."""
    now = [0.0]
    adaptive = AdaptiveLimit(1, 8, clock=lambda: now[0], rng=random.Random(0))
    gate = Gate(0, 0, 100, adaptive=adaptive, clock=lambda: now[0])
    server_end, front_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    serving = asyncio.create_task(GateServer(gate).serve(0, server_end, asyncio.Event()))
    shared = _remote(await Link.over(front_end), gate.limit)
    shared.start()
    sent = 0
    for observed in (False, True):
        for _ in range(40):  # rounds of twice the limit's requests, 100 ms each at the backend (dated, not slept)
            asking = [asyncio.create_task(shared.acquire(0, 60)) for _ in range(2 * gate.limit)]
            while asking:
                await asyncio.wait(asking, return_when=asyncio.FIRST_COMPLETED)
                held: list[RemoteLease] = []
                # every grant made is handed off, and the supervisor hears of it, before the backend's 100 ms pass
                # (over a real socket, within a millisecond of seconds): what it holds is what it counts the rate
                # from. Grants made together may cross the socket in several reads: each is handed off as it comes.
                for _ in range(POLLS):
                    held += [task.result() for task in asking if task.done()]
                    asking = [task for task in asking if not task.done()]
                    for lease in held:
                        lease.handed_off()
                    if gate.preparing == 0:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("never: the hand-offs at the supervisor's gate")
                now[0] += 0.1
                for lease in held:
                    if observed:
                        shared.observe(lease, Sample(0.1, ("chat", False, 4, 0)))
                        sent += 1
                    lease.release()
        if not observed:
            assert adaptive.samples == 0 and gate.limit == 1
    await _until(lambda: adaptive.samples == sent, "every sample at the supervisor's gate")
    assert gate.limit > 1
    await shared.close()
    serving.cancel()
