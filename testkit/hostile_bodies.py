"""Hostile chat bodies of a given size, each built to make a JSON walk work hard (``bench/loop_stall.py`` sends
them one at a time while it probes the event loop). All name "image", so the sniff sends them to the walk:

* ``image_flood``: one user message of as many tiny image parts (a 1x1 PNG data URI) as fit;
* ``text_flood``: as many small text parts whose text mentions "an image" as fit (a text-only body);
* ``deep``: an ``image_url`` whose value is arrays nested as deep as the size allows;
* ``invalid``: the text flood with its last byte cut off (JSON that is invalid only at its end);
* ``big_image``: one valid PNG of random pixels whose data URI fills the body.
"""

from __future__ import annotations

import base64
import io

KINDS = ("image_flood", "text_flood", "deep", "invalid", "big_image")


def _png_uri(png: bytes) -> bytes:
    return b"data:image/png;base64," + base64.b64encode(png)


def _tiny_png_uri() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (1, 1), "red").save(out, "PNG")
    return _png_uri(out.getvalue())


def big_png_uri(size: int) -> bytes:
    """A data URI of about ``size`` bytes: a PNG of random pixels (incompressible, so its size is its pixels)."""
    import numpy as np
    from PIL import Image

    side = int((size * 3 / 4 / 3) ** 0.5)
    pixels = np.random.default_rng(7).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    return _png_uri(out.getvalue())


def _parts_body(part: bytes, size: int) -> bytes:
    head, tail = b'{"model":"m","messages":[{"role":"user","content":[', b"]}]}"
    n = max(1, (size - len(head) - len(tail)) // (len(part) + 1))
    return head + b",".join([part] * n) + tail


def body_for(kind: str, size: int) -> bytes:
    """A body of ``kind`` (one of ``KINDS``) of about ``size`` bytes."""
    if kind == "image_flood":
        return _parts_body(b'{"type":"image_url","image_url":{"url":"' + _tiny_png_uri() + b'"}}', size)
    if kind in ("text_flood", "invalid"):
        body = _parts_body(b'{"type":"text","text":"an image of a cat"}', size)
        return body[:-1] if kind == "invalid" else body
    if kind == "deep":
        head = b'{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":'
        tail = b"}]}]}"
        depth = (size - len(head) - len(tail)) // 2
        return head + b"[" * depth + b"]" * depth + tail
    if kind == "big_image":
        head = b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},' \
               b'{"type":"image_url","image_url":{"url":"'
        return head + big_png_uri(size - len(head) - 8) + b'"}}]}]}'
    raise ValueError(kind)
