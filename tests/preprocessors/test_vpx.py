"""The frame sizes VP8 and VP9 frame headers state, read without decoding: what libvpx wrote, and nothing
but sizes (or nothing) from any bytes at all."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preprocessors.vpx import vp8_sizes, vp9_sizes


def encoded(codec: str, pix_fmt: str, options: dict[str, str]) -> list[bytes]:
    """Eight frames of 200x120 by libvpx, as packets."""
    import av

    encoder = av.CodecContext.create(codec, "w")
    assert isinstance(encoder, av.VideoCodecContext)
    encoder.width, encoder.height, encoder.pix_fmt = 200, 120, pix_fmt
    encoder.time_base, encoder.options = Fraction(1, 10), options
    packets = []
    for index in range(8):
        frame = av.VideoFrame(200, 120, pix_fmt)
        for plane in frame.planes:
            plane.update(bytes([index * 30]) * plane.buffer_size)
        frame.pts = index
        packets += encoder.encode(frame)
    packets += encoder.encode(None)
    return [bytes(packet) for packet in packets]


@pytest.mark.parametrize(("pix_fmt", "options"), [
    ("yuv420p", {"deadline": "realtime", "cpu-used": "8"}),  # profile 0
    ("yuv444p", {"deadline": "realtime", "cpu-used": "8"}),  # profile 1
    ("gbrp", {"deadline": "realtime", "cpu-used": "8"}),  # profile 1, RGB
])
def test_vp9_key_frames_state_the_encoded_size(pix_fmt: str, options: dict[str, str]) -> None:
    packets = encoded("libvpx-vp9", pix_fmt, options)
    sizes = [size for packet in packets for size in vp9_sizes(packet)]
    assert sizes and set(sizes) == {(200, 120)}


def test_each_frame_of_a_vp9_superframe_is_read() -> None:
    """A superframe (VP9 Annex B) is frames back to back, then an index: a marker byte (0b110, 4 bytes per
    size, 2 frames), the sizes little-endian, the marker again. A key frame hidden second in one is found."""
    inter, key = encoded("libvpx-vp9", "yuv420p", {"deadline": "realtime", "cpu-used": "8"})[1::-1]
    assert list(vp9_sizes(inter)) == []
    marker = bytes([0b110_11_001])
    superframe = inter + key + marker + len(inter).to_bytes(4, "little") + len(key).to_bytes(4, "little") + marker
    assert list(vp9_sizes(superframe)) == [(200, 120)]


def test_a_vp8_key_frame_states_the_encoded_size_and_an_inter_frame_none() -> None:
    packets = encoded("libvpx", "yuv420p", {"deadline": "realtime", "cpu-used": "8"})
    assert list(vp8_sizes(packets[0])) == [(200, 120)]
    assert [size for packet in packets[1:] for size in vp8_sizes(packet)] == []


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64))
def test_any_bytes_give_sizes_or_nothing(data: bytes) -> None:
    for sizes in (vp8_sizes(data), vp9_sizes(data), vp9_sizes(memoryview(data))):
        for width, height in sizes:
            assert 0 <= width <= 1 << 16 and 0 <= height <= 1 << 16
