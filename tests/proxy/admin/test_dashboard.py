"""The live dashboard: /mmgate/stats JSON and the page itself in a real headless Chromium.

The servers are real (an upstream and the proxy from build_app(), both on 127.0.0.1), the traffic is real,
and every wait is on an event: the upstream's arrival queue, or the page's own numbers (Playwright's
wait_for_function on the data-value attributes the page renders). No sleeps. The browser test saves
a screenshot (docs/dashboard.png with MMGATE_UPDATE_SCREENSHOT=1), taken while the gate is full and the queue holds
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pybase64
import pytest
from aiohttp import web
from PIL import Image

from proxy.admission.adaptive import START
from proxy.app import build_app
from proxy.settings import Settings
from proxy.state import STATE, AppState

ROOT = Path(__file__).resolve().parents[3]
# Where the screenshot goes: a temporary file, or docs/dashboard.png with MMGATE_UPDATE_SCREENSHOT=1 (so a
# test run never dirties the checkout).
DOCS_SCREENSHOT = ROOT / "docs" / "dashboard.png"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
CHAT_COMPLETION = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "a cat"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
}
PAGE_TIMEOUT_MS = 30_000  # an upper bound for a failure to show, never a synchronisation


# ---------------------------------------------------------------- servers


@dataclass
class Servers:
    """A real upstream whose answers a test can hold, and the real proxy in front of it."""

    proxy_url: str
    state: AppState
    hold: asyncio.Event  # cleared: the upstream keeps chat requests waiting until it is set again
    arrived: asyncio.Queue[None] = field(default_factory=asyncio.Queue)


async def _start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    async with _servers() as started:
        yield started


@contextlib.asynccontextmanager
async def _servers(models: dict[str, Any] | None = None, answer_after: float = 0.0, **env: str
                   ) -> AsyncIterator[Servers]:
    """``models``: what the upstream answers to GET /v1/models (without it, 404: it names no model);
    ``answer_after``: the seconds the upstream takes over each chat answer (its service time)."""
    hold = asyncio.Event()
    hold.set()
    arrived: asyncio.Queue[None] = asyncio.Queue()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        arrived.put_nowait(None)
        await hold.wait()
        if answer_after:
            await asyncio.sleep(answer_after)
        return web.json_response(CHAT_COMPLETION)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    upstream_app = web.Application(client_max_size=64 << 20)
    upstream_app.router.add_post("/v1/chat/completions", chat)
    upstream_app.router.add_get("/health", health)
    if models is not None:
        answer = models

        async def served_models(request: web.Request) -> web.Response:
            return web.json_response(answer)

        upstream_app.router.add_get("/v1/models", served_models)
    upstream_runner, upstream_url = await _start(upstream_app)

    settings = Settings.from_env({
        "MMGATE_UPSTREAM": upstream_url,
        "MMGATE_MAX_MM_CONCURRENCY": "2",
        "MMGATE_MAX_QUEUE": "2",
        "MMGATE_RELEASE_AT": "complete",  # a held upstream keeps the gate slot: the page sees the gate full
        "MMGATE_RESIZE_MAX_SIDE": "64",  # 256 px images shrink: "saved by resizing" moves
        "MMGATE_DECODE_WORKERS": "2",
        "MMGATE_ACCESS_LOG": "off",
        **env,
    })
    proxy_app = build_app(settings)
    proxy_runner, proxy_url = await _start(proxy_app)
    try:
        yield Servers(proxy_url, proxy_app[STATE], hold, arrived)
    finally:
        hold.set()
        await proxy_runner.cleanup()
        await upstream_runner.cleanup()


def _image_data_uri(side: int = 256) -> str:
    """A noisy PNG (noise does not compress, so the resized JPEG is clearly smaller)."""
    image = Image.frombytes("RGB", (side, side), os.urandom(side * side * 3))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + pybase64.b64encode(buffer.getvalue()).decode()


IMAGE = _image_data_uri()


def _chat(media: bool, image: str = IMAGE) -> bytes:
    content: Any = "describe the weather"
    if media:
        content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": image}}]
    return orjson.dumps({"model": "stub", "messages": [{"role": "user", "content": content}]})


async def _post(client: aiohttp.ClientSession, url: str, media: bool, image: str = IMAGE) -> int:
    async with client.post(url + "/v1/chat/completions", data=_chat(media, image),
                           headers={"Content-Type": "application/json"}) as response:
        await response.read()
        return response.status


# ---------------------------------------------------------------- /mmgate/stats and the page file (no browser)


async def test_stats_json_reflects_traffic_and_settings(servers: Servers) -> None:
    async with aiohttp.ClientSession() as client:
        assert await _post(client, servers.proxy_url, media=False) == 200
        assert await _post(client, servers.proxy_url, media=True) == 200
        async with client.get(servers.proxy_url + "/mmgate/stats") as response:
            assert response.status == 200
            assert response.content_type == "application/json"
            stats = await response.json()

    requests = stats["requests"]
    assert requests["total"] == 2 and requests["by_class"] == {"2xx": 2}
    assert requests["by_kind"] == {"text": 1, "media": 1}
    assert requests["status_429"] == 0
    request_hist = stats["latency"]["request"]
    assert request_hist["all"]["count"] == 2
    assert len(request_hist["all"]["counts"]) == len(request_hist["le"]) + 1
    assert request_hist["all"]["counts"][-1] == 2  # +Inf bucket = count
    assert request_hist["all"]["counts"] == sorted(request_hist["all"]["counts"])  # cumulative
    stages = stats["latency"]["stages"]["by_stage"]
    assert stages["total"]["count"] == 2
    assert stages["preprocess"]["count"] == 1  # only the media request was preprocessed
    assert stats["gate"] == {"in_use": 0, "limit": 2, "adaptive": False, "waiting": 0, "reading": 0, "max_queue": 2}
    assert stats["process"]["reading"] == 0
    media = stats["media"]
    assert media["bytes_in"] > media["bytes_out"] > 0
    assert media["bytes_saved"] == media["bytes_in"] - media["bytes_out"]
    assert media["bytes_inflight"] == 0 and media["bytes_live"] == 0 and media["buffers_live"] == 0
    assert stats["process"]["rss_bytes"] > 0
    assert stats["uptime_seconds"] > 0
    assert stats["limits"]["max_mm_concurrency"] == 2 and stats["limits"]["resize_max_side"] == 64
    assert stats["limits"]["decode_workers"] == 2
    assert stats["cache"] == {"hits": 0, "misses": 1, "evictions": 0, "bytes": servers.state.cache.bytes_held,
                              "entries": 1, "waiting": 0, "limit_bytes": 256 << 20}
    assert len(stats["event_loop_lag"]["counts"]) == len(stats["event_loop_lag"]["le"]) + 1


async def test_dashboard_page_is_self_contained(servers: Servers) -> None:
    async with aiohttp.ClientSession() as client, client.get(servers.proxy_url + "/mmgate/dashboard") as response:
        assert response.status == 200
        assert response.content_type == "text/html"
        html = await response.text()
    # Works offline and behind any prefix or port: no external resource, and the stats URL is relative.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and "<script src" not in html
    assert 'fetch("stats"' in html
    for testid in ("gate-in-use", "gate-limit", "gate-waiting", "reading", "gate-reading", "in-flight-reading",
                   "req-rate", "requests-total", "rate-429",
                   "media-inflight", "media-live", "media-buffers", "bytes-saved", "loop-lag-p99", "rss", "limits"):
        assert f'data-testid="{testid}"' in html


# ---------------------------------------------------------------- the page in headless Chromium


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("MMGATE_REQUIRE_HEAVY") == "1":
        pytest.fail(f"MMGATE_REQUIRE_HEAVY=1 and the dashboard browser test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
async def page(tmp_path: Path) -> AsyncIterator[Any]:
    """A page in Debian's Chromium (never a downloaded browser) with a fresh profile."""
    if not os.access(CHROMIUM, os.X_OK):
        _skip_or_fail(f"{CHROMIUM} not found (Debian: apt-get install --no-install-recommends chromium)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        _skip_or_fail("the playwright Python package is not installed (pip install -e '.[test]')")
    async with async_playwright() as p:
        context = await p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1440, "height": 1000}, device_scale_factor=1,
        )
        try:
            yield context.pages[0] if context.pages else await context.new_page()
        finally:
            await context.close()


