"""``MMGATE_MODEL``: the served model's processor, read offline, as a geometry and an image-token count.

The model is a local folder or a name already in the Hugging Face cache. Its processor configuration is
loaded with ``transformers`` (the optional ``model`` extra) through the PIL image processors, which need no
torch, and with the network off (``HF_HUB_OFFLINE``, ``local_files_only``): mmgate never downloads anything.
What is missing (the extra, the folder, the processor configuration, a tokenizer a count needs) is a
``ConfigError`` naming it, so ``mmgate`` stops at start-up with status 2.

Families: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (``QwenVL``), Idefics3 and SmolVLM (``Idefics3``), LLaVA 1.5
(``ShortestEdge``), LLaVA-NeXT's any-res grid (``LlavaNext``), Gemma 3 without pan-and-scan (``Square``). Any
other model keeps the generic resize rule, with a warning naming it.

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
from preprocessors.geometry import Geometry, Idefics3, LlavaNext, QwenVL, ShortestEdge, Square, model_size, upright
from proxy.settings import ConfigError

log = logging.getLogger("mmgate")

_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
_QWEN_TYPES = {"Qwen2VLImageProcessor": "qwen2-vl"}
_QWEN_MODEL_TYPES = {"qwen2_vl": "qwen2-vl", "qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl"}
_IDEFICS_MODULES = {
    "Idefics3ImageProcessor": ("idefics3", "transformers.models.idefics3.image_processing_pil_idefics3"),
    "SmolVLMImageProcessor": ("smolvlm", "transformers.models.smolvlm.image_processing_pil_smolvlm"),
}


_LARGEST_SIDE = 16384  # past every family's cap: Qwen's max_pixels, Idefics3's 4096 px bound, fixed squares


def _no_image_tokens(width: int, height: int) -> int:
    """The count of a family mmgate has no geometry for: none (its model is never served: ``app.served_model``)."""
    return 0


def _no_video_tokens(frames: int, width: int, height: int) -> int:
    """The count of a family whose video tokens mmgate does not count: none."""
    return 0


def _checked(geometry: Geometry, count: Callable[[int, int], int]) -> Callable[[int, int], int]:
    """``count`` of an image the processor takes; else the refusal of ``preprocessors.geometry.model_size``."""

    def checked(width: int, height: int) -> int:
        model_size(geometry, width, height)  # MediaError for an image the processor refuses
        return count(width, height)

    return checked


@dataclass(frozen=True)
class Model:
    """The loaded model: its family, its geometry (None: an unsupported family, the generic rule applies) and
    the image-token count of an upright ``(width, height)`` image."""

    name: str
    family: str
    geometry: Geometry | None
    count: Callable[[int, int], int] = field(default=_no_image_tokens, repr=False)  # of an upright image
    ceiling: int = 0  # the most tokens one image can make, where no single size gives it (Qwen)
    video_count: Callable[[int, int, int], int] = field(default=_no_video_tokens, repr=False)

    @property
    def supported(self) -> bool:
        return self.geometry is not None

    @functools.cached_property
    def most_tokens(self) -> int:
        """What an image whose head does not say its size is counted as: the most tokens one image can make,
        so the token budget errs on the safe side. Idefics3 and SmolVLM make the most of a square past their
        cap, LLaVA and Gemma 3 the same of every image; Qwen's ``ceiling`` is its pixel cap in tokens."""
        return self.ceiling or self.image_tokens(_LARGEST_SIDE, _LARGEST_SIDE)

    @property
    def counts_video(self) -> bool:
        """Whether the family defines video tokens (Qwen2-VL and its successors)."""
        return self.video_count is not _no_video_tokens

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


@functools.cache
def load_model(spec: str) -> Model:
    """Load ``spec`` (a folder or a cached model name) once per process; ConfigError names what is missing."""
    # Before huggingface_hub or transformers is imported (they read these once): never the network, and not
    # transformers' note that torch is absent (none is needed).
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    folder = _resolve(spec)
    try:
        from transformers import AutoImageProcessor
    except ImportError:
        raise ConfigError("MMGATE_MODEL needs the model extra: pip install 'mmgate[model]' "
                          "(transformers is not installed)") from None
    image_type = _image_processor_type(folder)
    try:
        processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
    except Exception as error:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: the image processor in {folder} could not be loaded "
                          f"offline ({type(error).__name__}: {str(error)[:200]})") from None
    model = _family_model(spec, folder, image_type, processor)
    if model.geometry is None:
        return model
    # The filter the processor's PIL backend resizes with: mmgate resizes with the same (image.process_image).
    resample = getattr(processor, "resample", None)
    if resample is None:
        return model
    return replace(model, geometry=replace(model.geometry, resample=int(resample)))  # type: ignore[type-var]


