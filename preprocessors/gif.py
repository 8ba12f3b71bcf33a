"""A GIF's frame count from its blocks, without decoding a pixel (GIF89a, sections 17-27).

A GIF does not store its count: its frames are image descriptors between extensions, each followed by its
LZW data as sub-blocks. Pillow's ``n_frames`` walks them the same way, but in Python per frame and to the
end, and a 32 MiB GIF of empty frames holds over a million; this walk stops one frame past the caller's limit.
It counts as ``n_frames`` does, frame for frame (tests compare the two on generated GIFs), and refuses what
Pillow's walk cannot read (``ValueError``): a descriptor, an extension label or a graphic control block cut
short, or a frame's LZW code size missing.
"""

from __future__ import annotations

IMAGE, EXTENSION, TRAILER = 0x2C, 0x21, 0x3B
GRAPHIC_CONTROL, COMMENT, APPLICATION = 0xF9, 0xFE, 0xFF  # extension labels
SCREEN_BYTES = 13  # signature, version and the logical screen descriptor
DESCRIPTOR_BYTES = 9  # an image descriptor after its separator


def gif_frames(data: bytes, limit: int) -> int:
    """The frames of the GIF ``data`` (or of the part of it that ``data`` holds), or ``limit + 1`` as soon
    as there are more than ``limit``."""
    end = len(data)
    if end < SCREEN_BYTES:
        raise ValueError("the GIF's screen descriptor is cut short")
    at = SCREEN_BYTES + _palette_bytes(data[10])
    frames = 0
    while frames <= limit:
        at = _next_frame(data, at, end, frames)
        if at < 0:
            return frames
        frames += 1
    return frames


def _next_frame(data: bytes, at: int, end: int, frame: int) -> int:
    """Where the data after the next frame's sub-blocks ends, from ``at``; -1 when no frame follows."""
    while at < end:
        kind = data[at]
        at += 1
        if kind == TRAILER:
            return -1
        if kind == EXTENSION:
            at = _after_extension(data, at, end, frame)
        elif kind == IMAGE:
            if at + DESCRIPTOR_BYTES > end:
                raise ValueError("an image descriptor is cut short")
            at += DESCRIPTOR_BYTES + _palette_bytes(data[at + DESCRIPTOR_BYTES - 1])
            if at >= end:
                raise ValueError("a frame's LZW code size is missing")
            return _after_blocks(data, at + 1, end)
        # any other byte is skipped, as Pillow skips it
    return -1


def _after_extension(data: bytes, at: int, end: int, frame: int) -> int:
    """Past an extension, from its label, read block by block as Pillow reads it: its first block, then the
    rest up to an empty one (so an extension with no block at all ends one run of blocks later, as in Pillow)."""
    if at >= end:
        raise ValueError("an extension's label is cut short")
    label = data[at]
    block, at = _block(data, at + 1, end)
    if label == GRAPHIC_CONTROL and block is not None:
        if len(block) < (4 if block and block[0] & 1 else 3):
            raise ValueError("a graphic control extension is cut short")
    elif label == COMMENT:
        while block:
            block, at = _block(data, at, end)
        return at
    elif label == APPLICATION and frame == 0 and block is not None and block.startswith(b"NETSCAPE2.0"):
        block, at = _block(data, at, end)  # the loop count
    return _after_blocks(data, at, end)


def _after_blocks(data: bytes, at: int, end: int) -> int:
    """Past blocks up to the first empty one (or the end)."""
    block, at = _block(data, at, end)
    while block:
        block, at = _block(data, at, end)
    return at


def _block(data: bytes, at: int, end: int) -> tuple[bytes | None, int]:
    """One sub-block at ``at`` (a size byte, then that many bytes or what is left) and where it ends; None for
    a zero size byte (a terminator) or none left."""
    if at >= end:
        return None, end
    size = data[at]
    if size == 0:
        return None, at + 1
    return data[at + 1:at + 1 + size], min(at + 1 + size, end)


def _palette_bytes(flags: int) -> int:
    """The bytes of the colour table a screen or image descriptor's flags announce."""
    return 3 << ((flags & 7) + 1) if flags & 0x80 else 0