def _value(testid: str) -> str:
    """JS expression: the raw number a tile shows."""
    return f'Number(document.querySelector(\'[data-testid="{testid}"]\').dataset.value)'

async def _fill_the_gate(client: aiohttp.ClientSession, servers: Servers, page: Any) -> list[asyncio.Task[int]]:
    """Two media requests held at the backend and two waiting at the gate, shown so on the page; the next two
    are refused with 429. Returns the four held requests."""
    def send_media() -> asyncio.Task[int]:
        return asyncio.create_task(_post(client, servers.proxy_url, media=True, image=_image_data_uri()))

    held = [send_media() for _ in range(2)]
    for _ in range(2):
        await servers.arrived.get()
    held += [send_media() for _ in range(2)]
    await page.wait_for_function(f"() => {_value('gate-in-use')} === 2 && {_value('gate-waiting')} === 2",
                                 timeout=PAGE_TIMEOUT_MS)
    assert await asyncio.gather(send_media(), send_media()) == [429, 429]
    return held



@pytest.mark.browser
async def test_dashboard_in_chromium_follows_live_traffic(servers: Servers, page: Any, tmp_path: Path) -> None:
    screenshot = DOCS_SCREENSHOT if os.environ.get("MMGATE_UPDATE_SCREENSHOT") == "1" else tmp_path / "dashboard.png"
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(f"console.{msg.type}: {msg.text}")
            if msg.type in ("error", "warning") else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url} {req.failure}"))

    response = await page.goto(servers.proxy_url + "/mmgate/dashboard")
    assert response is not None and response.status == 200
    await page.wait_for_function("() => window.mmgateDashboard && window.mmgateDashboard.polls >= 1",
                                 timeout=PAGE_TIMEOUT_MS)
    assert await page.text_content('[data-testid="conn-status"]') == "live"
    assert await page.get_attribute('[data-testid="limit-max_mm_concurrency"]', "data-value") == "2"
    assert await page.get_attribute('[data-testid="limit-resize_max_side"]', "data-value") == "64"
    assert await page.text_content('[data-testid="gate-limit"]') == "2"
    assert await page.evaluate(_value("requests-total")) == 0

    # Phase 1: bursts of text and media traffic; after each, wait until a poll has shown it, so the
    # charts get several points and the rates a real delta.
    sent = 0
    async with aiohttp.ClientSession() as client:
        for _ in range(5):
            statuses = await asyncio.gather(*(_post(client, servers.proxy_url, media=i % 4 == 0) for i in range(12)))
            assert statuses == [200] * 12
            sent += 12
            await page.wait_for_function(f"() => {_value('requests-total')} >= {sent}", timeout=PAGE_TIMEOUT_MS)
        assert await page.evaluate(_value("req-rate")) > 0
        assert await page.evaluate(_value("bytes-saved")) > 0
        # The same image every time: decoded once, then answered from the cache.
        await page.wait_for_function(f"() => {_value('cache-hits')} === 14 && {_value('cache-misses')} === 1",
                                     timeout=PAGE_TIMEOUT_MS)
        assert 0.9 < await page.evaluate(_value("cache-hit-ratio")) < 1
        assert await page.evaluate(_value("cache-bytes")) > 0 and await page.evaluate(_value("cache-entries")) == 1

        # Phase 2: the upstream holds its answers. Media requests, each with a new image (a cached one would
        # weigh nothing on the byte budget), sent in three pairs so the line's state never depends on which body
        # finished arriving first: 2 take the gate's slots, 2 queue behind them, 2 are refused at once with 429.
        servers.hold.clear()
        while not servers.arrived.empty():
            servers.arrived.get_nowait()

        held = await _fill_the_gate(client, servers, page)
        await page.wait_for_function(
            f"() => {_value('gate-in-use')} === 2 && {_value('gate-waiting')} === 2 && {_value('total-429')} === 2"
            f" && {_value('rate-429')} > 0",
            timeout=PAGE_TIMEOUT_MS,
        )
        assert await page.text_content('[data-testid="gate-in-use"]') == "2"
        assert await page.evaluate(_value("media-inflight")) > 0  # the two admitted requests' bytes
        assert await page.evaluate(_value("lat-request-count")) > 0
        assert await page.evaluate(_value("lat-stage-preprocess-p50")) > 0
        await page.screenshot(path=str(screenshot), full_page=True)

        # Release: everything finishes, the page sees the gate and the queue empty again.
        servers.hold.set()
        statuses = await asyncio.gather(*held)
        assert statuses == [200] * 4
        sent += 6
        await page.wait_for_function(
            f"() => {_value('requests-total')} === {sent} && {_value('gate-in-use')} === 0"
            f" && {_value('gate-waiting')} === 0 && {_value('media-inflight')} === 0",
            timeout=PAGE_TIMEOUT_MS,
        )

    assert await page.evaluate("window.mmgateDashboard.failures") == 0
    assert screenshot.stat().st_size > 10_000
    assert not problems, "\n".join(problems)