def _family_model(spec: str, folder: Path, image_type: str, processor: Any) -> Model:
    """The model of ``image_type``'s family, from its loaded image processor."""
    model_type = _model_type(folder)
    if image_type in _QWEN_TYPES:
        family = _QWEN_MODEL_TYPES.get(model_type, _QWEN_TYPES[image_type])
        return _qwen(spec, family, processor, folder)
    if image_type in _IDEFICS_MODULES:
        family, module = _IDEFICS_MODULES[image_type]
        return _idefics3(spec, family, module, folder, processor)
    if image_type in ("CLIPImageProcessor", "LlavaImageProcessor") and model_type == "llava":
        size, pad = processor.size, bool(image_type == "LlavaImageProcessor" and getattr(processor, "do_pad", False))
        geometry: Geometry = (ShortestEdge("llava", int(size.shortest_edge or size.height), pad)
                              if size.shortest_edge or pad else Square("llava", int(size.width), int(size.height)))
        return _constant(spec, "llava", folder, geometry)
    if image_type == "LlavaNextImageProcessor" and model_type == "llava_next":
        return _llava_next(spec, folder, processor)
    if image_type == "Gemma3ImageProcessor" and not getattr(processor, "do_pan_and_scan", False):
        return _constant(spec, "gemma3", folder, Square("gemma3", int(processor.size.width),
                                                         int(processor.size.height)))
    family = model_type or image_type
    if image_type == "Gemma3ImageProcessor":
        family = "gemma3 with pan-and-scan"
    log.warning("MMGATE_MODEL=%s: the %s family (%s) has no model geometry in mmgate; images follow the generic "
                "rule (MMGATE_RESIZE_MAX_*) and no image tokens are counted", spec, family, image_type)
    return Model(spec, family, None)


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


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ConfigError(f"MMGATE_MODEL: {path} is not readable JSON ({error})") from None
    return value if isinstance(value, dict) else None


def _image_processor_type(folder: Path) -> str:
    """The processor class the folder names, without its backend suffix (``Pil``, ``Fast``)."""
    for name in _PROCESSOR_FILES:
        config = _read_json(folder / name)
        if config is None:
            continue
        config = config.get("image_processor", config)
        kind = str(config.get("image_processor_type", ""))
        if kind:
            for suffix in ("Pil", "Fast"):
                kind = kind.removesuffix(suffix)
            return kind
    raise ConfigError(f"MMGATE_MODEL: {folder} has no image processor configuration (looked for "
                      f"{' or '.join(_PROCESSOR_FILES)} naming an image_processor_type)")


def _model_type(folder: Path) -> str:
    config = _read_json(folder / "config.json") or {}
    return str(config.get("model_type", ""))


def _qwen(spec: str, family: str, processor: Any, folder: Path) -> Model:
    size = processor.size
    geometry = QwenVL(family, int(processor.patch_size), int(processor.merge_size),
                      int(size.shortest_edge), int(size.longest_edge))
    per_token = int(processor.merge_size) ** 2

    def count(width: int, height: int) -> int:
        # Qwen2VLProcessor._get_num_multimodal_tokens: patches // merge_size ** 2 (its video processor needs
        # torch, so the processor itself is not loaded; tests check this against the processor's own output).
        return int(processor.get_number_of_image_patches(height, width, {})) // per_token

    # smart_resize keeps height x width within max_pixels, and a token is (patch_size x merge_size)^2 pixels.
    ceiling = geometry.max_pixels // (geometry.patch_size * geometry.merge_size) ** 2
    # Qwen3-VL's video prompt adds a timestamp in text to every frame pair: its video tokens are not counted.
    video_count = _qwen_video_count(folder, processor) if family in ("qwen2-vl", "qwen2.5-vl") else _no_video_tokens
    return Model(spec, family, geometry, _checked(geometry, count), ceiling, video_count)


