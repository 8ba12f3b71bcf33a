"""The transparent proxy: real clients → real mmgate → a real scripted upstream, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from yarl import URL

from testkit.media import chat_with_image, data_uri, image_bytes
from testkit.servers import counted
from tests.conftest import Proxy, StartProxy, Upstream


async def test_text_body_forwarded_byte_for_byte(upstream: Upstream, proxy: Proxy) -> None:
    # What a re-serialising proxy would change: big ints, exponents, escaped slashes, duplicate keys, key order.
    body = (b'{"model":"m","z":1,"messages":[{"role":"user","content":"hi \\/ there"}],'
            b'"seed":123456789012345678901234567890,"t":1e2,"dup":1,"dup":2}')
    async with aiohttp.ClientSession() as client:
        async with client.post(URL(proxy.url + "/v1/chat/completions?x=1&y=%2F", encoded=True), data=body,
                               headers={"Content-Type": "application/json"}) as response:
            assert response.status == 200
            await response.read()
    seen = upstream.seen[-1]
    assert seen.body == body
    assert seen.path == "/v1/chat/completions?x=1&y=%2F"
    assert seen.headers["Content-Type"] == "application/json"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_big_text_body_arriving_in_pieces_is_forwarded_byte_for_byte(upstream: Upstream, proxy: Proxy,
                                                                            framing: str) -> None:
    # Many reads of odd sizes: the body reaches mmgate in many chunks and leaves as they came, never joined.
    sizes = [1, 7, 4096, 65_537, 3, 300_000]
    text = b"".join(b"%07d lorem ipsum dolor sit amet, \\u00e9 \\n " % n for n in range(150_000))
    body = b'{"model":"m","messages":[{"role":"user","content":"' + text + b'"}]}'
    pieces, at = [], 0
    while at < len(body):
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(body[at:at + size])
        at += size

    async def stream() -> Any:
        for piece in pieces:
            yield piece

    data: Any = stream() if framing == "chunked" else body
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/chat/completions", data=data,
                               headers={"Content-Type": "application/json"}) as response:
            assert response.status == 200
            await response.read()
    seen = upstream.seen[-1]
    assert seen.body == body
    assert seen.headers["Content-Length"] == str(len(body))


async def test_hop_by_hop_headers_stripped_both_ways(upstream: Upstream, proxy: Proxy) -> None:
    async def answer(request: web.Request) -> web.Response:
        response = web.Response(text="ok")
        response.headers["Connection"] = "X-Upstream-Private"
        response.headers["X-Upstream-Private"] = "secret"
        response.headers["Keep-Alive"] = "timeout=5"
        response.headers["Proxy-Authenticate"] = "Basic"
        response.headers["X-Kept"] = "yes"
        return response

    upstream.route("/hop", answer)
    headers = {
        "Connection": "keep-alive, X-Client-Private",
        "X-Client-Private": "1",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Proxy-Authorization": "Basic Zm9vOmJhcg==",
        "Proxy-Connection": "keep-alive",
        "Upgrade": "h2c",
        "Authorization": "Bearer end-to-end",
        "X-Forwarded-For": "203.0.113.7",
        "X-Request-Id": "client-id-1",
    }
    async with aiohttp.ClientSession() as client, client.get(proxy.url + "/hop", headers=headers) as response:
        assert response.status == 200
        got = response.headers
        assert "X-Upstream-Private" not in got and "Keep-Alive" not in got
        assert "Proxy-Authenticate" not in got
        assert got["X-Kept"] == "yes"
        assert got["X-Request-Id"] == "client-id-1"
    seen = {k.lower(): v for k, v in upstream.seen[-1].headers.items()}
    for name in ("x-client-private", "keep-alive", "te", "proxy-authorization", "proxy-connection", "upgrade"):
        assert name not in seen, name
    assert seen["authorization"] == "Bearer end-to-end"  # end-to-end fields pass
    assert seen["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "http"
    assert seen["x-request-id"] == "client-id-1"
    assert seen["host"] == f"127.0.0.1:{upstream.server.port}"  # type: ignore[union-attr]


async def test_request_id_generated_when_missing_or_unsafe(upstream: Upstream, proxy: Proxy) -> None:
    async with aiohttp.ClientSession() as client:
        for sent in (None, "bad id with spaces\u00e9", "x" * 129):
            headers = {"X-Request-Id": sent} if sent else {}
            async with client.get(proxy.url + "/v1/models", headers=headers) as response:
                returned = response.headers["X-Request-Id"]
            assert returned != sent and len(returned) == 32
            assert upstream.seen[-1].headers["X-Request-Id"] == returned


async def test_upstream_errors_pass_through_untouched(upstream: Upstream, proxy: Proxy) -> None:
    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=503, body=b'{"weird": "upstream shape"}', headers={"Retry-After": "7"})

    upstream.route("/v1/chat/completions", fail)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/chat/completions", data=b'{"messages": []}') as response:
            assert response.status == 503
            assert await response.read() == b'{"weird": "upstream shape"}'
            assert response.headers["Retry-After"] == "7"


async def test_body_over_limit_by_content_length(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_BODY_MB="1")
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/chat/completions", data=b"x" * ((1 << 20) + 1)) as response:
            assert response.status == 413
            error = (await response.json())["error"]
    assert error["code"] == "body_too_large" and error["type"] == "invalid_request_error"
    assert upstream.seen == []


async def test_chunked_body_cut_at_limit(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_BODY_MB="1")
    sent = 0

    async def endless():
        nonlocal sent
        for _ in range(64):  # 4 MiB on offer; the proxy must stop reading after 1 MiB
            sent += 1
            yield b"y" * 65536

    async with aiohttp.ClientSession() as client:
        try:
            async with client.post(proxy.url + "/other", data=endless()) as response:
                assert response.status == 413
                assert (await response.json())["error"]["code"] == "body_too_large"
        except aiohttp.ClientOSError:
            pytest.fail("the 413 must reach the client")
    assert upstream.seen == []


@pytest.mark.parametrize(("framing", "kind"), [
    ("content-length", "media"), ("chunked", "media"), ("content-length", "text"), ("chunked", "text")])
async def test_a_body_too_large_is_counted_by_what_it_carries(upstream: Upstream, start_proxy: StartProxy,
                                                              caplog: pytest.LogCaptureFixture, framing: str,
                                                              kind: str) -> None:
    """413 before the body is parsed: a chunked body is known by the sniff of its head, one refused from its
    Content-Length alone by that length (over 4 MiB on a media route: more than a text prompt is)."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_BODY_MB="1", MMGATE_ACCESS_LOG="on")
    size = (5 << 20) if (framing, kind) == ("content-length", "media") else (2 << 20)
    if kind == "media":
        body = orjson.dumps(chat_with_image(data_uri(image_bytes(64, 48) + bytes(size))))
    else:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "words " * (size // 6)}]})

    async def pieces():
        for at in range(0, len(body), 65536):
            yield body[at:at + 65536]

    with caplog.at_level(logging.INFO, logger="mmgate.access"):
        async with aiohttp.ClientSession() as client:
            if framing == "chunked":
                request = client.post(proxy.url + "/v1/chat/completions", data=pieces())
            else:  # the body is never sent: the 413 comes instead of the 100 Continue
                request = client.post(proxy.url + "/v1/chat/completions", data=body, expect100=True)
            async with request as response:
                assert response.status == 413
                assert (await response.json())["error"]["code"] == "body_too_large"

    [line] = [r.fields for r in caplog.records if r.name == "mmgate.access"]  # type: ignore[attr-defined]
    assert (line["kind"], line["status"], line["code"]) == (kind, 413, "body_too_large")
    counts = await counted(proxy)
    assert counts.by_kind == {kind: 1}
    assert counts.by_kind_and_code == {(kind, "413"): 1}
    assert upstream.seen == []


async def test_an_image_body_refused_by_its_parse_is_counted_as_media(
        upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_ACCESS_LOG="on")
    body = orjson.dumps(chat_with_image(data_uri(image_bytes())))[:-2]  # cut short: no parse finds its parts
    with caplog.at_level(logging.INFO, logger="mmgate.access"):
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + "/v1/chat/completions", data=body) as response:
                assert response.status == 400
                assert (await response.json())["error"]["code"] == "invalid_json"
    [line] = [r.fields for r in caplog.records if r.name == "mmgate.access"]  # type: ignore[attr-defined]
    assert (line["kind"], line["code"]) == ("media", "invalid_json")
    assert (await counted(proxy)).by_kind_and_code == {("media", "400"): 1}