async def _send_part_of_a_body(url: str, body: bytes, sent: int) -> asyncio.StreamWriter:
    """A client that sends the head and the first ``sent`` bytes of ``body``, then goes quiet."""
    host, port = url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:sent])
    await writer.drain()
    return writer


@pytest.mark.browser
async def test_dashboard_in_chromium_shows_requests_whose_body_is_still_being_read(servers: Servers,
                                                                                  page: Any) -> None:
    """Requests still sending their body are in flight with the gate and the queue at 0: the page shows them
    (and the media ones among them holding a place in line), as /mmgate/metrics does."""
    await page.goto(servers.proxy_url + "/mmgate/dashboard")
    await page.wait_for_function("() => window.mmgateDashboard && window.mmgateDashboard.polls >= 1",
                                 timeout=PAGE_TIMEOUT_MS)
    text = _chat(media=False) + b" " * 1000
    media = b'{"model": "stub", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": ' \
            b'{"url": "data:image/png;base64,' + b"A" * (200 << 10) + b'"}}]}]}'
    writers = [await _send_part_of_a_body(servers.proxy_url, text, 20) for _ in range(2)]
    writers.append(await _send_part_of_a_body(servers.proxy_url, media, 100 << 10))  # past the head: a place
    try:
        await page.wait_for_function(
            f"() => {_value('in-flight-reading')} === 3 && {_value('reading')} === 3"
            f" && {_value('gate-reading')} === 1",
            timeout=PAGE_TIMEOUT_MS)
        assert await page.evaluate(_value("gate-in-use")) == 0 and await page.evaluate(_value("gate-waiting")) == 0
        assert await page.evaluate(_value("in-flight")) == 3
        registry = servers.state.metrics.registry
        assert registry.get_sample_value("mmgate_requests_reading") == 3
        assert registry.get_sample_value("mmgate_gate_reading") == 1
    finally:
        for writer in writers:
            writer.close()
    await page.wait_for_function(
        f"() => {_value('in-flight-reading')} === 0 && {_value('reading')} === 0 && {_value('gate-reading')} === 0"
        f" && {_value('in-flight')} === 0",
        timeout=PAGE_TIMEOUT_MS)
    assert await page.evaluate("window.mmgateDashboard.failures") == 0


