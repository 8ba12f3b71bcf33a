"""An upstream that cannot be reached: named in the log at start-up (mmgate starts anyway), media refused with a
retryable 503 before any decoding while it is known to be down, served again as soon as it answers."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.serve.demo import free_port
from testkit.environment import mmgate_env
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from tests.conftest import StartProxy, Upstream

MEDIA_BODY = orjson.dumps(chat_with_image(data_uri(image_bytes(64, 48))))
TEXT_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
CHAT = "/v1/chat/completions"
LINE_TIMEOUT = 60.0  # seconds; a bound on a hang, not a measure of speed


def sample(exposition: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text exposition (0 when the series is absent)."""
    for line in exposition.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if match is None or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


async def read_until(stream: asyncio.StreamReader, pattern: str, seen: list[str]) -> str:
    """The first log line matching ``pattern`` (bounded); every line read is kept in ``seen``."""
    async with asyncio.timeout(LINE_TIMEOUT):
        while True:
            line = (await stream.readline()).decode()
            assert line, f"mmgate exited; it said: {''.join(seen)[-2000:]}"
            seen.append(line)
            if re.search(pattern, line):
                return line


@pytest.fixture
async def mmgate_without_upstream() -> AsyncIterator[tuple[asyncio.subprocess.Process, int, int, list[str]]]:
    """A real ``mmgate`` process whose upstream port has nothing listening (yet)."""
    upstream_port, port = free_port(), free_port()
    env = mmgate_env(keep=("MMGATE_DECODE_MODE", "MMGATE_LOOP"), MMGATE_UPSTREAM=f"http://127.0.0.1:{upstream_port}",
                     MMGATE_HOST="127.0.0.1", MMGATE_PORT=str(port), MMGATE_DRAIN_GRACE="0")
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy", env=env,
                                                   stderr=asyncio.subprocess.PIPE)
    try:
        yield process, upstream_port, port, []
    finally:
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), LINE_TIMEOUT)


async def test_unreachable_upstream_is_logged_at_start_media_refused_undecoded_then_served_when_it_answers(
    mmgate_without_upstream: tuple[asyncio.subprocess.Process, int, int, list[str]],
) -> None:
    process, upstream_port, port, seen = mmgate_without_upstream
    assert process.stderr is not None
    url = f"http://127.0.0.1:{upstream_port}"
    # The start-up check runs beside the start: which line comes first is the event loop's choice.
    first = await read_until(process.stderr, "cannot be reached|listening on", seen)
    await read_until(process.stderr, "listening on" if "cannot be reached" in first else "cannot be reached", seen)
    [warning] = [line for line in seen if "cannot be reached" in line]  # and it started all the same
    assert url in warning and "connection refused" in warning
    base = f"http://127.0.0.1:{port}"

    async with aiohttp.ClientSession() as client:
        async with client.post(base + CHAT, data=MEDIA_BODY, headers={"Content-Type": "application/json"}) as response:
            assert response.status == 503
            assert response.headers["Retry-After"] == "1"
            assert "x-should-retry" not in response.headers  # the SDKs retry it
            raw = await response.read()
        error = orjson.loads(raw)["error"]
        assert error["code"] == "upstream_down"
        assert str(upstream_port) not in raw.decode(), "the upstream's address is for the log, never for clients"
        async with client.get(base + "/mmgate/metrics") as response:
            metrics = await response.text()
        assert sample(metrics, "mmgate_upstream_errors_total", kind="connect") == 1
        for stage in ("queue", "preprocess"):
            assert sample(metrics, "mmgate_stage_duration_seconds_count", stage=stage) == 0, stage
        assert not re.search(r"^mmgate_media_items_total\{.*\} [1-9]", metrics, re.M), "nothing was decoded"

        # The upstream starts: the re-check finds it, and media is served again.
        backend = web.Application()
        backend.router.add_get("/health", _ok)
        backend.router.add_post(CHAT, _echo_size)
        runner = web.AppRunner(backend)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", upstream_port).start()
            await read_until(process.stderr, "answers again", seen)
            async with client.post(base + CHAT, data=MEDIA_BODY,
                                   headers={"Content-Type": "application/json"}) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["images"] == 1
            async with client.get(base + "/mmgate/metrics") as response:
                metrics = await response.text()
            assert sample(metrics, "mmgate_stage_duration_seconds_count", stage="preprocess") == 1
        finally:
            await runner.cleanup()


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _echo_size(request: web.Request) -> web.Response:
    body = await request.json()
    images = [p for m in body["messages"] for p in m["content"] if isinstance(p, dict) and p["type"] == "image_url"]
    return web.json_response({"images": len(images)})


