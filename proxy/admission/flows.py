"""Who a media request waits for: its ``Flow``, a flow id from ``MMGATE_FAIRNESS_HEADER`` and a priority band from
``MMGATE_PRIORITY_HEADER`` (the gate serves flows in turn within a band, and bands strictly).

Both headers are a client's claim about itself: whoever may send them can jump the line or mint flows, so they
are read only from a peer in ``MMGATE_TRUST_FLOW_HEADERS_FROM`` (the gateway in front), judged by the TCP peer
address, never by ``X-Forwarded-For``, which the client writes. From any other peer they are not read at all: no
band, and the flow is the client's own address, so a client gets one flow's places in line however many ids it
sends.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from preprocessors.errors import INVALID_FLOW_HEADER, INVALID_PRIORITY_HEADER

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# An IPv6 client is one /64: a host is routinely handed a whole /64 and may pick any address in it.
IPV6_CLIENT_PREFIX = 64


@dataclass(frozen=True, slots=True)
class Flow:
    """Who a media request waits for: a flow id from a trusted fairness header, or else the client (its address,
    ``""`` when unknown), and a priority band. ``Flow()`` is the default flow: nothing known."""

    id: str = ""
    band: int = 0
    client: str = ""

    @property
    def key(self) -> tuple[str, str]:
        """What the gate's per-flow queues and counts are keyed by: an id never stands for a client's address."""
        return self.id, self.client

    def named(self) -> str:
        if self.id:
            return f"flow {self.id!r}"
        return f"the flow of client {self.client}" if self.client else "the default flow"


DEFAULT_FLOW = Flow()


MAX_FLOW_ID_CHARS = 128  # a longer id is refused: ids are echoed in refusals and kept while a flow waits


def _address(peer: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """A TCP peer's address, an IPv4-mapped IPv6 one as IPv4 (a dual-stack listener reports those); None for
    none (a Unix socket)."""
    try:
        address = ipaddress.ip_address((peer or "").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def client_of(address: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> str:
    """The client an address stands for: an IPv4 address itself, an IPv6 address its /64; ``""`` for none."""
    if address is None:
        return ""
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


@dataclass(frozen=True)
class FlowRules:
    """How a request's flow is found: the fairness headers (the first one present names the flow), the priority
    header, the bands a priority is clamped to, and the peers whose headers are read."""

    fairness_headers: tuple[str, ...]
    priority_header: str
    bands: tuple[int, int]
    trusted: tuple[Network, ...] = ()

    @classmethod
    def of(cls, fairness_headers: tuple[str, ...], priority_header: str, bands: tuple[int, int],
           trusted: tuple[str, ...]) -> FlowRules:
        return cls(fairness_headers, priority_header, bands, tuple(ipaddress.ip_network(n) for n in trusted))

    def trusts(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> bool:
        return address is not None and any(address in network for network in self.trusted)


def flow_for(headers: Mapping[str, str], peer: str | None, rules: FlowRules) -> Flow:
    """The flow of a request from TCP peer ``peer``. From a trusted peer: the first fairness header present names
    the flow (none: the peer's own flow), the priority is an integer (RFC 9110 section 5.5 field value) clamped
    to ``rules.bands``, and anything else is 400. From any other peer the headers are not read: the client's
    own flow in band 0."""
    address = _address(peer)
    if not rules.trusts(address):
        return Flow(client=client_of(address))
    name, flow_id = next(((name, value) for name in rules.fairness_headers
                          if (value := headers.get(name, "").strip())), ("", ""))
    if len(flow_id) > MAX_FLOW_ID_CHARS or not flow_id.isprintable():
        raise INVALID_FLOW_HEADER.error(f"{name} must be at most {MAX_FLOW_ID_CHARS} printable characters")
    band = 0
    raw = headers.get(rules.priority_header)
    if raw is not None:
        try:
            band = int(raw.strip())
        except ValueError:
            raise INVALID_PRIORITY_HEADER.error(
                f"{rules.priority_header} must be an integer, got {raw[:32]!r}") from None
        band = max(rules.bands[0], min(rules.bands[1], band))
    return Flow(flow_id, band) if flow_id else Flow(band=band, client=client_of(address))
