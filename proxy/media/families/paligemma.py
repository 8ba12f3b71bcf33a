"""PaliGemma and PaliGemma 2: one SigLIP square (224, 448 or 896 px), a constant count."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import Square

from .base import Family, Found, Model
from .llava import constant_model, image_seq_length


@dataclass(frozen=True)
class PaliGemma(Family):
    image_types = ("SiglipImageProcessor",)
    model_types = ("paligemma",)

    def load(self, found: Found) -> Model:
        size = found.image_processor.size
        return constant_model(found, "paligemma", Square("paligemma", int(size.width), int(size.height)),
                              image_seq_length)


PALIGEMMA = PaliGemma(
    names="PaliGemma, PaliGemma 2",
    processor="`SiglipImageProcessor` with model_type paligemma",
    resizes_to="one `size` square (224, 448 or 896 px)",
    counts="constant (`image_seq_length`: 256, 1024 or 4096), from the processor",
)
