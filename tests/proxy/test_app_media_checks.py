"""Two refusals through the real app, in front of a recording upstream: an image cut short (``image_truncated``,
from the file's last bytes, before admission, whatever ``MMGATE_VALIDATE``), and a media URL whose scheme is
not http(s) (``media_url_scheme_not_allowed``, whatever ``MMGATE_MEDIA_URLS``). Each refusal is asserted on the
answer's body, and on the upstream having received nothing; the files real encoders write still go through
byte for byte."""

from __future__ import annotations

import asyncio
import base64
import io
import random
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from PIL import Image, PngImagePlugin

from testkit.media import chat_with_image, data_uri, eventually
from tests.conftest import StartProxy, Upstream

CHAT = "/v1/chat/completions"
PARAM = "messages[0].content[1]"
MIME = {"JPEG": "image/jpeg", "PNG": "image/png", "GIF": "image/gif", "WEBP": "image/webp"}


def noisy(size: tuple[int, int] = (96, 72), seed: int = 0) -> Image.Image:
    """Noise compresses badly, so every file below has a long body to cut, not just a header."""
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.getrandbits(8) for _ in range(size[0] * size[1] * 3)))


def encoded(fmt: str, animated: bool = False, **options: Any) -> bytes:
    out = io.BytesIO()
    if animated:
        frames = [noisy(seed=seed) for seed in range(3)]
        frames[0].save(out, fmt, save_all=True, append_images=frames[1:], duration=80, loop=0, **options)
    else:
        noisy().save(out, fmt, **options)
    return out.getvalue()


def real_files() -> dict[str, tuple[str, bytes]]:
    """What encoders and cameras write, each with its format: every one must pass untouched."""
    exif = Image.Exif()
    exif[0x010F], exif[0x0112] = "camera", 6
    text_after_idat = PngImagePlugin.PngInfo()
    text_after_idat.add_text("comment", "written after the image data", zip=True)
    jpeg = encoded("JPEG")
    return {
        "jpeg with exif": ("JPEG", encoded("JPEG", exif=exif.tobytes())),
        "progressive jpeg": ("JPEG", encoded("JPEG", progressive=True, optimize=True)),
        "jpeg padded with zeros": ("JPEG", jpeg + b"\x00" * 300),
        "jpeg with a camera trailer": ("JPEG", jpeg + b"SEFH" + bytes(range(256)) * 4 + b"SEFT"),
        # A motion photo: the JPEG, then its video, far longer than the tail read.
        "motion photo": ("JPEG", jpeg + b"\x00\x00\x00\x18ftypmp42" + random.Random(1).randbytes(200_000)),
        "png with chunks after its data": ("PNG", encoded("PNG", pnginfo=text_after_idat)),
        "png with a line break after its end": ("PNG", encoded("PNG") + b"\r\n"),
        "animated png": ("PNG", encoded("PNG", animated=True)),
        "animated gif": ("GIF", encoded("GIF", animated=True)),
        "lossy webp": ("WEBP", encoded("WEBP", quality=70)),
        "lossless webp": ("WEBP", encoded("WEBP", lossless=True)),
        "animated webp": ("WEBP", encoded("WEBP", animated=True)),
    }


REAL = real_files()


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as client, client.post(url, data=orjson.dumps(body)) as response:
        return response.status, await response.json()


def hold(upstream: Upstream) -> None:
    """The upstream answers a request only once ``upstream.release`` is set."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        await upstream.release.wait()
        return web.json_response({"ok": True})

    upstream.route(CHAT, handler)


# ----------------------------------------------------------------------------------------------------------
# truncated images


@pytest.mark.parametrize("validate", ["header", "full"])
@pytest.mark.parametrize("name", sorted(REAL))
async def test_real_files_go_through_untouched(name: str, validate: str, upstream: Upstream,
                                               start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_VALIDATE=validate)
    fmt, data = REAL[name]
    body = chat_with_image(data_uri(data, MIME[fmt]))
    status, answer = await post(proxy.url + CHAT, body)
    assert status == 200, answer
    assert orjson.loads(upstream.seen[-1].body) == body


@pytest.mark.parametrize("validate", ["header", "full"])
@pytest.mark.parametrize(("name", "said"), [
    ("jpeg with exif", "JPEG ends without its end-of-image marker (FFD9)"),
    ("progressive jpeg", "JPEG ends without its end-of-image marker (FFD9)"),
    ("png with chunks after its data", "PNG ends without its IEND chunk"),
    ("animated gif", "GIF ends without its trailer (0x3B)"),
    ("lossy webp", "its RIFF header says"),
    ("animated webp", "its RIFF header says"),
])
async def test_an_image_cut_in_half_is_refused_and_nothing_is_forwarded(
        name: str, said: str, validate: str, upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_VALIDATE=validate)
    fmt, data = REAL[name]
    status, answer = await post(proxy.url + CHAT, chat_with_image(data_uri(data[: len(data) // 2], MIME[fmt])))
    assert status == 400
    assert answer["error"]["code"] == "image_truncated"
    assert answer["error"]["param"] == PARAM
    assert said in answer["error"]["message"] and "send the whole file" in answer["error"]["message"]
    assert upstream.seen == []


async def test_a_gif_cut_in_its_last_frame_is_refused_by_full_validation_too(
        upstream: Upstream, start_proxy: StartProxy) -> None:
    """Full validation decodes an animation's first frame only: the end is what tells a later frame is cut."""
    proxy = await start_proxy(upstream.url, MMGATE_VALIDATE="full")
    gif = REAL["animated gif"][1]
    status, answer = await post(proxy.url + CHAT, chat_with_image(data_uri(gif[:-200], "image/gif")))
    assert (status, answer["error"]["code"]) == (400, "image_truncated")
    assert upstream.seen == []


