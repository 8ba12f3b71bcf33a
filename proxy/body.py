"""Reading a request body whole, within MMGATE_MAX_BODY_MB and MMGATE_BODY_READ_TIMEOUT.

A Content-Length over the limit is refused before a byte is read, a chunked body as soon as it crosses
the limit, and a body that trickles is cut at the deadline (aiohttp has no body-read deadline of its own).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from .errors import MmgateError

HEAD_BYTES = 64 << 10  # how much of a body ``on_head`` sees; smaller bodies are not worth a place in line


async def read_body(request: web.Request, limit: int, timeout: float,
                    on_head: Callable[[bytes], None] | None = None) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (413 up front from Content-Length, or as soon as a
    chunked body crosses it) and more than ``timeout`` seconds (408: aiohttp has no body-read timeout).

    ``on_head`` is called once with the first ``HEAD_BYTES`` of a body bigger than that which has not fully
    arrived yet; it may raise to refuse the request before the rest is read."""
    if request.content_length is not None and request.content_length > limit:
        raise MmgateError(413, "body_too_large",
                          f"the body is {request.content_length} bytes, over the limit of {limit} (MMGATE_MAX_BODY_MB)")
    if not request.body_exists:
        return b""
    content = request.content
    if content.is_eof():  # the whole body came with the head (small requests): no wait, no timer
        body = content.read_nowait()
        if len(body) > limit:
            raise MmgateError(413, "body_too_large",
                              f"the body is over the limit of {limit} bytes (MMGATE_MAX_BODY_MB)")
        return body
    expected = request.content_length
    if expected is not None and expected <= HEAD_BYTES:
        on_head = None
    # With a Content-Length the chunks go straight into one buffer of that size: a list joined at the end
    # would hold the body twice at the moment of the join, for every request being read at once.
    buffer = bytearray(expected) if expected is not None else None
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in content.iter_any():
                end = size + len(chunk)
                if end > limit:
                    raise MmgateError(413, "body_too_large",
                                      f"the body is over the limit of {limit} bytes (MMGATE_MAX_BODY_MB)")
                if buffer is not None:
                    buffer[size:end] = chunk  # the HTTP parser never delivers more than Content-Length
                else:
                    chunks.append(chunk)
                size = end
                if on_head is not None and size >= HEAD_BYTES:
                    on_head(buffer[:HEAD_BYTES] if buffer is not None else b"".join(chunks)[:HEAD_BYTES])
                    on_head = None
    except TimeoutError:
        raise MmgateError(408, "body_read_timeout", f"the request body did not arrive within {timeout:g} s") from None
    if buffer is not None:
        if size != len(buffer):  # pragma: no cover - aiohttp raises on a short body before we get here
            raise MmgateError(400, "incomplete_body", f"the body ended after {size} of {len(buffer)} bytes")
        return buffer  # bytes-like: every consumer only reads it
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    chunks.clear()
    return body
