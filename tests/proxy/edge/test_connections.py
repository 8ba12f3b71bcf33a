"""Connections cost the client, not the proxy: the head has a deadline, open connections are capped, a body
refused for its size or slowness is not read on, and ``Expect: 100-continue`` is answered here. Raw sockets,
so every byte on the wire is the test's own."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import re
import socket
import sys
import termios
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.edge.connections import PROBE_RESERVE
from tests.conftest import Proxy, StartProxy, Upstream

MIB = 1 << 20


async def _connect(proxy: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.server.port)


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer with a Content-Length body: status, headers (lower-case names), body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def _sent_before_refused(writer: asyncio.StreamWriter, limit: int, chunk: bytes = bytes(64 << 10)) -> int:
    """Keep uploading ``chunk`` until the peer refuses it (reset or broken pipe); how many bytes went out."""
    sent = 0
    try:
        while sent < limit:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
    except (ConnectionResetError, BrokenPipeError):
        pass
    return sent


async def test_a_head_that_never_completes_gets_408_and_the_connection_closes(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_HEADER_TIMEOUT="0.3")
    reader, writer = await _connect(proxy)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nX-Slow: 1\r\n")  # the head never ends
    await writer.drain()
    status, headers, body = await _read_answer(reader)
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "header_timeout"
    assert await reader.read() == b""  # closed by the proxy
    writer.close()
    assert upstream.seen == []
    rejected = proxy.state.metrics.rejected.labels("header_timeout")._value.get()
    assert rejected == 1


async def test_a_connection_that_sends_nothing_is_closed_after_the_head_deadline(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_HEADER_TIMEOUT="0.3")
    reader, writer = await _connect(proxy)
    status, _headers, _body = await _read_answer(reader)
    assert status == 408
    assert await reader.read() == b""
    writer.close()


async def test_an_idle_keepalive_connection_is_not_cut_by_the_head_deadline(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """The head deadline runs from a request's first byte; between requests the keep-alive timeout rules."""
    proxy = await start_proxy(upstream.url, MMGATE_HEADER_TIMEOUT="0.2")
    reader, writer = await _connect(proxy)
    request = b"GET /v1/models HTTP/1.1\r\nHost: mmgate\r\n\r\n"
    writer.write(request)
    assert (await _read_answer(reader))[0] == 200
    await asyncio.sleep(0.6)  # three head deadlines of idleness: proving a negative takes time passing
    writer.write(request)
    assert (await _read_answer(reader))[0] == 200
    writer.close()


KEEPALIVE_REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: mmgate\r\n\r\n"
CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


