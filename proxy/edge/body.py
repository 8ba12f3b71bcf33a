"""Reading a request body whole within MMGATE_MAX_BODY_MB and MMGATE_BODY_READ_TIMEOUT (``read_body``): as the
chunks it arrived in, or, once its first bytes name media, gathered into one buffer as it arrives (its owner,
``buffers.BufferLedger.hold``, then takes that buffer as it is).

A Content-Length over the limit is refused before a byte is read, a chunked body as soon as it crosses
the limit, and a body that trickles is cut at the deadline (aiohttp has no body-read deadline of its own).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from preprocessors.errors import BODY_READ_TIMEOUT, BODY_TOO_LARGE, INCOMPLETE_BODY

HEAD_BYTES = 64 << 10  # how much of a body ``on_head`` sees; smaller bodies are not worth a place in line
SMALL_PIECE = 16 << 10  # parser chunks smaller than this are gathered before they join the list


async def read_body(request: web.Request, limit: int, timeout: float,
                    on_head: Callable[[bytes], Awaitable[bool]] | None = None) -> list[bytes]:
    """The whole body, as the chunks the HTTP parser delivered, refusing more than ``limit`` bytes (413 up
    front from Content-Length, or as soon as a chunked body crosses it) and more than ``timeout`` seconds (408:
    aiohttp has no body-read timeout). A text body is forwarded as it came, never copied.

    ``on_head`` is called once with the first ``HEAD_BYTES`` of a body bigger than that which has not fully
    arrived yet; it may raise to refuse the request before the rest is read. When it returns True (the head
    names media, so the body will be wanted in one buffer), the rest is appended to one growing buffer as it
    arrives, and the list holds that buffer alone. Joining the chunks at the end instead would hold the body
    twice at the join, and fault both copies into fresh pages (the chunks grow the heap, which
    ``runtime.memory``'s trim threshold hands back, and the joined buffer is a mapping of its own)."""
    if request.content_length is not None and request.content_length > limit:
        raise BODY_TOO_LARGE.error(
            f"the body is {request.content_length} bytes, over the limit of {limit} (MMGATE_MAX_BODY_MB)")
    if not request.body_exists:
        return []
    content = request.content
    if content.is_eof():  # the whole body came with the head (small requests): no wait, no timer
        body = content.read_nowait()
        if len(body) > limit:
            raise BODY_TOO_LARGE.error(f"the body is over the limit of {limit} bytes (MMGATE_MAX_BODY_MB)")
        return [body] if body else []
    expected = request.content_length
    if expected is not None and expected <= HEAD_BYTES:
        on_head = None
    # A text body's chunks are kept as aiohttp's parser hands them over: it is forwarded as it came, so a copy
    # would be waste. A media body, wanted in one buffer, grows one as it arrives rather than taking a buffer of
    # the declared size, which would cost a zeroing pass and commit that size in full before the client sent
    # it. Small pieces (a client that trickles) are gathered into pieces of at
    # least SMALL_PIECE, so the list costs a bounded fraction of the body whatever the client's pace.
    chunks: list[bytes] = []
    small = bytearray()
    whole: bytearray | None = None  # the body gathered into one buffer, once ``on_head`` asked for it
    size = 0
    try:
        async with asyncio.timeout(timeout):
            # iter_chunks hands over the parser's pieces one by one; iter_any would join those already queued.
            async for chunk, _end_of_http_chunk in content.iter_chunks():
                size += len(chunk)
                if size > limit:
                    raise BODY_TOO_LARGE.error(f"the body is over the limit of {limit} bytes (MMGATE_MAX_BODY_MB)")
                if whole is not None:
                    # Grown in place (glibc remaps a buffer this big without copying it); the parser's chunk is
                    # freed at once, so the next one reuses its memory.
                    whole += chunk
                    continue
                if len(chunk) < SMALL_PIECE:
                    small += chunk
                    if len(small) >= SMALL_PIECE:
                        chunks.append(bytes(small))
                        small.clear()
                else:
                    if small:
                        chunks.append(bytes(small))
                        small.clear()
                    chunks.append(chunk)
                if on_head is not None and size >= HEAD_BYTES:
                    gather = await on_head(_head(chunks, small))
                    on_head = None
                    if gather:
                        whole = bytearray().join((*chunks, small))
                        chunks.clear()
                        small.clear()
    except TimeoutError:
        raise BODY_READ_TIMEOUT.error(f"the request body did not arrive within {timeout:g} s") from None
    if whole is not None:
        chunks.append(whole)  # a bytes-like buffer: everything downstream reads it through find, slices and views
    elif small:
        chunks.append(bytes(small))
    if expected is not None and size != expected:  # pragma: no cover - aiohttp raises on a short body first
        raise INCOMPLETE_BODY.error(f"the body ended after {size} of {expected} bytes")
    return chunks


def _head(chunks: list[bytes], small: bytearray) -> bytes:
    """The first ``HEAD_BYTES`` of the chunks read so far (``small``: the gathered piece not yet in the list),
    joining only the chunks it needs."""
    needed: list[bytes | bytearray] = []
    taken = 0
    for chunk in (*chunks, small):
        needed.append(chunk)
        taken += len(chunk)
        if taken >= HEAD_BYTES:
            break
    return b"".join(needed)[:HEAD_BYTES]
