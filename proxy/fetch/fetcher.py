"""Fetching media URLs in mmgate (``MMGATE_MEDIA_URLS=fetch``) without opening a way into private networks.

A fetched URL becomes bytes that go through the very job inline media goes through (``media.step``): the same
per-item byte cap, pixel cap, decode budget and deadline. What is particular to a URL is here:

- **Which hosts** (``policy.HostPolicy``): ``MMGATE_FETCH_ALLOW_HOSTS``, exact names and ``*.suffix`` patterns;
  empty allows any host whose addresses are public.
- **Which addresses** (``policy.AddressPolicy``): every address a name resolves to is checked, and the request is
  refused when any is loopback, private, link-local, CGNAT, multicast, unspecified, reserved or otherwise
  not globally routable, also when such an IPv4 address hides inside an IPv6 form (mapped, compatible,
  NAT64, 6to4). Only ``MMGATE_FETCH_ALLOW_ADDRESSES`` (CIDRs) lets such an address through.
- **Connect to what was checked** (``policy.CheckedResolver``): the name is resolved once, by the resolver the
  connector itself uses, and the connector connects to exactly the addresses that resolver returned, all
  checked; the hostname stays the ``Host`` header and the TLS server name. A second lookup that could
  answer differently (DNS rebinding) never happens. Address literals never reach a resolver, so each hop's
  literal is checked before the request is made.
- **Every hop again**: redirects are followed by hand, at most ``MMGATE_FETCH_MAX_REDIRECTS``, and each new
  URL passes the scheme, host and address checks anew (RFC 9110 section 15.4).
- **Bounded**: bytes are counted while they are read (``Content-Length`` only refuses early, it is never
  trusted as a bound); the time to the response head (``MMGATE_FETCH_FIRST_BYTE_TIMEOUT``) and the whole
  fetch, redirects included (``MMGATE_FETCH_TIMEOUT``), are bounded; only ``image/*`` for an image part
  and ``audio/*`` for an audio part are read, and only without a content coding.

Every refusal is a 400 whose code names the rule (``FETCH_CODES``): the URL is the client's, so a remote that
fails is the client's problem to fix, not an upstream error of mmgate's.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import aiohttp
from yarl import URL

from preprocessors.base import MediaKind
from preprocessors.errors import (
    FETCH_ADDRESS_FORBIDDEN,
    FETCH_BAD_CONTENT_TYPE,
    FETCH_FAILED,
    FETCH_HOST_NOT_ALLOWED,
    FETCH_TIMEOUT,
    FETCH_TOO_LARGE,
    FETCH_TOO_MANY_REDIRECTS,
    FETCH_URL_NOT_ALLOWED,
    REGISTRY,
    FetchRefused,
    MmgateError,
)
from proxy.fetch.policy import AddressForbidden, AddressPolicy, HostPolicy, literal_address
from proxy.payload.item import MediaItem

# Refusal codes, one per rule; with "ok" and "cancelled" the ``outcome`` label of mmgate_fetches_total.
FETCH_CODES = tuple(entry.code for entry in REGISTRY.values() if entry.raised_as is FetchRefused)
FETCH_OUTCOMES = ("ok", "cancelled", *FETCH_CODES)  # "cancelled": the request ended before the fetch did
REDIRECTS = frozenset({301, 302, 303, 307, 308})
_SCHEMES = ("http", "https")


@dataclass(frozen=True, slots=True)
class FetchLimits:
    """What one fetch is bounded by (from the settings)."""

    max_redirects: int
    total_timeout: float
    first_byte_timeout: float


@dataclass(slots=True)
class Fetched:
    """A fetched media body (a ``bytearray``: read into one buffer) and the type the remote declared
    (``type/subtype``, lowercase)."""

    data: bytes
    mime: str


# RFC 6838 section 4.2 restricted names, as ``locate`` checks declared types.
_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,126}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}")


class Fetcher:
    """The app's fetch client: its own session and connection pool, the policies and the limits.

    ``on_outcome(outcome, nbytes)`` is told how each fetch ended (``FETCH_OUTCOMES``) and how many body bytes
    it read (the metrics)."""

    def __init__(self, session: aiohttp.ClientSession, hosts: HostPolicy, addresses: AddressPolicy,
                 limits: FetchLimits, on_outcome: Callable[[str, int], None]) -> None:
        self.session = session
        self.hosts = hosts
        self.addresses = addresses
        self.limits = limits
        self._on_outcome = on_outcome

    async def fetch(self, url: str, kind: MediaKind, max_bytes: int, read: list[int] | None = None) -> Fetched:
        """The body at ``url`` (redirects followed and checked), at most ``max_bytes``; FetchRefused else.
        ``read[0]``, when given, grows by the body bytes read, a refused fetch's included."""
        counted = [0]
        try:
            fetched = await self._fetch(url, kind, max_bytes, counted)
        except FetchRefused as refused:
            self._on_outcome(refused.code, counted[0])
            raise
        except asyncio.CancelledError:  # the request ended first (client gone, deadline, a sibling refused)
            self._on_outcome("cancelled", counted[0])
            raise
        else:
            self._on_outcome("ok", counted[0])
        finally:
            if read is not None:
                read[0] += counted[0]
        return fetched

    async def _fetch(self, url: str, kind: MediaKind, max_bytes: int, counted: list[int]) -> Fetched:
        total = self.limits.total_timeout
        deadline = asyncio.timeout(total)
        try:
            async with deadline:
                target = self.checked_url(url)
                for _hop in range(self.limits.max_redirects + 1):
                    response = await self._head(target, kind)
                    try:
                        location = response.headers.get("Location")
                        if response.status in REDIRECTS and location is not None:
                            target = self.checked_url(location, base=response.url)
                            continue
                        return await self._body(response, kind, max_bytes, counted)
                    finally:
                        response.close()  # the rest (a redirect's body, a refused body) is never read
                raise FETCH_TOO_MANY_REDIRECTS.error(
                    f"the media URL redirects more than {self.limits.max_redirects} times "
                    "(MMGATE_FETCH_MAX_REDIRECTS)")
        except TimeoutError:
            if not deadline.expired():
                raise
            raise FETCH_TIMEOUT.error(f"fetching the media URL took longer than {total:g} s "
                                      "(MMGATE_FETCH_TIMEOUT)") from None

    def checked_url(self, raw: str, base: URL | None = None) -> URL:
        """``raw`` (resolved against ``base`` for a redirect) when its scheme, host and, for an address
        literal, address may be fetched; FetchRefused else. Names are checked when the connector resolves."""
        try:
            url = URL(raw)
            if base is not None:
                url = base.join(url)
            host = url.raw_host
        except (ValueError, TypeError):
            raise FETCH_URL_NOT_ALLOWED.error("the media URL cannot be parsed") from None
        if url.scheme not in _SCHEMES or not host:
            raise FETCH_URL_NOT_ALLOWED.error(f"only http and https media URLs are fetched, not {url.scheme[:16]!r}")
        if url.user is not None or url.password is not None:
            raise FETCH_URL_NOT_ALLOWED.error("a media URL must not carry credentials")
        if not self.hosts.allows(host):
            raise FETCH_HOST_NOT_ALLOWED.error(f"the host {host[:255]!r} is not in MMGATE_FETCH_ALLOW_HOSTS")
        address = literal_address(host)
        if address is not None:
            why = self.addresses.refusal(address)
            if why is not None:
                raise FETCH_ADDRESS_FORBIDDEN.error(
                    f"the media URL points at a {why} address; mmgate fetches only from public "
                    "addresses (MMGATE_FETCH_ALLOW_ADDRESSES)")
        return url.with_fragment(None)

    async def _head(self, url: URL, kind: MediaKind) -> aiohttp.ClientResponse:
        """Connect and read the response head within MMGATE_FETCH_FIRST_BYTE_TIMEOUT."""
        wait = self.limits.first_byte_timeout
        first_byte = asyncio.timeout(wait)
        headers = {"Accept": f"{kind}/*", "Accept-Encoding": "identity", "User-Agent": "mmgate"}
        try:
            async with first_byte:
                return await self.session.get(url, headers=headers, allow_redirects=False)
        except TimeoutError:
            if not first_byte.expired():
                raise
            raise FETCH_TIMEOUT.error(f"the media URL's server sent no response within {wait:g} s "
                                      "(MMGATE_FETCH_FIRST_BYTE_TIMEOUT)") from None
        except aiohttp.ClientConnectorError as error:
            if isinstance(error.os_error, AddressForbidden):
                raise FETCH_ADDRESS_FORBIDDEN.error(
                    f"the media URL's host resolves to a {error.os_error.why} address; mmgate "
                    "fetches only from public addresses (MMGATE_FETCH_ALLOW_ADDRESSES)") from None
            raise FETCH_FAILED.error(f"the media URL's server could not be reached ({_brief(error)})") \
                from None
        except (aiohttp.ClientError, ValueError) as error:
            raise FETCH_FAILED.error(f"fetching the media URL failed ({_brief(error)})") from None

    async def _body(self, response: aiohttp.ClientResponse, kind: MediaKind, max_bytes: int,
                    counted: list[int]) -> Fetched:
        if response.status not in (200, 203):
            raise FETCH_FAILED.error(f"the media URL answered HTTP {response.status}")
        declared = response.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if not _MEDIA_TYPE.fullmatch(declared) or not declared.startswith(kind + "/"):
            raise FETCH_BAD_CONTENT_TYPE.error(
                f"the media URL serves {declared[:64] or 'no Content-Type'!r}, not {kind}/*")
        coding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            raise FETCH_BAD_CONTENT_TYPE.error(
                f"the media URL serves Content-Encoding {coding[:32]!r}; only identity is read")
        too_large = FETCH_TOO_LARGE.error(f"the media URL's body is over the per-item limit of "
                                          f"{max_bytes} bytes (MMGATE_MAX_MEDIA_ITEM_MB)")
        length = response.content_length
        if length is not None and length > max_bytes:
            raise too_large
        # One growing buffer (glibc grows a big one in place, by mremap): a list joined at the end would hold
        # the body twice for a moment.
        data = bytearray()
        try:
            async for chunk in response.content.iter_any():
                counted[0] += len(chunk)
                if counted[0] > max_bytes:
                    raise too_large
                data += chunk
        except aiohttp.ClientError as error:
            raise FETCH_FAILED.error(f"the media URL's body broke off ({_brief(error)})") from None
        return Fetched(data, declared)


def _brief(error: BaseException) -> str:
    """An exception as a short phrase for a client (its type and first line, bounded)."""
    text = str(error).splitlines()[0][:160] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def fetch_items(fetcher: Fetcher, items: list[MediaItem], max_bytes: int,
                      read: list[int]) -> list[MediaItem]:
    """Fetch every one of the URL ``items`` at once: each item again, with its body in ``fetched``. ``read[0]``
    grows by the bytes read, a refused fetch's included (the request's access log line counts them whatever
    happens next). The first refusal cancels the other fetches and is raised, with its item's path."""
    tasks: list[asyncio.Task[Fetched]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks += [group.create_task(fetcher.fetch(item.url, item.kind, max_bytes, read)) for item in items]
    except BaseExceptionGroup as failed:
        for item, task in zip(items, tasks, strict=False):
            if task.done() and not task.cancelled():
                error = task.exception()
                if isinstance(error, MmgateError):
                    raise error.at(item.path) from None
        raise failed.exceptions[0] from None
    bodies = [task.result() for task in tasks]
    return [replace(item, fetched=body.data, fetched_mime=body.mime) for item, body in zip(items, bodies, strict=True)]
