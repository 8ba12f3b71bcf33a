"""One of each message of the front <-> gate link, for the link's tests and the messages' own."""

from __future__ import annotations

from preprocessors.job import Refusal, Verdict
from proxy.admission.client import GateCounters
from proxy.admission.flows import Flow
from proxy.admission.sample import Sample
from proxy.processes.messages import (
    Acquire,
    Admitted,
    AskCounters,
    AskReport,
    Cancel,
    Collect,
    Collected,
    Counted,
    Found,
    HandedOff,
    Lookup,
    Lower,
    Message,
    Observe,
    Peek,
    Peeked,
    Ping,
    Placed,
    Pong,
    Ready,
    Refused,
    Release,
    Report,
    TakePlace,
    Unplace,
    WaitCancelled,
    verdict_to_wire,
)

COUNTERS = GateCounters(1, 2, 3, 4, 5, 6, 7)
FLOW = Flow("tenant-a", 2, "192.0.2.7")
VERDICT = Verdict(10, 4, b"image/png", b"image/jpeg", b"/9j/", Refusal(400, "invalid_image", "bad"), (1, 2, 3))
# One of each message, with every field set.
SAMPLES: list[Message] = [
    Ready(), TakePlace(1, FLOW), Acquire(2, 1 << 40, 2.5, 7, 12, FLOW), Acquire(3, 0, 30.0, None, 0, Flow()),
    Cancel(4), Unplace(5), Release(6), HandedOff(7), Lower(8, 9), Collect(10), AskCounters(11),
    Peek(12, ["00ff", "ab"]), Report(13, {"front": {"index": 1}, "families": [], "extra": {"in_flight": 2}}),
    Found(14, {"00ff": verdict_to_wire(VERDICT)}), Pong(15),
    Placed(16, COUNTERS, 17), Admitted(18, COUNTERS, 19), Counted(20, COUNTERS),
    Collected(21, COUNTERS, {"fronts": [], "families": [], "extra": {}}), Peeked(22, COUNTERS, {}),
    Refused(23, COUNTERS, 429, "queue_full", "the media queue is full", {"Retry-After": "3"}),
    WaitCancelled(24, COUNTERS), AskReport(25), Lookup(26, ["00ff"]), Ping(27),
    Observe(28, Sample(1.25, ("chat", True, 7, None))),
]
