"""Validate, and when asked downscale, client images with Pillow; runs in decode-pool threads.

Why it looks like this:

Security
  - Allowlist: only JPEG, PNG, WEBP, GIF and BMP are ever parsed. The format is sniffed from the magic
    bytes and Pillow is opened with ``formats=`` that single format, so no other plugin sees the bytes.
    Pillow's CVEs cluster in formats a vision model never needs (TIFF, PSD, EPS, J2K, FITS, ICNS...).
  - Bomb guard: width x height comes from the header and is checked against the policy before a single
    pixel is decoded; so is the frame count. Pillow's own guard only *warns* between 89 and 179 MP and
    is process-global, so it is switched off once at import and replaced by this exact per-policy
    check (no racy per-call mutation of Pillow or ``warnings`` state from several threads).
  - Truncated or corrupt files are refused (``LOAD_TRUNCATED_IMAGES`` stays off). A file cut short is refused
    from its last bytes (``formats.check_whole``), in both validation modes: header validation decodes no pixel,
    and full validation decodes only an animation's first frame.

Speed
  - An image that needs no change is never re-encoded: the caller forwards the original bytes.
  - JPEG draft mode: libjpeg decodes at 1/2, 1/4 or 1/8 scale (DCT scaling), the smallest that still
    covers the target, so a 12 MP photo bound for 1 MP is decoded as 3 MP and resized from there.
  - How many freed memory blocks Pillow keeps for reuse is process-global: ``proxy/runtime/memory.py`` sets it.
  - The resize runs before the EXIF rotation and the alpha handling, on the fewest pixels possible.

The handoff (with a model)
  - An image the model would shrink reaches the backend at the model's size where that costs the whole path
    less than the original does (``handoff.forward_original``: mmgate's decode, resize and encode, the bytes
    and the backend's decode, against the original's bytes and the backend's decode and resize of it), decided
    from the header: a 12 MP JPEG bound for 1.6 MP goes resized, a 6 MP one the model keeps nearly whole goes
    as it came.
  - The resize uses the model processor's own filter, and the file is lossless: an uncompressed BMP (a
    PNG where alpha must survive, which 32-bit BMP does not carry through Pillow). BMP is chosen by what the
    whole path pays (mmgate's encode, the bytes, the backend's decode): a small fraction of a JPEG q100
    4:4:4 re-encode's CPU, for a few more bytes on the sidecar's loopback, and the resize is then the only
    difference from the backend's own processing of the original (bench/fidelity.py; docs/model.md,
    "What it does"). ``MMGATE_IMAGE_FORMAT`` still picks another format; a JPEG then keeps 4:4:4 chroma
    at ``MODEL_JPEG_QUALITY``.
"""

from __future__ import annotations

import io
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from io import BytesIO

# Importing the five plugins registers exactly them, up front: Image.open never runs Pillow's lazy
# init() (which would import every plugin) from a worker thread.
from PIL import (
    BmpImagePlugin,  # noqa: F401
    ExifTags,
    GifImagePlugin,
    Image,
    JpegImagePlugin,  # noqa: F401
    PngImagePlugin,  # noqa: F401
    UnidentifiedImageError,
    WebPImagePlugin,  # noqa: F401
)

from .base import Checkpoint, ImagePolicy, Processed, no_checkpoint
from .dimensions import HEAD_STEPS, MAX_HEAD_BYTES, header_dimensions
from .errors import IMAGE_DECODE_FAILED, IMAGE_TOO_LARGE, TOO_MANY_FRAMES
from .formats import MIME_BY_FORMAT, TAIL_BYTES, check_whole, sniff_image_format
from .gif import gif_frames
from .handoff import handoff_target

# Our header check (exact, per policy, with a message naming the setting) replaces Pillow's global
# guard. Set once here, at import: never per call, never from a worker thread.
Image.MAX_IMAGE_PIXELS = None

