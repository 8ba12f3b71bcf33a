"""Unit tests of the image preprocessor: no HTTP, inputs synthesised with Pillow in the test.

Work is proven by events and counters (pixel decodes observed by wrapping ``ImageFile.load``, checkpoint
calls, frame-header walks), never by durations.
"""

from __future__ import annotations

import base64
import io
import random
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import GifImagePlugin, Image, ImageDraw, ImageOps

from preprocessors.base import AudioPolicy, Cancelled, ImagePolicy, no_checkpoint
from preprocessors.dataurl import Base64Ends
from preprocessors.errors import MediaError
from preprocessors.formats import ALLOWED_FORMATS, MIME_BY_FORMAT
from preprocessors.image import fit_within, process_image
from preprocessors.job import MediaTask, Verdict, judge_head, run_task
from testkit.media import image_bytes
from tests.preprocessors.conftest import decode, encode, expect_error, noisy

RESIZE_SMALL = ImagePolicy(resize_max_pixels=10_000)


@settings(deadline=None)
@given(
    st.integers(1, 30_000),
    st.integers(1, 30_000),
    st.integers(0, 5_000_000),
    st.integers(0, 8_000),
)
def test_fit_respects_limits_and_aspect(width: int, height: int, max_pixels: int, max_side: int) -> None:
    policy = ImagePolicy(resize_max_pixels=max_pixels, resize_max_side=max_side)
    target = fit_within(width, height, policy)
    fits = (not max_pixels or width * height <= max_pixels) and (
        not max_side or max(width, height) <= max_side
    )
    if fits:
        assert target is None
        return
    assert target is not None
    w, h = target
    assert 1 <= w <= width and 1 <= h <= height and (w, h) != (width, height)
    assert not max_pixels or w * h <= max_pixels
    assert not max_side or max(w, h) <= max_side
    if min(w, h) >= 20:  # aspect kept to rounding (thin strips are clamped to 1 px)
        assert abs(w / h - width / height) <= (width / height) * 0.1


@pytest.mark.parametrize(
    ("size", "policy", "expected"),
    [
        ((400, 300), ImagePolicy(resize_max_pixels=30_000), (200, 150)),
        ((300, 400), ImagePolicy(resize_max_pixels=30_000), (150, 200)),
        ((1000, 250), ImagePolicy(resize_max_side=100), (100, 25)),
        ((1000, 250), ImagePolicy(resize_max_side=500, resize_max_pixels=10_000), (200, 50)),
    ],
)
def test_resize_dimensions_and_aspect(
    size: tuple[int, int], policy: ImagePolicy, expected: tuple[int, int]
) -> None:
    result = process_image(encode(noisy(size), "JPEG"), policy)
    assert result is not None
    assert (result.width, result.height) == expected
    assert (result.source_width, result.source_height) == size
    assert result.mime == "image/jpeg"
    assert decode(result.data).size == expected


@pytest.mark.parametrize("fmt", ALLOWED_FORMATS)
def test_every_allowed_format_is_resized(fmt: str) -> None:
    data = encode(noisy((300, 200)), fmt)
    result = process_image(data, RESIZE_SMALL)
    assert result is not None
    assert result.width * result.height <= 10_000
    assert decode(result.data).format == "JPEG"


@pytest.mark.parametrize("fmt", ALLOWED_FORMATS)
@pytest.mark.parametrize("validate", ["full", "header"])
def test_small_image_is_forwarded_as_is(
    fmt: str, validate: str, loads: list[tuple[str | None, tuple[int, int]]]
) -> None:
    policy = ImagePolicy(
        resize_max_pixels=1_000_000, output_format="webp", validate=validate  # type: ignore[arg-type]
    )
    assert process_image(encode(noisy((64, 48)), fmt), policy) is None
    assert len(loads) == (1 if validate == "full" else 0)


def test_no_resize_policy_never_reencodes() -> None:
    assert process_image(encode(noisy((3000, 2000)), "JPEG"), ImagePolicy()) is None


