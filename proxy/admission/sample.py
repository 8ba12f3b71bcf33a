"""What one normal completion tells the adaptive limit: the backend's seconds, and the class of the request.

A ``Sample`` is taken only for an exchange that ended normally: the backend answered 2xx, the answer was relayed
to its last byte, and the client read it without stalling. Client aborts, refusals (the backend's or mmgate's),
errors, deadlines and stalled clients give none: a request that failed before any meaningful latency would
only teach an artificially low one (Netflix concurrency-limits' onIgnore of its Limiter.Listener), and Envoy's
adaptive concurrency filter likewise drops the sample of a request whose answer did not complete.

The class says what kind of work a request was, so that one client's cheap requests (one output token, a refusal
the backend would have answered at once) cannot set the yardstick everyone else's latency is read against: the
controller keeps one reference latency per class. It is the route, whether the answer streamed, and two size
buckets, each the ``bit_length`` of a count (so 0, 1, 2-3, 4-7, ...): output tokens, and image tokens (or, with
no served model to count them, decoded media bytes in 64 KiB units): ``sample_class``.
"""

from __future__ import annotations

from typing import NamedTuple

# (route, streamed, output-token bucket, image bucket); plain values, so it crosses a process link as it is
SampleClass = tuple[str | bool | int | None, ...]


class Sample(NamedTuple):
    """The backend's time for one normally completed request: from its hand-off to the backend (``Lease.handed_off``)
    to the answer's last byte, in seconds; and the request's class."""

    seconds: float
    cls: SampleClass


def bucket(count: int | None) -> int | None:
    """A count's power-of-two bucket (``bit_length``): 0 → 0, 1 → 1, 2-3 → 2, 4-7 → 3, …; None stays None
    (unknown is a class of its own, not a guess)."""
    return None if count is None else max(0, count).bit_length()


def sample_class(route: str, streamed: bool, output_tokens: int | None, image_tokens: int | None,
                 media_bytes: int) -> SampleClass:
    """A request's class: its ``route``, whether it ``streamed``, the bucket of its ``output_tokens`` (None:
    unknown), and the bucket of its ``image_tokens`` where the served model counts them (``MMGATE_MODEL``), else
    of its decoded ``media_bytes`` in 64 KiB units."""
    images = bucket(image_tokens) if image_tokens is not None else bucket(media_bytes >> 16)
    return (route, streamed, bucket(output_tokens), images)
