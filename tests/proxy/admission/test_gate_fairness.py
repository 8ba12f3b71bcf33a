"""Fair and prioritised waiting: per-flow queues served in turn, strict priority bands, a per-flow cap with a
429 naming the flow, and requests without the headers as one FIFO. The Gate on its own, then over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from preprocessors.errors import MmgateError
from proxy.admission.flows import DEFAULT_FLOW, Flow, FlowRules, flow_for
from proxy.admission.gate import Gate, Lease, Place
from proxy.settings import PRIORITY_MAX, PRIORITY_MIN
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from tests.conftest import Proxy, StartProxy, Upstream

HEADERS = ("x-gateway-inference-fairness-id", "x-mmgate-priority")


async def _queued(gate: Gate, count: int) -> None:
    while gate.waiting < count:  # noqa: ASYNC110 (each loop turn lets one waiter enqueue)
        await asyncio.sleep(0)


async def _serve_in_order(gate: Gate, arrivals: list[Flow]) -> list[int]:
    """Queue ``arrivals`` behind the only slot, then release one lease at a time: the order they are served."""
    held = await gate.acquire(0, 5)
    order: list[int] = []

    async def wait(index: int, flow: Flow) -> Lease:
        lease = await gate.acquire(0, 5, flow=flow)
        order.append(index)
        return lease

    tasks = [asyncio.create_task(wait(i, flow)) for i, flow in enumerate(arrivals)]
    await _queued(gate, len(arrivals))
    held.release()
    for _ in arrivals:
        while True:
            done = [t for t in tasks if t.done()]
            if done:
                break
            await asyncio.sleep(0)
        task = done[0]
        tasks.remove(task)
        task.result().release()
    assert (gate.in_use, gate.waiting) == (0, 0)
    return order


async def test_requests_without_headers_are_one_fifo() -> None:
    gate = Gate(limit=1, byte_budget=0, max_queue=20)
    assert await _serve_in_order(gate, [DEFAULT_FLOW] * 6) == [0, 1, 2, 3, 4, 5]


async def test_a_small_flow_behind_a_burst_is_served_in_the_next_slots() -> None:
    gate = Gate(limit=1, byte_budget=0, max_queue=20)
    arrivals = [Flow("burst")] * 12 + [Flow("small")] * 2
    order = await _serve_in_order(gate, arrivals)
    assert [order.index(12), order.index(13)] == [1, 3]  # turns alternate: burst, small, burst, small
    assert [i for i in order if i < 12] == list(range(12))  # each flow stays FIFO


async def test_a_higher_band_is_always_served_first() -> None:
    gate = Gate(limit=1, byte_budget=0, max_queue=20)
    arrivals = [Flow("a", 0), Flow("b", 0), Flow("low", -3), Flow("urgent", 5), Flow("a", 0), Flow("urgent", 5)]
    assert await _serve_in_order(gate, arrivals) == [3, 5, 0, 1, 4, 2]


async def test_the_next_flow_holds_the_line_for_its_bytes() -> None:
    """The head-of-line rule holds for the request whose turn it is: a small request of another flow that
    would fit waits, so the big one is never starved."""
    gate = Gate(limit=5, byte_budget=100, max_queue=10)
    running = await gate.acquire(60, 5, flow=Flow("a"))
    big = asyncio.create_task(gate.acquire(80, 5, flow=Flow("b")))
    await _queued(gate, 1)
    small = asyncio.create_task(gate.acquire(10, 5, flow=Flow("c")))
    await _queued(gate, 2)
    assert not big.done() and not small.done()
    running.release()
    assert (await big).cost == 80 and (await small).cost == 10


async def test_a_full_flow_is_refused_naming_it_while_others_still_queue() -> None:
    gate = Gate(limit=1, byte_budget=0, max_queue=10, max_queue_per_flow=2)
    held = await gate.acquire(0, 5)
    tenant = Flow("tenant-a")
    waiting = [asyncio.create_task(gate.acquire(0, 5, flow=tenant)) for _ in range(2)]
    await _queued(gate, 2)
    with pytest.raises(MmgateError) as refused:
        await gate.acquire(0, 5, flow=tenant)
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert refused.value.message.startswith("flow 'tenant-a'")
    assert refused.value.message.endswith(": this flow's share of the media queue is full "
                                          "(MMGATE_MAX_QUEUE_PER_FLOW=2 places): 2 waiting; retry later")
    with pytest.raises(MmgateError):
        gate.take_place(tenant)  # a body still arriving counts against its flow too
    other = asyncio.create_task(gate.acquire(0, 5, flow=Flow("tenant-b")))
    await _queued(gate, 3)
    held.release()
    for task in (waiting[0], other, waiting[1]):  # the flows' turns
        (await task).release()
    assert (gate.in_use, gate.waiting, gate.reading) == (0, 0, 0)


async def test_retry_after_counts_what_is_ahead_of_the_flow() -> None:
    gate = Gate(limit=1, byte_budget=0, max_queue=100)
    gate._hold_seconds = 2.0
    held = await gate.acquire(0, 5)
    burst = [asyncio.create_task(gate.acquire(0, 5, flow=Flow("burst"))) for _ in range(20)]
    await _queued(gate, 20)
    # a new flow goes in turn with the burst: one burst request ahead of it, then its own
    assert gate.retry_after(Flow("new")) == 4  # (1 ahead + 1) / 1 slot × 2 s
    assert gate.retry_after(Flow("burst")) == 42  # (20 ahead + 1) × 2 s
    assert gate.retry_after(DEFAULT_FLOW) == 4
    for task in burst:
        task.cancel()
    await asyncio.gather(*burst, return_exceptions=True)
    held.release()


async def test_a_waiter_timing_out_leaves_its_flow_clean() -> None:
    gate = Gate(limit=1, byte_budget=0, max_queue=10)
    held = await gate.acquire(0, 5)
    with pytest.raises(MmgateError) as refused:
        await gate.acquire(0, 0.01, flow=Flow("slow", 2))
    assert refused.value.code == "queue_timeout" and "flow 'slow'" in refused.value.message
    assert gate.waiting == 0 and not gate._bands
    held.release()


RULES = FlowRules.of(("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"), "x-mmgate-priority",
                     (PRIORITY_MIN, PRIORITY_MAX), ("10.0.0.0/8", "fd00::/64"))


def test_flow_from_a_trusted_peer_s_headers() -> None:
    gateway = "10.1.2.3"
    assert flow_for({}, gateway, RULES) == Flow(client=gateway)
    assert flow_for({HEADERS[0]: " t1 "}, gateway, RULES) == Flow("t1", 0)
    assert flow_for({"x-llm-d-inference-fairness-id": "t2", HEADERS[0]: "t1"}, gateway, RULES) == Flow("t2", 0)
    assert flow_for({HEADERS[1]: "1000"}, gateway, RULES) == Flow("", PRIORITY_MAX, gateway)
    assert flow_for({HEADERS[1]: "-1000"}, "::ffff:10.1.2.3", RULES) == Flow("", PRIORITY_MIN, gateway)
    assert flow_for({HEADERS[1]: "2"}, "fd00::7", RULES) == Flow("", 2, "fd00::/64")
    for bad in ("high", "1.5", ""):
        with pytest.raises(MmgateError) as refused:
            flow_for({HEADERS[1]: bad}, gateway, RULES)
        assert refused.value.status == 400 and refused.value.code == "invalid_priority_header"
    with pytest.raises(MmgateError) as refused:
        flow_for({HEADERS[0]: "x" * 129}, gateway, RULES)
    assert refused.value.code == "invalid_flow_header"


def test_an_untrusted_peer_s_headers_are_not_read() -> None:
    """Outside ``MMGATE_TRUST_FLOW_HEADERS_FROM`` the flow is the client's address (an IPv6 client's /64),
    band 0, whatever the headers say, invalid values included."""
    headers = {HEADERS[0]: "x" * 129, HEADERS[1]: "high", "x-llm-d-inference-fairness-id": "minted"}
    assert flow_for(headers, "192.0.2.7", RULES) == Flow(client="192.0.2.7")
    assert flow_for(headers, "2001:db8:1:2:3:4:5:6", RULES) == Flow(client="2001:db8:1:2::/64")
    assert flow_for(headers, None, RULES) == DEFAULT_FLOW  # a Unix socket: no address to tell clients apart
    nobody = FlowRules.of(RULES.fairness_headers, RULES.priority_header, RULES.bands, ())
    assert flow_for({HEADERS[1]: "8"}, "10.1.2.3", nobody) == Flow(client="10.1.2.3")
    assert Flow("10.1.2.3").key != Flow(client="10.1.2.3").key  # an id never stands for an address


arrivals_strategy = st.lists(st.tuples(st.sampled_from("abcd"), st.integers(-1, 1)), min_size=1, max_size=30)


@given(arrivals=arrivals_strategy)
def test_service_order_is_strict_by_band_fifo_per_flow_and_fair_in_turn(arrivals: list[tuple[str, int]]) -> None:
    flows = [Flow(flow_id, band) for flow_id, band in arrivals]
    order = asyncio.run(_serve_in_order(Gate(limit=1, byte_budget=0, max_queue=100), flows))
    served = [flows[i] for i in order]
    assert sorted(order) == list(range(len(flows)))
    assert [flow.band for flow in served] == sorted((flow.band for flow in flows), reverse=True)  # strict bands
    for flow in set(flows):  # FIFO within a flow
        mine = [i for i in order if flows[i] == flow]
        assert mine == sorted(mine)
    for band in {flow.band for flow in flows}:  # in turn: in every prefix, flows with work left are level
        total = {flow: flows.count(flow) for flow in flows if flow.band == band}
        count = dict.fromkeys(total, 0)
        for flow in (f for f in served if f.band == band):
            count[flow] += 1
            busy = [count[f] for f in total if count[f] < total[f]]
            assert not busy or max(busy) - min(busy) <= 1


class FlowGateMachine(RuleBasedStateMachine):
    """Random acquires of several flows and bands, places, cancels, timeouts and releases: budgets and the
    per-flow cap hold, and nothing is left in any flow's queue."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.gate = Gate(limit=2, byte_budget=100, max_queue=6, max_queue_per_flow=3)
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

    flows = st.one_of(st.builds(Flow, st.sampled_from(["", "a", "b"]), st.integers(-1, 1)),
                      st.builds(Flow, st.just(""), st.integers(-1, 1), st.sampled_from(["a", "192.0.2.7"])))

    @rule(cost=st.integers(0, 120), timeout=st.sampled_from([0.0, 60.0]), flow=flows)
    def acquire(self, cost: int, timeout: float, flow: Flow) -> None:
        self.pending.append(self.loop.create_task(self.gate.acquire(cost, timeout, flow=flow)))
        self._turn()

    @rule(flow=flows)
    def take_place(self, flow: Flow) -> None:
        try:
            self.places.append(self.gate.take_place(flow))
        except MmgateError as refused:
            assert refused.code == "queue_full"

    @precondition(lambda self: self.places)
    @rule(index=st.integers(0, 100), cost=st.integers(0, 120))
    def body_arrived(self, index: int, cost: int) -> None:
        place = self.places.pop(index % len(self.places))
        self.pending.append(self.loop.create_task(self.gate.acquire(cost, 60.0, place, flow=place.flow)))
        self._turn()

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 100))
    def cancel_waiter(self, index: int) -> None:
        self.pending[index % len(self.pending)].cancel()
        self._turn()

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 100), forwarded=st.booleans())
    def release(self, index: int, forwarded: bool) -> None:
        lease = self.leases.pop(index % len(self.leases))
        if forwarded:
            lease.handed_off()
        lease.release()
        lease.release()
        self._turn()

    @invariant()
    def within_limits(self) -> None:
        gate = self.gate
        assert 0 <= gate.in_use <= gate.limit and 0 <= gate.bytes_in_use <= gate.byte_budget
        assert gate.waiting == sum(len(q) for flows in gate._bands.values() for q in flows.values())
        assert gate.reading == len(self.places) == sum(gate._reading_by_flow.values())
        assert 0 <= gate.preparing <= gate.in_use
        assert all(queue for flows in gate._bands.values() for queue in flows.values())  # no empty flow kept

    def teardown(self) -> None:
        for task in self.pending:
            task.cancel()
        self._turn()
        for lease in self.leases:
            lease.release()
        for place in self.places:
            place.release()
        gate = self.gate
        assert (gate.in_use, gate.bytes_in_use, gate.waiting, gate.reading, gate.preparing) == (0, 0, 0, 0, 0)
        assert not gate._bands and not gate._reading_by_flow
        self.loop.close()


