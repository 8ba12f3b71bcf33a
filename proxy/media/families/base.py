"""What every family shares: the ``Family`` interface the registry lists, and the
loading helpers (offline processors, configuration files, the ConfigError that names what is missing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from preprocessors.geometry import Geometry, model_size
from proxy.media.model import PROCESSOR_FILES, Model, no_video_tokens, read_json
from proxy.settings import ConfigError

# The most tokens of a strip that a smart_resize keeps one token wide (its side clamped up to the factor) while
# the other side grows to the aspect-ratio limit it refuses past (200): 200 tokens, whatever max_pixels says.
STRIP_TOKENS = 200

__all__ = ["PROCESSOR_FILES", "Family", "Found", "Model", "checked", "load_processor", "merged_patches",
           "needs_processor", "no_video_tokens", "pixel_range_tokens", "read_json"]


def merged_patches(processor: Any, merge_size: int) -> Callable[[int, int], int]:
    """The image tokens of a patch-merging family (Qwen's, GLM's, PaddleOCR-VL's ``_get_num_multimodal_tokens``):
    the image processor's patches // ``merge_size`` ** 2. The processor itself is not loaded (their video
    processors need torch); tests check this against the processors' own output."""
    per_token = merge_size ** 2

    def count(width: int, height: int) -> int:
        return int(processor.get_number_of_image_patches(height, width, {})) // per_token

    return count


def pixel_range_tokens(max_pixels: int, token_pixels: int) -> int:
    """The most image tokens a ``smart_resize`` to at most ``max_pixels`` leaves, a token being ``token_pixels``:
    the range's top in tokens, or a strip's ``STRIP_TOKENS`` where a small range makes that more."""
    return max(max_pixels // token_pixels, STRIP_TOKENS)


def checked(geometry: Geometry, count: Callable[[int, int], int]) -> Callable[[int, int], int]:
    """``count`` of an image the processor takes; else the refusal of ``preprocessors.geometry.model_size``."""

    def checked_count(width: int, height: int) -> int:
        model_size(geometry, width, height)  # MediaError for an image the processor refuses
        return count(width, height)

    return checked_count


@dataclass(frozen=True)
class Found:
    """What a model folder says about its processor: the names a family is recognised by, and the loaded image
    processor (PIL backend) a family reads its geometry from."""

    spec: str  # MMGATE_MODEL as given
    folder: Path
    image_type: str  # image_processor_type without its backend suffix (``Pil``, ``Fast``)
    model_type: str  # config.json's model_type ("" where the folder has none)
    image_processor: Any


@dataclass(frozen=True)
class Family:
    """One family in the model mode: how it is recognised, what it loads, and its row of docs/model.md's table.

    A family module defines a subclass with the ``image_types`` (and ``model_types``) it is recognised by, or
    its own ``recognise``, and ``load``, and an instance of it, listed in
    ``proxy.media.families.FAMILIES``; the table is generated from these fields
    (``python -m proxy.media.families``)."""

    names: str  # the models it covers, as the table names them
    processor: str  # the processor class and what tells it apart
    resizes_to: str  # what mmgate forwards
    counts: str  # how the image tokens are counted
    kwargs: tuple[str, ...] = ()  # vLLM --mm-processor-kwargs keys whose values the processor config carries
    vllm: str = ""  # where vLLM's processing differs from transformers', and what mmgate follows

    image_types: ClassVar[tuple[str, ...]] = ()  # the image processor classes it takes ...
    model_types: ClassVar[tuple[str, ...]] = ()  # ... for these model types only (none: for any)

    def recognise(self, found: Found) -> bool:
        return found.image_type in self.image_types and (not self.model_types or found.model_type in self.model_types)

    def load(self, found: Found) -> Model:
        raise NotImplementedError


def load_processor(found: Found, family: str) -> Any:
    """The folder's whole processor (image processor and tokenizer), offline; a ConfigError naming what the
    count of ``family``'s image tokens needs where it cannot be loaded."""
    try:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(found.folder), local_files_only=True, backend="pil")
    except Exception as error:
        raise needs_processor(found, family, error) from None


def needs_processor(found: Found, family: str, error: Exception) -> ConfigError:
    return ConfigError(f"MMGATE_MODEL={found.spec!r}: counting {family} image tokens needs the model's processor "
                       f"and tokenizer in {found.folder}, which could not be loaded offline "
                       f"({type(error).__name__}: {str(error)[:200]})")
