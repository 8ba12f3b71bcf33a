"""preprocessors/dataurl.py: data URL headers and base64 decoding, sizes checked before any decode."""

from __future__ import annotations

from functools import partial

import pybase64
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preprocessors.dataurl import (
    Base64Ends,
    DataUrl,
    checked_size,
    decode_base64,
    decode_head,
    decode_tail,
    decoded_size,
    encode_base64,
    parse_data_url,
)
from tests.preprocessors.conftest import expect_error


def test_parse_data_url_fields() -> None:
    value = b"data:Image/PNG;base64,QUJD"
    assert parse_data_url(value) == DataUrl(mime="image/png", params="", payload_offset=22)
    assert value[22:] == b"QUJD"


def test_parse_data_url_params_empty_mime_case_and_memoryview() -> None:
    with_params = parse_data_url(memoryview(b"DATA:text/plain;charset=utf-8;BASE64,QUJD"))
    assert with_params == DataUrl(mime="text/plain", params=";charset=utf-8", payload_offset=37)
    no_mime = parse_data_url(b"data:;base64,QUJD")
    assert no_mime == DataUrl(mime="", params="", payload_offset=13)


@pytest.mark.parametrize("value", [b"https://example.com/cat.png", b"", b"dat", b"QUJDRA=="])
def test_parse_data_url_none_for_other_strings(value: bytes) -> None:
    assert parse_data_url(value) is None


@pytest.mark.parametrize(
    "value",
    [
        b"data:image/png,QUJD",  # not base64
        b"data:image/png;base64QUJD",  # no comma
        b"data:image/png;base64" + b"A" * 10_000 + b",QUJD",  # comma beyond the header window
        b"data:image/p\xc3\xa9ng;base64,QUJD",  # non-ASCII header
    ],
)
def test_parse_data_url_invalid(value: bytes) -> None:
    expect_error("invalid_data_uri", lambda: parse_data_url(value))


def test_parse_data_url_reads_only_the_header() -> None:
    """A 64 MiB payload of non-base64 bytes: the header parses; the payload is left to the decoder."""
    value = memoryview(b"data:image/jpeg;base64," + b"\xff" * (64 << 20))
    assert parse_data_url(value) == DataUrl("image/jpeg", "", 23)


@settings(deadline=None)
@given(st.binary(max_size=300))
def test_decoded_size_is_exact_up_to_padding(data: bytes) -> None:
    encoded = encode_base64(data)
    padding = len(encoded) - len(encoded.rstrip(b"="))
    assert decoded_size(len(encoded)) == len(data) + padding


@settings(deadline=None)
@given(st.binary(min_size=1, max_size=300), st.binary(max_size=8), st.binary(max_size=8))
def test_decode_roundtrip_from_a_memoryview_slice(data: bytes, before: bytes, after: bytes) -> None:
    encoded = encode_base64(data)
    assert encoded == pybase64.b64encode(data)
    body = before + encoded + after
    view = memoryview(body)[len(before) : len(before) + len(encoded)]
    assert decode_base64(view, max_bytes=len(data)) == data
    assert decode_base64(encoded.decode(), max_bytes=len(data)) == data


def test_decode_limit_checked_before_decoding() -> None:
    # Invalid base64 that is also too large: the size is refused first (413), nothing is decoded.
    error = expect_error("media_too_large", lambda: decode_base64(b"!" * 4000, max_bytes=2999))
    assert error.status == 413
    assert "MMGATE_MAX_MEDIA_ITEM_MB" in error.message


def test_decode_limit_counts_padding() -> None:
    data = bytes(range(256)) * 4 + b"x"  # 1025 bytes -> "==" padding; 1028 chars * 3 / 4 = 1026
    assert decode_base64(encode_base64(data), max_bytes=1025) == data
    expect_error("media_too_large", lambda: decode_base64(encode_base64(data), max_bytes=1024))


@pytest.mark.parametrize(
    ("payload", "hint"),
    [
        (b"", "empty"),
        (b"QUJD\nRA==", "line breaks"),
        (b"QU JD", "line breaks"),
        (b"-_-_", "URL-safe"),
        (b"QUJ\\/", "escape"),
        (b"QUJ\xe9", "non-ASCII"),
        (b"QUJ", "multiple of 4"),
        (b"QU=D", "multiple of 4"),
        ("QUJé", "non-ASCII"),  # a str with a non-ASCII character (ValueError in the stdlib)
        ("QU\ud800", "non-ASCII"),  # a lone surrogate, as JSON "\ud800" decodes
    ],
)
def test_decode_invalid_base64(payload: bytes | str, hint: str) -> None:
    error = expect_error("invalid_base64", lambda: decode_base64(payload, max_bytes=100))
    assert hint in error.message


@settings(max_examples=200)
@given(data=st.binary(min_size=1, max_size=600), tail_bytes=st.integers(3, 700))
def test_decode_tail_is_the_end_of_the_file(data: bytes, tail_bytes: int) -> None:
    tail = decode_tail(pybase64.b64encode(data), tail_bytes)
    assert data.endswith(tail)
    assert len(tail) >= min(len(data), tail_bytes // 3 * 3 - 2)


def test_decode_tail_names_a_stray_byte_by_its_offset_in_the_whole_payload() -> None:
    payload = pybase64.b64encode(bytes(3000))
    broken = payload[:-10] + b"-" + payload[-9:]
    error = expect_error("invalid_base64", lambda: decode_tail(broken, 300))
    assert f"at offset {len(payload) - 10} " in error.message
    error = expect_error("invalid_base64", lambda: decode_tail(payload + b"QQ", 300))
    assert f"{len(payload) + 2} characters with wrong length" in error.message


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=600), head_bytes=st.integers(3, 700), tail_bytes=st.integers(3, 700),
       view=st.booleans())
def test_base64_ends_read_what_the_functions_read_each_stretch_once(data: bytes, head_bytes: int, tail_bytes: int,
                                                                   view: bool) -> None:
    """``Base64Ends`` gives what ``decode_head``, ``decode_tail`` and ``checked_size`` give, and a second ask of the
    same stretch is the bytes already decoded, not a new decode."""
    payload = pybase64.b64encode(data)
    ends = Base64Ends(memoryview(payload) if view else payload)
    assert ends.size() == (checked_size(payload, len(data)) if data else 0) == len(data)
    head, tail = ends.head(head_bytes), ends.tail(tail_bytes)
    assert head == decode_head(payload, head_bytes) and tail == decode_tail(payload, tail_bytes)
    assert ends.head(head_bytes) is head and ends.tail(tail_bytes) is tail


def test_base64_ends_refuse_what_the_functions_refuse() -> None:
    ends = Base64Ends(b"QUJD!!!!" * 4)
    for read in (ends.head, ends.tail):
        error = expect_error("invalid_base64", partial(read, 300))
        assert "!" in str(error)
