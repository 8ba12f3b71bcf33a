"""The allocator settings the memory benches start mmgate under (bench/soak.py, bench/malloc_arenas.py,
bench/gate_sweep.py's peak_rss): environments of glibc's malloc, Pillow's block cache and jemalloc.

mmgate tunes the allocators itself when it starts serving (``MMGATE_MALLOC_TUNING``, on by default: glibc's
mmap and trim thresholds at 1 MiB, no Pillow block cache; ``proxy.runtime.memory.tune_process``) and would apply
that over any setting here, so each of ``SETTINGS`` comes with ``UNTUNED`` under it: glibc's defaults and Pillow's
16 kept blocks, plus exactly what the setting names.
"""

from __future__ import annotations

from pathlib import Path

MIB = 1 << 20
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"  # Debian's libjemalloc2
UNTUNED = {"MMGATE_MALLOC_TUNING": "off"}
MMAP_1M = {"MALLOC_MMAP_THRESHOLD_": str(MIB), "MALLOC_TRIM_THRESHOLD_": str(MIB)}
BLOCKS_0 = {"PILLOW_BLOCKS_MAX": "0"}
ARENA_2 = {"MALLOC_ARENA_MAX": "2"}
SETTINGS: dict[str, dict[str, str]] = {name: UNTUNED | env for name, env in {
    "arena2": ARENA_2,
    "mmap1m": MMAP_1M,  # a fixed threshold: big buffers are always mmapped, so freeing them returns them to the OS
    "blocks0": BLOCKS_0,
    "mmap1m+blocks0": MMAP_1M | BLOCKS_0,  # what MMGATE_MALLOC_TUNING sets, by hand
    "arena2+blocks0": ARENA_2 | BLOCKS_0,
    "jemalloc": {"LD_PRELOAD": JEMALLOC},
}.items()}


def missing(env: dict[str, str]) -> str | None:
    """The library ``env`` preloads where this machine lacks it (the run is skipped), else None."""
    preload = env.get("LD_PRELOAD")
    return preload if preload and not Path(preload).exists() else None


def env_text(env: dict[str, str], quote: str = "`", empty: str = "-") -> str:
    """``env`` as a table cell or a legend: ``KEY=value`` each, jemalloc by its file name."""
    return " ".join(f"{quote}{k}={v}{quote}" for k, v in env.items()).replace(JEMALLOC, "libjemalloc.so.2") or empty
