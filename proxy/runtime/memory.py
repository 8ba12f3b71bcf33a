"""The process's memory: allocator tuning (glibc, Pillow) and giving freed memory back after bursts.

Decode threads allocate and free large buffers for every big image. glibc keeps freed chunks inside its
arenas for reuse and only returns memory at the top of a heap, so after a burst the process's resident
size stays near the burst's high-water mark although nothing is live any more. ``malloc_trim(0)`` hands
every free page back (``madvise(MADV_DONTNEED)``, all arenas). It takes the arena locks, so
``IdleTrimmer`` runs it only when the media pipeline has been idle for ``MMGATE_TRIM_IDLE`` seconds,
never under load, and in a helper thread, never on the event loop.

Allocator settings are process-global, so this module alone sets them, once, at start-up
(``tune_process``). With ``MMGATE_MALLOC_TUNING`` (the default) memory comes before speed: glibc serves
every allocation of 1 MiB or more with its own mmap and unmaps it on free (``M_MMAP_THRESHOLD``, and
``M_TRIM_THRESHOLD`` for the heap top). The price is fresh pages, so more CPU, for every big buffer. Pillow
keeps ``PILLOW_BLOCKS_PER_THREAD`` freed image blocks per decode thread while media work runs, and the idle
trim clears them first (``release_freed_memory``): an image freed under the GIL would otherwise unmap its
pixels under it too (about 1 ms per 12 MP job, that every other thread and the event loop wait for).
Without the tuning, Pillow keeps a few more blocks for reuse (``PILLOW_BLOCKS_KEPT``), never cleared. An
operator's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``PILLOW_BLOCKS_MAX`` is left alone.

Decode worker processes (``worker_environment``) are tuned apart: the eager threshold would make a worker
fault in every image fresh, so each keeps ``PILLOW_BLOCKS_PER_WORKER`` blocks and a heap for buffers up to
``WORKER_MMAP_THRESHOLD`` while it works, and gives them back once idle for MMGATE_TRIM_IDLE.
bench/results/ has the measurements.

Not glibc (musl, macOS): there is nothing to call and the glibc parts do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable, Mapping

from proxy.edge.timer import Timer

log = logging.getLogger("mmgate")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
EAGER_THRESHOLD = 1 << 20
# Freed Pillow blocks (16 MiB each) kept for reuse when memory does not come first: enough for two workers'
# decode and resize buffers of a large photo, at most 256 MiB kept.
PILLOW_BLOCKS_KEPT = 16
# Freed Pillow blocks kept per decode thread while media work runs, when memory comes first: a job frees
# two big images (decoded and resized).
PILLOW_BLOCKS_PER_THREAD = 2
# A decode worker process, when memory comes first, is tuned like a thread: it keeps what one job of a
# large photo frees (decoded image and resized copy: four blocks), and serves buffers up to glibc's own
# largest dynamic mmap threshold from its heap, so the next item reuses pages instead of faulting in fresh
# ones. What it keeps goes back when it has been idle for MMGATE_TRIM_IDLE (``workers.serve``), and recycling
# (MMGATE_WORKER_MAX_RSS_MB) bounds a fragmented heap.
PILLOW_BLOCKS_PER_WORKER = 4
WORKER_MMAP_THRESHOLD = 32 << 20
WORKER_TRIM_THRESHOLD = 64 << 20


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc_trim, libc.mallopt  # noqa: B018 - glibc only
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def tune_process(environ: Mapping[str, str], *, memory_first: bool, decode_threads: int) -> list[str]:
    """Set the allocators once for this process (``memory_first``: MMGATE_MALLOC_TUNING; ``decode_threads``:
    the decode threads that free images here, 0 in process mode). Returns what was applied, as
    ``NAME=value`` (the variable an operator would set to do the same)."""
    if memory_first:
        return tune_allocators(environ, kept_blocks=PILLOW_BLOCKS_PER_THREAD * decode_threads)
    if "PILLOW_BLOCKS_MAX" in environ:  # Pillow applied it itself at import
        return []
    from PIL import Image

    Image.core.set_blocks_max(PILLOW_BLOCKS_KEPT)
    return [f"PILLOW_BLOCKS_MAX={PILLOW_BLOCKS_KEPT}"]


def worker_environment(environ: Mapping[str, str], *, memory_first: bool) -> dict[str, str]:
    """The same tuning for a decode worker process (MMGATE_DECODE_MODE=process), as the variables glibc and
    Pillow read when a process starts; an operator's own values, which the worker inherits, are left alone."""
    wanted = {"PILLOW_BLOCKS_MAX": str(PILLOW_BLOCKS_KEPT)}
    if memory_first:
        wanted = {"MALLOC_MMAP_THRESHOLD_": str(WORKER_MMAP_THRESHOLD),
                  "MALLOC_TRIM_THRESHOLD_": str(WORKER_TRIM_THRESHOLD),
                  "PILLOW_BLOCKS_MAX": str(PILLOW_BLOCKS_PER_WORKER)}
    return {name: value for name, value in wanted.items() if name not in environ}