async def _until(condition: Callable[[], bool]) -> None:
    """Yield to the loop (the proxy runs on it) until ``condition`` holds."""
    for _ in range(100_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def _idle_after_one_request(proxy: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await _connect(proxy)
    writer.write(KEEPALIVE_REQUEST)
    assert (await _read_answer(reader))[0] == 200
    return reader, writer


async def _mid_request(proxy: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose request is in the proxy's hands, its body half sent (the 100 Continue proves it)."""
    reader, writer = await _connect(proxy)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nExpect: 100-continue\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(CHAT_BODY))
    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(CHAT_BODY[:10])
    await writer.drain()
    return reader, writer


async def _finish_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    writer.write(CHAT_BODY[10:])
    status = (await _read_answer(reader))[0]
    writer.close()
    return status


def _idle_closed(proxy: Proxy) -> float:
    return float(proxy.state.metrics.idle_connections_closed._value.get())


async def test_at_the_cap_the_connection_idle_the_longest_makes_way_for_a_new_client(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="3")
    guard = proxy.state.connections
    held = [await _idle_after_one_request(proxy) for _ in range(3)]
    await _until(lambda: guard.idle == 3)

    reader, writer = await _connect(proxy)
    writer.write(KEEPALIVE_REQUEST)
    assert (await _read_answer(reader))[0] == 200
    assert await held[0][0].read() == b""  # the oldest idle one was closed, between its requests
    assert guard.open == 3 and _idle_closed(proxy) == 1
    for other_reader, other_writer in held[1:]:  # the others were left alone
        other_writer.write(KEEPALIVE_REQUEST)
        assert (await _read_answer(other_reader))[0] == 200
    for _, other in [*held, (reader, writer)]:
        other.close()
    assert proxy.state.metrics.rejected.labels("too_many_connections")._value.get() == 0


async def test_a_connection_in_the_middle_of_a_request_is_never_closed_to_make_room(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="2")
    guard = proxy.state.connections
    busy = await _mid_request(proxy)  # the older one, but busy
    idle_reader, idle_writer = await _idle_after_one_request(proxy)
    await _until(lambda: guard.idle == 1)

    reader, writer = await _connect(proxy)
    writer.write(KEEPALIVE_REQUEST)
    assert (await _read_answer(reader))[0] == 200
    assert await idle_reader.read() == b""
    assert await _finish_request(*busy) == 200
    writer.close()
    idle_writer.close()


@pytest.mark.parametrize(
    "first",
    [KEEPALIVE_REQUEST, b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(CHAT_BODY), CHAT_BODY)],
    ids=["after-a-get", "in-the-chunk-that-ends-a-body"],
)
async def test_a_connection_whose_next_request_began_is_not_idle(
    upstream: Upstream, start_proxy: StartProxy, first: bytes
) -> None:
    """A pipelined head that has begun to arrive is a request in progress: the connection is not closed for
    room, and the head deadline runs for it."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1", MMGATE_HEADER_TIMEOUT="0.5")
    reader, writer = await _connect(proxy)
    writer.write(first + b"GET /v1/mo")
    assert (await _read_answer(reader))[0] == 200

    other_reader, other_writer = await _connect(proxy)
    other_writer.write(KEEPALIVE_REQUEST)
    status, _headers, body = await _read_answer(other_reader)
    assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
    other_writer.close()
    status, _headers, body = await _read_answer(reader)  # the pipelined head never ended
    assert status == 408 and json.loads(body)["error"]["code"] == "header_timeout"
    writer.close()
    assert _idle_closed(proxy) == 0


async def test_a_pipelined_head_in_the_read_that_ends_a_body_is_seen(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1", MMGATE_HEADER_TIMEOUT="0.5")
    reader, writer = await _mid_request(proxy)  # the head is in the proxy's hands, the body half sent
    writer.write(CHAT_BODY[10:] + b"GET /v1/mo")
    assert (await _read_answer(reader))[0] == 200

    other_reader, other_writer = await _connect(proxy)
    other_writer.write(KEEPALIVE_REQUEST)
    assert (await _read_answer(other_reader))[0] == 503
    other_writer.close()
    status, _headers, body = await _read_answer(reader)
    assert status == 408 and json.loads(body)["error"]["code"] == "header_timeout"
    writer.close()


async def test_a_connection_quiet_after_its_refused_body_was_drained_makes_way(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """Refused before its body was read, the body arriving after the answer (aiohttp drains it and keeps the
    connection): once the body is in and the client is quiet, the connection is idle like any other."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1", MMGATE_ALLOW_PATHS="/v1/")
    guard = proxy.state.connections
    reader, writer = await _connect(proxy)
    writer.write(b"POST /admin HTTP/1.1\r\nHost: mmgate\r\nContent-Length: 10\r\n\r\n")
    status, headers, _body = await _read_answer(reader)
    assert status == 404 and headers.get("connection") != "close"
    writer.write(b"0123456789")  # the body, after the answer
    await _until(lambda: guard.idle == 1)

    other_reader, other_writer = await _connect(proxy)
    other_writer.write(KEEPALIVE_REQUEST)
    assert (await _read_answer(other_reader))[0] == 200
    assert await reader.read() == b""
    writer.close()
    other_writer.close()


async def test_a_silent_new_connection_makes_way_like_an_idle_one(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="2")
    guard = proxy.state.connections
    silent = [await _connect(proxy) for _ in range(2)]
    await _until(lambda: guard.idle == 2)
    reader, writer = await _connect(proxy)
    writer.write(KEEPALIVE_REQUEST)
    assert (await _read_answer(reader))[0] == 200
    assert await silent[0][0].read() == b""
    for _, other in [*silent, (reader, writer)]:
        other.close()


