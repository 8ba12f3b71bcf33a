"""Media through the real proxy: each dialect, resize, validation errors, the pool's deadline and
cancellation. The upstream records the exact bytes it received."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from PIL import Image

from demo.backend import StubConfig, create_stub_app
from testkit.media import BlockedPool, chat_with_image, data_uri, decode_uri, eventually, image_bytes
from tests.conftest import Proxy, StartProxy, Upstream

# Full validation: every image is decoded in the pool (with the default, header validation, an image its header
# decides never reaches the pool), for the tests of what a busy or stopped pool does to a request.
POOLED = {"MMGATE_VALIDATE": "full"}


async def post(url: str, body: dict | bytes, **headers: str) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession() as client:
        async with client.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as response:
            return response.status, await response.json()


async def test_resized_image_keeps_aspect_and_rest_of_body(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_SIDE="100")
    body = orjson.dumps(chat_with_image(data_uri(image_bytes(400, 200)))).replace(b'"model":"m"', b'"seed":1e2')
    status, _ = await post(proxy.url + "/v1/chat/completions", body)
    assert status == 200
    sent = upstream.seen[-1].body
    forwarded = orjson.loads(sent)
    head, image = decode_uri(forwarded["messages"][0]["content"][1]["image_url"]["url"])
    assert head == "data:image/jpeg;base64" and image.size == (100, 50)
    assert sent.startswith(b'{"seed":1e2,') and b'"text":"what is this?"' in sent  # untouched bytes stay


async def test_small_image_forwarded_byte_identical(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_SIDE="1000")
    body = orjson.dumps(chat_with_image(data_uri(image_bytes(64, 48), "image/png")))
    status, _ = await post(proxy.url + "/v1/chat/completions", body)
    assert status == 200
    assert upstream.seen[-1].body == body
    assert proxy.state.metrics.media_items.labels("image", "unchanged")._value.get() == 1


async def test_anthropic_image_and_media_type_rewritten(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_PIXELS="2500")
    png = base64.b64encode(image_bytes(200, 200, mode="RGBA", color=(0, 0, 255, 128))).decode()
    body = {"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
        {"type": "text", "text": "describe"}]}]}
    status, _ = await post(proxy.url + "/v1/messages", body)
    assert status == 200
    source = orjson.loads(upstream.seen[-1].body)["messages"][0]["content"][0]["source"]
    image = Image.open(io.BytesIO(base64.b64decode(source["data"])))
    assert source["media_type"] == "image/png" and image.size == (50, 50)  # alpha kept: PNG
    assert image.mode == "RGBA"


async def test_responses_and_generate_dialects(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_SIDE="32")
    uri = data_uri(image_bytes(128, 64))
    status, _ = await post(proxy.url + "/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": uri}]}]})
    assert status == 200
    part = orjson.loads(upstream.seen[-1].body)["input"][0]["content"][1]
    assert decode_uri(part["image_url"])[1].size == (32, 16)

    raw = base64.b64encode(image_bytes(128, 64)).decode()
    status, _ = await post(proxy.url + "/generate", {"text": "hi", "image_data": [raw, uri]})
    assert status == 200
    first, second = orjson.loads(upstream.seen[-1].body)["image_data"]
    assert Image.open(io.BytesIO(base64.b64decode(first))).size == (32, 16)  # raw base64 stays raw base64
    assert decode_uri(second)[1].size == (32, 16)


async def test_openai_sdk_image_reaches_stub_resized(start_proxy: StartProxy) -> None:
    stub = TestServer(create_stub_app(StubConfig(tokens=4)), host="127.0.0.1")
    await stub.start_server()
    try:
        proxy = await start_proxy(f"http://127.0.0.1:{stub.port}", MMGATE_RESIZE_MAX_SIDE="300")
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        uri = data_uri(image_bytes(1200, 600, "JPEG"), "image/jpeg")
        reply = await client.chat.completions.create(model="m", messages=chat_with_image(uri)["messages"])
        assert "saw 1 image(s) [300x150]" in (reply.choices[0].message.content or "")
        stream = await client.chat.completions.create(model="m", stream=True,
                                                      messages=chat_with_image(uri)["messages"])
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert "[300x150]" in text
        await client.close()
    finally:
        await stub.close()


async def test_anthropic_sdk_image_reaches_stub_resized(start_proxy: StartProxy) -> None:
    stub = TestServer(create_stub_app(StubConfig(tokens=4)), host="127.0.0.1")
    await stub.start_server()
    try:
        proxy = await start_proxy(f"http://127.0.0.1:{stub.port}", MMGATE_RESIZE_MAX_PIXELS="20000")
        client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="k", max_retries=0)
        png = base64.b64encode(image_bytes(400, 200)).decode()
        message = await client.messages.create(model="c", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
            {"type": "text", "text": "what is it?"}]}])
        assert "saw 1 image(s) [200x100]" in message.content[0].text  # type: ignore[union-attr]
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model="c", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image",
                 "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]}])
        assert "unsupported_media_type" in str(caught.value) and "messages[0].content[0]" in str(caught.value)
        await client.close()
    finally:
        await stub.close()


def _png_bomb(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` × ``height`` pixels (its pixel data is a few bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def _tiff() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "TIFF")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("uri", "status", "code"),
    [
        ("data:image/png;base64,not base64!", 400, "invalid_base64"),
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", 400, "unsupported_media_type"),
        ("data:image/png;base64," + base64.b64encode(image_bytes(64, 64)[:-30]).decode(), 400, "image_truncated"),
        (data_uri(_png_bomb(20000, 20000)), 400, "image_too_large"),
        (data_uri(_tiff(), "image/tiff"), 400, "unsupported_media_type"),
        ("data:image/png,rawbytes", 400, "invalid_data_uri"),
        ("data:image/png;base64," + "A" * (2 * 1024 * 1024), 413, "media_too_large"),
    ],
    ids=["invalid_base64", "not_an_image", "truncated_png", "bomb", "tiff", "no_base64_flag", "item_too_large"],
)
async def test_bad_media_refused_naming_the_part(upstream: Upstream, start_proxy: StartProxy, uri: str,
                                                 status: int, code: str) -> None:
    # full: every image goes through the decode pool (header validation, the default, judges these on the loop)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MEDIA_ITEM_MB="1", MMGATE_VALIDATE="full")
    got, body = await post(proxy.url + "/v1/chat/completions", chat_with_image(uri))
    assert (got, body["error"]["code"]) == (status, code)
    assert body["error"]["param"] == "messages[0].content[1]"
    assert upstream.seen == []  # nothing forwarded
    assert proxy.state.gate.counters().in_use == 0


async def test_non_ascii_base64(upstream: Upstream, proxy: Proxy) -> None:
    got, body = await post(proxy.url + "/v1/chat/completions", chat_with_image("data:image/png;base64,iVBOR\u00e9w=="))
    assert (got, body["error"]["code"]) == (400, "invalid_base64")


async def test_wrong_mime_is_judged_by_content(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_SIDE="16")
    uri = data_uri(image_bytes(64, 64, "PNG"), "image/gif")  # says GIF, is PNG
    status, _ = await post(proxy.url + "/v1/chat/completions", chat_with_image(uri))
    assert status == 200
    head, image = decode_uri(orjson.loads(upstream.seen[-1].body)["messages"][0]["content"][1]["image_url"]["url"])
    assert head == "data:image/jpeg;base64" and image.size == (16, 16)


async def test_too_many_media(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MEDIA_PER_REQUEST="2")
    part = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [part, part, part]}]}
    got, answer = await post(proxy.url + "/v1/chat/completions", body)
    assert (got, answer["error"]["code"], answer["error"]["param"]) == (400, "too_many_media", "messages[0].content[2]")
    assert upstream.seen == []


async def test_media_urls_forwarded_or_rejected(upstream: Upstream, start_proxy: StartProxy) -> None:
    body = chat_with_image("https://example.com/cat.png")
    forwarding = await start_proxy(upstream.url)
    assert (await post(forwarding.url + "/v1/chat/completions", body))[0] == 200
    assert upstream.seen[-1].body == orjson.dumps(body)
    rejecting = await start_proxy(upstream.url, MMGATE_MEDIA_URLS="reject")
    got, answer = await post(rejecting.url + "/v1/chat/completions", body)
    assert (got, answer["error"]["code"]) == (400, "media_url_not_allowed")


async def test_compressed_body_on_media_route_refused(upstream: Upstream, proxy: Proxy) -> None:
    got, answer = await post(proxy.url + "/v1/chat/completions", b'{"messages": []}', **{"Content-Encoding": "gzip"})
    assert (got, answer["error"]["code"]) == (415, "unsupported_content_encoding")


async def test_preprocess_timeout_frees_slot_when_work_stopped(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_DECODE_WORKERS="1", **POOLED, MMGATE_PREPROCESS_TIMEOUT="0.05")
    blocked = BlockedPool(proxy.state.pool)
    try:
        got, answer = await post(proxy.url + "/v1/chat/completions", chat_with_image(data_uri(image_bytes())))
        assert (got, answer["error"]["code"]) == (504, "preprocess_timeout")
        assert proxy.state.pool.queued == 0  # the item that never started was dropped
    finally:
        blocked.release()
    await eventually(lambda: proxy.state.gate.counters().in_use == 0, "lease released")
    assert upstream.seen == []


async def test_client_disconnect_during_preprocessing_frees_the_pool(upstream: Upstream,
                                                                    start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_DECODE_WORKERS="1", **POOLED)
    blocked = BlockedPool(proxy.state.pool)
    try:
        task = asyncio.create_task(post(proxy.url + "/v1/chat/completions", chat_with_image(data_uri(image_bytes()))))
        await eventually(lambda: proxy.state.pool.queued == 1, "item queued")
        async with aiohttp.ClientSession() as client:  # the loop is free while every worker is busy
            async with client.get(proxy.url + "/mmgate/health") as health:
                assert health.status == 200
        task.cancel()
        await eventually(lambda: proxy.state.pool.queued == 0, "queued item dropped")
        await eventually(lambda: proxy.state.gate.counters().in_use == 0, "lease released")
    finally:
        blocked.release()
    assert proxy.state.pool.stuck == 0 and upstream.seen == []


async def test_text_request_does_not_wait_for_busy_pool(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_DECODE_WORKERS="1", **POOLED)
    blocked = BlockedPool(proxy.state.pool)
    try:
        task = asyncio.create_task(post(proxy.url + "/v1/chat/completions", chat_with_image(data_uri(image_bytes()))))
        await eventually(lambda: proxy.state.pool.queued == 1, "item queued")
        status, _ = await post(proxy.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and len(upstream.seen) == 1
    finally:
        blocked.release()
    assert (await task)[0] == 200


async def test_with_header_validation_an_image_its_header_decides_never_waits_for_the_pool(
        upstream: Upstream, start_proxy: StartProxy) -> None:
    """The defaults: a JPEG, PNG or BMP that needs no resize is judged on the loop from the head of its base64,
    so it is forwarded byte for byte with every decode thread busy, and nothing of it is hashed or cached. A
    GIF (its frames are counted over the whole file) still goes to the pool, and waits there."""
    proxy = await start_proxy(upstream.url, MMGATE_PREPROCESS_TIMEOUT="0.3", MMGATE_DECODE_MODE="thread")
    blocked = BlockedPool(proxy.state.pool)
    try:
        for fmt in ("JPEG", "PNG", "BMP"):
            body = orjson.dumps(chat_with_image(data_uri(image_bytes(640, 480, fmt), f"image/{fmt.lower()}")))
            assert (await post(proxy.url + "/v1/chat/completions", body))[0] == 200
            assert upstream.seen[-1].body == body
        status, answer = await post(proxy.url + "/v1/chat/completions",
                                    chat_with_image(data_uri(image_bytes(64, 48, "GIF"), "image/gif")))
        assert (status, answer["error"]["code"]) == (504, "preprocess_timeout")
    finally:
        blocked.release()
    assert proxy.state.cache.entries == 0
    assert proxy.state.metrics.media_items.labels("image", "unchanged")._value.get() == 3
    assert proxy.state.gate.counters().in_use == 0


@pytest.mark.parametrize(("setting", "value"), [("MMGATE_VALIDATE", "full"), ("MMGATE_RESIZE_MAX_SIDE", "100")])
async def test_an_image_whose_pixels_are_needed_goes_to_the_pool(upstream: Upstream, start_proxy: StartProxy,
                                                                 setting: str, value: str) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_PREPROCESS_TIMEOUT="0.3", MMGATE_DECODE_MODE="thread",
                              **{setting: value})
    blocked = BlockedPool(proxy.state.pool)
    try:
        status, answer = await post(proxy.url + "/v1/chat/completions",
                                    chat_with_image(data_uri(image_bytes(640, 480, "JPEG"), "image/jpeg")))
    finally:
        blocked.release()
    assert (status, answer["error"]["code"]) == (504, "preprocess_timeout")


@pytest.mark.parametrize(("uri", "status", "code"), [
    ("data:image/png;base64,not base64!", 400, "invalid_base64"),
    ("data:image/png;base64," + base64.b64encode(_png_bomb(20000, 20000)).decode(), 400, "image_too_large"),
    ("data:image/png;base64," + "A" * (2 * 1024 * 1024), 413, "media_too_large"),
], ids=["invalid_base64", "bomb", "item_too_large"])
async def test_a_header_refusal_on_the_loop_is_the_same_as_the_pools(upstream: Upstream, start_proxy: StartProxy,
                                                                     uri: str, status: int, code: str) -> None:
    answers = []
    for validate in ("header", "full"):
        proxy = await start_proxy(upstream.url, MMGATE_MAX_MEDIA_ITEM_MB="1", MMGATE_VALIDATE=validate)
        got, body = await post(proxy.url + "/v1/chat/completions", chat_with_image(uri))
        answers.append((got, body["error"]["code"], body["error"]["param"]))
        assert proxy.state.gate.counters().in_use == 0
    assert answers == [(status, code, "messages[0].content[1]")] * 2
    assert upstream.seen == []
