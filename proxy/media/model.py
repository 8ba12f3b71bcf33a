"""The served model as mmgate uses it (``Model``): its family, its geometry and its image-token count.

``model_folder.load_model`` reads one from a model folder; each family (``proxy.media.families``) makes its own.

The token count of an image comes from the processor: the image processor's ``get_number_of_image_patches``
and, where the count also depends on the tokenizer (Idefics3/SmolVLM's row and column markers), Idefics3's
``_get_num_multimodal_tokens`` or SmolVLM's image prompt counted with its tokenizer, memoised by the patch
layout that determines it (a bounded set), so each image costs a few microseconds on the event loop. LLaVA 1.5
and Gemma 3 make the same count of every image, asked of their processor once; LLaVA-NeXT's is
``LlavaNextProcessor._get_number_of_features`` (arithmetic on the size).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preprocessors.errors import VIDEO_UNSUPPORTED_BY_MODEL
from preprocessors.geometry import Geometry, upright
from proxy.settings import ConfigError

__all__ = ["Model"]

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
LARGEST_SIDE = 16384  # past every family's cap: Qwen's max_pixels, Idefics3's 4096 px bound, fixed squares


def no_image_tokens(width: int, height: int) -> int:
    """The count of a family mmgate has no geometry for: none (its model is never served: ``app.served_model``)."""
    return 0


def no_video_tokens(frames: int, width: int, height: int) -> int:
    """The count of a family whose video tokens mmgate does not count: none."""
    return 0


@dataclass(frozen=True)
class Model:
    """The loaded model: its family, its geometry (None: an unsupported family, the generic rule applies) and
    the image-token count of an upright ``(width, height)`` image."""

    name: str
    family: str
    geometry: Geometry | None
    count: Callable[[int, int], int] = field(default=no_image_tokens, repr=False)  # of an upright image
    ceiling: int = 0  # the most tokens one image can make, where no single size gives it (Qwen)
    video_count: Callable[[int, int, int], int] = field(default=no_video_tokens, repr=False)

    @property
    def supported(self) -> bool:
        return self.geometry is not None

    @functools.cached_property
    def most_tokens(self) -> int:
        """What an image whose head does not say its size is counted as: the most tokens one image can make,
        so the token budget errs on the safe side. Idefics3 and SmolVLM make the most of a square past their
        cap, LLaVA and Gemma 3 the same of every image; a family's ``ceiling`` is its cap in tokens where no
        square reaches it."""
        return self.ceiling or self.image_tokens(LARGEST_SIDE, LARGEST_SIDE)

    @property
    def counts_video(self) -> bool:
        """Whether the family defines video tokens (Qwen2-VL and its successors)."""
        return self.video_count is not no_video_tokens

    def video_tokens(self, frames: int, width: int, height: int) -> int:
        """Tokens the backend's video processor makes of a clip of ``frames`` frames of ``width`` x ``height``."""
        try:
            return self.video_count(frames, width, height)
        except ValueError as error:  # the processor's own refusal (an aspect ratio over 200)
            raise VIDEO_UNSUPPORTED_BY_MODEL.error(
                f"the served model's processor refuses a {width}x{height} video: {error}") from None

    def image_tokens(self, width: int, height: int, orientation: int = 1) -> int:
        """Tokens the backend's processor makes of a stored image of this size and EXIF orientation; a
        MediaError for an image the processor refuses."""
        return self.count(*upright(width, height, orientation))


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ConfigError(f"MMGATE_MODEL: {path} is not readable JSON ({error})") from None
    return value if isinstance(value, dict) else None
