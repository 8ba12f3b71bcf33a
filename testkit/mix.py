"""A reproducible mix of multimodal requests, the soak's load (``bench/soak.py``): small and ~1 MP images passed
untouched, 4-12 MP ones resized, invalid media (bad base64, a truncated JPEG) and client disconnects; half
streamed; OpenAI chat and Anthropic messages.

- ``media_set``: the images of each kind (``Media``).
- ``workload``: ``n`` requests drawn from ``MIX`` with a seed, as (path, body, disconnect) (``Work``).
- ``disconnecting_request``: a request written whole on a raw socket and abandoned after a delay.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
from typing import Any

import numpy as np
import pybase64
from PIL import Image

from testkit.media import photo_jpeg, photo_sized

MIX = [("small_png", 55), ("jpeg_1mp", 25), ("jpeg_4mp", 6), ("jpeg_12mp", 3), ("png_6mp", 1),
       ("bad_base64", 2.5), ("truncated_jpeg", 2.5), ("disconnect", 5)]
DISCONNECT_KINDS = ["small_png", "jpeg_1mp", "jpeg_1mp", "jpeg_4mp"]
Media = dict[str, tuple[str, bytes | str]]  # kind -> (mime, raw image bytes, or an already-broken base64 string)
Work = list[tuple[str, bytes, bool]]  # (path, body, disconnect) per request


def encoded(img: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def media_set() -> Media:
    small = encoded(Image.fromarray(np.random.default_rng(7).integers(0, 255, (64, 64, 3), np.uint8)), "PNG")
    one_mp = encoded(photo_sized(1152, 864, 1, noise=9), "JPEG", quality=90)
    return {
        "small_png": ("image/png", small),
        "jpeg_1mp": ("image/jpeg", one_mp),
        "jpeg_4mp": ("image/jpeg", encoded(photo_sized(2309, 1732, 2, noise=9), "JPEG", quality=90)),
        "jpeg_12mp": ("image/jpeg", photo_jpeg()),
        "png_6mp": ("image/png", encoded(photo_sized(2828, 2121, 3, noise=9), "PNG", compress_level=1)),
        "bad_base64": ("image/png", "iVBORw0KGgo!!not*base64??" * 8),
        "truncated_jpeg": ("image/jpeg", one_mp[: len(one_mp) // 2]),
    }


def body_for(mime: str, data: bytes | str, dialect: str, stream: bool) -> tuple[str, bytes]:
    """(path, body) of one request with one image, OpenAI chat or Anthropic messages."""
    b64 = data if isinstance(data, str) else pybase64.b64encode(data).decode()
    text = {"type": "text", "text": "Describe this image."}
    if dialect == "openai":
        path, content = "/v1/chat/completions", [
            text, {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}}]
    else:
        path, content = "/v1/messages", [
            {"type": "image", "source": {"type": "base64", "media_type": mime, "data": b64}}, text]
    msg = {"model": "stub-vlm", "stream": stream, "max_tokens": 16, "messages": [{"role": "user", "content": content}]}
    return path, json.dumps(msg).encode()


def workload(n: int, seed: int, media: Media) -> Work:
    """``n`` requests drawn from ``MIX``; those of the same kind, dialect and stream share one prebuilt body, so the
    client allocates nothing per request."""
    rng = random.Random(seed)
    kinds, weights = zip(*MIX, strict=True)
    bodies: dict[tuple[str, str, bool], tuple[str, bytes]] = {}
    work = []
    for kind in rng.choices(kinds, weights, k=n):
        disconnect = kind == "disconnect"
        if disconnect:
            kind = rng.choice(DISCONNECT_KINDS)
        key = (kind, "openai" if rng.random() < 0.8 else "anthropic", rng.random() < 0.5)
        if key not in bodies:
            bodies[key] = body_for(*media[kind], *key[1:])
        work.append((*bodies[key], disconnect))
    return work


async def disconnecting_request(host: str, port: int, path: str, body: bytes, delay: float) -> str:
    """Write the whole request on a raw socket, wait ``delay`` s (reading whatever comes), then close it."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        writer.write(head)
        writer.write(body)  # not head + body: a copy of the body per request
        await writer.drain()
        try:
            async with asyncio.timeout(delay):
                while await reader.read(65536):
                    pass
            return "disconnect_too_late"  # the answer finished before we hung up
        except TimeoutError:
            return "disconnect"
    finally:
        writer.transport.abort()
