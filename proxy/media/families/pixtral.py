"""Pixtral and Mistral 3 (Mistral Small 3.1 / 3.2, Magistral Small, Devstral): the longest edge within a
bound, sides in whole patches; a token a patch, one more a row."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import PatchGrid

from .base import Family, Found, Model, checked, read_json

# PixtralProcessor's defaults, where processor_config.json names no value.
_PATCH = 16
_MERGE = 1


@dataclass(frozen=True)
class Pixtral(Family):
    image_types = ("PixtralImageProcessor",)

    def load(self, found: Found) -> Model:
        config = read_json(found.folder / "processor_config.json") or {}
        # PixtralProcessor resizes to whole merged patches whatever the image processor's own patch_size says.
        patch = int(config.get("patch_size", _PATCH)) * int(config.get("spatial_merge_size", _MERGE))
        family = "mistral3" if found.model_type == "mistral3" else "pixtral"
        geometry = PatchGrid(family, int(found.image_processor.size.longest_edge), patch)

        def count(width: int, height: int) -> int:
            # PixtralProcessor.replace_image_token: [IMG] a patch, [IMG_BREAK] after each row, the last one [IMG_END].
            w, h = geometry.backend_size(width, height)
            return (w // patch + 1) * (h // patch)

        side = -(-geometry.longest_edge // patch)  # rounded up to whole patches
        return Model(found.spec, family, geometry, checked(geometry, count), (side + 1) * side)


PIXTRAL = Pixtral(
    names="Pixtral, Mistral 3",
    processor="`PixtralImageProcessor` (model_type llava for Pixtral-12B, mistral3 for Mistral Small 3.1 and later)",
    resizes_to="longest edge within `size[\"longest_edge\"]` (1024, 1540), both sides rounded up to whole "
               "`patch_size` × `spatial_merge_size` px patches (16, 28)",
    counts="a token a patch + one a row (`[IMG_BREAK]`, the last `[IMG_END]`)",
    kwargs=("size", "patch_size"),
    vllm="the Hugging Face format runs transformers' processor; the Mistral format (`--tokenizer-mode mistral`, "
         "`params.json`) runs mistral_common's and ships no image processor configuration: `MMGATE_MODEL` then names "
         "a folder with the Hugging Face format's processor files",
)
