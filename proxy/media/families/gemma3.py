"""Gemma 3: one 896 px square of every image, a constant count; with pan-and-scan, a square more a crop."""

from __future__ import annotations

from dataclasses import dataclass

from preprocessors.geometry import PanAndScan, Square

from .base import Family, Found, Model, checked, load_processor
from .llava import constant_model, image_seq_length

# Gemma3Processor's defaults, which vLLM applies where the image processor's own value is unset.
_PAN_AND_SCAN = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                 "pan_and_scan_min_ratio_to_activate": 1.2}


def _pans(found: Found) -> bool:
    return bool(getattr(found.image_processor, "do_pan_and_scan", False))


@dataclass(frozen=True)
class Gemma3(Family):
    def recognise(self, found: Found) -> bool:
        return found.image_type == "Gemma3ImageProcessor" and not _pans(found)

    def load(self, found: Found) -> Model:
        size = found.image_processor.size
        return constant_model(found, "gemma3", Square("gemma3", int(size.width), int(size.height)),
                              image_seq_length)


@dataclass(frozen=True)
class Gemma3PanAndScan(Family):
    def recognise(self, found: Found) -> bool:
        return found.image_type == "Gemma3ImageProcessor" and _pans(found)

    def load(self, found: Found) -> Model:
        """As vLLM's Gemma 3 processing info counts: each setting the image processor's, else the processor's default;
        ``(crops + 1) × image_seq_length`` tokens (``get_num_image_tokens``)."""
        image_processor = found.image_processor
        settings = {key: value if (value := getattr(image_processor, key, None)) is not None else default
                    for key, default in _PAN_AND_SCAN.items()}
        size = image_processor.size
        geometry = PanAndScan("gemma3 with pan-and-scan", int(size.width), int(size.height),
                              int(settings["pan_and_scan_min_crop_size"]),
                              int(settings["pan_and_scan_max_num_crops"]),
                              float(settings["pan_and_scan_min_ratio_to_activate"]))
        per_square = int(load_processor(found, "gemma3").image_seq_length)

        def count(width: int, height: int) -> int:
            return (geometry.crops(width, height) + 1) * per_square

        return Model(found.spec, geometry.family, geometry, checked(geometry, count),
                     (geometry.max_crops + 1) * per_square)


GEMMA3 = Gemma3(
    names="Gemma 3",
    processor="`Gemma3ImageProcessor` without pan-and-scan",
    resizes_to="896 × 896",
    counts="constant (256), from the processor",
    kwargs=("do_pan_and_scan",),
)

GEMMA3_PAN_AND_SCAN = Gemma3PanAndScan(
    names="Gemma 3 with pan-and-scan",
    processor="`Gemma3ImageProcessor` with `do_pan_and_scan`",
    resizes_to="896 × 896 where the image is cut into no crops (an aspect ratio under "
               "`pan_and_scan_min_ratio_to_activate`, 1.2); otherwise forwarded as it is",
    counts="256 for the whole image + 256 a crop (2 to `pan_and_scan_max_num_crops`, 4, crops of at least "
           "`pan_and_scan_min_crop_size`, 256 px)",
    kwargs=("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
            "pan_and_scan_min_ratio_to_activate"),
    vllm="vLLM counts the soft tokens, `(crops + 1) × 256` (its Gemma 3 processing info's `get_num_image_tokens`), "
         "and takes each setting from the image processor before the processor's defaults; its prompt also carries the "
         "text \"Here is the original image … and here are some crops\", not counted",
)
