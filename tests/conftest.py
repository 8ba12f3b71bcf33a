"""Shared fixtures: a scriptable upstream and the real proxy, both real HTTP servers on 127.0.0.1.

The upstream records what really crossed the wire (method, path, headers, raw body) and reports events
(request arrived, handler cancelled because mmgate hung up) that tests await instead of sleeping.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from proxy.app import build_app, make_runner
from proxy.connections import GuardedSite
from proxy.state import STATE, AppState
from proxy.settings import Settings

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


@pytest.fixture
async def upstream() -> Any:
    up = Upstream()
    app = web.Application(client_max_size=1 << 30, handler_args={"auto_decompress": False})  # raw wire bytes
    app.router.add_route("*", "/{tail:.*}", up._dispatch)
    up.server = TestServer(app, host="127.0.0.1")
    await up.server.start_server()
    yield up
    up.release.set()
    await up.server.close()


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


@pytest.fixture
async def start_proxy() -> Any:
    """``await start_proxy(upstream_url, MMGATE_MAX_QUEUE="2", ...)``: the real app from build_app()."""
    runners: list[web.AppRunner] = []

    async def start(upstream_url: str, **env: str) -> Proxy:
        settings = Settings.from_env({"MMGATE_UPSTREAM": upstream_url, "MMGATE_ACCESS_LOG": "off", **env})
        app = build_app(settings)
        runner = make_runner(app)
        await runner.setup()
        runners.append(runner)
        site = GuardedSite(runner, "127.0.0.1", 0, app[STATE].connections)
        await site.start()
        return Proxy(site, app)

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def proxy(upstream: Upstream, start_proxy: StartProxy) -> Proxy:
    return await start_proxy(upstream.url)


def require_heavy() -> bool:
    """CI sets MMGATE_REQUIRE_HEAVY=1: a missing heavy part (Chromium, vLLM) then fails instead of skipping."""
    return os.environ.get("MMGATE_REQUIRE_HEAVY") == "1"
