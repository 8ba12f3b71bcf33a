"""The gate as handlers use it in one process: ``LocalGate`` over the real ``Gate``, built from the settings as
the supervisor builds its own."""

from __future__ import annotations

from proxy.admission.client import GateCounters, LocalGate, configured_limit, gate_from_settings
from proxy.admission.flows import Flow
from proxy.app import build_state
from proxy.ops.metrics import Metrics
from proxy.settings import Settings


def _settings(**env: str) -> Settings:
    return Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:1", **env})


def test_the_limit_is_fixed_or_found() -> None:
    fixed = gate_from_settings(_settings(MMGATE_MAX_MM_CONCURRENCY="3").gate)
    assert (fixed.limit, fixed.adaptive) == (3, None)
    auto = _settings(MMGATE_MAX_MM_CONCURRENCY="auto", MMGATE_MIN_MM_CONCURRENCY="2",
                     MMGATE_MAX_MM_CONCURRENCY_AUTO="40").gate
    found = gate_from_settings(auto)
    assert found.adaptive is not None and found.limit == found.adaptive.limit == configured_limit(auto)[0]
    assert 2 <= found.limit <= 40


async def test_every_change_is_seen_as_counters() -> None:
    seen: list[GateCounters] = []
    gate = LocalGate(gate_from_settings(_settings(MMGATE_MAX_MM_CONCURRENCY="2", MMGATE_MAX_QUEUE="3").gate,
                                        seen.append))
    assert seen == [GateCounters(0, 0, 0, 0, 0, 0, 2)]  # as built: the gauges start right
    place = await gate.take_place(Flow(client="192.0.2.7"))
    assert seen[-1].reading == 1 and gate.counters() == seen[-1]
    lease = await gate.acquire(100, 5, place, tokens=0)
    assert (seen[-1].in_use, seen[-1].reading, seen[-1].bytes_in_use, seen[-1].waiting_media) == (1, 0, 100, 1)
    lease.handed_off()
    assert gate.counters().waiting_media == 0
    lease.release()
    assert seen[-1] == GateCounters(0, 0, 0, 0, 0, 0, 2)


async def test_one_process_is_the_whole() -> None:
    """In one process there is no fleet: nothing to start or close, no other front's metrics or cache to ask."""
    state = build_state(_settings())
    assert state.fleet is None and state.gate.counters().in_use == 0



def test_the_counters_show_as_the_gauges_of_the_same_names() -> None:
    gauges = {family.name for family in Metrics().registry.collect() if family.type == "gauge"}
    shown = GateCounters(1, 2, 3, 4, 5, 6, 7).gauges()
    assert set(shown) <= gauges
    assert shown["mmgate_gate_in_use"] == 1 and shown["mmgate_gate_limit"] == 7
