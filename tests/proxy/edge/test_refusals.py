"""No input answers 5xx: declared media types are checked against the bytes, nesting is bounded, a fault of
mmgate's own is a 500 with a code and the request id (never a traceback), and every refusal tells the
client's SDK whether a retry can help."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import aiohttp
import anthropic
import pytest
from aiohttp.test_utils import TestServer

from proxy.app import build_admin_app
from testkit.media import chat_with_image, data_uri, image_bytes
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


async def test_the_admin_port_refuses_in_the_api_shape_too(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_ADMIN_PORT="1")
    admin = TestServer(build_admin_app(proxy.state), host="127.0.0.1")
    await admin.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            async with client.get(f"http://127.0.0.1:{admin.port}/v1/models") as response:
                assert response.status == 404
                assert (await response.json())["error"]["code"] == "path_not_allowed"
            async with client.get(f"http://127.0.0.1:{admin.port}/mmgate/health") as response:
                assert response.status == 200
    finally:
        await admin.close()
