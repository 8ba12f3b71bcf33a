"""MMGATE_MAX_MM_CONCURRENCY=auto: the gradient controller on its own (fed a thrashing backend's latencies),
its bounds under any latencies, the Gate following it, and the proxy exporting it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from proxy.admission.adaptive import MIN_WINDOW, AdaptiveLimit
from proxy.admission.gate import Gate
from proxy.settings import ConfigError, Settings
from testkit.media import chat_with_image, data_uri, eventually, image_bytes
from tests.conftest import StartProxy, Upstream


def thrashing_latency(concurrency: int, knee: int = 4) -> float:
    """Service time flat up to the knee, then growing with the square of the concurrency."""
    return max(1.0, (concurrency / knee) ** 2)


def _windows(limit: AdaptiveLimit, latency: float, windows: int, busy: bool = True) -> None:
    for _ in range(windows):
        for _ in range(max(MIN_WINDOW, limit.limit)):
            if busy:
                limit.busy(limit.limit)
            limit.observe(latency, limit.epoch)


def test_slow_start_doubles_then_halves_at_the_first_overload() -> None:
    limit = AdaptiveLimit(1, 64)
    seen = []
    while limit.slow_start:
        _windows(limit, thrashing_latency(limit.limit), 1)
        seen.append(limit.limit)
    assert seen == [2, 4, 8, 4]


def test_flat_latency_under_load_grows_to_the_ceiling() -> None:
    limit = AdaptiveLimit(1, 16)
    _windows(limit, 0.5, 60)
    assert limit.limit == 16


def test_no_growth_while_demand_stays_under_the_limit() -> None:
    limit = AdaptiveLimit(2, 16)
    _windows(limit, 0.5, 30, busy=False)
    assert limit.limit == 2


def test_rising_latency_shrinks_the_limit_but_never_below_the_floor() -> None:
    limit = AdaptiveLimit(3, 64, initial=40)
    _windows(limit, 1.0, 2)  # the baseline
    _windows(limit, 10.0, 8)
    assert limit.limit == 3


def test_a_lasting_change_of_latency_becomes_the_new_baseline() -> None:
    limit = AdaptiveLimit(1, 16, initial=8)
    _windows(limit, 1.0, 3)
    _windows(limit, 10.0, 60)  # bigger images from now on: after BASELINE_WINDOWS the limit grows again
    assert limit.limit == 16


def test_a_thrashing_backend_holds_the_limit_at_its_knee() -> None:
    limit = AdaptiveLimit(1, 64)
    seen = []
    for _ in range(200):
        _windows(limit, thrashing_latency(limit.limit), 1)
        seen.append(limit.limit)
    settled = seen[100:]
    assert set(settled) <= {4, 5} and settled.count(4) > settled.count(5)


def test_samples_from_before_a_change_are_not_counted_again() -> None:
    limit = AdaptiveLimit(1, 64, initial=8)
    limit.slow_start = False
    _windows(limit, 1.0, 1)
    epoch = limit.epoch
    _windows(limit, 4.0, 1)  # overload: the limit drops, the epoch moves on
    assert limit.limit < 8 and limit.epoch == epoch + 1
    after = limit.limit
    for _ in range(50):  # the requests still running from before the drop finish slowly
        assert not limit.observe(4.0, epoch)
    assert limit.limit == after


@given(st.lists(st.tuples(st.floats(0.0001, 1000.0), st.booleans()), max_size=300),
       st.integers(1, 8), st.integers(8, 64))
def test_the_limit_stays_within_its_bounds(samples: list[tuple[float, bool]], floor: int, ceiling: int) -> None:
    limit = AdaptiveLimit(floor, ceiling)
    for seconds, busy in samples:
        if busy:
            limit.busy(limit.limit)
        limit.observe(seconds, limit.epoch)
        assert floor <= limit.limit <= ceiling


async def test_the_gate_admits_more_as_the_limit_grows() -> None:
    gate = Gate(0, byte_budget=0, max_queue=100, adaptive=AdaptiveLimit(1, 8))
    assert gate.limit == 1
    for _ in range(60):  # requests one at a time, each reaching the backend
        lease = await gate.acquire(0, 5)
        lease.handed_off()
        # Each spent 100 ms at the backend (dated back, not slept): a steady latency the machine's own jitter
        # cannot turn into a sign of overload, as it can a latency of a few microseconds.
        lease.granted_at -= 0.1
        lease.release()
    assert gate.limit > 1
    leases = [await gate.acquire(0, 5) for _ in range(gate.limit)]  # all admitted at once, none queued
    assert gate.in_use == len(leases) and gate.waiting == 0
    for lease in leases:
        lease.release()


async def test_leases_that_never_reached_the_backend_teach_nothing() -> None:
    adaptive = AdaptiveLimit(1, 8)
    gate = Gate(0, byte_budget=0, max_queue=100, adaptive=adaptive)
    for _ in range(60):  # refused media, client gone: released before forwarding
        (await gate.acquire(0, 5)).release()
    assert gate.limit == 1 and adaptive.value == 1.0


def test_settings_accept_auto_and_its_range() -> None:
    settings = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9", "MMGATE_MAX_MM_CONCURRENCY": "auto",
                                  "MMGATE_MIN_MM_CONCURRENCY": "2", "MMGATE_MAX_MM_CONCURRENCY_AUTO": "12"})
    assert settings.gate.adaptive_concurrency and settings.gate.mm_concurrency_ceiling == 12
    assert "MMGATE_MAX_MM_CONCURRENCY=auto" in settings.describe()
    with pytest.raises(ConfigError, match="MMGATE_MAX_MM_CONCURRENCY='sometimes'"):
        Settings.from_env({"MMGATE_MAX_MM_CONCURRENCY": "sometimes"})
    with pytest.raises(ConfigError, match="MMGATE_MIN_MM_CONCURRENCY is above"):
        Settings.from_env({"MMGATE_MAX_MM_CONCURRENCY": "auto", "MMGATE_MIN_MM_CONCURRENCY": "9",
                           "MMGATE_MAX_MM_CONCURRENCY_AUTO": "8"})


async def test_auto_limit_is_exported_and_holds_the_slot_through_the_answer(upstream: Upstream,
                                                                            start_proxy: StartProxy) -> None:
    async def held(request: web.Request) -> web.Response:
        await upstream.release.wait()
        return web.json_response({"ok": True})

    upstream.route("/v1/chat/completions", held)
    proxy = await start_proxy(upstream.url, MMGATE_MAX_MM_CONCURRENCY="auto", MMGATE_MIN_MM_CONCURRENCY="2",
                              MMGATE_MAX_MM_CONCURRENCY_AUTO="6")
    body = chat_with_image(data_uri(image_bytes()))
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/mmgate/metrics") as response:
            assert "mmgate_gate_limit 2.0" in await response.text()
        posts = [asyncio.create_task(session.post(proxy.url + "/v1/chat/completions", json=body)) for _ in range(3)]
        for _ in range(2):
            await upstream.arrived.get()
        # non-streaming, yet the slots stay held while the backend works: the latency it learns from
        counters = proxy.state.gate.counters
        await eventually(lambda: (counters().in_use, counters().waiting) == (2, 1), "two held, one waiting")
        upstream.release.set()
        for post in posts:
            async with await post as response:
                assert response.status == 200
        async with session.get(proxy.url + "/mmgate/stats") as response:
            stats = await response.json()
    assert stats["gate"]["adaptive"] is True and stats["limits"]["max_mm_concurrency"] == "auto"
    assert 2 <= stats["gate"]["limit"] <= 6
