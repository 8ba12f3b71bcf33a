"""Delivery-rate samples: the completions while a request was in flight, per class."""

from __future__ import annotations

from proxy.admission.delivery import MAX_KEPT, Deliveries


def test_a_request_counts_what_completed_while_it_was_in_flight_itself_included() -> None:
    deliveries = Deliveries()
    for t, cls in [(1.0, ("a",)), (1.5, ("b",)), (2.0, ("a",)), (2.5, ("a",))]:
        deliveries.add(t, cls, 2.0)
    assert deliveries.during(1.0, 2.5) == {("a",): 2, ("b",): 1}  # after its hand-off at 1.0, up to now
    assert deliveries.during(2.4, 2.5) == {("a",): 1}


def test_completions_older_than_the_longest_time_in_flight_are_forgotten() -> None:
    deliveries = Deliveries()
    for step in range(5000):
        deliveries.add(step * 0.01, ("a",), 0.05)
    deliveries.shorten(0.05)
    deliveries.add(50.0, ("a",), 0.05)
    assert deliveries.during(0.0, 50.0) == deliveries.during(49.9, 50.0) == {("a",): 5}


def test_a_flood_keeps_a_bounded_number() -> None:
    deliveries = Deliveries()
    for step in range(MAX_KEPT + 5000):
        deliveries.add(1.0 + step * 1e-9, ("flood",), 3600.0)
    assert sum(deliveries.during(0.0, 2.0).values()) == MAX_KEPT
