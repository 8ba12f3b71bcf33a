"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL: ``smart_resize`` to multiples of 28 (32), patches // merge_size ** 2."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from preprocessors.geometry import QwenVL

from .base import (
    PROCESSOR_FILES,
    Family,
    Found,
    Model,
    checked,
    merged_patches,
    no_video_tokens,
    pixel_range_tokens,
    read_json,
)

_MODEL_TYPES = {"qwen2_vl": "qwen2-vl", "qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl"}


@dataclass(frozen=True)
class Qwen(Family):
    image_types = ("Qwen2VLImageProcessor",)

    def load(self, found: Found) -> Model:
        processor = found.image_processor
        family = _MODEL_TYPES.get(found.model_type, "qwen2-vl")
        size = processor.size
        geometry = QwenVL(family, int(processor.patch_size), int(processor.merge_size),
                          int(size.shortest_edge), int(size.longest_edge))
        count = merged_patches(processor, geometry.merge_size)
        ceiling = pixel_range_tokens(geometry.max_pixels, (geometry.patch_size * geometry.merge_size) ** 2)
        # Qwen3-VL's video prompt adds a timestamp in text to every frame pair: its video tokens are not counted.
        video_count = (qwen_video_count(found, processor) if family in ("qwen2-vl", "qwen2.5-vl")
                       else no_video_tokens)
        return Model(found.spec, family, geometry, checked(geometry, count), ceiling, video_count)


def qwen_video_count(found: Found, image_processor: Any) -> Callable[[int, int, int], int]:
    """``Qwen2VLVideoProcessor.get_num_of_video_patches // merge_size ** 2``: each frame brought within the
    video processor's pixel bounds (``smart_resize``), frames paired by ``temporal_patch_size`` (the last
    repeated to fill a pair). The video processor itself needs torch, so its configuration is read as its
    ``from_pretrained`` reads it: ``processor_config.json``'s ``video_processor``, else
    ``video_preprocessor_config.json``, else the image processor's file, with
    ``min_pixels``/``max_pixels`` over ``size``; what neither names is the image processor's
    (tests/proxy/media/test_model.py checks the count against the video processor's own method, taken from its
    source and run without torch)."""
    folder = found.folder
    nested = (read_json(folder / "processor_config.json") or {}).get("video_processor")
    config = (nested if isinstance(nested, dict) else None) or read_json(folder / "video_preprocessor_config.json") \
        or read_json(folder / PROCESSOR_FILES[0]) or {}
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


QWEN = Qwen(
    names="Qwen2-VL, Qwen2.5-VL, Qwen3-VL",
    processor="`Qwen2VLImageProcessor` (model_type qwen2_vl, qwen2_5_vl, qwen3_vl): 14 px patches (16 for Qwen3-VL)",
    resizes_to="both sides multiples of 28 (32), pixels within `min_pixels`–`max_pixels` (`smart_resize`)",
    counts="patches ÷ 4; video: frame pairs × patches ÷ 4 (Qwen2-VL, Qwen2.5-VL)",
    kwargs=("min_pixels", "max_pixels"),
)