async def test_when_every_connection_is_busy_a_new_one_gets_a_complete_503(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="2")
    busy = [await _mid_request(proxy) for _ in range(2)]
    reader, writer = await _connect(proxy)
    writer.write(KEEPALIVE_REQUEST)
    status, headers, body = await _read_answer(reader)
    assert status == 503 and headers["connection"] == "close" and 1 <= int(headers["retry-after"]) <= 120
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert await reader.read() == b""
    writer.close()
    assert [await _finish_request(*conn) for conn in busy] == [200, 200]
    assert proxy.state.metrics.rejected.labels("too_many_connections")._value.get() == 1
    assert _idle_closed(proxy) == 0


@pytest.mark.parametrize("path", ["/mmgate/health", "/mmgate/ready"])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_liveness_and_readiness_answer_on_the_main_port_while_every_connection_is_busy(
    upstream: Upstream, start_proxy: StartProxy, path: str, method: str
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="2")
    busy = [await _mid_request(proxy) for _ in range(2)]
    for _ in range(2):  # one after the other: a probe's place over the cap is given back
        reader, writer = await _connect(proxy)
        writer.write(b"%s %s HTTP/1.1\r\nHost: mmgate\r\nUser-Agent: kube-probe\r\n\r\n"
                     % (method.encode(), path.encode()))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in head
        rest = await reader.read()
        assert rest == b"" if method == "HEAD" else json.loads(rest)
        writer.close()
        await _until(lambda: proxy.state.connections.over_the_cap == 0)
    assert [await _finish_request(*conn) for conn in busy] == [200, 200]


async def test_the_docker_healthcheck_passes_while_every_connection_is_busy(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """The Dockerfile's own HEALTHCHECK command, run as Docker runs it (no admin port: the main port)."""
    dockerfile = (Path(__file__).parents[3] / "deploy" / "Dockerfile").read_text()
    command = json.loads(re.search(r"^\s*CMD (\[.*\])\s*$", dockerfile.split("HEALTHCHECK", 1)[1], re.M)[1])  # type: ignore[index]
    assert command[0] == "python"
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="2")
    busy = [await _mid_request(proxy) for _ in range(2)]
    env = {**os.environ, "MMGATE_PORT": str(proxy.server.port)}
    env.pop("MMGATE_ADMIN_PORT", None)
    check = await asyncio.create_subprocess_exec(sys.executable, *command[1:], env=env,
                                                 stderr=asyncio.subprocess.PIPE)
    _out, err = await check.communicate()
    assert check.returncode == 0, err.decode()
    assert [await _finish_request(*conn) for conn in busy] == [200, 200]


