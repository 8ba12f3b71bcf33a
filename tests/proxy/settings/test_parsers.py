"""Parsers of raw setting text: what each takes, what it refuses and how it says so."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.settings import ConfigError, Settings
from proxy.settings.parsers import Choice, base_url, integer, on_off, seconds
from proxy.settings.sections import ReleaseAt


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
