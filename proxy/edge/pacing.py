"""Pacing the reading of big request bodies by the event loop's lag (MMGATE_LOOP_LAG_TARGET).

One event loop moves every byte of every body. When big uploads arrive faster than it can move them (cache
hits: no decode to wait for, only bytes), each pass of the loop reads a piece of every upload, and a small
request or a liveness probe waits behind all of them. The pacer keeps the loop's lag near a target by
holding the reading of big uploads, not by refusing them:

* an upload (a body over ``body.HEAD_BYTES`` still arriving when its handler starts reading it) registers
  its connection, a ``Valve``, for as long as its body is read;
* while any upload is registered, a timer fires every ``TICK`` seconds; how late it fires is the loop's lag;
* over the target, the number of uploads allowed to read at once is halved (at least one always reads, so
  media never stops); at or under it, one more is allowed per tick. Uploads read in the order they started,
  so the oldest finish first; one that delivered nothing during the last tick (a slow or stalled client)
  costs the loop nothing and takes no share, so it cannot hold the others back;
* a held upload's connection stops reading (asyncio's ``transport.pause_reading``): its bytes wait in the
  kernel's socket buffer, and TCP's receive window pushes back on the client (RFC 9293 section 3.8.6).
  Nothing is lost or refused; the body-read deadline (MMGATE_BODY_READ_TIMEOUT) still runs.

Small requests and probes are never held, so the loop's passes stay short for them. The pacer costs a timer
every ``TICK`` only while an upload is being read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from proxy.edge.timer import Timer

TICK = 0.005  # seconds between two looks at the lag while uploads are read


class Valve(Protocol):
    """A connection whose reading the pacer may hold (``connections.GuardedConnection``)."""

    def hold_reading(self) -> None: ...

    def release_reading(self) -> None: ...

    def take_bytes_read(self) -> int:
        """Bytes received since the last call."""
        ...


class _Upload:
    __slots__ = ("held", "valve")

    def __init__(self, valve: Valve) -> None:
        self.valve = valve
        self.held = False


class Pacer:
    """The uploads being read, and how many of them may read at once."""

    def __init__(self, target: float, on_hold: Callable[[], None] = lambda: None,
                 measure: Callable[[float], float] = lambda lateness: lateness) -> None:
        self.target = target  # seconds of lag; 0: never hold
        self.on_hold = on_hold
        # What the pacer takes for the loop's lag, given how late its timer fired (the identity: the lag).
        self.measure = measure
        self.allowed = 1 << 30  # uploads that may read at once; halved on lag, grows back by one a tick
        self._uploads: dict[Valve, _Upload] = {}  # in the order they started
        self._tick_timer = Timer(self._tick)
        self._due = 0.0

    @property
    def held(self) -> int:
        """Uploads whose reading is held now."""
        return sum(upload.held for upload in self._uploads.values())

    @property
    def reading(self) -> int:
        """Uploads being read now, held or not."""
        return len(self._uploads)

    @contextmanager
    def upload(self, valve: Valve | None) -> Iterator[None]:
        """Pace ``valve`` while the body is read (None, or a target of 0: nothing to pace)."""
        if valve is None or not self.target or valve in self._uploads:
            yield
            return
        upload = self._uploads[valve] = _Upload(valve)
        valve.take_bytes_read()
        if len(self._uploads) - self.held > self.allowed:
            self._hold(upload)
        if not self._tick_timer.running:
            self._arm()
        try:
            yield
        finally:
            del self._uploads[valve]
            if upload.held:
                upload.held = False
                valve.release_reading()
            if not self._uploads:
                self._tick_timer.stop()
                self.allowed = 1 << 30

    def _arm(self) -> None:
        self._due = asyncio.get_running_loop().time() + TICK
        self._tick_timer.start_at(self._due)

    def _tick(self) -> None:
        lag = self.measure(max(0.0, asyncio.get_running_loop().time() - self._due))
        busy = sum(not upload.held for upload in self._uploads.values())
        if lag > self.target:
            self.allowed = max(1, min(self.allowed, busy) // 2)
        elif self.allowed < len(self._uploads):
            self.allowed += 1
        self.steer()
        if self._uploads:
            self._arm()

    def steer(self) -> None:
        """Let the oldest ``allowed`` uploads with something to read flow, hold the rest. An upload that read
        nothing since the last look is idle: it flows, but takes no share."""
        shares = self.allowed
        for upload in self._uploads.values():
            if upload.held:
                if shares > 0:
                    shares -= 1
                    upload.held = False
                    upload.valve.release_reading()
                continue
            if not upload.valve.take_bytes_read():
                continue
            if shares > 0:
                shares -= 1
            else:
                self._hold(upload)

    def _hold(self, upload: _Upload) -> None:
        upload.held = True
        upload.valve.hold_reading()
        self.on_hold()
