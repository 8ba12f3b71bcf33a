"""Image tokens of a planned request, from the image headers alone, before admission.

Each inline image's stored size and EXIF orientation are read from the first bytes of its base64
(``preprocessors.dimensions``), then the served model's processor says how many tokens the backend makes of
it (``model.Model.image_tokens``): what the image will cost the backend's prefill and KV cache, known before a
pixel is decoded. A resized image counts the same as its source (mmgate resizes to exactly the processor's
size), and an image mmgate forwards unchanged counts what the backend's processor makes of it. An image whose
head does not say its size (not an image, or a header past the first megabyte) counts the most tokens one
image can make, so the budget errs on the safe side; the decode worker then refuses or measures it. A media
URL mmgate fetches (MMGATE_MEDIA_URLS=fetch) counts the most too: its header is not known before admission.
An image the processor itself refuses (Qwen: an aspect ratio over 200) is 400 ``image_unsupported_by_model``.
"""

from __future__ import annotations

from preprocessors.dataurl import Base64Ends
from preprocessors.dimensions import peek_dimensions
from preprocessors.errors import MediaError
from proxy.media.model import Model
from proxy.payload.locate import Plan, inline_value


def plan_image_tokens(model: Model, plan: Plan, body: bytes) -> list[int]:
    """Image tokens of each item of ``plan`` (0 for audio and video), in plan order."""
    counts = []
    view = memoryview(body)
    for item in plan.items:
        if item.kind != "image":
            counts.append(0)
            continue
        span = item.span
        if span is not None and not span.escaped:
            payload: bytes | memoryview = view[span.start + 1 + item.payload_offset : span.end - 1]
        else:
            payload = inline_value(body, item)[item.payload_offset :]
        found = peek_dimensions(Base64Ends(payload).head)
        if found is None:
            counts.append(model.most_tokens)
            continue
        try:
            counts.append(model.image_tokens(found.width, found.height, found.orientation))
        except MediaError as error:
            raise error.at(item.path) from None
    return counts