async def test_anthropic_route_errors_in_anthropic_shape(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_BODY_MB="1")
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/messages", data=b"x" * (2 << 20)) as response:
            assert response.status == 413
            body = await response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "request_too_large"
    assert "body_too_large" in body["error"]["message"]


async def test_upstream_down_is_503_with_retry_after(start_proxy: StartProxy) -> None:
    from proxy.serve.demo import free_port

    proxy = await start_proxy(f"http://127.0.0.1:{free_port()}")
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/chat/completions", data=b"{}") as response:
            assert response.status == 503 and response.headers["Retry-After"] == "1"
            assert (await response.json())["error"]["code"] == "upstream_down"
        async with client.get(proxy.url + "/mmgate/ready") as response:
            assert response.status == 503
    assert proxy.state.metrics.upstream_errors.labels("connect")._value.get() == 1


async def test_stalled_upstream_is_504(upstream: Upstream, start_proxy: StartProxy) -> None:
    async def stall(request: web.Request) -> web.Response:
        await upstream.release.wait()
        return web.Response(text="late")

    upstream.route("/slow", stall)
    proxy = await start_proxy(upstream.url, MMGATE_UPSTREAM_READ_TIMEOUT="0.2")
    async with aiohttp.ClientSession() as client, client.get(proxy.url + "/slow") as response:
        assert response.status == 504
        assert (await response.json())["error"]["code"] == "upstream_timeout"
    await asyncio.wait_for(upstream.cancelled.wait(), 10)  # and the upstream request was closed


