"""``preprocessors.gif.gif_frames`` counts a GIF's frames as Pillow's ``n_frames`` does, on GIFs Pillow writes
and on block sequences built to hit its quirks (extensions without blocks, cut-short blocks, stray bytes, a
file cut anywhere), and stops one frame past its limit."""

from __future__ import annotations

import io

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import GifImagePlugin, Image

from preprocessors.gif import gif_frames

SCREEN = b"GIF89a" + bytes([4, 0, 4, 0, 0x80, 0, 0]) + bytes(6)  # 4x4, a global table of 2 colours
IMAGE = b"," + bytes([0, 0, 0, 0, 4, 0, 4, 0, 0]) + b"\x02\x02\x44\x01\x00"  # a 4x4 frame of colour 0
GRAPHIC_CONTROL = b"!\xf9\x04\x00\x0a\x00\x00\x00"
NETSCAPE = b"!\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"
COMMENT = b"!\xfe\x05hello\x00"

PIECES = st.sampled_from([
    IMAGE, GRAPHIC_CONTROL, NETSCAPE, COMMENT,
    b"!\xf9\x00",  # an extension with no block: Pillow reads the next run of blocks as its own
    b"!\x01\x00", b"!\xf9\x02\x01\x00\x00",  # a plain-text label; a graphic control block cut short
    b"!\xf9\x03\x01\x00\x00\x00",  # transparency flagged, no transparent index
    b"\x00", b"\x07", b"\x02ab\x00",  # stray bytes and blocks between the blocks
    b",\x00\x00\x00\x00\x04\x00\x04\x00\x81" + bytes(12) + b"\x02\x01\x00\x00",  # a frame with a local table
])


def pillow_frames(data: bytes) -> int | None:
    """Pillow's count, None where its walk fails; the file must open (its first frame read) to count."""
    image = Image.open(io.BytesIO(data), formats=("GIF",))
    assert isinstance(image, GifImagePlugin.GifImageFile)
    try:
        return image.n_frames
    except Exception:
        return None


def ours(data: bytes, limit: int = 1 << 20) -> int | None:
    try:
        return gif_frames(data, limit)
    except ValueError:
        return None


@settings(max_examples=400)
@given(st.lists(PIECES, max_size=12), st.booleans(), st.integers(min_value=0, max_value=400))
@example([IMAGE, b"!\xf9\x00", IMAGE, IMAGE], True, 400)
@example([NETSCAPE, IMAGE, COMMENT, IMAGE], False, 7)
def test_counts_as_pillow_counts(pieces: list[bytes], trailer: bool, cut: int) -> None:
    data = SCREEN + IMAGE + b"".join(pieces) + (b";" if trailer else b"")
    data = data[:max(len(SCREEN) + len(IMAGE), len(data) - cut)]  # cut anywhere after the first frame
    assert ours(data) == pillow_frames(data)


@pytest.mark.parametrize("frames", [1, 2, 5])
def test_counts_what_pillow_writes(frames: int) -> None:
    stills = [Image.new("L", (8, 8), 40 * i) for i in range(frames)]  # distinct: Pillow merges equal frames
    out = io.BytesIO()
    stills[0].save(out, "GIF", save_all=True, append_images=stills[1:], loop=0, duration=40, comment=b"mmgate")
    image = Image.open(out)
    assert isinstance(image, GifImagePlugin.GifImageFile)
    assert gif_frames(out.getvalue(), 100) == frames == image.n_frames


def test_stops_one_frame_past_the_limit() -> None:
    data = SCREEN + IMAGE * 1000 + b";"
    assert gif_frames(data, 1000) == 1000
    assert gif_frames(data, 5) == 6
    assert gif_frames(data, 0) == 1


def test_a_screen_cut_short_is_refused() -> None:
    with pytest.raises(ValueError, match="screen descriptor"):
        gif_frames(SCREEN[:10], 5)
