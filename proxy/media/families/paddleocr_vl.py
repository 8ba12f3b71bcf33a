"""PaddleOCR-VL: sides in multiples of 28 within a pixel range (its ``smart_resize``), patches // 4."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import SmartResize

from .base import STRIP_TOKENS, Family, Found, Model, checked

_MODULE = "transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl"


@dataclass(frozen=True)
class PaddleOCRVL(Family):
    image_types = ("PaddleOCRVLImageProcessor",)

    def load(self, found: Found) -> Model:
        processor = found.image_processor
        patch, merge = int(processor.patch_size), int(processor.merge_size)
        geometry = SmartResize("paddleocr-vl", _MODULE, patch * merge, int(processor.size["shortest_edge"]),
                               int(processor.size["longest_edge"]))

        def count(width: int, height: int) -> int:
            # PaddleOCRVLProcessor.replace_image_token: image_grid_thw.prod() // merge_size ** 2.
            return int(processor.get_number_of_image_patches(height, width, {})) // merge ** 2

        # max_pixels in tokens; a strip kept one token wide can pass it, up to the aspect-ratio limit of 200.
        ceiling = max(geometry.max_pixels // geometry.factor ** 2, STRIP_TOKENS)
        return Model(found.spec, "paddleocr-vl", geometry, checked(geometry, count), ceiling)


PADDLEOCR_VL = PaddleOCRVL(
    names="PaddleOCR-VL",
    processor="`PaddleOCRVLImageProcessor`",
    resizes_to="both sides multiples of 28, pixels within `min_pixels`–`max_pixels` (its `smart_resize`)",
    counts="patches ÷ 4",
    kwargs=("min_pixels", "max_pixels"),
)
