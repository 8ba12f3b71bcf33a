"""Buffer lifetime (issue 5): once the upstream has the body, the proxy holds none of the request's media,
although the response is still streaming. tracemalloc sees Python buffers (bodies, base64 strings); Pillow's
C memory is not seen by it, which is why images are closed inside the preprocessor."""

from __future__ import annotations

import asyncio
import gc
import io
import tracemalloc

import numpy as np
import orjson
import pytest
from aiohttp import web
from PIL import Image

from .conftest import StartProxy, Upstream
from .media import chat_with_image, data_uri, eventually

BIG = 1 << 20  # no single live allocation of this size may belong to a finished handoff


def noise_png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(7).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


async def raw_post(port: int, path: str, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a request with a bare socket and drop our copy of the body, so only the proxy could hold one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    writer.write(head + body)
    del body
    await writer.drain()
    return reader, writer


def big_allocations() -> list[tracemalloc.Trace]:
    gc.collect()
    return [t for t in tracemalloc.take_snapshot().traces if t.size >= BIG]


@pytest.mark.parametrize("resize", ["0", "256"], ids=["forwarded_as_is", "rewritten"])
async def test_media_released_while_response_still_streams(upstream: Upstream, start_proxy: StartProxy,
                                                           resize: str) -> None:
    upstream.keep_bodies = False
    upstream.route("/v1/chat/completions", upstream.held_stream)
    proxy = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_SIDE=resize, MMGATE_RELEASE_AT="complete")
    body = orjson.dumps(chat_with_image(data_uri(noise_png(1200, 900)), stream=True))
    assert len(body) > 3 * BIG
    tracemalloc.start()
    try:
        reader, writer = await raw_post(proxy.server.port, "/v1/chat/completions", body)
        del body
        await asyncio.wait_for(upstream.arrived.get(), 30)  # the upstream has read the whole body
        await reader.readuntil(b"data: first\n\n")  # the response is streaming, the upstream holds it open
        assert proxy.state.metrics.media_bytes_live._value.get() == 0
        assert proxy.state.gate.in_use == 1  # release_at=complete: the slot is still held, the bytes are not
        leftovers = big_allocations()
        assert leftovers == [], [t.traceback.format()[-3:] for t in leftovers]
        upstream.release.set()
        await reader.readuntil(b"data: [DONE]\n\n")
        writer.close()
    finally:
        tracemalloc.stop()
    await eventually(lambda: proxy.state.gate.in_use == 0, "lease released at completion")


async def test_live_bytes_zero_after_errors_and_disconnects(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_SIDE="64")
    live = proxy.state.metrics.media_bytes_live
    bad = orjson.dumps(chat_with_image("data:image/png;base64," + "QUJD" * 100_000))  # valid base64, not an image
    reader, writer = await raw_post(proxy.server.port, "/v1/chat/completions", bad)
    assert b" 400 " in await reader.readline()
    writer.close()
    assert live._value.get() == 0

    async def never(request: web.Request) -> web.Response:
        await upstream.release.wait()
        return web.json_response({})

    upstream.route("/v1/chat/completions", never)
    good = orjson.dumps(chat_with_image(data_uri(noise_png(300, 200))))
    reader, writer = await raw_post(proxy.server.port, "/v1/chat/completions", good)
    await asyncio.wait_for(upstream.arrived.get(), 30)
    writer.close()  # the client leaves while the upstream is working
    await asyncio.wait_for(upstream.cancelled.wait(), 30)
    await asyncio.wait_for(proxy.state.idle.wait(), 30)
    assert live._value.get() == 0 and proxy.state.gate.in_use == 0
