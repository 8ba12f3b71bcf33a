"""The scriptable upstream and the proxy handle the tests and the fuzzing bench share.

Why here and not in ``tests/conftest.py``: ``bench/fuzz.py`` starts the same servers outside pytest, and a bench
must not import the test suite. The pytest fixtures that start them stay in ``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.admin.routes import PROBE_USER_AGENT
from proxy.app import build_app, make_runner
from proxy.edge.site import GuardedSite
from proxy.settings import Settings
from proxy.state import STATE, AppState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Seen:
    method: str
    path: str
    headers: CIMultiDict[str]
    raw_headers: list[tuple[str, str]]
    body: bytes


@dataclass
class Upstream:
    """A real aiohttp server whose behaviour a test scripts with ``route()``; default: echo a small JSON."""

    server: TestServer | None = None
    seen: list[Seen] = field(default_factory=list)
    arrived: asyncio.Queue[Seen] = field(default_factory=asyncio.Queue)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)  # tests set it to let held handlers go on
    handlers: dict[str, Handler] = field(default_factory=dict)
    keep_bodies: bool = True  # False: bodies are read and dropped (memory tests must not see them kept here)
    checks: int = 0  # mmgate's upstream checks answered (never in ``seen``)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    def route(self, path: str, handler: Handler) -> None:
        self.handlers[path] = handler

    async def held_stream(self, request: web.Request, last: bytes = b"data: [DONE]\n\n") -> web.StreamResponse:
        """An SSE answer that sends its first event, then holds until ``release`` is set, then ``last``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        await self.release.wait()
        await response.write(last)
        return response

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("User-Agent") == PROBE_USER_AGENT:
            # mmgate's own upstream check (at start-up, /mmgate/ready): answered, not recorded as client traffic
            self.checks += 1
            handler = self.handlers.get(request.path)
            return await handler(request) if handler is not None else web.json_response({"ok": True})
        if self.keep_bodies:
            body = await request.read()
        else:
            async for _chunk in request.content.iter_any():
                pass
            body = b""
        seen = Seen(request.method, request.raw_path, CIMultiDict(request.headers),
                    [(k.decode(), v.decode()) for k, v in request.raw_headers], body)
        self.seen.append(seen)
        self.arrived.put_nowait(seen)
        handler = self.handlers.get(request.path)
        try:
            if handler is not None:
                return await handler(request)
            return web.json_response({"ok": True, "path": request.path})
        except asyncio.CancelledError:
            self.cancelled.set()
            raise



@dataclass
class Proxy:
    server: GuardedSite  # listens as `mmgate serve` does: connection cap and head deadline included
    app: web.Application

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def state(self) -> AppState:
        return self.app[STATE]


StartProxy = Callable[..., Awaitable[Proxy]]


@dataclass(frozen=True)
class Counted:
    """The requests mmgate says it answered, as an operator reads them over HTTP."""

    by_kind: dict[str, float]  # /mmgate/stats ``requests.by_kind``: what the dashboard draws
    by_kind_and_code: dict[tuple[str, str], float]  # ``mmgate_requests_total`` from /mmgate/metrics


async def counted(proxy: Proxy) -> Counted:
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/mmgate/stats") as response:
            by_kind = (await response.json())["requests"]["by_kind"]
        async with client.get(proxy.url + "/mmgate/metrics") as response:
            exposition = await response.text()
    by_kind_and_code: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "mmgate_requests_total":
                key = (sample.labels["kind"], sample.labels["code"])
                by_kind_and_code[key] = by_kind_and_code.get(key, 0.0) + sample.value
    return Counted(by_kind, by_kind_and_code)


def proxy_settings(upstream_url: str, **env: str) -> Settings:
    """The settings of a test proxy: ``env`` over quiet defaults. ``MMGATE_DECODE_MODE`` in the environment
    runs every test proxy in that mode (CI runs the suite once per mode)."""
    mode = os.environ.get("MMGATE_DECODE_MODE")
    base = {"MMGATE_UPSTREAM": upstream_url, "MMGATE_ACCESS_LOG": "off"}
    if mode:
        base["MMGATE_DECODE_MODE"] = mode
    return Settings.from_env({**base, **env})


# servers outside pytest (the fuzzing bench); the tests use the conftest fixtures instead


async def start_upstream() -> Upstream:
    """The conftest ``upstream`` fixture, without pytest (the fuzzing bench)."""
    up = Upstream()
    app = web.Application(client_max_size=1 << 30, handler_args={"auto_decompress": False})
    app.router.add_route("*", "/{tail:.*}", up._dispatch)
    up.server = TestServer(app, host="127.0.0.1")
    await up.server.start_server()
    return up


async def start_proxy_server(upstream_url: str, **env: str) -> tuple[Proxy, Callable[[], Awaitable[None]]]:
    """The conftest ``start_proxy`` fixture without pytest (same runner and listening site); returns the
    proxy and the coroutine function that stops it."""
    app = build_app(proxy_settings(upstream_url, **env))
    runner = make_runner(app)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, app[STATE].connections)
    await site.start()
    return Proxy(site, app), runner.cleanup


READER_RCVBUF = 4096  # bytes: the receive buffer of a client that reads nothing, so that its answer waits on it


async def reader_of_nothing(port: int, body: bytes, request_id: str | None = None) -> socket.socket:
    """A client with a ``READER_RCVBUF`` receive buffer (set before connecting: the window is agreed then) that
    sends ``body`` as a chat request to 127.0.0.1:``port`` (``Connection: close``: the answer's end ends the
    connection) and reads nothing of its answer yet."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READER_RCVBUF)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nConnection: close\r\n"
            + (f"X-Request-Id: {request_id}\r\n" if request_id else "")
            + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    await loop.sock_sendall(sock, head.encode() + body)
    return sock


async def read_to_the_end(sock: socket.socket, bound: float = 60.0) -> bytes:
    """What the kernel still holds for the client and the rest of its answer, until the connection ends (closed
    or reset) or ``bound`` seconds pass (a bound on a hang); the socket is closed."""
    loop = asyncio.get_running_loop()
    received = bytearray()
    try:
        async with asyncio.timeout(bound):
            while chunk := await loop.sock_recv(sock, 1 << 16):
                received += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return bytes(received)