# Without a model: after a draft decode BICUBIC is cheaper than LANCZOS and beats the naive
# full-resolution BICUBIC pipeline's quality; BILINEAR/HAMMING are cheaper still but alias visibly
# (bench/image_pipeline.py). With a model, its processor's own filter (``Geometry.resample``).
_RESAMPLE = Image.Resampling.BICUBIC
# resize() first box-reduces by a whole factor while >= 1.5x the target remains: for PNG/WEBP/GIF/BMP
# (no draft decode) that is most of the work saved on a large downscale, at about the JPEG draft path's
# quality; it does nothing after a draft decode (less than 2x left there). With a model the box reduction
# stops at 3x the target, which Pillow documents as indistinguishable from the full resample
# (bench/fidelity.py measures it against the processor's own resize).
_REDUCING_GAP = 1.5
_MODEL_REDUCING_GAP = 3.0
# JPEG quality where MMGATE_JPEG_QUALITY is auto (0). Without a model, 90 with 4:2:0 chroma: small files
# at no visible cost. With a model and MMGATE_IMAGE_FORMAT=jpeg, mmgate promises the backend what its own
# resize of the original would give: 4:4:4 chroma (4:2:0 halves the colour resolution the processor keeps)
# at the quality that holds the fidelity bound on high-detail photos (bench/fidelity.py: PSNR, bytes and
# CPU per encoding).
GENERIC_JPEG_QUALITY = 90
MODEL_JPEG_QUALITY = 100
# Formats whose size and frame count Pillow reads from the header alone (``judge_header``).
_HEADER_FORMATS = frozenset(("JPEG", "PNG", "BMP"))
# Formats Pillow opens only from the whole file: whether it is whole is checked before the open.
_OPENED_WHOLE = frozenset(("WEBP",))
_PNG_COMPRESS_LEVEL = 1  # fast: the output is consumed once, by the backend, on the same network

# EXIF orientation -> the transpose that makes the image upright (the table of ImageOps.exif_transpose).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_SIDES = frozenset((5, 6, 7, 8))

def process_image(
    data: bytes, policy: ImagePolicy, checkpoint: Checkpoint = no_checkpoint
) -> Processed | None:
    """Validate ``data``; downscale and re-encode it only when the policy's resize limits require it.

    Returns None when the image is valid and needs no change: the caller forwards the original string byte
    for byte (MIME and EXIF included), whatever ``policy.output_format`` says. Otherwise returns the
    re-encoded file: upright (EXIF orientation applied), metadata stripped, in the policy's format. Whether
    it will be re-encoded is decided from the header, before any pixel is decoded, and a re-encode is always
    what is sent: no work is done whose result is thrown away.

    ``validate="full"`` decodes the pixels (catches truncation); with a resize, the (draft) decode
    done for the resize is that validation. Animated images (GIF, WEBP, APNG) are checked from their
    headers and, for ``full``, their first frame is decoded; forwarded untouched when no resize is
    needed, and when one is, the output is the first frame as a still image (resizing every frame
    would multiply the work by the frame count for backends that mostly read frame 0 anyway).

    Raises MediaError for bad images and Cancelled (from ``checkpoint``, called between steps).
    Thread-safe: no shared state is touched after import.
    """
    checkpoint()
    fmt = sniff_image_format(data)
    if fmt in _OPENED_WHOLE:
        check_whole(fmt, data, data[-TAIL_BYTES:], len(data))
    with _decode_errors(fmt):
        img = Image.open(BytesIO(data), formats=(fmt,))
    try:
        if fmt not in _OPENED_WHOLE:  # a header Pillow could not read is corrupt (above), not cut short
            check_whole(fmt, data, data[-TAIL_BYTES:], len(data))
        width, height = img.size
        target = _checked_target(img, data, fmt, policy, len(data))
        checkpoint()
        if target is None:
            if policy.validate == "full":
                with _decode_errors(fmt):
                    img.load()
            return None
        with _decode_errors(fmt):
            draft = img.draft(None, target)  # JPEG only, else a no-op
            img.load()
        checkpoint()
        orientation = _orientation(img)
        geometry = policy.geometry
        small = _to_working_mode(img).resize(
            target,
            _RESAMPLE if geometry is None else Image.Resampling(geometry.resample),
            box=draft[1] if draft else None,
            reducing_gap=_REDUCING_GAP if geometry is None else _MODEL_REDUCING_GAP,
        )
    finally:
        img.close()  # frees the decoded pixels now, not when the garbage collector gets to them
    checkpoint()
    if orientation in _UPRIGHT:
        small = small.transpose(_UPRIGHT[orientation])
    if orientation in _SWAPS_SIDES:
        width, height = height, width
    out, mime = _encode(small, policy)
    return Processed(
        data=out,
        mime=mime,
        width=small.width,
        height=small.height,
        source_width=width,
        source_height=height,
    )


