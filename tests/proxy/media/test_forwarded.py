"""What mmgate forwards is bounded as what it receives is: a body that its rewritten images would take past
MMGATE_MAX_BODY_MB is refused from their headers, before a pixel is decoded, and the gate weighs what each
admitted request forwards, a cached rewrite included.

The header estimate is checked against what the decode really makes (a property over sizes, modes, source and
handoff formats); the attack of issue 39 runs in small through the real proxy with a Qwen2.5-VL processor of
the real bounds: solid 8064x6400 JPEGs of a few hundred KB, each of which the model's size makes a 38 MB BMP (a
JPEG that large is resized: libjpeg decodes it at half scale, which the handoff rule counts; a PNG the model
keeps more than half of goes as it came, see ``tests/preprocessors/test_handoff.py``).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from preprocessors.base import ImageFormat, ImagePolicy
from preprocessors.dataurl import Base64Ends
from preprocessors.errors import MediaError
from preprocessors.geometry import QwenVL
from preprocessors.header import inline_header
from preprocessors.image import process_image
from proxy.media.forwarded import base64_length, forwarded_file_bytes
from testkit.load import scrape
from testkit.media import chat_with_image, data_uri, eventually
from testkit.models import QWEN25_MAX_PIXELS, qwen_folder
from tests.conftest import StartProxy, Upstream

CHAT = "/v1/chat/completions"
# Qwen2.5-VL's processor at 12.8 MP turns an 8064x6400 image into 4004x3192: a 38.3 MB BMP, 51.1 MB of base64.
BIG_SIDES = (8064, 6400)
BIG_FORWARD_SIDES = (4004, 3192)
BIG_BMP = 54 + BIG_FORWARD_SIDES[0] * 3 * BIG_FORWARD_SIDES[1]


@functools.cache
def solid_png(width: int, height: int, color: str = "teal") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


@functools.cache
def solid_jpeg(width: int, height: int, color: str = "teal") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def chat_with_images(uris: list[str]) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "what are these?"}]
    content += [{"type": "image_url", "image_url": {"url": uri}} for uri in uris]
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as client, client.post(url + CHAT, json=body) as response:
        return response.status, await response.json()


def forwarded_payload(seen_body: bytes, part: int = 1) -> bytes:
    uri = json.loads(seen_body)["messages"][0]["content"][part]["image_url"]["url"]
    return str(uri).partition(",")[2].encode()


def qwen25(tmp_path: Path) -> str:
    return str(qwen_folder(tmp_path, "qwen2_5_vl", max_pixels=QWEN25_MAX_PIXELS))


# ------------------------------------------------------------------------------- the header's estimate


def _image(width: int, height: int, mode: str, smooth: bool, seed: int) -> Image.Image:
    """A gradient (what a lossy encoder is bounded on) or noise (the worst a lossless one gets)."""
    rng = np.random.default_rng(seed)
    channels = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}[mode]
    if smooth:
        ramp = np.linspace(0, 255, width * height * channels).reshape(height, width, channels)
        pixels = ramp.astype(np.uint8)
    else:
        pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    if mode in ("RGBA", "LA"):
        pixels[..., -1] = rng.integers(0, 255, (height, width), dtype=np.uint8)  # not fully opaque
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


SOURCES = {"PNG": ("L", "LA", "RGB", "RGBA"), "JPEG": ("L", "RGB"), "BMP": ("L", "RGB"), "WEBP": ("RGB", "RGBA"),
           "GIF": ("L", "RGB")}


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 300), height=st.integers(1, 300), source=st.sampled_from(sorted(SOURCES)),
       data=st.data(), output=st.sampled_from(["auto", "bmp", "png", "jpeg", "webp"]), model=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_header_bounds_the_file_the_decode_makes(width: int, height: int, source: str, data: st.DataObject,
                                                      output: ImageFormat, model: bool, seed: int) -> None:
    """Whatever the image and the handoff format, the estimate from the header is never under the file the
    decode writes, is 0 exactly where the image goes as it came, and a colour BMP's is exact but for a palette."""
    mode = data.draw(st.sampled_from(SOURCES[source]))
    side = data.draw(st.integers(1, max(1, max(width, height) - 1)))  # mostly a resize
    lossy = output in ("jpeg", "webp") or (output == "auto" and not model and mode not in ("RGBA", "LA"))
    buffer = io.BytesIO()
    _image(width, height, mode, smooth=lossy, seed=seed).save(buffer, source)
    geometry = QwenVL("qwen2.5-vl", 14, 2, 56 * 56, side * side * 28 * 28 // 64 + 56 * 56) if model else None
    policy = ImagePolicy(resize_max_side=side, output_format=output, geometry=geometry)
    try:
        processed = process_image(buffer.getvalue(), policy)
    except MediaError:  # refused (Qwen: an aspect ratio over 200): nothing is forwarded
        return
    estimated = forwarded_file_bytes(inline_header(Base64Ends(base64.b64encode(buffer.getvalue()))), policy)
    if processed is None:
        assert estimated == 0
        return
    assert estimated >= len(processed.data)
    if processed.mime == "image/bmp" and mode in ("RGB", "RGBA"):  # a grey one is 8-bit: a third of it
        assert estimated - len(processed.data) <= 1024 + 3 * max(processed.width, processed.height)


# ------------------------------------------------------------------------------- through the proxy


async def test_the_attack_in_small_is_refused_from_the_headers_before_any_decode(
        upstream: Upstream, start_proxy: StartProxy, tmp_path: Path) -> None:
    """Issue 39: three small JPEGs that the model's size makes 3 x 51 MB of base64. Refused 413 in the API's
    shape naming an image, nothing forwarded, nothing decoded or hashed; the gate never saw it."""
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=qwen25(tmp_path), MMGATE_MAX_BODY_MB="8",
                              MMGATE_MAX_INFLIGHT_MEDIA_MB="16", MMGATE_MAX_MM_CONCURRENCY="2")
    uri = data_uri(solid_jpeg(*BIG_SIDES), "image/jpeg")
    assert len(uri) * 3 < 8 << 20  # as received, the body is within the bound
    status, answer = await post(proxy.url, chat_with_images([uri] * 3))
    assert status == 413
    assert answer["error"]["code"] == "body_too_large"
    assert answer["error"]["param"].startswith("messages[0].content[")
    assert "MMGATE_MAX_BODY_MB" in answer["error"]["message"]
    assert upstream.seen == []
    prom = await scrape(proxy.url)
    assert prom[("mmgate_cache_misses_total", ())] == 0  # no item decoded
    assert prom[("mmgate_rejected_total", (("reason", "body_too_large"),))] == 1
    assert proxy.state.cache.entries == 0 and proxy.state.gate.counters().in_use == 0


