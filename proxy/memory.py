"""Giving freed heap back to the operating system once media work goes quiet (issue 5).

Decode threads allocate and free tens of MiB per large image. glibc keeps freed chunks inside its arenas
for reuse and only returns memory at the top of a heap, so after a burst the process's RSS stays near the
burst's high-water mark although nothing is live any more (measured in bench/results/malloc_arenas.md and
soak.md). ``malloc_trim(0)`` hands every free page back (``madvise(MADV_DONTNEED)``, all arenas). It takes
the arena locks, so it runs only when the media pipeline has been idle for ``MMGATE_TRIM_IDLE`` seconds,
never under load, and in a helper thread, never on the event loop.

Not glibc (musl, macOS): there is nothing to call and the trimmer does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from typing import Callable

log = logging.getLogger("mmgate")


def glibc_malloc_trim() -> Callable[[], int] | None:
    """``malloc_trim(0)`` when the C library is glibc, else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))  # ctypes releases the GIL for the call


class IdleTrimmer:
    """Calls ``trim`` once the media pipeline has stayed idle for ``delay`` seconds after having been busy."""

    def __init__(self, delay: float, trim: Callable[[], int] | None, on_trimmed: Callable[[], None]) -> None:
        self._delay = delay
        self._trim = trim if delay > 0 else None
        self._on_trimmed = on_trimmed
        self._timer: asyncio.TimerHandle | None = None
        self._dirty = False  # media work happened since the last trim
        self.trimmed = asyncio.Event()  # set after each trim (tests await it)

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    @property
    def pending(self) -> bool:
        """A trim is scheduled (the pipeline is idle and the delay has not passed yet)."""
        return self._timer is not None

    def busy(self) -> None:
        """Media work started: a pending trim would contend with it."""
        self._dirty = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def idle(self) -> None:
        """No media work left: trim after ``delay`` seconds unless work starts again."""
        if self._trim is None or not self._dirty or self._timer is not None:
            return
        self._timer = asyncio.get_running_loop().call_later(self._delay, self._start)

    def _start(self) -> None:
        self._timer = None
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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
