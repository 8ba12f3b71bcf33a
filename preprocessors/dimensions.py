"""An image's size and EXIF orientation from the first bytes of its base64, without decoding a pixel.

The token estimate runs on the event loop before admission, once per image, so it must cost microseconds:
only a short head of the payload is base64-decoded. PNG, GIF and BMP heads go to Pillow, which reads their
fixed headers and stops. Two formats are read here instead, because Pillow cannot do it from a head or not in
microseconds: a JPEG's markers are walked to the frame header (SOFn, ITU-T T.81 B.2.2) and its EXIF segment
(APP1) searched for the orientation tag (Pillow's JPEG opener parses every table and the whole EXIF block in
Python and costs about 100 µs); a WEBP's first chunk (VP8, VP8L or VP8X: RFC 9649 section 2.5-2.7) holds its
size, while Pillow's opener needs the whole file. A JPEG whose EXIF block or thumbnail pushes the frame
header further is retried with a longer head, up to ``MAX_HEAD_BYTES``. Tests compare every format with
Pillow on the whole file.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from io import BytesIO

from PIL import Image

from .errors import MediaError
from .formats import sniff_image_format

# Decoded bytes tried in turn: most headers fit the first; an EXIF thumbnail (up to 64 KiB) the second.
HEAD_STEPS = (3 << 10, 96 << 10)
MAX_HEAD_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Dimensions:
    """The stored size and EXIF orientation (1 when absent) of an image."""

    width: int
    height: int
    orientation: int = 1


def peek_dimensions(head: Callable[[int], bytes], fmt: str | None = None) -> Dimensions | None:
    """The dimensions of an image from its first bytes, ``head(n)`` giving the first ``n`` decoded (fewer: the
    whole file; ``dataurl.Base64Ends.head`` for base64), its format ``fmt`` when already sniffed; None when its
    head does not say (not base64, not an accepted format, a header longer than ``MAX_HEAD_BYTES``): the decode
    worker then refuses the image or measures it, and this estimate counts nothing for it."""
    for head_bytes in (*HEAD_STEPS, MAX_HEAD_BYTES):
        try:
            data = head(head_bytes)
        except MediaError:
            return None
        found = _from_head(data, fmt)
        if found is not None or len(data) < head_bytes // 3 * 3:
            return found
    return None


def header_dimensions(data: bytes) -> Dimensions | None:
    """What ``peek_dimensions`` reads, from the decoded file: the decode worker checks it against Pillow."""
    for head_bytes in (*HEAD_STEPS, MAX_HEAD_BYTES):
        found = _from_head(data[:head_bytes])
        if found is not None or len(data) <= head_bytes:
            return found
    return None


def _from_head(data: bytes, fmt: str | None = None) -> Dimensions | None:
    if fmt is None:
        try:
            fmt = sniff_image_format(data)
        except MediaError:
            return None
    if fmt == "JPEG":
        return _jpeg(data)
    if fmt == "WEBP":
        return _webp(data)
    try:
        with Image.open(BytesIO(data), formats=(fmt,)) as img:
            width, height = img.size
            orientation = 1
    except Exception:  # a head cut inside the header, or a corrupt one: Pillow raises many types
        return None
    return Dimensions(width, height, orientation)


# SOF markers: 0xC0-0xCF except DHT (C4), JPG (C8) and DAC (CC), which are no frame headers.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))  # TEM and RSTn carry no length
_ORIENTATION = 0x0112


def _jpeg(data: bytes) -> Dimensions | None:
    """Walk the markers from SOI to SOS as Pillow's opener does (junk between markers skipped, the last frame
    header wins, the first EXIF segment gives the orientation); None when the head ends first or a segment is
    malformed."""
    at, size = 2, len(data)
    found: tuple[int, int] | None = None
    orientation: int | None = None
    while at + 2 <= size:
        if data[at] != 0xFF:  # junk between segments
            at += 1
            continue
        marker = data[at + 1]
        if marker in (0xFF, 0x00):  # fill byte, or a stuffed zero
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        if marker == 0xDA:  # start of scan: the header is over
            if found is None:
                return None
            return Dimensions(found[0], found[1], orientation or 1)
        if at + 4 > size:
            return None
        (length,) = struct.unpack_from(">H", data, at + 2)
        if length < 2 or at + 2 + length > size:
            return None  # malformed, or the segment runs past the head: a longer head is needed
        if marker in _SOF:
            if length < 7:
                return None
            height, width = struct.unpack_from(">HH", data, at + 5)
            found = (width, height)
        elif marker == 0xE1 and orientation is None and data[at + 4 : at + 10] == b"Exif\x00\x00":
            orientation = _exif_orientation(data[at + 10 : at + 2 + length])
        at += 2 + length
    return None


def _exif_orientation(tiff: bytes) -> int:
    """Tag 0x0112 of IFD0 (TIFF 6.0 section 2, EXIF 2.32 section 4.6.4): a SHORT from 1 to 8, else 1. Pillow's
    ``Image.Exif.load`` reads every IFD0 entry's value and costs tens of microseconds; this reads one."""
    if tiff[:4] == b"II*\x00":
        order = "<"
    elif tiff[:4] == b"MM\x00*":
        order = ">"
    else:
        return 1
    try:
        (ifd,) = struct.unpack_from(order + "I", tiff, 4)
        (entries,) = struct.unpack_from(order + "H", tiff, ifd)
        for entry in range(ifd + 2, ifd + 2 + 12 * min(entries, 256), 12):
            tag, kind, count = struct.unpack_from(order + "HHI", tiff, entry)
            if tag == _ORIENTATION:
                if count != 1 or kind not in (3, 4):  # SHORT, or a LONG some writers use
                    return 1
                (value,) = struct.unpack_from(order + ("H" if kind == 3 else "I"), tiff, entry + 8)
                return value if 1 <= value <= 8 else 1
    except struct.error:  # an entry past the end of the segment: malformed, ignored as the decode worker does
        return 1
    return 1


def _webp(data: bytes) -> Dimensions | None:
    """The canvas size from the first chunk after ``RIFF....WEBP``."""
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:
        width = 1 + int.from_bytes(data[24:27], "little")
        height = 1 + int.from_bytes(data[27:30], "little")
        return Dimensions(width, height)
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack_from("<HH", data, 26)
        return Dimensions(width & 0x3FFF, height & 0x3FFF)
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        (bits,) = struct.unpack_from("<I", data, 21)
        return Dimensions(1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF))
    return None
