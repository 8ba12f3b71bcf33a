"""MMGATE_MEDIA_URLS=fetch: media URLs fetched by mmgate within the inline limits, and every SSRF rule.

The remote media servers are real aiohttp servers on 127.0.0.1, reachable only because each proxy here opts in
with MMGATE_FETCH_ALLOW_ADDRESSES=127.0.0.1/32. A process-wide audit hook (``socket.connect`` and
``socket.getaddrinfo``) is the witness that nothing else is touched: while a test of this module runs, a
connect to anything but loopback, or a lookup of any name but ``localhost``, raises and is recorded, and the
test fails. So "refused before connecting" is observed on the socket layer, not assumed.
"""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import json
import socket
import struct
import sys
import wave
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from proxy.fetch.fetcher import FETCH_OUTCOMES, Fetcher, FetchLimits, FetchRefused
from proxy.fetch.policy import AddressPolicy, CheckedResolver, HostPolicy, embedded_ipv4, forbidden_class
from proxy.settings import ConfigError, Settings
from testkit.load import scrape
from testkit.media import BlockedPool, chat_with_image, data_uri, eventually, image_bytes, photo_jpeg
from tests.conftest import Proxy, StartProxy, Upstream, scriptable_server

# ----------------------------------------------------------------------------------------------------------
# the witness: no packet leaves loopback while these tests run

_WATCH: dict[str, Any] = {"on": False, "foreign": []}
_LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
_NAMES = {"127.0.0.1", "::1", "localhost", None}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _WATCH["on"]:
        return
    if event == "socket.connect":
        address = args[1]
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host.split("%")[0] not in _LOOPBACK:
            _WATCH["foreign"].append(("connect", host))
            raise PermissionError(f"test_fetch: a connect to {host} was attempted")
    elif event == "socket.getaddrinfo":
        host = args[0].decode() if isinstance(args[0], bytes) else args[0]
        if host not in _NAMES:
            _WATCH["foreign"].append(("getaddrinfo", host))
            raise PermissionError(f"test_fetch: a lookup of {host} was attempted")


sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def loopback_only() -> Any:
    _WATCH["on"], _WATCH["foreign"] = True, []
    yield
    _WATCH["on"] = False
    assert _WATCH["foreign"] == [], "a test of this module tried to reach beyond loopback"


# ----------------------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture
async def remote() -> AsyncIterator[Upstream]:
    """The media server the URLs point at (a second scriptable server, on 127.0.0.1)."""
    async with scriptable_server() as up:
        yield up


FETCH = {"MMGATE_MEDIA_URLS": "fetch", "MMGATE_FETCH_ALLOW_ADDRESSES": "127.0.0.1/32"}


async def fetching(start_proxy: StartProxy, upstream: Upstream, **env: str) -> Proxy:
    return await start_proxy(upstream.url, **{**FETCH, **env})


def serve(data: bytes, content_type: str = "image/png", **headers: str) -> Callable[..., Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=data, headers={"Content-Type": content_type, **headers})
    return handler


def redirect(location: str, status: int = 302) -> Callable[..., Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, headers={"Location": location})
    return handler


async def post(proxy: Proxy, body: dict[str, Any], path: str = "/v1/chat/completions",
               **headers: str) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + path, json=body, headers=headers) as response:
        return response.status, await response.json(), response.headers


def sample(proxy: Proxy, name: str, **labels: str) -> float:
    return proxy.state.metrics.registry.get_sample_value(name, labels) or 0.0


async def refused(proxy: Proxy, upstream: Upstream, url: str, code: str) -> str:
    """Send a chat with one image URL; it must be refused with ``code`` in OpenAI's shape, nothing forwarded."""
    status, doc, headers = await post(proxy, chat_with_image(url))
    assert status == 400, doc
    assert doc["error"]["code"] == code, doc
    assert doc["error"]["param"] == "messages[0].content[1]"
    assert headers["x-should-retry"] == "false"
    assert upstream.seen == []
    assert sample(proxy, "mmgate_fetches_total", outcome=code) >= 1
    message: str = doc["error"]["message"]
    return message


def held_image(remote: Upstream) -> asyncio.Event:
    """Route ``/held`` on ``remote`` to a small PNG answered only once ``remote.release`` is set; the event
    returned is set when the request arrives."""
    arrived = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        arrived.set()
        await remote.release.wait()
        return web.Response(body=image_bytes(8, 8), content_type="image/png")

    remote.route("/held", held)
    return arrived


