"""MMGATE_MODEL: what the image-token estimate costs, what a model's geometry costs mmgate, and, against a real
vLLM, that the geometry is right (identical prompt_tokens) and what it saves.

Three parts:

  estimate  per image, on the event loop before admission: the head of the base64 decoded, the header parsed
            (``preprocessors.dimensions``), the served model's processor asked for the tokens
            (``proxy.media.model.Model.image_tokens``). Per family, for a 12 MP JPEG with EXIF, a 4 MP PNG and a
            1 MP WEBP. Goal: under 50 µs per image.
  cpu       mmgate's CPU per image in a decode worker (``process_image``, thread CPU time) for a 12 MP JPEG:
            with a model's geometry (Idefics3 1456/364, Qwen2-VL) vs the generic rule (``--resize-max-side
            1456``) vs validation only (no resize).
  vllm      (``--vllm`` or ``--vllm-url``) the tiny Idefics3 of tests/e2e, direct vs through mmgate
            ``--model``: prompt_tokens per image size (must be identical), bytes vLLM received, latency mean
            and p99, throughput, rounds interleaved.

Each figure is the median of ``--rounds`` (≥ 3) rounds with its spread. Processor folders for the estimate and
cpu parts are built locally (``testkit.models``); nothing is downloaded.

    python -m bench run model_tokens [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list model_tokens   # the knobs and their defaults
Writes bench/results/model_tokens.md and .json.
"""

from __future__ import annotations

import asyncio
import base64
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from PIL import Image

from bench import _results as R
from preprocessors.base import ImagePolicy
from preprocessors.dataurl import Base64Ends
from preprocessors.dimensions import peek_dimensions
from preprocessors.image import process_image
from proxy.media.model import Model
from proxy.media.model_folder import load_model
from testkit import vllm as h
from testkit.models import gemma3_folder, idefics3_folder, llava_folder, llava_next_folder, qwen_folder

SCRIPT = "model_tokens.py"
WHAT = "MMGATE_MODEL: image-token estimate cost, geometry CPU, real-vLLM prompt tokens direct vs through mmgate"
FAMILIES = {
    "qwen2-vl": lambda p: qwen_folder(p, "qwen2_vl"),
    "qwen3-vl": lambda p: qwen_folder(p, "qwen3_vl"),
    "idefics3": lambda p: idefics3_folder(p),
    "smolvlm": lambda p: idefics3_folder(p, "smolvlm", tile=512, longest_edge=2048),
    "llava": lambda p: llava_folder(p),
    "llava-next": lambda p: llava_next_folder(p),
    "gemma3": lambda p: gemma3_folder(p),
}
# (width, height, EXIF orientation) sent to vLLM: one each for resized, upscaled by the backend, a strip, rotated
VLLM_SIZES = {"2000x1500": (2000, 1500, 1), "640x480": (640, 480, 1), "3000x300": (3000, 300, 1),
              "4000x3000 EXIF 6": (4000, 3000, 6)}


def photo(width: int, height: int, fmt: str = "JPEG", orientation: int = 1) -> bytes:
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buf = io.BytesIO()
    img = h.photo_like(width, height, seed=width + height)
    if fmt == "JPEG":
        img.save(buf, "JPEG", quality=90, exif=exif.tobytes())
    elif fmt == "PNG":
        img.save(buf, "PNG", compress_level=1)
    else:
        img.save(buf, fmt, quality=90)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------- estimate, cpu


def estimate_us(model: Model, payload: bytes, count: int) -> float:
    """Microseconds per image for the header read and the token count (what the plan step adds)."""
    started = time.perf_counter()
    for _ in range(count):
        found = peek_dimensions(Base64Ends(payload).head)
        assert found is not None
        model.image_tokens(found.width, found.height, found.orientation)
    return (time.perf_counter() - started) / count * 1e6


def cpu_ms(data: bytes, policy: ImagePolicy, count: int) -> float:
    """Thread CPU milliseconds per image for the decode worker's whole job."""
    started = time.thread_time()
    for _ in range(count):
        process_image(data, policy)
    return (time.thread_time() - started) / count * 1000


