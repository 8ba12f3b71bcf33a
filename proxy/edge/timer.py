"""A one-shot timer of the running event loop, for the deadlines and ticks that come and go: a connection's
head deadline, its write deadline, the pacer's tick, the idle trim."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Timer:
    """Calls ``fire`` once when it runs out, unless stopped first; it may be started again after either.
    Starting a timer that runs already changes nothing: it keeps the time it was started with."""

    __slots__ = ("_fire", "_handle")

    def __init__(self, fire: Callable[[], None]) -> None:
        self._fire = fire
        self._handle: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        """Started, and neither run out nor stopped since."""
        return self._handle is not None

    def start(self, seconds: float) -> None:
        """Run out ``seconds`` from now."""
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(seconds, self._run_out)

    def start_at(self, when: float) -> None:
        """Run out at ``when``, a time of the running event loop's clock (its ``time()``)."""
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_at(when, self._run_out)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _run_out(self) -> None:
        self._handle = None
        self._fire()
