"""A client that reads nothing of its answer loses its connection: real sockets, a raw client with a small
receive buffer that never reads, an upstream that streams until it is told to stop by the connection closing.

What is asserted is what happened (the backend saw the close, the lease is back, the code and the counter),
never how long it took: each test awaits the backend's close, bounded only against a hang."""

from __future__ import annotations

import asyncio
import logging
import socket

import orjson
import pytest
from aiohttp import web

from proxy.edge.connections import ConnectionGuard
from proxy.edge.site import GuardedSite, mark_head_received
from proxy.edge.write_deadline import WRITE_TIMEOUT_CODE, client_gone_code, stall_deadline
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from testkit.servers import read_to_the_end, reader_of_nothing
from tests.conftest import StartProxy, Upstream

IMAGE = data_uri(image_bytes(32, 32))
EVENT = b"data: " + b"x" * (16 << 10) + b"\n\n"
HANG_BOUND = 60.0  # seconds: a bound on a hang, not a measure of speed


def endless_stream(upstream: Upstream, closed: asyncio.Event) -> None:
    """The upstream streams SSE events until its connection to mmgate closes; then ``closed`` is set."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(EVENT)
        except ConnectionError:  # the write found the connection gone
            closed.set()
        except asyncio.CancelledError:  # the test server cancels a handler whose connection is gone
            closed.set()
            raise
        return response

    upstream.route("/v1/chat/completions", handler)


def media_stream_request() -> bytes:
    return orjson.dumps(chat_with_image(IMAGE, stream=True))


async def test_a_client_that_reads_nothing_is_cut_the_backend_sees_it_and_the_lease_is_back(
    upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    closed = asyncio.Event()
    endless_stream(upstream, closed)
    # A fixed limit holding its lease until the answer is complete: only the cut can give it back.
    proxy = await start_proxy(upstream.url, MMGATE_CLIENT_WRITE_TIMEOUT="0.5", MMGATE_RELEASE_AT="complete",
                              MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_ACCESS_LOG="on")
    caplog.set_level(logging.INFO, logger="mmgate.access")
    sock = await reader_of_nothing(proxy.server.port, media_stream_request())
    await eventually(lambda: proxy.state.gate.counters().in_use == 1, "the media request holds its lease")
    async with asyncio.timeout(HANG_BOUND):
        await closed.wait()
    await read_to_the_end(sock)  # the connection ends
    await eventually(lambda: proxy.state.gate.counters().in_use == 0, "the lease is back")
    assert proxy.state.metrics.client_write_timeouts._value.get() == 1
    await eventually(lambda: proxy.state.in_flight == 0, "the request is recorded")
    [access] = [r for r in caplog.records if r.name == "mmgate.access"]
    assert access.fields["code"] == WRITE_TIMEOUT_CODE  # type: ignore[attr-defined]


async def test_the_upstream_read_timeout_still_bounds_a_stall_when_the_write_deadline_is_off(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """While mmgate waits on the client it reads nothing from the upstream, and aiohttp's client drops its read
    timer then: the upstream's deadline is the one left, and it cuts the stall."""
    closed = asyncio.Event()
    endless_stream(upstream, closed)
    proxy = await start_proxy(upstream.url, MMGATE_CLIENT_WRITE_TIMEOUT="0", MMGATE_UPSTREAM_READ_TIMEOUT="0.5")
    sock = await reader_of_nothing(proxy.server.port, media_stream_request())
    async with asyncio.timeout(HANG_BOUND):
        await closed.wait()
    await read_to_the_end(sock)
    assert proxy.state.metrics.client_write_timeouts._value.get() == 1


def test_the_deadline_is_the_write_timeout_never_longer_than_the_upstream_read_timeout() -> None:
    assert stall_deadline(30, 600) == 30
    assert stall_deadline(30, 10) == 10
    assert stall_deadline(0, 600) == 600  # the write deadline off: the upstream's still bounds a stall


async def test_on_stall_is_called_once_when_the_answer_waits_on_the_client() -> None:
    """The hook the pipeline uses to give back a lease that waits on the client: called the first time the
    answer is over the high-water mark, then cleared; the write deadline off, the connection stays."""
    guard = ConnectionGuard(16, 10.0)  # no write deadline
    stalls: list[str] = []
    stalled = asyncio.Event()
    done = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        conn = guard.connection_for(request.protocol)
        assert conn is not None  # served through the guard's site

        def on_stall() -> None:
            stalls.append(client_gone_code(request))
            stalled.set()

        conn.on_stall = on_stall
        response = web.StreamResponse()
        await response.prepare(request)
        stall = asyncio.ensure_future(stalled.wait())
        try:
            while not stalled.is_set():
                # The write that goes over the high-water mark may itself wait on the client (aiohttp drains
                # every 64 KiB), so the stall is awaited beside it, not after it.
                writing = asyncio.ensure_future(response.write(EVENT))
                await asyncio.wait({writing, stall}, return_when=asyncio.FIRST_COMPLETED)
                if not writing.done():
                    writing.cancel()
            assert conn.on_stall is None
        finally:
            stall.cancel()
            done.set()
        return response

    app = web.Application(middlewares=[mark_head_received(guard)])
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, guard)
    await site.start()
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", site.port))
        await asyncio.get_running_loop().sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(HANG_BOUND):
            await done.wait()
        assert stalls == ["client_closed"]  # not cut: nothing marks the request
        assert guard.open == 1
        sock.close()
    finally:
        await runner.cleanup()

