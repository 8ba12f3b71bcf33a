"""The signals that stop a process of mmgate: SIGTERM and SIGINT, and Ctrl-C again (``server.drain`` says what
each sets off)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any

FORCED_EXIT_STATUS = 128 + signal.SIGINT  # a second Ctrl-C: the status a shell gives a process SIGINT ended


class StopSignals:
    """SIGTERM and SIGINT caught on the running loop. ``stopped`` is set by the first one; ``first`` says which,
    since it decides how to drain (SIGINT skips the grace when nothing is in flight). ``forced`` is set by a
    SIGINT after the first signal: a person pressing Ctrl-C again wants out now, not after the drain. Install
    it before anything slow starts, so a signal that arrives meanwhile is not a ``KeyboardInterrupt``."""

    CAUGHT = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.stopped = asyncio.Event()
        self.forced = asyncio.Event()
        self._received: list[signal.Signals] = []

    def __call__(self, signum: signal.Signals) -> None:
        if self._received and signum == signal.SIGINT:
            self.forced.set()
        self._received.append(signum)
        self.stopped.set()

    @property
    def first(self) -> signal.Signals:
        return self._received[0] if self._received else signal.SIGTERM

    async def unless_forced(self, work: Coroutine[Any, Any, None]) -> bool:
        """Run ``work`` to its end (True), or until ``forced`` is set (``work`` is cancelled: False)."""
        task = asyncio.ensure_future(work)
        forced = asyncio.ensure_future(self.forced.wait())
        try:
            await asyncio.wait((task, forced), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            forced.cancel()
        if not task.done():
            task.cancel()
            return False
        task.result()  # its exception, if it failed
        return True

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in self.CAUGHT:
            loop.add_signal_handler(signum, self, signum)

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in self.CAUGHT:
            loop.remove_signal_handler(signum)
