"""File descriptors: the soft RLIMIT_NOFILE raised at start to what MMGATE_MAX_CONNECTIONS needs, the cap lowered
when the hard limit is too low, and a connect that fails for want of mmgate's own descriptors answered as
mmgate's (503 local_resources_exhausted), never blamed on the upstream."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.runtime.fd_limit import connections_within, fds_needed, plan_fd_limit
from proxy.serve.demo import free_port
from proxy.settings import Settings
from testkit.environment import mmgate_env
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from testkit.servers import proxy_settings
from tests.proxy.edge.test_upstream_health import read_until, sample

CHAT = "/v1/chat/completions"
MEDIA_BODY = orjson.dumps(chat_with_image(data_uri(image_bytes(64, 48))))
TEXT_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
INFINITY = resource.RLIM_INFINITY
BOUND = 60.0  # seconds; a bound on a hang, not a measure of speed


def _settings(**env: str) -> Settings:
    return proxy_settings("http://127.0.0.1:9", MMGATE_DECODE_MODE="thread", **env)


# ----- the plan, with the limits passed in -----


def test_a_low_soft_limit_is_raised_to_what_the_connections_need() -> None:
    settings = _settings(MMGATE_MAX_CONNECTIONS="1024")
    needed = fds_needed(settings, 1024)
    assert needed > 2 * 1024  # each client connection and the upstream connection it may open
    plan = plan_fd_limit(settings, soft=1024, hard=1 << 20)
    assert plan.soft == needed and plan.max_connections == 1024
    assert plan_fd_limit(settings, soft=1024, hard=INFINITY).soft == needed


def test_a_soft_limit_already_high_enough_is_left_alone() -> None:
    settings = _settings(MMGATE_MAX_CONNECTIONS="100")
    for soft in (fds_needed(settings, 100), 1 << 20, INFINITY):
        plan = plan_fd_limit(settings, soft=soft, hard=INFINITY)
        assert plan.soft is None and plan.max_connections == 100


@pytest.mark.parametrize("upstream_pool", ["1024", "16"])
def test_a_hard_limit_too_low_lowers_the_cap_to_what_fits(upstream_pool: str) -> None:
    settings = _settings(MMGATE_MAX_CONNECTIONS="1024", MMGATE_UPSTREAM_MAX_CONNECTIONS=upstream_pool)
    plan = plan_fd_limit(settings, soft=256, hard=300)
    assert plan.soft == 300  # as high as it may go
    assert 0 < plan.max_connections < 1024
    assert fds_needed(settings, plan.max_connections) <= 300 < fds_needed(settings, plan.max_connections + 1)
    assert plan.needed == fds_needed(settings, 1024)


def test_no_room_for_a_connection_is_a_cap_of_zero() -> None:
    settings = _settings()
    assert connections_within(settings, fds_needed(settings, 1) - 1) == 0
    assert connections_within(settings, fds_needed(settings, 1)) == 1


def test_a_hard_limit_too_low_for_one_connection_stops_mmgate_with_one_line() -> None:
    env = mmgate_env(keep=(), MMGATE_UPSTREAM="http://127.0.0.1:9", MMGATE_HOST="127.0.0.1",
                     MMGATE_PORT=str(free_port()), MMGATE_DECODE_MODE="thread", MMGATE_DECODE_WORKERS="1")
    result = subprocess.run([sys.executable, "-m", "proxy"], env=env, capture_output=True, text=True, timeout=BOUND,
                            check=False, preexec_fn=_nofile(40, 40))
    assert result.returncode == 2, result.stderr
    assert "mmgate: the file descriptor limit (RLIMIT_NOFILE 40) leaves no room for a client connection" \
        in result.stderr


# ----- a real process short of descriptors -----


def _nofile(soft: int, hard: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _closing(request: web.Request) -> web.Response:
    """Every answer closes its connection: each forward needs a fresh upstream connect (a descriptor)."""
    if request.path == CHAT:
        await request.read()
    response = web.json_response({"ok": True})
    response.force_close()
    return response


@pytest.fixture
async def closing_upstream() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _closing)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _fds(pid: int) -> set[int]:
    return {int(name) for name in os.listdir(f"/proc/{pid}/fd")}


async def _collect(stream: asyncio.StreamReader, lines: list[str]) -> None:
    """Every line the process logs, read as it comes: a full pipe would stop the process mid-log."""
    while line := await stream.readline():
        lines.append(line.decode())


def _logged(lines: list[str], text: str) -> str | None:
    return next((line for line in lines if text in line), None)


async def test_out_of_descriptors_is_mmgates_own_503_and_the_upstream_stays_up(closing_upstream: str) -> None:
    port = free_port()
    env = mmgate_env(keep=(), MMGATE_UPSTREAM=closing_upstream, MMGATE_HOST="127.0.0.1", MMGATE_PORT=str(port),
                     MMGATE_DECODE_MODE="thread", MMGATE_DECODE_WORKERS="1", MMGATE_DRAIN_GRACE="0")
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy", env=env,
                                                   stderr=asyncio.subprocess.PIPE, preexec_fn=_nofile(256, 300))
    assert process.stderr is not None
    seen: list[str] = []
    collector: asyncio.Task[None] | None = None
    idle: list[asyncio.StreamWriter] = []
    try:
        await read_until(process.stderr, "listening on", seen)
        collector = asyncio.create_task(_collect(process.stderr, seen))
        raised, lowered = _logged(seen, "soft limit raised"), _logged(seen, "MMGATE_MAX_CONNECTIONS lowered to")
        assert raised is not None and "from 256 to 300" in raised
        assert lowered is not None and "RLIMIT_NOFILE 300" in lowered and "MMGATE_MAX_CONNECTIONS=1024" in lowered
        base = f"http://127.0.0.1:{port}"
        connector = aiohttp.TCPConnector(limit=1)  # one kept-alive connection, open before descriptors run out
        async with aiohttp.ClientSession(connector=connector) as client:
            async with client.get(base + "/mmgate/health") as response:
                assert response.status == 200

            # Only a few descriptors left, then idle client connections take every one of them.
            limit = len(_fds(process.pid)) + 16
            resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (limit, 300))

            def exhausted() -> bool:
                return set(range(limit)) <= _fds(process.pid)

            for _ in range(limit):  # more than there are descriptors left: the rest wait in the listen backlog
                idle.append((await asyncio.open_connection("127.0.0.1", port))[1])
            await eventually(exhausted, "every descriptor taken")

            async with client.post(base + CHAT, data=TEXT_BODY,
                                   headers={"Content-Type": "application/json"}) as response:
                assert response.status == 503, await response.text()
                assert response.headers["Retry-After"] == "1"
                assert (await response.json())["error"]["code"] == "local_resources_exhausted"
            shortage = "could not open a connection to the upstream"
            await eventually(lambda: _logged(seen, shortage) is not None, "the shortage logged")
            line = _logged(seen, shortage)
            assert line is not None and "EMFILE" in line and "mmgate's own shortage" in line
            assert not any("cannot be reached" in said for said in seen), "the upstream was blamed"

            for writer in idle:  # the descriptors come back
                writer.close()
            await eventually(lambda: not exhausted(), "the idle connections closed")
            async with client.post(base + CHAT, data=MEDIA_BODY,
                                   headers={"Content-Type": "application/json"}) as response:
                assert response.status == 200, await response.text()  # media: not refused as upstream_down
            async with client.get(base + "/mmgate/metrics") as response:
                metrics = await response.text()
        assert sample(metrics, "mmgate_rejected_total", reason="local_resources_exhausted") == 1
        assert sample(metrics, "mmgate_upstream_errors_total", kind="connect") == 0
    finally:
        for writer in idle:
            writer.close()
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), BOUND)
        if collector is not None:
            await collector
