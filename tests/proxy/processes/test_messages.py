"""The messages of the front <-> gate link: each one decodes to what was encoded, whatever its fields, and every
refusal one can carry is one of the error registry's (the front rebuilds it from there)."""

from __future__ import annotations

from dataclasses import fields

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from preprocessors.errors import REGISTRY, MmgateError
from preprocessors.job import Verdict
from proxy.admission.client import GateCounters
from proxy.admission.flows import Flow
from proxy.admission.gate import Gate
from proxy.admission.sample import Sample
from proxy.processes.messages import (
    MESSAGES,
    Acquire,
    Counted,
    Observe,
    Refused,
    decode,
    encode,
    verdict_from_wire,
    verdict_to_wire,
)
from proxy.state import Lifecycle
from tests.proxy.processes.conftest import COUNTERS, SAMPLES, VERDICT


def test_the_samples_hold_one_of_each_message() -> None:
    assert {type(sample) for sample in SAMPLES} == set(MESSAGES.values())
    assert len(MESSAGES) == len({kind.TAG for kind in MESSAGES.values()})  # a tag names one message


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
    gate = Gate(1, 100, 1, refusing=lambda: lifecycle.refusing, token_budget=10, max_queue_per_flow=1)
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
