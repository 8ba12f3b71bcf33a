"""Fidelity with ``MMGATE_MODEL``: what reaches the backend against the backend's own resize of the original.

The model is Idefics3 (a processor folder built by ``testkit.models``; no weights, no downloads): its processor
resizes a 4000x3000 photo to 1456x1092 with LANCZOS (its PIL backend's ``resample``). The **reference** is that
resize run by the processor itself on the fully decoded original (``testkit.models.idefics3_resize``): what the
backend would make of the original had mmgate forwarded it untouched.

The images are generated, deterministic 1/f noise photos (``testkit.media.detailed_photo``: the amplitude
spectrum of natural images, detail at every scale: the hard case for JPEG) of several slopes, contrasts and
colour detail, and the smooth-plus-sensor-noise photo of ``bench/image_pipeline.py``; each sent as a camera
JPEG (quality 92), one also as PNG. mmgate decodes each as ``process_image`` does with the model (JPEG draft
decode, the processor's filter) and the bench then encodes the same pixels with each candidate encoding:

* PSNR (dB) of the decoded output against the reference, and of the resize alone (the bound any lossless
  encoding reaches);
* bytes to the backend (the file; base64 in the JSON adds a third);
* mmgate CPU ms: decode and resize (shared by every candidate) plus the candidate's encode, thread CPU;
* backend decode CPU ms: ``Image.open`` + ``load`` + ``convert("RGB")`` of what it receives, thread CPU;
* handoff CPU ms: what the choice of encoding costs the whole path, thread CPU: mmgate's encode and base64,
  then the backend's base64 decode and its decode, as above (the resize, the same for every candidate, left
  out). The bytes themselves cross the sidecar's loopback.

"original" is the other way: forward the file untouched; the backend then decodes 12 MP and resizes itself.
A self-check asserts the bench's resize is pixel for pixel ``process_image``'s (PNG output).

Without a model (the generic rule, ``MMGATE_RESIZE_MAX_PIXELS`` at the same pixel count): BICUBIC, JPEG q90
4:2:0, its PSNR against Pillow's BICUBIC of the original at that size and the bytes it saves.

Goal: every image ≥ 40 dB with the encoding mmgate uses with a model (``MMGATE_IMAGE_FORMAT=auto``: BMP).
Timings are the median of ``--rounds`` (≥ 3) with their spread; PSNR and bytes are deterministic.

    python -m bench run fidelity [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list fidelity   # the knobs and their defaults
"""

from __future__ import annotations

import io
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pybase64
from PIL import Image

from bench import _results as R
from preprocessors.base import ImagePolicy
from preprocessors.image import GENERIC_JPEG_QUALITY, process_image
from testkit.media import detailed_photo, photo_sized, psnr
from testkit.models import idefics3_folder, idefics3_resize

SCRIPT = "fidelity.py"
WHAT = "PSNR vs the backend's own resize, bytes and CPU per output encoding, with a model (Idefics3)"
BOUND_DB = 40.0
SIZE = (4000, 3000)
SOURCE_QUALITY = 92


@dataclass(frozen=True)
class Photo:
    name: str
    make: Callable[[], Image.Image]
    fmt: str = "JPEG"


def high_detail(optics: float = 0.7) -> Image.Image:
    """The high-detail photo (tests/preprocessors/test_image_fidelity.py asserts the bound on it): where JPEG q90
    at the model's size loses the most of the set."""
    return detailed_photo(*SIZE, seed=1, slope=1.0, contrast=40, shared=0.4, optics=optics)


PHOTOS = (
    Photo("high-detail photo (1/f slope 1.0, colour detail, lens blur 0.7 px)",
          high_detail),
    Photo("1/f slope 1.1, contrast 40", lambda: detailed_photo(*SIZE, seed=2, slope=1.1, contrast=40, optics=0.7)),
    Photo("1/f slope 1.2, colour detail", lambda: detailed_photo(*SIZE, seed=3, slope=1.2, contrast=40, shared=0.4)),
    Photo("1/f slope 1.35, contrast 45", lambda: detailed_photo(*SIZE, seed=4, slope=1.35, contrast=45)),
    Photo("1/f slope 1.5, contrast 50", lambda: detailed_photo(*SIZE, seed=5, slope=1.5, contrast=50)),
    Photo("smooth fields + sensor noise", lambda: photo_sized(*SIZE, seed=6)),
    Photo("1/f slope 1.2 as PNG", lambda: detailed_photo(*SIZE, seed=7, slope=1.2, contrast=40), "PNG"),
    Photo("stress: the high-detail photo without lens blur (detail to the last pixel)",
          lambda: high_detail(optics=0.0)),
)
QUICK_PHOTOS = (0, 6)