async def test_over_the_cap_a_probe_path_does_not_reach_the_upstream_without_admin_routes(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """With MMGATE_ADMIN_PORT, /mmgate/* is not served on the main port: over the cap it is a 503 like any path."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1", MMGATE_ADMIN_PORT="1")
    busy = await _mid_request(proxy)
    reader, writer = await _connect(proxy)
    writer.write(b"GET /mmgate/health HTTP/1.1\r\nHost: mmgate\r\n\r\n")
    status, _headers, body = await _read_answer(reader)
    assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
    assert await reader.read() == b""
    writer.close()
    assert await _finish_request(*busy) == 200
    assert [seen.path for seen in upstream.seen] == ["/v1/chat/completions"]


async def test_over_the_cap_half_a_request_line_is_closed_at_the_head_deadline(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1", MMGATE_HEADER_TIMEOUT="0.3")
    busy = await _mid_request(proxy)
    reader, writer = await _connect(proxy)
    writer.write(b"GET /mmgate/hea")
    status, headers, body = await _read_answer(reader)
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "header_timeout"
    assert await reader.read() == b""
    writer.close()
    assert await _finish_request(*busy) == 200


async def test_over_the_cap_a_probe_whose_head_never_ends_is_closed_at_the_head_deadline(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1", MMGATE_HEADER_TIMEOUT="0.3")
    busy = await _mid_request(proxy)
    reader, writer = await _connect(proxy)
    writer.write(b"GET /mmgate/health HTTP/1.1\r\nHost: mmgate\r\n")  # the head never ends
    status, _headers, body = await _read_answer(reader)
    assert status == 408 and json.loads(body)["error"]["code"] == "header_timeout"
    assert await reader.read() == b""
    writer.close()
    assert await _finish_request(*busy) == 200


async def test_over_the_cap_a_long_line_that_is_no_probe_gets_503(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1")
    busy = await _mid_request(proxy)
    reader, writer = await _connect(proxy)
    writer.write(b"GET /" + b"a" * 4096)  # no line end within what a probe's request line takes
    status, _headers, body = await _read_answer(reader)
    assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
    writer.close()
    assert await _finish_request(*busy) == 200


async def test_over_the_cap_a_probe_with_a_body_is_refused_and_the_body_not_read(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1")
    busy = await _mid_request(proxy)
    reader, writer = await _connect(proxy)
    writer.write(b"GET /mmgate/health HTTP/1.1\r\nHost: mmgate\r\nContent-Length: %d\r\n\r\n" % (512 * MIB)
                 + bytes(64 << 10))
    status, headers, body = await _read_answer(reader)
    assert status == 503 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert await _sent_before_refused(writer, 256 * MIB) < 64 * MIB
    writer.close()
    assert await _finish_request(*busy) == 200


async def test_connections_over_the_cap_are_bounded_and_the_oldest_silent_one_makes_way_for_a_probe(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1")
    guard = proxy.state.connections
    busy = await _mid_request(proxy)
    silent = []
    for count in range(1, PROBE_RESERVE + 1):
        silent.append(await _connect(proxy))
        await _until(lambda count=count: guard.over_the_cap == count)  # type: ignore[misc]

    reader, writer = await _connect(proxy)
    writer.write(b"GET /mmgate/health HTTP/1.1\r\nHost: mmgate\r\n\r\n")
    assert (await _read_answer(reader))[0] == 200
    writer.close()
    status, _headers, body = await _read_answer(silent[0][0])  # the oldest silent one gave its place
    assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
    assert guard.over_the_cap <= PROBE_RESERVE
    for _, other in silent:
        other.close()
    assert await _finish_request(*busy) == 200


async def test_after_413_the_rest_of_the_body_is_not_read(upstream: Upstream, start_proxy: StartProxy) -> None:
    """aiohttp's lingering close used to read on for 10 s after the refusal (about 70 MB more)."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_BODY_MB="1")
    reader, writer = await _connect(proxy)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (512 * MIB) + bytes(64 << 10))
    status, headers, body = await _read_answer(reader)
    assert status == 413 and headers["connection"] == "close" and headers["x-should-retry"] == "false"
    assert json.loads(body)["error"]["code"] == "body_too_large"
    # Kernel buffers take a few MiB; a proxy that kept reading would take them all.
    assert await _sent_before_refused(writer, 256 * MIB) < 64 * MIB
    writer.close()


async def test_after_a_chunked_body_crosses_the_limit_the_rest_is_not_read(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_BODY_MB="1")
    reader, writer = await _connect(proxy)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n" % (256 << 10) + bytes(256 << 10) + b"\r\n"
    for _ in range(5):
        writer.write(chunk)
    await writer.drain()
    status, _headers, body = await _read_answer(reader)
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
    assert await _sent_before_refused(writer, 256 * MIB, chunk) < 64 * MIB  # valid chunks: a reader would take them
    writer.close()


