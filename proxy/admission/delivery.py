"""Delivery-rate samples, as TCP BBR takes them (``net/ipv4/tcp_rate.c``): each completed request measures the
completions delivered while it was in flight, over its own time in flight.

A rate measured over a fixed window of a few rounds is at the mercy of where the window's edges fall: closed-loop
clients finish in bunches, one per round, and a bunch more or less inside the window is an eighth of a phase of
eight. A request's own time in flight always spans one round, from its hand-off to its completion, and every
request of the phase gives one sample: averaged, the edges wash out.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter

from proxy.admission.sample import SampleClass

MAX_KEPT = 100_000  # completions remembered at most (a flood of tiny answers cannot grow it without bound)


class Deliveries:
    """The recent completions: when each came, and its class."""

    def __init__(self) -> None:
        self._times: list[float] = []
        self._classes: list[SampleClass] = []
        self._head = 0  # entries before it are forgotten
        self.horizon = 0.0  # the longest time in flight lately: completions older than it are not needed

    def add(self, now: float, cls: SampleClass, seconds: float) -> None:
        self._times.append(now)
        self._classes.append(cls)
        self.horizon = max(self.horizon, seconds)
        self._forget(now)

    def during(self, start: float, now: float) -> Counter[SampleClass]:
        """Completions per class after ``start`` up to ``now`` (the one completing now included)."""
        first = bisect_right(self._times, start, lo=self._head)
        return Counter(self._classes[first:])

    def shorten(self, horizon: float) -> None:
        """From now on, look back only as far as ``horizon`` (the longest time in flight of the last phases)."""
        self.horizon = horizon

    def _forget(self, now: float) -> None:
        oldest = bisect_right(self._times, now - self.horizon, lo=self._head)
        self._head = max(oldest, len(self._times) - MAX_KEPT)
        if self._head > len(self._times) // 2 and self._head > 1024:
            del self._times[:self._head], self._classes[:self._head]
            self._head = 0
