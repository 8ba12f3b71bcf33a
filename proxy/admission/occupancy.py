"""How many leases were held, over time: by Little's law, the rate at which they complete requests.

A limit under which ``L`` leases were held on average while each was held ``W`` seconds on average completes
``L / W`` requests a second. Each normal completion brings the mean number held over its own lease's time
(``mean``) and those seconds; a phase's rate of a class is the sum of its completions' means over the sum of
every completion's seconds (``adaptive._Phase.mix``), which is exact for any mix of classes once a phase spans a
round. Counted at the backend instead (from the hand-off), the gaps in which a lease is held while mmgate prepares
its request would not count: the rate of a small limit, which loses the most to them, would read too high.

Why not count completions. A delivery-rate sample (TCP BBR's, ``net/ipv4/tcp_rate.c``: the completions while a
request was in flight, over its time in flight) is biased low when answers come in bunches, as they do from a
batching server: closed-loop clients answered together send again together, after the whole bunch, so the k-th
request of a bunch of n counts k completions and a phase reads (n + 1) / 2n of its rate, 0.62 at 4 (over HTTP,
measured: 2.56 where 4.0 was right). BBR keeps the largest of its samples over ten rounds; a phase here has one or
two rounds, and its largest sample is the one a bunch inflates most. The number held does not come in bunches.
"""

from __future__ import annotations

from bisect import bisect_right

MAX_KEPT = 100_000  # changes remembered at most (a flood of requests that never end cannot grow it without bound)


class Occupancy:
    """The number of leases held at every change since the oldest of those still held was granted."""

    def __init__(self, now: float) -> None:
        self._times: list[float] = [now]
        self._areas: list[float] = [0.0]  # request-seconds held up to each change
        self._counts: list[int] = [0]  # requests held from each change on
        self._head = 0  # changes before it are forgotten

    def change(self, now: float, held: int, oldest: float) -> None:
        """``held`` leases are held from ``now`` on; the oldest was granted at ``oldest`` (``now`` when none is
        held): no request still to complete asks about anything before it."""
        last = len(self._times) - 1
        self._areas.append(self._areas[last] + self._counts[last] * (now - self._times[last]))
        self._times.append(now)
        self._counts.append(held)
        self._forget(oldest)

    def __len__(self) -> int:
        """The changes remembered."""
        return len(self._times) - self._head

    def mean(self, start: float, now: float) -> float:
        """The mean number of leases held over (``start``, ``now``]."""
        if now <= start:
            return float(self._counts[-1])
        return (self._area(now) - self._area(start)) / (now - start)

    def _area(self, t: float) -> float:
        at = max(self._head, bisect_right(self._times, t, lo=self._head) - 1)
        return self._areas[at] + self._counts[at] * max(0.0, t - self._times[at])

    def _forget(self, oldest: float) -> None:
        # the last change at or before the oldest hand-off still counts: the area from there is read off it
        keep_from = max(self._head, bisect_right(self._times, oldest, lo=self._head) - 1)
        self._head = max(keep_from, len(self._times) - MAX_KEPT)
        if self._head > len(self._times) // 2 and self._head > 1024:
            del self._times[:self._head], self._areas[:self._head], self._counts[:self._head]
            self._head = 0
