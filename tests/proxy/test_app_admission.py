"""Admission through the real HTTP path: the storm, FIFO at the upstream, release points, exits.

The upstream holds every request until the test lets it go, so who is admitted, who waits and who is refused
is decided by the gate alone, never by timing.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.admission.client import GateClient
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from testkit.servers import counted
from tests.conftest import Proxy, StartProxy, Upstream

IMAGE = data_uri(image_bytes(32, 32))


def hold(upstream: Upstream, stream: bool = False) -> None:
    """Upstream answers only when ``upstream.release`` is set; streaming: headers first, then hold."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if b"image_url" not in await request.read():
            return web.json_response({"text": True})  # text-only requests are answered at once
        if stream:
            return await upstream.held_stream(request)
        await upstream.release.wait()
        return web.json_response({"ok": True})

    upstream.route("/v1/chat/completions", handler)


async def send(proxy: Proxy, text: str, **extra: object) -> tuple[int, dict, dict[str, str]]:
    async with aiohttp.ClientSession() as client, client.post(proxy.url + "/v1/chat/completions",
                           data=orjson.dumps(chat_with_image(IMAGE, text=text, **extra))) as response:
        body = await response.read()
        return response.status, (orjson.loads(body) if body.startswith(b"{") else {}), dict(response.headers)


def _line(gate: GateClient) -> tuple[int, int, int]:
    """The gate's line: bodies still arriving (each holding a place), requests admitted, requests waiting."""
    counters = gate.counters()
    return counters.reading, counters.in_use, counters.waiting


def arrived_texts(upstream: Upstream) -> list[str]:
    return [orjson.loads(s.body)["messages"][0]["content"][0]["text"] for s in upstream.seen]


async def test_storm(upstream: Upstream, start_proxy: StartProxy) -> None:
    holds: list[asyncio.Event] = []  # one per request the upstream holds, released one at a time

    async def handler(request: web.Request) -> web.Response:
        holds.append(asyncio.Event())
        await holds[-1].wait()
        return web.json_response({"ok": True})

    upstream.route("/v1/chat/completions", handler)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="2", MMGATE_MAX_QUEUE="3",
                              MMGATE_RELEASE_AT="complete")
    gate = proxy.state.gate
    running = [asyncio.create_task(send(proxy, f"run{i}")) for i in range(2)]
    await eventually(lambda: len(holds) == 2, "two admitted")
    queued = []
    for i in range(3):  # one at a time, so the queue order is known
        queued.append(asyncio.create_task(send(proxy, f"queued{i}")))
        await eventually(lambda: gate.counters().waiting == i + 1, "queued")  # noqa: B023 (awaited in this iteration)
    refused = await asyncio.gather(*(send(proxy, f"refused{i}") for i in range(4)))
    for status, body, headers in refused:
        assert (status, body["error"]["code"], body["error"]["type"]) == (429, "queue_full", "rate_limit_error")
        assert body["error"]["message"] == ("the media queue is full (MMGATE_MAX_QUEUE=3 places): 3 waiting, "
                                            "behind 2 running; retry later")
        assert 1 <= int(headers["Retry-After"]) <= 60
    assert (_line(gate), len(upstream.seen)) == ((0, 2, 3), 2)
    for admitted in range(2, 5):  # each finished request lets exactly the next one in
        holds[admitted - 2].set()
        await eventually(lambda: len(holds) == admitted + 1, "next admitted")  # noqa: B023 (awaited here)
        assert gate.counters().in_use == 2
    for event in holds:
        event.set()
    results = await asyncio.gather(*running, *queued)
    assert [status for status, _, _ in results] == [200] * 5
    assert arrived_texts(upstream)[2:] == ["queued0", "queued1", "queued2"]  # FIFO
    assert (_line(gate), gate.counters().bytes_in_use) == ((0, 0, 0), 0)
    assert proxy.state.metrics.rejected.labels("queue_full")._value.get() == 4


