"""The video probe: what PyAV costs to carry (installed size, import time) and what one probe costs.

Two parts:

  weight   the installed size of each distribution mmgate's core imports, and of PyAV (``av``: its wheel
           bundles FFmpeg's libraries), from each distribution's own file list; and the import time of
           ``av`` in a fresh interpreter beside those of ``proxy.app`` (everything mmgate imports to serve)
           and ``PIL.Image`` (``python -X importtime``, the cumulative time of the top-level import).
           This is what decides core dependency or optional extra (docs/media.md, "Video").
  probe    thread CPU per ``preprocessors.video.probe_video`` call (in a decode worker; every packet
           demuxed, H.264 key frames decoded, VP9 frame headers read): a small MP4, a 300-frame 720p MP4
           (index and packets) and the same as WebM (packets only), and an 8K MP4 refused on its pixel
           count. Clips are encoded with PyAV in memory.

Each figure is the median of ``--rounds`` (≥ 3) rounds with its spread.

    python -m bench run video_probe [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list video_probe   # the knobs and their defaults
"""

from __future__ import annotations

import statistics
from typing import Any

from bench import _results as R
from preprocessors.base import VideoPolicy, no_checkpoint
from preprocessors.errors import MediaError
from preprocessors.video import probe_video
from testkit.call_timing import thread_cpu_ms
from testkit.dependency_weight import import_ms, installed_mib
from testkit.media import video_clip

WHAT = "Video probe: PyAV's installed size and import time beside mmgate's core, CPU per probe"
CORE = ("aiohttp", "orjson", "pillow", "prometheus-client", "pybase64", "hyperscan")
IMPORTS = {"av": "import av", "proxy.app": "import proxy.app", "PIL.Image": "import PIL.Image"}


def probe_ms(data: bytes, policy: VideoPolicy, count: int) -> float:
    """Thread CPU milliseconds per probe (a refusal included: it is the probe's answer)."""

    def probes() -> None:
        for _ in range(count):
            try:
                probe_video(data, policy, no_checkpoint)
            except MediaError:
                pass

    return thread_cpu_ms(probes) / count


def measure(knobs: R.Knobs) -> dict[str, Any]:
    stamp = R.stamp("video_probe.py", WHAT)
    frames = 30 if knobs.quick else 300
    clips = {
        "64x48 MP4, 3 frames": video_clip(64, 48, 3),
        f"1280x720 MP4, {frames} frames (index)": video_clip(1280, 720, frames, rate=30),
        f"1280x720 WebM, {frames} frames (demuxed)": video_clip(1280, 720, frames, codec="libvpx-vp9",
                                                                container="webm", rate=30),
        "7680x4320 MP4, 3 frames (refused)": video_clip(7680, 4320, 3),
    }
    count = 5 if knobs.quick else 200
    probe: dict[str, list[float]] = {name: [] for name in clips}
    imports: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _round in range(knobs.rounds):
        for name, data in clips.items():
            probe[name].append(probe_ms(data, VideoPolicy(), count))
        for name, statement in IMPORTS.items():
            imports[name].append(import_ms(statement))
    return stamp | {"probe_ms": probe, "import_ms": imports,
                    "installed_mib": {name: installed_mib(name) for name in (*CORE, "av")},
                    "clip_bytes": {name: len(data) for name, data in clips.items()}}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    imports = data["import_ms"]
    core = sum(v for k, v in data["installed_mib"].items() if k != "av")
    return [R.goal("import av ÷ import proxy.app (fresh interpreter)",
                   [a / p for a, p in zip(imports["av"], imports["proxy.app"], strict=True)], unit="×"),
            R.record("PyAV installed ÷ mmgate's core dependencies installed",
                     {"median": data["installed_mib"]["av"] / core, "spread": None, "n": 1}, unit="×", over="files"),
            *(R.goal(f"probe CPU: {name}", values, "≤ 5", lambda v: v <= 5, unit="ms")
              for name, values in data["probe_ms"].items())]


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def spread(values: list[float]) -> str:
    """The rounds' median, then their min–max, as two cells."""
    return f"{R.number(statistics.median(values))} | {R.number(min(values))}–{R.number(max(values))}"


def report(data: dict[str, Any]) -> str:
    return "\n".join([
        "## Installed size (MiB, from each distribution's RECORD)", "", row("distribution", "MiB"), row("---", "---"),
        *(row(name, R.number(mib)) for name, mib in data["installed_mib"].items()),
        "", "## Import time in a fresh interpreter (ms, median of rounds)", "",
        row("import", "ms", "min–max"), row("---", "---", "---"),
        *(row(name, spread(values)) for name, values in data["import_ms"].items()),
        "", "## Thread CPU per probe (ms, median of rounds)", "",
        row("clip", "bytes", "ms", "min–max"), row("---", "---", "---", "---"),
        *(row(name, str(data["clip_bytes"][name]), spread(values)) for name, values in data["probe_ms"].items()),
    ]) + "\n"
