"""LLaVA-OneVision: LLaVA-NeXT's any-res grid with 384 px SigLIP squares, a grid past ``anyres_max_9`` pooled."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import LlavaNext

from .base import Family, Found, Model, checked, read_json

# LlavaOnevisionProcessor's defaults, where processor_config.json names no value.
_DEFAULTS = {"num_image_tokens": 729, "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9"}


@dataclass(frozen=True)
class LlavaOnevision(Family):
    image_types = ("LlavaOnevisionImageProcessor",)

    def load(self, found: Found) -> Model:
        """The geometry of LLaVA-NeXT's grid; the count of LlavaOnevisionProcessor's ``_get_num_multimodal_tokens``
        (the processor needs torch for its video processor, so its configuration is read from its file)."""
        config = {**_DEFAULTS, **(read_json(found.folder / "processor_config.json") or {})}
        side = round(int(config["num_image_tokens"]) ** 0.5)  # patches along the base square
        drops = 1 if config["vision_feature_select_strategy"] == "default" else 0
        max_patches = int(str(config["vision_aspect_ratio"]).removeprefix("anyres_max_"))
        image_processor = found.image_processor
        size = image_processor.size
        processed = int(size.shortest_edge or min(size.height, size.width))
        pinpoints = tuple((int(h), int(w)) for h, w in image_processor.image_grid_pinpoints)
        geometry = LlavaNext("llava-onevision", pinpoints, processed, processed // side, -drops,
                             max_patches=max_patches)
        # A bound, not a size's count: the grid is kept whole up to 1.1² × max_patches squares of patches (and
        # pooled past that), with a newline a row, beside the base square.
        rows = max(h for h, _w in pinpoints) // processed * side
        ceiling = int(1.21 * max_patches * side * side) + rows + side * side - drops
        return Model(found.spec, "llava-onevision", geometry, checked(geometry, geometry.tokens), ceiling)

LLAVA_ONEVISION = LlavaOnevision(
    names="LLaVA-OneVision",
    processor="`LlavaOnevisionImageProcessor`",
    resizes_to="as LLaVA-NeXT, within its best `image_grid_pinpoints` resolution (384 px squares up to 6 × 6); "
               "forwarded as it is where that size would count differently",
    counts="grid patches, unpadded, pooled down past `anyres_max_9`, + one newline a row + the base 729",
    kwargs=("vision_aspect_ratio",),
    vllm="vLLM's own count (`llava_onevision.py`) follows the same rule",
)
