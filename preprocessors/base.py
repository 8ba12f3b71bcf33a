"""Types shared by the media preprocessors. No aiohttp here: this package is plain, thread-safe Python.

Work runs in decode-pool threads. A thread cannot be killed, so every long operation takes a
``checkpoint`` callable and calls it between steps; it raises ``Cancelled`` once the request timed out
or its client left, so abandoned work stops at the next step boundary instead of running to the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

MediaKind = Literal["image", "audio", "video"]
ImageFormat = Literal["auto", "jpeg", "png", "webp"]
Checkpoint = Callable[[], None]


def no_checkpoint() -> None:
    """A checkpoint that never cancels (benchmarks, unit tests)."""


class MediaError(Exception):
    """Bad media from the client: becomes a 400 (or 413) naming the part. ``code`` is one of the README's error codes."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


class Cancelled(Exception):
    """Raised by a checkpoint: the request no longer wants this work (timeout or client gone)."""


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """What the image preprocessor enforces and produces; built from Settings."""

    max_pixels: int = 64_000_000
    max_frames: int = 64
    resize_max_pixels: int = 0  # 0 = no pixel-count limit
    resize_max_side: int = 0  # 0 = no side limit
    output_format: ImageFormat = "auto"
    jpeg_quality: int = 90
    validate: Literal["full", "header"] = "full"

    @property
    def resizes(self) -> bool:
        return bool(self.resize_max_pixels or self.resize_max_side)


@dataclass(frozen=True, slots=True)
class AudioPolicy:
    max_seconds: float = 600.0


@dataclass(slots=True)
class Processed:
    """A rewritten media item. ``data`` is the new encoded file (not base64); ``mime`` its content type."""

    data: bytes
    mime: str
    width: int = 0
    height: int = 0
    source_width: int = 0
    source_height: int = 0
