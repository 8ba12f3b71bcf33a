"""One photo's way to a backend with ``MMGATE_MODEL`` set, for ``bench/fidelity``: what reaches the backend
against the backend's own resize of the original (the processor's, run on the full decode:
``testkit.models.idefics3_resize``), per candidate encoding of mmgate's resize: PSNR, bytes, and the thread CPU of
mmgate's side, the backend's decode and the whole handoff (encode, base64, base64 decode, decode); then what
``process_image`` sends, the original forwarded untouched, and the generic rule without a model. Every
``*_cpu_ms`` is the list of the rounds' milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from PIL import Image

from preprocessors.base import ImagePolicy
from preprocessors.image import GENERIC_JPEG_QUALITY, process_image
from testkit.call_timing import cpu_runs_ms
from testkit.image_steps import backend_decode, backend_receive, handoff_text, model_resize
from testkit.media import encoded, psnr
from testkit.models import idefics3_resize

SOURCE = {"JPEG": {"quality": 92}, "PNG": {"compress_level": 1}}  # a camera's JPEG; a PNG fast to build


@dataclass(frozen=True)
class Photo:
    name: str
    make: Callable[[], Image.Image]
    fmt: str = "JPEG"


@dataclass(frozen=True)
class Encoding:
    name: str
    fmt: str
    options: dict[str, Any]


def measure_encoding(encoding: Encoding, resized: Image.Image, reference: Image.Image, resize_cpu: list[float],
                     rounds: int) -> dict[str, Any]:
    """One candidate encoding of mmgate's resize: its PSNR, bytes and the CPU of each side."""
    out = encoded(resized, encoding.fmt, **encoding.options)
    got = backend_decode(out)
    encode_cpu = cpu_runs_ms(partial(encoded, resized, encoding.fmt, **encoding.options), rounds)
    decode_cpu = cpu_runs_ms(partial(backend_decode, out), rounds)
    send = partial(handoff_text, resized, encoding.fmt, encoding.options)
    text = send()
    path_cpu = [cpu_runs_ms(send, 1)[0] + cpu_runs_ms(partial(backend_receive, text), 1)[0] for _ in range(rounds)]
    return {"encoding": encoding.name, "psnr_db": round(psnr(got, reference), 2),
            "encode_only_psnr_db": round(psnr(got, resized), 2), "bytes": len(out),
            "base64_bytes": len(text), "handoff_cpu_ms": path_cpu,
            "mmgate_cpu_ms": [r + e for r, e in zip(resize_cpu, encode_cpu, strict=True)],
            "backend_decode_cpu_ms": decode_cpu}


def measure_photo(photo: Photo, folder: Path, policy: ImagePolicy, rounds: int, encodings: Sequence[Encoding],
                  chosen_name: str) -> dict[str, Any]:
    """One photo through a model's handoff: mmgate's resize (checked against ``process_image``'s) under each of
    ``encodings``; what ``process_image`` sends with the model (``chosen_name``: the encoding it picks), the
    original forwarded as it is, and the generic rule without a model at the same pixel count."""
    from preprocessors.image import _MODEL_REDUCING_GAP

    geometry = policy.geometry
    assert geometry is not None
    image = photo.make()
    data = encoded(image, photo.fmt, **SOURCE[photo.fmt])
    original_image = backend_decode(data)  # the original as the backend reads the file
    reference = idefics3_resize(folder, original_image)
    target = reference.size
    resize = partial(model_resize, data, target, geometry.resample, _MODEL_REDUCING_GAP)
    resized = resize()
    processed = process_image(data, ImagePolicy(geometry=geometry, output_format="png"))
    # None: even the lossless re-encode is no smaller than the original, which mmgate then sends as it is.
    assert processed is None or psnr(backend_decode(processed.data), resized) == float("inf"), \
        "the bench's resize is not process_image's"
    resize_cpu = cpu_runs_ms(resize, rounds)
    rows = [measure_encoding(encoding, resized, reference, resize_cpu, rounds) for encoding in encodings]
    # The chosen encoding, end to end through process_image as a model makes it.
    # None: no re-encode is smaller than the original, so mmgate forwards the original byte for byte and the
    # backend's own processing of it is the reference itself: no PSNR to compute, the pixels are identical.
    chosen = process_image(data, policy)
    chosen_cpu = cpu_runs_ms(lambda: process_image(data, policy), rounds)
    original_decode = cpu_runs_ms(lambda: backend_decode(data), rounds)
    backend_resize = cpu_runs_ms(lambda: original_image.resize(target, Image.Resampling(geometry.resample)), rounds)
    # Without a model: the generic rule at the same pixel count, BICUBIC, JPEG q90 4:2:0.
    generic_policy = ImagePolicy(resize_max_pixels=target[0] * target[1])
    generic = process_image(data, generic_policy)
    assert generic is not None
    generic_reference = original_image.resize((generic.width, generic.height), Image.Resampling.BICUBIC)
    generic_cpu = cpu_runs_ms(lambda: process_image(data, generic_policy), rounds)
    return {
        "photo": photo.name, "source": f"{photo.fmt} {image.width}x{image.height}", "source_bytes": len(data),
        "model_size": f"{target[0]}x{target[1]}", "resize_psnr_db": round(psnr(resized, reference), 2),
        "resize_cpu_ms": resize_cpu, "encodings": rows,
        "chosen": ({"encoding": chosen_name, "psnr_db": round(psnr(backend_decode(chosen.data), reference), 2),
                    "exact": False, "bytes": len(chosen.data), "mime": chosen.mime, "mmgate_cpu_ms": chosen_cpu}
                   if chosen is not None else
                   {"encoding": "the original, byte for byte", "psnr_db": None, "exact": True, "bytes": len(data),
                    "mime": f"image/{photo.fmt.lower()}", "mmgate_cpu_ms": chosen_cpu}),
        "original": {"bytes": len(data), "backend_decode_cpu_ms": original_decode,
                     "backend_resize_cpu_ms": backend_resize},
        "generic": {"encoding": f"BICUBIC, JPEG q{GENERIC_JPEG_QUALITY} 4:2:0",
                    "size": f"{generic.width}x{generic.height}",
                    "psnr_db": round(psnr(backend_decode(generic.data), generic_reference), 2),
                    "psnr_vs_model_reference_db": round(psnr(backend_decode(generic.data).resize(
                        target, Image.Resampling(geometry.resample)), reference), 2),
                    "bytes": len(generic.data), "saved": round(1 - len(generic.data) / len(data), 3),
                    "mmgate_cpu_ms": generic_cpu},
    }
