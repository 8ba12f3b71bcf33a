"""The model mode with real checkpoints' own configurations against the stub: req/s ÷ direct, and the bytes sent on.

Issue 40's goal: with each real checkpoint's own processor configuration (``testkit.models.REAL_CHECKPOINTS``,
built offline: Qwen2.5-VL, Qwen3-VL, Idefics3 and Gemma 3 by default), mmgate's model mode in front of the stub
backend (``demo.backend``, which base64-decodes and Pillow-decodes every image) makes at least 0.95× direct's
req/s on 3000×2000 photos and at least 1.0× on 12 MP camera JPEGs, at 4 clients; and wherever the model keeps
an image nearly whole, so that the original already goes at about the model's size, the bytes mmgate forwards
for it are at most 1.5× the client's.

"Nearly whole": the model's size (``preprocessors.geometry.resize_target``, what its processor makes of the
image) keeps at least ``KEPT`` of each side, or the model does not resize it at all; there the original already
is about the model's size, and a resize in mmgate could only add bytes (the 3000x2000 JPEG that went as a
2996x1988 BMP, 8.8x its bytes). Each cell says whether it is such a one; the byte goal is checked on those, and
the bytes of the others are reported.

Images, as ``bench/peer_client.py``'s photo and camera sets (``testkit.media.detailed_photo``): ``photo`` 3000x2000
(1/f noise of slope 1.5), ``camera`` 4000x3000 high-detail, both JPEG q90 4:2:0, one streaming chat request each,
8 output tokens, sent by ``testkit.load.run_load`` (every client its own keep-alive connection, no pauses). The
bytes forwarded are the stub's request body bytes per request (``/stats``, reset before each cell) over the
body the client sent: one image a request, so it is the image's.

One mmgate a checkpoint (``--model`` its folder, the cache off) lives for the whole run, warmed with a request of
each image before the first round. Within a round the modes (direct, then each checkpoint) take turns, the order
turning round by round; each ratio is a checkpoint's req/s ÷ direct's in the same round; every figure is the
median of ``--rounds`` (≥ 3) with its spread.

    python -m bench run checkpoints [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list checkpoints   # the knobs and their defaults

Writes bench/results/checkpoints.md/.json.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image

from bench import _results as R
from preprocessors.geometry import resize_target
from proxy.media.model_folder import load_model
from testkit.load import closed_loop_cell, stub_and_gates, stub_stats, turn
from testkit.media import camera_jpeg, camera_photo, chat_body, detailed_photo
from testkit.models import REAL_CHECKPOINTS

WHAT = ("req/s through mmgate's model mode ÷ direct, real checkpoints' configurations, stub backend; bytes forwarded "
        "per image ÷ sent")
OUTPUT_TOKENS = 8
KEPT = 0.9  # the share of each side the model's size keeps, at least, for an image it keeps "nearly whole"
# name -> (words, size, the photo): peer_client's photo and camera sets.
IMAGES: dict[str, tuple[str, tuple[int, int], Callable[[], Image.Image]]] = {
    "photo": ("3000×2000 photo", (3000, 2000), lambda: detailed_photo(
        3200, 2200, seed=5, slope=1.5, contrast=50).crop((37, 53, 3037, 2053))),
    "camera": ("12 MP camera JPEG", (4000, 3000), camera_photo),
}
TARGETS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "photo": ("≥ 0.95", lambda v: v >= 0.95), "camera": ("≥ 1.0", lambda v: v >= 1.0)}


def kept_whole(folder: Path, size: tuple[int, int]) -> bool:
    """Whether the model keeps at least ``KEPT`` of each side of an upright ``size`` image (or does not resize it)."""
    model = load_model(str(folder))
    assert model.geometry is not None, f"{folder}: no model geometry"
    target = resize_target(model.geometry, *size, 1)
    return target is None or min(target[0] / size[0], target[1] / size[1]) >= KEPT


def run_cell(stub_url: str, target: str, body: bytes, clients: int, requests: int) -> dict[str, Any]:
    """One cell: ``requests`` requests from ``clients`` clients at ``target``; req/s and bytes forwarded."""
    stub_stats(stub_url, reset=True)
    cell, _ = closed_loop_cell(target, body, clients, requests)
    seen = stub_stats(stub_url)
    return cell | {"bytes_ratio": seen["request_body_bytes"] / max(1, seen["requests"]) / len(body)}


def measure(args: R.Knobs) -> dict[str, Any]:
    names = [n for n in args.checkpoints.split(",") if n]
    images = [n for n in args.images.split(",") if n]
    unknown = set(names) - set(REAL_CHECKPOINTS) | (set(images) - set(IMAGES))
    if unknown:
        raise SystemExit(f"unknown checkpoint or image set: {', '.join(sorted(unknown))}")
    data: dict[str, Any] = R.stamp("checkpoints.py", WHAT)
    data["settings"] = {"rounds": args.rounds, "clients": args.clients, "requests": args.requests,
                        "checkpoints": names, "output_tokens": OUTPUT_TOKENS}
    bodies = {name: chat_body(camera_jpeg(IMAGES[name][2]()), stream=True, max_tokens=OUTPUT_TOKENS) for name in images}
    data["image_bytes"] = {name: len(body) for name, body in bodies.items()}
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mmgate-checkpoints-") as tmp:
        folders = {n: REAL_CHECKPOINTS[n](Path(tmp) / n.replace(" ", "_")) for n in names}
        data["kept_whole"] = {n: {i: kept_whole(folders[n], IMAGES[i][1]) for i in images} for n in names}
        gates = {n: ("--model", str(folders[n])) for n in names}
        with stub_and_gates(("--tokens", str(OUTPUT_TOKENS)), gates) as (stub_url, urls):
            targets = {"direct": stub_url} | urls
            for name in images:  # warm-up, not measured: first requests load what each process loads lazily
                for target in targets.values():
                    run_cell(stub_url, target, bodies[name], 1, 1)
            started = time.monotonic()
            for round_ in range(args.rounds):
                for name in images:
                    for mode in turn(list(targets), round_):
                        cell = run_cell(stub_url, targets[mode], bodies[name], args.clients, args.requests)
                        cells.append({"mode": mode, "images": name, "round": round_, **cell})
                        print(f"r={round_} {name:6} {mode:11} {cell['rps']:6.2f} req/s, bytes forwarded "
                              f"{cell['bytes_ratio']:.2f}× sent, {cell['statuses']}", flush=True)
            data["measured_s"] = time.monotonic() - started
    data["cells"] = cells
    return data


def by_round(data: dict[str, Any], mode: str, images: str, key: str) -> dict[int, float]:
    return {c["round"]: c[key] for c in data["cells"] if c["mode"] == mode and c["images"] == images
            and c["ok"] == c["sent"]}


def rps_ratios(data: dict[str, Any], mode: str, images: str) -> list[float | None]:
    """The checkpoint's req/s ÷ direct's, round by round (None where a round had failed requests)."""
    direct, mine = by_round(data, "direct", images, "rps"), by_round(data, mode, images, "rps")
    return [mine[r] / direct[r] if r in mine and r in direct else None
            for r in sorted({c["round"] for c in data["cells"]})]


def goals(data: dict[str, Any]) -> list[R.Goal]:
    out: list[R.Goal] = []
    clients = data["settings"]["clients"]
    for n in data["settings"]["checkpoints"]:
        for images, kept in data["kept_whole"][n].items():
            target, test = TARGETS[images]
            out.append(R.goal(f"{n}, {images}, {clients} clients: req/s ÷ direct", rps_ratios(data, n, images),
                              target, test, unit="×"))
            bytes_sent = list(by_round(data, n, images, "bytes_ratio").values())
            if kept:
                out.append(R.goal(f"{n}, {images} (kept nearly whole): bytes forwarded ÷ sent", bytes_sent, "≤ 1.5",
                                  lambda v: v <= 1.5, unit="×", met_on="every"))
            else:
                out.append(R.goal(f"{n}, {images} (shrunk): bytes forwarded ÷ sent", bytes_sent, unit="×"))
    return out


def report(data: dict[str, Any]) -> str:
    s = data["settings"]
    sizes = ", ".join(f"{name} {IMAGES[name][0]} {b / 1e6:.2f} MB" for name, b in data["image_bytes"].items())
    lines = [
        f"{s['clients']} clients, {s['requests']} requests a cell, {s['rounds']} rounds; request bodies: {sizes}. "
        "Median (min–max) of the rounds.",
        "",
        "| checkpoint | images | kept nearly whole | req/s | req/s ÷ direct | bytes forwarded ÷ sent |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    text = R.spread_cell
    for images in data["image_bytes"]:
        lines.append(f"| direct | {images} | – | {text(by_round(data, 'direct', images, 'rps').values())} | 1 | "
                     f"{text(by_round(data, 'direct', images, 'bytes_ratio').values())} |")
        for n in s["checkpoints"]:
            lines.append(f"| {n} | {images} | {'yes' if data['kept_whole'][n][images] else 'no'} | "
                         f"{text(by_round(data, n, images, 'rps').values())} | {text(rps_ratios(data, n, images))} | "
                         f"{text(by_round(data, n, images, 'bytes_ratio').values())} |")
    return "\n".join(lines) + "\n"
