"""The cost coefficients of ``preprocessors/handoff.py``: what each step of an image's path costs in CPU.

With a model, mmgate either forwards a client's image as it came (the backend decodes it and resizes it to the
model's size) or forwards its own resize (mmgate decodes, resizes and encodes; the backend decodes that). The
rule that picks one (``preprocessors.handoff.forward_original``) adds up the steps of each path with the
coefficients this module measures, single-threaded, on photo-like images (``testkit.media.detailed_photo``):

* decode, per megapixel decoded, per format (a JPEG's also at its draft scales 1/2, 1/4, 1/8, per megapixel
  of the file: libjpeg still reads every coefficient);
* resize, per megapixel of the source, with the processors' filters (BICUBIC, the most common);
* encode of the handoff, per megapixel written (BMP, PNG level 1, JPEG q100 4:4:4, WebP q100), and the bytes
  a pixel of it takes;
* the bytes: base64 encode and decode and a JSON parse of the string, per byte of file.

    python -m testkit.handoff_calibration [--size 3000x2000] [--repeat 5]

Prints the constants as ``preprocessors/handoff.py`` holds them; nothing is written. The figures are medians of
``--repeat`` runs of thread CPU time (``time.thread_time``), so other load on the machine moves them little.
"""

from __future__ import annotations

import argparse
import io
from functools import partial
from typing import Any

import orjson
import pybase64
from PIL import Image

from testkit.call_timing import median_cpu_ms
from testkit.image_steps import draft_decode
from testkit.media import detailed_photo, encoded

DRAFT_SCALES = (2, 4, 8)
# The files clients send: JPEG as cameras write them, PNG as most tools write them.
SOURCES: dict[str, dict[str, Any]] = {"JPEG": {"quality": 90, "subsampling": 2}, "PNG": {"compress_level": 6},
                                      "WEBP": {"quality": 90}, "BMP": {}, "GIF": {}}
HANDOFFS: dict[str, dict[str, Any]] = {"bmp": {}, "png": {"compress_level": 1},
                                       "jpeg": {"quality": 100, "subsampling": 0}, "webp": {"quality": 100}}


def _save(image: Image.Image, out: io.BytesIO, fmt: str, named: dict[str, Any]) -> None:
    out.seek(0)
    out.truncate()
    image.save(out, fmt.upper(), **named)


def calibrate(width: int = 3000, height: int = 2000, repeat: int = 5) -> dict[str, float]:
    """Milliseconds of one CPU per megapixel (``*_ms_per_mp``) or per megabyte (``bytes_ms_per_mb``), and the
    handoff's bytes per pixel, for a ``width`` x ``height`` photo."""
    image = detailed_photo(width, height, seed=3, slope=1.2, contrast=40)
    mp = width * height / 1e6
    costs: dict[str, float] = {}
    for fmt, options in SOURCES.items():
        data = encoded(image if fmt != "GIF" else image.convert("P"), fmt, **options)
        costs[f"decode_{fmt.lower()}_ms_per_mp"] = median_cpu_ms(partial(draft_decode, data), repeat) / mp
    jpeg = encoded(image, "JPEG", **SOURCES["JPEG"])
    for scale in DRAFT_SCALES:
        costs[f"decode_jpeg_draft{scale}_ms_per_mp"] = median_cpu_ms(partial(draft_decode, jpeg, scale), repeat) / mp
    small = (width * 2 // 3, height * 2 // 3)
    costs["resize_ms_per_source_mp"] = median_cpu_ms(
        lambda: image.resize(small, Image.Resampling.BICUBIC, reducing_gap=3.0), repeat) / mp
    target = image.resize(small, Image.Resampling.BICUBIC)
    for fmt, named in HANDOFFS.items():
        written = io.BytesIO()
        costs[f"encode_{fmt}_ms_per_mp"] = median_cpu_ms(partial(_save, target, written, fmt, named), repeat) / (
            small[0] * small[1] / 1e6)
        costs[f"handoff_{fmt}_bytes_per_pixel"] = len(written.getvalue()) / (small[0] * small[1])
    raw = encoded(image, "BMP")
    body = orjson.dumps({"url": "data:image/bmp;base64," + pybase64.b64encode(raw).decode()})

    def through() -> None:  # mmgate encodes, the backend parses the body and decodes the string
        pybase64.b64encode(raw)
        pybase64.b64decode(orjson.loads(body)["url"].partition(",")[2], validate=True)

    costs["bytes_ms_per_mb"] = median_cpu_ms(through, repeat) / (len(raw) / 1e6)
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="3000x2000")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    for name, value in calibrate(width, height, args.repeat).items():
        print(f"{name.upper()} = {value:.2f}")


if __name__ == "__main__":
    main()