async def test_queue_timeout(upstream: Upstream, start_proxy: StartProxy) -> None:
    hold(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_QUEUE_TIMEOUT="0.05",
                              MMGATE_RELEASE_AT="complete")
    first = asyncio.create_task(send(proxy, "first"))
    await eventually(lambda: len(upstream.seen) == 1, "admitted")
    status, body, headers = await send(proxy, "second")
    assert (status, body["error"]["code"]) == (429, "queue_timeout") and "Retry-After" in headers
    assert body["error"]["message"] == ("waited 0.05 s in the media queue, the longest allowed "
                                        "(MMGATE_QUEUE_TIMEOUT=0.05), behind 1 running; retry later")
    upstream.release.set()
    assert (await first)[0] == 200


async def test_cost_over_budget_is_413(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_INFLIGHT_MEDIA_MB="1")
    big = data_uri(image_bytes(600, 600, "BMP"), "image/bmp")  # a whole image, over 1 MiB uncompressed
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/chat/completions", data=orjson.dumps(chat_with_image(big))) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "media_too_large"
    assert upstream.seen == []


async def test_byte_budget_admits_by_bytes(upstream: Upstream, start_proxy: StartProxy) -> None:
    """Two images that together exceed the budget never run at once, although slots are free."""
    hold(upstream)
    half = image_bytes(500, 500, "BMP")  # ~0.7 MiB each, uncompressed: two exceed 1 MiB
    other = image_bytes(500, 500, "BMP", color="blue")  # not the same image: a cached one would weigh nothing
    proxy = await start_proxy(upstream.url, MMGATE_MAX_INFLIGHT_MEDIA_MB="1", MMGATE_MAX_MM_CONCURRENCY="8",
                              MMGATE_MAX_MEDIA_ITEM_MB="8", MMGATE_RELEASE_AT="complete")
    async with aiohttp.ClientSession() as client:
        body = orjson.dumps(chat_with_image(data_uri(half, "image/bmp")))
        first = asyncio.create_task(client.post(proxy.url + "/v1/chat/completions", data=body))
        await eventually(lambda: len(upstream.seen) == 1, "first admitted")
        body = orjson.dumps(chat_with_image(data_uri(other, "image/bmp")))
        second = asyncio.create_task(client.post(proxy.url + "/v1/chat/completions", data=body))
        await eventually(lambda: proxy.state.gate.counters().waiting == 1, "second waits for bytes")
        assert proxy.state.gate.counters().in_use == 1
        assert proxy.state.gate.counters().bytes_in_use >= len(half)
        upstream.release.set()
        for task in (first, second):
            response = await task
            assert response.status == 200
            response.release()
    assert proxy.state.gate.counters().bytes_in_use == 0


@pytest.mark.parametrize("release_at", ["sent", "headers", "complete"])
async def test_release_point_seen_from_upstream(upstream: Upstream, start_proxy: StartProxy, release_at: str) -> None:
    hold(upstream, stream=True)
    proxy = await start_proxy(upstream.url, MMGATE_RELEASE_AT=release_at)
    gate = proxy.state.gate
    upstream_has_body = asyncio.Event()
    async with aiohttp.ClientSession() as client:
        response = await client.post(proxy.url + "/v1/chat/completions",
                                     data=orjson.dumps(chat_with_image(IMAGE, stream=True)))
        upstream_has_body.set()
        assert await response.content.readuntil(b"\n\n") == b"data: first\n\n"
        # The upstream has the body and sent its headers, but has not finished.
        assert gate.counters().in_use == (1 if release_at == "complete" else 0)
        upstream.release.set()
        await response.read()
    await eventually(lambda: gate.counters().in_use == 0, "released at the end")


async def test_auto_release_is_sent_for_non_streaming(upstream: Upstream, proxy: Proxy) -> None:
    hold(upstream)
    task = asyncio.create_task(send(proxy, "non-streaming"))
    await eventually(lambda: len(upstream.seen) == 1, "upstream has the body")
    # released while the upstream still holds the request
    await eventually(lambda: proxy.state.gate.counters().in_use == 0, "released once sent")
    assert not task.done()
    upstream.release.set()
    assert (await task)[0] == 200