def local_parts(rounds: int, quick: bool) -> dict[str, Any]:
    images = {"12MP JPEG EXIF": photo(4000, 3000, "JPEG", 6), "4MP PNG": photo(2304, 1728, "PNG"),
              "1MP WEBP": photo(1152, 864, "WEBP")}
    payloads = {name: base64.b64encode(data) for name, data in images.items()}
    with tempfile.TemporaryDirectory() as tmp:
        models = {family: load_model(str(build(Path(tmp) / family))) for family, build in FAMILIES.items()}
        count = 200 if quick else 5000
        estimate: dict[str, dict[str, list[float]]] = {}
        for _round in range(rounds):
            for family, model in models.items():
                for name, payload in payloads.items():
                    estimate.setdefault(family, {}).setdefault(name, []).append(estimate_us(model, payload, count))
        policies = {"idefics3 geometry": ImagePolicy(geometry=models["idefics3"].geometry),
                    "qwen2-vl geometry": ImagePolicy(geometry=models["qwen2-vl"].geometry),
                    "generic --resize-max-side 1456": ImagePolicy(resize_max_side=1456),
                    "validate only": ImagePolicy()}
        data = images["12MP JPEG EXIF"]
        cpu: dict[str, list[float]] = {}
        for _round in range(rounds):
            for name, policy in policies.items():
                cpu.setdefault(name, []).append(cpu_ms(data, policy, 1 if quick else 5))
    return {"estimate_us": estimate, "cpu_ms": cpu}


# ----------------------------------------------------------------------------------------------- real vLLM


async def one(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, int]:
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"}) as response:
        answer = await response.json()
        assert response.status == 200, answer
    return time.perf_counter() - started, int(answer["usage"]["prompt_tokens"])


def chat(image: bytes) -> bytes:
    import orjson

    uri = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    return orjson.dumps({"model": h.SERVED_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "Describe this image."}]}]})


async def vllm_part(vllm: h.Server, gate: h.Server, rounds: int, requests: int, concurrency: int) -> dict[str, Any]:
    """Per size and mode: every round's latencies, prompt tokens, bytes vLLM received and wall time."""
    cells: dict[str, dict[str, dict[str, list[Any]]]] = {}
    modes = {"direct": vllm.url, "mmgate --model": gate.url}
    # A new connection per request: a keep-alive connection the server closes as the next request starts
    # (uvicorn's 5 s idle timeout) would fail that POST, and aiohttp never retries one.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        for size, (width, height, orientation) in VLLM_SIZES.items():
            body = chat(photo(width, height, "JPEG", orientation))
            for _round in range(rounds):
                for mode, url in modes.items():  # modes take turns, so drift on a shared machine hits both
                    cell = cells.setdefault(size, {}).setdefault(mode, {})
                    before = h.metric_sum(vllm.metrics("/metrics"), "http_request_size_bytes_sum",
                                          handler="/v1/chat/completions")
                    limit = asyncio.Semaphore(concurrency)

                    async def limited(url: str = url, body: bytes = body,
                                      limit: asyncio.Semaphore = limit) -> tuple[float, int]:
                        async with limit:
                            return await one(session, url, body)

                    started = time.perf_counter()
                    results = await asyncio.gather(*(limited() for _ in range(requests)))
                    wall = time.perf_counter() - started
                    after = h.metric_sum(vllm.metrics("/metrics"), "http_request_size_bytes_sum",
                                         handler="/v1/chat/completions")
                    latencies = [r[0] for r in results]
                    cell.setdefault("mean_ms", []).append(statistics.fmean(latencies) * 1000)
                    cell.setdefault("p99_ms", []).append(sorted(latencies)[max(0, round(0.99 * len(latencies)) - 1)]
                                                         * 1000)
                    cell.setdefault("rps", []).append(requests / wall)
                    cell.setdefault("vllm_bytes_per_request", []).append((after - before) / requests)
                    cell.setdefault("prompt_tokens", []).extend(sorted({r[1] for r in results}))
    return cells


# ----------------------------------------------------------------------------------------------- report