def judge_header(fmt: str, head: Callable[[int], bytes], tail: Callable[[int], bytes], size: int,
                 policy: ImagePolicy) -> str | None:
    """With header validation, the MIME type of an image of format ``fmt`` (as ``formats.sniff_image_format``
    names it) that its header alone decides: valid, and left as it is. ``head(n)`` gives the file's first ``n``
    bytes (fewer: the whole file), ``tail(n)`` its last ``n``, ``size`` its length; heads of
    ``dimensions.HEAD_STEPS`` and then ``MAX_HEAD_BYTES`` are tried, as the token count reads them. Every image's
    end is checked (``formats.check_whole``: a file cut short is refused here, whatever judges the rest). None
    where the header does not decide: an image to resize, a GIF or WebP (their frames, and Pillow's WebP opener,
    need the whole file), or a header past the longest head; ``process_image`` then judges the whole file, in a
    decode worker. Raises what ``process_image`` raises for the same header. Thread-safe, and cheap enough for
    the event loop (a Pillow open of a few KiB)."""
    if policy.validate != "header":
        return None
    if fmt not in _HEADER_FORMATS:
        check_whole(fmt, head(HEAD_STEPS[0]), tail(TAIL_BYTES), size)
        return None
    for head_bytes in (*HEAD_STEPS, MAX_HEAD_BYTES):
        data = head(head_bytes)
        whole = len(data) < head_bytes // 3 * 3
        try:
            img = Image.open(BytesIO(data), formats=(fmt,))
        except Exception:
            if not whole:
                continue  # the header goes on past this head
            with _decode_errors(fmt):
                raise
        with img:
            check_whole(fmt, data, tail(TAIL_BYTES), size)  # the head holds the header Pillow just read
            return MIME_BY_FORMAT[fmt] if _checked_target(img, data, fmt, policy, size) is None else None
    return None


def _checked_target(img: Image.Image, data: bytes, fmt: str, policy: ImagePolicy,
                    size: int) -> tuple[int, int] | None:
    """The header's checks (pixels, frames; with a model, the size the token count read) on the opened
    ``img`` of a ``size``-byte file, and the size to resize it to: None to keep it as it is."""
    width, height = img.size
    if width * height > policy.max_pixels:
        raise IMAGE_TOO_LARGE.error(
            f"image is {width}x{height} = {width * height} pixels, over the limit of "
            f"{policy.max_pixels} (MMGATE_MAX_IMAGE_PIXELS); downscale it before sending",
        )
    with _decode_errors(fmt):
        frames = _count_frames(img, data, policy.max_frames)
    if frames > policy.max_frames:
        raise TOO_MANY_FRAMES.error(
            f"image has more than {policy.max_frames} frames; "
            "send a still image or a shorter animation",
        )
    if policy.geometry is None:
        return fit_within(width, height, policy)
    _same_as_counted(data, fmt, width, height)
    return handoff_target(policy.geometry, fmt, size, width, height, _orientation(img), _may_carry_alpha(img),
                          policy.output_format)


def _may_carry_alpha(img: Image.Image) -> bool:
    """Whether the opened image may come out with alpha, read as ``proxy/media/forwarded.py`` reads it from the
    header, so the handoff rule decides the same there and here."""
    return img.format != "JPEG" and (img.has_transparency_data
                                     or img.mode in ("RGBA", "LA", "PA", "La", "RGBa"))


def _same_as_counted(data: bytes, fmt: str, width: int, height: int) -> None:
    """With a model, the image's tokens were counted from its header by ``dimensions`` before admission: a file
    whose size reads differently there and here (crafted to slip past the token budget) is refused. The
    orientation is not compared: Pillow also takes it from XMP, which the count does not read, and a swap of
    sides barely moves a count."""
    counted = header_dimensions(data)
    if counted is None:  # counted as the largest image: nothing to undercount
        return
    if (counted.width, counted.height) != (width, height):
        raise IMAGE_DECODE_FAILED.error(f"{fmt} headers disagree about the image's size")


@contextmanager
def _decode_errors(fmt: str) -> Iterator[None]:
    """Turn Pillow's many exception types for corrupt input into image_decode_failed."""
    try:
        yield
    except MemoryError:
        raise
    except Image.DecompressionBombError as e:  # only if something re-enabled Pillow's global guard
        raise IMAGE_TOO_LARGE.error(str(e)) from None
    except UnidentifiedImageError:  # the plugin rejected a header that had the right magic bytes
        raise IMAGE_DECODE_FAILED.error(
            f"{fmt} header is corrupt or truncated"
        ) from None
    except Exception as e:  # OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError...
        raise IMAGE_DECODE_FAILED.error(
            f"{fmt} image could not be decoded: {e or type(e).__name__}"
        ) from None


def _count_frames(img: Image.Image, data: bytes, limit: int) -> int:
    """The frame count from headers only, or ``limit + 1`` as soon as it is known to exceed ``limit``.

    APNG, WEBP and MPO store their count. A GIF does not, and Pillow's ``n_frames`` walks every frame header
    (a 32 MiB GIF of empty frames holds over a million): ``gif.gif_frames`` walks ``data``, what ``img`` was
    opened from, stopping one frame past the limit.
    """
    if isinstance(img, GifImagePlugin.GifImageFile):
        return gif_frames(data, limit)
    return getattr(img, "n_frames", 1)


