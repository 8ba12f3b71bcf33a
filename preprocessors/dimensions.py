"""An image's size and EXIF orientation from the first bytes of its base64, without decoding a pixel.

The token estimate runs on the event loop before admission, once per image, so it must cost microseconds:
only a short head of the payload is base64-decoded and handed to Pillow, which parses the header (PNG IHDR,
JPEG markers up to the frame header, WEBP/GIF/BMP headers) and stops. A JPEG whose EXIF block or thumbnail
pushes the frame header further is retried with a longer head, up to ``MAX_HEAD_BYTES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from io import BytesIO

import pybase64
from PIL import Image

from .base import MediaError
from .image import _orientation, _sniff

# Decoded bytes tried in turn: most headers fit the first; an EXIF thumbnail (up to 64 KiB) the second.
HEAD_STEPS = (3 << 10, 96 << 10)
MAX_HEAD_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Dimensions:
    """The stored size and EXIF orientation (1 when absent) of an image."""

    width: int
    height: int
    orientation: int = 1


def peek_dimensions(payload: bytes | memoryview) -> Dimensions | None:
    """The dimensions of the image whose base64 ``payload`` this is; None when its head does not say (not
    base64, not an accepted format, a header longer than ``MAX_HEAD_BYTES``): the decode worker then refuses
    the image or measures it, and this estimate counts nothing for it."""
    for head_bytes in (*HEAD_STEPS, MAX_HEAD_BYTES):
        chars = head_bytes // 3 * 4
        head = payload[:chars]
        try:
            data = pybase64.b64decode(head, validate=True)
        except ValueError:
            return None
        found = _from_head(data)
        if found is not None or len(head) < chars:
            return found
    return None


def _from_head(data: bytes) -> Dimensions | None:
    try:
        fmt = _sniff(data)
    except MediaError:
        return None
    try:
        with Image.open(BytesIO(data), formats=(fmt,)) as img:
            width, height = img.size
            orientation = _orientation(img) if fmt == "JPEG" else 1
    except Exception:  # a head cut inside the header, or a corrupt one: Pillow raises many types
        return None
    return Dimensions(width, height, orientation)
