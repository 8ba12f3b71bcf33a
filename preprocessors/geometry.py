"""A served model's own image geometry: the size its processor resizes an image to, as plain data.

With ``MMGATE_MODEL`` set, ``proxy/media/model.py`` reads the model's image processor configuration and builds one
of these. They are frozen dataclasses of integers (picklable, so a decode worker in another process can hold
one) that call the resize helpers of ``transformers`` itself, imported when first used: the rules are the
processor's, not a copy of them.

Sizes are ``(width, height)`` of the image as the backend sees it: upright, after its EXIF orientation
(vLLM applies it before the processor runs). ``resize_target`` turns that into what a decode worker does
with the image as stored.

A decode worker in another process need not import ``transformers`` at all (about a second of its start-up,
and tens of MB): the proxy, which loaded the processor anyway, works out ``resize_target`` from each image's
header before the image goes to a worker, and the task carries the answers (``planned_targets``; the worker
opens them with ``known_targets``). A size the proxy could not read from the header is worked out in the
worker, importing the helpers then.

Each also carries the processor's ``resample``, the filter its PIL backend resizes with (LANCZOS for
Idefics3/SmolVLM, BICUBIC for Qwen and LLaVA, BILINEAR for Gemma 3): a decode worker resizes with that
filter, so the image the backend receives is close to what the processor would make of the original
(``docs/tuning.md``, "Image format and quality").
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import IMAGE_UNSUPPORTED_BY_MODEL, MediaError

# EXIF orientations whose transpose swaps width and height.
SWAPS_SIDES = frozenset((5, 6, 7, 8))
# PIL.Image.Resampling.BICUBIC: what a processor that names no filter of its own resizes with.
BICUBIC = 3


class Geometry(Protocol):
    """What the model's processor makes of an upright ``width`` x ``height`` image."""

    @property
    def family(self) -> str: ...

    @property
    def resample(self) -> int:
        """The processor's resize filter, a ``PIL.Image.Resampling`` value."""
        ...

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        """The ``(width, height)`` the processor resizes the image to (it may be larger: it upscales)."""
        ...


# (stored width, height, EXIF orientation, the size ``resize_target`` gives or None): its answers for one image.
KnownTargets = tuple[tuple[int, int, int, tuple[int, int] | None], ...]
_Table = dict[tuple[int, int, int], tuple[int, int] | None]
# The answers of the image being judged in this thread (a context variable: each decode thread its own).
_ANSWERS: ContextVar[_Table | None] = ContextVar("resize_targets", default=None)


@contextmanager
def known_targets(known: KnownTargets = ()) -> Iterator[None]:
    """Within: ``resize_target`` answers from ``known`` first, and keeps what it works out for the next call."""
    token = _ANSWERS.set({(w, h, orientation): target for w, h, orientation, target in known})
    try:
        yield
    finally:
        _ANSWERS.reset(token)


def planned_targets(geometry: Geometry, width: int, height: int) -> KnownTargets:
    """``resize_target``'s answers a decode worker needs for a stored ``width`` x ``height`` image, under each
    EXIF orientation (Pillow may find one the header did not say: in XMP, or past the head); worked out once
    for the sides as stored and once turned. A size the processor refuses is left out (the worker refuses it)."""
    known = []
    for turned in (False, True):
        try:
            target = resize_target(geometry, width, height, 6 if turned else 1)
        except MediaError:
            continue
        known += [(width, height, orientation, target) for orientation in range(1, 9)
                  if (orientation in SWAPS_SIDES) == turned]
    return tuple(known)


def upright(width: int, height: int, orientation: int) -> tuple[int, int]:
    """The size of a stored ``width`` x ``height`` image once its EXIF ``orientation`` is applied."""
    return (height, width) if orientation in SWAPS_SIDES else (width, height)


