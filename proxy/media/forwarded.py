"""What a request will forward upstream, from its image headers alone, before a pixel is decoded.

An image mmgate rewrites is forwarded as a new file whose size depends on what mmgate makes of it, not on what
the client sent: a solid-colour 5000x4000 PNG of 67 KB becomes, for Qwen2.5-VL (12.8 MP), a 38 MB BMP. So the
size of a rewritten image is worked out from what its header says (width, height, EXIF orientation, whether it
may carry alpha), the resize the policy or the served model's geometry asks for (``geometry.resize_target``,
or the generic limits; with a model, ``handoff.handoff_target``, which also forwards as it is an original that
costs the path less than its resize) and the handoff format (``image._encode``'s choice: BMP with a model, JPEG
without, PNG where alpha must survive, or ``MMGATE_IMAGE_FORMAT``):

- BMP: exact (24-bit rows padded to 4 bytes; an 8-bit grey one with its palette is smaller);
- PNG: the filtered rows stored uncompressed, and deflate's and the chunks' overhead: what level 1 makes of
  noise;
- JPEG, WebP: the raw pixels (3 bytes each, 4 for WebP with alpha), what a lossy encoder stays under except on
  noise at quality 100, whose bytes the media step checks again before anything is forwarded
  (``MediaStep``).

``ForwardEstimate`` holds, per item, the base64 bytes mmgate would forward in its place (0: forwarded as it
came) and the whole body's bound: the body as received, less the tokens rewritten, plus the new ones. The
media step refuses a body whose bound passes MMGATE_MAX_BODY_MB with 413 ``body_too_large`` before anything is
hashed, admitted or decoded, and weighs each item's forwarded bytes at the gate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from preprocessors.base import ImagePolicy
from preprocessors.dimensions import Dimensions
from preprocessors.errors import MediaError
from preprocessors.geometry import QwenVL, Square
from preprocessors.handoff import handoff_target
from preprocessors.header import Header
from preprocessors.image import fit_within
from proxy.payload.item import MediaItem

# What a rewritten token adds besides its base64: ``"data:image/jpeg;base64,"`` and its quotes, or an
# Anthropic ``media_type`` rewritten beside it.
TOKEN_OVERHEAD = 64
# A BMP's file and info headers, and the palette of an 8-bit grey one.
_BMP_HEADERS = 14 + 40 + 1024
# A PNG's signature, IHDR and IEND, zlib's wrapper, and slack for the rest.
_PNG_HEADERS = 4096
# A JPEG's headers and tables (about 600 bytes), a WebP's RIFF and VP8 headers.
_LOSSY_HEADERS = 4096
# Sides of a JPEG's MCU at 4:2:0: the encoder codes whole blocks.
_JPEG_BLOCK = 16


def base64_length(size: int) -> int:
    """Characters of the padded base64 of ``size`` bytes."""
    return 4 * -(-size // 3)


def encoded_bytes(width: int, height: int, alpha: bool, policy: ImagePolicy) -> int:
    """At most how many bytes the file of a ``width`` x ``height`` image re-encoded as the policy says takes
    (``image._encode``: ``auto`` is PNG with alpha, else BMP with a model and JPEG without)."""
    fmt = policy.output_format
    if fmt == "auto":
        fmt = "png" if alpha else "bmp" if policy.geometry is not None else "jpeg"
    if fmt == "bmp":  # 24-bit rows padded to 4 bytes (alpha is flattened: Pillow writes no 32-bit BMP to read)
        return _BMP_HEADERS + (width * 24 + 31) // 32 * 4 * height
    if fmt == "png":  # each row its filter byte and its pixels; level 1 deflate stores what it cannot shrink
        raw = height * (1 + width * (4 if alpha else 3))
        return raw + raw // 128 + _PNG_HEADERS
    if fmt == "jpeg":  # alpha is flattened; whole blocks coded
        blocks = math.ceil(width / _JPEG_BLOCK) * math.ceil(height / _JPEG_BLOCK)
        return blocks * _JPEG_BLOCK * _JPEG_BLOCK * 3 + _LOSSY_HEADERS
    return width * height * (4 if alpha else 3) + _LOSSY_HEADERS  # webp


def forwarded_file_bytes(header: Header | None, policy: ImagePolicy) -> int:
    """At most how many bytes of file mmgate forwards in place of an image with this header: 0 when it goes as
    it came (or is refused). An image whose head does not say its size counts as the largest the policy can
    make: the pixel cap of the model (Qwen's ``max_pixels``, a fixed square) or of the generic resize, within
    MMGATE_MAX_IMAGE_PIXELS."""
    if header is None or not policy.resizes:
        return 0
    found = header.dimensions
    if found is None:
        side = math.isqrt(_largest_output_pixels(policy)) + 1
        return encoded_bytes(side, side, header.alpha, policy)
    try:
        target = _target(found, policy, header)
    except MediaError:  # the model's processor refuses it: so does the decode
        return 0
    if target is None:
        return 0
    width, height = target  # as stored: an EXIF rotation may swap the sides the file is written with
    return max(encoded_bytes(width, height, header.alpha, policy), encoded_bytes(height, width, header.alpha, policy))


def _target(found: Dimensions, policy: ImagePolicy, header: Header) -> tuple[int, int] | None:
    """The size the decode resizes to (``image._checked_target``), or None to forward the image as it is."""
    if policy.geometry is not None:
        return handoff_target(policy.geometry, header.format, header.file_bytes, found.width, found.height,
                              found.orientation, header.alpha, policy.output_format)
    return fit_within(found.width, found.height, policy)


def _largest_output_pixels(policy: ImagePolicy) -> int:
    """The most pixels a resized image can have under ``policy`` (never more than it had)."""
    largest = policy.max_pixels
    geometry = policy.geometry
    if isinstance(geometry, QwenVL):
        largest = min(largest, geometry.max_pixels)
    elif isinstance(geometry, Square):
        largest = min(largest, geometry.width * geometry.height)
    elif geometry is None:
        if policy.resize_max_pixels:
            largest = min(largest, policy.resize_max_pixels)
        if policy.resize_max_side:
            largest = min(largest, policy.resize_max_side ** 2)
    return largest


@dataclass(slots=True)
class ForwardEstimate:
    """What one request will forward: per item (by its plan index) the base64 bytes of the file mmgate sends in
    its place (0: the item goes as it came), and the body's bound."""

    received: int  # the body as it arrived
    replaced: dict[int, int] = field(default_factory=dict)  # item index -> base64 bytes forwarded in its place
    token_bytes: dict[int, int] = field(default_factory=dict)  # item index -> bytes of its token in the body

    def set(self, item: MediaItem, encoded: int) -> None:
        """Item ``item`` is forwarded as ``encoded`` base64 bytes (0: as it came)."""
        self.replaced[item.index] = encoded
        if item.span is not None:
            self.token_bytes[item.index] = item.span.end - item.span.start

    def of(self, index: int) -> int:
        """The base64 bytes forwarded in place of the item at plan index ``index`` (0: it goes as it came)."""
        return self.replaced.get(index, 0)

    @property
    def body_bytes(self) -> int:
        """At most how many bytes the forwarded body has: each rewritten token replaced by its new one."""
        grown = sum(encoded + TOKEN_OVERHEAD - self.token_bytes.get(index, 0)
                    for index, encoded in self.replaced.items() if encoded)
        return self.received + max(0, grown)


def estimate(items: Sequence[MediaItem], headers: Mapping[int, Header | None], received: int,
             policy: ImagePolicy) -> ForwardEstimate:
    """What ``items`` (inline, and fetched once read; each image's ``headers`` by plan index, an inline one's
    read where the policy resizes) will forward, from their headers. Only a rewritten image changes size: audio
    and video go as they came, and a fetched body goes as its bytes in base64 at least."""
    forward = ForwardEstimate(received)
    for item in items:
        if item.span is None or (item.source == "fetched" and item.fetched is None):
            continue  # nothing of it is rewritten (a literal), or not known before the fetch
        if item.fetched is not None:
            file = len(item.fetched)
            if item.kind == "image":
                file = max(file, forwarded_file_bytes(headers.get(item.index), policy))
            forward.set(item, base64_length(file))
        elif item.kind == "image" and policy.resizes:  # else no inline image is re-encoded: no header to read
            file = forwarded_file_bytes(headers.get(item.index), policy)
            forward.set(item, base64_length(file) if file else 0)
    return forward
