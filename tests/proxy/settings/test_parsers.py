"""Parsers of raw setting text: what each takes, what it refuses and how it says so."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.admission.flows import FlowRules, flow_for
from proxy.settings import ConfigError, Settings
from proxy.settings.parsers import Choice, base_url, cidrs, integer, on_off, seconds
from proxy.settings.sections import PRIORITY_MAX, PRIORITY_MIN, ReleaseAt


@pytest.mark.parametrize(
    ("given_url", "corrected"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("https://vllm.internal/V1", "https://vllm.internal"),
        ("http://gateway:80/team-a/v1", "http://gateway:80/team-a"),
    ],
)
def test_an_upstream_ending_in_v1_is_refused_with_the_url_to_use(given_url: str, corrected: str) -> None:
    """An SDK's base URL (``.../v1``) would make every forwarded path ``/v1/v1/...``: refused at start, in one
    line that says why and what to write instead."""
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({"MMGATE_UPSTREAM": given_url})
    message = str(refused.value)
    assert message.startswith(f"MMGATE_UPSTREAM={given_url!r} is not allowed: expected the backend's base URL "
                              "without /v1 (clients send /v1/... paths and mmgate forwards them as they come)")
    assert message.endswith(f": {corrected}") and "\n" not in message
    assert base_url(corrected) == corrected  # the URL it names is taken


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://h:1/", "http://h/v1beta", "http://h/api/v10"])
def test_an_upstream_with_another_path_is_taken(url: str) -> None:
    assert base_url(url) == url.rstrip("/")


def test_a_choice_lists_its_values_in_order_and_takes_them_in_any_case() -> None:
    release_at = Choice(ReleaseAt)
    assert release_at.values == ("auto", "sent", "headers", "complete")
    assert release_at(" Headers ") == "headers"
    with pytest.raises(ValueError, match=r"^one of auto, sent, headers, complete$"):
        release_at("never")
    assert on_off.values == ("on", "off") and on_off("YES") is True and on_off("0") is False


def test_the_fairness_header_setting_takes_one_name_or_several() -> None:
    default = Settings.from_env({"MMGATE_UPSTREAM": "http://h:1"}).gate
    assert default.fairness_header == ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
    assert default.trust_flow_headers_from == ()
    one = Settings.from_env({"MMGATE_UPSTREAM": "http://h:1", "MMGATE_FAIRNESS_HEADER": "X-Tenant",
                             "MMGATE_TRUST_FLOW_HEADERS_FROM": "10.0.0.0/8, 192.0.2.7"}).gate
    assert one.fairness_header == ("x-tenant",) and one.trust_flow_headers_from == ("10.0.0.0/8", "192.0.2.7/32")


@pytest.mark.parametrize("variable", ["MMGATE_TRUST_FLOW_HEADERS_FROM", "MMGATE_FETCH_ALLOW_ADDRESSES"])
@pytest.mark.parametrize(("given_cidr", "network"), [("10.0.0.1/8", "10.0.0.0/8"),
                                                      ("2001:db8::1/32", "2001:db8::/32")])
def test_a_cidr_with_host_bits_stops_start_up_naming_the_setting_and_the_network(
    variable: str, given_cidr: str, network: str
) -> None:
    """Taking 10.0.0.1/8 as 10.0.0.0/8 would widen, without a word, whom mmgate trusts or may connect to."""
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({"MMGATE_UPSTREAM": "http://h:1", variable: f"192.0.2.7, {given_cidr}"})
    message = str(refused.value)
    assert message.startswith(f"{variable}=") and f"{given_cidr} has host bits set" in message
    assert f"write the network, {network}," in message and "\n" not in message


def test_an_ipv4_mapped_flow_trust_network_matches_its_ipv4_peers() -> None:
    """Peers are compared as IPv4 when they come IPv4-mapped: a mapped network is taken as the IPv4 one."""
    gate = Settings.from_env({"MMGATE_UPSTREAM": "http://h:1", "MMGATE_FAIRNESS_HEADER": "X-Tenant",
                              "MMGATE_TRUST_FLOW_HEADERS_FROM": "::ffff:127.0.0.1/128, ::ffff:10.1.0.0/112, "
                                                                "2001:db8::/32"}).gate
    assert gate.trust_flow_headers_from == ("127.0.0.1/32", "10.1.0.0/16", "2001:db8::/32")
    rules = FlowRules.of(gate.fairness_header, gate.priority_header, (PRIORITY_MIN, PRIORITY_MAX),
                         gate.trust_flow_headers_from)
    for peer in ["127.0.0.1", "::ffff:127.0.0.1", "10.1.200.3", "2001:db8::5"]:
        assert flow_for({"x-tenant": "team-a"}, peer, rules).id == "team-a", peer
    assert flow_for({"x-tenant": "team-a"}, "10.2.0.1", rules).id != "team-a"


@given(address=st.ip_addresses(), prefix=st.integers(0, 128))
def test_a_network_is_taken_as_written_or_refused(address: ipaddress.IPv4Address | ipaddress.IPv6Address,
                                                  prefix: int) -> None:
    """Any address with any prefix: taken unchanged when it is a network, else refused; never widened."""
    prefix = min(prefix, address.max_prefixlen)
    written = f"{address}/{prefix}"
    try:
        [taken] = cidrs(written)
    except ValueError as refused:
        assert "host bits set" in str(refused)
        with pytest.raises(ValueError):
            ipaddress.ip_network(written, strict=True)
    else:
        assert ipaddress.ip_network(taken) == ipaddress.ip_network(written, strict=True)


@given(lo=st.integers(0, 100), span=st.integers(0, 1000), value=st.integers(-10, 1200))
def test_integer_takes_its_range_and_names_it_otherwise(lo: int, span: int, value: int) -> None:
    parse = integer(lo, lo + span)
    if lo <= value <= lo + span:
        assert parse(str(value)) == value
    else:
        with pytest.raises(ValueError, match=rf"^an integer from {lo} to {lo + span}$"):
            parse(str(value))


@given(value=st.floats(allow_nan=True, allow_infinity=True), allow_zero=st.booleans())
def test_seconds_are_finite_and_positive_or_zero_where_zero_is_off(value: float, allow_zero: bool) -> None:
    parse = seconds(allow_zero)
    if 0 < value < float("inf") or (allow_zero and value == 0):
        assert parse(repr(value)) == value
    else:
        with pytest.raises(ValueError, match=r"^a number of seconds"):
            parse(repr(value))