def sent_image_url(upstream: Upstream, index: int = 0) -> str:
    doc = json.loads(upstream.seen[index].body)
    url: str = doc["messages"][0]["content"][1]["image_url"]["url"]
    return url


# ----------------------------------------------------------------------------------------------------------
# success: fetched, checked, resized, spliced as a data URI


async def test_a_12_mp_photo_is_fetched_resized_and_spliced_as_a_data_uri(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    photo = photo_jpeg()
    remote.route("/photo.jpg", serve(photo, "image/jpeg"))
    proxy = await fetching(start_proxy, upstream, MMGATE_RESIZE_MAX_PIXELS="1000000", MMGATE_ACCESS_LOG="on")
    body = chat_with_image(f"{remote.url}/photo.jpg?x=1#frag")
    with caplog.at_level("INFO", logger="mmgate.access"):
        status, _doc, headers = await post(proxy, body, Authorization="Bearer client-secret")
    assert status == 200
    assert [t.split(";")[0].strip() for t in headers["Server-Timing"].split(",")] == [
        "queue", "fetch", "preprocess", "upstream"]

    [got] = remote.seen  # one GET, with no header of the client's, the fragment not sent
    assert (got.method, got.path) == ("GET", "/photo.jpg?x=1")
    assert "Authorization" not in got.headers and got.headers["Accept"] == "image/*"
    assert remote.server is not None and got.headers["Host"] == f"127.0.0.1:{remote.server.port}"

    url = sent_image_url(upstream)
    head, payload = url.split(",", 1)
    assert head == "data:image/jpeg;base64"
    resized = Image.open(io.BytesIO(base64.b64decode(payload)))
    assert resized.width * resized.height <= 1_000_000 and resized.width / resized.height == pytest.approx(4 / 3, 0.01)
    rest = json.loads(upstream.seen[0].body)
    assert rest["messages"][0]["content"][0] == body["messages"][0]["content"][0]  # the rest untouched

    assert sample(proxy, "mmgate_fetches_total", outcome="ok") == 1
    assert sample(proxy, "mmgate_fetched_bytes_total") == len(photo)
    [line] = [r for r in caplog.records if r.name == "mmgate.access"]
    assert line.fields["fetched"] == len(photo)  # type: ignore[attr-defined]
    assert line.fields["media_in"] == len(photo)  # type: ignore[attr-defined]


async def test_an_image_needing_no_change_is_inlined_with_its_true_type(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    png = image_bytes(64, 48)
    remote.route("/a", serve(png, "image/jpeg"))  # the declared type is wrong; the bytes decide
    proxy = await fetching(start_proxy, upstream)
    status, _doc, _h = await post(proxy, chat_with_image(f"{remote.url}/a"))
    assert status == 200
    assert sent_image_url(upstream) == "data:image/png;base64," + base64.b64encode(png).decode()


async def test_fetched_media_is_cached_by_its_bytes(remote: Upstream, upstream: Upstream,
                                                    start_proxy: StartProxy) -> None:
    photo = photo_jpeg()
    remote.route("/a.jpg", serve(photo, "image/jpeg"))
    remote.route("/same-bytes-elsewhere.jpg", serve(photo, "image/jpeg"))
    remote.route("/bomb.png", serve(image_bytes(400, 400), "image/png"))
    proxy = await fetching(start_proxy, upstream, MMGATE_RESIZE_MAX_PIXELS="1000000", MMGATE_MAX_IMAGE_PIXELS="1000")
    photo_proxy = await fetching(start_proxy, upstream, MMGATE_RESIZE_MAX_PIXELS="1000000")
    for url in ("/a.jpg", "/a.jpg", "/same-bytes-elsewhere.jpg"):
        status, doc, _h = await post(photo_proxy, chat_with_image(remote.url + url))
        assert status == 200, doc
    first, second, third = (sent_image_url(upstream, i) for i in range(3))
    assert first == second == third and first.startswith("data:image/jpeg;base64,")
    assert sample(photo_proxy, "mmgate_fetches_total", outcome="ok") == 3  # the fetch itself is not saved
    assert (sample(photo_proxy, "mmgate_cache_misses_total"), sample(photo_proxy, "mmgate_cache_hits_total")) == (1, 2)
    # a refusal is kept too: the second time it is refused without a decode
    for _ in range(2):
        status, doc, _h = await post(proxy, chat_with_image(remote.url + "/bomb.png"))
        assert (status, doc["error"]["code"]) == (400, "image_too_large")
    assert (sample(proxy, "mmgate_cache_misses_total"), sample(proxy, "mmgate_cache_hits_total")) == (1, 1)


async def decodes_and_hits(proxy: Proxy) -> tuple[float, float]:
    """The cache's misses (each one decode) and hits, as /mmgate/metrics reports them."""
    prom = await scrape(proxy.url)
    return prom.get(("mmgate_cache_misses_total", ()), -1.0), prom.get(("mmgate_cache_hits_total", ()), -1.0)


async def test_a_url_part_does_not_take_single_flight_from_the_inline_part_beside_it(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    """The first request decodes an inline image; the second sends that image inline beside a URL part while
    the first still decodes: it waits for the first's verdict instead of decoding the inline image again."""
    inline = data_uri(image_bytes(64, 48, color="green"), "image/png")
    remote.route("/blue.png", serve(image_bytes(32, 32, color="blue")))
    # full validation: the inline image is decoded in the pool (a header-judged one never is)
    proxy = await fetching(start_proxy, upstream, MMGATE_VALIDATE="full")
    both = chat_with_image(inline)
    both["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": f"{remote.url}/blue.png"}})
    blocked = BlockedPool(proxy.state.pool)
    try:
        leader = asyncio.create_task(post(proxy, chat_with_image(inline)))
        await eventually(lambda: proxy.state.pool.queued == 1, "the first request's item queued")
        follower = asyncio.create_task(post(proxy, both))
        await eventually(lambda: proxy.state.cache.waiting == 1, "the second waits for the first's decode")
    finally:
        blocked.release()
    assert (await leader)[0] == 200 and (await follower)[0] == 200
    assert await decodes_and_hits(proxy) == (2, 1)  # the inline image once, the fetched one once


async def test_two_identical_first_fetches_decode_once(remote: Upstream, upstream: Upstream,
                                                       start_proxy: StartProxy) -> None:
    png = image_bytes(48, 48, color="red")
    remote.route("/a.png", serve(png))
    remote.route("/same-bytes-elsewhere.png", serve(png))
    proxy = await fetching(start_proxy, upstream)
    blocked = BlockedPool(proxy.state.pool)
    try:
        first = asyncio.create_task(post(proxy, chat_with_image(f"{remote.url}/a.png")))
        await eventually(lambda: proxy.state.pool.queued == 1, "the first fetch's item queued")
        second = asyncio.create_task(post(proxy, chat_with_image(f"{remote.url}/same-bytes-elsewhere.png")))
        await eventually(lambda: proxy.state.cache.waiting == 1, "the second fetch waits for the first's decode")
    finally:
        blocked.release()
    assert (await first)[0] == 200 and (await second)[0] == 200
    assert sent_image_url(upstream, 0) == sent_image_url(upstream, 1)
    assert sample(proxy, "mmgate_fetches_total", outcome="ok") == 2  # each request reads its own URL
    assert await decodes_and_hits(proxy) == (1, 1)


async def test_a_cache_hit_of_a_fetched_item_weighs_only_what_it_forwards(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    """Charged the per-item cap while it is fetched; once its bytes are known, a miss weighs what it is and
    the base64 that takes its URL's place, a hit only that base64, for as long as the request holds its slot."""
    png = image_bytes(40, 40, color="white")
    remote.route("/w.png", serve(png))
    arrived = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        arrived.set()
        await upstream.release.wait()
        return web.json_response({"ok": True})

    upstream.route("/v1/chat/completions", held)
    proxy = await fetching(start_proxy, upstream, MMGATE_RELEASE_AT="complete")
    gate = proxy.state.gate
    forwarded = len(base64.b64encode(png))
    for weighs in (len(png) + forwarded, forwarded):  # a miss, then a hit
        arrived.clear()
        upstream.release.clear()
        sending = asyncio.create_task(post(proxy, chat_with_image(f"{remote.url}/w.png")))
        await arrived.wait()
        assert (gate.counters().in_use, gate.counters().bytes_in_use) == (1, weighs)
        upstream.release.set()
        assert (await sending)[0] == 200
        await eventually(lambda: gate.counters().in_use == 0, "the lease released")
    assert await decodes_and_hits(proxy) == (1, 1)


def _wav(seconds: float) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(8000)
        out.writeframes(struct.pack("<h", 0) * int(8000 * seconds))
    return buf.getvalue()


async def test_audio_urls_are_fetched_and_checked_like_inline_audio(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    short, long = _wav(0.5), _wav(3)
    remote.route("/short.wav", serve(short, "audio/x-wav"))  # the bytes name the type in the data URI
    remote.route("/long.wav", serve(long, "audio/wav"))
    proxy = await fetching(start_proxy, upstream, MMGATE_MAX_AUDIO_SECONDS="2")

    def chat(url: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "listen"}, {"type": "audio_url", "audio_url": {"url": url}}]}]}

    status, _doc, _h = await post(proxy, chat(f"{remote.url}/short.wav"))
    assert status == 200
    sent = json.loads(upstream.seen[0].body)["messages"][0]["content"][1]["audio_url"]["url"]
    assert sent == "data:audio/wav;base64," + base64.b64encode(short).decode()

    status, doc, _h = await post(proxy, chat(f"{remote.url}/long.wav"))
    assert (status, doc["error"]["code"]) == (400, "audio_invalid")
    assert len(upstream.seen) == 1