def resize_target(geometry: Geometry, width: int, height: int, orientation: int) -> tuple[int, int] | None:
    """The size to resize a stored image to (before its EXIF transpose), or None to forward it as it is.

    The target is exactly what the model's processor would produce, so the backend's own resize is a no-op.
    mmgate never enlarges: where the processor would make either side larger than the image has, the image is
    forwarded unchanged and the backend upscales it itself. Answered from the table ``known_targets`` opened,
    if one is (and recorded there).
    """
    answers = _ANSWERS.get()
    if answers is None:
        return _resize_target(geometry, width, height, orientation)
    key = (width, height, orientation)
    if key not in answers:
        answers[key] = _resize_target(geometry, width, height, orientation)
    return answers[key]


def _resize_target(geometry: Geometry, width: int, height: int, orientation: int) -> tuple[int, int] | None:
    up_w, up_h = upright(width, height, orientation)
    out_w, out_h = model_size(geometry, up_w, up_h)
    if out_w > up_w or out_h > up_h or (out_w, out_h) == (up_w, up_h):
        return None
    keeps_tokens = getattr(geometry, "resize_keeps_tokens", None)  # tiled families: a resize may change the tiles
    if keeps_tokens is not None and not keeps_tokens(up_w, up_h, out_w, out_h):
        return None
    return (out_h, out_w) if orientation in SWAPS_SIDES else (out_w, out_h)


def model_size(geometry: Geometry, width: int, height: int) -> tuple[int, int]:
    """``geometry.backend_size``, with the processor's own refusal (Qwen's aspect ratio over 200) as a
    MediaError: the backend would refuse the image, so mmgate does, in the client's API shape."""
    try:
        return geometry.backend_size(width, height)
    except ValueError as error:
        raise IMAGE_UNSUPPORTED_BY_MODEL.error(
            f"the served model's processor refuses a {width}x{height} image: {error}") from None