TestFlowGateMachine = FlowGateMachine.TestCase
TestFlowGateMachine.settings = hsettings(max_examples=150, stateful_step_count=40, deadline=None)


# ----- over HTTP -----


async def _held_backend(upstream: Upstream) -> asyncio.Queue[str]:
    """A backend that answers one chat request at a time, in the order mmgate forwards them, when told."""
    forwarded: asyncio.Queue[str] = asyncio.Queue()
    go: asyncio.Queue[None] = asyncio.Queue()

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        forwarded.put_nowait(body["messages"][0]["content"][0]["text"])
        await go.get()
        return web.json_response({"ok": True})

    upstream.route("/v1/chat/completions", chat)
    upstream.go = go  # type: ignore[attr-defined]
    return forwarded


async def test_http_flows_take_turns_and_bands_go_first(upstream: Upstream, start_proxy: StartProxy) -> None:
    forwarded = await _held_backend(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_RELEASE_AT="complete",
                              MMGATE_CACHE_MB="0", MMGATE_TRUST_FLOW_HEADERS_FROM="127.0.0.1/32")
    image = data_uri(image_bytes())

    async def post(session: aiohttp.ClientSession, name: str, headers: dict[str, str]) -> int:
        async with session.post(proxy.url + "/v1/chat/completions", json=chat_with_image(image, text=name),
                                headers=headers) as response:
            await response.read()
            return response.status

    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, "first", {}))
        assert await forwarded.get() == "first"
        sent = [("burst0", {HEADERS[0]: "burst"}), ("burst1", {HEADERS[0]: "burst"}),
                ("burst2", {HEADERS[0]: "burst"}), ("small0", {HEADERS[0]: "small"}),
                ("vip", {HEADERS[0]: "small", HEADERS[1]: "3"})]
        tasks = [first]
        counters = proxy.state.gate.counters
        for count, (name, headers) in enumerate(sent, 1):
            tasks.append(asyncio.create_task(post(session, name, headers)))
            await eventually(lambda count=count: counters().waiting == count, f"{name} queued")  # type: ignore[misc]
        order = []
        for _ in sent:
            upstream.go.put_nowait(None)  # type: ignore[attr-defined]
            order.append(await forwarded.get())
        upstream.go.put_nowait(None)  # type: ignore[attr-defined]
        assert await asyncio.gather(*tasks) == [200] * 6
    assert order == ["vip", "burst0", "small0", "burst1", "burst2"]


