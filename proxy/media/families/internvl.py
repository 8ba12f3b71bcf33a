"""InternVL 3 and 3.5 (the ``-hf`` checkpoints): 448 px tiles and a thumbnail, 256 tokens a tile."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import Tiles

from .base import Family, Found, Model, checked, read_json

# InternVLProcessor's own defaults: it crops to tiles whatever the image processor's file says
# (``images_kwargs = {"crop_to_patches": True}``), and a tile is 256 tokens.
_CROPS = True
_TILE_TOKENS = 256


@dataclass(frozen=True)
class InternVL(Family):
    image_types = ("GotOcr2ImageProcessor",)
    model_types = ("internvl",)

    def load(self, found: Found) -> Model:
        processor = found.image_processor
        config = read_json(found.folder / "processor_config.json") or {}
        tile_tokens = int(config.get("image_seq_length", _TILE_TOKENS))
        crop = bool(config.get("images_kwargs", {}).get("crop_to_patches", _CROPS))
        geometry = Tiles("internvl", int(processor.size.width), int(processor.size.height),
                         int(processor.min_patches), int(processor.max_patches), crop)

        def count(width: int, height: int) -> int:
            # InternVLProcessor._get_num_multimodal_tokens: <img>, 256 <IMG_CONTEXT> a tile (and the thumbnail),
            # </img> (its video processor needs torch, so the processor itself is not loaded).
            columns, rows = geometry.grid(width, height)
            tiles = columns * rows + 1 if columns * rows > 1 else 1
            return 2 + tile_tokens * tiles

        ceiling = 2 + tile_tokens * (geometry.max_tiles + 1 if crop and geometry.max_tiles > 1 else 1)
        return Model(found.spec, "internvl", geometry, checked(geometry, count), ceiling)


INTERNVL = InternVL(
    names="InternVL 3, InternVL 3.5",
    processor="`GotOcr2ImageProcessor` with model_type internvl (the `-hf` checkpoints)",
    resizes_to="the grid of 448 px tiles nearest the image's aspect ratio, 1 to `max_patches` (12) tiles "
               "(`get_optimal_tiled_canvas`); forwarded as it is where the resized image would take another grid",
    counts="256 a tile, + 256 for the thumbnail where there is more than one tile, + `<img>`, `</img>`",
    kwargs=("crop_to_patches", "min_patches", "max_patches"),
    vllm="vLLM serves the `-hf` checkpoints with its interns1 module, which runs transformers' processor (tiles "
         "on) and puts `<img>`, 256 a tile, `</img>` in the prompt, as counted; the original `internvl_chat` "
         "checkpoints run vLLM's own processor and name no `GotOcr2ImageProcessor`: the generic rule",
)