def goals(data: dict[str, Any]) -> list[R.Goal]:
    out = []
    series = [values for by_image in data["estimate_us"].values() for values in by_image.values()]
    worst = [max(values[i] for values in series) for i in range(len(series[0]))]  # per round
    out.append(R.goal("token estimate per image, worst family and image", worst, "< 50", lambda v: v < 50, unit="µs"))
    cpu = data["cpu_ms"]
    generic = cpu["generic --resize-max-side 1456"]
    out.append(R.goal("decode worker CPU, Idefics3 geometry ÷ generic rule (12 MP JPEG)",
                      [a / b for a, b in zip(cpu["idefics3 geometry"], generic, strict=True)], unit="×"))
    if data.get("vllm"):
        same = [all(len(set(cells[m]["prompt_tokens"])) == 1 for m in cells)
                and set(cells["direct"]["prompt_tokens"]) == set(cells["mmgate --model"]["prompt_tokens"])
                for cells in data["vllm"].values()]
        # Every request of every round counts: one differing prompt_tokens anywhere fails the size.
        out.append(R.record("image sizes with identical prompt_tokens direct and through mmgate (every round)",
                            {"median": sum(same), "spread": [sum(same), sum(same)], "n": len(same)},
                            f"= {len(same)}", lambda v: v == len(same), over="image sizes"))
        big = data["vllm"].get("4000x3000 EXIF 6")
        if big:
            out.append(R.goal("4000x3000: bytes to vLLM, direct ÷ through mmgate",
                              [d / g for d, g in zip(big["direct"]["vllm_bytes_per_request"],
                                                     big["mmgate --model"]["vllm_bytes_per_request"], strict=True)],
                              unit="×"))
            out.append(R.goal("4000x3000: mean latency through mmgate ÷ direct",
                              [g / d for d, g in zip(big["direct"]["mean_ms"], big["mmgate --model"]["mean_ms"],
                                                     strict=True)], unit="×"))
    return out


def report(data: dict[str, Any]) -> str:
    lines = ["## Token estimate per image (µs, median of rounds)", "",
             "| family | " + " | ".join(next(iter(data["estimate_us"].values()))) + " |",
             "| --- |" + " --- |" * len(next(iter(data["estimate_us"].values())))]
    for family, by_image in data["estimate_us"].items():
        lines.append(f"| {family} | " + " | ".join(R.number(statistics.median(v)) for v in by_image.values()) + " |")
    lines += ["", "## Decode worker CPU per 12 MP JPEG (ms, median of rounds)", "", "| rule | ms | min–max |",
              "| --- | --- | --- |"]
    for name, values in data["cpu_ms"].items():
        lines.append(f"| {name} | {R.number(statistics.median(values))} | {R.number(min(values))}–"
                     f"{R.number(max(values))} |")
    if data.get("vllm"):
        lines += ["", "## Real vLLM (tiny Idefics3), direct vs through mmgate --model (medians of rounds)", "",
                  "| image | mode | prompt_tokens | bytes to vLLM / request | mean ms | p99 ms | req/s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for size, cells in data["vllm"].items():
            for mode, c in cells.items():
                lines.append(f"| {size} | {mode} | {','.join(map(str, sorted(set(c['prompt_tokens']))))} | "
                             f"{R.number(statistics.median(c['vllm_bytes_per_request']))} | "
                             f"{R.number(statistics.median(c['mean_ms']))} | {R.number(statistics.median(c['p99_ms']))}"
                             f" | {R.number(statistics.median(c['rps']))} |")
    return "\n".join(lines) + "\n"


def measure(knobs: R.Knobs) -> dict[str, Any]:
    data: dict[str, Any] = R.stamp(SCRIPT, WHAT)
    data |= local_parts(knobs.rounds, knobs.quick)
    if knobs.vllm or knobs.vllm_url:
        vllm = h.Server("vllm", knobs.vllm_url.rstrip("/"), None, None) if knobs.vllm_url else h.start_vllm()
        gate = h.start_mmgate(vllm.url, "--model", str(h.DEFAULT_DIR / "tiny-idefics3"))
        try:
            data["vllm"] = asyncio.run(vllm_part(vllm, gate, knobs.rounds, 2 if knobs.quick else knobs.requests,
                                                 knobs.concurrency))
        finally:
            gate.stop()
            if not knobs.vllm_url:
                vllm.stop()
    return data