def _qwen_video_count(folder: Path, image_processor: Any) -> Callable[[int, int, int], int]:
    """``Qwen2VLVideoProcessor.get_num_of_video_patches // merge_size ** 2``: each frame brought within the
    video processor's pixel bounds (``smart_resize``), frames paired by ``temporal_patch_size`` (the last
    repeated to fill a pair). The video processor itself needs torch, so its configuration is read as its
    ``from_pretrained`` reads it: ``processor_config.json``'s ``video_processor``, else
    ``video_preprocessor_config.json``, else the image processor's file, with
    ``min_pixels``/``max_pixels`` over ``size``; what neither names is the image processor's
    (tests/proxy/media/test_model.py checks the count against the video processor's own method, taken from its
    source and run without torch)."""
    nested = (_read_json(folder / "processor_config.json") or {}).get("video_processor")
    config = (nested if isinstance(nested, dict) else None) or _read_json(folder / "video_preprocessor_config.json") \
        or _read_json(folder / _PROCESSOR_FILES[0]) or {}
    named = config.get("size")
    size: dict[str, Any] = named if isinstance(named, dict) else {}
    image_size = image_processor.size
    min_pixels = int(config.get("min_pixels") or size.get("shortest_edge") or image_size.shortest_edge)
    max_pixels = int(config.get("max_pixels") or size.get("longest_edge") or image_size.longest_edge)
    patch = int(config.get("patch_size") or image_processor.patch_size)
    merge = int(config.get("merge_size") or image_processor.merge_size)
    temporal = int(config.get("temporal_patch_size") or image_processor.temporal_patch_size)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    def count(frames: int, width: int, height: int) -> int:
        h, w = smart_resize(height, width, factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
        grid_t = -(-frames // temporal)
        return grid_t * (h // patch) * (w // patch) // merge ** 2

    return count


def _constant(spec: str, family: str, folder: Path, geometry: Geometry) -> Model:
    """LLaVA 1.5 and Gemma 3 make the same number of tokens of every image: their processor says how many."""
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
        tokens = int(processor._get_num_multimodal_tokens(image_sizes=[[1, 1]]).num_image_tokens[0])
    except Exception as error:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: counting {family} image tokens needs the model's processor and "
                          f"tokenizer in {folder}, which could not be loaded offline "
                          f"({type(error).__name__}: {str(error)[:200]})") from None
    return Model(spec, family, geometry, _checked(geometry, lambda _width, _height: tokens))


def _idefics3(spec: str, family: str, module: str, folder: Path, image_processor: Any) -> Model:
    geometry = Idefics3(family, module, int(image_processor.size.longest_edge),
                        int(image_processor.max_image_size["longest_edge"]), bool(image_processor.do_image_splitting))
    try:
        layout_tokens = _idefics3_layout_tokens(family, folder)
        layout_tokens(1, 1, (0, 0, 0))
    except Exception as error:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: counting {family} image tokens needs the model's processor "
                          f"configuration and tokenizer in {folder}, which could not be loaded offline "
                          f"({type(error).__name__}: {str(error)[:200]})") from None
    by_layout: dict[Any, int] = {}

    def count(width: int, height: int) -> int:
        layout = image_processor.get_number_of_image_patches(height, width, {})  # (patches, rows, columns)
        tokens = by_layout.get(layout)
        if tokens is None:  # bounded: rows and columns are at most the longest edge over the tile
            tokens = by_layout[layout] = layout_tokens(width, height, layout)
        return tokens

    return Model(spec, family, geometry, _checked(geometry, count))


def _idefics3_layout_tokens(family: str, folder: Path) -> Callable[[int, int, Any], int]:
    """How many tokens an image of a given patch layout becomes, from the processor itself. Idefics3's processor
    says it (``_get_num_multimodal_tokens``). SmolVLM's cannot load without torch (its video processor), so its
    image prompt (``get_image_prompt_string``) is built and counted with the model's own tokenizer."""
    if family == "idefics3":
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
        return lambda width, height, _layout: int(
            processor._get_num_multimodal_tokens(image_sizes=[[height, width]]).num_image_tokens[0])
    from transformers import AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    config = _read_json(folder / "processor_config.json") or {}
    image_seq_len = int(config.get("image_seq_len", 169))  # SmolVLMProcessor's default
    markers = (getattr(tokenizer, "fake_image_token", "<fake_token_around_image>"),
               getattr(tokenizer, "image_token", "<image>"), getattr(tokenizer, "global_image_token", "<global-img>"))

    def layout_tokens(_width: int, _height: int, layout: Any) -> int:
        _patches, rows, columns = layout
        prompt = get_image_prompt_string(rows, columns, image_seq_len, *markers)
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])

    return layout_tokens


def _llava_next(spec: str, folder: Path, image_processor: Any) -> Model:
    """LLaVA-NeXT: the any-res geometry from the image processor, the count from ``LlavaNextProcessor`` (its
    ``_get_number_of_features``, less the CLS token the "default" feature strategy drops)."""
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True, backend="pil")
        patch_size = int(processor.patch_size)
        drops = 1 if processor.vision_feature_select_strategy == "default" else 0
        extra = int(processor.num_additional_image_tokens) - drops
    except Exception as error:
        raise ConfigError(f"MMGATE_MODEL={spec!r}: counting llava-next image tokens needs the model's processor "
                          f"and tokenizer in {folder}, which could not be loaded offline "
                          f"({type(error).__name__}: {str(error)[:200]})") from None
    size = image_processor.size
    processed = int(size.shortest_edge or min(size.height, size.width))  # the base square the count assumes
    pinpoints = tuple((int(h), int(w)) for h, w in image_processor.image_grid_pinpoints)
    geometry = LlavaNext("llava-next", pinpoints, processed, patch_size, extra)

    def count(width: int, height: int) -> int:
        return int(processor._get_number_of_features(height, width, processed, processed)) - drops

    side = processed // patch_size
    # Every grid full (nothing unpadded), a newline token a row, and the base square.
    ceiling = max((h // processed * side) * (w // processed * side) + h // processed * side
                  for h, w in pinpoints) + side * side + extra
    return Model(spec, "llava-next", geometry, _checked(geometry, count), ceiling)