async def test_generate_and_responses_urls_are_fetched_too(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    png = image_bytes(8, 8)
    remote.route("/p", serve(png))
    proxy = await fetching(start_proxy, upstream)
    expected = "data:image/png;base64," + base64.b64encode(png).decode()
    status, _doc, _h = await post(proxy, {"text": "hi", "image_data": [f"{remote.url}/p"]}, "/generate")
    assert status == 200 and json.loads(upstream.seen[0].body)["image_data"] == [expected]
    status, _doc, _h = await post(proxy, {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": f"{remote.url}/p"}]}]}, "/v1/responses")
    assert status == 200
    assert json.loads(upstream.seen[1].body)["input"][0]["content"][0]["image_url"] == expected


async def test_the_openai_sdk_sends_an_http_image_url_that_arrives_inline(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    png = image_bytes(32, 32, color="blue")
    remote.route("/blue.png", serve(png))
    proxy = await fetching(start_proxy, upstream)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    await client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "colour?"},
        {"type": "image_url", "image_url": {"url": f"{remote.url}/blue.png"}}]}])
    await client.close()
    assert sent_image_url(upstream) == "data:image/png;base64," + base64.b64encode(png).decode()
    assert len(remote.seen) == 1


async def test_a_url_is_charged_the_per_item_cap_at_admission_before_its_bytes_are_read(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    arrived = held_image(remote)
    proxy = await fetching(start_proxy, upstream, MMGATE_MAX_MEDIA_ITEM_MB="3")
    sending = asyncio.create_task(post(proxy, chat_with_image(f"{remote.url}/held")))
    await arrived.wait()
    assert proxy.state.gate.counters().bytes_in_use == 3 << 20 and proxy.state.gate.counters().in_use == 1
    remote.release.set()
    status, _doc, _h = await sending
    assert status == 200 and proxy.state.gate.counters().bytes_in_use == 0

    # More URLs than the byte budget can charge: 413 from the gate, nothing fetched.
    small = await fetching(start_proxy, upstream, MMGATE_MAX_MEDIA_ITEM_MB="3", MMGATE_MAX_INFLIGHT_MEDIA_MB="5")
    two = chat_with_image(f"{remote.url}/held")
    two["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": f"{remote.url}/held"}})
    status, doc, _h = await post(small, two)
    assert (status, doc["error"]["code"]) == (413, "media_too_large")
    assert len(remote.seen) == 1


