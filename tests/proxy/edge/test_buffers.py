"""Buffer lifetime: once the upstream has the body, or the request ended any other way, the proxy
holds none of the request's media.

Three independent witnesses, each able to fail on its own:
* the owner objects (``weakref.finalize`` in ``proxy.buffers``): ``mmgate_media_buffers_live`` back to 0;
* the bytes they hold: ``mmgate_media_bytes_live`` 0 at handoff, while the answer still streams;
* tracemalloc: no live allocation of 1 MiB or more made while the request ran. The test builds its own
  body before tracing starts, so only the proxy's copies are traced. Pillow's C memory is not seen by
  tracemalloc, which is why images are closed inside the preprocessor.

The faults cover every stage a request can end in: reading the body, locating media, the queue, the decode
pool, the upstream connect, the upstream's silence, and the client leaving before, during and after
handoff. Every wait is on an event or on the proxy's own counters; none is on a duration.
"""

from __future__ import annotations

import asyncio
import gc
import io
import socket
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import orjson
import pytest
from aiohttp import web
from PIL import Image

from testkit.media import BlockedPool, chat_with_image, data_uri, eventually
from tests.conftest import Proxy, StartProxy, Upstream

BIG = 1 << 20  # no live allocation this size may remain from a request that ended or handed off
PATH = "/v1/chat/completions"


def noise_png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(7).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


IMAGE_BODY = orjson.dumps(chat_with_image(data_uri(noise_png(1200, 900)), stream=True))  # 4.3 MB, made untraced
SMALL_BODY = orjson.dumps(chat_with_image(data_uri(noise_png(32, 32))))
NOT_AN_IMAGE = orjson.dumps(chat_with_image("data:image/png;base64," + "QUJD" * 400_000))  # 1.6 MB of base64


class RawClient:
    """One request over a bare socket: the test keeps no reference of its own to what the proxy holds."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def send(cls, port: int, body: bytes, *, headers: str = "", cut_at: int | None = None) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = (f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        writer.write(head)
        writer.write(body if cut_at is None else body[:cut_at])
        await writer.drain()
        return cls(reader, writer)

    async def status(self) -> int:
        line = await asyncio.wait_for(self.reader.readline(), 30)
        return int(line.split()[1])

    def hang_up(self) -> None:
        self.writer.transport.abort()  # RST: the proxy notices at once


def big_allocations(*, collect: bool = True) -> list[tracemalloc.Trace]:
    """Live traced allocations of 1 MiB or more. ``collect=False`` also catches garbage that only a GC pass
    would free: a reference cycle through an exception's frames can hold media for minutes."""
    if collect:
        gc.collect()
    return [t for t in tracemalloc.take_snapshot().traces if t.size >= BIG]


def owner_count(proxy: Proxy) -> float:
    """``mmgate_media_buffers_live`` as a scrape sees it."""
    value = proxy.state.metrics.registry.get_sample_value("mmgate_media_buffers_live")
    assert value is not None
    return value


async def hold_until_released(upstream: Upstream, request: web.Request) -> web.Response:
    await upstream.release.wait()
    return web.json_response({"ok": True})


# ----------------------------------------------------------------------------------------------------------
# handoff while the answer still streams


@pytest.mark.parametrize("resize", ["0", "256"], ids=["forwarded_as_is", "rewritten"])
async def test_media_released_while_response_still_streams(upstream: Upstream, start_proxy: StartProxy,
                                                           resize: str) -> None:
    upstream.keep_bodies = False
    upstream.route(PATH, upstream.held_stream)
    proxy = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_SIDE=resize, MMGATE_RELEASE_AT="complete")
    ledger = proxy.state.buffers
    tracemalloc.start()
    try:
        client = await RawClient.send(proxy.server.port, IMAGE_BODY)
        await asyncio.wait_for(upstream.arrived.get(), 30)  # the upstream has read the whole body
        await client.reader.readuntil(b"data: first\n\n")  # the response is streaming, the upstream holds it open
        assert proxy.state.gate.counters().in_use == 1  # release_at=complete: the slot is still held, the bytes are not
        assert ledger.owners_total == 1  # the request's body had an owner...
        assert (ledger.bytes_live, owner_count(proxy)) == (0, 0)  # ...which is gone, with its bytes
        leftovers = big_allocations()
        assert leftovers == [], [t.traceback.format()[-3:] for t in leftovers]
        upstream.release.set()
        await client.reader.readuntil(b"data: [DONE]\n\n")
        client.writer.close()
    finally:
        tracemalloc.stop()
    await eventually(lambda: proxy.state.gate.counters().in_use == 0, "lease released at completion")


