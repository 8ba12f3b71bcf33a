"""Load against a real vLLM, directly and through mmgate in front of it, and what vLLM saw of it: the request
bodies, the clients, and the counters read around each cell (bench/real_vllm.py and bench/model_tokens.py).

- ``image_chat``: one OpenAI chat to the tiny model with one data-URI image, built once, sent many times.
- ``interleaved_cells`` (real_vllm): per image and concurrency, the modes (direct, or one mmgate each) taking
  turns in rounds of a closed loop of workers; per ``Cell``: latencies, statuses, mmgate's Server-Timing
  ``preprocess``, the bytes vLLM received (its own ``http_request_size_bytes_sum``), mmgate's media bytes in and
  out, and vLLM's peak RSS over the cell (VmHWM, reset before each round through ``procfs.reset_peaks``).
- ``prompt_token_cells`` (model_tokens): per image and mode, rounds of a burst of requests at most
  ``concurrency`` at once; per round the mean and p99 latency, req/s, bytes vLLM received per request, and every
  ``prompt_tokens`` vLLM counted.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from testkit import procfs
from testkit.vllm import SERVED_MODEL, Server, data_uri, metric_sum

CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
DERIVED = ("p50", "p99", "rps", "preprocess_p50_ms")  # a Cell's figures its JSON row adds to its fields


def image_chat(image: bytes, mime: str, max_tokens: int, *, compact: bool = False) -> bytes:
    """A chat to ``SERVED_MODEL``: the image as a data URI, then "Describe this image."; ``compact``: JSON
    without spaces between items."""
    body = {"model": SERVED_MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(image, mime)}},
        {"type": "text", "text": "Describe this image."}]}]}
    return json.dumps(body, separators=(",", ":") if compact else None).encode()


def vllm_bytes_received(vllm: Server) -> float:
    """Request body bytes vLLM has received on the chat endpoint, by its own count."""
    return metric_sum(vllm.metrics("/metrics"), "http_request_size_bytes_sum", handler=CHAT)


# ----------------------------------------------------------------------------------------------- real_vllm


@dataclass
class Cell:
    """One image, mode and concurrency: what its requests measured, over its rounds."""

    image: str
    fmt: str
    mode: str
    concurrency: int
    requests: int
    image_bytes: int
    statuses: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    preprocess_ms: list[float] = field(default_factory=list)  # mmgate's Server-Timing "preprocess"
    wall: float = 0.0
    vllm_bytes: float = 0.0
    gate_media_in: float = 0.0
    gate_media_out: float = 0.0
    vllm_hwm_mib: float = 0.0
    vllm_rss_mib: float = 0.0

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) if self.latencies else float("nan")

    @property
    def p99(self) -> float:
        if not self.latencies:
            return float("nan")
        s = sorted(self.latencies)
        return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]

    @property
    def preprocess_p50(self) -> float:
        return statistics.median(self.preprocess_ms) if self.preprocess_ms else float("nan")

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall if self.wall else float("nan")

    def row(self) -> dict[str, Any]:
        """The cell as its result's JSON holds it: its fields, then its figures (None for NaN)."""
        figures = zip(DERIVED, (self.p50, self.p99, self.rps, self.preprocess_p50), strict=True)
        return asdict(self) | {k: (None if math.isnan(v) else v) for k, v in figures}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Cell:
        return cls(**{k: v for k, v in row.items() if k not in DERIVED})


def parse_server_timing(value: str) -> dict[str, float]:
    """``queue;dur=1.2, preprocess;dur=35.0`` → {"queue": 1.2, "preprocess": 35.0} (milliseconds)."""
    out: dict[str, float] = {}
    for part in value.split(","):
        name, _, rest = part.strip().partition(";")
        if rest.startswith("dur="):
            try:
                out[name] = float(rest[4:])
            except ValueError:
                pass
    return out


async def run_cell(session: aiohttp.ClientSession, url: str, body: bytes, cell: Cell, count: int) -> None:
    """``count`` more requests for ``cell``, at most ``cell.concurrency`` in flight (a closed loop of workers)."""
    todo = list(range(count))

    async def worker() -> None:
        while todo:
            todo.pop()
            t0 = time.perf_counter()
            try:
                async with session.post(url + CHAT, data=body, headers=JSON) as r:
                    await r.read()
                    status = str(r.status)
                    timing = parse_server_timing(r.headers.get("Server-Timing", ""))
            except aiohttp.ClientError as e:
                status, timing = type(e).__name__, {}
            dt = time.perf_counter() - t0
            cell.statuses[status] = cell.statuses.get(status, 0) + 1
            if status == "200":
                cell.latencies.append(dt)
                if "preprocess" in timing:
                    cell.preprocess_ms.append(timing["preprocess"])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(cell.concurrency, count))))
    cell.wall += time.perf_counter() - t0


def vllm_memory(pids: list[int]) -> tuple[float, float]:
    """(peak RSS, RSS) of vLLM's processes, summed, in MiB."""
    hwm = rss = 0
    for p in pids:
        m = procfs.memory(p)
        hwm += m.get("VmHWM", 0)
        rss += m.get("VmRSS", 0)
    return hwm / 2**20, rss / 2**20


