"""Which image formats mmgate accepts, told from their magic bytes alone: the allowlist every image parser
(``image``, ``dimensions``) opens Pillow with, and the MIME type a declared type is checked against. And
whether a file of an accepted format is whole, told from its last bytes (``check_whole``): header validation
reads no pixel, so a file cut short would otherwise reach the backend."""

from __future__ import annotations

import re

from .errors import IMAGE_TRUNCATED, UNSUPPORTED_MEDIA_TYPE

__all__ = ["ALLOWED_FORMATS", "MIME_BY_FORMAT", "TAIL_BYTES", "check_whole", "image_mime", "sniff_image_format"]

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
MIME_BY_FORMAT = {
    "JPEG": "image/jpeg",
    "PNG": "image/png",
    "WEBP": "image/webp",
    "GIF": "image/gif",
    "BMP": "image/bmp",
}

# Magic bytes of common formats we refuse, only to name them in the error message.
_REFUSED_SIGNATURES = (
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
    (0, b"8BPS", "PSD"),
    (0, b"\x00\x00\x01\x00", "ICO"),
    (0, b"%PDF", "PDF"),
    (4, b"ftyp", "HEIF/AVIF"),
    (0, b"<", "SVG/XML"),
)


def image_mime(data: bytes) -> str:
    """The true MIME type of ``data`` from its magic bytes (what a declared type is checked against)."""
    return MIME_BY_FORMAT[sniff_image_format(data)]


def sniff_image_format(data: bytes) -> str:
    """The allowed format ``data`` claims by its magic bytes; unsupported_media_type otherwise."""
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:2] == b"BM":
        return "BMP"
    looks_like = next(
        (name for at, magic, name in _REFUSED_SIGNATURES if data[at : at + len(magic)] == magic),
        None,
    )
    found = f" (looks like {looks_like})" if looks_like else ""
    raise UNSUPPORTED_MEDIA_TYPE.error(
        f"not an accepted image format{found}; send {', '.join(ALLOWED_FORMATS)}",
    )


# The last bytes of a file ``check_whole`` reads: an end marker with a short trailer after it is found there.
TAIL_BYTES = 16 << 10

_JPEG_EOI = b"\xff\xd9"
# Inside a JPEG's scan data 0xFF is followed only by a stuffed 0x00, a restart marker (D0-D7) or, between the
# scans of a progressive file, a marker (C0-FE). 0xFF then 01-BF (TEM and reserved codes no encoder writes)
# is no JPEG at all: bytes appended after the image, such as a motion photo's video.
_NOT_JPEG = re.compile(rb"\xff[\x01-\xbf]")
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the IEND chunk: no data, then its fixed CRC
_GIF_END = b"\x00;"  # the last block's terminator, then the trailer 0x3B
_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))  # TEM and RSTn carry no length


def check_whole(fmt: str, head: bytes, tail: bytes, size: int) -> None:
    """Refuse with ``image_truncated`` an image of format ``fmt`` that ends before its format's end: a JPEG
    without its end-of-image marker, a PNG without its IEND chunk, a GIF without its trailer, a WebP shorter
    than its RIFF header says. ``head`` is the file's first bytes (through a JPEG's first scan header),
    ``tail`` its last ``TAIL_BYTES`` (all of it when shorter), ``size`` its length.

    What follows a real end within the tail is accepted as Pillow and browsers accept it: zero padding
    (cameras, card firmware) after any format, any trailer after a JPEG's or a PNG's end (a camera's metadata,
    a line break). A JPEG whose end marker lies further back is still accepted when its tail holds
    bytes no JPEG scan holds (a motion photo's appended video): the tail of a JPEG cut inside its scans never
    does. BMP has no end to check."""
    if fmt == "JPEG":
        if _ends_with(tail, _JPEG_EOI):
            return
        scan = _jpeg_scan_start(head)
        after = max(0, (size if scan is None else scan) - (size - len(tail)))
        if tail.find(_JPEG_EOI, after) < 0 and _NOT_JPEG.search(tail, after) is None:
            raise IMAGE_TRUNCATED.error(
                "JPEG ends without its end-of-image marker (FFD9): the file was cut short; send the whole file")
    elif fmt == "PNG":
        if not tail.endswith(_PNG_IEND) and _PNG_IEND not in tail:
            raise IMAGE_TRUNCATED.error("PNG ends without its IEND chunk: the file was cut short; send the whole file")
    elif fmt == "GIF":
        if not _ends_with(tail, _GIF_END):
            raise IMAGE_TRUNCATED.error(
                "GIF ends without its trailer (0x3B): the file was cut short; send the whole file")
    elif fmt == "WEBP":
        declared = int.from_bytes(head[4:8], "little") + 8
        if size < declared:
            raise IMAGE_TRUNCATED.error(
                f"WEBP file is {size} bytes, its RIFF header says {declared}: the file was cut short; send the "
                "whole file")


def _ends_with(tail: bytes, end: bytes) -> bool:
    """``tail`` ends with ``end``, or with ``end`` and then zero bytes only (padding)."""
    return tail.endswith(end) or (tail.endswith(b"\x00") and tail.rstrip(b"\x00").endswith(end))


def _jpeg_scan_start(head: bytes) -> int | None:
    """Where a JPEG's scan data begins (past its first SOS segment), walking the markers as Pillow's opener
    does (junk and fill bytes between segments skipped); None when ``head`` ends first or a length is bad."""
    at, size = 2, len(head)
    while at + 2 <= size:
        if head[at] != 0xFF:
            at += 1
            continue
        marker = head[at + 1]
        if marker in (0xFF, 0x00):
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        if at + 4 > size:
            return None
        length = int.from_bytes(head[at + 2 : at + 4], "big")
        if length < 2:
            return None
        if marker == 0xDA:
            return at + 2 + length
        at += 2 + length
    return None
