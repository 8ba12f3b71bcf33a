"""No input answers 5xx: declared media types are checked against the bytes, nesting is bounded, a fault of
mmgate's own is a 500 with a code and the request id (never a traceback), and every refusal tells the
client's SDK whether a retry can help."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import anthropic
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from preprocessors.errors import REGISTRY, UpstreamError
from proxy.app import build_admin_app
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from tests.conftest import Proxy, StartProxy, Upstream

PNG = image_bytes(16, 16, "PNG")
JPEG = image_bytes(16, 16, "JPEG")


async def _post(proxy: Proxy, path: str, body: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
    async with aiohttp.ClientSession() as client:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with client.post(proxy.url + path, data=raw,
                               headers={"Content-Type": "application/json"}) as response:
            return response.status, dict(response.headers), await response.json()


@pytest.mark.parametrize("declared", ["text/plain", "application/json", "audio/wav", "image"])
async def test_a_data_uri_declared_as_another_kind_is_refused(
    upstream: Upstream, proxy: Proxy, declared: str
) -> None:
    """A PNG declared text/plain used to be decoded and forwarded as an image."""
    status, headers, body = await _post(proxy, "/v1/chat/completions", chat_with_image(data_uri(PNG, declared)))
    assert status == 400 and headers["x-should-retry"] == "false"
    assert body["error"]["code"] == "invalid_media_type"
    assert body["error"]["param"] == "messages[0].content[1]"
    assert upstream.seen == []


async def test_an_anthropic_source_declared_text_plain_is_refused(upstream: Upstream, proxy: Proxy) -> None:
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    source = {"type": "base64", "media_type": "text/plain", "data": base64.b64encode(PNG).decode()}
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [  # type: ignore[misc, list-item]
            {"type": "image", "source": source}]}])
    assert "invalid_media_type" in str(info.value)
    assert upstream.seen == []


async def test_a_data_uri_with_the_wrong_image_type_is_forwarded_with_the_true_one(
    upstream: Upstream, proxy: Proxy
) -> None:
    sent = chat_with_image(data_uri(PNG, "image/jpeg"))
    status, _headers, _body = await _post(proxy, "/v1/chat/completions", sent)
    assert status == 200
    forwarded = json.loads((await upstream.arrived.get()).body)
    url = forwarded["messages"][0]["content"][1]["image_url"]["url"]
    assert url == data_uri(PNG, "image/png")  # the same bytes, the true type
    assert forwarded["messages"][0]["content"][0] == sent["messages"][0]["content"][0]
    assert proxy.state.metrics.media_type_corrected.labels("image")._value.get() == 1


async def test_an_escaped_data_uri_with_the_wrong_type_is_corrected_too(upstream: Upstream, proxy: Proxy) -> None:
    uri = data_uri(JPEG, "image/png").replace("/", "\\/")  # JSON escapes: the token is rewritten whole
    raw = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "'
    raw += uri.encode() + b'"}}]}]}'
    async with aiohttp.ClientSession() as client, client.post(proxy.url + "/v1/chat/completions", data=raw,
                           headers={"Content-Type": "application/json"}) as response:
        assert response.status == 200
    forwarded = json.loads((await upstream.arrived.get()).body)
    assert forwarded["messages"][0]["content"][0]["image_url"]["url"] == data_uri(JPEG, "image/jpeg")


async def test_an_anthropic_media_type_that_is_wrong_is_corrected(upstream: Upstream, proxy: Proxy) -> None:
    source = {"type": "base64", "media_type": "image/gif", "data": base64.b64encode(JPEG).decode()}
    status, _h, _b = await _post(proxy, "/v1/messages", {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source}]}]})
    assert status == 200
    forwarded = json.loads((await upstream.arrived.get()).body)
    got = forwarded["messages"][0]["content"][0]["source"]
    assert got == {**source, "media_type": "image/jpeg"}


async def test_an_undeclared_or_matching_type_is_forwarded_untouched(upstream: Upstream, proxy: Proxy) -> None:
    for uri in (data_uri(PNG, "image/png"), data_uri(PNG, ""), data_uri(PNG, "Image/PNG")):
        raw = json.dumps(chat_with_image(uri)).encode()
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + "/v1/chat/completions", data=raw) as response:
                assert response.status == 200
        assert (await upstream.arrived.get()).body == raw
    assert proxy.state.metrics.media_type_corrected.labels("image")._value.get() == 0


async def test_a_generic_octet_stream_data_uri_is_forwarded_with_the_true_type(upstream: Upstream,
                                                                              proxy: Proxy) -> None:
    body = chat_with_image(data_uri(PNG, "application/octet-stream"))
    status, _h, _b = await _post(proxy, "/v1/chat/completions", body)
    assert status == 200
    forwarded = json.loads((await upstream.arrived.get()).body)
    assert forwarded["messages"][0]["content"][1]["image_url"]["url"] == data_uri(PNG, "image/png")


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


async def test_deeply_nested_generate_media_is_400_not_500(upstream: Upstream, proxy: Proxy) -> None:
    """About a thousand levels used to raise RecursionError in the walker: a 500 and a traceback."""
    leaf = b'"' + base64.b64encode(PNG) + b'"'
    body = b'{"text": "hi", "image_data": ' + b"[" * 1000 + leaf + b"]" * 1000 + b"}"  # json.dumps cannot
    status, headers, answer = await _post(proxy, "/generate", body)
    assert status == 400 and headers["x-should-retry"] == "false"
    assert answer["error"]["code"] == "json_too_deep"
    assert upstream.seen == []


async def test_deeply_nested_anthropic_tool_results_are_400(upstream: Upstream, proxy: Proxy) -> None:
    block: dict[str, Any] = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                          "data": base64.b64encode(PNG).decode()}}
    for _ in range(400):
        block = {"type": "tool_result", "tool_use_id": "t", "content": [block]}
    status, _h, answer = await _post(proxy, "/v1/messages", {"model": "m", "max_tokens": 8,
                                                            "messages": [{"role": "user", "content": [block]}]})
    assert status == 400 and answer["type"] == "error"
    assert "json_too_deep" in answer["error"]["message"]


async def test_nesting_within_the_limit_is_walked(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_JSON_DEPTH="16", MMGATE_RESIZE_MAX_SIDE="8")
    status, _h, _b = await _post(proxy, "/generate", {"image_data": _nested(10, base64.b64encode(PNG).decode())})
    assert status == 200
    forwarded = json.loads((await upstream.arrived.get()).body)
    leaf = forwarded["image_data"]
    for _ in range(10):
        [leaf] = leaf
    assert leaf != base64.b64encode(PNG).decode()  # found and resized at depth 11
    status, _h, answer = await _post(proxy, "/generate", {"image_data": _nested(20, "x")})
    assert (status, answer["error"]["code"]) == (400, "json_too_deep")


async def test_a_fault_of_the_proxy_is_a_500_with_code_and_request_id(
    upstream: Upstream, proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """A real fault, not a mock: the upstream client session is closed under the proxy's feet."""
    assert proxy.state.session is not None
    await proxy.state.session.close()
    with caplog.at_level(logging.ERROR, logger="mmgate.access"):
        async with aiohttp.ClientSession() as client:
            async with client.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": []},
                                   headers={"X-Request-Id": "fault-1"}) as response:
                status, text = response.status, await response.text()
                request_id = response.headers["X-Request-Id"]
    assert status == 500 and request_id == "fault-1"
    error = json.loads(text)["error"]
    assert error["code"] == "internal_error" and "fault-1" in error["message"]
    assert "Traceback" not in text
    faults = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(faults) == 1 and faults[0].exc_info is not None  # logged once, with its traceback
    assert proxy.state.metrics.requests.labels("chat", "text", "500")._value.get() == 1  # its real status


