"""A sample's class: its counts in power-of-two buckets."""

from __future__ import annotations

from proxy.admission.sample import bucket


def test_counts_fall_in_power_of_two_buckets_and_unknown_stays_unknown() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 64, 65)] == [0, 1, 2, 2, 3, 3, 4, 7, 7]
    assert bucket(None) is None and bucket(-3) == 0
