"""Client connections: how many may be open, and how long a request head may take to arrive.

aiohttp bounds the size of a request head but not the time it takes, so a client that sends header lines
slowly holds a connection (and its buffers) as long as it likes, and nothing caps how many connections
are open at once. ``GuardedSite`` listens like ``web.TCPSite`` but wraps every connection in a
``GuardedConnection`` that

* refuses a connection beyond ``MMGATE_MAX_CONNECTIONS`` at once, with a complete 503 answer
  (``too_many_connections``, ``Retry-After``) and a close, before aiohttp ever parses anything;
* gives the request head ``MMGATE_HEADER_TIMEOUT`` seconds from the connection's opening, or from the
  first byte after an idle keep-alive pause: then it answers 408 ``header_timeout`` and closes (the
  role of nginx's ``client_header_timeout``). Idle keep-alive connections are closed by aiohttp after
  ``MMGATE_KEEPALIVE_TIMEOUT``; the body has its own deadline (``MMGATE_BODY_READ_TIMEOUT``).

A head is known to be complete when aiohttp hands the request to the application: ``mark_head_received``
(a middleware) tells the connection, and re-opens the head deadline for the next request once the
response is done and the body was read whole (a body left unread is drained by aiohttp's lingering close,
which ends the connection anyway).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .dialects import Dialect, error_headers
from .errors import MmgateError

log = logging.getLogger("mmgate")


def raw_error_response(error: MmgateError) -> bytes:
    """A complete HTTP/1.1 answer for a connection no request handler will ever see, then close."""
    body = Dialect.OPENAI.error_body(error)
    reason = {408: "Request Timeout", 503: "Service Unavailable"}.get(error.status, "Error")
    head = [f"HTTP/1.1 {error.status} {reason}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close"]
    head.extend(f"{name}: {value}" for name, value in error_headers(error).items())
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class ConnectionGuard:
    """The open client connections of one app, and the limits they live under."""

    def __init__(self, max_connections: int, header_timeout: float,
                 on_refused: Callable[[str], None] = lambda code: None) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.on_refused = on_refused
        self.open = 0
        self._by_handler: dict[RequestHandler, GuardedConnection] = {}

    def connection_for(self, handler: Any) -> GuardedConnection | None:
        return self._by_handler.get(handler)

    def _opened(self, conn: GuardedConnection, handler: RequestHandler) -> None:
        self.open += 1
        self._by_handler[handler] = conn

    def _closed(self, handler: RequestHandler) -> None:
        self.open -= 1
        self._by_handler.pop(handler, None)


class GuardedConnection(asyncio.Protocol):
    """One client connection: aiohttp's own protocol inside, a connection cap and a head deadline around."""

    def __init__(self, guard: ConnectionGuard, make_handler: Callable[[], RequestHandler]) -> None:
        self._guard = guard
        self._make_handler = make_handler
        self._handler: RequestHandler | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._awaiting_head = True  # no request in the handler's hands: the next bytes are a head

    # --- asyncio.Protocol, delegated to aiohttp's RequestHandler ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        guard = self._guard
        if guard.open >= guard.max_connections:
            guard.on_refused("too_many_connections")
            transport.write(raw_error_response(MmgateError(
                503, "too_many_connections",
                f"{guard.open} client connections are open, the limit (MMGATE_MAX_CONNECTIONS); retry later",
                headers={"Retry-After": "1"})))
            transport.close()
            return
        self._handler = self._make_handler()
        guard._opened(self, self._handler)
        self._handler.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._handler is None:
            return  # refused: whatever the client still sends is dropped with the connection
        if self._awaiting_head and self._timer is None:
            self._arm()
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        if self._handler is not None:
            self._handler.eof_received()  # aiohttp's handler returns None: keep the transport's default close
        return None

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        handler, self._handler = self._handler, None
        if handler is not None:
            self._guard._closed(handler)
            handler.connection_lost(exc)

    # --- the head deadline ---

    def head_received(self) -> None:
        self._awaiting_head = False
        self._disarm()

    def response_done(self, body_read: bool) -> None:
        """The handler is done with a request. Its next bytes start a new head, unless this body was left
        unread (aiohttp drains it, then closes the connection)."""
        self._awaiting_head = body_read

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.header_timeout, self._head_too_slow)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_too_slow(self) -> None:
        self._timer = None
        transport = self._transport
        if not self._awaiting_head or transport is None or transport.is_closing():
            return
        self._guard.on_refused("header_timeout")
        transport.write(raw_error_response(MmgateError(
            408, "header_timeout",
            f"the request head did not arrive within {self._guard.header_timeout:g} s (MMGATE_HEADER_TIMEOUT)")))
        transport.close()


def mark_head_received(guard: ConnectionGuard) -> Any:
    """Middleware: tells the request's connection that its head is in, and when its handler is done."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        conn = guard.connection_for(request.protocol)
        if conn is None:  # served by another site (a test server, the admin port)
            return await handler(request)
        conn.head_received()
        try:
            return await handler(request)
        finally:
            conn.response_done(request.content.is_eof() or not request.body_exists)

    return middleware


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` whose connections go through a ``ConnectionGuard``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard, *,
                 backlog: int = 1024) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        # create_server() in start() returns an asyncio.Server; aiohttp's BaseSite types the slot as AbstractServer
        server = cast("asyncio.Server | None", self._server)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        make_handler = self._runner.server
        assert make_handler is not None
        guard = self._guard
        self._server = await asyncio.get_running_loop().create_server(
            lambda: GuardedConnection(guard, make_handler), self._host, self._port,
            backlog=self._backlog, reuse_address=True)
