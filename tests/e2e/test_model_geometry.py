"""MMGATE_MODEL against a real vLLM: mmgate resizes to the tiny Idefics3's own geometry and counts its tokens.

The proof the geometry is right is vLLM's own count: ``usage.prompt_tokens`` is identical whether an image goes
to vLLM directly or through mmgate with ``--model`` (mmgate resized it to exactly what the processor makes; an
image the processor would enlarge went through unchanged). The proof the estimate is right: the tokens vLLM
adds for an image (two images minus one) equal what mmgate counted for it, seen in ``mmgate_image_tokens``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import cache

import pytest
from PIL import Image

from testkit import vllm as h

from .conftest import unavailable
from .test_real_vllm import MODEL, client, gate_metrics, image_messages

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

# (width, height, EXIF orientation): what each size shows
SIZES = {
    "upscaled_by_the_backend": (640, 480, 1),  # Idefics3 brings it to a 1456 px edge: forwarded as it is
    "resized_by_mmgate": (2000, 1500, 1),  # 1456x1092: three rows of 364 px tiles, a downscale
    "strip_enlarged_on_one_side": (3000, 300, 1),  # 1456x364 would be taller than 300 px: forwarded
    "rotated_photo_resized_upright": (2400, 1800, 6),  # EXIF 6: the backend sees 1800x2400, mmgate sends upright
}


@cache
def photo(width: int, height: int, orientation: int) -> bytes:
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buf = io.BytesIO()
    h.photo_like(width, height, seed=width * 3 + height).save(buf, "JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()


def prompt_tokens(server: h.Server, *images: bytes) -> int:
    messages = image_messages(h.data_uri(images[0], "image/jpeg"))
    for extra in images[1:]:
        messages[0]["content"].insert(1, {"type": "image_url",  # type: ignore[attr-defined]
                                          "image_url": {"url": h.data_uri(extra, "image/jpeg")}})
    r = client(server).chat.completions.create(model=MODEL, max_tokens=1, messages=messages)  # type: ignore[arg-type]
    assert r.usage is not None
    return r.usage.prompt_tokens


@pytest.fixture(scope="module")
def model_gate(start_gate: Callable[..., h.Server]) -> h.Server:
    folder = h.DEFAULT_DIR / "tiny-idefics3"
    if not (folder / "processor_config.json").is_file():
        unavailable(f"{folder} has no processor_config.json (run tests/e2e/setup_vllm.sh)")
    return start_gate("--model", str(folder))


@pytest.mark.parametrize("name", sorted(SIZES))
def test_prompt_tokens_equal_direct_and_through_mmgate(model_gate: h.Server, vllm: h.Server, name: str) -> None:
    data = photo(*SIZES[name])
    small = photo(320, 240, 1)
    m0 = gate_metrics(model_gate)
    through = prompt_tokens(model_gate, data)
    assert through == prompt_tokens(vllm, data)
    m1 = gate_metrics(model_gate)
    counted = h.metric_sum(m1, "mmgate_image_tokens_sum") - h.metric_sum(m0, "mmgate_image_tokens_sum")
    # What vLLM adds for this image: the same message with one more image, minus the message without it.
    assert counted == prompt_tokens(vllm, small, data) - prompt_tokens(vllm, small)
    bytes_in = h.metric_sum(m1, "mmgate_media_bytes_total", direction="in") - h.metric_sum(
        m0, "mmgate_media_bytes_total", direction="in")
    bytes_out = h.metric_sum(m1, "mmgate_media_bytes_total", direction="out") - h.metric_sum(
        m0, "mmgate_media_bytes_total", direction="out")
    if name.startswith(("resized", "rotated")):
        assert bytes_out < bytes_in
    else:
        assert bytes_out == bytes_in  # forwarded byte for byte
