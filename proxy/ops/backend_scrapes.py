"""The backend's /metrics as mmgate last read it, shared by every scrape of mmgate for a short interval.

Each ``GET /metrics`` (merge modes) and ``GET /mmgate/backend/metrics`` needs the backend's exposition; many
scrapers at once (several endpoint pickers, Prometheus replicas, anyone on a public port) would each cost the
backend a full exposition. A complete scrape is reused for ``SCRAPE_REUSE_SECONDS``, and while none is fresh
every caller awaits the one fetch in flight. What is made of a scrape (the merged exposition) is made once per
scrape too (``derived``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar, cast

SCRAPE_REUSE_SECONDS = 1.0  # a scrape of the backend answers every scrape of mmgate within this interval


@dataclass(frozen=True, slots=True)
class Scrape:
    """The backend's /metrics, read to its end."""

    status: int
    body: bytes
    content_type: str


@dataclass(frozen=True, slots=True)
class ScrapeFailed:
    """Why the backend's /metrics could not be read whole: the status mmgate answers (502, 504) and a reason."""

    status: int
    reason: str


Scraped = Scrape | ScrapeFailed
Derived = TypeVar("Derived")


class BackendScrapes:
    """The last complete scrape of the backend, reused for ``reuse_seconds`` of ``clock``; while none is fresh,
    every caller awaits the one fetch in flight. A failed fetch is not kept: the next scrape tries again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 reuse_seconds: float = SCRAPE_REUSE_SECONDS) -> None:
        self.clock = clock
        self.reuse_seconds = reuse_seconds
        self._kept: tuple[float, Scrape] | None = None
        self._in_flight: asyncio.Future[Scraped] | None = None
        self._derived: tuple[Scrape, object] | None = None  # what ``derived`` made of the latest scrape

    def derived(self, scrape: Scrape, make: Callable[[Scrape], Derived]) -> Derived:
        """``make(scrape)``, made once per scrape: every caller given the same ``scrape`` gets the first one's.
        One user (``make`` the same function each time): only what was made of the latest scrape is kept."""
        if self._derived is None or self._derived[0] is not scrape:
            self._derived = (scrape, make(scrape))
        return cast(Derived, self._derived[1])

    async def get(self, fetch: Callable[[], Awaitable[Scraped]]) -> Scraped:
        kept = self._kept
        if kept is not None and self.clock() - kept[0] < self.reuse_seconds:
            return kept[1]
        if self._in_flight is None:
            self._in_flight = asyncio.ensure_future(self._fetched(fetch))
        # shielded: a scraper that hangs up does not cancel the fetch the others are waiting for
        return await asyncio.shield(self._in_flight)

    async def _fetched(self, fetch: Callable[[], Awaitable[Scraped]]) -> Scraped:
        try:
            scraped = await fetch()
        finally:
            self._in_flight = None
        if isinstance(scraped, Scrape):
            self._kept = (self.clock(), scraped)
        return scraped
