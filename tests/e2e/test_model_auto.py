"""MMGATE_MODEL unset (auto) in front of a real vLLM serving the tiny Idefics3 from a folder inside
MMGATE_MODEL_DIRS: mmgate asks vLLM which model it serves (``/v1/models``' ``root`` is the folder) and runs in the
model mode by itself. The proof is vLLM's own count: an image mmgate shrinks to the model's size makes the same
``usage.prompt_tokens`` as the original sent to vLLM directly, and what mmgate forwarded is not the original.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from testkit import vllm as h
from tests.e2e.test_model_geometry import counted, photo, prompt_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def served_model(gate: h.Server) -> dict[str, Any]:
    status, body = h.http_get(gate.url + "/mmgate/stats")
    assert status == 200
    served: dict[str, Any] = json.loads(body)["served_model"]
    return served


def test_unset_model_finds_the_folder_vllm_loaded_and_runs_in_the_model_mode(
        start_gate: Callable[..., h.Server], vllm: h.Server) -> None:
    folder = h.DEFAULT_DIR / "tiny-idefics3"
    gate = start_gate("--model-dirs", str(h.DEFAULT_DIR))
    deadline = time.monotonic() + 120  # the lookup runs in the background: readiness does not wait for it
    while (served := served_model(gate))["family"] is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served["mode"] == "auto" and served["family"] == "idefics3", served
    assert served["served"] == h.SERVED_MODEL and served["folder"] == str(folder.resolve())
    data = photo(4000, 3000, 1)  # Idefics3 brings it to 1456x1092: mmgate resizes it (the handoff pays)
    through, estimate, bytes_in, bytes_out = counted(gate, data)
    assert through == prompt_tokens(vllm, data) and estimate > 0 and bytes_out != bytes_in
