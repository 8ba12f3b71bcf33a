"""The frame size a VP8 or VP9 frame states in its uncompressed header, read without decoding the frame.

FFmpeg's VP8 and VP9 decoders reconstruct every frame they are given, whatever ``skip_frame`` says, and its
parsers for them do not report a size; the sizes are plain fields at the head of a frame, so they are read
here. A frame states a size of its own only as a VP8 key frame (RFC 6386, section 9.1) or a VP9 key or
intra-only frame (VP9 Bitstream Specification 0.6, section 6.2, ``uncompressed_header``); a VP9 inter frame
takes a reference's size or states one after its reference indices, which this does not follow.
"""

from __future__ import annotations

from collections.abc import Iterator

_VP8_START_CODE = b"\x9d\x01\x2a"
_VP9_SYNC_CODE = 0x498342
_VP9_RGB = 7


class _Bits:
    """Big-endian bits of ``data``, read past the end as zeros (a short header then fails its sync code)."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.value = int.from_bytes(data[:16], "big")
        self.left = 8 * min(len(data), 16)

    def read(self, count: int) -> int:
        self.left -= count
        return (self.value >> self.left) & ((1 << count) - 1) if self.left >= 0 else 0


def vp8_sizes(packet: bytes | memoryview) -> Iterator[tuple[int, int]]:
    """A VP8 key frame's ``(width, height)``; nothing for an inter frame, which keeps the key frame's."""
    if len(packet) >= 10 and not packet[0] & 1 and packet[3:6] == _VP8_START_CODE:
        yield (int.from_bytes(packet[6:8], "little") & 0x3FFF, int.from_bytes(packet[8:10], "little") & 0x3FFF)


def vp9_sizes(packet: bytes | memoryview) -> Iterator[tuple[int, int]]:
    """The ``(width, height)`` of each key or intra-only frame in a VP9 packet (a superframe holds several)."""
    for frame in _vp9_frames(packet):
        size = _vp9_size(frame)
        if size is not None:
            yield size


def _vp9_frames(packet: bytes | memoryview) -> Iterator[bytes | memoryview]:
    """A superframe's frames, by the index at its end (Annex B); any other packet is one frame."""
    marker = packet[-1] if packet else 0
    if marker & 0xE0 == 0xC0:
        width, count = ((marker >> 3) & 3) + 1, (marker & 7) + 1
        index = 2 + width * count
        if len(packet) >= index and packet[-index] == marker:
            at = 0
            for entry in range(count):
                start = len(packet) - index + 1 + entry * width
                size = int.from_bytes(packet[start:start + width], "little")
                yield packet[at:at + size]
                at += size
            return
    yield packet


def _vp9_size(frame: bytes | memoryview) -> tuple[int, int] | None:
    bits = _Bits(frame)
    if bits.read(2) != 2:  # frame_marker
        return None
    profile = bits.read(1)
    profile |= bits.read(1) << 1
    if profile == 3:
        bits.read(1)
    if bits.read(1):  # show_existing_frame
        return None
    key_frame = bits.read(1) == 0
    show_frame = bits.read(1)
    error_resilient = bits.read(1)
    if not key_frame:
        intra_only = 0 if show_frame else bits.read(1)
        if not error_resilient:
            bits.read(2)  # reset_frame_context
        if not intra_only:
            return None
    if bits.read(24) != _VP9_SYNC_CODE:
        return None
    if key_frame or profile > 0:  # color_config
        if profile >= 2:
            bits.read(1)  # ten_or_twelve_bit
        if bits.read(3) != _VP9_RGB:
            bits.read(1)  # color_range
            if profile in (1, 3):
                bits.read(3)  # subsampling_x, subsampling_y, reserved_zero
        elif profile in (1, 3):
            bits.read(1)
    if not key_frame:
        bits.read(8)  # refresh_frame_flags
    width, height = bits.read(16) + 1, bits.read(16) + 1
    return (width, height) if bits.left >= 0 else None
