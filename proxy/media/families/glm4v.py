"""GLM-4.1V, GLM-4.5V, GLM-4.6V: sides in multiples of 28 within a pixel range (GLM's ``smart_resize``),
patches // merge_size ** 2."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import Glm4v

from .base import Family, Found, Model, checked, merged_patches, pixel_range_tokens

_MODULES = {"Glm4vImageProcessor": "transformers.models.glm4v.image_processing_pil_glm4v",
            "Glm46VImageProcessor": "transformers.models.glm46v.image_processing_pil_glm46v"}
_MODEL_TYPES = {"glm4v": "glm-4.1v", "glm4v_moe": "glm-4.5v", "glm46v": "glm-4.6v"}


@dataclass(frozen=True)
class Glm4vFamily(Family):
    image_types = tuple(_MODULES)

    def load(self, found: Found) -> Model:
        processor = found.image_processor
        family = _MODEL_TYPES.get(found.model_type, "glm-4.1v")
        size = processor.size
        geometry = Glm4v(family, _MODULES[found.image_type], int(processor.patch_size), int(processor.merge_size),
                         int(processor.temporal_patch_size), int(size.shortest_edge), int(size.longest_edge))
        count = merged_patches(processor, geometry.merge_size)
        # An image counts as temporal_patch_size frames against max_pixels.
        ceiling = pixel_range_tokens(geometry.max_pixels // geometry.temporal_patch_size,
                                     (geometry.patch_size * geometry.merge_size) ** 2)
        return Model(found.spec, family, geometry, checked(geometry, count), ceiling)


GLM4V = Glm4vFamily(
    names="GLM-4.1V, GLM-4.5V, GLM-4.6V",
    processor="`Glm4vImageProcessor`, `Glm46VImageProcessor` (model_type glm4v, glm4v_moe, glm46v)",
    resizes_to="both sides multiples of 28, the image (as two frames) within `size`'s pixel range (GLM's "
               "`smart_resize`)",
    counts="patches ÷ 4",
    kwargs=("size",),
)