def tune_allocators(environ: Mapping[str, str], *, kept_blocks: int = 0) -> list[str]:
    """Big buffers straight back to the OS when freed; Pillow keeps ``kept_blocks`` freed blocks until the
    idle trim. Returns what was applied."""
    applied = []
    libc = _glibc()
    if libc is not None:
        for name, option in (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD),
                             ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD)):
            if name not in environ and libc.mallopt(option, EAGER_THRESHOLD) == 1:
                applied.append(f"{name}={EAGER_THRESHOLD}")
    if "PILLOW_BLOCKS_MAX" not in environ:
        from PIL import Image

        Image.core.set_blocks_max(kept_blocks)
        applied.append(f"PILLOW_BLOCKS_MAX={kept_blocks}")
    return applied


def release_freed_memory() -> Callable[[], int] | None:
    """What the idle trim runs: Pillow's kept blocks freed, then ``malloc_trim(0)``; None without glibc."""
    trim = glibc_malloc_trim()
    if trim is None:
        return None
    from PIL import Image

    def release() -> int:
        Image.core.clear_cache()  # holds the GIL while it frees, but only ever runs when media work is idle
        return trim()

    return release


def glibc_malloc_trim() -> Callable[[], int] | None:
    """``malloc_trim(0)`` when the C library is glibc, else None."""
    libc = _glibc()
    if libc is None:
        return None
    trim = libc.malloc_trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))  # ctypes releases the GIL for the call


class IdleTrimmer:
    """Calls ``trim`` once the media pipeline has stayed idle for ``delay`` seconds after having been busy."""

    def __init__(self, delay: float, trim: Callable[[], int] | None, on_trimmed: Callable[[], None]) -> None:
        self._delay = delay
        self._trim = trim if delay > 0 else None
        self._on_trimmed = on_trimmed
        self._timer = Timer(self._start)
        self._dirty = False  # media work happened since the last trim
        self.trimmed = asyncio.Event()  # set after each trim (tests await it)

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    @property
    def pending(self) -> bool:
        """A trim is scheduled (the pipeline is idle and the delay has not passed yet)."""
        return self._timer.running

    def follow(self, *, running: int, waiting: int) -> None:
        """The gate changed: media work is under way while a request holds or waits for a slot. A lease
        outlives its decode batch, so a free gate means every worker has stopped."""
        if running or waiting:
            self.busy()
        else:
            self.idle()

    def busy(self) -> None:
        """Media work started: a pending trim would contend with it."""
        self._dirty = True
        self._timer.stop()

    def idle(self) -> None:
        """No media work left: trim after ``delay`` seconds unless work starts again."""
        if self._trim is not None and self._dirty:
            self._timer.start(self._delay)

    def _start(self) -> None:
        self._dirty = False
        self.trimmed.clear()
        task = asyncio.ensure_future(asyncio.to_thread(self._trim))  # type: ignore[arg-type]
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[int]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:  # pragma: no cover - malloc_trim does not fail
            log.warning("malloc_trim failed: %r", task.exception())
            return
        self._on_trimmed()
        self.trimmed.set()

    def close(self) -> None:
        self._timer.stop()