@dataclass(frozen=True)
class Encoding:
    name: str
    fmt: str
    options: dict[str, Any]


ENCODINGS = (
    Encoding("JPEG q90 4:2:0 (generic default)", "JPEG", {"quality": 90}),
    Encoding("JPEG q95 4:2:0", "JPEG", {"quality": 95}),
    Encoding("JPEG q95 4:4:4", "JPEG", {"quality": 95, "subsampling": 0}),
    Encoding("JPEG q98 4:4:4", "JPEG", {"quality": 98, "subsampling": 0}),
    Encoding("JPEG q100 4:4:4", "JPEG", {"quality": 100, "subsampling": 0}),
    Encoding("PNG level 1", "PNG", {"compress_level": 1}),
    Encoding("WebP lossless, method 0", "WEBP", {"lossless": True, "method": 0, "quality": 0}),
    Encoding("WebP near-lossless 60, method 0", "WEBP", {"lossless": True, "near_lossless": 60, "method": 0,
                                                          "quality": 0}),
    Encoding("BMP, uncompressed", "BMP", {}),
)
CHOSEN = "BMP, uncompressed"  # what process_image sends with a model and MMGATE_IMAGE_FORMAT=auto


def cpu_ms(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.thread_time()
    out = fn()
    return out, (time.thread_time() - start) * 1000


def source_bytes(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    if fmt == "JPEG":
        image.save(buf, "JPEG", quality=SOURCE_QUALITY)
    else:
        image.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def mmgate_resize(data: bytes, target: tuple[int, int], resample: int, reducing_gap: float) -> Image.Image:
    """``process_image``'s decode and resize with a model, before its encode (the self-check holds it to it)."""
    img = Image.open(io.BytesIO(data))
    draft = img.draft(None, target)
    img.load()
    return img.convert("RGB").resize(target, Image.Resampling(resample), box=draft[1] if draft else None,
                                     reducing_gap=reducing_gap)


def encode(image: Image.Image, encoding: Encoding) -> bytes:
    buf = io.BytesIO()
    image.save(buf, encoding.fmt, **encoding.options)
    return buf.getvalue()


def handoff(image: Image.Image, encoding: Encoding) -> bytes:
    """mmgate's side of the handoff: the file and its base64."""
    return pybase64.b64encode(encode(image, encoding))


def backend_receive(text: bytes) -> Image.Image:
    """The backend's side: its base64 decode and its decode."""
    return backend_decode(pybase64.b64decode(text, validate=True))


def backend_decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img.convert("RGB")


def summary(values: list[float]) -> dict[str, Any]:
    return R.summary(round(v, 2) for v in values)


def measure_photo(photo: Photo, folder: Path, policy: ImagePolicy, rounds: int) -> dict[str, Any]:
    from preprocessors.image import _MODEL_REDUCING_GAP

    geometry = policy.geometry
    assert geometry is not None
    data = source_bytes(photo.make(), photo.fmt)
    original_image = backend_decode(data)  # the original as the backend reads the file
    reference = idefics3_resize(folder, original_image)
    target = reference.size
    resized = mmgate_resize(data, target, geometry.resample, _MODEL_REDUCING_GAP)
    processed = process_image(data, ImagePolicy(geometry=geometry, output_format="png"))
    # None: even the lossless re-encode is no smaller than the original, which mmgate then sends as it is.
    assert processed is None or psnr(backend_decode(processed.data), resized) == float("inf"), \
        "the bench's resize is not process_image's"
    resize_cpu = [cpu_ms(lambda: mmgate_resize(data, target, geometry.resample, _MODEL_REDUCING_GAP))[1]
                  for _ in range(rounds)]
    resize_psnr = psnr(resized, reference)
    rows = []
    for encoding in ENCODINGS:
        out = encode(resized, encoding)
        got = backend_decode(out)
        encode_cpu = [cpu_ms(partial(encode, resized, encoding))[1] for _ in range(rounds)]
        decode_cpu = [cpu_ms(partial(backend_decode, out))[1] for _ in range(rounds)]
        text = handoff(resized, encoding)
        path_cpu = [cpu_ms(partial(handoff, resized, encoding))[1] + cpu_ms(partial(backend_receive, text))[1]
                    for _ in range(rounds)]
        rows.append({"encoding": encoding.name, "psnr_db": round(psnr(got, reference), 2),
                     "encode_only_psnr_db": round(psnr(got, resized), 2), "bytes": len(out),
                     "base64_bytes": len(text), "handoff_cpu_ms": summary(path_cpu),
                     "mmgate_cpu_ms": summary([r + e for r, e in zip(resize_cpu, encode_cpu, strict=True)]),
                     "backend_decode_cpu_ms": summary(decode_cpu)})
    # The chosen encoding, end to end through process_image as a model makes it.
    # None: no re-encode is smaller than the original, so mmgate forwards the original byte for byte and the
    # backend's own processing of it is the reference itself: no PSNR to compute, the pixels are identical.
    chosen = process_image(data, policy)
    chosen_psnr = None if chosen is None else round(psnr(backend_decode(chosen.data), reference), 2)
    chosen_cpu = [cpu_ms(lambda: process_image(data, policy))[1] for _ in range(rounds)]
    original_decode = [cpu_ms(lambda: backend_decode(data))[1] for _ in range(rounds)]
    backend_resize = [cpu_ms(lambda: original_image.resize(target, Image.Resampling(geometry.resample)))[1]
                      for _ in range(rounds)]
    # Without a model: the generic rule at the same pixel count, BICUBIC, JPEG q90 4:2:0.
    generic_policy = ImagePolicy(resize_max_pixels=target[0] * target[1])
    generic = process_image(data, generic_policy)
    assert generic is not None
    generic_reference = original_image.resize((generic.width, generic.height), Image.Resampling.BICUBIC)
    generic_cpu = [cpu_ms(lambda: process_image(data, generic_policy))[1] for _ in range(rounds)]
    return {
        "photo": photo.name, "source": f"{photo.fmt} {SIZE[0]}x{SIZE[1]}", "source_bytes": len(data),
        "model_size": f"{target[0]}x{target[1]}", "resize_psnr_db": round(resize_psnr, 2),
        "resize_cpu_ms": summary(resize_cpu), "encodings": rows,
        "chosen": ({"encoding": CHOSEN, "psnr_db": chosen_psnr, "exact": False, "bytes": len(chosen.data),
                    "mime": chosen.mime, "mmgate_cpu_ms": summary(chosen_cpu)} if chosen is not None else
                   {"encoding": "the original, byte for byte", "psnr_db": None, "exact": True, "bytes": len(data),
                    "mime": f"image/{photo.fmt.lower()}", "mmgate_cpu_ms": summary(chosen_cpu)}),
        "original": {"bytes": len(data), "backend_decode_cpu_ms": summary(original_decode),
                     "backend_resize_cpu_ms": summary(backend_resize)},
        "generic": {"encoding": f"BICUBIC, JPEG q{GENERIC_JPEG_QUALITY} 4:2:0",
                    "size": f"{generic.width}x{generic.height}",
                    "psnr_db": round(psnr(backend_decode(generic.data), generic_reference), 2),
                    "psnr_vs_model_reference_db": round(psnr(backend_decode(generic.data).resize(
                        target, Image.Resampling(geometry.resample)), reference), 2),
                    "bytes": len(generic.data), "saved": round(1 - len(generic.data) / len(data), 3),
                    "mmgate_cpu_ms": summary(generic_cpu)},
    }


def goals(data: dict[str, Any]) -> list[R.Goal]:
    out = []
    for photo in data["photos"]:
        value = photo["chosen"]["psnr_db"]
        exact = photo["chosen"].get("exact", False)
        goal = R.record(f"{photo['photo']}: PSNR with a model ({photo['chosen']['encoding']}"
                        f"{': identical pixels' if exact else ''})",
                        {"median": value, "spread": None if exact else [value, value], "n": 1}, f"≥ {BOUND_DB:g}",
                        lambda v: v >= BOUND_DB, unit="dB", over="deterministic runs")
        if exact:
            goal["met"] = True
        out.append(goal)
    for photo in data["photos"]:
        value = photo["generic"]["psnr_db"]
        out.append(R.record(f"{photo['photo']}: PSNR without a model ({photo['generic']['encoding']}, "
                            f"{photo['generic']['saved']:.0%} of the bytes saved)",
                            {"median": value, "spread": [value, value], "n": 1}, unit="dB",
                            over="deterministic runs"))
    return out


def chosen_psnr_text(chosen: dict[str, Any]) -> str:
    return "exact (the original, byte for byte)" if chosen.get("exact") else f"{chosen['psnr_db']} dB"



def report(data: dict[str, Any]) -> str:
    lines = [
        f"Idefics3 (LANCZOS, {SIZE[0]}x{SIZE[1]} → its 1456x1092), "
        f"{data['rounds']} rounds per timing (median, min–max), thread CPU. Reference: the processor's own resize "
        "of the fully decoded original. PSNR over RGB, 8 bits. The chosen encoding is what mmgate sends with a "
        f"model and `MMGATE_IMAGE_FORMAT=auto`: {CHOSEN}. Handoff CPU: mmgate's encode and base64, plus the "
        "backend's base64 decode and decode (the resize, the same for all, left out).",
        "",
        "## Summary over the photos",
        "",
        "| encoding | PSNR dB, lowest | PSNR dB, median | bytes, median | mmgate CPU ms, median | "
        "backend decode CPU ms, median | handoff CPU ms, median |",
        "|---|---|---|---|---|---|---|",
    ]
    names = [e.name for e in ENCODINGS]
    for name in names:
        rows = [next(r for r in p["encodings"] if r["encoding"] == name) for p in data["photos"]]
        ps = sorted(r["psnr_db"] for r in rows)
        by = sorted(r["bytes"] for r in rows)
        cpu = sorted(r["mmgate_cpu_ms"]["median"] for r in rows)
        dec = sorted(r["backend_decode_cpu_ms"]["median"] for r in rows)
        path = sorted(r["handoff_cpu_ms"]["median"] for r in rows)
        mid = len(rows) // 2
        lines.append(f"| {name}{' (chosen)' if name == CHOSEN else ''} | {ps[0]} | {ps[mid]} | "
                     f"{by[mid] / 1e6:.2f} MB | {R.number(cpu[mid])} | {R.number(dec[mid])} | "
                     f"{R.number(path[mid])} |")
    originals = data["photos"]
    mid = len(originals) // 2
    decode = sorted(p["original"]["backend_decode_cpu_ms"]["median"] for p in originals)[mid]
    resize = sorted(p["original"]["backend_resize_cpu_ms"]["median"] for p in originals)[mid]
    lines.append(f"| original, forwarded (the backend decodes 12 MP and resizes) | exact | exact | "
                 f"{sorted(p['source_bytes'] for p in originals)[mid] / 1e6:.2f} MB | validate only | "
                 f"{R.number(decode)} + resize {R.number(resize)} | – |")
    for photo in data["photos"]:
        lines += [
            "",
            f"## {photo['photo']}: {photo['source']}, {photo['source_bytes'] / 1e6:.2f} MB → {photo['model_size']}",
            "",
            f"Resize alone (draft decode + the processor's filter): {photo['resize_psnr_db']} dB, "
            f"{R.summary_text(photo['resize_cpu_ms'])} ms CPU. Through `process_image` with the model: "
            f"{chosen_psnr_text(photo['chosen'])}, "
            f"{photo['chosen']['bytes'] / 1e6:.2f} MB {photo['chosen']['mime']}, "
            f"{R.summary_text(photo['chosen']['mmgate_cpu_ms'])} ms CPU. "
            f"Without a model ({photo['generic']['encoding']}, "
            f"{photo['generic']['size']}): {photo['generic']['psnr_db']} dB against Pillow's BICUBIC of the original "
            f"({photo['generic']['psnr_vs_model_reference_db']} dB against the model's reference), "
            f"{photo['generic']['bytes'] / 1e6:.2f} MB ({photo['generic']['saved']:.0%} saved), "
            f"{R.summary_text(photo['generic']['mmgate_cpu_ms'])} ms CPU. "
            "Forwarded as it is, the backend decodes it in "
            f"{R.summary_text(photo['original']['backend_decode_cpu_ms'])} ms and resizes it in "
            f"{R.summary_text(photo['original']['backend_resize_cpu_ms'])} ms.",
            "",
            "| encoding | PSNR dB | encode-only PSNR dB | bytes | mmgate CPU ms | backend decode CPU ms | "
            "handoff CPU ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in photo["encodings"]:
            lines.append(f"| {r['encoding']} | {r['psnr_db']} | {r['encode_only_psnr_db']} | "
                         f"{r['bytes'] / 1e6:.2f} MB | {R.summary_text(r['mmgate_cpu_ms'])} | "
                         f"{R.summary_text(r['backend_decode_cpu_ms'])} | {R.summary_text(r['handoff_cpu_ms'])} |")
    return "\n".join(lines) + "\n"


def measure(knobs: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp(SCRIPT, WHAT)
    from proxy.media.model_folder import load_model

    photos = [PHOTOS[i] for i in QUICK_PHOTOS] if knobs.quick else list(PHOTOS)
    rounds = max(knobs.rounds, R.MIN_ROUNDS)
    with tempfile.TemporaryDirectory(prefix="mmgate-fidelity-") as tmp:
        folder = idefics3_folder(Path(tmp))
        model = load_model(str(folder))
        if model.geometry is None:
            raise SystemExit("the Idefics3 folder gave no geometry")
        policy = ImagePolicy(geometry=model.geometry)
        results = []
        for photo in photos:
            print(f"  {photo.name}...", flush=True)
            results.append(measure_photo(photo, folder, policy, rounds))
    return stamp | {"rounds": rounds, "bound_db": BOUND_DB, "photos": results}