async def test_a_body_its_image_keeps_within_the_bound_passes_and_one_past_it_does_not(
        upstream: Upstream, start_proxy: StartProxy, tmp_path: Path) -> None:
    """One such JPEG is forwarded as a 4004x3192 BMP (51.1 MB of base64): under a 56 MiB bound it passes, and
    the bytes the backend gets stay under it; under 48 MiB it is refused before its decode."""
    folder = qwen25(tmp_path)
    body = chat_with_image(data_uri(solid_jpeg(*BIG_SIDES), "image/jpeg"))
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=folder, MMGATE_MAX_BODY_MB="56")
    assert (await post(proxy.url, body))[0] == 200
    (seen,) = upstream.seen
    assert len(seen.body) <= 56 << 20
    payload = forwarded_payload(seen.body)
    assert len(payload) == base64_length(BIG_BMP)
    assert Image.open(io.BytesIO(base64.b64decode(payload[:1024]))).size == BIG_FORWARD_SIDES

    tight = await start_proxy(upstream.url, MMGATE_MODEL=folder, MMGATE_MAX_BODY_MB="48")
    status, answer = await post(tight.url, body)
    assert (status, answer["error"]["code"], answer["error"]["param"]) == (
        413, "body_too_large", "messages[0].content[1]")
    assert len(upstream.seen) == 1
    assert (await scrape(tight.url))[("mmgate_cache_misses_total", ())] == 0


async def test_the_gate_weighs_what_a_request_forwards_and_a_cached_rewrite_weighs_its_own(
        upstream: Upstream, start_proxy: StartProxy, tmp_path: Path) -> None:
    """Held at the backend (the lease lasts until the answer is complete): a first request weighs its decoded
    JPEG and the BMP's base64 its header foretells (at most a palette over the real one); the same image again,
    answered from the cache, weighs exactly the base64 it forwards."""
    proxy = await start_proxy(upstream.url, MMGATE_MODEL=str(qwen_folder(tmp_path, "qwen2_5_vl")),
                              MMGATE_RELEASE_AT="complete")
    png = solid_jpeg(3200, 2400)
    body = chat_with_image(data_uri(png, "image/jpeg"))
    gate = proxy.state.gate

    async def weighed(request_number: int) -> tuple[int, bytes]:
        upstream.release.clear()
        task = asyncio.create_task(post(proxy.url, body))
        await eventually(lambda: len(upstream.seen) == request_number, "the request forwarded")
        weight = gate.counters().bytes_in_use
        upstream.release.set()
        assert (await task)[0] == 200
        return weight, forwarded_payload(upstream.seen[-1].body)

    upstream.route(CHAT, lambda request: _held(upstream))
    first, payload = await weighed(1)
    assert len(png) + len(payload) <= first <= len(png) + len(payload) + 1400
    second, again = await weighed(2)
    assert again == payload
    assert second == len(payload)
    assert gate.counters().bytes_in_use == 0


async def test_a_lossy_handoff_past_its_estimate_is_refused_before_it_is_forwarded(
        upstream: Upstream, start_proxy: StartProxy, tmp_path: Path) -> None:
    """The header bounds a JPEG handoff by its raw pixels, which noise at quality 100 (4:4:4) passes: the body's
    exact size is checked again once decoded, and one over MMGATE_MAX_BODY_MB is refused with nothing forwarded.
    Here a 2200x2000 noise JPEG (q75, decoded at half scale) becomes 1064x952: about 0.84, 0.98 and 1.03 of the
    4 MiB bound as received, as estimated and as it would be forwarded."""
    noise = np.random.default_rng(7).integers(0, 256, (2000, 2200, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise, "RGB").save(buffer, "JPEG", quality=75)
    body = chat_with_image(data_uri(buffer.getvalue(), "image/jpeg"))
    assert len(json.dumps(body)) < 4 << 20
    proxy = await start_proxy(upstream.url, MMGATE_IMAGE_FORMAT="jpeg", MMGATE_MAX_BODY_MB="4",
                              MMGATE_MODEL=str(qwen_folder(tmp_path, "qwen2_5_vl", max_pixels=28 * 28 * 1320)))
    status, answer = await post(proxy.url, body)
    assert (status, answer["error"]["code"]) == (413, "body_too_large")
    assert "MMGATE_MAX_BODY_MB" in answer["error"]["message"]
    assert upstream.seen == []
    assert (await scrape(proxy.url))[("mmgate_cache_misses_total", ())] == 1  # this one was decoded
    assert proxy.state.gate.counters().in_use == 0


async def _held(upstream: Upstream) -> Any:
    from aiohttp import web

    await upstream.release.wait()
    return web.json_response({"ok": True})
