"""Which hosts and addresses a fetched media URL may reach (``MMGATE_FETCH_ALLOW_HOSTS``,
``MMGATE_FETCH_ALLOW_ADDRESSES``), and the resolver that connects only to addresses it checked.

Every address a name resolves to is checked, and the request is refused when any is loopback, private,
link-local, CGNAT, multicast, unspecified, reserved or otherwise not globally routable, also when such an IPv4
address hides inside an IPv6 form (mapped, compatible, NAT64, 6to4). ``CheckedResolver`` is the resolver the
connector itself uses, so the connector connects to exactly the addresses it checked: a second lookup that
could answer differently (DNS rebinding) never happens.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # RFC 4291 section 2.5.5.1 (deprecated)


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 well-known prefix


# The IANA special-purpose registries (RFC 6890 and successors) by class, spelt out rather than left to
# ``ipaddress``'s predicates, whose tables change between Python patch releases; the predicates still run
# after this table as a second net.
_FORBIDDEN: tuple[tuple[str, tuple[IPNetwork, ...]], ...] = tuple(
    (why, tuple(ipaddress.ip_network(n) for n in networks)) for why, networks in (
        ("link-local", ("169.254.0.0/16", "fe80::/10")),
        ("private", ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")),
        ("shared (CGNAT)", ("100.64.0.0/10",)),
        ("multicast", ("224.0.0.0/4", "ff00::/8")),
        ("site-local", ("fec0::/10",)),
        ("reserved", ("0.0.0.0/8", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "198.18.0.0/15",
                      "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4", "::/8", "64:ff9b:1::/48", "100::/64",
                      "2001::/23", "2001:db8::/32", "3fff::/20", "5f00::/16")),
    ))


class AddressForbidden(OSError):
    """Raised by ``CheckedResolver``: an OSError, so aiohttp passes it on (inside ``ClientConnectorError``)
    without connecting anywhere."""

    def __init__(self, host: str, address: str, why: str) -> None:
        super().__init__(f"{host} resolves to {address}, a {why} address")
        self.address = address
        self.why = why


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address stands for: mapped (RFC 4291), compatible, NAT64 (RFC 6052),
    6to4 (RFC 3056)."""
    found = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address in _V4_COMPATIBLE or address in _NAT64:
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    return found


def forbidden_class(address: IPAddress) -> str | None:
    """Why ``address`` must not be fetched from ("loopback", "private", ...), None for a public unicast one.

    An IPv6 form that carries an IPv4 address is forbidden when that address is. NAT64 and 6to4 addresses are
    judged by the IPv4 address alone (an IPv6-only network reaches public IPv4 hosts through them); mapped and
    compatible forms are refused in any case, as nothing public resolves to them."""
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if isinstance(address, ipaddress.IPv6Address):
        for inner in embedded_ipv4(address):
            why = forbidden_class(inner)
            if why is not None:
                return f"{why} (as IPv6 {address.compressed})"
        if address in _NAT64 or address.sixtofour is not None:
            return None
    for why, networks in _FORBIDDEN:
        if any(address in network for network in networks):
            return why
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.is_private:
        return "private"
    if address.is_reserved:
        return "reserved"
    if not address.is_global:
        return "non-global"
    return None


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """Which resolved addresses may be connected to: public ones, and those in ``allowed`` (an opt-in)."""

    allowed: tuple[IPNetwork, ...] = ()

    @classmethod
    def from_cidrs(cls, cidrs: Iterable[str]) -> AddressPolicy:
        return cls(tuple(ipaddress.ip_network(c, strict=False) for c in cidrs))

    def refusal(self, address: IPAddress) -> str | None:
        """Why ``address`` is refused, None when it may be connected to."""
        if any(address.version == net.version and address in net for net in self.allowed):
            return None
        return forbidden_class(address)


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """``MMGATE_FETCH_ALLOW_HOSTS``: exact names and ``*.suffix`` patterns (a suffix matches its subdomains,
    not itself); no pattern at all allows every host. Names compare in IDNA (ASCII) form, lowercase."""

    exact: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()

    @classmethod
    def from_patterns(cls, patterns: Iterable[str]) -> HostPolicy:
        exact, suffixes = set(), []
        for pattern in patterns:
            if pattern.startswith("*."):
                suffixes.append("." + normal_host(pattern[2:]))
            else:
                exact.add(normal_host(pattern))
        return cls(frozenset(exact), tuple(suffixes))

    def allows(self, host: str) -> bool:
        if not self.exact and not self.suffixes:
            return True
        host = normal_host(host)
        return host in self.exact or host.endswith(self.suffixes)


def normal_host(host: str) -> str:
    """Lowercase ASCII form of a host name (IDNA for non-ASCII), no trailing dot, no IPv6 brackets."""
    host = host.strip().rstrip(".").strip("[]").lower()
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:  # no valid IDNA name: left as it is, it matches no (ASCII) pattern
            pass
    return host


def literal_address(host: str) -> IPAddress | None:
    """The address when ``host`` is an IP literal, else None (a name, to be resolved). The legacy IPv4 forms
    ``inet_aton(3)`` reads (``127.1``, ``0x7f.0.0.1``, ``2130706433``) count as the address they name: the
    system resolver would read them so."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


class CheckedResolver(AbstractResolver):
    """Resolves through ``inner`` (the system resolver in a thread) and returns the addresses only when every
    one passes ``policy``: the connector connects to one of exactly these, with no lookup of its own."""

    def __init__(self, policy: AddressPolicy, inner: AbstractResolver | None = None) -> None:
        self._policy = policy
        self._inner = inner if inner is not None else aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        for result in results:
            why = self._policy.refusal(ipaddress.ip_address(result["host"]))
            if why is not None:
                raise AddressForbidden(host, result["host"], why)
        return results

    async def close(self) -> None:
        await self._inner.close()