async def test_http_refusal_names_the_flow(upstream: Upstream, start_proxy: StartProxy) -> None:
    await _held_backend(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_RELEASE_AT="complete",
                              MMGATE_MAX_QUEUE_PER_FLOW="1", MMGATE_CACHE_MB="0",
                              MMGATE_TRUST_FLOW_HEADERS_FROM="127.0.0.1/32")
    body = chat_with_image(data_uri(image_bytes()))
    async with aiohttp.ClientSession() as session:
        async def post(headers: dict[str, str]) -> aiohttp.ClientResponse:
            async with session.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as response:
                await response.read()
                return response

        running = asyncio.create_task(post({}))
        await upstream.arrived.get()
        queued = asyncio.create_task(post({HEADERS[0]: "tenant-7"}))
        await eventually(lambda: proxy.state.gate.counters().waiting == 1, "one queued")
        async with session.post(proxy.url + "/v1/chat/completions", json=body,
                                headers={HEADERS[0]: "tenant-7"}) as refused:
            error = (await refused.json())["error"]
            assert refused.status == 429 and error["code"] == "queue_full"
            assert "flow 'tenant-7'" in error["message"] and int(refused.headers["Retry-After"]) >= 1
        async with session.post(proxy.url + "/v1/chat/completions", json=body,
                                headers={HEADERS[1]: "urgent"}) as bad:
            assert bad.status == 400 and (await bad.json())["error"]["code"] == "invalid_priority_header"
        upstream.go.put_nowait(None)  # type: ignore[attr-defined]
        upstream.go.put_nowait(None)  # type: ignore[attr-defined]
        assert (await running).status == 200 and (await queued).status == 200


