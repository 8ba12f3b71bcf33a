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
  vllm      (the ``vllm`` knob, or ``vllm_url``) the tiny Idefics3 of tests/e2e, direct vs through mmgate
            ``--model``: prompt_tokens per image size (must be identical), bytes vLLM received, latency mean
            and p99, throughput, rounds interleaved.

Each figure is the median of ``--rounds`` (≥ 3) rounds with its spread. Processor folders for the estimate and
cpu parts are built locally (``testkit.models``); nothing is downloaded.

    python -m bench run model_tokens [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list model_tokens   # the knobs and their defaults
"""

from __future__ import annotations

import asyncio
import base64
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench import _results as R
from preprocessors.base import ImagePolicy
from proxy.media.model_folder import load_model
from testkit import vllm as h
from testkit.model_costs import cpu_ms, estimate_us
from testkit.models import gemma3_folder, idefics3_folder, llava_folder, llava_next_folder, qwen_folder
from testkit.vllm_load import image_chat, prompt_token_cells

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
MODES = ("direct", "mmgate --model")


def local_parts(rounds: int, quick: bool) -> dict[str, Any]:
    """The estimate and cpu parts: per round, every family × image, then every rule."""
    images = {"12MP JPEG EXIF": h.photo_file(4000, 3000, "JPEG", 6), "4MP PNG": h.photo_file(2304, 1728, "PNG"),
              "1MP WEBP": h.photo_file(1152, 864, "WEBP")}
    payloads = {name: base64.b64encode(data) for name, data in images.items()}
    with tempfile.TemporaryDirectory() as tmp:
        models = {family: load_model(str(build(Path(tmp) / family))) for family, build in FAMILIES.items()}
        count = 200 if quick else 5000
        estimate: dict[str, dict[str, list[float]]] = {family: {name: [] for name in payloads} for family in models}
        for _round in range(rounds):
            for family, model in models.items():
                for name, payload in payloads.items():
                    estimate[family][name].append(estimate_us(model, payload, count))
        policies = {"idefics3 geometry": ImagePolicy(geometry=models["idefics3"].geometry),
                    "qwen2-vl geometry": ImagePolicy(geometry=models["qwen2-vl"].geometry),
                    "generic --resize-max-side 1456": ImagePolicy(resize_max_side=1456),
                    "validate only": ImagePolicy()}
        cpu: dict[str, list[float]] = {name: [] for name in policies}
        for _round in range(rounds):
            for name, policy in policies.items():
                cpu[name].append(cpu_ms(images["12MP JPEG EXIF"], policy, 1 if quick else 5))
    return {"estimate_us": estimate, "cpu_ms": cpu}


def measure(knobs: R.Knobs) -> dict[str, Any]:
    data: dict[str, Any] = R.stamp(SCRIPT, WHAT)
    data |= local_parts(knobs.rounds, knobs.quick)
    if knobs.vllm or knobs.vllm_url:
        bodies = {size: image_chat(h.photo_file(width, height, "JPEG", orientation), "image/jpeg", 1, compact=True)
                  for size, (width, height, orientation) in VLLM_SIZES.items()}
        gate_flags = {"mmgate --model": ("--model", str(h.DEFAULT_DIR / "tiny-idefics3"))}
        with h.vllm_server(knobs.vllm_url) as vllm, h.gates(vllm.url, gate_flags) as gates:
            modes = {"direct": vllm.url} | {name: gate.url for name, gate in gates.items()}  # in the order of MODES
            data["vllm"] = asyncio.run(prompt_token_cells(vllm, modes, bodies, knobs.rounds,
                                                          2 if knobs.quick else knobs.requests, knobs.concurrency))
    return data


def goals(data: dict[str, Any]) -> list[R.Goal]:
    series = [values for by_image in data["estimate_us"].values() for values in by_image.values()]
    worst = [max(values[i] for values in series) for i in range(len(series[0]))]  # per round
    cpu = data["cpu_ms"]
    out = [R.goal("token estimate per image, worst family and image", worst, "< 50", lambda v: v < 50, unit="µs"),
           R.goal("decode worker CPU, Idefics3 geometry ÷ generic rule (12 MP JPEG)",
                  [a / b for a, b in zip(cpu["idefics3 geometry"], cpu["generic --resize-max-side 1456"], strict=True)],
                  unit="×")]
    if data.get("vllm"):
        direct, gate = MODES
        same = [all(len(set(cells[m]["prompt_tokens"])) == 1 for m in cells)
                and set(cells[direct]["prompt_tokens"]) == set(cells[gate]["prompt_tokens"])
                for cells in data["vllm"].values()]
        # Every request of every round counts: one differing prompt_tokens anywhere fails the size.
        out.append(R.record("image sizes with identical prompt_tokens direct and through mmgate (every round)",
                            {"median": sum(same), "spread": [sum(same), sum(same)], "n": len(same)},
                            f"= {len(same)}", lambda v: v == len(same), over="image sizes"))
        big = data["vllm"].get("4000x3000 EXIF 6")
        if big:
            out += [R.goal("4000x3000: bytes to vLLM, direct ÷ through mmgate",
                           [d / g for d, g in zip(big[direct]["vllm_bytes_per_request"],
                                                  big[gate]["vllm_bytes_per_request"], strict=True)], unit="×"),
                    R.goal("4000x3000: mean latency through mmgate ÷ direct",
                           [g / d for d, g in zip(big[direct]["mean_ms"], big[gate]["mean_ms"], strict=True)],
                           unit="×")]
    return out


def median(values: list[float]) -> str:
    return R.number(statistics.median(values))


def report(data: dict[str, Any]) -> str:
    images = list(next(iter(data["estimate_us"].values())))
    lines = ["## Token estimate per image (µs, median of rounds)", "",
             "| family | " + " | ".join(images) + " |", "| --- |" + " --- |" * len(images),
             *(f"| {family} | " + " | ".join(median(v) for v in by_image.values()) + " |"
               for family, by_image in data["estimate_us"].items()),
             "", "## Decode worker CPU per 12 MP JPEG (ms, median of rounds)", "", "| rule | ms | min–max |",
             "| --- | --- | --- |",
             *(f"| {name} | {median(values)} | {R.number(min(values))}–{R.number(max(values))} |"
               for name, values in data["cpu_ms"].items())]
    if data.get("vllm"):
        lines += ["", "## Real vLLM (tiny Idefics3), direct vs through mmgate --model (medians of rounds)", "",
                  "| image | mode | prompt_tokens | bytes to vLLM / request | mean ms | p99 ms | req/s |",
                  "| --- | --- | --- | --- | --- | --- | --- |",
                  *(f"| {size} | {mode} | {','.join(map(str, sorted(set(c['prompt_tokens']))))} | "
                    f"{median(c['vllm_bytes_per_request'])} | {median(c['mean_ms'])} | {median(c['p99_ms'])} | "
                    f"{median(c['rps'])} |" for size, cells in data["vllm"].items() for mode, c in cells.items())]
    return "\n".join(lines) + "\n"
