"""The cost coefficients of ``preprocessors/handoff.py``: what each step of an image's path costs in CPU.

With a model, mmgate either forwards a client's image as it came (the backend decodes it and resizes it to the
model's size) or forwards its own resize (mmgate decodes, resizes and encodes; the backend decodes that). The
rule that picks one (``preprocessors.handoff.forward_original``) adds up the steps of each path with the
coefficients this script measures, single-threaded, on photo-like images (``testkit.media.detailed_photo``):

* decode, per megapixel decoded, per format (a JPEG's also at its draft scales 1/2, 1/4, 1/8, per megapixel
  of the file: libjpeg still reads every coefficient);
* resize, per megapixel of the source, with the processors' filters (BICUBIC, the most common);
* encode of the handoff, per megapixel written (BMP, PNG level 1, JPEG q100 4:4:4, WebP q100), and the bytes
  a pixel of it takes;
* the bytes: base64 encode and decode and a JSON parse of the string, per byte of file.

    python -m bench.handoff_costs [--size 3000x2000] [--repeat 5]

Prints the constants as ``preprocessors/handoff.py`` holds them; nothing is written. The figures are medians of
``--repeat`` runs of thread CPU time (``time.thread_time``), so other load on the machine moves them little.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson
import pybase64
from PIL import Image

from testkit.media import detailed_photo

DRAFT_SCALES = (1, 2, 4, 8)


def _cpu_ms(step: Callable[[], object], repeat: int) -> float:
    """The median thread CPU milliseconds of ``step`` over ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        started = time.thread_time()
        step()
        times.append((time.thread_time() - started) * 1000)
    return statistics.median(times)


def _file(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    if fmt == "JPEG":
        image.save(out, "JPEG", quality=90, subsampling=2)  # as cameras write them
    elif fmt == "PNG":
        image.save(out, "PNG", compress_level=6)  # as most tools write them
    elif fmt == "WEBP":
        image.save(out, "WEBP", quality=90)
    else:
        image.save(out, fmt)
    return out.getvalue()


def _save(image: Image.Image, out: io.BytesIO, fmt: str, named: dict[str, Any]) -> None:
    out.seek(0)
    out.truncate()
    image.save(out, fmt.upper(), **named)


def _decode(data: bytes, scale: int = 1) -> None:
    with Image.open(io.BytesIO(data)) as img:
        if scale > 1:
            img.draft("RGB", (img.width // scale, img.height // scale))
        img.load()


def calibrate(width: int = 3000, height: int = 2000, repeat: int = 5) -> dict[str, float]:
    """Milliseconds of one CPU per megapixel (``*_ms_per_mp``) or per megabyte (``bytes_ms_per_mb``), and the
    handoff's bytes per pixel, for a ``width`` x ``height`` photo."""
    image = detailed_photo(width, height, seed=3, slope=1.2, contrast=40)
    mp = width * height / 1e6
    costs: dict[str, float] = {}
    for fmt in ("JPEG", "PNG", "WEBP", "BMP", "GIF"):
        data = _file(image if fmt != "GIF" else image.convert("P"), fmt)
        costs[f"decode_{fmt.lower()}_ms_per_mp"] = _cpu_ms(partial(_decode, data), repeat) / mp
    jpeg = _file(image, "JPEG")
    for scale in DRAFT_SCALES[1:]:
        costs[f"decode_jpeg_draft{scale}_ms_per_mp"] = _cpu_ms(partial(_decode, jpeg, scale), repeat) / mp
    small = (width * 2 // 3, height * 2 // 3)
    costs["resize_ms_per_source_mp"] = _cpu_ms(
        lambda: image.resize(small, Image.Resampling.BICUBIC, reducing_gap=3.0), repeat) / mp
    target = image.resize(small, Image.Resampling.BICUBIC)
    target_mp = small[0] * small[1] / 1e6
    options: dict[str, dict[str, Any]] = {"bmp": {}, "png": {"compress_level": 1},
                                          "jpeg": {"quality": 100, "subsampling": 0}, "webp": {"quality": 100}}
    for fmt, named in options.items():
        written = io.BytesIO()
        costs[f"encode_{fmt}_ms_per_mp"] = _cpu_ms(partial(_save, target, written, fmt, named), repeat) / target_mp
        costs[f"handoff_{fmt}_bytes_per_pixel"] = len(written.getvalue()) / (small[0] * small[1])
    raw = _file(image, "BMP")
    body = orjson.dumps({"url": "data:image/bmp;base64," + pybase64.b64encode(raw).decode()})

    def through() -> None:  # mmgate encodes, the backend parses the body and decodes the string
        pybase64.b64encode(raw)
        pybase64.b64decode(orjson.loads(body)["url"].partition(",")[2], validate=True)

    costs["bytes_ms_per_mb"] = _cpu_ms(through, repeat) / (len(raw) / 1e6)
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