async def test_after_408_for_a_slow_body_the_rest_is_not_read(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_BODY_READ_TIMEOUT="0.3")
    reader, writer = await _connect(proxy)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nContent-Length: %d\r\n\r\n{" % (64 * MIB))
    await writer.drain()
    status, _headers, body = await _read_answer(reader)
    assert status == 408 and json.loads(body)["error"]["code"] == "body_read_timeout"
    assert await _sent_before_refused(writer, 256 * MIB) < 64 * MIB
    writer.close()
    assert upstream.seen == []


async def test_expect_100_continue_is_answered_here_and_not_forwarded(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(upstream.url)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    reader, writer = await _connect(proxy)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nExpect: 100-continue\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    await writer.drain()
    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"  # before any body byte
    writer.write(body)
    status, _headers, _answer = await _read_answer(reader)
    assert status == 200
    seen = await upstream.arrived.get()
    assert "expect" not in {name.lower() for name, _ in seen.raw_headers}
    assert seen.body == body
    writer.close()


@pytest.mark.parametrize(
    ("target", "extra", "status", "code"),
    [
        (b"/v1/chat/completions", b"Content-Length: %d\r\n" % (512 * MIB), 413, "body_too_large"),
        (b"/admin", b"Content-Length: 10\r\n", 404, "path_not_allowed"),
    ],
)
async def test_expect_100_continue_is_not_sent_for_a_body_that_will_be_refused(
    upstream: Upstream, start_proxy: StartProxy, target: bytes, extra: bytes, status: int, code: str
) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_BODY_MB="1", MMGATE_ALLOW_PATHS="/v1/")
    reader, writer = await _connect(proxy)
    writer.write(b"POST " + target + b" HTTP/1.1\r\nHost: mmgate\r\nExpect: 100-continue\r\n" + extra + b"\r\n")
    await writer.drain()
    answer_status, _headers, body = await _read_answer(reader)  # the refusal itself, no 100 first
    assert (answer_status, json.loads(body)["error"]["code"]) == (status, code)
    writer.close()


async def test_an_unknown_expectation_is_417_in_the_api_shape(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url)
    reader, writer = await _connect(proxy)
    writer.write(b"POST /v1/messages HTTP/1.1\r\nHost: mmgate\r\nExpect: teapot\r\nContent-Length: 2\r\n\r\n{}")
    status, _headers, body = await _read_answer(reader)
    assert status == 417
    assert json.loads(body)["type"] == "error"  # Anthropic's shape on /v1/messages
    assert "expectation_failed" in json.loads(body)["error"]["message"]
    writer.close()
    assert upstream.seen == []


POST_REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: mmgate\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(CHAT_BODY), CHAT_BODY))


def _burst(port: int, count: int, all_sent: threading.Event) -> list[tuple[int, str] | str]:
    """``count`` connections, each sending its POST as soon as it is open, then ``all_sent``; then each
    answer's status and code, or the connection error met instead."""
    clients = []
    for _ in range(count):
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(POST_REQUEST)
        clients.append(client)
    all_sent.set()
    outcomes: list[tuple[int, str] | str] = []
    for client in clients:
        with client, client.makefile("rb") as answer:
            try:
                status = int(answer.readline().split(b" ", 2)[1])
                headers = dict(line.rstrip(b"\r\n").lower().split(b": ", 1)
                               for line in iter(answer.readline, b"\r\n"))
                body = answer.read(int(headers[b"content-length"]))
                outcomes.append((status, json.loads(body)["error"]["code"] if status >= 400 else ""))
            except (OSError, IndexError, ValueError) as failed:
                outcomes.append(f"{failed!r}")
    return outcomes


async def test_a_burst_over_the_cap_gets_answers_or_503s_never_connection_errors(
    upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """64 clients open their connections at once against a cap of 16, then each sends its request: a
    connection whose request arrived is never closed as idle, and one past the cap gets a complete 503 with
    an access-log line."""
    caplog.set_level(logging.INFO, logger="mmgate.access")
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="16", MMGATE_ACCESS_LOG="on")
    all_sent = threading.Event()
    burst = asyncio.get_running_loop().run_in_executor(None, _burst, proxy.server.port, 64, all_sent)
    # The proxy's loop is held until every request is in the kernel's buffers: mmgate then accepts all 64
    # connections, and makes their protocols, before it reads a byte of any.
    assert all_sent.wait(timeout=60)
    outcomes = await burst
    assert [o for o in outcomes if isinstance(o, str)] == []
    assert {o for o in outcomes if not isinstance(o, str)} <= {(200, ""), (503, "too_many_connections")}
    refused = sum(o == (503, "too_many_connections") for o in outcomes)
    assert refused == proxy.state.metrics.rejected.labels("too_many_connections")._value.get()
    lines = [r.getMessage() for r in caplog.records if r.name == "mmgate.access"]
    assert sum(" 503 " in line and line.endswith(" too_many_connections") for line in lines) == refused


