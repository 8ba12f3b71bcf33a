"""With a model: whether an image the model shrinks goes to the backend as the client sent it or as mmgate's resize.

Either way the backend's processor ends with the same pixels and the same tokens: it brings the original to the
model's size itself (``geometry.resize_target`` is exactly that size), and a handoff already at that size is left
as it is. What differs is the work on the way, and the rule picks the path that costs less in all:

* **the original**: its bytes (base64 written, parsed and decoded), the backend's decode of the whole file, and
  its resize of every source pixel to the model's size;
* **the handoff**: mmgate's decode (a JPEG at its draft scale, ``image.process_image``'s ``draft``) and resize,
  its encode of the handoff (BMP, PNG where alpha must survive, or ``MMGATE_IMAGE_FORMAT``), the handoff's bytes,
  and the backend's decode of it.

So an image the model keeps nearly whole (a 3000x2000 photo under Qwen2.5-VL's 12.8 MP) goes as it came: the
handoff would repeat the decode and resize in mmgate and add an uncompressed file eight times the JPEG's bytes.
One the model shrinks a lot (a 12 MP camera JPEG to Idefics3's 1456 px edge, or to Gemma 3's 896 px square)
goes as the handoff: libjpeg decodes it at half scale or less, and the backend then decodes a small BMP instead
of resizing 12 MP. Where no draft applies (the model keeps more than half of a side, or the file is no JPEG),
both paths decode and resize the same pixels once, so the handoff wins only where its file is smaller than the
original's: it never forwards more bytes than the client sent there.

It reads the header only (format, file size, stored width and height, the target), so it decides before any
pixel is decoded, and ``proxy/media/forwarded.py``'s estimate calls the same function.
"""

from __future__ import annotations

from .geometry import Geometry, resize_target

# Milliseconds of one CPU per megapixel, measured by ``python -m testkit.handoff_calibration`` (thread CPU time,
# medians; 3000x2000 and 4000x3000 photo-like images, 2 shared cores, Pillow 11 with libjpeg-turbo). Only their ratios
# matter: the rule compares two sums of them.
DECODE_MS_PER_MP = {"JPEG": 3.7, "PNG": 27.0, "WEBP": 19.5, "BMP": 1.2, "GIF": 5.7}
# A JPEG decoded at a draft scale still reads every coefficient: per megapixel of the file, not of the output.
JPEG_DRAFT_MS_PER_MP = {1: 3.7, 2: 2.6, 4: 2.3, 8: 2.0}
RESIZE_MS_PER_SOURCE_MP = 11.9  # the processors' filters (BICUBIC measured); a source pixel is read once
ENCODE_MS_PER_MP = {"bmp": 1.5, "png": 78.6, "jpeg": 8.5, "webp": 128.6}
# The handoff file's bytes per pixel on photos (BMP exact: 24-bit; the others what the bench's photos make).
HANDOFF_BYTES_PER_PIXEL = {"bmp": 3.0, "png": 1.75, "jpeg": 1.35, "webp": 0.47}
# Base64 encode, the backend's JSON parse of the string and its base64 decode, per megabyte of file.
BYTES_MS_PER_MB = 3.5

_DRAFT_SCALES = (8, 4, 2, 1)


def draft_scale(source_format: str, width: int, height: int, target_w: int, target_h: int) -> int:
    """The scale a JPEG's draft decode reduces a stored ``width`` x ``height`` image by for a resize to
    ``target_w`` x ``target_h`` (Pillow's JPEG draft: the largest of 8, 4, 2 that still covers the
    target); 1 for other formats."""
    if source_format != "JPEG":
        return 1
    fits = min(width // max(1, target_w), height // max(1, target_h))
    return next(scale for scale in _DRAFT_SCALES if fits >= scale)


def original_cost_ms(source_format: str, source_bytes: int, width: int, height: int) -> float:
    """What forwarding the original costs the path: its bytes, the backend's decode and resize of every pixel."""
    mp = width * height / 1e6
    return (source_bytes / 1e6 * BYTES_MS_PER_MB + mp * DECODE_MS_PER_MP.get(source_format, DECODE_MS_PER_MP["PNG"])
            + mp * RESIZE_MS_PER_SOURCE_MP)


def handoff_cost_ms(source_format: str, width: int, height: int, target: tuple[int, int],
                    handoff_format: str) -> float:
    """What forwarding mmgate's resize costs the path: mmgate's decode (at the draft scale) and resize, its
    encode, the handoff's bytes and the backend's decode of it."""
    mp = width * height / 1e6
    target_mp = target[0] * target[1] / 1e6
    scale = draft_scale(source_format, width, height, *target)
    if source_format == "JPEG":
        decode = mp * JPEG_DRAFT_MS_PER_MP[scale]
    else:
        decode = mp * DECODE_MS_PER_MP.get(source_format, DECODE_MS_PER_MP["PNG"])
    fmt = handoff_format if handoff_format in ENCODE_MS_PER_MP else "png"
    handoff_mb = target_mp * HANDOFF_BYTES_PER_PIXEL[fmt]
    return (decode + mp / (scale * scale) * RESIZE_MS_PER_SOURCE_MP + target_mp * ENCODE_MS_PER_MP[fmt]
            + handoff_mb * BYTES_MS_PER_MB + target_mp * DECODE_MS_PER_MP[fmt.upper()])


def forward_original(source_format: str, source_bytes: int, width: int, height: int, target: tuple[int, int],
                     handoff_format: str) -> bool:
    """Whether a stored ``width`` x ``height`` image of ``source_bytes`` bytes in ``source_format`` (as
    ``formats.sniff_image_format`` names it), which the model brings to ``target`` (as stored), costs the path
    less forwarded as it is than as a ``handoff_format`` file (``bmp``, ``png``, ``jpeg``, ``webp``) at
    ``target``. A tie goes to the original: it changes nothing."""
    return (original_cost_ms(source_format, source_bytes, width, height)
            <= handoff_cost_ms(source_format, width, height, target, handoff_format))


def handoff_format(output_format: str, alpha: bool) -> str:
    """The format ``image._encode`` writes a model's handoff in: ``MMGATE_IMAGE_FORMAT``, or with ``auto`` PNG
    where alpha may survive and BMP otherwise."""
    if output_format != "auto":
        return output_format
    return "png" if alpha else "bmp"


def handoff_target(geometry: Geometry, source_format: str, source_bytes: int, width: int, height: int,
                   orientation: int, alpha: bool, output_format: str) -> tuple[int, int] | None:
    """The size mmgate resizes a stored image to (``resize_target``), or None where it forwards it as it is:
    the model keeps it as it is, or the original costs the path less than the handoff (``forward_original``).
    ``alpha``: whether the header says the image may carry alpha; ``output_format``: ``MMGATE_IMAGE_FORMAT``."""
    target = resize_target(geometry, width, height, orientation)
    if target is None:
        return None
    if forward_original(source_format, source_bytes, width, height, target, handoff_format(output_format, alpha)):
        return None
    return target
