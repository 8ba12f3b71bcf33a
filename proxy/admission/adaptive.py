"""The adaptive concurrency limit (``MMGATE_MAX_MM_CONCURRENCY=auto``): a gradient controller on the latency of
media requests past admission.

What it borrows, and from whom:

- Envoy's adaptive concurrency filter (gradient controller): the limit moves by the gradient
  ``tolerance × baseline / sample`` of a sampled latency against a no-load latency. Envoy measures that minimum
  by pinning the concurrency to a floor for a while every minute, which costs throughput each time; here the
  baseline is the lowest window median of the recent windows instead, which the limit's own backing-off keeps
  fresh. Envoy's growth term ``sqrt(limit)`` overshoots a small knee (at a limit of 4 it adds 2); here growth
  is 10 % of the limit, at least a quarter of a slot.
- Netflix's Gradient2: the gradient is clamped (never below 0.5, so one bad window cannot collapse the
  limit), and the limit does not grow while demand stays under it (an app-limited window says nothing about
  capacity). Its long-term average baseline drifts up under a sustained overload, which is why the baseline
  here is a minimum.

And two of its own: until the first sign of overload the limit doubles per calm, busy window and then halves back
to the last calm value (TCP's slow start), so a cold start reaches a backend's capacity in a few windows rather
than dozens; and samples from requests
admitted under an earlier whole-number limit are dropped, so a decrease is not applied twice for the same
overload (the requests still running were admitted before it).

The controller is pure arithmetic on the event loop; ``Gate`` feeds it one sample per released lease.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

TOLERANCE = 1.25  # latency up to this many times the baseline is not a sign of overload
MIN_GRADIENT = 0.5  # the most one window can cut the limit by
GROWTH = 0.10  # the limit grows by this fraction per calm, busy window ...
MIN_GROWTH = 0.25  # ... and at least by this many slots
MIN_WINDOW = 5  # samples per window at least (more with a higher limit: one per slot)
BASELINE_WINDOWS = 20  # the baseline is the lowest median of this many recent windows


class AdaptiveLimit:
    """Finds a concurrency limit between ``floor`` and ``ceiling`` from latency samples."""

    def __init__(self, floor: int, ceiling: int, initial: int | None = None) -> None:
        self.floor = floor
        self.ceiling = ceiling
        self.value = float(min(ceiling, max(floor, initial if initial is not None else floor)))
        self.epoch = 0  # bumped whenever the whole-number limit changes
        self._window: list[float] = []
        self._busy = False  # whether in-flight work reached the limit during this window
        self._medians: deque[float] = deque(maxlen=BASELINE_WINDOWS)
        self.slow_start = True  # doubling until the first decrease

    @property
    def limit(self) -> int:
        return max(self.floor, min(self.ceiling, math.floor(self.value)))

    def busy(self, in_use: int) -> None:
        """Called on every admission: a window during which the limit was reached can grow it."""
        if in_use >= self.limit:
            self._busy = True

    def observe(self, seconds: float, epoch: int) -> bool:
        """One finished request's latency; ``epoch`` is ``self.epoch`` when it was admitted. Returns whether
        the whole-number limit changed."""
        if epoch != self.epoch:
            return False
        self._window.append(seconds)
        if len(self._window) < max(MIN_WINDOW, self.limit):
            return False
        sample = statistics.median(self._window)
        busy = self._busy
        self._window.clear()
        self._busy = False
        self._medians.append(sample)
        baseline = min(self._medians)
        before = self.limit
        gradient = TOLERANCE * baseline / sample if sample > 0 else 1.0
        if gradient < 1.0 and self.slow_start:
            # the first overload: back to the last limit that was calm (the first windows of a new limit
            # see its fastest requests first, so their gradient understates the overload)
            self.value = max(float(self.floor), self.value / 2)
            self.slow_start = False
        elif gradient < 1.0:
            self.value = max(float(self.floor), self.value * max(MIN_GRADIENT, gradient))
        elif busy:
            growth = self.value if self.slow_start else max(MIN_GROWTH, GROWTH * self.value)
            self.value = min(float(self.ceiling), self.value + growth)
        if self.limit != before:
            self.epoch += 1
            return True
        return False
