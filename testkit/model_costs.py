"""What serving a model's geometry costs mmgate per image, timed in this process (``bench/model_tokens.py``):

- ``estimate_us``: the image-token estimate the plan step adds on the event loop before admission: the head of
  the base64 decoded, the header parsed (``preprocessors.dimensions``), the served model's processor asked for
  the tokens (``proxy.media.model.Model.image_tokens``); wall time, a few µs a call.
- ``cpu_ms``: a decode worker's whole job on one image (``process_image`` under an ``ImagePolicy``), in thread
  CPU time: the steady figure on a shared machine.
"""

from __future__ import annotations

import time

from preprocessors.base import ImagePolicy
from preprocessors.dataurl import Base64Ends
from preprocessors.dimensions import peek_dimensions
from preprocessors.image import process_image
from proxy.media.model import Model


def estimate_us(model: Model, payload: bytes, count: int) -> float:
    """Microseconds per image for the header read of the base64 ``payload`` and the token count, over ``count``."""
    started = time.perf_counter()
    for _ in range(count):
        found = peek_dimensions(Base64Ends(payload).head)
        assert found is not None
        model.image_tokens(found.width, found.height, found.orientation)
    return (time.perf_counter() - started) / count * 1e6


def cpu_ms(data: bytes, policy: ImagePolicy, count: int) -> float:
    """Thread CPU milliseconds per image for the decode worker's whole job, over ``count``."""
    started = time.thread_time()
    for _ in range(count):
        process_image(data, policy)
    return (time.thread_time() - started) / count * 1000
