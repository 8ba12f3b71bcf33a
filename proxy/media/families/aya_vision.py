"""Aya Vision: InternVL's tiles (364 px, up to 12, and a thumbnail); the prompt counted with its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import Tiles

from .base import Family, Found, Model, checked, load_processor, needs_processor


@dataclass(frozen=True)
class AyaVision(Family):
    image_types = ("GotOcr2ImageProcessor",)
    model_types = ("aya_vision",)

    def load(self, found: Found) -> Model:
        image_processor = found.image_processor
        # AyaVisionProcessor crops to tiles whatever the image processor's file says (its images_kwargs).
        geometry = Tiles("aya-vision", int(image_processor.size.width), int(image_processor.size.height),
                         int(image_processor.min_patches), int(image_processor.max_patches), True)
        processor = load_processor(found, "aya-vision")

        def prompt_tokens(patches: int) -> int:
            # The prompt vLLM puts in place of <image> (the processor's replace_image_token: a TILE_n marker and
            # the patch tokens a tile, the global tile, the begin and end markers), counted with the tokenizer.
            prompt = processor.replace_image_token({"num_patches": [patches]}, 0)
            return len(processor.tokenizer(prompt, add_special_tokens=False)["input_ids"])

        try:
            by_patches = {1: prompt_tokens(1)}
        except Exception as error:
            raise needs_processor(found, "aya-vision", error) from None

        def count(width: int, height: int) -> int:
            columns, rows = geometry.grid(width, height)
            patches = columns * rows + 1 if columns * rows > 1 else 1
            tokens = by_patches.get(patches)
            if tokens is None:  # bounded: at most max_patches + 1 entries
                tokens = by_patches[patches] = prompt_tokens(patches)
            return tokens

        return Model(found.spec, "aya-vision", geometry, checked(geometry, count),
                     prompt_tokens(geometry.max_tiles + 1 if geometry.max_tiles > 1 else 1))


AYA_VISION = AyaVision(
    names="Aya Vision",
    processor="`GotOcr2ImageProcessor` with model_type aya_vision",
    resizes_to="as InternVL, with 364 px tiles, 1 to `max_patches` (12)",
    counts="the prompt in place of `<image>`: 169 patch tokens a tile and the thumbnail, with their markers, counted "
           "with the model's tokenizer",
    kwargs=("min_patches", "max_patches"),
)
