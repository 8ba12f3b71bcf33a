"""The one-shot timer: it fires once when it runs out, never once stopped, and a second start while it runs
leaves its time alone. Each test awaits a fire (a later timer of the same loop witnesses what did not fire)."""

from __future__ import annotations

import asyncio

from proxy.edge.timer import Timer

HANG_BOUND = 60.0  # seconds: a bound on a hang, not a measure of speed


class Fired:
    """A ``fire`` callback that counts its calls and can be awaited."""

    def __init__(self) -> None:
        self.count = 0
        self.event = asyncio.Event()

    def __call__(self) -> None:
        self.count += 1
        self.event.set()

    async def wait(self) -> None:
        await asyncio.wait_for(self.event.wait(), HANG_BOUND)
        self.event.clear()


async def witness() -> None:
    """Returns once a timer started now has run out: every timer due before it has fired."""
    seen = Fired()
    Timer(seen).start(0)
    await seen.wait()


async def test_a_timer_fires_once_when_it_runs_out() -> None:
    fired = Fired()
    timer = Timer(fired)
    timer.start(0)
    assert timer.running
    await fired.wait()
    assert not timer.running
    await witness()
    assert fired.count == 1


async def test_a_stopped_timer_never_fires() -> None:
    fired = Fired()
    timer = Timer(fired)
    timer.start(0)
    timer.stop()
    assert not timer.running
    await witness()
    assert fired.count == 0
    timer.stop()  # stopping a timer that does not run is nothing


async def test_a_second_start_keeps_the_time_of_the_first() -> None:
    fired = Fired()
    timer = Timer(fired)
    timer.start(HANG_BOUND * 10)
    timer.start(0)
    await witness()
    assert fired.count == 0 and timer.running
    timer.stop()


async def test_a_timer_starts_again_after_it_fired_and_at_a_time_of_the_loop() -> None:
    fired = Fired()
    timer = Timer(fired)
    timer.start(0)
    await fired.wait()
    timer.start_at(asyncio.get_running_loop().time())
    await fired.wait()
    assert fired.count == 2 and not timer.running