@pytest.mark.browser
async def test_dashboard_shows_image_tokens_in_flight_against_the_budget(page: Any, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the model extra: pip install -e '.[model]'")
    from proxy.media.model_folder import load_model
    from testkit.models import qwen_folder

    folder = str(qwen_folder(tmp_path / "qwen2-vl"))
    per_image = load_model(folder).image_tokens(256, 256)  # each request: one 256 px image (81 tokens)
    budget = 2 * per_image + per_image // 2  # two fit, a third waits for tokens while slots are free
    async with _servers(MMGATE_MODEL=folder, MMGATE_MAX_INFLIGHT_IMAGE_TOKENS=str(budget),
                        MMGATE_MAX_MM_CONCURRENCY="4") as servers:
        await page.goto(servers.proxy_url + "/mmgate/dashboard")
        await page.wait_for_function("() => window.mmgateDashboard && window.mmgateDashboard.polls >= 1",
                                     timeout=PAGE_TIMEOUT_MS)
        assert await page.text_content('[data-testid="tokens-model"]') == "qwen2-vl"
        assert await page.text_content('[data-testid="tokens-inflight-limit"]') == str(budget)
        servers.hold.clear()
        async with aiohttp.ClientSession() as client:
            held = [asyncio.create_task(_post(client, servers.proxy_url, media=True)) for _ in range(3)]
            for _ in range(2):
                await servers.arrived.get()
            await page.wait_for_function(
                f"() => {_value('tokens-inflight')} === {2 * per_image} && {_value('gate-waiting')} === 1",
                timeout=PAGE_TIMEOUT_MS)
            assert await page.text_content('[data-testid="gate-in-use"]') == "2"
            servers.hold.set()
            assert await asyncio.gather(*held) == [200, 200, 200]
            await page.wait_for_function(f"() => {_value('tokens-inflight')} === 0", timeout=PAGE_TIMEOUT_MS)


def _vllm_models(name: str, root: str) -> dict[str, Any]:
    """vLLM's answer to GET /v1/models: ``root`` is the path or Hub id it loaded."""
    return {"object": "list", "data": [{"id": name, "object": "model", "root": root, "parent": None}]}


@pytest.mark.browser
@pytest.mark.parametrize("case", ["found", "not_found", "off"])
async def test_dashboard_and_stats_name_the_model_in_force_or_why_none_is(
        case: str, page: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MMGATE_MODEL=auto with the served model's folder in MMGATE_MODEL_DIRS: the family and its geometry; a
    Hub id found nowhere, or MMGATE_MODEL=none: the generic rule, why, and the setting that fixes it."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache: only MMGATE_MODEL_DIRS holds models
    models = tmp_path / "models"
    env: dict[str, str] = {"MMGATE_MODEL_DIRS": str(models)}
    answer: dict[str, Any] | None = _vllm_models("org/missing-vl", "org/missing-vl")
    if case == "found":
        pytest.importorskip("transformers", reason="the model extra: pip install -e '.[model]'")
        from testkit.models import qwen_folder

        folder = str(qwen_folder(models / "qwen"))
        answer = _vllm_models("qwen", folder)
    elif case == "off":
        env["MMGATE_MODEL"], answer = "none", None
    async with _servers(models=answer, answer_after=0.0, **env) as servers:
        await page.goto(servers.proxy_url + "/mmgate/dashboard")
        # Found in the background: the page shows the lookup's outcome once it has ended.
        shown = ("() => document.querySelector('[data-testid=\"model-family\"]').dataset.value === 'qwen2-vl'"
                 if case == "found" else
                 f"() => document.querySelector('[data-testid=\"model-reason\"]').dataset.value === '{case}'")
        await page.wait_for_function(shown, timeout=PAGE_TIMEOUT_MS)
        async with aiohttp.ClientSession() as client, client.get(servers.proxy_url + "/mmgate/stats") as response:
            served = (await response.json())["served_model"]
        family = await page.text_content('[data-testid="model-family"]')
        geometry = await page.text_content('[data-testid="model-geometry"]')
        reason_shown = await page.is_visible('[data-testid="model-reason"]')
        fix_shown = await page.is_visible('[data-testid="model-fix"]')
        fix = await page.text_content('[data-testid="model-fix"]') or ""
        assert await page.text_content('[data-testid="model-mode"]') == served["mode"]
        if case == "found":
            assert served["family"] == family == "qwen2-vl" == await page.text_content('[data-testid="tokens-model"]')
            assert served["geometry"].startswith("QwenVL(") and geometry == served["geometry"]
            assert served["reason"] is None and served["fix"] is None and served["folder"] == folder
            assert await page.text_content('[data-testid="model-folder"]') == folder
            assert await page.text_content('[data-testid="model-served"]') == "qwen"
            assert not reason_shown and not fix_shown
            return
        assert served["family"] is None and served["geometry"] is None and served["reason"] == case
        assert family == "none" and "the generic rule (MMGATE_RESIZE_MAX_PIXELS" in (geometry or "")
        assert reason_shown and await page.text_content('[data-testid="model-reason"]') == served["note"]
        assert fix_shown and fix == "Fix: " + served["fix"]
        if case == "not_found":
            assert served["mode"] == "auto" and served["served"] == "org/missing-vl"
            assert "'org/missing-vl'" in served["note"] and str(models) in served["note"]
            assert "MMGATE_MODEL_DIRS" in fix
        else:
            assert served["mode"] == "none" and "MMGATE_MODEL=auto" in fix
        assert await page.evaluate(OVERFLOWING) == []  # the longest of the texts, the reason, wraps inside its tile


@pytest.mark.browser
async def test_dashboard_draws_the_adaptive_limit_as_it_moves(page: Any) -> None:
    """MMGATE_MAX_MM_CONCURRENCY=auto: the page says auto, its limit follows mmgate_gate_limit up from where the
    controller starts, and it shows the controller's phase and why the limit last moved, as /mmgate/stats does."""
    async with _servers(answer_after=0.2, MMGATE_MAX_MM_CONCURRENCY="auto", MMGATE_MIN_MM_CONCURRENCY="1",
                        MMGATE_MAX_MM_CONCURRENCY_AUTO="8", MMGATE_MAX_QUEUE="16") as servers:
        await page.goto(servers.proxy_url + "/mmgate/dashboard")
        await page.wait_for_function("() => window.mmgateDashboard && window.mmgateDashboard.polls >= 1",
                                     timeout=PAGE_TIMEOUT_MS)
        assert await page.text_content('[data-testid="gate-limit-mode"]') == "auto"
        assert await page.text_content('[data-testid="limit-max_mm_concurrency"]') == "auto"
        assert await page.text_content('[data-testid="gate-limit"]') == str(START)
        assert "the start, before any sample" in await page.text_content('[data-testid="gate-controller"]')
        sent = 0

        async def client_loop(client: aiohttp.ClientSession) -> None:
            nonlocal sent
            while servers.state.gate.counters().limit <= START and sent < 2000:
                sent += 1
                assert await _post(client, servers.proxy_url, media=True) == 200

        async with aiohttp.ClientSession() as client:
            # Answers at a steady 200 ms from twice as many client loops as the limit can reach, so demand keeps
            # it full (a limit that demand leaves unfilled does not grow, and comes down to what demand used) and
            # the rate grows with it: it doubles from its start. As many loops as the ceiling were not enough on a
            # loaded machine: the loops share this event loop with mmgate and lag, and the limit came down to 3.
            # (With instant answers the rate is mmgate's own decode pool's, flat from 2 requests with 2 decode
            # processes: the limit probes down that plateau instead.)
            await asyncio.gather(*(client_loop(client) for _ in range(16)))
        grown = servers.state.gate.counters().limit
        assert grown > START
        await page.wait_for_function(f"() => {_value('gate-limit')} > {START}", timeout=PAGE_TIMEOUT_MS)
        # no traffic now: the controller holds still, and the page catches up with its last move
        controller = servers.state.gate.controller()
        assert controller is not None and isinstance(controller["moves"], list)
        last = controller["moves"][-1]
        moved = f"{last['before']} → {last['limit']}"
        await page.wait_for_function(f"() => document.querySelector('[data-testid=\"gate-controller-move\"]')"
                                     f".textContent === {moved!r}", timeout=PAGE_TIMEOUT_MS)
        shown = await page.text_content('[data-testid="gate-controller"]')
        assert last["why"] in shown and "samples" in shown
        if last["rate"] is not None and last["spread"] is not None:  # a phase that ended on its answers: how noisy
            assert " ± " in shown and " %" in shown
        assert await page.evaluate("window.mmgateDashboard.failures") == 0


# Every element the page colours as a warning, with the advice beside it that must show while it is coloured
# and a setting or part that advice names.
WARNINGS = {
    "rate-429": ("advice-429", "MMGATE_MAX_QUEUE"),
    "gate-in-use": ("advice-gate", "MMGATE_MAX_MM_CONCURRENCY"),
    "gate-waiting": ("advice-queue", "MMGATE_MAX_QUEUE"),
    "loop-lag-p99": ("advice-loop-lag", "MMGATE_PROCESSES"),
}
# JS: the elements wider than the box that holds them (a tile cut at the window's edge, a table scrolled).
OVERFLOWING = """() => {
  const out = [];
  const page = document.documentElement.scrollWidth;
  if (page > window.innerWidth) out.push("page " + page);
  for (const el of document.querySelectorAll("section.tile, section.tile table, section.tile .split > div")) {
    const box = el.closest("section.tile").getBoundingClientRect(), r = el.getBoundingClientRect();
    if (el.scrollWidth > el.clientWidth + 1 || r.right > box.right + 1 || box.right > window.innerWidth)
      out.push((el.querySelector("h2") || el).textContent.trim().slice(0, 40) + " " + el.scrollWidth + " px");
  }
  return out;
}"""


def _block_the_event_loop(seconds: float) -> None:
    """What a blocking call on the running loop does (a decode in the loop, a slow synchronous read)."""
    time.sleep(seconds)


async def _coloured(page: Any, testid: str) -> bool:
    """Whether the page shows ``testid`` in a warning colour."""
    return bool(await page.evaluate(
        f"() => /\\b(hot|crit)\\b/.test(document.querySelector('[data-testid=\"{testid}\"]').className)"))


@pytest.mark.browser
async def test_dashboard_fits_1000_px_and_advises_beside_each_warning(servers: Servers, page: Any,
                                                                       tmp_path: Path) -> None:
    """At 1000 px wide every panel fits (no tile, table or page wider than the window), and every warning colour
    comes with what it means and which setting or part to look at: the gate full, the queue full, 429s, and the
    event loop blocked (by this very test, which runs the proxy's loop and blocks it)."""
    await page.set_viewport_size({"width": 1000, "height": 900})
    await page.goto(servers.proxy_url + "/mmgate/dashboard")
    await page.wait_for_function("() => window.mmgateDashboard && window.mmgateDashboard.polls >= 1",
                                 timeout=PAGE_TIMEOUT_MS)
    for element, (advice, _setting) in WARNINGS.items():  # shown exactly while its element is coloured
        coloured, shown = await page.evaluate(
            f"() => [/\\b(hot|crit)\\b/.test(document.querySelector('[data-testid=\"{element}\"]').className),"
            f" !document.querySelector('[data-testid=\"{advice}\"]').hidden]")
        assert coloured == shown, advice
    async with aiohttp.ClientSession() as client:
        statuses = await asyncio.gather(*(_post(client, servers.proxy_url, media=i % 2 == 0) for i in range(8)))
        assert statuses == [200] * 8
        await page.wait_for_function(
            f"() => {_value('requests-total')} >= 8 && {_value('lat-stage-preprocess-count')} > 0",
            timeout=PAGE_TIMEOUT_MS)
        servers.hold.clear()

        held = await _fill_the_gate(client, servers, page)
        # The cause the loop-lag tile warns of: the proxy's event loop (this test's) blocked, again and again,
        # until a poll shows its p99 red (bounded: a page that never turns red fails below).
        for _ in range(PAGE_TIMEOUT_MS // 300):
            if await _coloured(page, "loop-lag-p99"):
                break
            _block_the_event_loop(0.3)
            await asyncio.sleep(0)
        await page.wait_for_function(f"() => {_value('total-429')} === 2 && {_value('rate-429')} > 0",
                                     timeout=PAGE_TIMEOUT_MS)
        await page.screenshot(path=str(tmp_path / "dashboard-1000.png"), full_page=True)
        assert await page.evaluate(OVERFLOWING) == []
        for element, (advice, setting) in WARNINGS.items():
            assert await _coloured(page, element), element
            assert await page.is_visible(f'[data-testid="{advice}"]'), f"no advice beside {element}'s colour"
            assert setting in (await page.text_content(f'[data-testid="{advice}"]') or ""), advice
        servers.hold.set()
        assert await asyncio.gather(*held) == [200] * 4
