"""Where guarded connections meet aiohttp: ``GuardedSite`` listens like ``web.TCPSite`` with every connection
wrapped in a ``connections.GuardedConnection``, and ``mark_head_received`` (a middleware) tells a connection
that its head is in and when its answer is done; a connection over the cap gets only the probes."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from aiohttp import web

from proxy.edge.access_log import log_refused_request
from proxy.edge.aiohttp_internals import listening_server, set_listening_server
from proxy.edge.connections import PROBE_PATHS, ConnectionGuard, GuardedConnection
from proxy.edge.error_response import error_response
from proxy.edge.upstream import request_id_for
from proxy.payload.dialects import dialect_for_path


async def _probe_over_the_cap(request: web.Request, handler: Any, guard: ConnectionGuard) -> web.StreamResponse:
    """A connection over the cap gets liveness or readiness from the app, without a body, then a close."""
    resource = request.match_info.route.resource
    if resource is not None and resource.canonical in PROBE_PATHS and not request.body_exists:
        response: web.StreamResponse = await handler(request)
        response.force_close()
        return response
    error = guard.too_many()
    request_id = request_id_for(request.headers.get("X-Request-Id"))
    guard.on_refused(error.code)
    if guard.access_log:
        log_refused_request(error, request, request_id, 0.0)
    answer = error_response(error, dialect_for_path(request.path), request_id)
    answer.force_close()
    if request.content.is_eof():
        return answer
    await answer.prepare(request)  # a body is on its way: answer, then close without reading it
    await answer.write_eof()
    request.protocol.force_close()
    return answer


def mark_head_received(guard: ConnectionGuard) -> Any:
    """Middleware: tells the request's connection that its head is in, and when its handler is done."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        conn = guard.connection_for(request.protocol)
        if conn is None:  # served by another site (a test server, the admin port)
            return await handler(request)
        conn.head_received(request)
        task = asyncio.current_task()
        if task is not None:  # the request's own task: done once aiohttp has written the whole answer
            task.add_done_callback(lambda _: conn.request_finished())
        try:
            if conn.probe:
                return await _probe_over_the_cap(request, handler, guard)
            return await handler(request)
        finally:
            conn.response_done(request.content.is_eof() or not request.body_exists)

    return middleware


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` whose connections go through a ``ConnectionGuard``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard, *,
                 backlog: int = 1024, sock: socket.socket | None = None) -> None:
        super().__init__(runner, backlog=backlog)
        self._app_runner = runner
        self._host = host
        self._port = port
        self._guard = guard
        self._listen_backlog = backlog
        self._sock = sock  # a listening socket shared with other front processes (MMGATE_PROCESSES)

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        server = listening_server(self)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        make_handler = self._app_runner.server
        if make_handler is None:
            raise RuntimeError("GuardedSite.start() before its runner's setup()")
        guard = self._guard
        loop = asyncio.get_running_loop()
        if self._sock is not None:
            server = await loop.create_server(lambda: GuardedConnection(guard, make_handler), sock=self._sock,
                                              backlog=self._listen_backlog)
        else:
            server = await loop.create_server(lambda: GuardedConnection(guard, make_handler), self._host, self._port,
                                              backlog=self._listen_backlog, reuse_address=True)
        set_listening_server(self, server)