@pytest.mark.parametrize("stage", ["queued", "upstream"])
async def test_disconnect_restores_gate(upstream: Upstream, start_proxy: StartProxy, stage: str) -> None:
    hold(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_RELEASE_AT="complete")
    gate = proxy.state.gate
    holder = asyncio.create_task(send(proxy, "holder"))
    await eventually(lambda: len(upstream.seen) == 1, "holder admitted")
    if stage == "queued":
        leaver = asyncio.create_task(send(proxy, "leaver"))
        await eventually(lambda: gate.counters().waiting == 1, "leaver queued")
        leaver.cancel()
        await eventually(lambda: gate.counters().waiting == 0, "queue emptied")
        assert gate.counters().in_use == 1
        upstream.release.set()
        assert (await holder)[0] == 200
    else:
        holder.cancel()
        await asyncio.wait_for(upstream.cancelled.wait(), 10)
    await eventually(lambda: (_line(gate), gate.counters().bytes_in_use) == ((0, 0, 0), 0), "gate restored")
    await asyncio.wait_for(proxy.state.idle.wait(), 10)


async def test_text_passes_while_gate_full(upstream: Upstream, start_proxy: StartProxy) -> None:
    hold(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_MAX_QUEUE="1",
                              MMGATE_RELEASE_AT="complete")
    media = [asyncio.create_task(send(proxy, "a")), asyncio.create_task(send(proxy, "b"))]
    await eventually(lambda: proxy.state.gate.counters().waiting == 1, "gate full, queue full")

    async def text_answer(request: web.Request) -> web.Response:
        return web.json_response({"text": True})

    upstream.route("/v1/completions", text_answer)
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy.url + "/v1/completions", data=b'{"prompt": "hi"}') as response:
            assert response.status == 200 and (await response.json()) == {"text": True}
        async with client.post(proxy.url + "/v1/chat/completions",
                               data=b'{"messages": [{"role": "user", "content": "hi"}]}') as response:
            assert response.status == 200
    upstream.release.set()
    assert [r[0] for r in await asyncio.gather(*media)] == [200, 200]


async def test_server_timing_header(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url)
    status, _, headers = await send(proxy, "timed")
    assert status == 200
    names = [item.split(";")[0].strip() for item in headers["Server-Timing"].split(",")]
    assert names == ["queue", "preprocess", "upstream"]
    hidden = await start_proxy(upstream.url, MMGATE_SERVER_TIMING="off")
    assert "Server-Timing" not in (await send(hidden, "untimed"))[2]


