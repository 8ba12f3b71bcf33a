"""Llama 3.2 Vision (Mllama): up to 4 tiles of 560 px; its image tokens are the vision encoder's, a tile each."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import MllamaTiles

from .base import Family, Found, Model, checked, read_json


@dataclass(frozen=True)
class Mllama(Family):
    image_types = ("MllamaImageProcessor",)

    def load(self, found: Found) -> Model:
        processor = found.image_processor
        geometry = MllamaTiles("mllama", int(processor.size.height), int(processor.max_image_tiles))
        vision = (read_json(found.folder / "config.json") or {}).get("vision_config") or {}
        # vLLM's mllama: a tile is (image_size // 14) ** 2 patches and a class token in the encoder's prompt;
        # the decoder's prompt holds one <|image|> an image.
        per_tile = (geometry.tile // int(vision.get("patch_size", 14))) ** 2 + 1

        def count(width: int, height: int) -> int:
            columns, rows = geometry.canvas(width, height)
            return columns * rows * per_tile

        return Model(found.spec, "mllama", geometry, checked(geometry, count), geometry.max_tiles * per_tile)


MLLAMA = Mllama(
    names="Llama 3.2 Vision",
    processor="`MllamaImageProcessor`",
    resizes_to="fitted within the canvas of 560 px tiles (up to `max_image_tiles`, 4) that scales it least "
               "(`get_optimal_tiled_canvas`, `get_image_size_fit_to_canvas`); forwarded as it is where the fitted "
               "image would take another canvas, or where the processor enlarges it",
    counts="the vision encoder's tokens: 1601 a tile ((560 ÷ 14)² + 1)",
    vllm="an encoder-decoder model: vLLM puts the encoder's tokens, tiles × 1601, in the encoder prompt (what "
         "mmgate counts) and one `<|image|>` in the decoder prompt",
)