def _helper(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, slots=True)
class QwenVL:
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL: both sides a multiple of ``patch_size * merge_size`` (28 or 32), the
    pixel count within ``[min_pixels, max_pixels]`` (``smart_resize``)."""

    family: str
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    resample: int = BICUBIC

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        smart_resize = _helper("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", "smart_resize")
        h, w = smart_resize(height, width, factor=self.patch_size * self.merge_size,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return int(w), int(h)


@dataclass(frozen=True, slots=True)
class Idefics3:
    """Idefics3 and SmolVLM: the longest edge brought to ``longest_edge`` (up or down), then, with splitting,
    both sides rounded up to whole ``tile`` px tiles (``resize_for_vision_encoder``); without splitting, one
    ``tile`` square."""

    family: str
    module: str  # the transformers module whose helpers apply (idefics3's or smolvlm's PIL processor)
    longest_edge: int
    tile: int
    split: bool
    resample: int = BICUBIC

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        if not self.split:
            return self.tile, self.tile
        to_max_len = _helper(self.module, "_resize_output_size_rescale_to_max_len")
        below_bound = _helper(self.module, "_resize_output_size_scale_below_upper_bound")
        h, w = to_max_len(height, width, max_len=self.longest_edge)
        h, w = below_bound(h, w, max_len=_helper(self.module, "MAX_IMAGE_SIZE"))
        return _vision_encoder_size(w, h, self.tile)


def _vision_encoder_size(width: int, height: int, tile: int) -> tuple[int, int]:
    """``resize_for_vision_encoder`` of the Idefics3/SmolVLM processors works on a pixel array; this is its
    size arithmetic, step for step (tests check it against the processor on random sizes)."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = int(width / aspect_ratio)
        height = math.ceil(height / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = int(height * aspect_ratio)
        width = math.ceil(width / tile) * tile
    return width, height


@dataclass(frozen=True, slots=True)
class ShortestEdge:
    """LLaVA 1.5: the shortest edge brought to ``shortest_edge`` (``get_resize_output_image_size`` with
    ``default_to_square=False``), then a centre crop the backend takes from that. With ``pad_to_square``
    (``LlavaImageProcessor``'s ``do_pad``) the image is first padded to a square, so the longest edge is the
    one brought to ``shortest_edge``."""

    family: str
    shortest_edge: int
    pad_to_square: bool = False
    resample: int = BICUBIC

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        if self.pad_to_square:  # the padded square is resized to shortest_edge; the image within it scales so
            edge, longest = self.shortest_edge, max(width, height)
            if width >= height:
                return edge, max(1, round(height * edge / longest))
            return max(1, round(width * edge / longest)), edge
        numpy = importlib.import_module("numpy")
        resize_size = _helper("transformers.image_transforms", "get_resize_output_image_size")
        # The helper reads the size off an array: a zero-channel one costs no memory.
        h, w = resize_size(numpy.empty((height, width, 0), dtype=numpy.uint8), self.shortest_edge,
                           default_to_square=False, input_data_format="channels_last")
        return int(w), int(h)


@dataclass(frozen=True, slots=True)
class Square:
    """Gemma 3 (without pan-and-scan): every image becomes one ``width`` x ``height`` square (896 px)."""

    family: str
    width: int
    height: int
    resample: int = BICUBIC

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        return self.width, self.height


@dataclass(frozen=True, slots=True)
class LlavaNext:
    """LLaVA-NeXT's any-res grid: the grid resolution that keeps the most of the image
    (``select_best_resolution`` over ``image_grid_pinpoints``, ``(height, width)`` pairs), the image brought
    within it keeping its aspect ratio (``get_patch_output_size``), padded, and cut into ``tile`` px patches,
    beside one ``tile`` square of the whole image (which any size makes the same).

    The token count depends on the size of the image it is given, not only on the grid (the padding it
    "unpads" is worked out from the original aspect ratio), so a resize can shift it by a row of patches:
    ``resize_keeps_tokens`` says whether the processor's own patch size counts as the original does, and
    where it does not, the image is forwarded as it is."""

    family: str
    pinpoints: tuple[tuple[int, int], ...]
    tile: int  # the base square and the patch side (size.shortest_edge / crop_size)
    patch_size: int  # the vision tower's patch (14)
    extra_tokens: int  # num_additional_image_tokens, less the one the "default" feature strategy drops
    resample: int = BICUBIC
    max_patches: int = 0  # LLaVA-OneVision's anyres_max_N: a grid past N base squares' patches is pooled down

    def _best(self, width: int, height: int) -> tuple[int, int]:
        select = _helper("transformers.image_processing_utils", "select_best_resolution")
        best_h, best_w = select((height, width), [list(p) for p in self.pinpoints])
        return int(best_w), int(best_h)

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        numpy = importlib.import_module("numpy")
        output_size = _helper("transformers.image_processing_utils", "get_patch_output_size")
        channels_last = _helper("transformers.image_utils", "ChannelDimension").LAST
        best_w, best_h = self._best(width, height)
        # The helper reads the size off an array: a zero-channel one costs no memory.
        h, w = output_size(numpy.empty((height, width, 0), dtype=numpy.uint8), (best_h, best_w), channels_last)
        return int(w), int(h)

    def tokens(self, width: int, height: int) -> int:
        """What ``LlavaNextProcessor`` counts for an image of this size (``LlavaOnevisionProcessor`` with
        ``max_patches``): its grid's patches, unpadded, one newline token a row, and the base square's patches.
        The arithmetic is the processors', step for step; tests check it against them."""
        best_w, best_h = self._best(width, height)
        side = self.tile // self.patch_size
        rows, columns = side * (best_h // self.tile), side * (best_w // self.tile)
        if width / height > columns / rows:  # wider than the grid: padded above and below
            rows -= (rows - int(round(height * (columns / width), 7))) // 2 * 2
        else:
            columns -= (columns - int(round(width * (rows / height), 7))) // 2 * 2
        unpadded, newlines = rows * columns, rows
        if self.max_patches:  # pooled down past max_patches base squares' patches
            ratio = math.sqrt(rows * columns / (self.max_patches * side * side))
            if ratio > 1.1:
                unpadded, newlines = int(rows // ratio) * int(columns // ratio), int(rows // ratio)
        return unpadded + newlines + side * side + self.extra_tokens

    def resize_keeps_tokens(self, width: int, height: int, out_w: int, out_h: int) -> bool:
        """Whether an image resized from ``width`` x ``height`` to ``out_w`` x ``out_h`` lands in the same grid
        resolution and makes the same tokens."""
        return (self._best(out_w, out_h) == self._best(width, height)
                and self.tokens(out_w, out_h) == self.tokens(width, height))


@dataclass(frozen=True, slots=True)
class Tiles:
    """InternVL's tiles (``GotOcr2ImageProcessor`` with ``crop_to_patches``): the grid of ``tile`` px tiles whose
    aspect ratio is nearest the image's, within ``min_tiles``–``max_tiles`` (``get_optimal_tiled_canvas``), the
    image resized to the whole grid and cut, beside a thumbnail of the whole image where the grid has more than
    one tile. Without cropping, one ``tile`` square.

    The grid is chosen from the size (a tie between grids of one aspect ratio goes by area), so a resize to the
    grid is made only where the processor picks the same grid of the resized image (``resize_keeps_tokens``)."""

    family: str
    tile_width: int
    tile_height: int
    min_tiles: int
    max_tiles: int
    crop: bool
    resample: int = BICUBIC

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """``(columns, rows)`` of tiles the processor cuts the image into (``(1, 1)``: one square, no thumbnail)."""
        if not self.crop or self.max_tiles <= 1:
            return 1, 1
        canvas = _helper("transformers.models.got_ocr2.image_processing_pil_got_ocr2", "get_optimal_tiled_canvas")
        columns, rows = canvas((height, width), (self.tile_height, self.tile_width), self.min_tiles, self.max_tiles)
        return int(columns), int(rows)

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        columns, rows = self.grid(width, height)
        return columns * self.tile_width, rows * self.tile_height

    def resize_keeps_tokens(self, width: int, height: int, out_w: int, out_h: int) -> bool:
        return self.grid(out_w, out_h) == self.grid(width, height)


@dataclass(frozen=True, slots=True)
class PatchGrid:
    """Pixtral and Mistral 3: the image brought within ``longest_edge`` (never enlarged), then both sides rounded
    up to whole ``patch`` px patches (the vision patch times the spatial merge; ``get_resize_output_image_size``
    of the Pixtral processor). The rounding up can make a side a little larger than the image's: such an image
    is forwarded as it is. A strip whose short side scales to under a pixel is refused, as the processor does."""

    family: str
    longest_edge: int
    patch: int
    resample: int = BICUBIC

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        numpy = importlib.import_module("numpy")
        resize_size = _helper("transformers.models.pixtral.image_processing_pil_pixtral",
                              "get_resize_output_image_size")
        # The helper reads the size off an array: a zero-channel one costs no memory.
        h, w = resize_size(numpy.empty((height, width, 0), dtype=numpy.uint8), (self.longest_edge, self.longest_edge),
                           (self.patch, self.patch), input_data_format="channels_last")
        if not w or not h:  # the processor's resize to a side of 0 px fails
            raise ValueError(f"a side scaled within {self.longest_edge} px is under one pixel")
        return int(w), int(h)


@dataclass(frozen=True, slots=True)
class PanAndScan:
    """Gemma 3 with pan-and-scan: a ``width`` x ``height`` square of the whole image and, where its aspect ratio
    reaches ``min_ratio``, one more square of each of 2 to ``max_crops`` crops along its long side, each at least
    ``min_crop_size`` px (the Gemma 3 image processor's ``pan_and_scan``). An image without crops is resized to the
    square; one with crops goes as it is, since the square would have none (``resize_keeps_tokens``)."""

    family: str
    width: int
    height: int
    min_crop_size: int
    max_crops: int
    min_ratio: float
    resample: int = BICUBIC

    def crops(self, width: int, height: int) -> int:
        """How many crops the processor cuts beside the whole image (0: none)."""
        numpy = importlib.import_module("numpy")
        processor = _helper("transformers.models.gemma3.image_processing_pil_gemma3", "Gemma3ImageProcessorPil")
        # The method reads the size off a channels-first array and slices it: a zero-channel one costs nothing.
        return len(processor.pan_and_scan(None, numpy.empty((0, height, width), dtype=numpy.uint8),
                                          self.min_crop_size, self.max_crops, self.min_ratio))

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        return self.width, self.height

    def resize_keeps_tokens(self, width: int, height: int, out_w: int, out_h: int) -> bool:
        return self.crops(out_w, out_h) == self.crops(width, height)


@dataclass(frozen=True, slots=True)
class MllamaTiles:
    """Llama 3.2 Vision: the canvas of ``tile`` px tiles, up to ``max_tiles``, that scales the image least
    (``get_optimal_tiled_canvas`` of the Mllama processor), the image fitted within it keeping its aspect ratio
    (``get_image_size_fit_to_canvas``; a side under a tile is brought up to one), then padded and cut. A resize
    is made only where the fitted image takes the same canvas (``resize_keeps_tokens``)."""

    family: str
    tile: int
    max_tiles: int
    resample: int = BICUBIC

    def canvas(self, width: int, height: int) -> tuple[int, int]:
        """``(columns, rows)`` of tiles."""
        canvas = _helper("transformers.models.mllama.image_processing_pil_mllama", "get_optimal_tiled_canvas")
        canvas_h, canvas_w = canvas(height, width, self.max_tiles, self.tile)
        return int(canvas_w) // self.tile, int(canvas_h) // self.tile

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        fit = _helper("transformers.models.mllama.image_processing_pil_mllama", "get_image_size_fit_to_canvas")
        columns, rows = self.canvas(width, height)
        h, w = fit(height, width, rows * self.tile, columns * self.tile, self.tile)
        return int(w), int(h)

    def resize_keeps_tokens(self, width: int, height: int, out_w: int, out_h: int) -> bool:
        return self.canvas(out_w, out_h) == self.canvas(width, height)


@dataclass(frozen=True, slots=True)
class Glm4v:
    """GLM-4.1V, GLM-4.5V, GLM-4.6V: Qwen's rule with GLM's ``smart_resize`` (an image counts as a pair of frames
    against ``max_pixels``, and a side under ``patch_size * merge_size`` is first scaled up to it)."""

    family: str
    module: str  # the transformers module whose smart_resize applies (glm4v's or glm46v's PIL processor)
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    resample: int = BICUBIC

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        smart_resize = _helper(self.module, "smart_resize")
        h, w = smart_resize(num_frames=self.temporal_patch_size, height=height, width=width,
                            temporal_factor=self.temporal_patch_size, factor=self.patch_size * self.merge_size,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return int(w), int(h)


@dataclass(frozen=True, slots=True)
class SmartResize:
    """PaddleOCR-VL: Qwen's rule with the family's own ``smart_resize`` (a side under ``factor`` is first scaled
    up to it): both sides multiples of ``factor``, the pixels within ``[min_pixels, max_pixels]``."""

    family: str
    module: str  # the transformers module whose smart_resize applies
    factor: int
    min_pixels: int
    max_pixels: int
    resample: int = BICUBIC

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        h, w = _helper(self.module, "smart_resize")(height, width, self.factor, min_pixels=self.min_pixels,
                                                    max_pixels=self.max_pixels)
        return int(w), int(h)


@dataclass(frozen=True, slots=True)
class PatchBudget:
    """Gemma 4: the image scaled, up or down, to the most pixels within ``max_patches`` patches of ``patch_size``,
    both sides whole multiples of ``pooling_kernel_size`` patches (``get_aspect_ratio_preserving_size``). Scaling
    to fill the budget means the processor may scale mmgate's output again: a resize is made only where the
    processor leaves the resized image as it is (``resize_keeps_tokens``)."""

    family: str
    patch_size: int
    max_patches: int
    pooling_kernel_size: int
    resample: int = BICUBIC

    def backend_size(self, width: int, height: int) -> tuple[int, int]:
        size = _helper("transformers.models.gemma4.image_processing_pil_gemma4", "get_aspect_ratio_preserving_size")
        h, w = size(height, width, self.patch_size, self.max_patches, self.pooling_kernel_size)
        return int(w), int(h)

    def resize_keeps_tokens(self, width: int, height: int, out_w: int, out_h: int) -> bool:
        return self.backend_size(out_w, out_h) == (out_w, out_h)