def two_colour(size: tuple[int, int]) -> Image.Image:
    """Left half red, right half blue."""
    img = Image.new("RGB", size, (0, 0, 255))
    ImageDraw.Draw(img).rectangle((0, 0, size[0] // 2 - 1, size[1] - 1), fill=(255, 0, 0))
    return img


def is_colour(pixel: float | tuple[int, ...] | None, colour: tuple[int, int, int]) -> bool:
    assert isinstance(pixel, tuple), f"not a multi-band pixel: {pixel!r}"
    return all(abs(a - b) < 40 for a, b in zip(pixel, colour, strict=False))


def test_exif_rotated_jpeg_comes_out_upright() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: the viewer rotates 90 degrees clockwise
    exif[0x010E] = "private description"
    data = encode(two_colour((200, 100)), "JPEG", exif=exif.tobytes())

    assert process_image(data, ImagePolicy()) is None  # no resize: forwarded with its EXIF

    result = process_image(data, ImagePolicy(resize_max_side=100))
    assert result is not None
    assert (result.width, result.height) == (50, 100)
    assert (result.source_width, result.source_height) == (100, 200)
    out = decode(result.data).convert("RGB")
    assert out.size == (50, 100)
    assert is_colour(out.getpixel((25, 10)), (255, 0, 0))  # the stored left half is now on top
    assert is_colour(out.getpixel((25, 90)), (0, 0, 255))
    assert not out.getexif() and "exif" not in out.info  # metadata stripped


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_matches_imageops(orientation: int) -> None:
    quadrants = Image.new("RGB", (200, 100), (255, 0, 0))
    draw = ImageDraw.Draw(quadrants)
    draw.rectangle((100, 0, 199, 49), fill=(0, 255, 0))
    draw.rectangle((0, 50, 99, 99), fill=(0, 0, 255))
    draw.rectangle((100, 50, 199, 99), fill=(255, 255, 0))
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(quadrants, "JPEG", exif=exif.tobytes())
    expected = ImageOps.exif_transpose(decode(data))

    result = process_image(data, ImagePolicy(resize_max_side=100))
    assert result is not None
    out = decode(result.data).convert("RGB")
    assert out.size == (expected.width // 2, expected.height // 2)
    for fx, fy in ((0.25, 0.25), (0.75, 0.25), (0.25, 0.75), (0.75, 0.75)):
        want = expected.getpixel((int(fx * expected.width), int(fy * expected.height)))
        assert is_colour(out.getpixel((int(fx * out.width), int(fy * out.height))), want)  # type: ignore[arg-type]


def half_transparent(mode: str = "RGBA") -> Image.Image:
    img = Image.new("RGBA", (200, 100), (255, 0, 0, 255))
    ImageDraw.Draw(img).rectangle((100, 0, 199, 99), fill=(0, 0, 0, 0))
    return img.convert(mode)


def test_rgba_auto_keeps_alpha_as_png() -> None:
    result = process_image(encode(half_transparent(), "PNG"), RESIZE_SMALL)
    assert result is not None and result.mime == "image/png"
    out = decode(result.data)
    assert out.format == "PNG" and out.mode == "RGBA"
    assert out.getpixel((5, 5))[3] == 255
    assert out.getpixel((out.width - 5, 5))[3] == 0


def test_rgba_forced_jpeg_is_composited_on_white() -> None:
    policy = ImagePolicy(resize_max_pixels=10_000, output_format="jpeg")
    result = process_image(encode(half_transparent(), "PNG"), policy)
    assert result is not None and result.mime == "image/jpeg"
    out = decode(result.data)
    assert out.mode == "RGB"
    assert is_colour(out.getpixel((5, 5)), (255, 0, 0))
    assert is_colour(out.getpixel((out.width - 5, 5)), (255, 255, 255))  # white, not black


def test_webp_output_keeps_alpha() -> None:
    policy = ImagePolicy(resize_max_pixels=10_000, output_format="webp")
    result = process_image(encode(half_transparent(), "PNG"), policy)
    assert result is not None and result.mime == "image/webp"
    out = decode(result.data)
    assert out.format == "WEBP" and out.getpixel((out.width - 5, 5))[3] == 0


def test_opaque_alpha_channel_goes_to_jpeg() -> None:
    data = encode(noisy((300, 200)).convert("RGBA"), "PNG")
    result = process_image(data, RESIZE_SMALL)
    assert result is not None and result.mime == "image/jpeg"


def test_forced_png_output() -> None:
    policy = ImagePolicy(resize_max_pixels=10_000, output_format="png")
    result = process_image(encode(noisy((300, 200)), "JPEG"), policy)
    assert result is not None and result.mime == "image/png" and decode(result.data).format == "PNG"


def test_palette_with_transparency() -> None:
    img = half_transparent().convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    transparent_index = img.getpixel((150, 50))
    data = encode(img, "PNG", transparency=transparent_index)
    assert decode(data).mode == "P"
    result = process_image(data, RESIZE_SMALL)
    assert result is not None and result.mime == "image/png"
    out = decode(result.data)
    assert out.mode == "RGBA"
    assert out.getpixel((out.width - 5, 5))[3] == 0 and out.getpixel((5, 5))[3] == 255


@pytest.mark.parametrize(("mode", "transparency"), [("L", 0), ("RGB", (0, 0, 0))])
def test_colour_key_transparency_is_kept(mode: str, transparency: object) -> None:
    img = Image.new(mode, (200, 100), 200 if mode == "L" else (200, 10, 10))
    ImageDraw.Draw(img).rectangle((100, 0, 199, 99), fill=transparency)  # type: ignore[arg-type]
    result = process_image(encode(img, "PNG", transparency=transparency), RESIZE_SMALL)
    assert result is not None and result.mime == "image/png"
    out = decode(result.data)
    assert out.mode == ("LA" if mode == "L" else "RGBA")
    assert out.getpixel((out.width - 5, 5))[-1] == 0


def test_sixteen_bit_png_is_scaled_not_clipped() -> None:
    gradient = Image.linear_gradient("L").convert("I").point(lambda v: v * 257)  # 0..65535, top to bottom
    data = encode(gradient.convert("I;16"), "PNG")
    assert decode(data).mode == "I;16"
    result = process_image(data, ImagePolicy(resize_max_side=64))
    assert result is not None
    out = decode(result.data)
    assert out.mode == "L"
    low, high = out.getextrema()
    assert low < 10 and high > 245
    assert 100 < out.getpixel((32, 32)) < 156  # mid-grey stays mid-grey (a clip would give 255)


def test_cmyk_jpeg_becomes_rgb() -> None:
    data = encode(Image.new("CMYK", (300, 200), (0, 255, 255, 0)), "JPEG")
    assert decode(data).mode == "CMYK"
    result = process_image(data, RESIZE_SMALL)
    assert result is not None
    out = decode(result.data)
    assert out.mode == "RGB"
    assert is_colour(out.getpixel((10, 10)), (255, 0, 0))


@pytest.mark.parametrize("mode", ["1", "L", "LA"])
def test_grey_modes(mode: str) -> None:
    fmt = "PNG" if mode != "1" else "BMP"
    result = process_image(encode(noisy((300, 200), mode), fmt), RESIZE_SMALL)
    assert result is not None
    assert decode(result.data).mode in ("L", "LA")


def animated_gif(frames: int, size: tuple[int, int] = (120, 90)) -> bytes:
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    images = [Image.new("RGB", size, colours[i % 3]) for i in range(frames)]
    return encode(images[0], "GIF", save_all=True, append_images=images[1:], duration=40, loop=0)


def test_animated_gif_within_frame_cap_is_forwarded() -> None:
    data = animated_gif(5)
    assert Image.open(io.BytesIO(data)).n_frames == 5
    assert process_image(data, ImagePolicy(max_frames=5)) is None


def test_animated_gif_over_frame_cap() -> None:
    data = animated_gif(6)
    error = expect_error("too_many_frames", lambda: process_image(data, ImagePolicy(max_frames=5)))
    assert "more than 5 frames" in error.message


def test_animated_gif_resized_to_its_first_frame() -> None:
    result = process_image(animated_gif(3), ImagePolicy(resize_max_side=60))
    assert result is not None and (result.width, result.height) == (60, 45)
    out = decode(result.data)
    assert getattr(out, "n_frames", 1) == 1
    assert is_colour(out.convert("RGB").getpixel((30, 20)), (255, 0, 0))


def test_gif_frame_count_stops_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 000 empty frames (4.6 MB): only limit + 1 frame headers are walked, not all of them."""
    head = b"GIF89a\x02\x00\x02\x00\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff"  # 2x2, 2 colours
    frame = (
        b"!\xf9\x04\x00\x02\x00\x00\x00"  # graphic control extension
        b",\x00\x00\x00\x00\x01\x00\x01\x00\x00"  # image descriptor: 1x1 at 0,0
        b"\x02\x02\x44\x01\x00"  # LZW data, end of block
    )
    walked = []
    original = GifImagePlugin.GifImageFile._seek

    def counting(self: GifImagePlugin.GifImageFile, frame_no: int, update_image: bool = True) -> None:
        walked.append(frame_no)
        original(self, frame_no, update_image)

    monkeypatch.setattr(GifImagePlugin.GifImageFile, "_seek", counting)
    expect_error("too_many_frames", lambda: process_image(head + frame * 200_000 + b";", ImagePolicy()))
    assert len(walked) < 70


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "GIF"])
def test_animation_frame_cap(fmt: str) -> None:
    frames = [Image.new("RGB", (40, 30), c) for c in ("red", "green", "blue")]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=40)
    assert Image.open(io.BytesIO(data)).n_frames == 3
    expect_error("too_many_frames", lambda: process_image(data, ImagePolicy(max_frames=2)))
    assert process_image(data, ImagePolicy(max_frames=3)) is None


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_image_is_refused_from_its_end_whatever_the_validation(fmt: str) -> None:
    data = encode(noisy((256, 256)), fmt)
    cut = data[: len(data) // 2]
    for policy in (ImagePolicy(), ImagePolicy(validate="header"), ImagePolicy(validate="header", resize_max_side=64)):
        error = expect_error("image_truncated", partial(process_image, cut, policy))
        assert error.message.startswith(fmt)


def test_a_file_corrupt_in_its_middle_fails_full_validation_only() -> None:
    data = bytearray(encode(noisy((256, 256)), "PNG"))
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)  # the IDAT's checksum no longer matches: whole, but corrupt
    error = expect_error("image_decode_failed", lambda: process_image(bytes(data), ImagePolicy()))
    assert "PNG" in error.message
    # header validation reads the header and the end, nothing between (documented trade-off)
    assert process_image(bytes(data), ImagePolicy(validate="header")) is None
    # ... but a resize decodes, and catches it
    policy = ImagePolicy(validate="header", resize_max_side=64)
    expect_error("image_decode_failed", lambda: process_image(bytes(data), policy))


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xd8\xff\xe0" + b"\x00" * 20,
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 20,
        b"GIF89a\x01",
        b"RIFF\x00\x00\x00\x00WEBPVP8 ",
    ],
)
def test_corrupt_header_with_right_magic(data: bytes) -> None:
    error = expect_error("image_decode_failed", lambda: process_image(data, ImagePolicy()))
    assert "0x" not in error.message  # no Python object reprs leak into client messages


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (encode(noisy((32, 32)), "TIFF"), "TIFF"),
        (b"8BPS\x00\x01" + b"\x00" * 40, "PSD"),
        (encode(noisy((32, 32)), "ICO"), "ICO"),
        (b"\x00\x00\x00\x1cftypheic" + b"\x00" * 40, "HEIF"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG"),
        (b"hello, this is not an image", None),
        (b"", None),
    ],
)
def test_refused_formats(data: bytes, named: str | None, loads: list[object]) -> None:
    error = expect_error("unsupported_media_type", lambda: process_image(data, ImagePolicy()))
    assert "JPEG, PNG, WEBP, GIF, BMP" in error.message
    if named:
        assert named in error.message
    assert loads == []


def png_claiming(width: int, height: int) -> bytes:
    """A valid-looking PNG whose IHDR claims width x height over a 7-byte IDAT (no big allocation)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def jpeg_claiming(width: int, height: int) -> bytes:
    data = bytearray(encode(noisy((16, 16)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def gif_claiming(width: int, height: int) -> bytes:
    data = bytearray(encode(noisy((16, 16)), "GIF"))
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


@pytest.mark.parametrize("build", [png_claiming, jpeg_claiming, gif_claiming])
@pytest.mark.parametrize("policy", [ImagePolicy(), ImagePolicy(resize_max_pixels=1_000_000)])
def test_bomb_refused_from_the_header_without_decoding(
    build: Callable[[int, int], bytes], policy: ImagePolicy, loads: list[object]
) -> None:
    data = build(20000, 20000)
    assert len(data) < 10_000
    error = expect_error("image_too_large", lambda: process_image(data, policy))
    assert error.message.startswith("image is 20000x20000 = 400000000 pixels, over the limit of 64000000")
    assert "MMGATE_MAX_IMAGE_PIXELS" in error.message
    assert loads == []  # no pixel was decoded


def test_pixel_limit_is_the_policy_not_pillow() -> None:
    data = encode(noisy((200, 100)), "PNG")
    expect_error("image_too_large", lambda: process_image(data, ImagePolicy(max_pixels=19_999)))
    assert process_image(data, ImagePolicy(max_pixels=20_000)) is None
    assert Image.MAX_IMAGE_PIXELS is None  # Pillow's global guard is replaced, once, at import


def test_checkpoints_run_between_steps() -> None:
    calls = 0

    def counting() -> None:
        nonlocal calls
        calls += 1

    process_image(encode(noisy((300, 200)), "JPEG"), RESIZE_SMALL, counting)
    assert calls >= 4


@pytest.mark.parametrize("cancel_at", [1, 2, 3, 4])
def test_cancelled_checkpoint_stops_processing(
    cancel_at: int, loads: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = encode(noisy((300, 200)), "JPEG")
    saves = []
    original_save = Image.Image.save
    monkeypatch.setattr(
        Image.Image, "save", lambda self, *a, **k: saves.append(1) or original_save(self, *a, **k)
    )
    calls = 0

    def checkpoint() -> None:
        nonlocal calls
        calls += 1
        if calls == cancel_at:
            raise Cancelled

    with pytest.raises(Cancelled):
        process_image(data, RESIZE_SMALL, checkpoint)
    assert calls == cancel_at  # nothing ran past the cancelled step
    assert saves == []  # never re-encoded
    if cancel_at <= 2:
        assert loads == []  # cancelled before any pixel decode


def test_big_jpeg_is_decoded_at_draft_scale(loads: list[tuple[str | None, tuple[int, int]]]) -> None:
    source = noisy((2400, 1600))
    policy = ImagePolicy(resize_max_pixels=60_000)  # -> 300x200, 1/8 of each side

    result = process_image(encode(source, "JPEG"), policy)
    assert result is not None and (result.width, result.height) == (300, 200)
    assert loads[0] == ("JPEG", (300, 200))  # libjpeg decoded at 1/8 scale: 1/64 of the pixels

    loads.clear()
    assert process_image(encode(source, "PNG"), policy) is not None
    assert loads[0] == ("PNG", (2400, 1600))  # no scaled decode for PNG

    loads.clear()
    policy = ImagePolicy(resize_max_pixels=600_000)  # -> ~949x632: 1/2 scale is the smallest covering it
    assert process_image(encode(source, "JPEG"), policy) is not None
    assert loads[0] == ("JPEG", (1200, 800))


def test_concurrent_calls_give_the_sequential_results() -> None:
    inputs = [
        encode(noisy((640, 480)), "JPEG"),
        encode(half_transparent(), "PNG"),
        animated_gif(3),
        encode(noisy((500, 300)), "WEBP"),
        encode(Image.new("CMYK", (300, 200), (0, 255, 255, 0)), "JPEG"),
    ] * 4
    policy = ImagePolicy(resize_max_pixels=20_000)
    expected = [process_image(data, policy) for data in inputs]
    barrier = threading.Barrier(4)

    def run(data: bytes) -> object:
        barrier.wait(timeout=120)  # four calls start together, every round (20 inputs, 4 threads)
        return process_image(data, policy)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, inputs))
    assert results == expected


def test_mime_table_covers_formats() -> None:
    assert set(MIME_BY_FORMAT) == set(ALLOWED_FORMATS)


def _task(policy: ImagePolicy, max_bytes: int = 1 << 24) -> MediaTask:
    return MediaTask("image", "messages[0].content[1]", max_bytes, policy, AudioPolicy())


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP"])
def test_an_image_is_judged_from_the_head_of_its_base64_where_its_header_decides(fmt: str) -> None:
    data = image_bytes(640, 480, fmt)
    verdict = judge_head(_task(ImagePolicy(validate="header")), Base64Ends(base64.b64encode(data)))
    assert verdict == Verdict(len(data), len(data), f"image/{fmt.lower()}".encode())
    # what the pool makes of the whole file is the same verdict
    assert run_task(_task(ImagePolicy(validate="header")), lambda: base64.b64encode(data), no_checkpoint) == verdict


def test_a_header_past_the_first_head_is_read_from_a_longer_one() -> None:
    """A camera's EXIF block (with its thumbnail) pushes a JPEG's frame header past the first 3 KiB."""
    exif = Image.Exif()
    exif[0x010E] = "x" * 40_000  # ImageDescription: a 40 KB APP1 before the frame header
    buf = io.BytesIO()
    Image.new("RGB", (640, 480), "teal").save(buf, "JPEG", exif=exif.tobytes())
    verdict = judge_head(_task(ImagePolicy(validate="header")), Base64Ends(base64.b64encode(buf.getvalue())))
    assert verdict is not None and verdict.sniffed_mime == b"image/jpeg"


@pytest.mark.parametrize("policy", [ImagePolicy(validate="full"), ImagePolicy(validate="header", resize_max_side=100)],
                         ids=["full", "resize"])
def test_an_image_whose_pixels_are_needed_is_left_to_the_pool(policy: ImagePolicy) -> None:
    assert judge_head(_task(policy), Base64Ends(base64.b64encode(image_bytes(640, 480, "JPEG")))) is None


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_formats_whose_frames_need_the_whole_file_are_left_to_the_pool(fmt: str) -> None:
    payload = Base64Ends(base64.b64encode(image_bytes(64, 48, fmt)))
    assert judge_head(_task(ImagePolicy(validate="header")), payload) is None


def test_the_head_judges_what_the_header_says_and_leaves_the_rest_to_the_backend() -> None:
    """Header validation reads the header and the end: a file corrupt between them, or base64 the backend will
    refuse there, passes; a bomb, a size over the item limit, a file cut short and base64 broken inside the
    head or the tail are refused as the pool refuses them."""
    grain = io.BytesIO()
    Image.frombytes("RGB", (640, 480), random.Random(5).randbytes(640 * 480 * 3)).save(grain, "PNG")
    data = grain.getvalue()  # far longer than the head and the tail read
    encoded = base64.b64encode(data)
    middle = len(encoded) // 2 // 4 * 4
    policy = ImagePolicy(validate="header", max_pixels=640 * 480)
    assert judge_head(_task(policy), Base64Ends(encoded[:middle] + b"AAAAAAAA" + encoded[middle + 8 :])) is not None
    assert judge_head(_task(policy), Base64Ends(encoded[:middle] + b"!!!!" + encoded[middle + 4 :])) is not None
    for payload, max_bytes, code in ((base64.b64encode(image_bytes(641, 480, "PNG")), 1 << 24, "image_too_large"),
                                     (encoded, 100, "media_too_large"),
                                     (base64.b64encode(data[:-30]), 1 << 24, "image_truncated"),
                                     (encoded[:-8] + b"!!!!====", 1 << 24, "invalid_base64"),
                                     (b"iVBOR!" + encoded[6:], 1 << 24, "invalid_base64")):
        with pytest.raises(MediaError) as refused:
            judge_head(_task(policy, max_bytes), Base64Ends(payload))
        assert (refused.value.code, refused.value.param) == (code, "messages[0].content[1]")