def gate_media(gate: Server | None) -> tuple[float, float]:
    """mmgate's media bytes (in, out) so far; none for the direct mode."""
    if gate is None:
        return 0.0, 0.0
    m = gate.metrics("/mmgate/metrics")
    return (metric_sum(m, "mmgate_media_bytes_total", direction="in"),
            metric_sum(m, "mmgate_media_bytes_total", direction="out"))


async def interleaved_cells(vllm: Server, vllm_pid: int | None, gates: Mapping[str, Server | None],
                            images: Mapping[tuple[str, str], bytes], requests: Mapping[int, int],
                            rounds: Mapping[int, int], max_tokens: int) -> list[Cell]:
    """For each (image name, format) of ``images`` and each concurrency of ``requests`` (its request count): one
    Cell per mode of ``gates`` (None: direct to vLLM), the modes taking turns over ``rounds[concurrency]`` rounds
    (in reverse every other round), so drift on a shared machine (other work, vLLM's own state) is spread over
    every mode instead of landing on one. Prints each row of cells as it ends."""
    modes = list(gates)
    pids = procfs.tree(vllm_pid) if vllm_pid else []
    cells: list[Cell] = []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for (name, fmt), img in images.items():
            body = image_chat(img, f"image/{fmt}", max_tokens)
            # warm-up (untimed): first requests of a new image shape pay one-off costs in vLLM
            async with session.post(vllm.url + CHAT, data=body, headers=JSON) as r:
                await r.read()
            for conc, n in requests.items():
                row = {mode: Cell(name, fmt, mode, conc, n, len(img)) for mode in modes}
                for rnd in range(rounds[conc]):
                    count = n // rounds[conc] + (1 if rnd < n % rounds[conc] else 0)
                    for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                        gate, cell = gates[mode], row[mode]
                        b0, (gi0, go0) = vllm_bytes_received(vllm), gate_media(gate)
                        procfs.reset_peaks(pids)
                        await run_cell(session, gate.url if gate else vllm.url, body, cell, count)
                        hwm, rss = vllm_memory(pids)
                        cell.vllm_hwm_mib, cell.vllm_rss_mib = max(cell.vllm_hwm_mib, hwm), rss
                        b1, (gi1, go1) = vllm_bytes_received(vllm), gate_media(gate)
                        cell.vllm_bytes += b1 - b0
                        cell.gate_media_in += gi1 - gi0
                        cell.gate_media_out += go1 - go0
                for cell in row.values():
                    cells.append(cell)
                    print(f"{name:>4} {fmt:<4} c={conc:<2} {cell.mode:<6} n={n:<2} p50 {cell.p50:6.2f}s "
                          f"p99 {cell.p99:6.2f}s {cell.rps:5.2f} req/s  to vLLM {cell.vllm_bytes / n / 1e6:7.2f} MB/req"
                          f"  preprocess {cell.preprocess_p50:6.0f} ms  vLLM HWM {cell.vllm_hwm_mib:6.0f} MiB"
                          f"  {cell.statuses}", flush=True)
    return cells


# ----------------------------------------------------------------------------------------------- model_tokens


async def _timed_chat(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, int]:
    """One chat: (seconds, the prompt_tokens vLLM counted); anything but 200 fails the run."""
    started = time.perf_counter()
    async with session.post(url + CHAT, data=body, headers=JSON) as response:
        answer = await response.json()
        assert response.status == 200, answer
    return time.perf_counter() - started, int(answer["usage"]["prompt_tokens"])


async def prompt_token_cells(vllm: Server, modes: Mapping[str, str], bodies: Mapping[str, bytes], rounds: int,
                             requests: int, concurrency: int) -> dict[str, dict[str, dict[str, list[Any]]]]:
    """Per image (``bodies``) and mode (``modes``: its URL), every round's mean and p99 latency (ms), req/s,
    bytes vLLM received per request, and the distinct prompt_tokens of its ``requests`` requests, at most
    ``concurrency`` in flight. Modes take turns within each round, so drift on a shared machine hits both."""
    cells: dict[str, dict[str, dict[str, list[Any]]]] = {}
    # A new connection per request: a keep-alive connection the server closes as the next request starts
    # (uvicorn's 5 s idle timeout) would fail that POST, and aiohttp never retries one.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        for image, body in bodies.items():
            for _round in range(rounds):
                for mode, url in modes.items():
                    cell = cells.setdefault(image, {}).setdefault(mode, {})
                    before = vllm_bytes_received(vllm)
                    limit = asyncio.Semaphore(concurrency)

                    async def limited(url: str = url, body: bytes = body,
                                      limit: asyncio.Semaphore = limit) -> tuple[float, int]:
                        async with limit:
                            return await _timed_chat(session, url, body)

                    started = time.perf_counter()
                    results = await asyncio.gather(*(limited() for _ in range(requests)))
                    wall = time.perf_counter() - started
                    after = vllm_bytes_received(vllm)
                    latencies = [r[0] for r in results]
                    cell.setdefault("mean_ms", []).append(statistics.fmean(latencies) * 1000)
                    cell.setdefault("p99_ms", []).append(sorted(latencies)[max(0, round(0.99 * len(latencies)) - 1)]
                                                         * 1000)
                    cell.setdefault("rps", []).append(requests / wall)
                    cell.setdefault("vllm_bytes_per_request", []).append((after - before) / requests)
                    cell.setdefault("prompt_tokens", []).extend(sorted({r[1] for r in results}))
    return cells
