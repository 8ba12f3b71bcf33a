"""``MMGATE_MODEL``: the served model's processor, read offline, as a geometry and an image-token count.

The model is a local folder or a name already in the Hugging Face cache. Its processor configuration is
loaded with ``transformers`` (the optional ``model`` extra) through the PIL image processors, which need no
torch, and with the network off (``HF_HUB_OFFLINE``, ``local_files_only``): mmgate never downloads anything.
What is missing (the extra, the folder, the processor configuration, a tokenizer a count needs) is a
``ConfigError`` naming it, so ``mmgate`` stops at start-up with status 2.

Families: one module each in ``proxy.media.families``, tried in the order ``FAMILIES`` lists them (docs/model.md's
table is generated from it). Any other model keeps the generic resize rule, with a warning naming it; so does a
family whose processor transformers ships only for torch or as remote code (``families.GENERIC``), with the
reason.

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
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from preprocessors.errors import VIDEO_UNSUPPORTED_BY_MODEL
from preprocessors.geometry import Geometry, upright
from proxy.settings import ConfigError

log = logging.getLogger("mmgate")

__all__ = ["Model", "load_model"]

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


@functools.cache
def load_model(spec: str) -> Model:
    """Load ``spec`` (a folder or a cached model name) once per process; ConfigError names what is missing."""
    # Before huggingface_hub or transformers is imported (they read these once): never the network, and not
    # transformers' note that torch is absent (none is needed).
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # The families import this module (Model): imported here, once it is whole.
    from .families import FAMILIES, GENERIC
    from .families.base import Found

    folder = _resolve(spec)
    try:
        from transformers import AutoImageProcessor
    except ImportError:
        raise ConfigError("MMGATE_MODEL needs the model extra: pip install 'mmgate[model]' "
                          "(transformers is not installed)") from None
    image_type = _image_processor_type(folder)
    model_type = _model_type(folder)
    generic = GENERIC.get(image_type) or _remote_code(folder, model_type or image_type)
    if generic is not None:  # no PIL processor to load: the generic rule, with the reason
        names, reason = generic
        log.warning("MMGATE_MODEL=%s: the %s family (%s) has no model geometry in mmgate (%s); images follow the "
                    "generic rule (MMGATE_RESIZE_MAX_*) and no image tokens are counted", spec, names, image_type,
                    reason)
        return Model(spec, names, None)
    try:
        processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
    except Exception as error:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: the image processor in {folder} could not be loaded "
                          f"offline ({type(error).__name__}: {str(error)[:200]})") from None
    found = Found(spec, folder, image_type, model_type, processor)
    family = next((family for family in FAMILIES if family.recognise(found)), None)
    if family is None:
        name = model_type or image_type
        log.warning("MMGATE_MODEL=%s: the %s family (%s) has no model geometry in mmgate; images follow the generic "
                    "rule (MMGATE_RESIZE_MAX_*) and no image tokens are counted", spec, name, image_type)
        return Model(spec, name, None)
    model = family.load(found)
    if model.geometry is None:
        return model
    # The filter the processor's PIL backend resizes with: mmgate resizes with the same (image.process_image).
    resample = getattr(processor, "resample", None)
    if resample is None:
        return model
    return replace(model, geometry=replace(model.geometry, resample=int(resample)))  # type: ignore[type-var]


def _resolve(spec: str) -> Path:
    """A local folder as it is; otherwise a name looked up in the Hugging Face cache, offline."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or spec.startswith((".", "~")) or spec.count("/") > 1:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: no such folder")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: not a folder, and looking up a cached model name needs the "
                          "model extra: pip install 'mmgate[model]'") from None
    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: not a folder and not in the Hugging Face cache "
                          "(mmgate never downloads: fetch the model first, or point at its folder)") from None


def _image_processor_type(folder: Path) -> str:
    """The processor class the folder names, without its backend suffix (``Pil``, ``Fast``)."""
    for name in PROCESSOR_FILES:
        config = read_json(folder / name)
        if config is None:
            continue
        config = config.get("image_processor", config)
        kind = str(config.get("image_processor_type", ""))
        if kind:
            for suffix in ("Pil", "Fast"):
                kind = kind.removesuffix(suffix)
            return kind
    raise ConfigError(f"MMGATE_MODEL: {folder} has no image processor configuration (looked for "
                      f"{' or '.join(PROCESSOR_FILES)} naming an image_processor_type)")


def _remote_code(folder: Path, family: str) -> tuple[str, str] | None:
    """``(family, reason)`` where the folder's image processor is remote code (its configuration maps it with
    ``auto_map``), which transformers loads only with ``trust_remote_code`` and mmgate never runs."""
    for name in PROCESSOR_FILES:
        config = read_json(folder / name) or {}
        config = config.get("image_processor", config) if isinstance(config.get("image_processor"), dict) else config
        if isinstance(config.get("auto_map"), dict):
            return family, "its processor is remote code (`auto_map`), which mmgate never runs"
    return None


def _model_type(folder: Path) -> str:
    config = read_json(folder / "config.json") or {}
    return str(config.get("model_type", ""))
