"""The requests the backend held over time, and their mean over a span (Little's law's L)."""

from __future__ import annotations

from proxy.admission.occupancy import MAX_KEPT, Occupancy


def test_the_mean_weighs_each_count_by_how_long_it_lasted() -> None:
    occupancy = Occupancy(0.0)
    occupancy.change(1.0, 1, 1.0)
    occupancy.change(2.0, 3, 1.0)
    occupancy.change(3.0, 2, 1.0)
    assert occupancy.mean(1.0, 3.0) == 2.0  # 1 for a second, 3 for a second
    assert occupancy.mean(1.5, 2.5) == 2.0  # 1 for half a second, 3 for half
    assert occupancy.mean(3.0, 5.0) == 2.0  # still 2 since the last change
    assert occupancy.mean(0.0, 1.0) == 0.0


def test_a_bunch_of_answers_reads_the_number_held() -> None:
    """Four requests handed off together, answered together: the first of the bunch to complete held four at the
    backend almost all along (a count of the completions during its time there would read one)."""
    occupancy = Occupancy(0.0)
    for request in range(4):
        occupancy.change(0.25 + request * 1e-4, request + 1, 0.25)
    assert abs(occupancy.mean(0.25, 0.5) - 4.0) < 0.01


def test_changes_before_the_oldest_request_still_held_are_forgotten() -> None:
    occupancy = Occupancy(0.0)
    for step in range(5000):
        occupancy.change(step * 0.01, 1 + step % 2, step * 0.01 - 0.02)  # each request 20 ms at the backend
    assert abs(occupancy.mean(49.97, 49.99) - 1.5) < 1e-9
    assert len(occupancy) <= 4


def test_a_flood_keeps_a_bounded_number() -> None:
    occupancy = Occupancy(0.0)
    for step in range(MAX_KEPT + 5000):
        occupancy.change(1.0 + step * 1e-6, step % 3, 0.0)  # the oldest never leaves
    assert len(occupancy) <= MAX_KEPT