class Upload:
    """A client that sends headers and the first part of a body, then the rest only when told to."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rest: bytes) -> None:
        self.reader, self.writer, self.rest = reader, writer, rest

    @classmethod
    async def start(cls, proxy: Proxy, body: bytes, first: int) -> Upload:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:first])
        await writer.drain()
        return cls(reader, writer, body[first:])

    async def finish(self) -> None:
        self.writer.write(self.rest)
        await self.writer.drain()

    async def answer(self) -> tuple[int, dict[str, str]]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 30)
        lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if line)
        return int(lines[0].split()[1]), headers

    async def refusal(self) -> tuple[int, dict]:
        """The answer to a request refused before its body was read: its status and its JSON error."""
        status, headers = await self.answer()
        body = await asyncio.wait_for(self.reader.readexactly(int(headers["Content-Length"])), 30)
        return status, orjson.loads(body)["error"]


async def test_burst_refused_before_its_bodies_are_read(upstream: Upstream, start_proxy: StartProxy) -> None:
    """One slot + one queue place: two big media bodies still arriving hold both, so a third is refused with
    429 as soon as its head shows media, its body never read (a burst cannot fill memory with bodies the
    gate would refuse anyway). A text body as big, whose head names no media, is not held back."""
    hold(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_MAX_QUEUE="1",
                              MMGATE_RELEASE_AT="complete")
    gate = proxy.state.gate
    media = orjson.dumps(chat_with_image(IMAGE, text="look", user="u" * 400_000))  # "image" early, big after
    text = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "words " * 70_000}]})
    first = 100_000

    a = await Upload.start(proxy, media, first)
    await eventually(lambda: gate.counters().reading == 1, "first body holds a place while arriving")
    b = await Upload.start(proxy, media, first)
    await eventually(lambda: gate.counters().reading == 2, "second body holds the queue place")
    c = await Upload.start(proxy, media, first)
    status, headers = await c.answer()  # c has not sent the rest of its body
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert proxy.state.metrics.registry.get_sample_value("mmgate_rejected_total", {"reason": "queue_full"}) == 1

    t = await Upload.start(proxy, text, first)  # places are all taken, but this body is text
    await t.finish()
    assert (await t.answer())[0] == 200

    await a.finish()
    await b.finish()
    await eventually(lambda: _line(gate) == (0, 1, 1), "a admitted, b queued")
    upstream.release.set()
    assert [(await a.answer())[0], (await b.answer())[0]] == [200, 200]
    for upload in (a, b, c, t):
        upload.writer.close()
    await eventually(lambda: _line(gate) == (0, 0, 0), "gate empty")


async def test_refused_image_requests_are_counted_logged_and_drawn_as_media(
        upstream: Upstream, start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    """Eight clients sending only images at a gate of 2 and a queue of 4: the six places go to six bodies still
    arriving, and the last two are refused at their head. Every one is media in the access log, in
    /mmgate/stats (the dashboard) and in Prometheus, and the 429 names the limit that refused it."""
    hold(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="2", MMGATE_MAX_QUEUE="4",
                              MMGATE_RELEASE_AT="complete", MMGATE_ACCESS_LOG="on")
    gate = proxy.state.gate
    image = data_uri(image_bytes(300, 300, "BMP"), "image/bmp")  # ~360 KB of base64, its head naming the image
    body = orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]})

    with caplog.at_level(logging.INFO, logger="mmgate.access"):
        uploads = [await Upload.start(proxy, body, 100_000) for _ in range(8)]
        answers = [asyncio.create_task(upload.refusal()) for upload in uploads]
        await eventually(lambda: sum(answer.done() for answer in answers) == 2, "two refused at their head")
        assert _line(gate) == (6, 0, 0)
        refused = [answer.result() for answer in answers if answer.done()]
        for status, error in refused:
            assert (status, error["code"]) == (429, "queue_full")
            assert error["message"] == (
                "the media queue is full (6 places: 2 slots + MMGATE_MAX_QUEUE=4): 0 running, 0 waiting and 6 "
                "still arriving (a body being read holds its place); retry later")

        holding = [upload for upload, answer in zip(uploads, answers, strict=True) if not answer.done()]
        for upload, answer in zip(uploads, answers, strict=True):
            answer.cancel()
            if upload not in holding:
                upload.writer.close()
        for upload in holding:
            await upload.finish()
        await eventually(lambda: _line(gate) == (0, 2, 4), "two admitted, four wait")
        upstream.release.set()
        assert [(await upload.answer())[0] for upload in holding] == [200] * 6
        for upload in holding:
            upload.writer.close()
        await eventually(lambda: len([r for r in caplog.records if r.name == "mmgate.access"]) == 8, "all logged")

    lines = [(r.fields["kind"], r.fields["status"], r.fields["code"])  # type: ignore[attr-defined]
             for r in caplog.records if r.name == "mmgate.access"]
    assert sorted(lines) == [("media", 200, None)] * 6 + [("media", 429, "queue_full")] * 2
    counts = await counted(proxy)
    assert counts.by_kind == {"media": 8}
    assert counts.by_kind_and_code == {("media", "200"): 6, ("media", "429"): 2}
