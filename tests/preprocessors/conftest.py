"""Helpers of the preprocessor tests: images synthesised with Pillow, the pixel decodes observed by wrapping
``ImageFile.load``, and a MediaError expected by its code."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
from PIL import Image, ImageFile

from preprocessors.errors import MediaError


def encode(img: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **params)
    return buf.getvalue()


def decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def noisy(size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    """Photo-like enough that JPEG keeps real entropy-coded data (so truncation is visible)."""
    return Image.effect_noise(size, 60).convert(mode)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, tuple[int, int]]]:
    """Every pixel decode: (format, size at the moment load() runs -- the draft size for JPEG)."""
    calls: list[tuple[str | None, tuple[int, int]]] = []
    original = ImageFile.ImageFile.load

    def counting(self: ImageFile.ImageFile) -> object:
        calls.append((self.format, self.size))
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting)
    return calls


def expect_error(code: str, fn: Callable[[], object]) -> MediaError:
    with pytest.raises(MediaError) as info:
        fn()
    assert info.value.code == code, info.value.message
    return info.value
