"""The allowlist cannot be walked around: the path is normalised once, matched on segment boundaries, and
exactly the checked path is what the upstream receives."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from yarl import URL

from preprocessors.errors import MmgateError
from proxy.edge.paths import is_allowed, normalise_target, remove_dot_segments
from tests.conftest import StartProxy, Upstream

# RFC 3986 section 5.2.4 (and the dot-segment cases of 5.4.2), for absolute paths.
RFC_DOT_SEGMENTS = [
    ("/a/b/c/./../../g", "/a/g"),
    ("/b/c/./g/.", "/b/c/g/"),
    ("/b/c/.", "/b/c/"),
    ("/b/c/..", "/b/"),
    ("/..", "/"),
    ("/../g", "/g"),
    ("/../../g", "/g"),
    ("/./g", "/g"),
    ("/g.", "/g."),
    ("/.g", "/.g"),
    ("/g..", "/g.."),
    ("/..g", "/..g"),
    ("/b/c/./../g", "/b/g"),
    ("/b/c/g/./h", "/b/c/g/h"),
    ("/b/c/g/../h", "/b/c/h"),
    ("/b/c/g;x=1/./y", "/b/c/g;x=1/y"),
    ("/b/c/g;x=1/../y", "/b/c/y"),
]


@pytest.mark.parametrize(("path", "expected"), RFC_DOT_SEGMENTS)
def test_rfc3986_dot_segment_examples(path: str, expected: str) -> None:
    assert remove_dot_segments(path) == expected
    assert normalise_target(path).path == expected


# (raw target as sent, the path forwarded) for targets that normalise safely.
NORMALISED = [
    ("/v1/models", "/v1/models"),
    ("/v1/models/../../admin", "/admin"),  # literal dot-segments
    ("/v1/models/%2e%2e/%2E%2E/admin", "/admin"),  # encoded dots are dots (unreserved, RFC 3986 6.2.2.2)
    ("/v1/models/.%2e/x", "/v1/x"),
    ("/v1//models", "/v1/models"),  # merge_slashes
    ("//v1///chat/completions", "/v1/chat/completions"),
    ("/v1/mod%65ls", "/v1/models"),  # encoded unreserved letters are decoded
    ("/v1/a%3fb", "/v1/a%3Fb"),  # other encodings stay encoded, upper-case hex
    ("/v1/caf\u00e9", "/v1/caf%C3%A9"),  # a URI is ASCII
    ("/v1/models?x=../../admin", "/v1/models"),  # the query is not a path
    ("http://evil.example/admin?x=1", "/admin"),  # absolute-form: authority ignored (RFC 9112 3.2.2)
    ("HTTPS://evil.example", "/"),
]


@pytest.mark.parametrize(("raw", "expected"), NORMALISED)
def test_targets_normalise_to_the_path_that_is_forwarded(raw: str, expected: str) -> None:
    assert normalise_target(raw).path == expected


REFUSED = [
    "/v1/models%2f..%2fadmin",  # encoded slash: backends disagree on it
    "/v1/models%2F",
    "/v1/models%5c..%5cadmin",  # encoded backslash
    "/v1/models\\..\\admin",  # literal backslash (some servers read it as /)
    "/v1/models%00",  # NUL, encoded
    "/v1/mo\x00dels",  # NUL, raw
    "/v1/mo\x1bdels",  # control character
    "/v1/models%0a",
    "/v1/models%zz",  # malformed percent-encoding
    "/v1/models%2",
    "/v1/models#frag",  # a fragment is never sent in a request target
    "*",  # asterisk-form
    "evil.example:443",  # authority-form (CONNECT)
    "ftp://evil.example/x",  # absolute-form, not http(s)
]


@pytest.mark.parametrize("raw", REFUSED)
def test_unsafe_targets_are_refused_with_invalid_path(raw: str) -> None:
    with pytest.raises(MmgateError) as info:
        normalise_target(raw)
    assert (info.value.status, info.value.code) == (400, "invalid_path")


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/v1/models", True),
        ("/v1/models/abc", True),
        ("/v1/modelsanything", False),  # no segment boundary
        ("/v1/models;x", False),
        ("/v1/chat/completions", True),
        ("/v1/chat/completionsX", False),
        ("/v1", False),
        ("/admin", False),
        ("/", False),
    ],
)
def test_prefixes_match_on_segment_boundaries(path: str, allowed: bool) -> None:
    assert is_allowed(path, ("/v1/models", "/v1/chat/completions")) is allowed


def test_a_prefix_with_a_trailing_slash_and_the_root_prefix() -> None:
    assert is_allowed("/v1/x", ("/v1/",)) and is_allowed("/v1", ("/v1/",)) and not is_allowed("/v2", ("/v1/",))
    assert is_allowed("/anything", ("/",))
    assert is_allowed("/anything", ())  # no allowlist: everything


async def _raw_request(port: int, target: bytes) -> tuple[int, bytes]:
    """Send ``target`` exactly as given (no client-side normalisation) and return status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET " + target + b" HTTP/1.1\r\nHost: mmgate\r\nConnection: close\r\n\r\n")
    await writer.drain()
    answer = await reader.read()
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


