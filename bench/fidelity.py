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
* backend decode CPU ms: ``testkit.image_steps.backend_decode`` (open, load, convert to RGB) of what it receives,
  thread CPU;
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

import tempfile
from pathlib import Path
from typing import Any

from bench import _results as R
from preprocessors.base import ImagePolicy
from testkit.encoding_fidelity import Encoding, Photo, measure_photo
from testkit.media import detailed_photo, high_detail_photo, photo_sized
from testkit.models import idefics3_folder

WHAT = "PSNR vs the backend's own resize, bytes and CPU per output encoding, with a model (Idefics3)"
BOUND_DB = 40.0
SIZE = (4000, 3000)
PHOTOS = (
    Photo("high-detail photo (1/f slope 1.0, colour detail, lens blur 0.7 px)", lambda: high_detail_photo(*SIZE)),
    Photo("1/f slope 1.1, contrast 40", lambda: detailed_photo(*SIZE, seed=2, slope=1.1, contrast=40, optics=0.7)),
    Photo("1/f slope 1.2, colour detail", lambda: detailed_photo(*SIZE, seed=3, slope=1.2, contrast=40, shared=0.4)),
    Photo("1/f slope 1.35, contrast 45", lambda: detailed_photo(*SIZE, seed=4, slope=1.35, contrast=45)),
    Photo("1/f slope 1.5, contrast 50", lambda: detailed_photo(*SIZE, seed=5, slope=1.5, contrast=50)),
    Photo("smooth fields + sensor noise", lambda: photo_sized(*SIZE, seed=6)),
    Photo("1/f slope 1.2 as PNG", lambda: detailed_photo(*SIZE, seed=7, slope=1.2, contrast=40), "PNG"),
    Photo("stress: the high-detail photo without lens blur (detail to the last pixel)",
          lambda: high_detail_photo(*SIZE, optics=0.0)),
)
QUICK_PHOTOS = (0, 6)


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


def summarised(value: Any) -> Any:
    """``value`` with each ``*_cpu_ms`` list of rounds as its summary (to 0.01 ms), the rest as it is."""
    if isinstance(value, list):
        return [summarised(item) for item in value]
    if isinstance(value, dict):
        return {key: R.summary(round(v, 2) for v in item) if key.endswith("_cpu_ms") else summarised(item)
                for key, item in value.items()}
    return value


def measure(knobs: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("fidelity.py", WHAT)
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
            results.append(summarised(measure_photo(photo, folder, policy, rounds, ENCODINGS, CHOSEN)))
    return stamp | {"rounds": rounds, "bound_db": BOUND_DB, "photos": results}


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


def table(titles: str, rows: list[list[Any]]) -> list[str]:
    """A Markdown table of ready-made cells, every column left-aligned; ``titles`` separated by ``; ``."""
    columns = [(title, str(i), "s") for i, title in enumerate(titles.split("; "))]
    return R.table(columns, ({str(i): str(cell) for i, cell in enumerate(row)} for row in rows))


def summary_rows(photos: list[dict[str, Any]]) -> list[list[Any]]:
    """Per encoding over the photos: the lowest and median PSNR and the median of the other figures; then the
    original, forwarded."""
    mid = len(photos) // 2

    def middle(values: list[Any]) -> Any:
        return sorted(values)[mid]

    rows = []
    for encoding in ENCODINGS:
        cells = [next(r for r in p["encodings"] if r["encoding"] == encoding.name) for p in photos]
        rows.append([f"{encoding.name}{' (chosen)' if encoding.name == CHOSEN else ''}",
                     min(r["psnr_db"] for r in cells), middle([r["psnr_db"] for r in cells]),
                     f"{middle([r['bytes'] for r in cells]) / 1e6:.2f} MB",
                     *(R.number(middle([r[key]["median"] for r in cells]))
                       for key in ("mmgate_cpu_ms", "backend_decode_cpu_ms", "handoff_cpu_ms"))])
    decode, resize = (R.number(middle([p["original"][key]["median"] for p in photos]))
                      for key in ("backend_decode_cpu_ms", "backend_resize_cpu_ms"))
    rows.append(["original, forwarded (the backend decodes 12 MP and resizes)", "exact", "exact",
                 f"{middle([p['source_bytes'] for p in photos]) / 1e6:.2f} MB", "validate only",
                 f"{decode} + resize {resize}", "–"])
    return rows


def photo_text(photo: dict[str, Any]) -> str:
    chosen, generic, original = photo["chosen"], photo["generic"], photo["original"]
    chosen_psnr = "exact (the original, byte for byte)" if chosen.get("exact") else f"{chosen['psnr_db']} dB"
    return (f"Resize alone (draft decode + the processor's filter): {photo['resize_psnr_db']} dB, "
            f"{R.summary_text(photo['resize_cpu_ms'])} ms CPU. Through `process_image` with the model: "
            f"{chosen_psnr}, {chosen['bytes'] / 1e6:.2f} MB {chosen['mime']}, "
            f"{R.summary_text(chosen['mmgate_cpu_ms'])} ms CPU. Without a model ({generic['encoding']}, "
            f"{generic['size']}): {generic['psnr_db']} dB against Pillow's BICUBIC of the original "
            f"({generic['psnr_vs_model_reference_db']} dB against the model's reference), "
            f"{generic['bytes'] / 1e6:.2f} MB ({generic['saved']:.0%} saved), "
            f"{R.summary_text(generic['mmgate_cpu_ms'])} ms CPU. Forwarded as it is, the backend decodes it in "
            f"{R.summary_text(original['backend_decode_cpu_ms'])} ms and resizes it in "
            f"{R.summary_text(original['backend_resize_cpu_ms'])} ms.")


def report(data: dict[str, Any]) -> str:
    lines = [
        f"Idefics3 (LANCZOS, {SIZE[0]}x{SIZE[1]} → its 1456x1092), "
        f"{data['rounds']} rounds per timing (median, min–max), thread CPU. Reference: the processor's own resize "
        "of the fully decoded original. PSNR over RGB, 8 bits. The chosen encoding is what mmgate sends with a "
        f"model and `MMGATE_IMAGE_FORMAT=auto`: {CHOSEN}. Handoff CPU: mmgate's encode and base64, plus the "
        "backend's base64 decode and decode (the resize, the same for all, left out).",
        "", "## Summary over the photos", "",
        *table("encoding; PSNR dB, lowest; PSNR dB, median; bytes, median; mmgate CPU ms, median; "
               "backend decode CPU ms, median; handoff CPU ms, median", summary_rows(data["photos"])),
    ]
    for photo in data["photos"]:
        lines += [
            "", f"## {photo['photo']}: {photo['source']}, {photo['source_bytes'] / 1e6:.2f} MB → {photo['model_size']}",
            "", photo_text(photo), "",
            *table("encoding; PSNR dB; encode-only PSNR dB; bytes; mmgate CPU ms; backend decode CPU ms; "
                   "handoff CPU ms",
                   [[r["encoding"], r["psnr_db"], r["encode_only_psnr_db"], f"{r['bytes'] / 1e6:.2f} MB",
                     *(R.summary_text(r[key]) for key in ("mmgate_cpu_ms", "backend_decode_cpu_ms", "handoff_cpu_ms"))]
                    for r in photo["encodings"]]),
        ]
    return "\n".join(lines) + "\n"
