"""Where the process is in its life: serving, in the grace after SIGTERM, or draining.

One state instead of flags kept in step: readiness fails from the grace on (the load balancer is told to
stop sending), new requests and new media admissions are refused only once the drain proper starts (the
requests already accepted keep their place). ``server.drain`` moves it forward; nothing moves it back.
"""

from __future__ import annotations

import asyncio
import signal
from enum import Enum


class Phase(Enum):
    SERVING = "serving"
    GRACE = "grace"  # SIGTERM received: readiness fails, requests are still served
    DRAINING = "draining"  # new requests get 503 draining; those in flight may finish


class Lifecycle:
    """The app's phase, shared by the handlers, the admin routes and the gate."""

    def __init__(self) -> None:
        self.phase = Phase.SERVING

    @property
    def ready(self) -> bool:
        """Whether readiness may pass (the upstream is asked only then)."""
        return self.phase is Phase.SERVING

    @property
    def refusing(self) -> bool:
        """Whether new requests and new admissions are refused."""
        return self.phase is Phase.DRAINING

    def start_grace(self) -> None:
        if self.phase is Phase.SERVING:
            self.phase = Phase.GRACE

    def start_draining(self) -> None:
        self.phase = Phase.DRAINING


class StopSignals:
    """SIGTERM and SIGINT caught on the running loop. ``stopped`` is set by the first one; ``first`` says which,
    since it decides how to drain (SIGINT skips the grace when nothing is in flight). Install it before
    anything slow starts, so a signal that arrives meanwhile is not a ``KeyboardInterrupt``."""

    CAUGHT = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.stopped = asyncio.Event()
        self._received: list[signal.Signals] = []

    def __call__(self, signum: signal.Signals) -> None:
        self._received.append(signum)
        self.stopped.set()

    @property
    def first(self) -> signal.Signals:
        return self._received[0] if self._received else signal.SIGTERM

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in self.CAUGHT:
            loop.add_signal_handler(signum, self, signum)

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in self.CAUGHT:
            loop.remove_signal_handler(signum)