def fit_within(width: int, height: int, policy: ImagePolicy) -> tuple[int, int] | None:
    """The largest size with the same aspect ratio within the resize limits; None if it fits already.

    Both limits (pixel count, longest side) are the same for either orientation, so the header size
    decides even when EXIF will rotate the image.
    """
    max_pixels, max_side = policy.resize_max_pixels, policy.resize_max_side
    scale = 1.0
    if max_pixels and width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
    if max_side and max(width, height) > max_side:
        scale = min(scale, max_side / max(width, height))
    if scale >= 1.0:
        return None
    w, h = max(1, round(width * scale)), max(1, round(height * scale))
    if max_pixels and w * h > max_pixels:  # rounding up, or the 1-pixel floor of a thin strip
        if w >= h:
            w = max(1, max_pixels // h)
        else:
            h = max(1, max_pixels // w)
    return w, h


def _orientation(img: Image.Image) -> int:
    """EXIF (or XMP) orientation, 1 when absent or unreadable."""
    try:
        return int(img.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception:  # a malformed EXIF block: viewers ignore it too, and re-encoding strips it
        return 1


def _to_working_mode(img: Image.Image) -> Image.Image:
    """RGB, RGBA, L or LA: what resize and every output encoder handle directly.

    Palette images (with transparency: GIF index, PNG tRNS) become RGB(A); CMYK becomes RGB; 1-bit
    becomes L; 16/32-bit grey (PNG I;16) is scaled, not clipped, to 8-bit L.
    """
    mode = img.mode
    if mode.startswith("I") or mode == "F":
        return img.point(lambda v: v / 256).convert("L")
    grey = mode in ("1", "L", "LA")
    if img.has_transparency_data:
        target = "LA" if grey else "RGBA"
    else:
        target = "L" if grey else "RGB"
    return img if mode == target else img.convert(target)


def _encode(img: Image.Image, policy: ImagePolicy) -> tuple[bytes, str]:
    """Encode ``img`` (RGB, RGBA, L or LA) as the policy says; returns the file bytes and MIME.

    ``auto``: with a model, BMP (lossless, the cheapest to write and to read), without one JPEG; PNG for
    either where alpha must survive. With a model a JPEG keeps full-resolution chroma (4:4:4); a WebP is
    always 4:2:0 when lossy."""
    if img.mode in ("RGBA", "LA") and img.getchannel("A").getextrema()[0] == 255:
        img = img.convert(img.mode[:-1])  # an alpha channel that is fully opaque carries nothing
    has_alpha = img.mode in ("RGBA", "LA")
    model = policy.geometry is not None
    fmt = policy.output_format
    if fmt == "auto":
        fmt = "png" if has_alpha else "bmp" if model else "jpeg"
    if fmt in ("jpeg", "bmp") and has_alpha:  # neither carries alpha (Pillow reads a 32-bit BMP as RGB)
        background = Image.new(img.mode[:-1], img.size, "white")
        background.paste(img, mask=img.getchannel("A"))
        img = background
    img.info.clear()  # no EXIF, ICC, XMP, text chunks, dpi: metadata is stripped on re-encode
    out = _scratch_file()
    quality = policy.jpeg_quality or (MODEL_JPEG_QUALITY if model else GENERIC_JPEG_QUALITY)
    try:
        if fmt == "jpeg":  # subsampling 0 is 4:4:4; -1 is Pillow's default, 4:2:0
            img.save(out, "JPEG", quality=quality, subsampling=0 if model else -1)
        elif fmt == "png":
            img.save(out, "PNG", compress_level=_PNG_COMPRESS_LEVEL)
        elif fmt == "bmp":
            img.save(out, "BMP")
        else:
            img.save(out, "WEBP", quality=quality)
        return os.pread(out.fileno(), out.tell(), 0), MIME_BY_FORMAT[fmt.upper()]
    finally:
        os.ftruncate(out.fileno(), 0)  # its pages go back now; the file stays for this thread's next image
        out.seek(0)


_scratch = threading.local()


def _scratch_file() -> io.FileIO:
    """This thread's encode target: a memfd, not a BytesIO, because Pillow encodes into a real file
    descriptor with the GIL released (``encode_to_file``) and into a BytesIO with it held, for the whole
    compression. ``os.pread`` then reads the file back, also with the GIL released."""
    out: io.FileIO | None = getattr(_scratch, "file", None)
    if out is None:
        out = _scratch.file = io.FileIO(os.memfd_create("mmgate-encode", os.MFD_CLOEXEC), "r+")
    return out
