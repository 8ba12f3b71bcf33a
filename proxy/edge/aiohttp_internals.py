"""Every place mmgate reaches into aiohttp's private parts, and the aiohttp versions they were checked against.

aiohttp has no public way to wrap the protocol of a site's connections, to tell whether a connection waits
for its next request, or whether its own flow control holds the reading; ``connections.GuardedConnection``
and ``site.GuardedSite`` need all three. The private names they use are read here only, so that a new aiohttp
is checked in one module:

* ``RequestHandler._waiter``: the future aiohttp's request loop awaits between two requests (its keep-alive
  timer's own test for an idle connection);
* ``RequestHandler._reading_paused`` and ``_buffer_paused``: aiohttp paused the transport's reading for its
  body buffer or its queue of pipelined requests (``_buffer_paused`` is in 3.14.5, not in 3.14.3);
* ``aiohttp.web.BaseSite._server``: the listening ``asyncio.Server`` a site closes when it stops
  (``aiohttp.web.TCPSite.start`` sets it the same way);
* ``web.StreamResponse._payload_writer``: the response's ``StreamWriter``, whose ``write(..., drain=False)`` and
  ``drain()`` (public on the writer) add to the transport's buffer without waiting for the client to read it
  down, and wait for it apart; ``web.StreamResponse.write`` waits every 64 KiB, even on the write that fills it.

Checked against aiohttp ``CHECKED_FROM`` up to, not including, ``CHECKED_BELOW`` (the source of 3.14.5,
with this suite passing); ``pyproject.toml`` bounds the dependency to that range, and
tests/proxy/edge/test_aiohttp_internals.py fails when the installed aiohttp is outside it.
"""

from __future__ import annotations

import asyncio
from typing import cast

from aiohttp import web
from aiohttp.http_writer import StreamWriter
from aiohttp.web_protocol import RequestHandler

CHECKED_FROM = "3.14.5"
CHECKED_BELOW = "3.15"


def waits_for_next_request(handler: RequestHandler) -> bool:
    """aiohttp's request loop waits for the next request on this connection (no byte of it has arrived)."""
    waiter = handler._waiter
    return waiter is not None and not waiter.done()


def reading_held_by_aiohttp(handler: RequestHandler) -> bool:
    """aiohttp's own flow control holds the connection's reading: a full body buffer or request queue."""
    return handler._reading_paused or handler._buffer_paused


def listening_server(site: web.BaseSite) -> asyncio.Server | None:
    """The site's listening server (``asyncio.AbstractEventLoop.create_server`` makes an ``asyncio.Server``;
    aiohttp types the slot as ``AbstractServer``), None before it started."""
    return cast("asyncio.Server | None", site._server)


def set_listening_server(site: web.BaseSite, server: asyncio.Server) -> None:
    """Hand the site a listening server it started itself: aiohttp closes it when the site stops."""
    site._server = server


async def write_without_waiting(response: web.StreamResponse, chunk: bytes) -> None:
    """Add ``chunk`` to the answer without waiting for the client to read what is buffered: the transport
    keeps it until the client reads (the caller bounds how much it adds this way, with ``client_read_down``)."""
    await _writer(response).write(chunk, drain=False)


async def client_read_down(response: web.StreamResponse) -> None:
    """Wait until the client has read the answer's buffer down (at once if it is not over the high-water mark)."""
    await _writer(response).drain()


def _writer(response: web.StreamResponse) -> StreamWriter:
    writer = response._payload_writer
    if not isinstance(writer, StreamWriter):  # pragma: no cover - a response the relay has not prepared
        raise RuntimeError("the response is not prepared, or already ended")
    return writer
