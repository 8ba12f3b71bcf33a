"""Reading a body: a media body is held once while it arrives, a text body is never copied.

A real aiohttp server reads the body with ``read_body`` (and, for media, gives it its owner with
``BufferLedger.hold``, as the pipeline does); a real client sends it in pieces. tracemalloc sees what the
server allocated while reading: the body is made before tracing starts.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.edge.body import HEAD_BYTES, read_body
from proxy.edge.buffers import BufferLedger

BODY = os.urandom(3 << 20)
PIECE = 64 << 10

ServerFactory = Callable[[web.Application], Awaitable[TestServer]]


async def pieces() -> AsyncIterator[bytes]:
    for low in range(0, len(BODY), PIECE):
        yield BODY[low : low + PIECE]


async def read_with(aiohttp_server: ServerFactory, names_media: bool) -> dict[str, int | bool]:
    """Send BODY in pieces to a server that reads it as the pipeline does; what it got, and the most memory
    its reading held at once."""
    heads: list[bytes] = []

    async def on_head(head: bytes) -> bool:
        heads.append(head)
        return names_media

    async def handler(request: web.Request) -> web.Response:
        tracemalloc.start()
        try:
            chunks = await read_body(request, 64 << 20, 30.0, on_head)
            count = len(chunks)
            if names_media:
                body = (await BufferLedger().hold(chunks)).data
            else:
                body = b"".join(chunks)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return web.json_response({"buffers": count, "same": body == BODY, "peak": peak,
                                  "head": len(heads[0]) if heads else 0})

    app = web.Application()
    app.router.add_post("/", handler)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session, \
            session.post(server.make_url("/"), data=pieces(), headers={"Content-Length": str(len(BODY))}) as answer:
        assert answer.status == 200
        return dict(await answer.json())


async def test_a_media_body_is_held_once_while_it_arrives(aiohttp_server: ServerFactory) -> None:
    seen = await read_with(aiohttp_server, names_media=True)
    assert seen["head"] == HEAD_BYTES
    assert seen["same"]
    assert seen["buffers"] == 1  # the owner takes the buffer as it is, with no join
    # Gathered as it arrived: never the chunks and a joined copy at once (2× the body), only the growing buffer
    # (its over-allocation is an eighth) and a chunk in flight.
    assert int(seen["peak"]) < 1.3 * len(BODY)


async def test_a_text_body_stays_the_chunks_it_came_in(aiohttp_server: ServerFactory) -> None:
    seen = await read_with(aiohttp_server, names_media=False)
    assert seen["head"] == HEAD_BYTES
    assert seen["same"]
    assert int(seen["buffers"]) > 1  # forwarded as it came: nothing joined them