# A second loopback address for a second client: the proxy tells clients apart by their TCP peer address.
OTHER_CLIENT = "127.0.0.2"


def _client_from(address: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0)))


class _Chats:
    """Chat requests with an image, each tagged by its text, posted from one client session."""

    def __init__(self, proxy: Proxy) -> None:
        self.url = proxy.url + "/v1/chat/completions"
        self.image = data_uri(image_bytes())

    async def post(self, session: aiohttp.ClientSession, name: str,
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        async with session.post(self.url, json=chat_with_image(self.image, text=name),
                                headers=headers or {}) as response:
            return response.status, await response.json()


async def _queue(proxy: Proxy, tasks: list[asyncio.Task[Any]], post: Coroutine[Any, Any, Any]) -> None:
    """Send one more request and wait until it waits in the gate."""
    tasks.append(asyncio.create_task(post))
    count = len(tasks) - 1  # the first one is at the backend
    await eventually(lambda: proxy.state.gate.counters().waiting == count, f"{count} queued")


async def _forward_order(upstream: Upstream, forwarded: asyncio.Queue[str], count: int) -> list[str]:
    """Let the backend answer one request at a time: the order mmgate forwards the next ``count`` in."""
    order = []
    for _ in range(count):
        upstream.go.put_nowait(None)  # type: ignore[attr-defined]
        order.append(await forwarded.get())
    upstream.go.put_nowait(None)  # type: ignore[attr-defined]
    return order


async def test_http_an_untrusted_priority_cannot_jump_the_line(upstream: Upstream, start_proxy: StartProxy) -> None:
    """By default no peer is trusted: a client's priority header (an invalid one too) is not read, so a
    request asking for band 99 waits behind the one sent before it."""
    forwarded = await _held_backend(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_RELEASE_AT="complete",
                              MMGATE_CACHE_MB="0")
    chats = _Chats(proxy)
    async with aiohttp.ClientSession() as session, _client_from(OTHER_CLIENT) as other:
        tasks = [asyncio.create_task(chats.post(session, "first"))]
        assert await forwarded.get() == "first"
        await _queue(proxy, tasks, chats.post(other, "honest"))
        await _queue(proxy, tasks, chats.post(session, "greedy", {HEADERS[1]: "99"}))
        await _queue(proxy, tasks, chats.post(session, "junk", {HEADERS[1]: "urgent", HEADERS[0]: "x" * 200}))
        assert await _forward_order(upstream, forwarded, 3) == ["honest", "greedy", "junk"]
        assert [status for status, _ in await asyncio.gather(*tasks)] == [200] * 4


async def test_http_a_trusted_peer_s_headers_are_honoured(upstream: Upstream, start_proxy: StartProxy) -> None:
    """Only the peer in MMGATE_TRUST_FLOW_HEADERS_FROM picks a band; another peer's priority is not read."""
    forwarded = await _held_backend(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_RELEASE_AT="complete",
                              MMGATE_CACHE_MB="0", MMGATE_TRUST_FLOW_HEADERS_FROM=f"{OTHER_CLIENT}/32")
    chats = _Chats(proxy)
    async with aiohttp.ClientSession() as session, _client_from(OTHER_CLIENT) as gateway:
        tasks = [asyncio.create_task(chats.post(session, "first"))]
        assert await forwarded.get() == "first"
        await _queue(proxy, tasks, chats.post(session, "plain"))
        await _queue(proxy, tasks, chats.post(session, "spoofed", {HEADERS[1]: "5"}))
        await _queue(proxy, tasks, chats.post(gateway, "gateway", {HEADERS[1]: "3"}))
        status, body = await chats.post(gateway, "bad", {HEADERS[1]: "urgent"})  # read, so judged
        assert status == 400 and body["error"]["code"] == "invalid_priority_header"
        assert await _forward_order(upstream, forwarded, 3) == ["gateway", "plain", "spoofed"]
        assert [status for status, _ in await asyncio.gather(*tasks)] == [200] * 4


async def test_http_the_per_flow_cap_is_per_client_address(upstream: Upstream, start_proxy: StartProxy) -> None:
    """Clients without a trusted fairness id are one flow each, by address: one client filling its places
    leaves another's free."""
    await _held_backend(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_RELEASE_AT="complete",
                              MMGATE_MAX_QUEUE_PER_FLOW="2", MMGATE_CACHE_MB="0")
    chats = _Chats(proxy)
    async with aiohttp.ClientSession() as session, _client_from(OTHER_CLIENT) as other:
        tasks = [asyncio.create_task(chats.post(session, "first"))]
        await upstream.arrived.get()
        await _queue(proxy, tasks, chats.post(session, "mine0"))
        await _queue(proxy, tasks, chats.post(session, "mine1"))
        status, body = await chats.post(session, "mine2")
        assert status == 429 and body["error"]["code"] == "queue_full"
        assert "the flow of client 127.0.0.1" in body["error"]["message"]
        await _queue(proxy, tasks, chats.post(other, "theirs"))
        for _ in tasks:
            upstream.go.put_nowait(None)  # type: ignore[attr-defined]
        assert [status for status, _ in await asyncio.gather(*tasks)] == [200] * 4


async def test_http_minted_ids_from_an_untrusted_client_share_its_flow(upstream: Upstream,
                                                                      start_proxy: StartProxy) -> None:
    """A new fairness id per request buys an untrusted client no more places than its one flow's."""
    await _held_backend(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_RELEASE_AT="complete",
                              MMGATE_MAX_QUEUE_PER_FLOW="2", MMGATE_CACHE_MB="0")
    chats = _Chats(proxy)
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(chats.post(session, "first"))]
        await upstream.arrived.get()
        await _queue(proxy, tasks, chats.post(session, "a", {HEADERS[0]: "id-a"}))
        await _queue(proxy, tasks, chats.post(session, "b", {"x-llm-d-inference-fairness-id": "id-b"}))
        status, body = await chats.post(session, "c", {HEADERS[0]: "id-c"})
        assert status == 429 and "the flow of client 127.0.0.1" in body["error"]["message"]
        for _ in tasks:
            upstream.go.put_nowait(None)  # type: ignore[attr-defined]
        assert [status for status, _ in await asyncio.gather(*tasks)] == [200] * 3


async def test_http_both_fairness_header_names_name_the_flow(upstream: Upstream, start_proxy: StartProxy) -> None:
    """llm-d's x-llm-d-inference-fairness-id and its older x-gateway-inference-fairness-id are read by default:
    the same id under either name is the same flow."""
    await _held_backend(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_RELEASE_AT="complete",
                              MMGATE_MAX_QUEUE_PER_FLOW="1", MMGATE_CACHE_MB="0",
                              MMGATE_TRUST_FLOW_HEADERS_FROM="127.0.0.1/32")
    chats = _Chats(proxy)
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(chats.post(session, "first"))]
        await upstream.arrived.get()
        await _queue(proxy, tasks, chats.post(session, "new", {"x-llm-d-inference-fairness-id": "tenant-1"}))
        status, body = await chats.post(session, "old", {"x-gateway-inference-fairness-id": "tenant-1"})
        assert status == 429 and "flow 'tenant-1'" in body["error"]["message"]
        await _queue(proxy, tasks, chats.post(session, "old", {"x-gateway-inference-fairness-id": "tenant-2"}))
        for _ in tasks:
            upstream.go.put_nowait(None)  # type: ignore[attr-defined]
        assert [status for status, _ in await asyncio.gather(*tasks)] == [200] * 3
