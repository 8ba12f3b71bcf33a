"""Gemma 3: one 896 px square of every image, a constant count."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import Square

from .base import Family, Found, Model
from .llava import constant_model


@dataclass(frozen=True)
class Gemma3(Family):
    def recognise(self, found: Found) -> bool:
        return (found.image_type == "Gemma3ImageProcessor"
                and not getattr(found.image_processor, "do_pan_and_scan", False))

    def load(self, found: Found) -> Model:
        size = found.image_processor.size
        return constant_model(found, "gemma3", Square("gemma3", int(size.width), int(size.height)))


GEMMA3 = Gemma3(
    names="Gemma 3",
    processor="`Gemma3ImageProcessor` without pan-and-scan",
    resizes_to="896 × 896",
    counts="constant (256), from the processor",
    kwargs=("do_pan_and_scan",),
)
