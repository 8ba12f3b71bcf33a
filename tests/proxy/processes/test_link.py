"""The front <-> gate link: every message crosses a real socket pair as it was sent, and every refusal it can
carry is one of the error registry's (the front rebuilds it from there)."""

from __future__ import annotations

import socket
import struct
from dataclasses import fields

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from preprocessors.errors import REGISTRY, MmgateError
from preprocessors.job import Refusal, Verdict
from proxy.admission.client import GateCounters
from proxy.admission.flows import Flow
from proxy.admission.gate import Gate
from proxy.admission.sample import Sample
from proxy.processes.link import (
    MESSAGES,
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
    Link,
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
    decode,
    encode,
    verdict_from_wire,
    verdict_to_wire,
)
from proxy.serve.lifecycle import Lifecycle

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


async def _pair() -> tuple[Link, Link]:
    one, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return await Link.over(one), await Link.over(other)


def test_the_samples_hold_one_of_each_message() -> None:
    assert {type(sample) for sample in SAMPLES} == set(MESSAGES.values())
    assert len(MESSAGES) == len({kind.TAG for kind in MESSAGES.values()})  # a tag names one message


async def test_every_message_crosses_a_socket_pair_as_sent() -> None:
    front, gate = await _pair()
    for sample in SAMPLES:
        front.send(sample)
    assert [await gate.receive() for _ in SAMPLES] == SAMPLES
    front.close()
    assert await gate.receive() is None  # the other end is gone
    gate.close()


@given(st.integers(0, 2**53), st.integers(0, 2**53), st.floats(0, 1e9), st.one_of(st.none(), st.integers(0, 2**53)),
       st.integers(0, 2**53), st.text(), st.integers(-(2**31), 2**31), st.text())
def test_an_acquire_round_trips_whatever_its_fields(rid: int, cost: int, timeout: float, place: int | None,
                                                     tokens: int, flow_id: str, band: int, client: str) -> None:
    sent = Acquire(rid, cost, timeout, place, tokens, Flow(flow_id, band, client))
    assert decode(encode(sent)) == sent


@given(st.lists(st.integers(0, 2**53), min_size=7, max_size=7))
def test_counters_round_trip(values: list[int]) -> None:
    sent = Counted(1, GateCounters(*values))
    received = decode(encode(sent))
    assert received == sent and isinstance(received, Counted) and isinstance(received.counters, GateCounters)


@given(st.integers(0, 2**53), st.floats(0, 1e9), st.text(), st.booleans(), st.one_of(st.none(), st.integers(0, 64)),
       st.one_of(st.none(), st.integers(0, 64)))
def test_a_sample_round_trips_whatever_its_class(lease: int, seconds: float, route: str, streamed: bool,
                                                  output: int | None, images: int | None) -> None:
    sent = Observe(lease, Sample(seconds, (route, streamed, output, images)))
    received = decode(encode(sent))
    assert received == sent and isinstance(received, Observe) and isinstance(received.sample, Sample)
    assert isinstance(received.sample.cls, tuple)  # hashable: the controller keys its references by it


def test_a_cached_verdict_round_trips() -> None:
    assert verdict_from_wire(orjson.loads(orjson.dumps(verdict_to_wire(VERDICT)))) == VERDICT
    plain = Verdict(3, 3, b"image/png", b"image/png", None, None, None)
    assert verdict_from_wire(verdict_to_wire(plain)) == plain


@pytest.mark.parametrize("frame", [
    b"{}", b"[]", b'["no such message", 1]', b'["release"]', b'["release", 1, 2]', b"not json",
    b'["refused", 1, [0, 0, 0, 0, 0, 0, 1], 499, "cancelled", "", {}]',
    b'["counted", 1, [0, 0]]', b'["place", 1, ["id", 0, "client", "more"]]',
])
async def test_a_frame_that_holds_no_message_ends_the_link(frame: bytes) -> None:
    front, gate = await _pair()
    front.writer.write(struct.pack(">I", len(frame)) + frame)
    assert await gate.receive() is None
    front.close()
    gate.close()


def test_only_a_refusal_carries_a_status_and_it_must_be_the_registrys() -> None:
    assert [kind for kind in MESSAGES.values() if "status" in {field.name for field in fields(kind)}] == [Refused]
    with pytest.raises(ValueError, match="not in the error registry"):
        Refused(1, COUNTERS, 499, "cancelled", "", {})
    for status, code in REGISTRY:
        assert Refused(1, COUNTERS, status, code, "why", {}).error().code == code


async def _refusals_of_a_gate() -> list[MmgateError]:
    """Every refusal a real Gate gives, each caught as it raised it."""
    caught: list[MmgateError] = []
    lifecycle = Lifecycle()
    gate = Gate(1, 100, 1, lifecycle=lifecycle, token_budget=10, max_queue_per_flow=1)
    held = await gate.acquire(1, 30)
    attempts = [
        lambda: gate.acquire(101, 30),  # 413 media_too_large
        lambda: gate.acquire(1, 30, tokens=11),  # 413 too_many_image_tokens
        lambda: gate.acquire(1, 0.01),  # 429 queue_timeout
    ]
    for attempt in attempts:
        with pytest.raises(MmgateError) as refused:
            await attempt()
        caught.append(refused.value)
    gate.take_place()
    with pytest.raises(MmgateError) as refused:
        gate.take_place()  # 429 queue_full
    caught.append(refused.value)
    lifecycle.start_draining()
    with pytest.raises(MmgateError) as refused:
        gate.take_place()  # 503 draining
    caught.append(refused.value)
    held.release()
    return caught


async def test_every_refusal_of_the_gate_crosses_the_link_as_the_same_error() -> None:
    refusals = await _refusals_of_a_gate()
    assert {(error.status, error.code) for error in refusals} == {
        (413, "media_too_large"), (413, "too_many_image_tokens"), (429, "queue_timeout"), (429, "queue_full"),
        (503, "draining")}
    for error in refusals:
        received = decode(encode(Refused.of(7, error, COUNTERS)))
        assert isinstance(received, Refused)
        again = received.error()
        assert (type(again), again.status, again.code, again.message, again.headers) == (
            type(error), error.status, error.code, error.message, error.headers)


async def test_no_frame_is_read_past_its_bound() -> None:
    front, gate = await _pair()
    front.writer.write(struct.pack(">I", (64 << 20) + 1))
    assert await gate.receive() is None
    front.close()
    gate.close()
