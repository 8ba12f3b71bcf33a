"""Image downscale cost: a naive Pillow pipeline vs mmgate's ``process_image``, side by side.

Inputs are synthesised photo-like images (smooth gradients + per-pixel noise, so JPEG sizes are
realistic) of 1, 4, 12 and 24 MP, encoded as JPEG (q90) and PNG; every one goes to <= 1 MP
(``resize_max_pixels=1_000_000``, JPEG q90 out):

* naive: ``Image.open`` -> ``convert("RGB")`` -> ``resize(BICUBIC)`` at full resolution -> JPEG q90.
* mmgate: ``process_image`` (header checks, JPEG draft decode, BICUBIC, EXIF/alpha/mode handling).
  The 1 MP input already fits: mmgate validates it (full decode) and forwards it untouched.

Reported per cell: median wall ms and median thread-CPU ms of single-threaded runs (the two pipelines
interleaved, so background load hits both alike), and images/s with 1 and 2 threads. Two smaller tables
record the choices made in preprocessors/image.py: the resampling filter (time and PSNR against a
full-resolution LANCZOS reference, on a detailed image) and Pillow's ``blocks_max``.

The machine may be shared (check the load average in the output): wall times then swing, and CPU
times are the steadier column. Runs in about 2-3 minutes on 2 cores.

Goal: a 12 MP JPEG to <= 1 MP in <= 60 ms with mmgate (median of the runs, min–max spread).

    python -m bench.image_pipeline [--repeat N] [--quick]
    python -m bench.image_pipeline --render   # rebuild the .md and the goals from the committed .json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import partial
from io import BytesIO
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, features

from bench import _results as R
from preprocessors.base import ImagePolicy, Processed
from preprocessors.image import process_image
from testkit.media import photo_sized

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_PIXELS = 1_000_000
POLICY = ImagePolicy(resize_max_pixels=TARGET_PIXELS)
QUALITY = 90


def photo(megapixels: float, seed: int = 0) -> Image.Image:
    """A 4:3 photo-like RGB image: smooth colour fields plus sensor-like noise."""
    height = int(math.sqrt(megapixels * 1e6 * 3 / 4))
    return photo_sized(height * 4 // 3, height, seed)


def detailed(megapixels: float) -> Image.Image:
    """``photo`` plus a zone plate, thin outlines and text: content where resampling filters differ."""
    img = photo(megapixels, seed=1)
    w, h = img.size
    yy, xx = np.mgrid[0 : h // 2, 0 : w // 2].astype(np.float32)
    rings = np.cos(((xx - w / 4) ** 2 + (yy - h / 4) ** 2) * (np.pi / (2.5 * w)))
    zone = (127 + 100 * rings).astype(np.uint8)
    img.paste(Image.fromarray(zone, "L").convert("RGB"), (0, 0))
    draw = ImageDraw.Draw(img)
    rng = np.random.default_rng(2)
    for _ in range(400):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(2, 300)), y0 + int(rng.integers(2, 300))
        colour = tuple(int(v) for v in rng.integers(0, 255, 3))
        draw.rectangle((x0, y0, x1, y1), outline=colour, width=int(rng.integers(1, 4)))
        draw.text((x1, y0), "mmgate draft test 0123", fill=(0, 0, 0))
    return img


def encode(img: Image.Image, fmt: str) -> bytes:
    buf = BytesIO()
    if fmt == "JPEG":
        img.save(buf, "JPEG", quality=QUALITY)
    else:
        img.save(buf, "PNG", compress_level=1)  # fast to build; decode cost barely depends on the level
    return buf.getvalue()


def fitted(size: tuple[int, int]) -> tuple[int, int]:
    w, h = size
    scale = min(1.0, math.sqrt(TARGET_PIXELS / (w * h)))
    return max(1, int(w * scale)), max(1, int(h * scale))


def naive(data: bytes) -> bytes:
    img = Image.open(BytesIO(data)).convert("RGB")
    img = img.resize(fitted(img.size), Image.Resampling.BICUBIC)
    buf = BytesIO()
    img.save(buf, "JPEG", quality=QUALITY)
    return buf.getvalue()


def mmgate(data: bytes) -> Processed | None:
    return process_image(data, POLICY)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return (time.perf_counter() - wall) * 1000, (time.thread_time() - cpu) * 1000


def throughput(fn: Callable[[bytes], object], data: bytes, threads: int, images: int) -> float:
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(fn, [data] * images))
        return images / (time.perf_counter() - start)


def median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def pipeline_rows(sizes: list[float], repeat: int) -> list[dict[str, object]]:
    rows = []
    for fmt in ("JPEG", "PNG"):
        for mp in sizes:
            source = photo(mp)
            data = encode(source, fmt)
            del source
            out = mmgate(data)
            out_size = f"{out.width}x{out.height}" if out is not None else "forwarded as is"
            naive(data)  # warm-up (page cache of the allocator, lazy imports)
            runs: dict[str, list[tuple[float, float]]] = {"naive": [], "mmgate": []}
            for _ in range(repeat):
                runs["naive"].append(timed(partial(naive, data)))
                runs["mmgate"].append(timed(partial(mmgate, data)))
            row: dict[str, object] = {
                "input": f"{fmt} {mp:g} MP",
                "input_mb": round(len(data) / 1e6, 2),
                "mmgate_output": out_size,
            }
            for name, fn in (("naive", naive), ("mmgate", mmgate)):
                walls = [r[0] for r in runs[name]]
                row[f"{name}_ms"] = median(walls)
                row[f"{name}_ms_spread"] = [round(min(walls), 1), round(max(walls), 1)]
                row[f"{name}_runs"] = len(walls)
                row[f"{name}_cpu_ms"] = median([r[1] for r in runs[name]])
                row[f"{name}_ips_1t"] = round(len(walls) / (sum(walls) / 1000), 2)
                row[f"{name}_ips_2t"] = round(throughput(fn, data, 2, repeat + repeat % 2), 2)
            row["speedup"] = round(float(row["naive_ms"]) / float(row["mmgate_ms"]), 2)  # type: ignore[arg-type]
            row["speedup_cpu"] = round(float(row["naive_cpu_ms"]) / float(row["mmgate_cpu_ms"]), 2)  # type: ignore[arg-type]
            print(f"  {row['input']}: naive {row['naive_ms']} ms, mmgate {row['mmgate_ms']} ms", flush=True)
            rows.append(row)
    return rows


def psnr(img: Image.Image, reference: np.ndarray) -> float:
    err = np.mean((np.asarray(img.convert("RGB"), np.float32) - reference) ** 2)
    return round(float(10 * np.log10(255**2 / err)), 2)


def resample_rows(repeat: int) -> list[dict[str, object]]:
    """12 MP JPEG -> 1 MP: the filter applied after the draft decode (what process_image does)."""
    source = detailed(12)
    target = fitted(source.size)
    reference = np.asarray(source.resize(target, Image.Resampling.LANCZOS), np.float32)
    data = encode(source, "JPEG")
    del source
    full = Image.open(BytesIO(data))
    full.load()
    drafted = Image.open(BytesIO(data))
    box = drafted.draft("RGB", target)[1]  # type: ignore[index]
    drafted.load()
    bicubic = Image.Resampling.BICUBIC
    scale = f"draft 1/{full.width // drafted.width}"
    cases = [
        ("naive: full decode + BICUBIC", full, bicubic, None, None),
        ("full decode + BICUBIC, reducing_gap 1.5 (mmgate, non-JPEG)", full, bicubic, None, 1.5),
        (f"{scale} + BICUBIC (mmgate, JPEG)", drafted, bicubic, box, 1.5),
    ]
    cases += [(f"{scale} + {f.name}", drafted, f, box, 1.5) for f in
              (Image.Resampling.LANCZOS, Image.Resampling.HAMMING, Image.Resampling.BILINEAR)]
    rows = []
    for label, img, resample, crop, gap in cases:
        resize = partial(img.resize, target, resample, box=crop, reducing_gap=gap)
        times = [timed(resize) for _ in range(repeat)]
        result = resize()
        rows.append({"pipeline": label, "resize_ms": median([t[0] for t in times]),
                     "resize_cpu_ms": median([t[1] for t in times]), "psnr_db": psnr(result, reference)})
    return rows


def blocks_rows(repeat: int) -> list[dict[str, object]]:
    """mmgate on 12 MP inputs with Pillow keeping 0 to 256 freed 16 MiB blocks for reuse."""
    inputs = {fmt: encode(photo(12), fmt) for fmt in ("JPEG", "PNG")}
    before = Image.core.get_blocks_max()
    rows = []
    try:
        for blocks in (0, 16, 64, 256):
            Image.core.set_blocks_max(blocks)
            row: dict[str, object] = {"blocks_max": blocks}
            for fmt, data in inputs.items():
                mmgate(data)
                times = [timed(partial(mmgate, data)) for _ in range(repeat)]
                row[f"{fmt.lower()}_ms"] = median([t[0] for t in times])
                row[f"{fmt.lower()}_cpu_ms"] = median([t[1] for t in times])
            rows.append(row)
    finally:
        Image.core.set_blocks_max(before)
    return rows


def table(rows: list[dict[str, object]], columns: list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[key]) for key, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def report(
    env: dict[str, object],
    rows: list[dict[str, object]],
    resample: list[dict[str, object]],
    blocks: list[dict[str, object]],
) -> str:
    main_table = table(rows, [
        ("input", "input"), ("input_mb", "MB"), ("mmgate_output", "mmgate output"),
        ("naive_ms", "naive ms"), ("mmgate_ms", "mmgate ms"), ("speedup", "ratio"),
        ("naive_cpu_ms", "naive CPU ms"), ("mmgate_cpu_ms", "mmgate CPU ms"), ("speedup_cpu", "CPU ratio"),
        ("naive_ips_1t", "naive img/s 1T"), ("mmgate_ips_1t", "mmgate img/s 1T"),
        ("naive_ips_2t", "naive img/s 2T"), ("mmgate_ips_2t", "mmgate img/s 2T"),
    ])
    resample_table = table(resample, [
        ("pipeline", "pipeline"), ("resize_ms", "resize ms"), ("resize_cpu_ms", "resize CPU ms"),
        ("psnr_db", "PSNR dB"),
    ])
    blocks_table = table(blocks, [
        ("blocks_max", "blocks_max"), ("jpeg_ms", "JPEG ms"), ("jpeg_cpu_ms", "JPEG CPU ms"),
        ("png_ms", "PNG ms"), ("png_cpu_ms", "PNG CPU ms"),
    ])
    return (
        "# Image pipeline: naive Pillow vs mmgate process_image (to <= 1 MP, JPEG q90)\n\n"
        f"`python -m bench.image_pipeline` -- {env['date']}, Python {env['python']}, "
        f"Pillow {env['pillow']}, libjpeg-turbo {env['libjpeg_turbo']}, {env['usable_cpus']} usable CPUs, "
        f"blocks_max {env['blocks_max']}, median of {env['repeat']} runs, {env['seconds']} s in all.\n"
        f"Load average before {env['load_avg_before']}, after {env['load_avg_after']}: the machine is "
        "shared, so wall times include other people's work; CPU ms (this thread's CPU time) is the "
        "steadier column. img/s: 1T = sequential, 2T = two threads.\n\n"
        f"{main_table}\n\n"
        "## Resampling filter after the draft decode (12 MP JPEG -> 1 MP, detailed content)\n\n"
        "Resize step only. PSNR against LANCZOS from the full-resolution original (which favours "
        f"LANCZOS).\n\n{resample_table}\n\n"
        "## Pillow blocks_max (mmgate, 12 MP -> 1 MP, 1 thread)\n\n"
        "Freed 16 MiB blocks Pillow keeps for reuse instead of returning them to the OS.\n\n"
        f"{blocks_table}\n"
    )


WHAT = "ms per image, naive Pillow vs mmgate, 1–24 MP JPEG/PNG → ≤ 1 MP"
GOAL_MS = 60.0


def goals(env: dict[str, object], rows: list[dict[str, object]]) -> list[R.Goal]:
    """12 MP JPEG: mmgate against the 60 ms goal, naive Pillow beside it (older files have no spread)."""
    out: list[dict] = []
    twelve = next((r for r in rows if r["input"] == "JPEG 12 MP"), None)
    if twelve is None:
        return out
    for name, target in (("mmgate", f"≤ {GOAL_MS:g}"), ("naive", None)):
        s = {"median": twelve[f"{name}_ms"], "spread": twelve.get(f"{name}_ms_spread"),
             "n": twelve.get(f"{name}_runs", env["repeat"])}
        out.append(R.record(f"12 MP JPEG → 1 MP, {name}", s, target, (lambda v: v <= GOAL_MS) if target else None,
                            unit="ms", over="runs"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="single-thread runs per cell (median)")
    parser.add_argument("--quick", action="store_true", help="1 and 4 MP only, 3 runs (a smoke test)")
    parser.add_argument("--render", action="store_true", help="only rebuild .md and goals from the .json")
    args = parser.parse_args()
    if args.render:
        data = json.loads((RESULTS / "image_pipeline.json").read_text())
        env = data["env"]
        data |= R.kept_stamp(data, "image_pipeline.py", WHAT, env["date"])
        data["machine"] = data["machine"] or {"usable_cores": env["usable_cpus"]}
        data["goals"] = goals(env, data["pipelines"])
        R.write("image_pipeline", data, report(env, data["pipelines"], data["resampling"], data["blocks_max"]))
        return
    stamp = R.stamp("image_pipeline.py", WHAT)
    sizes = [1.0, 4.0] if args.quick else [1.0, 4.0, 12.0, 24.0]
    repeat = 3 if args.quick else args.repeat
    load_before = os.getloadavg()
    started = time.perf_counter()

    print("pipelines...", flush=True)
    rows = pipeline_rows(sizes, repeat)
    print("resampling filters...", flush=True)
    resample = resample_rows(repeat)
    print("blocks_max...", flush=True)
    blocks = blocks_rows(repeat)

    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "pillow": Image.__version__,
        "libjpeg_turbo": features.version("libjpeg_turbo"),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "blocks_max": Image.core.get_blocks_max(),
        "load_avg_before": [round(v, 2) for v in load_before],
        "load_avg_after": [round(v, 2) for v in os.getloadavg()],
        "repeat": repeat,
        "seconds": round(time.perf_counter() - started, 1),
    }
    markdown = report(env, rows, resample, blocks)
    print()
    print(markdown)
    data = stamp | {"goals": goals(env, rows), "env": env, "pipelines": rows, "resampling": resample,
                    "blocks_max": blocks}
    R.print_goals(data["goals"])
    if not args.quick:
        R.write("image_pipeline", data, markdown)


if __name__ == "__main__":
    main()
