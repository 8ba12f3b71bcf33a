"""Gemma 4: the image scaled to fill a budget of soft tokens (280 by default), a token a 3 x 3 of 16 px patches."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import PatchBudget

from .base import Family, Found, Model, checked


@dataclass(frozen=True)
class Gemma4(Family):
    image_types = ("Gemma4ImageProcessor",)

    def load(self, found: Found) -> Model:
        processor = found.image_processor
        kernel = int(processor.pooling_kernel_size)
        max_soft_tokens = int(processor.max_soft_tokens)
        geometry = PatchBudget("gemma4", int(processor.patch_size), max_soft_tokens * kernel ** 2, kernel)

        def count(width: int, height: int) -> int:
            # Gemma4Processor._get_num_multimodal_tokens: the resized image's patches pooled kernel x kernel (its
            # video and audio processors need torch, so the processor itself is not loaded).
            w, h = geometry.backend_size(width, height)
            return (h // geometry.patch_size) * (w // geometry.patch_size) // kernel ** 2

        return Model(found.spec, "gemma4", geometry, checked(geometry, count), max_soft_tokens)


GEMMA4 = Gemma4(
    names="Gemma 4",
    processor="`Gemma4ImageProcessor`",
    resizes_to="the most pixels within `max_soft_tokens` (280) × 3 × 3 patches of 16 px, sides in multiples of "
               "48 px (`get_aspect_ratio_preserving_size`); forwarded as it is where the processor would scale the "
               "resized image again, or enlarge it",
    counts="soft tokens: patches ÷ 9, at most `max_soft_tokens`",
    kwargs=("max_soft_tokens",),
)
