"""Media values: real tiny files made once per process, and every way to send or mangle them.

``blobs`` are small images, an animated GIF, a WAV and a video clip, valid or not for their kind; the strategies
wrap them as data URLs, raw base64 or URLs, with headers and base64 mangled in every way a client could.
"""

from __future__ import annotations

import base64
import functools
import io
import wave
from dataclasses import dataclass
from typing import Any, Literal

from hypothesis import strategies as st
from PIL import Image

from ..media import video_clip
from .json_writer import Media


@dataclass(frozen=True)
class Blob:
    """One file to embed: ``valid`` means mmgate must accept it for its ``kind``."""

    name: str
    kind: Literal["image", "audio", "video", "junk"]
    mime: str
    data: bytes
    pixels: int = 0
    valid: bool = True


def _image(width: int, height: int, fmt: str, mode: str = "RGB", **save: Any) -> bytes:
    buf = io.BytesIO()
    image = Image.new(mode, (width, height), 0)
    for x in range(width):  # a gradient, so the encoders have something to encode
        for y in range(height):
            value = (x * 37 + y * 91) % 256
            image.putpixel((x, y), value if mode in ("L", "P") else (value,) * len(mode))
    image.save(buf, fmt, **save)
    return buf.getvalue()


def _gif_animated() -> bytes:
    frames = [Image.new("P", (10, 10), c) for c in (1, 2, 3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=20, loop=0)
    return buf.getvalue()


def _wav() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(8000)
        out.writeframes(b"\x00\x01" * 40)
    return buf.getvalue()


@functools.cache
def blobs() -> dict[str, tuple[Blob, ...]]:
    """Real tiny files by kind, made once: Pillow in a strategy would dominate the budget."""
    png = _image(24, 16, "PNG")
    images = (
        Blob("png-rgb-24x16", "image", "image/png", png, 24 * 16),
        Blob("png-rgba-12x12", "image", "image/png", _image(12, 12, "PNG", "RGBA"), 144),
        Blob("png-l-2x2", "image", "image/png", _image(2, 2, "PNG", "L"), 4),
        Blob("png-p-4x4", "image", "image/png", _image(4, 4, "PNG", "P"), 16),
        Blob("jpeg-20x20", "image", "image/jpeg", _image(20, 20, "JPEG", quality=80), 400),
        Blob("gif-animated-10x10", "image", "image/gif", _gif_animated(), 100),
        Blob("webp-16x10", "image", "image/webp", _image(16, 10, "WEBP"), 160),
        Blob("bmp-11x9", "image", "image/bmp", _image(11, 9, "BMP"), 99),
    )
    junk = (
        Blob("png-truncated", "junk", "image/png", png[: len(png) // 2], valid=False),
        Blob("png-magic-then-junk", "junk", "image/png", png[:8] + b"\x00junk" * 8, valid=False),
        Blob("text", "junk", "text/plain", b"hello, not an image at all", valid=False),
        Blob("svg", "junk", "image/svg+xml", b'<svg xmlns="http://www.w3.org/2000/svg"/>', valid=False),
        Blob("zeros", "junk", "application/octet-stream", bytes(33), valid=False),
        Blob("one-byte", "junk", "application/octet-stream", b"\xff", valid=False),
    )
    audio = (Blob("wav", "audio", "audio/wav", _wav()),)
    video = (Blob("mp4-h264-16x16", "video", "video/mp4", video_clip(16, 16, 2)),
             Blob("mp4-head-then-junk", "junk", "video/mp4", b"\x00\x00\x00\x18ftypmp42" + bytes(range(40)),
                  valid=False))
    return {"image": images, "junk": junk, "audio": audio, "video": video}


# media strategies


@dataclass(frozen=True)
class Choice:
    """A media value and whether mmgate must accept it (True), must refuse it (False) or may do either (None)."""

    text: str
    clean: bool | None
    pixels: int = 0
    form: Literal["data_uri", "base64", "url"] = "data_uri"


def both(*flags: bool | None) -> bool | None:
    """Combine cleanliness: any False wins, then any None, else True."""
    if any(flag is False for flag in flags):
        return False
    return None if any(flag is None for flag in flags) else True


_B64_VARIANTS = ("std", "std", "std", "std", "urlsafe", "nopad", "lines", "crlf", "space", "extra_pad",
                 "truncated", "empty", "junk_char", "unicode", "lowercase")


@st.composite
def base64_of(draw: st.DrawFn, data: bytes) -> tuple[str, bool]:
    """Base64 of ``data``, possibly mangled; True when it is exactly the standard padded encoding."""
    std = base64.b64encode(data).decode()
    variant = draw(st.sampled_from(_B64_VARIANTS))
    text = std
    if variant == "urlsafe":
        text = base64.urlsafe_b64encode(data).decode()
    elif variant == "nopad":
        text = std.rstrip("=")
    elif variant in ("lines", "crlf"):
        width = draw(st.sampled_from([4, 60, 76]))
        text = ("\n" if variant == "lines" else "\r\n").join(std[i : i + width] for i in range(0, len(std), width))
    elif variant == "space":
        at = draw(st.integers(0, len(std)))
        text = std[:at] + " " + std[at:]
    elif variant == "extra_pad":
        text = std + draw(st.sampled_from(["=", "==", "===", "A="]))
    elif variant == "truncated" and std:
        text = std[: draw(st.integers(0, len(std) - 1))]
    elif variant == "empty":
        text = ""
    elif variant == "junk_char":
        at = draw(st.integers(0, len(std)))
        text = std[:at] + draw(st.sampled_from(["*", "%", "\x00", "-", "_", ".", "\\", '"', ","])) + std[at:]
    elif variant == "unicode":
        at = draw(st.integers(0, len(std)))
        text = std[:at] + draw(st.sampled_from(["é", "😀", "\u2028", "\ufeff"])) + std[at:]
    elif variant == "lowercase":
        text = std.lower()
    return text, text == std and text != ""


def _blob_for(draw: st.DrawFn, kind: str) -> Blob:
    if draw(st.integers(0, 9)) == 0:
        return Blob("random-bytes", "junk", "application/octet-stream", draw(st.binary(max_size=48)), valid=False)
    pool = blobs()
    if kind == "image":
        choices = pool["image"] * 3 + pool["junk"]
    elif kind == "audio":
        choices = pool["audio"] * 3 + pool["junk"] + pool["image"][:1]
    else:
        choices = pool["video"] * 3 + pool["junk"][:2]
    return draw(st.sampled_from(choices))


OTHER_IMAGE_MIME = {"image/png": "image/jpeg", "image/jpeg": "image/png", "image/gif": "image/webp",
                     "image/webp": "image/gif", "image/bmp": "image/png"}


@st.composite
def data_uri(draw: st.DrawFn, kind: str = "image") -> Choice:
    """A ``data:`` URL: valid, or with a broken header, a wrong/non-image/missing MIME type, params, case."""
    blob = _blob_for(draw, kind)
    payload, payload_ok = draw(base64_of(blob.data))
    mime = blob.mime
    header = draw(st.sampled_from([
        ("data:{m};base64,", True), ("data:{m};base64,", True), ("data:{m};base64,", True),
        ("DATA:{M};BASE64,", True), ("Data:{m};Base64,", True),
        ("data:{m};charset=utf-8;base64,", True), ("data:{m};name=cat.png;base64,", True),
        ("data:;base64,", None), ("data:{wrong};base64,", None), ("data:text/plain;base64,", None),
        ("data:application/octet-stream;base64,", None), ("data:{m} ;base64,", None),
        ("data:{m};;base64,", None), ("data: {m};base64,", None), ("data:{m};charset=utf-8,", False),
        ("data:{m},", False), ("data:{m};base64", False), ("data:{m};base64;x=y,", False),
        ("data:{m};" + "p=" + "x" * 300 + ";base64,", False), ("data:imagé/png;base64,", False),
        ("data:{m}%3Bbase64,", False), ("data:", False), ("data:image/\ud800png;base64,", False),
        ("data:{m};charset=\udfff;base64,", False),
    ]))
    template, header_ok = header
    text = template.format(m=mime, M=mime.upper(), wrong=OTHER_IMAGE_MIME.get(mime, "image/png")) + payload
    blob_ok: bool | None = blob.valid if blob.kind == kind else (False if kind == "image" else None)
    return Choice(text, both(header_ok, payload_ok, blob_ok), blob.pixels if blob.kind == "image" else 0)


@st.composite
def raw_base64(draw: st.DrawFn, kind: str = "image") -> tuple[Choice, Blob]:
    blob = _blob_for(draw, kind)
    payload, payload_ok = draw(base64_of(blob.data))
    blob_ok: bool | None = blob.valid if blob.kind == kind else (False if kind == "image" else None)
    return Choice(payload, both(payload_ok, blob_ok), blob.pixels if blob.kind == "image" else 0, "base64"), blob


urls = st.sampled_from([
    Choice("https://example.invalid/cat.png", True, form="url"),
    Choice("http://example.invalid/a/b.jpg?x=1&y=%2F", True, form="url"),
    Choice("HTTPS://EXAMPLE.INVALID/X.PNG", True, form="url"),
    Choice("ftp://example.invalid/x.png", None, form="url"),
    Choice("file:///etc/passwd", None, form="url"),
    Choice("not a url at all", None, form="url"),
    Choice("", None, form="url"),
])


def media_url_or_data(kind: str = "image") -> st.SearchStrategy[Choice]:
    return st.one_of(data_uri(kind), data_uri(kind), data_uri(kind), urls)


def media_node(choice: Choice) -> Media:
    return Media(choice.text, "data", choice.form, choice.pixels if choice.clean is not False else 0)


