"""What finding a payload in the processed-media cache costs the event loop (``bench/cache``): hashing a
payload's base64 handed to the cache's hasher threads, as mmgate does, against hashing it on the loop itself.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import pybase64

from proxy.media.cache import MediaCache, media_digest
from testkit.media import photo_jpeg


def hash_cost(payload_mb: float, repeats: int = 5) -> dict[str, float]:
    """Loop-thread CPU per MB to hash a payload through the cache's hasher threads, against on the loop."""
    photo = photo_jpeg()
    data = pybase64.b64encode(photo * max(1, round(payload_mb * 1e6 / (len(photo) * 4 / 3))))
    mb = len(data) / 1e6
    cache = MediaCache(1 << 20, "")

    async def run() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        off_loop, inline, thread = [], [], []
        for _ in range(repeats):
            c0, w0 = time.thread_time(), time.perf_counter()
            await loop.run_in_executor(cache.hasher, media_digest, data, "base64")
            off_loop.append((time.thread_time() - c0) * 1e6)
            thread.append((time.perf_counter() - w0) / mb * 1e6)
            c0 = time.thread_time()
            media_digest(data, "base64")
            inline.append((time.thread_time() - c0) / mb * 1e6)
        per_call = statistics.median(off_loop)
        return {"payload_mb": round(mb, 2), "loop_us_per_call_handed_off": per_call,
                "loop_us_per_mb_handed_off": per_call / mb,
                "loop_us_per_mb_inline": statistics.median(inline), "hasher_wall_us_per_mb": statistics.median(thread)}

    try:
        return asyncio.run(run())
    finally:
        cache.close()
