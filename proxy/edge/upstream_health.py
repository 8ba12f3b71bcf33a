"""What mmgate knows of the upstream's reachability: checked at start-up, re-checked while it is down.

The upstream is *known to be down* once a check (``routes.probe_upstream``, the same probe /mmgate/ready
runs) or a forwarded request could not connect to it; it is up again as soon as a check or a request gets
any answer from it. Only a failed connect counts: an upstream that answers, even 404 or 503 on its health
path, is reachable, and its requests are forwarded for it to answer. A connect that failed for want of mmgate's
own resources (``upstream.LOCAL_ERRNOS``: no descriptor, port or buffer left) does not count either.

A request whose forward cannot connect gets 503 ``upstream_down`` with ``Retry-After`` (RFC 9110 section
10.2.3), text and media alike: one down backend, one answer. While the upstream is known to be down, media
requests get that answer before any decoding (decoding a request whose forward cannot connect would spend the
pool for nothing); text requests are still tried (they cost nothing to try), and get the same answer when
their connect fails. The URL goes to the log only, never to a client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from yarl import URL

from preprocessors.errors import UPSTREAM_DOWN, UpstreamError

log = logging.getLogger("mmgate")

# Seconds between checks while the upstream is down; also the Retry-After of the refusal.
RECHECK_SECONDS = 1.0


def upstream_down(reason: str = "the upstream cannot be reached at the moment") -> UpstreamError:
    """503 for a request the upstream cannot take: a media request while it is known to be down (nothing was
    decoded), or any request whose connect failed; retry shortly."""
    return UPSTREAM_DOWN.error(f"{reason}; the request was not processed, retry shortly",
                               headers={"Retry-After": str(int(RECHECK_SECONDS))})


def loggable(url: str) -> str:
    """``url`` without user and password: the log names the upstream, never its credentials."""
    parsed = URL(url)
    return str(parsed.with_user(None)) if parsed.user or parsed.password else url


class UpstreamHealth:
    """Whether the upstream is known to be down, and the task that re-checks it until it answers."""

    def __init__(self, upstream: str, health_path: str) -> None:
        self.url = loggable(upstream)
        self.health_url = loggable(upstream + health_path)
        self.down = False
        self._went_down = asyncio.Event()

    def reached(self) -> None:
        """Something came back from the upstream (a check or a forwarded request)."""
        if self.down:
            self.down = False
            log.info("upstream %s answers again: media requests are served", self.url)

    def unreachable(self, reason: str) -> None:
        """A check or a forwarded request could not connect."""
        if not self.down:
            self.down = True
            log.warning("upstream %s cannot be reached (%s): media requests get 503 upstream_down until it answers "
                        "(checked every %g s at %s)", self.url, reason, RECHECK_SECONDS, self.health_url)
            self._went_down.set()

    async def watch(self, probe: Callable[[], Awaitable[tuple[bool, str]]]) -> None:
        """The start-up check, then a check every RECHECK_SECONDS while the upstream is down; runs until cancelled."""
        ok, detail = await probe()
        if ok:
            log.info("upstream %s answers (%s)", self.url, detail)
        elif not self.down:  # it answered, but not 2xx: forwarded to, though /mmgate/ready fails
            log.warning("upstream %s: %s at %s; /mmgate/ready fails until it answers 2xx (MMGATE_UPSTREAM_HEALTH_PATH)",
                        self.url, detail, self.health_url)
        while True:
            if not self.down:
                self._went_down.clear()
                await self._went_down.wait()
            await asyncio.sleep(RECHECK_SECONDS)
            try:
                await probe()
            except Exception:  # a fault of the check itself must not end the re-checks
                log.exception("upstream check of %s failed", self.health_url)
