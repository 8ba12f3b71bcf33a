"""LLaVA-NeXT: the any-res grid; the count as ``LlavaNextProcessor`` makes it (``geometry.LlavaNext.tokens``)."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import LlavaNext

from .base import Family, Found, Model, checked, load_processor, needs_processor


@dataclass(frozen=True)
class LlavaNextFamily(Family):
    image_types = ("LlavaNextImageProcessor",)
    model_types = ("llava_next",)

    def load(self, found: Found) -> Model:
        """The any-res geometry from the image processor; the count from ``LlavaNextProcessor``'s settings (its
        patch size and additional tokens, less the CLS token the "default" feature strategy drops)."""
        processor = load_processor(found, "llava-next")
        try:
            patch_size = int(processor.patch_size)
            drops = 1 if processor.vision_feature_select_strategy == "default" else 0
            extra = int(processor.num_additional_image_tokens) - drops
        except Exception as error:
            raise needs_processor(found, "llava-next", error) from None
        image_processor = found.image_processor
        size = image_processor.size
        processed = int(size.shortest_edge or min(size.height, size.width))  # the base square the count assumes
        pinpoints = tuple((int(h), int(w)) for h, w in image_processor.image_grid_pinpoints)
        geometry = LlavaNext("llava-next", pinpoints, processed, patch_size, extra)

        side = processed // patch_size
        # Every grid full (nothing unpadded), a newline token a row, and the base square.
        ceiling = max((h // processed * side) * (w // processed * side) + h // processed * side
                      for h, w in pinpoints) + side * side + extra
        return Model(found.spec, "llava-next", geometry, checked(geometry, geometry.tokens), ceiling)


LLAVA_NEXT = LlavaNextFamily(
    names="LLaVA-NeXT",
    processor="`LlavaNextImageProcessor` with model_type llava_next",
    resizes_to="the size the processor brings the image to within its best `image_grid_pinpoints` resolution "
               "(`select_best_resolution`, `get_patch_output_size`); forwarded as it is where that size would count "
               "differently",
    counts="grid patches, unpadded, + one newline a row + the base 336 px square, as `LlavaNextProcessor` counts",
)
