"""The adaptive limit's yardstick: a long average of the backend's seconds, one per request class.

Each class's reference is Netflix concurrency-limits' ``ExpAvgMeasurement`` as ``Gradient2Limit`` uses it for its
long-term RTT: the plain mean of the first ``WARMUP`` values, then an exponential average with the factor
``2 / (WINDOW + 1)``. Gradient2 is fed one value per window (behind its ``WindowedLimit``); ``adaptive`` feeds it
one per cruising phase, the class's median seconds in it. One value moves it by at most 2/601 of the
difference, so no window can drag it down, however many fast answers it holds: a thousand answers in a row, a
thousand times faster than the class's usual, in three phases, move it by 1 %.

Gradient2 also shrinks its long average by 5 % whenever it is more than twice the short one, to recover from a
long overload sooner. That is not taken: here it would let the same burst cut the reference by 5 % a phase,
while the controller compares rates only with the same references on both sides, and a latency with a
reference only together with the last phases' (``adaptive``): a reference left high by an overload rescales,
it does not mislead.

The table holds the classes used most recently, ``MAX_CLASSES`` of them (least recently used out first).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from proxy.admission.sample import SampleClass

WINDOW = 600  # Gradient2Limit's longWindow default
WARMUP = 10  # ExpAvgMeasurement's warm-up as Gradient2Limit builds it
MAX_CLASSES = 64


class Reference:
    """One class's long average of seconds, and when the class last completed."""

    __slots__ = ("completed_at", "count", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.count = 0
        self.completed_at = -math.inf

    @property
    def warm(self) -> bool:
        """Whether it has seen its warm-up samples: until then a sample is measured against itself."""
        return self.count >= WARMUP

    def add(self, seconds: float) -> None:
        if self.count < WARMUP:
            self.count += 1
            self.value += (seconds - self.value) / self.count
        else:
            self.value += (seconds - self.value) * 2 / (WINDOW + 1)


class References:
    """The reference of each recently seen class."""

    def __init__(self, max_classes: int = MAX_CLASSES) -> None:
        self._max = max_classes
        self._table: OrderedDict[SampleClass, Reference] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def value(self, cls: SampleClass) -> float:
        """``cls``'s reference seconds, 0 if it has none (it is not made one)."""
        reference = self._table.get(cls)
        return reference.value if reference is not None else 0.0

    def costliest_live(self, now: float, lively: float) -> float:
        """The largest reference of the classes that completed within ``lively`` times their reference before
        ``now``: what a request still at the backend may be worth (its class is known once it completes). 0 if
        none did."""
        return max((reference.value for reference in self._table.values()
                    if now - reference.completed_at <= lively * reference.value), default=0.0)

    def completed(self, cls: SampleClass, now: float) -> None:
        """``cls`` completed a request at ``now``: recorded if it has a reference (a late answer of a class never
        measured makes none, so it cannot push a measured class out of the table)."""
        reference = self._table.get(cls)
        if reference is not None:
            reference.completed_at = now
            self._table.move_to_end(cls)

    def get(self, cls: SampleClass) -> Reference:
        """``cls``'s reference, a new one if it has none (forgetting the least recently used class when full)."""
        reference = self._table.get(cls)
        if reference is None:
            reference = self._table[cls] = Reference()
            if len(self._table) > self._max:
                self._table.popitem(last=False)
        else:
            self._table.move_to_end(cls)
        return reference