async def test_refusals_say_whether_a_retry_can_help(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_BODY_MB="1")
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/chat/completions", data=b"x" * (2 << 20)) as response:
            assert response.status == 413 and response.headers["x-should-retry"] == "false"
        async with client.post(proxy.url + "/v1/chat/completions", data=b"{}",
                               headers={"Content-Encoding": "gzip"}) as response:
            assert response.status == 415 and response.headers["x-should-retry"] == "false"
        async with client.post(proxy.url + "/v1/chat/completions", data=b"{}",
                               headers={"X-MMGate-Timeout": "soon"}) as response:
            assert response.status == 400 and response.headers["x-should-retry"] == "false"
    proxy.state.lifecycle.start_draining()  # what SIGTERM's drain does
    async with aiohttp.ClientSession() as client, client.get(proxy.url + "/v1/models") as response:
        assert response.status == 503 and 1 <= int(response.headers["Retry-After"]) <= 120
        assert "x-should-retry" not in response.headers


async def test_a_declared_type_that_is_not_a_media_type_token_is_refused(upstream: Upstream, proxy: Proxy) -> None:
    """Found by the fuzzer: ``image/\\ud800`` passed a prefix check and failed to encode in the worker (500)."""
    data = base64.b64encode(PNG)
    for media_type in (b'"image/\\ud800"', b'"image/png; x=\\"1\\""', b'"image/"'):
        raw = (b'{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", '
               b'"source": {"type": "base64", "media_type": ' + media_type + b', "data": "' + data + b'"}}]}]}')
        status, _h, answer = await _post(proxy, "/v1/messages", raw)
        assert status == 400 and "invalid_media_type" in answer["error"]["message"], media_type
    assert upstream.seen == []


