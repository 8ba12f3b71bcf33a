"""The per-class reference latency: Gradient2's long exponential average, warm-up mean first."""

from __future__ import annotations

import pytest

from proxy.admission.class_reference import MAX_CLASSES, WARMUP, WINDOW, Reference, References


def test_the_first_values_are_averaged_plainly_then_each_moves_it_by_2_in_601() -> None:
    reference = Reference()
    for value in range(1, WARMUP + 1):
        assert not reference.warm
        reference.add(float(value))
    assert reference.warm and reference.value == pytest.approx((WARMUP + 1) / 2)
    before = reference.value
    reference.add(before + 601.0)
    assert reference.value == pytest.approx(before + 601.0 * 2 / (WINDOW + 1))


def test_fast_values_in_a_row_cannot_drag_it_down() -> None:
    reference = Reference()
    for _ in range(WARMUP):
        reference.add(1.0)
    for _ in range(55):  # even fed one per answer: 55 answers a thousand times faster
        reference.add(0.001)
    assert reference.value >= 0.83


def test_the_least_recently_used_class_is_forgotten_first() -> None:
    references = References()
    references.get(("first",)).add(1.0)
    for index in range(MAX_CLASSES - 1):
        references.get(("other", index)).add(2.0)
    references.get(("first",))  # used again: the oldest is now ("other", 0)
    references.get(("new",)).add(3.0)
    assert len(references) == MAX_CLASSES
    assert references.value(("first",)) == 1.0 and references.value(("other", 0)) == 0.0
    assert references.value(("never seen",)) == 0.0 and len(references) == MAX_CLASSES


def test_a_completion_of_a_class_never_measured_makes_no_reference() -> None:
    references = References()
    for index in range(MAX_CLASSES):
        references.get(("measured", index)).add(1.0)
    references.completed(("measured", 0), now=5.0)  # the oldest, used again: ("measured", 1) is now the oldest
    for index in range(MAX_CLASSES):
        references.completed(("late", index), now=6.0)  # answers of requests admitted under another limit
    assert len(references) == MAX_CLASSES and references.value(("late", 0)) == 0.0
    assert references.costliest_live(now=6.0, lively=2.0) == 1.0  # ("measured", 0), 1 s ago, within 2 × 1 s
    references.get(("new",)).add(2.0)
    assert references.value(("measured", 0)) == 1.0 and references.value(("measured", 1)) == 0.0
