"""Shared fixtures: a scriptable upstream and the real proxy, both real HTTP servers on 127.0.0.1.

The upstream records what really crossed the wire (method, path, headers, raw body) and reports events
(request arrived, handler cancelled because mmgate hung up) that tests await instead of sleeping. The classes
live in ``testkit.servers`` (the fuzzing bench starts the same servers without pytest); they are imported here
so test modules keep importing them from ``.conftest``.

``MMGATE_LOOP=uvloop`` in the environment runs every async test, and so every proxy a test starts in-process,
on uvloop (CI runs the suite once more so); otherwise they run on asyncio's own loop, and ``MMGATE_LOOP`` is set
to ``asyncio`` for the ``mmgate`` processes tests start with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import settings as hypothesis_settings

from proxy.app import build_app, make_runner
from proxy.edge.site import GuardedSite
from proxy.state import STATE
from testkit.servers import Handler, Proxy, Seen, StartProxy, Upstream, proxy_settings

__all__ = ["Handler", "Proxy", "Seen", "StartProxy", "Upstream", "require_heavy", "scriptable_server"]

# Hypothesis's per-example deadline is a timing assertion, and the tests assert none (speed belongs in bench/):
# on a loaded CI machine it would fail examples that are merely slow.
hypothesis_settings.register_profile("no-deadline", deadline=None)
hypothesis_settings.load_profile("no-deadline")

os.environ.setdefault("MMGATE_LOOP", "asyncio")
if os.environ["MMGATE_LOOP"] == "uvloop":

    def pytest_asyncio_loop_factories(config: pytest.Config,
                                      item: pytest.Item) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
        """pytest-asyncio's hook: the loop every async test runs on."""
        return {"uvloop": importlib.import_module("uvloop").new_event_loop}


@contextlib.asynccontextmanager
async def scriptable_server() -> AsyncIterator[Upstream]:
    """A scriptable ``Upstream`` listening on 127.0.0.1 for the duration of the block."""
    up = Upstream()
    app = web.Application(client_max_size=1 << 30, handler_args={"auto_decompress": False})  # raw wire bytes
    app.router.add_route("*", "/{tail:.*}", up._dispatch)
    up.server = TestServer(app, host="127.0.0.1")
    await up.server.start_server()
    try:
        yield up
    finally:
        up.release.set()
        await up.server.close()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with scriptable_server() as up:
        yield up


@pytest.fixture
async def start_proxy() -> Any:
    """``await start_proxy(upstream_url, MMGATE_MAX_QUEUE="2", ...)``: the real app from build_app()."""
    runners: list[web.AppRunner] = []

    async def start(upstream_url: str, **env: str) -> Proxy:
        app = build_app(proxy_settings(upstream_url, **env))
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
