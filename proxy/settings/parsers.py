"""Parsers of raw setting text: each returns the value or raises ``ValueError("what is allowed")``."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable
from typing import Any, get_args
from urllib.parse import urlsplit, urlunsplit

MAX_PROCESSES = 64


def integer(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise ValueError(f"an integer {'>= ' + str(lo) if hi is None else f'from {lo} to {hi}'}")
        return value

    return parse


def seconds(allow_zero: bool) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not (value > 0 or (allow_zero and value == 0)) or value == float("inf"):
            raise ValueError("a number of seconds " + (">= 0 (0 = off)" if allow_zero else "> 0"))
        return value

    return parse


class Choice:
    """A parser for the values of the ``Literal`` type it is given; ``values`` lists them, in its order."""

    def __init__(self, choices: Any) -> None:
        self.values: tuple[str, ...] = get_args(choices)

    def __call__(self, raw: str) -> str:
        value = raw.strip().lower()
        if value not in self.values:
            raise ValueError("one of " + ", ".join(self.values))
        return value


class OnOff:
    """A switch: on or off (also 1/0, true/false, yes/no); ``values`` are the two words help shows."""

    values = ("on", "off")

    def __call__(self, raw: str) -> bool:
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError("on or off")


on_off = OnOff()


def base_url(raw: str) -> str:
    """An http(s) URL of the backend itself, without the API's ``/v1``: clients send ``/v1/...`` paths and
    mmgate forwards each path as it comes, so a ``/v1`` here would make every path ``/v1/v1/...``."""
    parts = urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError("an http(s) base URL such as http://127.0.0.1:8000")
    prefix = parts.path.rstrip("/")
    if prefix.lower().endswith("/v1"):
        corrected = urlunsplit((parts.scheme, parts.netloc, prefix[:-3], "", ""))
        raise ValueError(f"the backend's base URL without /v1 (clients send /v1/... paths and mmgate forwards "
                         f"them as they come): {corrected}")
    return raw.strip().rstrip("/")


def path(raw: str) -> str:
    if not raw.startswith("/"):
        raise ValueError("a path starting with /")
    return raw


def path_prefixes(raw: str) -> tuple[str, ...]:
    items = tuple(p.strip() for p in raw.split(",") if p.strip())
    if any(not p.startswith("/") for p in items):
        raise ValueError("comma-separated path prefixes, each starting with /")
    return items


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 section 5.1: a field name is a token


def header_name(raw: str) -> str:
    value = raw.strip().lower()
    if not _TOKEN.fullmatch(value):
        raise ValueError("an HTTP header name (RFC 9110 section 5.1)")
    return value


def header_names(raw: str) -> tuple[str, ...]:
    try:
        items = tuple(header_name(p) for p in raw.split(",") if p.strip())
    except ValueError:
        items = ()
    if not items:
        raise ValueError("comma-separated HTTP header names (RFC 9110 section 5.1)")
    return items


def text(raw: str) -> str:
    return raw


_HOST_NAME = re.compile(r"[a-z0-9_][a-z0-9_.-]{0,252}")


def host_patterns(raw: str) -> tuple[str, ...]:
    items = tuple(p.strip().lower() for p in raw.split(",") if p.strip())
    for item in items:
        name = item[2:] if item.startswith("*.") else item
        try:
            ipaddress.ip_address(name.strip("[]"))
            continue
        except ValueError:
            pass
        try:
            ascii_name = name.encode("idna").decode("ascii")
        except UnicodeError:
            ascii_name = ""
        if not _HOST_NAME.fullmatch(ascii_name):
            raise ValueError("comma-separated host names and *.suffix patterns, e.g. images.example.com,*.cdn.net")
    return items


CIDRS_ALLOWED = "comma-separated addresses or CIDR networks, e.g. 127.0.0.1/32,10.1.0.0/16"
# IPv4-mapped IPv6 addresses (RFC 4291 section 2.5.5.2): ::ffff:a.b.c.d is the IPv4 address a.b.c.d.
IPV4_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """One address or CIDR network, refused when it has host bits set: ``10.0.0.1/8`` is no network, and taking
    it as ``10.0.0.0/8`` would widen what the operator wrote without a word."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError:
        try:
            network = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ValueError(CIDRS_ALLOWED) from None
        raise ValueError(f"{text} has host bits set: write the network, {network}, or the one address, "
                         f"{text.split('/', 1)[0]}") from None


def cidrs(raw: str) -> tuple[str, ...]:
    return tuple(str(_network(p.strip())) for p in raw.split(",") if p.strip())


def peer_cidrs(raw: str) -> tuple[str, ...]:
    """``cidrs`` for networks matched against TCP peers, which mmgate sees as IPv4 when they come IPv4-mapped
    (a dual-stack listener): an IPv4-mapped network is taken as the IPv4 network it maps, so that it matches."""
    networks = []
    for text in (p.strip() for p in raw.split(",") if p.strip()):
        network = _network(text)
        if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(IPV4_MAPPED):
            mapped = ipaddress.IPv4Address(int(network.network_address) & 0xFFFF_FFFF)  # its low 32 bits
            network = ipaddress.IPv4Network((mapped, network.prefixlen - IPV4_MAPPED.prefixlen))
        networks.append(str(network))
    return tuple(networks)


def model_name(raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ValueError("auto, none, a model folder or a model name in the Hugging Face cache")
    return value.lower() if value.lower() in ("auto", "none") else value


def folders(raw: str) -> tuple[str, ...]:
    items = tuple(p.strip() for p in raw.split(",") if p.strip())
    if any(not p.startswith("/") for p in items):
        raise ValueError("comma-separated absolute folder paths, e.g. /models,/mnt/models")
    return items


def json_object(raw: str) -> str:
    """A JSON object of string keys, as compact JSON with its keys sorted ('' for none)."""
    if not raw.strip():
        return ""
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError('a JSON object, e.g. {"max_pixels": 1003520}')
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
