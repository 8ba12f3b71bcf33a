"""What an image's header says before a pixel is decoded: its format, stored size and EXIF orientation, whether it
may carry alpha, and the file's length (``Header``), read once per image and handed on.

An inline image's header is read from the ends of its base64 (``dataurl.Base64Ends``: ``inline_header``), a
fetched one's from its bytes (``fetched_header``). The media step reads it once for each image it may rewrite and
hands it to each stage that asks: the bound on what is forwarded (``proxy/media/forwarded.py``) and the served
model's plan of the resize (``job.with_planned_targets``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from io import BytesIO

from PIL import Image

from .dataurl import Base64Ends
from .dimensions import HEAD_STEPS, Dimensions, header_dimensions, peek_dimensions
from .errors import MediaError
from .formats import sniff_image_format


@dataclass(frozen=True, slots=True)
class Header:
    """What an image's first bytes say: its stored size and EXIF orientation, and whether it may carry alpha
    (True where the head does not say); its format and the file's length."""

    dimensions: Dimensions | None  # None: the head does not say
    alpha: bool
    format: str = "PNG"
    file_bytes: int = 0


def inline_header(ends: Base64Ends) -> Header | None:
    """The header of an inline image from its base64: the dimensions as the token count reads them, and the
    alpha from the first KiBs; None when it is not base64 of an accepted image (the decode refuses it)."""
    try:
        fmt = ends.image_format()
        head = ends.head(HEAD_STEPS[0])
    except MediaError:
        return None
    return Header(peek_dimensions(ends.head, fmt), _may_have_alpha(fmt, head), fmt, ends.size())


def fetched_header(data: bytes) -> Header | None:
    """The header of a fetched image, from its bytes."""
    head = data[: HEAD_STEPS[0]]
    try:
        fmt = sniff_image_format(head)
    except MediaError:
        return None
    return Header(header_dimensions(data), _may_have_alpha(fmt, head), fmt, len(data))


def _may_have_alpha(fmt: str, head: bytes) -> bool:
    """Whether the image may come out with alpha (``image._to_working_mode``): never a JPEG; a WebP as its first
    chunk says; a PNG, GIF or BMP as Pillow reads its header (a transparency chunk comes before the pixels)."""
    if fmt == "JPEG":
        return False
    if fmt == "WEBP":
        chunk = head[12:16]
        if chunk == b"VP8 ":
            return False
        if chunk == b"VP8X" and len(head) > 20:
            return bool(head[20] & 0x10)
        if chunk == b"VP8L" and len(head) >= 25:
            return bool(struct.unpack_from("<I", head, 21)[0] >> 28 & 1)
        return True
    try:
        with Image.open(BytesIO(head), formats=(fmt,)) as img:
            return img.has_transparency_data or img.mode in ("RGBA", "LA", "PA", "La", "RGBa")
    except Exception:  # a head cut inside the header, or a corrupt one: alpha cannot be ruled out
        return True
