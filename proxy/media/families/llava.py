"""LLaVA 1.5: the shortest edge to 336 (or, padding to a square, the longest), a constant count."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from preprocessors.geometry import Geometry, ShortestEdge, Square

from .base import Family, Found, Model, checked, load_processor


def llava_tokens(processor: Any) -> int:
    """What ``LlavaProcessor`` counts for any image: the vision tower's patches of the processor's crop and its
    additional tokens, less the CLS token the "default" feature strategy drops."""
    crop, patch = processor.image_processor.crop_size, int(processor.patch_size)
    return ((int(crop["height"]) // patch) * (int(crop["width"]) // patch) + int(processor.num_additional_image_tokens)
            - (processor.vision_feature_select_strategy == "default"))


def image_seq_length(processor: Any) -> int:
    """What ``Gemma3Processor`` and ``PaliGemmaProcessor`` count for any image: their ``image_seq_length``."""
    return int(processor.image_seq_length)


def constant_model(found: Found, family: str, geometry: Geometry, count: Callable[[Any], int]) -> Model:
    """A family that makes the same number of tokens of every image: ``count`` reads it off its processor."""
    processor = load_processor(found, family)
    try:
        tokens = count(processor)
    except Exception as error:
        from .base import needs_processor

        raise needs_processor(found, family, error) from None
    return Model(found.spec, family, geometry, checked(geometry, lambda _width, _height: tokens))


@dataclass(frozen=True)
class Llava(Family):
    image_types = ("CLIPImageProcessor", "LlavaImageProcessor")
    model_types = ("llava",)

    def load(self, found: Found) -> Model:
        processor = found.image_processor
        size = processor.size
        pad = bool(found.image_type == "LlavaImageProcessor" and getattr(processor, "do_pad", False))
        geometry: Geometry = (ShortestEdge("llava", int(size.shortest_edge or size.height), pad)
                              if size.shortest_edge or pad else Square("llava", int(size.width), int(size.height)))
        return constant_model(found, "llava", geometry, llava_tokens)


LLAVA = Llava(
    names="LLaVA 1.5",
    processor="`CLIPImageProcessor` or `LlavaImageProcessor` with model_type llava",
    resizes_to="shortest edge 336 (or, padding to a square, longest edge 336); the backend crops",
    counts="constant (576), from the processor",
)
