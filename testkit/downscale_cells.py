"""The cells of ``bench/image_pipeline``: photo-like images downscaled to at most 1 MP by the ways the bench
compares, each timed alone on one thread.

- ``pipeline_rows``: each input (a 4:3 photo of 1 to 24 MP, JPEG q90 or PNG) through the naive Pillow pipeline,
  ``process_image`` and ``process_image`` with a Qwen2-VL model, the ways taking turns: wall and thread CPU ms,
  images/s on 1 and 2 threads, what the model path sends and its PSNR against the processor's own resize;
- ``resample_rows``: a 12 MP high-detail JPEG decoded and resized by each of ``image_steps.resize_alternatives``,
  process CPU and PSNR against BICUBIC and LANCZOS of the full decode;
- ``blocks_rows``: ``process_image`` on 12 MP inputs with Pillow keeping 0 to 256 freed blocks for reuse.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from io import BytesIO
from pathlib import Path
from typing import Any

from PIL import Image

from preprocessors.base import ImagePolicy
from preprocessors.image import process_image
from testkit.call_timing import interleaved, per_second, wall_and_cpu_ms
from testkit.image_steps import fitted, naive_downscale, resize_alternatives
from testkit.media import encoded, four_by_three, high_detail_photo, photo_sized, psnr

TARGET_PIXELS = 1_000_000
POLICY = ImagePolicy(resize_max_pixels=TARGET_PIXELS)
QUALITY = 90
SOURCE = {"JPEG": {"quality": QUALITY}, "PNG": {"compress_level": 1}}  # PNG: fast to build; decode cost barely
# depends on the level


def photo_file(megapixels: float, fmt: str) -> bytes:
    """A 4:3 photo-like picture (smooth colour fields plus sensor-like noise) as a ``fmt`` file."""
    return encoded(photo_sized(*four_by_three(megapixels), 0), fmt, **SOURCE[fmt])


def model_policy() -> ImagePolicy:
    """The policy of ``MMGATE_MODEL`` set to a Qwen2-VL processor (built locally: no weights, no downloads)."""
    import tempfile

    from proxy.media.model_folder import load_model
    from testkit.models import qwen_folder

    geometry = load_model(str(qwen_folder(Path(tempfile.mkdtemp(prefix="mmgate-bench-qwen-"))))).geometry
    assert geometry is not None
    return ImagePolicy(geometry=geometry)


def model_reference(data: bytes, policy: ImagePolicy) -> Image.Image | None:
    """The processor's own resize of the decoded original (Qwen's PIL backend: Pillow BICUBIC), or None when the
    model takes the image as it is."""
    assert policy.geometry is not None
    img = Image.open(BytesIO(data)).convert("RGB")
    size = policy.geometry.backend_size(*img.size)
    if size[0] >= img.width or size[1] >= img.height:
        return None
    return img.resize(size, Image.Resampling(policy.geometry.resample))


def median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 1), round(max(values), 1)]


def output_size(out: Any) -> str:
    return f"{out.width}x{out.height}" if out is not None else "forwarded as is"


def pipeline_rows(sizes: list[float], repeat: int) -> list[dict[str, object]]:
    """Each input through the three ways, the ways taking turns: wall and thread CPU, images/s on 1 and 2
    threads, and what the model path sends and its PSNR."""
    rows = []
    policy = model_policy()
    ways: dict[str, Callable[[bytes], Any]] = {
        "naive": partial(naive_downscale, pixels=TARGET_PIXELS, quality=QUALITY),
        "mmgate": partial(process_image, policy=POLICY), "model": partial(process_image, policy=policy)}
    for fmt in ("JPEG", "PNG"):
        for mp in sizes:
            data = photo_file(mp, fmt)
            modelled, reference = process_image(data, policy), model_reference(data, policy)
            row: dict[str, object] = {
                "input": f"{fmt} {mp:g} MP", "input_mb": round(len(data) / 1e6, 2),
                "mmgate_output": output_size(ways["mmgate"](data)), "model_output": output_size(modelled),
                "model_mb": round(len(modelled.data) / 1e6, 2) if modelled is not None else "–",
                "model_psnr_db": (round(psnr(Image.open(BytesIO(modelled.data)), reference), 2)
                                  if modelled is not None and reference is not None else "–"),
            }
            ways["naive"](data)  # warm-up (page cache of the allocator, lazy imports)
            runs = interleaved({name: partial(way, data) for name, way in ways.items()}, repeat)
            for name, way in ways.items():
                walls, cpus = [r[0] for r in runs[name]], [r[1] for r in runs[name]]
                row |= {f"{name}_ms": median(walls), f"{name}_ms_spread": spread(walls), f"{name}_runs": len(walls),
                        f"{name}_cpu_ms": median(cpus), f"{name}_cpu_ms_spread": spread(cpus),
                        f"{name}_ips_1t": round(len(walls) / (sum(walls) / 1000), 2),
                        f"{name}_ips_2t": round(per_second(way, data, 2, repeat + repeat % 2), 2)}
            for suffix in ("", "_cpu"):
                row[f"speedup{suffix}"] = round(float(row[f"naive{suffix}_ms"]) /  # type: ignore[arg-type]
                                                float(row[f"mmgate{suffix}_ms"]), 2)  # type: ignore[arg-type]
            print(f"  {row['input']}: naive {row['naive_ms']} ms, mmgate {row['mmgate_ms']} ms, model "
                  f"{row['model_ms']} ms", flush=True)
            rows.append(row)
    return rows


def resample_rows(repeat: int) -> list[dict[str, object]]:
    """12 MP JPEG -> 1 MP, decode and resize from the file: mmgate's ways and their alternatives, process CPU
    (a library's own threads count too) and PSNR against BICUBIC and LANCZOS of the full decode."""
    data = encoded(high_detail_photo(*four_by_three(12)), "JPEG", **SOURCE["JPEG"])
    target = fitted(Image.open(BytesIO(data)).size, TARGET_PIXELS)
    full = Image.open(BytesIO(data)).convert("RGB")
    references = {name: full.resize(target, f) for name, f in (("bicubic", Image.Resampling.BICUBIC),
                                                                ("lanczos", Image.Resampling.LANCZOS))}
    del full
    rows = []
    for label, way in resize_alternatives(data, target):
        way()  # warm-up
        cpu = []
        for _ in range(repeat):
            start = time.process_time()
            way()
            cpu.append((time.process_time() - start) * 1000)
        result = way()
        rows.append({"pipeline": label, "decode_resize_cpu_ms": median(cpu), "spread": spread(cpu),
                     "psnr_bicubic_db": round(psnr(result, references["bicubic"]), 2),
                     "psnr_lanczos_db": round(psnr(result, references["lanczos"]), 2)})
        print(f"  {label}: {rows[-1]['decode_resize_cpu_ms']} ms", flush=True)
    return rows


def blocks_rows(repeat: int) -> list[dict[str, object]]:
    """mmgate on 12 MP inputs with Pillow keeping 0 to 256 freed 16 MiB blocks for reuse."""
    inputs = {fmt: photo_file(12, fmt) for fmt in ("JPEG", "PNG")}
    before = Image.core.get_blocks_max()
    rows = []
    try:
        for blocks in (0, 16, 64, 256):
            Image.core.set_blocks_max(blocks)
            row: dict[str, object] = {"blocks_max": blocks}
            for fmt, data in inputs.items():
                process_image(data, POLICY)
                times = [wall_and_cpu_ms(partial(process_image, data, POLICY)) for _ in range(repeat)]
                row[f"{fmt.lower()}_ms"] = median([t[0] for t in times])
                row[f"{fmt.lower()}_cpu_ms"] = median([t[1] for t in times])
            rows.append(row)
    finally:
        Image.core.set_blocks_max(before)
    return rows
