"""Which image formats mmgate accepts, told from their magic bytes alone: the allowlist every image parser
(``image``, ``dimensions``) opens Pillow with, and the MIME type a declared type is checked against."""

from __future__ import annotations

from .errors import UNSUPPORTED_MEDIA_TYPE

__all__ = ["ALLOWED_FORMATS", "MIME_BY_FORMAT", "image_mime", "sniff_image_format"]

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
