"""MMGATE_MAX_MM_CONCURRENCY=auto over HTTP: which exchanges teach the adaptive limit, and as which class.

Only a media request the backend answered 2xx, relayed to its last byte, is a sample (``admission.sample``); a
backend refusal, a client gone, an upstream that breaks mid-answer give none. The controller is the real one,
keeping each sample it is handed (``Recording``). Every wait is on an event or on the gate's counters: a lease
goes back after its sample is taken, so once ``in_use`` is 0 every sample of the request is in.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from proxy.admission.adaptive import AdaptiveLimit
from proxy.admission.client import LocalGate
from proxy.admission.sample import Sample, bucket
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from testkit.servers import read_to_the_end, reader_of_nothing
from tests.conftest import Proxy, StartProxy, Upstream

EVENT = b"data: " + b"x" * (16 << 10) + b"\n\n"
EVENT_EVERY = 0.002  # seconds between a backend's events: a model's pace, not a wait for something
SLOW_EVENTS = 256  # 4 MiB: more than the socket buffers between mmgate and a slow client hold (about 3 MiB here)
HANG_BOUND = 60.0  # seconds: a bound on a hang, not a measure of speed
AUTO = {"MMGATE_MAX_MM_CONCURRENCY": "auto", "MMGATE_MIN_MM_CONCURRENCY": "1",
        "MMGATE_MAX_MM_CONCURRENCY_AUTO": "8"}


class Recording(AdaptiveLimit):
    """The real controller, keeping every sample it is handed."""

    def __init__(self, floor: int, ceiling: int) -> None:
        super().__init__(floor, ceiling)
        self.seen: list[Sample] = []

    def observe(self, sample: Sample, phase: int, granted_at: float) -> bool:
        self.seen.append(sample)
        return super().observe(sample, phase, granted_at)


async def _auto_proxy(upstream: Upstream, start_proxy: StartProxy) -> tuple[Proxy, Recording]:
    proxy = await start_proxy(upstream.url, **AUTO)
    gate = proxy.state.gate
    assert isinstance(gate, LocalGate) and gate.gate.adaptive is not None
    recording = Recording(gate.gate.adaptive.floor, gate.gate.adaptive.ceiling)
    gate.gate.adaptive = recording  # before any request: the limit is its floor either way
    return proxy, recording


def _body(**extra: int | bool) -> bytes:
    return orjson.dumps(chat_with_image(data_uri(image_bytes())) | extra)


async def _post(proxy: Proxy, body: bytes) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as client, client.post(
            proxy.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.read()


async def _all_back(proxy: Proxy) -> None:
    await eventually(lambda: proxy.state.gate.counters().in_use == 0, "every lease given back")


async def test_an_answered_media_request_is_one_sample(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy, recording = await _auto_proxy(upstream, start_proxy)
    assert await _post(proxy, _body()) == (200, b'{"ok": true, "path": "/v1/chat/completions"}')
    await _all_back(proxy)
    assert len(recording.seen) == 1 and recording.samples == 1
    sample = recording.seen[0]
    assert sample.seconds > 0
    assert sample.cls == ("chat", False, None, bucket(0))  # no usage in the answer: output tokens unknown


async def test_a_backend_refusal_is_no_sample(upstream: Upstream, start_proxy: StartProxy) -> None:
    async def refused(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "bad request"}}, status=400)

    upstream.route("/v1/chat/completions", refused)
    proxy, recording = await _auto_proxy(upstream, start_proxy)
    status, _ = await _post(proxy, _body())
    assert status == 400
    await _all_back(proxy)
    assert recording.seen == []


async def test_a_client_gone_before_the_answer_is_no_sample(upstream: Upstream, start_proxy: StartProxy) -> None:
    async def held(request: web.Request) -> web.Response:
        await upstream.release.wait()
        return web.json_response({"usage": {"completion_tokens": 16}})

    upstream.route("/v1/chat/completions", held)
    proxy, recording = await _auto_proxy(upstream, start_proxy)
    posting = asyncio.create_task(_post(proxy, _body()))
    await upstream.arrived.get()
    posting.cancel()  # the client hangs up while the backend works
    await upstream.cancelled.wait()  # mmgate hung up on the backend in turn
    await _all_back(proxy)
    assert recording.seen == []


async def test_an_upstream_reset_mid_stream_is_no_sample(upstream: Upstream, start_proxy: StartProxy) -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\n')
        await upstream.release.wait()
        assert request.transport is not None
        request.transport.abort()  # the backend dies mid-answer
        return response

    upstream.route("/v1/chat/completions", broken)
    proxy, recording = await _auto_proxy(upstream, start_proxy)
    async with aiohttp.ClientSession() as client, client.post(
            proxy.url + "/v1/chat/completions", data=_body(stream=True),
            headers={"Content-Type": "application/json"}) as response:
        assert response.status == 200
        assert await response.content.readuntil(b"\n\n") == b'data: {"choices": []}\n\n'
        upstream.release.set()
        try:
            await response.read()
        except aiohttp.ClientPayloadError:
            pass  # the answer ends broken, as it should
    await _all_back(proxy)
    assert recording.seen == []


async def test_one_output_token_is_another_class_than_sixty_four(upstream: Upstream,
                                                                 start_proxy: StartProxy) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        asked = orjson.loads(await request.read())
        tokens = asked["max_tokens"]
        if not asked["stream"]:
            return web.json_response({"choices": [{"message": {"content": "x" * tokens}}],
                                      "usage": {"prompt_tokens": 90, "completion_tokens": tokens}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(tokens):
            await response.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    upstream.route("/v1/chat/completions", answer)
    proxy, recording = await _auto_proxy(upstream, start_proxy)
    for stream in (False, True):
        for tokens in (1, 64):
            status, _ = await _post(proxy, _body(max_tokens=tokens, stream=stream))
            assert status == 200
            await _all_back(proxy)
    classes = [sample.cls for sample in recording.seen]
    assert classes == [("chat", False, bucket(1), bucket(0)), ("chat", False, bucket(64), bucket(0)),
                       ("chat", True, bucket(1), bucket(0)), ("chat", True, bucket(64), bucket(0))]
    assert len(set(classes)) == 4


def _dechunked(raw: bytes) -> bytes:
    """The body of a raw chunked HTTP/1.1 answer (mmgate's chunks follow the upstream's reads, not its events)."""
    _head, _, rest = raw.partition(b"\r\n\r\n")
    body = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2:]
    return bytes(body)


class StallingBackend:
    """A streamed answer to a client that reads nothing: an event every ``EVENT_EVERY`` s (as a model generates:
    the backend is never far ahead of mmgate) until mmgate sees its answer wait on the client, then ``after``
    events more (``counted``: the gate's leases in use before each), then the end once ``finish`` is set."""

    def __init__(self, proxy: Proxy, after: int) -> None:
        self.proxy, self.after = proxy, after
        self.finish = asyncio.Event()
        self.ended = asyncio.Event()  # the backend's handler returned or was cut
        self.counted: list[int] = []
        self.events = 0

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while not self.proxy.state.connections.waiting_on_clients and self.events < 4096:
                await response.write(EVENT)
                self.events += 1
                await asyncio.sleep(EVENT_EVERY)
            for _ in range(self.after):
                self.counted.append(self.proxy.state.gate.counters().in_use)
                await response.write(EVENT)
                self.events += 1
                await asyncio.sleep(EVENT_EVERY if self.after <= 64 else 0)
            await self.finish.wait()
            await response.write(b"data: [DONE]\n\n")
        finally:
            self.ended.set()
        return response


async def test_a_client_that_stops_reading_holds_its_slot_until_the_backend_is_done_and_is_no_sample(
        upstream: Upstream, start_proxy: StartProxy) -> None:
    """The backend still holds a request whose client stopped reading: its lease stays while the backend
    generates, and goes back when the backend has sent its answer's end, which mmgate reads ahead for it
    (``upstream.relay``) while the client reads nothing. The client gets the whole answer when it reads after all,
    and the request is no sample: its time measured the client too."""
    proxy, recording = await _auto_proxy(upstream, start_proxy)
    backend = StallingBackend(proxy, after=16)  # 256 KiB after the stall: within READ_AHEAD
    upstream.route("/v1/chat/completions", backend)
    sock = await reader_of_nothing(proxy.server.port, _body(stream=True))
    await eventually(lambda: len(backend.counted) == backend.after, "the backend generated on after the stall")
    assert backend.counted == [1] * backend.after  # counted while the backend generates for it
    assert proxy.state.gate.counters().in_use == 1
    backend.finish.set()
    await _all_back(proxy)  # the backend is done; the client has read nothing yet
    raw = await read_to_the_end(sock, HANG_BOUND)
    assert raw.endswith(b"0\r\n\r\n") and _dechunked(raw) == EVENT * backend.events + b"data: [DONE]\n\n"
    await eventually(lambda: proxy.state.in_flight == 0, "the request is done")
    assert recording.seen == []


async def test_a_client_that_reads_nothing_of_an_answer_beyond_the_read_ahead_holds_its_slot_until_cut(
        upstream: Upstream, start_proxy: StartProxy) -> None:
    """An answer that goes on past what mmgate reads ahead (64 MiB after the stall, more than every buffer
    between the backend and mmgate): the backend waits on the client, so the lease stays until the write
    deadline cuts the client, and the backend's answer is cut with it."""
    proxy = await start_proxy(upstream.url, **AUTO, MMGATE_CLIENT_WRITE_TIMEOUT="1")
    backend = StallingBackend(proxy, after=4096)
    upstream.route("/v1/chat/completions", backend)
    sock = await reader_of_nothing(proxy.server.port, _body(stream=True))
    async with asyncio.timeout(HANG_BOUND):
        await backend.ended.wait()  # cut: the backend could not write it all
    assert len(backend.counted) < backend.after and set(backend.counted) == {1}
    await _all_back(proxy)
    answer = await read_to_the_end(sock, HANG_BOUND)
    assert b"data: [DONE]" not in answer


async def test_slow_readers_never_keep_more_at_the_backend_than_the_limit(upstream: Upstream,
                                                                          start_proxy: StartProxy) -> None:
    """Issue 43's attack: six clients, each with a 4 KiB receive buffer, reading a 4 MiB streamed answer at an
    eighth of the pace the backend generates it, under ``MMGATE_MAX_MM_CONCURRENCY_AUTO=2``. A request counts
    until the backend has generated its answer's end (mmgate reads it ahead for its slow client, or the backend
    waits on the client), so the backend never generates more than 2 at once; before, a slot went back at the
    first stall, and the backend generated for every slow reader at once."""
    holding = most = stalled = 0

    async def long_stream(request: web.Request) -> web.StreamResponse:
        nonlocal holding, most, stalled
        holding += 1
        most = max(most, holding)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(SLOW_EVENTS):
                await response.write(EVENT)
                stalled = max(stalled, proxy.state.connections.waiting_on_clients)
                await asyncio.sleep(EVENT_EVERY)  # generating: a model's pace
            await response.write(b"data: [DONE]\n\n")
        finally:
            holding -= 1
        return response

    upstream.route("/v1/chat/completions", long_stream)
    proxy = await start_proxy(upstream.url, **(AUTO | {"MMGATE_MAX_MM_CONCURRENCY_AUTO": "2"}))

    async def slow_reader() -> bytes:
        sock = await reader_of_nothing(proxy.server.port, _body(stream=True))
        received = bytearray()
        async with asyncio.timeout(HANG_BOUND):
            while chunk := await asyncio.get_running_loop().sock_recv(sock, 4096):
                received += chunk
                await asyncio.sleep(2 * EVENT_EVERY)  # a client reading an eighth of an event a tick: its pace
        sock.close()
        return bytes(received)

    answers = await asyncio.gather(*(slow_reader() for _ in range(6)))
    assert all(_dechunked(answer) == EVENT * SLOW_EVENTS + b"data: [DONE]\n\n" for answer in answers)
    assert stalled  # the answers waited on their clients: else the test tested nothing
    assert most <= 2


async def test_stats_show_the_controller_and_why_the_limit_last_moved(upstream: Upstream,
                                                                      start_proxy: StartProxy) -> None:
    """/mmgate/stats carries ``AdaptiveLimit.explain``: its phase, and each move of the limit with its reason."""
    proxy = await start_proxy(upstream.url, **AUTO)
    for _ in range(3):
        assert (await _post(proxy, _body()))[0] == 200
    await _all_back(proxy)
    async with aiohttp.ClientSession() as client, client.get(proxy.url + "/mmgate/stats") as response:
        stats = await response.json()
    controller = stats["gate"]["controller"]
    assert controller["samples"] == 3 and controller["limit"] == stats["gate"]["limit"]
    assert controller["mode"] in ("startup", "probe") and controller["phase"] in ("startup", "up", "down", "cruise")
    assert controller["moves"][0]["why"] == "the start, before any sample"
    assert all(move["why"] for move in controller["moves"])