async def test_a_client_that_leaves_mid_fetch_frees_the_gate_and_stops_the_fetch(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    arrived = held_image(remote)
    proxy = await fetching(start_proxy, upstream)
    leaving = asyncio.create_task(post(proxy, chat_with_image(f"{remote.url}/held")))
    await arrived.wait()
    assert proxy.state.gate.counters().in_use == 1
    leaving.cancel()  # the client hangs up while mmgate waits for the remote
    await eventually(lambda: proxy.state.gate.counters().in_use == 0
                     and sample(proxy, "mmgate_fetches_total", outcome="cancelled") == 1, "fetch cancelled")
    assert upstream.seen == []


# ----------------------------------------------------------------------------------------------------------
# each refusal


@pytest.mark.parametrize("url", [
    "http://10.0.0.1/x", "http://192.168.1.1/x", "http://172.16.0.1/x", "http://169.254.169.254/latest/meta-data",
    "http://100.64.0.1/x", "http://0.0.0.0/x", "http://224.0.0.1/x", "http://255.255.255.255/x",
    "http://[::1]/x", "http://[fd00:ec2::254]/x", "http://[fe80::1]/x", "http://[::ffff:10.0.0.1]/x",
    "http://[64:ff9b::a9fe:a9fe]/x", "http://[2002:a00:1::]/x", "http://127.0.0.2/x",
    "http://10.1/x", "http://167772161/x", "http://0xa9.0xfe.0xa9.0xfe/x", "http://012.0.0.1/x",
    "http://[::127.0.0.1]/x",
])
async def test_a_forbidden_address_literal_is_refused_before_any_connect(
        url: str, upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await fetching(start_proxy, upstream)
    message = await refused(proxy, upstream, url, "fetch_address_forbidden")
    assert "MMGATE_FETCH_ALLOW_ADDRESSES" in message
    assert _WATCH["foreign"] == []  # the audit hook saw no connect to it


async def test_loopback_needs_the_explicit_address_setting(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    remote.route("/p", serve(image_bytes(8, 8)))
    proxy = await start_proxy(upstream.url, MMGATE_MEDIA_URLS="fetch")  # no MMGATE_FETCH_ALLOW_ADDRESSES
    message = await refused(proxy, upstream, f"{remote.url}/p", "fetch_address_forbidden")
    assert "loopback" in message
    # A name that resolves to loopback is refused from its resolved addresses, before a connect.
    message = await refused(proxy, upstream, f"http://localhost:{remote.server.port}/p" if remote.server else "",
                            "fetch_address_forbidden")
    assert "resolves to a loopback address" in message
    assert remote.seen == []


async def test_a_redirect_into_a_private_address_is_checked_and_refused(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    remote.route("/to-private", redirect("http://10.1.2.3/secret"))
    remote.route("/to-metadata", redirect("http://169.254.169.254/latest/meta-data/", 307))
    remote.route("/to-file", redirect("file:///etc/passwd"))
    proxy = await fetching(start_proxy, upstream)
    await refused(proxy, upstream, f"{remote.url}/to-private", "fetch_address_forbidden")
    await refused(proxy, upstream, f"{remote.url}/to-metadata", "fetch_address_forbidden")
    await refused(proxy, upstream, f"{remote.url}/to-file", "fetch_url_not_allowed")
    assert [s.path for s in remote.seen] == ["/to-private", "/to-metadata", "/to-file"]


async def test_a_redirect_within_the_rules_is_followed(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    png = image_bytes(8, 8)
    remote.route("/old", redirect("/new", 301))
    remote.route("/new", serve(png))
    proxy = await fetching(start_proxy, upstream)
    status, _doc, _h = await post(proxy, chat_with_image(f"{remote.url}/old"))
    assert status == 200 and [s.path for s in remote.seen] == ["/old", "/new"]
    assert sent_image_url(upstream) == "data:image/png;base64," + base64.b64encode(png).decode()


async def test_too_many_redirects(remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    remote.route("/loop", redirect("/loop"))
    proxy = await fetching(start_proxy, upstream, MMGATE_FETCH_MAX_REDIRECTS="2")
    await refused(proxy, upstream, f"{remote.url}/loop", "fetch_too_many_redirects")
    assert len(remote.seen) == 3  # the first request and two redirects followed, no more


async def test_a_host_outside_the_allow_list_is_refused_before_any_request(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    remote.route("/p", serve(image_bytes(8, 8)))
    remote.route("/away", redirect("http://127.0.0.1:1/p"))
    proxy = await fetching(start_proxy, upstream, MMGATE_FETCH_ALLOW_HOSTS="images.example.com,*.cdn.example")
    message = await refused(proxy, upstream, f"{remote.url}/p", "fetch_host_not_allowed")
    assert "MMGATE_FETCH_ALLOW_HOSTS" in message
    assert remote.seen == []
    # Listed literally, the address is fetched; a redirect to another host is checked against the list.
    listed = await fetching(start_proxy, upstream, MMGATE_FETCH_ALLOW_HOSTS="127.0.0.1")
    status, _doc, _h = await post(listed, chat_with_image(f"{remote.url}/p"))
    assert status == 200
    other = await fetching(start_proxy, upstream, MMGATE_FETCH_ALLOW_HOSTS="127.0.0.1,*.example.com")
    status, doc, _h = await post(other, chat_with_image(f"http://LOCALHOST:{remote.server.port}/p"
                                                        if remote.server else ""))
    assert (status, doc["error"]["code"]) == (400, "fetch_host_not_allowed")


async def test_an_oversize_body_is_refused_with_and_without_content_length(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    big = b"\x89PNG" + bytes((1 << 20) + 100)
    remote.route("/declared", serve(big))

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(128):  # 8 MiB with no length announced: only a cap counted while reading stops it
            await response.write(bytes(64 << 10))
        return response

    remote.route("/endless", chunked)
    proxy = await fetching(start_proxy, upstream, MMGATE_MAX_MEDIA_ITEM_MB="1", MMGATE_ACCESS_LOG="on")
    with caplog.at_level("INFO", logger="mmgate.access"):
        await refused(proxy, upstream, f"{remote.url}/declared", "fetch_too_large")
        assert sample(proxy, "mmgate_fetched_bytes_total") == 0  # refused from Content-Length, nothing read
        await refused(proxy, upstream, f"{remote.url}/endless", "fetch_too_large")
    read = sample(proxy, "mmgate_fetched_bytes_total")
    assert (1 << 20) < read <= (1 << 20) + (1 << 20)  # stopped within a chunk of the cap
    records = [r for r in caplog.records if r.name == "mmgate.access"]
    assert [r.fields["fetched"] for r in records] == [0, read]  # type: ignore[attr-defined]


async def test_a_slow_first_byte_and_a_slow_body_are_timed_out(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    async def silent(request: web.Request) -> web.StreamResponse:
        await remote.release.wait()
        return web.Response()

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        await response.write(b"\x89PNG")
        await remote.release.wait()
        return response

    remote.route("/silent", silent)
    remote.route("/trickle", trickle)
    proxy = await fetching(start_proxy, upstream, MMGATE_FETCH_FIRST_BYTE_TIMEOUT="0.2", MMGATE_FETCH_TIMEOUT="0.5")
    message = await refused(proxy, upstream, f"{remote.url}/silent", "fetch_timeout")
    assert "MMGATE_FETCH_FIRST_BYTE_TIMEOUT" in message
    message = await refused(proxy, upstream, f"{remote.url}/trickle", "fetch_timeout")
    assert "MMGATE_FETCH_TIMEOUT" in message and "FIRST_BYTE" not in message


@pytest.mark.parametrize(("content_type", "extra"), [
    ("text/html", {}), ("application/octet-stream", {}), ("audio/wav", {}), ("", {}),
    ("image/png", {"Content-Encoding": "gzip"}),
])
async def test_a_wrong_content_type_is_refused(
        content_type: str, extra: dict[str, str], remote: Upstream, upstream: Upstream,
        start_proxy: StartProxy) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.Response(body=image_bytes(8, 8), headers=extra)
        if content_type:
            response.headers["Content-Type"] = content_type
        else:
            response.headers["Content-Type"] = ""
        return response

    remote.route("/p", handler)
    proxy = await fetching(start_proxy, upstream)
    await refused(proxy, upstream, f"{remote.url}/p", "fetch_bad_content_type")


async def test_a_remote_error_or_an_unreachable_port_is_the_clients_400(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    with socket.socket() as sock:  # a loopback port with nothing listening
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]

    async def missing(request: web.Request) -> web.StreamResponse:
        return web.Response(status=404, body=image_bytes(8, 8), content_type="image/png")

    remote.route("/missing", missing)
    proxy = await fetching(start_proxy, upstream)
    message = await refused(proxy, upstream, f"{remote.url}/missing", "fetch_failed")
    assert "HTTP 404" in message
    await refused(proxy, upstream, f"http://127.0.0.1:{closed_port}/p", "fetch_failed")


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/p", "file:///etc/passwd", "gopher://127.0.0.1/"])
async def test_only_http_and_https_are_fetched(url: str, upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await fetching(start_proxy, upstream)
    status, doc, _h = await post(proxy, chat_with_image(url))
    assert (status, doc["error"]["code"]) == (400, "media_url_scheme_not_allowed")  # in every mode, fetch too
    assert upstream.seen == []


async def test_parts_whose_url_cannot_become_a_data_uri_are_refused(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await fetching(start_proxy, upstream)
    video = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "t"}, {"type": "video_url", "video_url": {"url": f"{remote.url}/v.mp4"}}]}]}
    status, doc, _h = await post(proxy, video)
    assert (status, doc["error"]["code"]) == (400, "media_url_not_allowed")
    anthropic_url = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": f"{remote.url}/p.png"}}]}]}
    status, doc, _h = await post(proxy, anthropic_url, "/v1/messages")
    assert status == 400 and doc["type"] == "error" and "media_url_not_allowed" in doc["error"]["message"]
    assert upstream.seen == [] and remote.seen == []


async def test_forward_stays_the_default_and_fetches_nothing(
        remote: Upstream, upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url)
    assert proxy.state.fetcher is None
    registry = proxy.state.metrics.registry
    assert registry.get_sample_value("mmgate_fetches_total", {"outcome": "ok"}) is None  # nothing shown
    fetching_proxy = await fetching(start_proxy, upstream)
    for outcome in FETCH_OUTCOMES:  # with fetch, every outcome's series exists from the start
        assert fetching_proxy.state.metrics.registry.get_sample_value(
            "mmgate_fetches_total", {"outcome": outcome}) == 0
    url = f"{remote.url}/p.png"
    status, _doc, _h = await post(proxy, chat_with_image(url))
    assert status == 200 and sent_image_url(upstream) == url and remote.seen == []


# ----------------------------------------------------------------------------------------------------------
# one lookup, checked, and the connection goes to what it answered


class Answers(AbstractResolver):
    """A DNS stand-in (no packet leaves the machine): fixed answers per name, and a log of what was asked."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        self.asked.append(host)
        return [{"hostname": host, "host": a, "port": port, "proto": 0, "flags": socket.AI_NUMERICHOST,
                 "family": socket.AF_INET6 if ":" in a else socket.AF_INET} for a in self.answers[host]]

    async def close(self) -> None:
        pass


async def fetcher_with(answers: Answers, allowed: list[str]) -> Fetcher:
    addresses = AddressPolicy.from_cidrs(allowed)
    connector = aiohttp.TCPConnector(resolver=CheckedResolver(addresses, answers), use_dns_cache=False)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    return Fetcher(session, HostPolicy(), addresses, FetchLimits(3, 30, 30), lambda outcome, n: None)


async def test_a_name_is_resolved_once_checked_and_connected_to_as_answered(remote: Upstream) -> None:
    assert remote.server is not None
    png = image_bytes(8, 8)
    remote.route("/p", serve(png))
    answers = Answers({"media.test": ["127.0.0.1"]})
    fetcher = await fetcher_with(answers, ["127.0.0.1/32"])
    try:
        fetched = await fetcher.fetch(f"http://media.test:{remote.server.port}/p", "image", 1 << 20)
    finally:
        await fetcher.session.close()
    assert fetched.data == png and fetched.mime == "image/png"
    assert answers.asked == ["media.test"]  # one lookup: no second one could answer something else
    assert remote.seen[0].headers["Host"] == f"media.test:{remote.server.port}"  # the name stays the Host


async def test_one_forbidden_answer_refuses_the_name_before_any_connect(remote: Upstream) -> None:
    answers = Answers({"mixed.test": ["93.184.216.34", "10.0.0.7"], "meta.test": ["fd00:ec2::254"]})
    fetcher = await fetcher_with(answers, [])
    try:
        for name, why in (("mixed.test", "private"), ("meta.test", "private")):
            with pytest.raises(FetchRefused) as refused_fetch:
                await fetcher.fetch(f"http://{name}/p", "image", 1 << 20)
            assert refused_fetch.value.code == "fetch_address_forbidden" and why in refused_fetch.value.message
    finally:
        await fetcher.session.close()
    assert answers.asked == ["mixed.test", "meta.test"]
    assert _WATCH["foreign"] == [] and remote.seen == []


# ----------------------------------------------------------------------------------------------------------
# the address rule, over the address spaces

FORBIDDEN_V4 = [ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4")]
FORBIDDEN_V6 = [ipaddress.IPv6Network(n) for n in (
    "::1/128", "::/128", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8", "::ffff:0:0/96", "64:ff9b:1::/48")]


def _in(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> st.SearchStrategy[Any]:
    return st.integers(0, network.num_addresses - 1).map(lambda i: network[i])


v4_forbidden = st.sampled_from(FORBIDDEN_V4).flatmap(_in)
v6_forbidden = st.sampled_from(FORBIDDEN_V6).flatmap(_in)
# Public unicast IPv4: 1.0.0.0 - 9.255.255.255 and 11.0.0.0 - 99.255.255.255 hold no special range.
v4_public = st.one_of(st.integers(0x01000000, 0x09FFFFFF), st.integers(0x0B000000, 0x63FFFFFF)).map(
    ipaddress.IPv4Address)
v6_public = _in(ipaddress.IPv6Network("2606:4700::/32"))


def v6_forms(v4: ipaddress.IPv4Address) -> list[ipaddress.IPv6Address]:
    """Every IPv6 spelling of ``v4``: mapped, compatible, NAT64, 6to4 (with any subnet and interface)."""
    n = int(v4)
    return [ipaddress.IPv6Address((0xFFFF << 32) | n), ipaddress.IPv6Address(n),
            ipaddress.IPv6Address((0x0064FF9B << 96) | n),
            ipaddress.IPv6Address((0x2002 << 112) | (n << 80) | 0x1234_5678)]


@settings(max_examples=300, deadline=None)
@given(v4_forbidden)
def test_a_forbidden_ipv4_is_forbidden_in_every_ipv6_form(address: ipaddress.IPv4Address) -> None:
    assert forbidden_class(address) is not None
    for form in v6_forms(address):
        assert address in embedded_ipv4(form) or form == ipaddress.IPv6Address(0)
        assert forbidden_class(form) is not None, form


@settings(max_examples=200, deadline=None)
@given(v6_forbidden)
def test_forbidden_ipv6_ranges(address: ipaddress.IPv6Address) -> None:
    assert forbidden_class(address) is not None


@settings(max_examples=200, deadline=None)
@given(st.one_of(v4_public, v6_public))
def test_public_addresses_are_allowed_and_only_explicit_cidrs_open_private_ones(address: Any) -> None:
    assert forbidden_class(address) is None
    if isinstance(address, ipaddress.IPv4Address):  # NAT64 and 6to4 of a public address stay public
        assert forbidden_class(v6_forms(address)[2]) is None
        assert forbidden_class(v6_forms(address)[3]) is None


@settings(max_examples=200, deadline=None)
@given(st.one_of(v4_forbidden, v6_forbidden))
def test_the_allow_setting_opens_exactly_its_networks(address: Any) -> None:
    assert AddressPolicy().refusal(address) is not None
    assert AddressPolicy.from_cidrs([str(address)]).refusal(address) is None
    assert AddressPolicy.from_cidrs(["192.0.2.0/24", "2001:db8::/32"]).refusal(address) is not None \
        or address in ipaddress.ip_network("192.0.2.0/24") or address in ipaddress.ip_network("2001:db8::/32")


def test_named_addresses() -> None:
    for literal in ("169.254.169.254", "fd00:ec2::254", "100.64.0.1", "255.255.255.255", "::ffff:127.0.0.1",
                    "::127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::", "2002:a9fe:a9fe::1", "fe80::1%eth0"):
        assert forbidden_class(ipaddress.ip_address(literal)) is not None, literal
    assert forbidden_class(ipaddress.ip_address("8.8.8.8")) is None
    assert forbidden_class(ipaddress.ip_address("2001:4860:4860::8888")) is None


def test_host_patterns() -> None:
    policy = HostPolicy.from_patterns(["images.example.com", "*.cdn.example", "bücher.example"])
    assert policy.allows("images.example.com") and policy.allows("IMAGES.example.com.")
    assert policy.allows("a.cdn.example") and policy.allows("a.b.cdn.example")
    assert not policy.allows("cdn.example") and not policy.allows("evilcdn.example")
    assert not policy.allows("images.example.com.evil.net") and not policy.allows("example.com")
    assert policy.allows("xn--bcher-kva.example")
    assert HostPolicy.from_patterns([]).allows("anything.example")


def test_fetch_settings_are_validated() -> None:
    s = Settings.from_env({"MMGATE_MEDIA_URLS": "fetch", "MMGATE_FETCH_ALLOW_HOSTS": "A.example.com, *.cdn.net",
                           "MMGATE_FETCH_ALLOW_ADDRESSES": "127.0.0.1,10.0.0.0/8"})
    assert s.fetch.fetch_allow_hosts == ("a.example.com", "*.cdn.net")
    assert s.fetch.fetch_allow_addresses == ("127.0.0.1/32", "10.0.0.0/8")
    assert s.worst_case_memory_bytes()["fetched"] > 0
    assert Settings.from_env({}).worst_case_memory_bytes()["fetched"] == 0
    for name, value in (("MMGATE_FETCH_ALLOW_HOSTS", "a b"), ("MMGATE_FETCH_ALLOW_HOSTS", "*.*.x"),
                        ("MMGATE_FETCH_ALLOW_HOSTS", "http://x"), ("MMGATE_FETCH_ALLOW_ADDRESSES", "10.0.0.0/33"),
                        ("MMGATE_FETCH_ALLOW_ADDRESSES", "localhost"), ("MMGATE_MEDIA_URLS", "download")):
        with pytest.raises(ConfigError, match=name):
            Settings.from_env({name: value})