async def test_an_anthropic_media_type_with_spaces_is_refused(upstream: Upstream, proxy: Proxy) -> None:
    """Found by the fuzzer: " image/png " was accepted, and a re-encoded image left it naming the old format."""
    source = {"type": "base64", "media_type": " image/png ", "data": base64.b64encode(PNG).decode()}
    status, _h, answer = await _post(proxy, "/v1/messages", {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source}]}]})
    assert status == 400 and "invalid_media_type" in answer["error"]["message"]


async def test_the_admin_port_refuses_in_the_api_shape_too(
    upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """And each of its refusals is counted and logged under its code, like the main port's."""
    proxy = await start_proxy(upstream.url, MMGATE_ADMIN_PORT="1", MMGATE_ACCESS_LOG="on")
    caplog.set_level(logging.INFO, logger="mmgate.access")
    admin = TestServer(build_admin_app(proxy.state), host="127.0.0.1")
    await admin.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            async with client.get(f"http://127.0.0.1:{admin.port}/v1/models") as response:
                assert response.status == 404
                assert (await response.json())["error"]["code"] == "path_not_allowed"
            async with client.get(f"http://127.0.0.1:{admin.port}/mmgate/health") as response:
                assert response.status == 200
            async with client.delete(f"http://127.0.0.1:{admin.port}/mmgate/health") as response:
                assert response.status == 405
                assert (await response.json())["error"]["code"] == "invalid_request"
    finally:
        await admin.close()
    rejected = proxy.state.metrics.rejected
    assert [rejected.labels(code)._value.get() for code in ("path_not_allowed", "invalid_request")] == [1, 1]
    lines = [r.fields for r in caplog.records if r.name == "mmgate.access"]  # type: ignore[attr-defined]
    assert [(line["method"], line["path"], line["status"], line["code"], line["answered_by"]) for line in lines] == [
        ("GET", "/v1/models", 404, "path_not_allowed", "mmgate"),
        ("DELETE", "/mmgate/health", 405, "invalid_request", "mmgate")]


# --- every refusal of mmgate's own is counted and logged under its code ---------------------------------------

CHAT = "/v1/chat/completions"


def _image_request(uri: str, **extra: Any) -> bytes:
    return json.dumps(chat_with_image(uri, **extra)).encode()


def _raw_post(body: bytes, path: str = CHAT, headers: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: mmgate\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), headers, body))


IMAGE_REQUEST = _raw_post(_image_request(data_uri(PNG)))
TWO_IMAGES = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": data_uri(PNG)}},
    {"type": "image_url", "image_url": {"url": data_uri(PNG)}}]}]}).encode()


async def _stall(upstream: Upstream, request: web.Request) -> web.Response:
    """The backend takes the request and says nothing until the test ends."""
    await upstream.release.wait()
    return web.Response(text="late")


async def _hang_up(upstream: Upstream, request: web.Request) -> web.Response:
    """The backend takes the request and closes the connection without an answer."""
    assert request.transport is not None
    request.transport.close()
    await upstream.release.wait()
    return web.Response(text="never sent")


@dataclass(frozen=True)
class Trigger:
    """A request that makes mmgate refuse with one code: the settings, the raw bytes sent (the connection is then
    read to its end, the client sending nothing more), whether the upstream goes away first, and how the
    backend handles what is forwarded to it."""

    env: dict[str, str]
    sent: bytes
    upstream_gone: bool = False
    backend: Callable[[Upstream, web.Request], Awaitable[web.StreamResponse]] | None = None
    held: bytes = b""  # sent first on a connection of its own, and in the backend's hands (stalled) before ``sent``