@pytest.mark.parametrize("name", ["jpeg with exif", "png with chunks after its data", "animated gif", "lossy webp"])
async def test_a_truncated_image_is_refused_before_admission(name: str, upstream: Upstream,
                                                             start_proxy: StartProxy) -> None:
    """The one gate slot is held by a request the upstream keeps: a refusal decided after admission would wait
    for that slot and time out in the queue (429); the truncated file is refused without waiting."""
    hold(upstream)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="1", MMGATE_QUEUE_TIMEOUT="0.05",
                              MMGATE_RELEASE_AT="complete")
    fmt, data = REAL[name]
    first = asyncio.create_task(post(proxy.url + CHAT, chat_with_image(data_uri(REAL["lossy webp"][1],
                                                                                "image/webp"))))
    await eventually(lambda: len(upstream.seen) == 1, "the first request holds the slot")
    status, answer = await post(proxy.url + CHAT, chat_with_image(data_uri(data[:-300], MIME[fmt])))
    assert (status, answer["error"]["code"]) == (400, "image_truncated")
    assert proxy.state.gate.counters().in_use == 1
    upstream.release.set()
    assert (await first)[0] == 200
    assert len(upstream.seen) == 1


# ----------------------------------------------------------------------------------------------------------
# media URL schemes

SCHEMES = [
    ("file:///etc/passwd", "file"),
    ("FILE:///etc/passwd", "file"),
    ("ftp://127.0.0.1/cat.png", "ftp"),
    ("gopher://127.0.0.1:70/_x", "gopher"),
    ("s3://bucket/cat.png", "s3"),
    ("  \x01file:///etc/passwd", "file"),  # leading spaces and controls: URL parsers skip them
    ("fi\tle:///etc/passwd", "file"),  # a tab inside the scheme: URL parsers drop it
    ("c:\\images\\cat.png", "c"),
    (" data:image/png;base64,iVBORw0KGgo=", "data"),  # not a data: URI, since something comes first
]
URL_MODES = ["forward", "reject", "fetch"]


def mode_env(mode: str) -> dict[str, str]:
    return {"MMGATE_MEDIA_URLS": mode, "MMGATE_FETCH_ALLOW_ADDRESSES": "127.0.0.1/32"} if mode == "fetch" else {
        "MMGATE_MEDIA_URLS": mode}


@pytest.mark.parametrize("mode", URL_MODES)
@pytest.mark.parametrize(("url", "scheme"), SCHEMES)
async def test_a_media_url_whose_scheme_is_not_http_is_refused_in_every_mode(
        url: str, scheme: str, mode: str, upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **mode_env(mode))
    status, answer = await post(proxy.url + CHAT, chat_with_image(url))
    assert status == 400
    assert answer["error"]["code"] == "media_url_scheme_not_allowed"
    assert answer["error"]["param"] == PARAM
    assert f"the scheme {scheme!r} are not accepted, only http and https" in answer["error"]["message"]
    assert upstream.seen == []


@pytest.mark.parametrize("mode", URL_MODES)
async def test_every_dialect_refuses_a_file_url(mode: str, upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, **mode_env(mode))
    url = "file:///etc/passwd"
    status, answer = await post(proxy.url + "/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url}]}]})
    assert (status, answer["error"]["code"]) == (400, "media_url_scheme_not_allowed")
    status, answer = await post(proxy.url + "/generate", {"text": "x", "image_data": [url]})
    assert (status, answer["error"]["code"], answer["error"]["param"]) == (
        400, "media_url_scheme_not_allowed", "image_data[0]")
    status, answer = await post(proxy.url + "/v1/messages", {"model": "c", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}}]}]})
    assert status == 400 and answer["type"] == "error"
    assert "the scheme 'file' are not accepted" in answer["error"]["message"]
    assert upstream.seen == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/cat.png", "HTTPS://example.invalid/cat.png"])
async def test_http_urls_are_still_forwarded(url: str, upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url)
    body = chat_with_image(url)
    status, _ = await post(proxy.url + CHAT, body)
    assert status == 200
    assert orjson.loads(upstream.seen[-1].body) == body


async def test_inline_data_uris_are_media_not_urls(upstream: Upstream, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_MEDIA_URLS="reject")
    png = REAL["png with chunks after its data"][1]
    body = chat_with_image("DATA:image/png;base64," + base64.b64encode(png).decode())
    status, _ = await post(proxy.url + CHAT, body)
    assert status == 200
    assert orjson.loads(upstream.seen[-1].body) == body
