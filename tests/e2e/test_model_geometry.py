"""MMGATE_MODEL against a real vLLM: mmgate resizes to the tiny Idefics3's own geometry and counts its tokens.

The proof the geometry is right is vLLM's own count: ``usage.prompt_tokens`` is identical whether an image goes
to vLLM directly or through mmgate with ``--model`` (mmgate resized it to exactly what the processor makes; an
image the processor would enlarge went through unchanged). The estimate (``mmgate_image_tokens``) moves exactly as
vLLM's count does from one image to another (vLLM serves one image per prompt here, so differences it is).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from functools import cache

import pytest
from openai import OpenAI
from PIL import Image

from testkit import vllm as h

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

# (width, height, EXIF orientation): what each size shows
SIZES = {
    "upscaled_by_the_backend": (640, 480, 1),  # Idefics3 brings it to a 1456 px edge: forwarded as it is
    # 1456x1092, but the model keeps more than half of each side: no JPEG draft applies, so the original costs the
    # path less than mmgate's decode, resize and BMP would (preprocessors/handoff.py): forwarded as it is
    "kept_nearly_whole": (2000, 1500, 1),
    "resized_by_mmgate": (4000, 3000, 1),  # a 12 MP camera JPEG to 1456x1092: decoded at half scale, a BMP goes
    "strip_enlarged_on_one_side": (3000, 300, 1),  # 1456x364 would be taller than 300 px: forwarded
    "rotated_photo_resized_upright": (4000, 3000, 6),  # EXIF 6: the backend sees 3000x4000 either way
}


@cache
def photo(width: int, height: int, orientation: int) -> bytes:
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buf = io.BytesIO()
    h.photo_like(width, height, seed=width * 3 + height).save(buf, "JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()


def prompt_tokens(server: h.Server, image: bytes) -> int:
    """vLLM's count for one user turn: the image, then the same text."""
    uri = h.data_uri(image, "image/jpeg")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "Describe this image."}]}]
    sdk = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = sdk.chat.completions.create(model=h.SERVED_MODEL, max_tokens=1, messages=messages)  # type: ignore[arg-type]
    assert r.usage is not None
    return r.usage.prompt_tokens


def counted(gate: h.Server, image: bytes) -> tuple[int, int, float, float]:
    """Through mmgate: vLLM's prompt tokens, mmgate's image-token count, media bytes in and out."""
    m0 = gate.metrics("/mmgate/metrics")
    tokens = prompt_tokens(gate, image)
    m1 = gate.metrics("/mmgate/metrics")

    def delta(name: str, **labels: str) -> float:
        return h.metric_sum(m1, name, **labels) - h.metric_sum(m0, name, **labels)

    return (tokens, int(delta("mmgate_image_tokens_sum")), delta("mmgate_media_bytes_total", direction="in"),
            delta("mmgate_media_bytes_total", direction="out"))


@pytest.fixture(scope="module")
def model_gate(start_gate: Callable[..., h.Server]) -> h.Server:
    folder = h.DEFAULT_DIR / "tiny-idefics3"
    if not (folder / "processor_config.json").is_file():
        reason = f"{folder} has no processor_config.json (run tests/e2e/setup_vllm.sh)"
        if os.environ.get("MMGATE_REQUIRE_HEAVY") == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return start_gate("--model", str(folder))


@pytest.mark.parametrize("name", sorted(SIZES))
def test_prompt_tokens_equal_direct_and_through_mmgate(model_gate: h.Server, vllm: h.Server, name: str) -> None:
    data = photo(*SIZES[name])
    through, estimate, bytes_in, bytes_out = counted(model_gate, data)
    assert through == prompt_tokens(vllm, data)
    # The estimate moves exactly as vLLM's count does from one image to another (same text around both).
    small = photo(320, 240, 1)
    through_small, estimate_small, _, _ = counted(model_gate, small)
    assert estimate - estimate_small == through - through_small
    assert estimate > 0
    if name.startswith(("resized", "rotated")):
        assert bytes_out != bytes_in  # rewritten at the model's size (a BMP)
    else:
        assert bytes_out == bytes_in  # forwarded byte for byte