# ----------------------------------------------------------------------------------------------------------
# every other way a request can end


@dataclass
class Fault:
    """A way for a media request to end early: the proxy's settings and what the client sees."""

    env: dict[str, str]
    run: Callable[[Proxy, Upstream], Awaitable[int]]  # returns the status the client got (0: it hung up)
    expected: int
    owners: int = 1  # media owners the scenario's requests make (0: the body never arrived whole)


async def _invalid_image(proxy: Proxy, upstream: Upstream) -> int:
    return await (await RawClient.send(proxy.server.port, NOT_AN_IMAGE)).status()


async def _item_too_large(proxy: Proxy, upstream: Upstream) -> int:
    return await (await RawClient.send(proxy.server.port, IMAGE_BODY)).status()


async def _body_cut_off(proxy: Proxy, upstream: Upstream) -> int:
    client = await RawClient.send(proxy.server.port, IMAGE_BODY, cut_at=len(IMAGE_BODY) // 2)
    await eventually(lambda: proxy.state.in_flight == 1, "request in flight")
    client.hang_up()
    return 0


async def _behind_a_held_request(proxy: Proxy, upstream: Upstream,
                                 then: Callable[[RawClient], Awaitable[int]], *, headers: str = "") -> int:
    """Fill the gate's one slot with a request the upstream holds, send ours, run ``then``, let go."""
    upstream.route(PATH, lambda request: hold_until_released(upstream, request))
    first = await RawClient.send(proxy.server.port, SMALL_BODY)
    await asyncio.wait_for(upstream.arrived.get(), 30)
    second = await RawClient.send(proxy.server.port, IMAGE_BODY, headers=headers)
    try:
        return await then(second)
    finally:
        upstream.release.set()
        assert await first.status() == 200
        first.writer.close()


async def _refused_in_queue(proxy: Proxy, upstream: Upstream) -> int:
    return await _behind_a_held_request(proxy, upstream, RawClient.status)


async def _request_deadline_while_queued(proxy: Proxy, upstream: Upstream) -> int:
    return await _behind_a_held_request(proxy, upstream, RawClient.status, headers="X-MMGate-Timeout: 0.2\r\n")


async def _hang_up_while_queued(proxy: Proxy, upstream: Upstream) -> int:
    async def leave(client: RawClient) -> int:
        await eventually(lambda: proxy.state.gate.counters().waiting == 1, "second request queued")
        client.hang_up()
        await eventually(lambda: proxy.state.gate.counters().waiting == 0, "queued request gone")
        return 0

    return await _behind_a_held_request(proxy, upstream, leave)


async def _in_a_blocked_pool(proxy: Proxy, then: Callable[[RawClient], Awaitable[int]]) -> int:
    """Every decode thread busy: our items wait in the pool's queue while ``then`` runs."""
    blocked = BlockedPool(proxy.state.pool)
    try:
        client = await RawClient.send(proxy.server.port, IMAGE_BODY)
        status = await then(client)
        # The request is over and its owner gone at once, although its cancelled job still sits in the
        # executor's queue until a thread is free to dequeue it (jobs hold the owner only weakly).
        await eventually(lambda: proxy.state.in_flight == 0, "request ended")
        assert (proxy.state.buffers.bytes_live, proxy.state.buffers.owners_live) == (0, 0)
        return status
    finally:
        blocked.release()


async def _preprocess_timeout(proxy: Proxy, upstream: Upstream) -> int:
    return await _in_a_blocked_pool(proxy, RawClient.status)


async def _hang_up_during_preprocessing(proxy: Proxy, upstream: Upstream) -> int:
    async def leave(client: RawClient) -> int:
        await eventually(lambda: proxy.state.pool is not None and proxy.state.pool.queued == 1, "item queued")
        client.hang_up()
        return 0

    return await _in_a_blocked_pool(proxy, leave)


async def _upstream_gone(proxy: Proxy, upstream: Upstream) -> int:
    """The upstream was there at start-up and is gone now: decoded, then the forward cannot connect."""
    await eventually(lambda: proxy.state.ready_cache[0] > 0, "the start-up check")
    assert upstream.server is not None and not proxy.state.upstream.down
    await upstream.server.close()
    return await (await RawClient.send(proxy.server.port, IMAGE_BODY)).status()


async def _upstream_down(proxy: Proxy, upstream: Upstream) -> int:
    """The upstream is known to be down: refused before any decoding."""
    await eventually(lambda: proxy.state.upstream.down, "the start-up check found nothing listening")
    return await (await RawClient.send(proxy.server.port, IMAGE_BODY)).status()


async def _upstream_silent(proxy: Proxy, upstream: Upstream) -> int:
    upstream.route(PATH, lambda request: hold_until_released(upstream, request))
    return await (await RawClient.send(proxy.server.port, IMAGE_BODY)).status()


async def _hang_up_while_upstream_works(proxy: Proxy, upstream: Upstream) -> int:
    upstream.route(PATH, lambda request: hold_until_released(upstream, request))
    client = await RawClient.send(proxy.server.port, IMAGE_BODY)
    await asyncio.wait_for(upstream.arrived.get(), 30)
    client.hang_up()
    await asyncio.wait_for(upstream.cancelled.wait(), 30)  # the upstream saw the cancellation
    return 0


async def _hang_up_mid_stream(proxy: Proxy, upstream: Upstream) -> int:
    upstream.route(PATH, upstream.held_stream)
    client = await RawClient.send(proxy.server.port, IMAGE_BODY)
    await client.reader.readuntil(b"data: first\n\n")
    client.hang_up()
    await asyncio.wait_for(upstream.cancelled.wait(), 30)
    return 0


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


ONE_SLOT = {"MMGATE_MAX_MM_CONCURRENCY": "1", "MMGATE_RELEASE_AT": "complete"}  # the held request keeps it
FAULTS: dict[str, Fault] = {
    "body_cut_off": Fault({}, _body_cut_off, 0, owners=0),
    "invalid_image_400": Fault({}, _invalid_image, 400),
    "item_too_large_413": Fault({"MMGATE_MAX_MEDIA_ITEM_MB": "1"}, _item_too_large, 413),
    # refused while its body is still arriving (no place in line left): never read whole, so no owner
    "queue_full_429": Fault({**ONE_SLOT, "MMGATE_MAX_QUEUE": "0"}, _refused_in_queue, 429, owners=1),
    "queue_timeout_429": Fault({**ONE_SLOT, "MMGATE_QUEUE_TIMEOUT": "0.2"}, _refused_in_queue, 429, owners=2),
    "request_deadline_504": Fault(ONE_SLOT, _request_deadline_while_queued, 504, owners=2),
    "hang_up_while_queued": Fault(ONE_SLOT, _hang_up_while_queued, 0, owners=2),
    "preprocess_timeout_504": Fault({"MMGATE_DECODE_WORKERS": "1", "MMGATE_PREPROCESS_TIMEOUT": "0.2"},
                                    _preprocess_timeout, 504),
    "hang_up_during_preprocessing": Fault({"MMGATE_DECODE_WORKERS": "1"}, _hang_up_during_preprocessing, 0),
    "upstream_gone_503": Fault({}, _upstream_gone, 503),
    "upstream_down_503": Fault({"MMGATE_UPSTREAM": "closed-port"}, _upstream_down, 503),
    "upstream_silent_504": Fault({"MMGATE_UPSTREAM_READ_TIMEOUT": "0.2"}, _upstream_silent, 504),
    "hang_up_while_upstream_works": Fault({}, _hang_up_while_upstream_works, 0),
    "hang_up_mid_stream": Fault({}, _hang_up_mid_stream, 0),
}


@pytest.mark.parametrize("name", FAULTS)
async def test_nothing_left_after_fault(upstream: Upstream, start_proxy: StartProxy, name: str) -> None:
    fault = FAULTS[name]
    upstream.keep_bodies = False
    env = dict(fault.env)
    upstream_url = _closed_port() if env.pop("MMGATE_UPSTREAM", None) else upstream.url
    proxy = await start_proxy(upstream_url, MMGATE_RESIZE_MAX_SIDE="256", **env)
    state, ledger = proxy.state, proxy.state.buffers
    tracemalloc.start()
    try:
        assert await fault.run(proxy, upstream) == fault.expected
        await eventually(lambda: state.in_flight == 0, "every request ended")
        assert ledger.bytes_live == 0
        counters = state.gate.counters()
        assert (counters.in_use, counters.waiting, counters.bytes_in_use) == (0, 0, 0)
        assert ledger.owners_total == fault.owners  # the owners existed (so their absence below means something)
        await eventually(lambda: ledger.owners_live == 0, "every buffer owner freed")  # queued jobs may lag
        assert owner_count(proxy) == 0
        leftovers = big_allocations(collect=False)
        assert leftovers == [], [t.traceback.format()[-4:] for t in leftovers]
    finally:
        tracemalloc.stop()


# ----------------------------------------------------------------------------------------------------------
# giving freed heap back (proxy/runtime/memory.py)


async def test_heap_trimmed_once_media_work_goes_idle(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_TRIM_IDLE="0.05", MMGATE_RELEASE_AT="complete")
    trimmer, registry = proxy.state.trimmer, proxy.state.metrics.registry
    assert trimmer.enabled  # glibc here and in CI
    text = await RawClient.send(proxy.server.port, b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert await text.status() == 200
    upstream.arrived.get_nowait()
    assert not trimmer.pending  # text traffic never schedules a trim

    upstream.route(PATH, lambda request: hold_until_released(upstream, request))
    client = await RawClient.send(proxy.server.port, IMAGE_BODY)
    await asyncio.wait_for(upstream.arrived.get(), 30)
    assert proxy.state.gate.counters().in_use == 1 and not trimmer.pending  # never while media work holds the gate
    upstream.release.set()
    assert await client.status() == 200
    await asyncio.wait_for(trimmer.trimmed.wait(), 30)
    assert registry.get_sample_value("mmgate_memory_trims_total") == 1
    assert not trimmer.pending  # one trim per idle period


async def test_trim_off(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_TRIM_IDLE="0")
    client = await RawClient.send(proxy.server.port, SMALL_BODY)
    assert await client.status() == 200
    await eventually(lambda: proxy.state.gate.counters().in_use == 0, "lease released")
    assert not proxy.state.trimmer.enabled and not proxy.state.trimmer.pending


async def test_pillow_blocks_kept_while_busy_are_freed_by_the_idle_trim(upstream: Upstream,
                                                                       start_proxy: StartProxy) -> None:
    """A decode thread's freed images stay in Pillow's block cache while media work runs (freeing them would
    unmap their pixels under the GIL); the idle trim empties that cache before ``malloc_trim``."""
    from PIL import Image

    before = Image.core.get_blocks_max()
    Image.core.set_blocks_max(4)  # what tune_process sets for two decode threads
    try:
        proxy = await start_proxy(upstream.url, MMGATE_DECODE_MODE="thread", MMGATE_TRIM_IDLE="0.05",
                                  MMGATE_RELEASE_AT="complete", MMGATE_RESIZE_MAX_SIDE="256")
        upstream.route(PATH, lambda request: hold_until_released(upstream, request))
        client = await RawClient.send(proxy.server.port, IMAGE_BODY)
        await asyncio.wait_for(upstream.arrived.get(), 30)
        assert Image.core.get_stats()["blocks_cached"] > 0  # the decoded image's blocks, kept for the next one
        upstream.release.set()
        assert await client.status() == 200
        await asyncio.wait_for(proxy.state.trimmer.trimmed.wait(), 30)
        assert Image.core.get_stats()["blocks_cached"] == 0
    finally:
        Image.core.set_blocks_max(before)
