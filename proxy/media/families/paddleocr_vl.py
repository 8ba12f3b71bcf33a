"""PaddleOCR-VL: sides in multiples of 28 within a pixel range (its ``smart_resize``), patches // 4."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import SmartResize

from .base import Family, Found, Model, checked, merged_patches, pixel_range_tokens

_MODULE = "transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl"


@dataclass(frozen=True)
class PaddleOCRVL(Family):
    image_types = ("PaddleOCRVLImageProcessor",)

    def load(self, found: Found) -> Model:
        processor = found.image_processor
        patch, merge = int(processor.patch_size), int(processor.merge_size)
        geometry = SmartResize("paddleocr-vl", _MODULE, patch * merge, int(processor.size["shortest_edge"]),
                               int(processor.size["longest_edge"]))
        count = merged_patches(processor, merge)  # its replace_image_token: image_grid_thw.prod() // merge ** 2
        ceiling = pixel_range_tokens(geometry.max_pixels, geometry.factor ** 2)
        return Model(found.spec, "paddleocr-vl", geometry, checked(geometry, count), ceiling)


PADDLEOCR_VL = PaddleOCRVL(
    names="PaddleOCR-VL",
    processor="`PaddleOCRVLImageProcessor`",
    resizes_to="both sides multiples of 28, pixels within `min_pixels`–`max_pixels` (its `smart_resize`)",
    counts="patches ÷ 4",
    kwargs=("min_pixels", "max_pixels"),
)