WALK_AROUNDS = [
    b"/v1/modelsanything",
    b"/v1/models/../../admin",
    b"/v1/models/%2e%2e/%2e%2e/pause",
    b"/v1/models/%2E%2E/%2E%2E/collective_rpc",
    b"/v1/models%2f..%2f..%2fadmin",
    b"/v1/models/..%2f..%2fadmin",
    b"/v1/models\\..\\..\\admin",
    b"/v1//models/../../admin",
    b"http://127.0.0.1/admin",
]


@pytest.mark.parametrize("target", WALK_AROUNDS)
async def test_allowlist_cannot_be_walked_around(upstream: Upstream, start_proxy: StartProxy, target: bytes) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_ALLOW_PATHS="/v1/models,/v1/chat/completions")
    status, body = await _raw_request(proxy.server.port, target)
    assert status in (400, 404), body
    assert upstream.seen == []  # nothing reached the upstream
    assert b'"code":"path_not_allowed"' in body or b'"code":"invalid_path"' in body


async def test_the_checked_path_is_what_the_upstream_receives(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_ALLOW_PATHS="/v1/models")
    for target, forwarded in [
        (b"/v1//models/./x/../y?q=%2e%2e/a", "/v1/models/y?q=%2e%2e/a"),
        (b"/v1/mod%65ls", "/v1/models"),
        (b"http://other.example/v1/models?a=1", "/v1/models?a=1"),
    ]:
        status, _body = await _raw_request(proxy.server.port, target)
        assert status == 200
        seen = await upstream.arrived.get()
        assert seen.path == forwarded


async def test_absolute_form_target_is_reduced_to_its_path(upstream: Upstream, start_proxy: StartProxy) -> None:
    """It used to be joined to the upstream URL as text: yarl raised and the client got a 500."""
    proxy = await start_proxy(upstream.url)
    status, body = await _raw_request(proxy.server.port, b"http://example.invalid:9/v1/models?limit=2")
    assert status == 200, body
    assert (await upstream.arrived.get()).path == "/v1/models?limit=2"


async def test_invalid_path_is_a_400_in_the_api_shape(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url)
    async with aiohttp.ClientSession() as client:
        url = URL(proxy.url + "/v1/chat%2fcompletions", encoded=True)
        async with client.post(url, json={"model": "m", "messages": []}) as response:
            assert response.status == 400
            assert response.headers["x-should-retry"] == "false"
            error = (await response.json())["error"]
    assert error["code"] == "invalid_path" and error["type"] == "invalid_request_error"
    assert upstream.seen == []


async def test_media_route_is_recognised_after_normalisation(upstream: Upstream, start_proxy: StartProxy) -> None:
    """``/v1//chat/completions`` reaches the upstream as the chat route: its media must take the gate too."""
    proxy = await start_proxy(upstream.url)
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}]}
    async with aiohttp.ClientSession() as client:
        url = URL(proxy.url + "/v1//chat/./completions", encoded=True)
        async with client.post(url, json=body) as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == "unsupported_media_type"
    assert upstream.seen == []


async def test_a_target_the_router_cannot_match_is_refused_in_the_api_shape(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """An absolute-form target with no path at all never reaches the request handler."""
    proxy = await start_proxy(upstream.url)
    status, body = await _raw_request(proxy.server.port, b"HTTP://example.invalid:1")
    assert status == 404
    assert json.loads(body)["error"]["code"] == "path_not_allowed"
    assert upstream.seen == []


async def test_an_encoded_line_break_is_an_invalid_path_not_a_missing_route(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url)
    status, body = await _raw_request(proxy.server.port, b"/v1/models%0aX-Injected:%201")
    assert status == 400
    assert json.loads(body)["error"]["code"] == "invalid_path"
    assert upstream.seen == []


async def test_a_path_cannot_write_control_characters_into_the_text_log(
    upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_ACCESS_LOG="on")
    with caplog.at_level(logging.INFO, logger="mmgate.access"):
        status, _body = await _raw_request(proxy.server.port, b"/v1/%1b[31mred%1b[0m")
    assert status == 400
    [line] = [r.getMessage() for r in caplog.records if r.name == "mmgate.access"]
    assert "\x1b" not in line and "\\x1b[31mred" in line