async def test_a_request_that_cannot_connect_marks_the_upstream_down_and_text_still_goes(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """Known down from a forwarded request's failed connect too; text is still forwarded (nothing to spend on
    it). One down backend, one answer: every request that cannot reach it, text or media, before or after it is
    known down, gets 503 ``upstream_down`` with ``Retry-After``."""
    proxy = await start_proxy(upstream.url)
    state = proxy.state
    await eventually(lambda: state.ready_cache[0] > 0, "the start-up check")
    assert not state.upstream.down
    assert upstream.server is not None
    await upstream.server.close()  # the upstream goes away after the start-up check found it
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + CHAT, data=MEDIA_BODY) as response:
            # not known yet: decoded, then the forward could not connect
            assert response.status == 503 and response.headers["Retry-After"] == "1"
            assert (await response.json())["error"]["code"] == "upstream_down"
        assert state.upstream.down
        preprocessed = sample(state.metrics.exposition().decode(), "mmgate_stage_duration_seconds_count",
                              stage="preprocess")
        assert preprocessed == 1
        async with client.post(proxy.url + CHAT, data=MEDIA_BODY) as response:
            assert response.status == 503 and response.headers["Retry-After"] == "1"
            assert (await response.json())["error"]["code"] == "upstream_down"
        assert sample(state.metrics.exposition().decode(), "mmgate_stage_duration_seconds_count",
                      stage="preprocess") == preprocessed, "the refused request was not decoded"
        async with client.post(proxy.url + CHAT, data=TEXT_BODY) as response:
            assert response.status == 503 and response.headers["Retry-After"] == "1", "tried, and the same answer"
            assert (await response.json())["error"]["code"] == "upstream_down"
    assert state.metrics.upstream_errors.labels("connect")._value.get() == 3


@pytest.mark.parametrize("body", [TEXT_BODY, MEDIA_BODY], ids=["text", "media"])
async def test_a_text_or_media_request_to_a_backend_that_refuses_connections_gets_one_answer(
    start_proxy: StartProxy, body: bytes
) -> None:
    """Nothing listens at the upstream's address from the start (connection refused)."""
    proxy = await start_proxy(f"http://127.0.0.1:{free_port()}")
    async with aiohttp.ClientSession() as client, client.post(proxy.url + CHAT, data=body) as response:
        assert response.status == 503 and response.headers["Retry-After"] == "1"
        assert (await response.json())["error"]["code"] == "upstream_down"


async def test_a_502_the_backend_answered_itself_is_relayed_and_marks_nothing_down(
    upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The backend is reachable and said 502 (its own engine failed, or a proxy of its own): the answer is the
    backend's, relayed as it came, logged as the upstream's, counted as no refusal of mmgate's, and the backend
    is not down."""
    upstream.route(CHAT, lambda request: _own_502())
    proxy = await start_proxy(upstream.url, MMGATE_ACCESS_LOG="on")
    caplog.set_level(logging.INFO, logger="mmgate.access")
    await eventually(lambda: proxy.state.ready_cache[0] > 0, "the start-up check")
    async with aiohttp.ClientSession() as client:
        for body in (TEXT_BODY, MEDIA_BODY):
            async with client.post(proxy.url + CHAT, data=body) as response:
                assert response.status == 502 and "Retry-After" not in response.headers
                assert await response.json() == {"backend": "engine failed"}
    assert not proxy.state.upstream.down
    metrics = proxy.state.metrics
    assert [metrics.upstream_errors.labels(kind)._value.get() for kind in ("connect", "timeout", "reset")] == [0] * 3
    assert "mmgate_rejected_total{" not in metrics.exposition().decode()
    lines = [r.fields for r in caplog.records if r.name == "mmgate.access"]  # type: ignore[attr-defined]
    assert [(line["status"], line["code"], line["answered_by"]) for line in lines] == [(502, None, "upstream")] * 2


async def _own_502() -> web.Response:
    return web.json_response({"backend": "engine failed"}, status=502)


async def test_an_upstream_that_answers_is_not_down_whatever_its_health_path_says(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """A health path the backend does not have (404) fails readiness, but media is forwarded: it is reachable."""
    upstream.route("/health", lambda request: _status(404))
    proxy = await start_proxy(upstream.url)
    await eventually(lambda: proxy.state.ready_cache[0] > 0, "the start-up check")
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/mmgate/ready") as response:
            assert response.status == 503
        async with client.post(proxy.url + CHAT, data=MEDIA_BODY) as response:
            assert response.status == 200
    assert not proxy.state.upstream.down


async def _status(status: int) -> web.Response:
    return web.Response(status=status)
