"""The steps of an image's way from a client through mmgate to a backend, each a call the image benches time
alone (``bench/image_pipeline``, ``fidelity``, ``testkit.handoff_calibration``):

- the backend's side: ``backend_decode`` (open, load, RGB) and ``backend_receive`` (base64 decode, then that);
- mmgate's side with a model: ``model_resize`` (``process_image``'s draft decode and resize, before its encode),
  and ``handoff_text`` (the encode and its base64);
- ``draft_decode``: a decode at one of libjpeg's draft scales;
- the yardstick without mmgate: ``naive_downscale`` (full decode, BICUBIC, JPEG);
- ``resize_alternatives``: mmgate's decode-and-resize and the other ways it could have gone (other Pillow
  filters and reductions, simplejpeg's DCT scaling and pyvips' shrink-on-load where installed).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import pybase64
from PIL import Image

from testkit.media import encoded

BICUBIC, LANCZOS = Image.Resampling.BICUBIC, Image.Resampling.LANCZOS


def backend_decode(data: bytes) -> Image.Image:
    """What a backend does with the file it receives: open, load, convert to RGB."""
    img = Image.open(io.BytesIO(data))
    img.load()
    return img.convert("RGB")


def backend_receive(text: bytes) -> Image.Image:
    """The backend's side of the handoff: its base64 decode, then its decode."""
    return backend_decode(pybase64.b64decode(text, validate=True))


def handoff_text(image: Image.Image, fmt: str, options: dict[str, Any]) -> bytes:
    """mmgate's side of the handoff: the file and its base64."""
    return pybase64.b64encode(encoded(image, fmt, **options))


def model_resize(data: bytes, target: tuple[int, int], resample: int, reducing_gap: float) -> Image.Image:
    """``process_image``'s decode and resize with a model, before its encode (``bench/fidelity`` checks it is
    pixel for pixel the same)."""
    img = Image.open(io.BytesIO(data))
    draft = img.draft(None, target)
    img.load()
    return img.convert("RGB").resize(target, Image.Resampling(resample), box=draft[1] if draft else None,
                                     reducing_gap=reducing_gap)


def draft_decode(data: bytes, scale: int = 1) -> None:
    """A decode at 1/``scale`` of the size (JPEG draft; 1: the whole picture)."""
    with Image.open(io.BytesIO(data)) as img:
        if scale > 1:
            img.draft("RGB", (img.width // scale, img.height // scale))
        img.load()


def fitted(size: tuple[int, int], pixels: int) -> tuple[int, int]:
    """``size`` scaled down to at most ``pixels`` (never up)."""
    w, h = size
    scale = min(1.0, math.sqrt(pixels / (w * h)))
    return max(1, int(w * scale)), max(1, int(h * scale))


def naive_downscale(data: bytes, pixels: int, quality: int) -> bytes:
    """The pipeline anyone writes first: full decode, RGB, BICUBIC at full resolution to ``pixels``, JPEG."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    return encoded(img.resize(fitted(img.size, pixels), BICUBIC), "JPEG", quality=quality)


def _pillow(data: bytes, target: tuple[int, int], resample: Image.Resampling, draft: bool,
            gap: float | None) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    box = img.draft("RGB", target)[1] if draft else None  # type: ignore[index]
    img.load()
    return img.resize(target, resample, box=box, reducing_gap=gap)


def _reduce_then(data: bytes, target: tuple[int, int], factor: int, resample: Image.Resampling) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img.reduce(factor).resize(target, resample)


def _simplejpeg(data: bytes, target: tuple[int, int], resample: Image.Resampling) -> Image.Image:
    import simplejpeg  # type: ignore[import-not-found,import-untyped,unused-ignore]

    # libjpeg-turbo's DCT scaling by any M/8 (3/8 here), not only Pillow's 1/2, 1/4, 1/8
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=target[0], min_height=target[1])
    return Image.fromarray(pixels).resize(target, resample)


def _vips(data: bytes, target: tuple[int, int]) -> Image.Image:
    import pyvips  # type: ignore[import-not-found,import-untyped,unused-ignore]

    image = pyvips.Image.thumbnail_buffer(data, target[0], height=target[1], size="force")
    return Image.fromarray(image.numpy())


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # not installed, or its native library is missing
        return False
    return True


def resize_alternatives(data: bytes, target: tuple[int, int]) -> list[tuple[str, Callable[[], Image.Image]]]:
    """A JPEG decoded and resized to ``target`` from the file, each way labelled (what mmgate does where)."""
    ways: list[tuple[str, Callable[[], Image.Image]]] = [
        ("naive: full decode + BICUBIC", partial(_pillow, data, target, BICUBIC, False, None)),
        ("full decode + BICUBIC, reducing_gap 1.5 (mmgate, non-JPEG)",
         partial(_pillow, data, target, BICUBIC, False, 1.5)),
        ("full decode + BICUBIC, reducing_gap 3 (mmgate with a model, non-JPEG)",
         partial(_pillow, data, target, BICUBIC, False, 3.0)),
        ("full decode + reduce(2) + BICUBIC", partial(_reduce_then, data, target, 2, BICUBIC)),
        ("full decode + reduce(3) + BICUBIC", partial(_reduce_then, data, target, 3, BICUBIC)),
        ("draft 1/2 + BICUBIC (mmgate, JPEG; a BICUBIC model)", partial(_pillow, data, target, BICUBIC, True, None)),
        ("draft 1/2 + LANCZOS (a LANCZOS model: Idefics3)", partial(_pillow, data, target, LANCZOS, True, None)),
        ("draft 1/2 + HAMMING", partial(_pillow, data, target, Image.Resampling.HAMMING, True, None)),
        ("draft 1/2 + BILINEAR", partial(_pillow, data, target, Image.Resampling.BILINEAR, True, None)),
    ]
    if _installed("simplejpeg"):
        ways.append(("simplejpeg: DCT scaling 3/8 + BICUBIC", partial(_simplejpeg, data, target, BICUBIC)))
    if _installed("pyvips"):
        import pyvips

        pyvips.concurrency_set(1)  # one thread, like a decode worker
        ways.append(("pyvips thumbnail (shrink-on-load + lanczos3), 1 thread", partial(_vips, data, target)))
    return ways
