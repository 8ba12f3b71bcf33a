"""Types shared by the media preprocessors. No aiohttp here: this package is plain, thread-safe Python.

Work runs in decode-pool threads (or, in process mode, in worker processes, which are killed instead). A
thread cannot be killed, so every long operation takes a ``checkpoint`` callable and calls it between
steps; it raises ``Cancelled`` once the request timed out or its client left, so abandoned work stops at the
next step boundary instead of running to the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .policy_settings import AudioSettings, ImageSettings, VideoSettings

if TYPE_CHECKING:
    from .geometry import Geometry

MediaKind = Literal["image", "audio", "video"]
ImageFormat = Literal["auto", "jpeg", "png", "webp", "bmp"]
Checkpoint = Callable[[], None]


def no_checkpoint() -> None:
    """A checkpoint that never cancels (benchmarks, unit tests)."""


class Cancelled(Exception):
    """Raised by a checkpoint: the request no longer wants this work (timeout or client gone)."""


@dataclass(frozen=True, slots=True)
class ImagePolicy(ImageSettings):
    """What the image preprocessor enforces and produces: the image settings (``ImageSettings``, made from their
    declarations), and the served model's geometry, which is found, not set."""

    # The served model's own geometry (MMGATE_MODEL): when set, it replaces the two resize limits.
    geometry: Geometry | None = None

    @property
    def resizes(self) -> bool:
        return bool(self.resize_max_pixels or self.resize_max_side or self.geometry)


@dataclass(frozen=True, slots=True)
class AudioPolicy(AudioSettings):
    """What the audio check enforces (``preprocessors/audio.py``): the audio settings."""


@dataclass(frozen=True, slots=True)
class VideoPolicy(VideoSettings):
    """What the video probe enforces (``preprocessors/video.py``): the video settings."""


@dataclass(slots=True)
class Processed:
    """A rewritten media item. ``data`` is the new encoded file (not base64); ``mime`` its content type."""

    data: bytes
    mime: str
    width: int = 0
    height: int = 0
    source_width: int = 0
    source_height: int = 0