def _answers(clients: list[socket.socket]) -> list[tuple[int, str] | str]:
    """Each client's answer: its status and code, or the connection error met instead."""
    outcomes: list[tuple[int, str] | str] = []
    for client in clients:
        with client, client.makefile("rb") as answer:
            try:
                status = int(answer.readline().split(b" ", 2)[1])
                headers = dict(line.rstrip(b"\r\n").lower().split(b": ", 1)
                               for line in iter(answer.readline, b"\r\n"))
                body = answer.read(int(headers[b"content-length"]))
                outcomes.append((status, json.loads(body)["error"]["code"] if status >= 400 else ""))
            except (OSError, IndexError, ValueError) as failed:
                outcomes.append(f"{failed!r}")
    return outcomes



def _unread(transport: asyncio.BaseTransport) -> int:
    """Bytes in the kernel's receive buffer of the proxy's side of a connection, not read by the loop yet."""
    waiting = fcntl.ioctl(transport.get_extra_info("socket").fileno(), termios.FIONREAD, bytes(4))
    return int.from_bytes(waiting, sys.byteorder)


async def test_a_request_that_arrived_but_is_not_read_yet_keeps_its_connection_at_the_cap(
    upstream: Upstream, start_proxy: StartProxy
) -> None:
    """Connections at the cap, each waiting for its first request; the requests arrive while the proxy's loop
    has not read them yet (their reading paused here: the loop busy elsewhere, or the connection just made).
    A new connection does not take them for idle: it gets 503, and every waiting request is answered."""
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="4")
    guard = proxy.state.connections
    waiting = [await _connect(proxy) for _ in range(4)]
    await _until(lambda: guard.idle == 4)
    transports: list[asyncio.Transport] = []
    for handler in guard._by_handler:
        assert handler.transport is not None
        transports.append(handler.transport)
    for transport in transports:
        transport.pause_reading()
    for _reader, writer in waiting:
        writer.write(POST_REQUEST)
        await writer.drain()
    await _until(lambda: all(_unread(transport) == len(POST_REQUEST) for transport in transports))

    reader, writer = await _connect(proxy)
    writer.write(POST_REQUEST)
    status, _headers, body = await _read_answer(reader)
    assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
    writer.close()
    for transport in transports:
        transport.resume_reading()
    assert [(await _read_answer(reader))[0] for reader, _writer in waiting] == [200] * 4
    for _reader, writer in waiting:
        writer.close()
    assert _idle_closed(proxy) == 0


async def test_a_refused_connection_s_access_line_escapes_what_it_sent(
    upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Over the cap, the access line of a refusal names the request line as it arrived, whatever it was (a TLS
    handshake, control characters): escaped, so it cannot forge log lines."""
    caplog.set_level(logging.INFO, logger="mmgate.access")
    proxy = await start_proxy(upstream.url, MMGATE_MAX_CONNECTIONS="1", MMGATE_ACCESS_LOG="on")
    busy = await _mid_request(proxy)
    reader, writer = await _connect(proxy)
    writer.write(b"\x16\x03\x01\nGET /x\r\nforged 200 HTTP/1.1\r\n\r\n")
    status, _headers, _body = await _read_answer(reader)
    assert status == 503
    writer.close()
    assert await _finish_request(*busy) == 200
    [line] = [r for r in caplog.records if r.name == "mmgate.access" and r.fields["status"] == 503]  # type: ignore[attr-defined]
    assert "\n" not in line.getMessage() and "\r" not in line.getMessage() and "\x16" not in line.getMessage()
    assert line.fields["code"] == "too_many_connections"  # type: ignore[attr-defined]