TRIGGERS: dict[tuple[int, str], Trigger] = {
    (400, "invalid_request"): Trigger({}, _raw_post(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": 5}]}]}).encode())),
    (400, "json_too_deep"): Trigger({}, _raw_post(json.dumps({"image_data": _nested(200, "x")}).encode(), "/generate")),
    (400, "unsupported_media_type"): Trigger({}, _raw_post(_image_request(data_uri(b"plain words, no image")))),
    (400, "invalid_json"): Trigger({}, _raw_post(b'{"messages": [{"content": "image_url')),
    (400, "invalid_path"): Trigger({}, b"GET /v1/a%2Fb HTTP/1.1\r\nHost: mmgate\r\n\r\n"),
    (400, "invalid_base64"): Trigger({}, _raw_post(_image_request("data:image/png;base64,@@@@"))),
    (400, "invalid_media_type"): Trigger({}, _raw_post(_image_request(data_uri(PNG, "text/plain")))),
    (400, "image_too_large"): Trigger({"MMGATE_MAX_IMAGE_PIXELS": "100"}, IMAGE_REQUEST),
    (400, "too_many_media"): Trigger({"MMGATE_MAX_MEDIA_PER_REQUEST": "1"}, _raw_post(TWO_IMAGES)),
    (400, "media_url_not_allowed"): Trigger({"MMGATE_MEDIA_URLS": "reject"},
                                            _raw_post(_image_request("http://images.example/a.png"))),
    (400, "media_url_scheme_not_allowed"): Trigger({}, _raw_post(_image_request("ftp://images.example/a.png"))),
    (400, "invalid_timeout_header"): Trigger({}, _raw_post(b"{}", headers=b"X-MMGate-Timeout: soon\r\n")),
    (404, "path_not_allowed"): Trigger({"MMGATE_ALLOW_PATHS": "/v1/"}, b"GET /admin HTTP/1.1\r\nHost: mmgate\r\n\r\n"),
    (408, "header_timeout"): Trigger({"MMGATE_HEADER_TIMEOUT": "0.2"}, b"GET /v1/models HTTP/1.1\r\nHost: mm"),
    (408, "body_read_timeout"): Trigger(
        {"MMGATE_BODY_READ_TIMEOUT": "0.2"},
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nContent-Length: 100\r\n\r\n{\"model\""),
    (413, "body_too_large"): Trigger(
        {"MMGATE_MAX_BODY_MB": "1"}, b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nContent-Length: %d\r\n\r\n"
        % (2 << 20)),
    (415, "unsupported_content_encoding"): Trigger({}, _raw_post(b"{}", headers=b"Content-Encoding: gzip\r\n")),
    (417, "expectation_failed"): Trigger({}, _raw_post(b"{}", headers=b"Expect: 200-ok\r\n")),
    (501, "websocket_not_supported"): Trigger(
        {}, b"GET /v1/realtime HTTP/1.1\r\nHost: mmgate\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"),
    (503, "upstream_down"): Trigger({}, _raw_post(b'{"model": "m", "messages": []}'), upstream_gone=True),
    (502, "upstream_reset"): Trigger({}, _raw_post(b'{"model": "m", "messages": []}'), backend=_hang_up),
    (504, "upstream_timeout"): Trigger({"MMGATE_UPSTREAM_READ_TIMEOUT": "0.2"}, _raw_post(b'{"model": "m"}'),
                                       backend=_stall),
    (429, "queue_full"): Trigger({"MMGATE_MAX_MM_CONCURRENCY": "1", "MMGATE_MAX_QUEUE": "0",
                                  "MMGATE_RELEASE_AT": "complete"}, IMAGE_REQUEST, backend=_stall, held=IMAGE_REQUEST),
    (503, "too_many_connections"): Trigger({"MMGATE_MAX_CONNECTIONS": "1"}, _raw_post(b'{"model": "m"}'),
                                           backend=_stall, held=_raw_post(b'{"model": "m"}')),
    (504, "request_timeout"): Trigger({"MMGATE_REQUEST_TIMEOUT": "0.2"}, _raw_post(b'{"model": "m"}'), backend=_stall),
}

# Codes whose trigger needs a setup of its own (a held gate, a killed worker, SIGTERM, a fetch server, a model):
# where each is answered, and the test that makes it. Every one of them is raised inside ``handle_request`` and
# goes through ``pipeline._answer``, the one place a refusal is counted, before ``exchange.record`` logs it.
ELSEWHERE: dict[tuple[int, str], str] = {
    (400, "incomplete_body"): "edge/body.py read_body: a guard aiohttp never lets through (a body cut short ends "
                              "the connection inside aiohttp first): no request reaches it",
    (400, "json_too_complex"): "tests/proxy/payload/test_locate.py: MMGATE_MAX_JSON_STRUCTURE_KB",
    (400, "invalid_data_uri"): "tests/proxy/payload: the walkers' data URI checks",
    (400, "image_decode_failed"): "tests/preprocessors: MMGATE_VALIDATE=full",
    (400, "image_truncated"): "tests/preprocessors: the image-end check",
    (400, "too_many_frames"): "tests/preprocessors: MMGATE_MAX_FRAMES",
    (400, "audio_invalid"): "tests/preprocessors: audio checks",
    (400, "invalid_priority_header"): "tests/proxy/admission: a trusted peer's priority header",
    (400, "invalid_flow_header"): "tests/proxy/admission: a trusted peer's fairness header",
    (400, "image_unsupported_by_model"): "tests/proxy/media: MMGATE_MODEL",
    (400, "video_unsupported_by_model"): "tests/proxy/media: MMGATE_MODEL",
    (400, "decoder_crashed"): "tests/preprocessors: a worker that dies on an item",
    (400, "video_invalid"): "tests/preprocessors: the video probe",
    (400, "video_too_large"): "tests/preprocessors: the video probe",
    (400, "video_unavailable"): "tests/preprocessors/test_video.py: without PyAV",
    (400, "fetch_url_not_allowed"): "tests/proxy/fetch: MMGATE_MEDIA_URLS=fetch",
    (400, "fetch_host_not_allowed"): "tests/proxy/fetch",
    (400, "fetch_address_forbidden"): "tests/proxy/fetch",
    (400, "fetch_too_many_redirects"): "tests/proxy/fetch",
    (400, "fetch_too_large"): "tests/proxy/fetch",
    (400, "fetch_timeout"): "tests/proxy/fetch",
    (400, "fetch_bad_content_type"): "tests/proxy/fetch",
    (400, "fetch_failed"): "tests/proxy/fetch",
    (405, "invalid_request"): "test_refusals.py: the admin port's refusals, counted and logged",
    (413, "media_too_large"): "tests/proxy/media: MMGATE_MAX_MEDIA_ITEM_MB",
    (413, "too_many_image_tokens"): "tests/proxy/media: MMGATE_MAX_INFLIGHT_IMAGE_TOKENS",
    (429, "queue_timeout"): "tests/proxy/admission: a held gate",
    (500, "internal_error"): "tests/preprocessors/test_errors.py: a fault in the pipeline",
    (503, "draining"): "tests/proxy/serve: SIGTERM",
    (503, "gate_unavailable"): "tests/proxy/processes: a supervisor that does not answer",
    (503, "local_resources_exhausted"): "tests/proxy/runtime/test_fd_limit.py: EMFILE on the upstream connect",
    (503, "decoder_unavailable"): "tests/preprocessors: two workers killed on one item",
    (504, "preprocess_timeout"): "tests/proxy/edge/test_buffers.py: MMGATE_PREPROCESS_TIMEOUT",
}


def test_every_code_of_the_registry_has_a_trigger_here_or_a_named_test_elsewhere() -> None:
    assert not set(TRIGGERS) & set(ELSEWHERE)
    assert sorted(set(REGISTRY) - set(TRIGGERS) - set(ELSEWHERE)) == []
    assert sorted((set(TRIGGERS) | set(ELSEWHERE)) - set(REGISTRY)) == []


@pytest.mark.parametrize(("status", "code"), list(TRIGGERS), ids=[code for _, code in TRIGGERS])
async def test_each_refusal_is_answered_counted_and_logged_under_its_code(
    upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture, status: int, code: str
) -> None:
    trigger = TRIGGERS[status, code]
    if (backend := trigger.backend) is not None:
        upstream.route(CHAT, lambda request: backend(upstream, request))
    proxy = await start_proxy(upstream.url, MMGATE_ACCESS_LOG="on", **trigger.env)
    if trigger.upstream_gone:
        await eventually(lambda: proxy.state.ready_cache[0] > 0, "the start-up check")
        assert upstream.server is not None
        await upstream.server.close()
    caplog.set_level(logging.INFO, logger="mmgate.access")
    if trigger.held:
        _held_reader, held_writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        held_writer.write(trigger.held)
        await asyncio.wait_for(upstream.arrived.get(), 10)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(trigger.sent)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), head
    length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)[1])  # type: ignore[index]
    answer = json.loads(await reader.readexactly(length))
    writer.close()
    assert code in (answer["error"]["code"], answer["error"].get("type"))

    metrics = proxy.state.metrics
    if REGISTRY[status, code].raised_as is UpstreamError:
        kind = REGISTRY[status, code].error("").kind
        assert metrics.upstream_errors.labels(kind)._value.get() == 1
    else:
        await eventually(lambda: metrics.rejected.labels(code)._value.get() == 1, "the refusal counted")
    await eventually(lambda: any(getattr(r, "fields", {}).get("code") == code for r in caplog.records
                                 if r.name == "mmgate.access"), "its access-log line")
    [line] = [r.fields for r in caplog.records if r.name == "mmgate.access"]  # type: ignore[attr-defined]
    assert (line["status"], line["code"], line["answered_by"]) == (status, code, "mmgate")
