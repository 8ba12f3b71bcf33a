"""A model backend in this process whose speed follows a ``testkit.adaptive_sim.Curve``, and mmgate in front of it:
what ``bench/fleet.py``'s cells (``testkit.fleet_cells``) measure the adaptive limit against.

The backend shares itself among the requests it holds, as a batching server's steps serve its whole batch: each
request is one unit of work, done at ``1 / curve(c, now)`` units a second while it holds ``c``. It waits on timers,
so the figures depend little on the shared machine. Shared, not fixed at each request's arrival as the
simulator's: over HTTP the clients answered together send again a few milliseconds apart, and requests that came
while the backend held fewer would keep their short times, a rate no server gives.

What a request asks decides its answer (the cells' attackers and slow reader rely on it): its first text part is
its tag (recorded in ``order``); tag ``refuse`` gets 400 at once, ``max_tokens: 1`` an answer at once (one
completion token), ``stream`` ``SLOW_EVENTS`` SSE events at once; any other is served by the curve and answered
with 16 completion tokens in ``usage``, as a model server's answers carry them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from testkit.adaptive_sim import Curve
from testkit.media import chat_with_image
from testkit.servers import Proxy, start_proxy_server

# 8 MiB of SSE events: more than every buffer between mmgate and a client that reads nothing (Linux lets a
# socket's send buffer grow to tcp_wmem's maximum, 4 MiB by default; a 2 MiB answer fits in it whole)
SLOW_EVENT, SLOW_EVENTS = b"data: " + b"x" * (16 << 10) + b"\n\n", 512


def answer(completion_tokens: int) -> dict[str, Any]:
    usage = {"prompt_tokens": 64, "completion_tokens": completion_tokens, "total_tokens": 64 + completion_tokens}
    return {"id": "c", "object": "chat.completion", "usage": usage,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}


ANSWER, ONE_TOKEN = answer(16), answer(1)


@dataclass
class CurveBackend:
    """The backend of this module's docstring; ``order``: the tags of the requests, as they arrived."""

    curve: Curve
    order: list[str] = field(default_factory=list)
    server: TestServer | None = None
    started: float = field(default_factory=time.perf_counter)
    remaining: dict[asyncio.Future[None], float] = field(default_factory=dict)  # each request's work left
    _updated: float = 0.0
    _timer: asyncio.TimerHandle | None = None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        tag = body["messages"][0]["content"][0]["text"]
        self.order.append(tag)
        if tag == "refuse":
            return web.json_response({"error": {"message": "no", "type": "invalid_request_error"}}, status=400)
        if body.get("max_tokens") == 1:
            return web.json_response(ONE_TOKEN)
        if body.get("stream"):
            return await self.stream(request)
        await self.serve()
        return web.json_response(ANSWER)

    async def serve(self) -> None:
        """One request's service, sharing the backend with every request it holds meanwhile."""
        done = asyncio.get_running_loop().create_future()
        self._advance()
        self.remaining[done] = 1.0
        self._reschedule()
        try:
            await done
        finally:
            if self.remaining.pop(done, None) is not None:  # cancelled: the client went away
                self._advance()
                self._reschedule()

    def _advance(self) -> None:
        now = time.perf_counter()
        if self.remaining:
            progress = (now - self._updated) / self.curve(len(self.remaining), now - self.started)
            for request in self.remaining:
                self.remaining[request] -= progress
        self._updated = now

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.remaining:
            now = time.perf_counter()
            left = min(self.remaining.values()) * self.curve(len(self.remaining), now - self.started)
            self._timer = asyncio.get_running_loop().call_later(max(0.0, left), self._finish)

    def _finish(self) -> None:
        self._timer = None
        self._advance()
        for request, left in list(self.remaining.items()):
            if left <= 1e-9:
                del self.remaining[request]
                request.set_result(None)
        self._reschedule()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):  # mmgate closed the upstream: it cut its client
            for _ in range(SLOW_EVENTS):
                await response.write(SLOW_EVENT)
            await response.write(b"data: [DONE]\n\n")
        return response

    async def start(self) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return f"http://127.0.0.1:{self.server.port}"


def tagged_body(tag: str, image: str, **extra: Any) -> bytes:
    """A chat request of ``image`` (a data URI) whose text, ``tag``, tells the backend what to do with it."""
    return orjson.dumps(chat_with_image(image, text=tag) | extra)


@contextlib.asynccontextmanager
async def behind_mmgate(curve: Curve, **env: str) -> AsyncIterator[tuple[CurveBackend, Proxy]]:
    """A ``CurveBackend`` of ``curve`` and mmgate built in this process in front of it (``env``: its settings),
    both stopped after."""
    backend = CurveBackend(curve)
    proxy, stop = await start_proxy_server(await backend.start(), **env)
    try:
        yield backend, proxy
    finally:
        await stop()
        assert backend.server is not None
        await backend.server.close()


async def post(session: aiohttp.ClientSession, proxy: Proxy, body: bytes, **headers: str) -> int:
    """One chat request through ``proxy``, its answer read whole; its status."""
    async with session.post(proxy.url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json", **headers}) as response:
        await response.read()
        return response.status
