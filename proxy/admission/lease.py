"""A request's admission: the slot, bytes and image tokens the gate (``gate.Gate``) granted it, until it gives
them back. The lease knows its gate only by what it asks of it (``Holder``), so the two modules do not import
each other; a front process's lease (``processes.remote_gate``) asks the same of the supervisor's gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from proxy.admission.adaptive import AdaptiveLimit


class Holder(Protocol):
    """What a lease needs of the gate that granted it."""

    preparing: int  # leases granted and not yet handed to the backend
    adaptive: AdaptiveLimit | None  # with MMGATE_MAX_MM_CONCURRENCY=auto: told when a request reaches the backend

    def _give_back(self, lease: Lease) -> None: ...

    def _lower(self, lease: Lease, cost: int) -> None: ...


@dataclass(eq=False)
class Lease:
    """One admitted request's slot, bytes and image tokens. ``release()`` gives them back; calling it again does
    nothing."""

    gate: Holder
    cost: int
    tokens: int = 0
    granted_at: float = 0.0  # the gate's clock
    released: bool = False
    deferred: bool = False  # the release waits for work that has not stopped yet
    phase: int = 0  # the adaptive limit's phase at admission: its sample judges that phase only
    held_since: float = 0.0  # the adaptive limit's clock at admission
    forwarded: bool = False  # the request went on to the backend: no longer waiting in mmgate
    at_backend_since: float = 0.0  # the adaptive limit's clock at the hand-off

    def handed_off(self) -> None:
        """The request is on its way to the backend: from here on it no longer counts as waiting in mmgate
        (``Gate.preparing``, what ``MMGATE_BACKEND_METRICS=merge`` adds to the backend's queue)."""
        if not self.forwarded:
            self.forwarded = True
            if not self.released:
                self.gate.preparing -= 1
                if self.gate.adaptive is not None:
                    self.at_backend_since = self.gate.adaptive.started(self.phase)

    def release(self) -> None:
        if not self.released and not self.deferred:
            self._give_back()

    def lower(self, cost: int) -> None:
        """Weigh ``cost`` bytes from now on, when that is less than the lease holds: what turned out not to need
        decoding (a cache hit known only once its bytes were fetched) gives its share of the budget back."""
        if not self.released and 0 <= cost < self.cost:
            self.gate._lower(self, cost)

    def release_after(self, work: Awaitable[object]) -> None:
        """Keep the slot until ``work`` (a decode batch) has really stopped, whatever calls ``release()``
        meanwhile: the answer may go out at once, but the slot stands for work still running."""
        if self.released or self.deferred:
            return
        self.deferred = True
        task = asyncio.ensure_future(work)
        task.add_done_callback(lambda _task: self._give_back())

    def _give_back(self) -> None:
        if not self.released:
            self.released = True
            self.gate._give_back(self)
