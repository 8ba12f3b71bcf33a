"""Whether an image is whole, told from its last bytes (``formats.check_whole``), on the two paths that read it:
the loop's header judge, from the base64 (``job.judge_head``), and the decode worker, from the file
(``image.process_image``). Files real encoders write pass, with what cameras and tools append after them; every
cut of them is refused."""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, PngImagePlugin

from preprocessors.base import AudioPolicy, ImagePolicy
from preprocessors.dataurl import Base64Ends
from preprocessors.errors import MediaError
from preprocessors.formats import TAIL_BYTES, check_whole, sniff_image_format
from preprocessors.image import process_image
from preprocessors.job import MediaTask, judge_head
from tests.preprocessors.conftest import expect_error, noisy

HEADER = ImagePolicy(validate="header")
FULL = ImagePolicy(validate="full")


def encoded(img: Image.Image | list[Image.Image], fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    if isinstance(img, list):
        img[0].save(out, fmt, save_all=True, append_images=img[1:], duration=60, loop=0, **options)
    else:
        img.save(out, fmt, **options)
    return out.getvalue()


def real_files() -> dict[str, bytes]:
    exif = Image.Exif()
    exif[0x0112] = 3
    with_exif_thumbnail = io.BytesIO()
    noisy((96, 64)).save(with_exif_thumbnail, "JPEG", exif=exif.tobytes())
    after_idat = PngImagePlugin.PngInfo()
    after_idat.add_text("note", "x" * 500, zip=True)
    frames = [noisy((64, 48)) for _ in range(3)]
    return {
        "jpeg": encoded(noisy((96, 64)), "JPEG"),
        "jpeg with exif": with_exif_thumbnail.getvalue(),
        "progressive jpeg": encoded(noisy((96, 64)), "JPEG", progressive=True),
        "optimized progressive jpeg": encoded(noisy((96, 64)), "JPEG", progressive=True, optimize=True),
        "grey jpeg with restart markers": encoded(noisy((96, 64), "L"), "JPEG", restart_marker_blocks=2),
        "png": encoded(noisy((64, 48)), "PNG"),
        "png with chunks after idat": encoded(noisy((64, 48)), "PNG", pnginfo=after_idat),
        "apng": encoded(frames, "PNG"),
        "gif": encoded(noisy((64, 48)).convert("P"), "GIF"),
        "animated gif": encoded(frames, "GIF"),
        "lossy webp": encoded(noisy((64, 48)), "WEBP", quality=60),
        "lossless webp": encoded(noisy((64, 48)), "WEBP", lossless=True),
        "animated webp": encoded(frames, "WEBP"),
        "bmp": encoded(noisy((32, 24)), "BMP"),
    }


REAL = real_files()


def task() -> MediaTask:
    return MediaTask("image", "messages[0].content[1]", 1 << 24, HEADER, AudioPolicy())


# The ways a file is judged: on the loop from its base64, in a worker with each validation.
JUDGES: dict[str, Callable[[bytes], object]] = {
    "loop": lambda data: judge_head(task(), Base64Ends(base64.b64encode(data))),
    "worker, header": lambda data: process_image(data, HEADER),
    "worker, full": lambda data: process_image(data, FULL),
}


def passes(judge: str, data: bytes) -> None:
    try:
        JUDGES[judge](data)
    except MediaError as error:
        pytest.fail(f"{judge} refused a whole file: {error.code}: {error.message}")


@pytest.mark.parametrize("judge", sorted(JUDGES))
@pytest.mark.parametrize("name", sorted(REAL))
def test_whole_files_pass(name: str, judge: str) -> None:
    passes(judge, REAL[name])


@pytest.mark.parametrize("judge", sorted(JUDGES))
@pytest.mark.parametrize("name", sorted(set(REAL) - {"bmp"}))
def test_zero_padding_after_the_end_passes(name: str, judge: str) -> None:
    passes(judge, REAL[name] + bytes(4096))


@pytest.mark.parametrize("judge", sorted(JUDGES))
@pytest.mark.parametrize("trailer", [b"\r\n", b"SEFH" + bytes(range(256)) * 8 + b"SEFT", b"\xff\xd9" * 3],
                         ids=["line break", "camera metadata", "second end marker"])
@pytest.mark.parametrize("name", ["jpeg with exif", "progressive jpeg", "png with chunks after idat"])
def test_a_short_trailer_after_a_jpeg_or_png_passes(name: str, trailer: bytes, judge: str) -> None:
    passes(judge, REAL[name] + trailer)


@pytest.mark.parametrize("judge", sorted(JUDGES))
def test_a_motion_photo_passes(judge: str) -> None:
    """A JPEG, then an MP4 far longer than the tail read: the tail holds bytes no JPEG scan holds."""
    video = b"\x00\x00\x00\x18ftypmp42" + random.Random(7).randbytes(3 * TAIL_BYTES)
    passes(judge, REAL["progressive jpeg"] + video)


@settings(max_examples=60)
@given(st.data())
@pytest.mark.parametrize("judge", sorted(JUDGES))
@pytest.mark.parametrize("name", sorted(set(REAL) - {"bmp"}))
def test_every_cut_is_refused(name: str, judge: str, data: st.DataObject) -> None:
    """Cut anywhere: refused, as cut short once the header is read (a cut inside the header cannot be read)."""
    whole = REAL[name]
    cut = data.draw(st.integers(12, len(whole) - 1), label="cut")
    if name.endswith("gif") and whole[:cut].rstrip(b"\x00").endswith(b"\x00;"):
        return  # LZW data that happens to end like a GIF's last block: the limit of the check, documented
    with pytest.raises(MediaError) as refused:
        JUDGES[judge](whole[:cut])
    assert refused.value.code in ("image_truncated", "image_decode_failed")


@pytest.mark.parametrize("judge", sorted(JUDGES))
@pytest.mark.parametrize(("name", "said"), [
    ("jpeg with exif", "JPEG ends without its end-of-image marker (FFD9)"),
    ("optimized progressive jpeg", "JPEG ends without its end-of-image marker (FFD9)"),
    ("png with chunks after idat", "PNG ends without its IEND chunk"),
    ("animated gif", "GIF ends without its trailer (0x3B)"),
    ("animated webp", "its RIFF header says"),
])
def test_a_file_cut_past_its_header_is_refused_as_cut_short(name: str, said: str, judge: str) -> None:
    whole = REAL[name]
    error = expect_error("image_truncated", lambda: JUDGES[judge](whole[: len(whole) * 3 // 4]))
    assert said in error.message


@settings(max_examples=200)
@given(st.binary(min_size=1, max_size=TAIL_BYTES - 2))
def test_any_trailer_within_the_tail_after_a_jpeg_or_png_passes(trailer: bytes) -> None:
    for name in ("progressive jpeg", "png with chunks after idat"):
        data = REAL[name] + trailer
        check_whole(sniff_image_format(data), data, data[-TAIL_BYTES:], len(data))


@pytest.mark.parametrize("judge", sorted(JUDGES))
def test_a_jpeg_cut_just_past_an_embedded_thumbnail_is_not_taken_for_whole(judge: str) -> None:
    """A thumbnail inside an APP segment has its own end marker: only one after the scans begin counts."""
    thumbnail = encoded(noisy((64, 48)), "JPEG")
    segment = b"\xff\xe1" + (len(thumbnail) + 9).to_bytes(2, "big") + b"Thumbs\x00" + thumbnail
    photo = REAL["jpeg"]
    data = photo[:2] + segment + photo[2:]
    passes(judge, data)
    scans = data.index(b"\xff\xda", 2 + len(segment))
    assert b"\xff\xd9" in data[:scans]
    error = expect_error("image_truncated", lambda: JUDGES[judge](data[: scans + 40]))
    assert error.message.startswith("JPEG ends without")


def test_the_loop_reads_only_the_tail_of_a_long_payload() -> None:
    """Base64 broken between the head and the tail is not read (the backend decodes it): only the ends are."""
    whole = encoded(noisy((256, 256)), "PNG")
    assert len(whole) > 4 * TAIL_BYTES
    text = bytearray(base64.b64encode(whole))
    middle = len(text) // 2 // 4 * 4
    text[middle : middle + 4] = b"!!!!"
    assert judge_head(task(), Base64Ends(bytes(text))) is not None
