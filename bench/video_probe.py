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
Writes bench/results/video_probe.md and .json.
"""

from __future__ import annotations

import importlib.metadata
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import _results as R
from preprocessors.base import VideoPolicy, no_checkpoint
from preprocessors.errors import MediaError
from preprocessors.video import probe_video
from testkit.media import video_clip

SCRIPT = "video_probe.py"
WHAT = "Video probe: PyAV's installed size and import time beside mmgate's core, CPU per probe"
CORE = ("aiohttp", "orjson", "pillow", "prometheus-client", "pybase64", "hyperscan")
IMPORTS = {"av": "import av", "proxy.app": "import proxy.app", "PIL.Image": "import PIL.Image"}


def installed_mib(distribution: str) -> float:
    """MiB of the files a distribution installed (its RECORD), bundled shared libraries included."""
    files = importlib.metadata.distribution(distribution).files or []
    total = 0
    for file in files:
        path = Path(str(file.locate()))
        if path.is_file():
            total += path.stat().st_size
    return total / (1 << 20)


def import_ms(statement: str) -> float:
    """Milliseconds of one top-level import in a fresh interpreter (``-X importtime``'s cumulative figure)."""
    module = statement.split()[-1]
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True,
                         check=True, cwd=R.REPO).stderr
    for line in out.splitlines():
        found = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)$", line)
        if found and found.group(2) == module:
            return int(found.group(1)) / 1000
    raise RuntimeError(f"no importtime line for {module}")


def probe_ms(data: bytes, policy: VideoPolicy, count: int) -> float:
    """Thread CPU milliseconds per probe (a refusal included: it is the probe's answer)."""
    started = time.thread_time()
    for _ in range(count):
        try:
            probe_video(data, policy, no_checkpoint)
        except MediaError:
            pass
    return (time.thread_time() - started) / count * 1000


def _measure(rounds: int, quick: bool) -> dict[str, Any]:
    frames = 30 if quick else 300
    clips = {
        "64x48 MP4, 3 frames": video_clip(64, 48, 3),
        f"1280x720 MP4, {frames} frames (index)": video_clip(1280, 720, frames, rate=30),
        f"1280x720 WebM, {frames} frames (demuxed)": video_clip(1280, 720, frames, codec="libvpx-vp9",
                                                                container="webm", rate=30),
        "7680x4320 MP4, 3 frames (refused)": video_clip(7680, 4320, 3),
    }
    policy = VideoPolicy()
    count = 5 if quick else 200
    probe: dict[str, list[float]] = {name: [] for name in clips}
    imports: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _round in range(rounds):
        for name, data in clips.items():
            probe[name].append(probe_ms(data, policy, count))
        for name, statement in IMPORTS.items():
            imports[name].append(import_ms(statement))
    sizes = {name: installed_mib(name) for name in (*CORE, "av")}
    return {"probe_ms": probe, "import_ms": imports, "installed_mib": sizes,
            "clip_bytes": {name: len(data) for name, data in clips.items()}}


def goals(data: dict[str, Any]) -> list[R.Goal]:
    imports = data["import_ms"]
    core = sum(v for k, v in data["installed_mib"].items() if k != "av")
    out = [R.goal("import av ÷ import proxy.app (fresh interpreter)",
                  [a / p for a, p in zip(imports["av"], imports["proxy.app"], strict=True)], unit="×"),
           R.record("PyAV installed ÷ mmgate's core dependencies installed",
                    {"median": data["installed_mib"]["av"] / core, "spread": None, "n": 1}, unit="×", over="files")]
    for name, values in data["probe_ms"].items():
        out.append(R.goal(f"probe CPU: {name}", values, "≤ 5", lambda v: v <= 5, unit="ms"))
    return out


def report(data: dict[str, Any]) -> str:
    lines = ["## Installed size (MiB, from each distribution's RECORD)", "",
             "| distribution | MiB |", "| --- | --- |"]
    for name, mib in data["installed_mib"].items():
        lines.append(f"| {name} | {R.number(mib)} |")
    lines += ["", "## Import time in a fresh interpreter (ms, median of rounds)", "", "| import | ms | min–max |",
              "| --- | --- | --- |"]
    for name, values in data["import_ms"].items():
        lines.append(f"| {name} | {R.number(statistics.median(values))} | {R.number(min(values))}–"
                     f"{R.number(max(values))} |")
    lines += ["", "## Thread CPU per probe (ms, median of rounds)", "", "| clip | bytes | ms | min–max |",
              "| --- | --- | --- | --- |"]
    for name, values in data["probe_ms"].items():
        lines.append(f"| {name} | {data['clip_bytes'][name]} | {R.number(statistics.median(values))} | "
                     f"{R.number(min(values))}–{R.number(max(values))} |")
    return "\n".join(lines) + "\n"


def measure(knobs: R.Knobs) -> dict[str, Any]:
    return R.stamp(SCRIPT, WHAT) | _measure(knobs.rounds, knobs.quick)