async def test_request_deadline_header(upstream: Upstream, proxy: Proxy) -> None:
    async def stall(request: web.Request) -> web.Response:
        await upstream.release.wait()
        return web.Response(text="late")

    upstream.route("/slow", stall)
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/slow", headers={"X-MMGate-Timeout": "0.2"}) as response:
            assert response.status == 504
            error = (await response.json())["error"]
            assert error["code"] == "request_timeout"
            assert "0.2 s deadline (the request's X-MMGate-Timeout header)" in error["message"]
        await asyncio.wait_for(upstream.cancelled.wait(), 10)
        assert "X-MMGate-Timeout" not in upstream.seen[-1].headers  # ours, never forwarded
        async with client.get(proxy.url + "/slow", headers={"X-MMGate-Timeout": "soon"}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == "invalid_timeout_header"


async def test_timeout_header_cannot_raise_configured_deadline(upstream: Upstream, start_proxy: StartProxy) -> None:
    async def stall(request: web.Request) -> web.Response:
        await upstream.release.wait()
        return web.Response(text="late")

    upstream.route("/slow", stall)
    proxy = await start_proxy(upstream.url, MMGATE_REQUEST_TIMEOUT="0.2")
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/slow", headers={"X-MMGate-Timeout": "3600"}) as response:
            assert response.status == 504
            error = (await response.json())["error"]
            assert error["code"] == "request_timeout"
            assert "0.2 s deadline (MMGATE_REQUEST_TIMEOUT)" in error["message"]  # the one that fired


def _sse_upstream(upstream: Upstream, events: int, hold_after: int | None = None):
    """An SSE endpoint that sends ``events`` events; after ``hold_after`` of them it waits for upstream.release."""
    first_sent = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(events):
            if i == hold_after:
                await upstream.release.wait()
            await response.write(b"data: " + orjson.dumps({"i": i}) + b"\n\n")
            first_sent.set()
        await response.write(b"data: [DONE]\n\n")
        return response

    upstream.route("/v1/chat/completions", stream)
    return first_sent


async def test_sse_events_arrive_while_upstream_still_streaming(upstream: Upstream, proxy: Proxy) -> None:
    _sse_upstream(upstream, events=3, hold_after=1)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/chat/completions", data=b'{"stream": true}') as response:
            first = await response.content.readuntil(b"\n\n")  # arrives although the upstream is holding
            assert first == b'data: {"i":0}\n\n'
            upstream.release.set()
            rest = await response.read()
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_client_disconnect_mid_stream_aborts_upstream(upstream: Upstream, proxy: Proxy) -> None:
    _sse_upstream(upstream, events=3, hold_after=1)
    async with aiohttp.ClientSession() as client:
        response = await client.post(proxy.url + "/v1/chat/completions", data=b'{"stream": true}')
        await response.content.readuntil(b"\n\n")
        response.close()  # hang up mid-stream
    await asyncio.wait_for(upstream.cancelled.wait(), 10)


async def test_client_disconnect_before_first_byte_aborts_upstream(upstream: Upstream, proxy: Proxy) -> None:
    async def stall(request: web.Request) -> web.Response:
        await upstream.release.wait()
        return web.Response(text="late")

    upstream.route("/v1/chat/completions", stall)
    async with aiohttp.ClientSession() as client:
        task = asyncio.create_task(client.post(proxy.url + "/v1/chat/completions", data=b"{}"))
        await asyncio.wait_for(upstream.arrived.get(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await asyncio.wait_for(upstream.cancelled.wait(), 10)
    await asyncio.wait_for(proxy.state.idle.wait(), 10)
    assert proxy.state.in_flight == 0


async def test_websocket_upgrade_refused(proxy: Proxy) -> None:
    async with aiohttp.ClientSession() as client:
        with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
            await client.ws_connect(proxy.url + "/ws")
    assert caught.value.status == 501


async def test_allow_paths(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_ALLOW_PATHS="/v1/chat/,/v1/models")
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/pause") as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "path_not_allowed"
        async with client.get(proxy.url + "/v1/models") as response:
            assert response.status == 200
    assert [s.path for s in upstream.seen] == ["/v1/models"]


async def test_admin_endpoints(upstream: Upstream, proxy: Proxy) -> None:
    async with aiohttp.ClientSession() as client:
        async with client.get(proxy.url + "/mmgate/health") as response:
            assert response.status == 200
        async with client.get(proxy.url + "/mmgate/ready") as response:
            assert response.status == 200
        async with client.get(proxy.url + "/v1/models") as response:
            assert response.status == 200
        async with client.get(proxy.url + "/mmgate/metrics") as response:
            text = await response.text()
    assert 'mmgate_requests_total{code="200",kind="text",route="other"} 1.0' in text
    assert "mmgate_request_duration_seconds_bucket" in text
    assert "process_resident_memory_bytes" in text
    assert [s.path for s in upstream.seen] == ["/v1/models"]  # admin paths are answered locally
    assert upstream.checks >= 1  # readiness asked the upstream's health path (the start-up check's answer, or its own)


async def test_admin_port_keeps_admin_off_the_public_port(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_ADMIN_PORT="1")  # the in-test app skips the admin site
    async with aiohttp.ClientSession() as client, client.get(proxy.url + "/mmgate/metrics") as response:
        assert response.status == 404
    assert upstream.seen == []


async def test_compressed_body_passes_through_untouched(upstream: Upstream, proxy: Proxy) -> None:
    import gzip

    body = gzip.compress(b'{"input": "plain text"}')
    async with aiohttp.ClientSession() as client, client.post(proxy.url + "/v1/embeddings", data=body,
                           headers={"Content-Encoding": "gzip"}) as response:
        assert response.status == 200
    seen = upstream.seen[-1]
    assert seen.body == body and seen.headers["Content-Encoding"] == "gzip"

