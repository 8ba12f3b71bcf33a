"""The stub backend speaks each API well enough for the official SDKs, and decodes images like a VLM server.

Synchronisation is on the stub's own counters (``StubState.wait_for``), never on sleeps or durations.
"""

from __future__ import annotations

import asyncio
import base64
import io
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer
from PIL import Image

from demo.backend import STATE, StubConfig, StubState, create_stub_app

ROOT = Path(__file__).resolve().parents[2]


def png_b64(width: int, height: int, mode: str = "RGB") -> str:
    buf = io.BytesIO()
    Image.new(mode, (width, height), "red").save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def data_uri(width: int, height: int) -> str:
    return "data:image/png;base64," + png_b64(width, height)


def chat_image_messages(*urls: object) -> list[dict[str, object]]:
    parts: list[object] = [{"type": "text", "text": "what is this?"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


StartStub = Callable[..., Awaitable[TestServer]]


@pytest.fixture
def start_stub(aiohttp_server: Callable[..., Awaitable[TestServer]]) -> StartStub:
    async def start(**knobs: object) -> TestServer:
        return await aiohttp_server(create_stub_app(StubConfig(**knobs)))  # handler_cancellation=True

    return start


def state(server: TestServer) -> StubState:
    return server.app[STATE]


def oai(server: TestServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)


def claude(server: TestServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x", max_retries=0)


async def test_chat_non_stream_reports_image_sizes_and_tokens(start_stub: StartStub) -> None:
    server = await start_stub()
    async with oai(server) as client:
        out = await client.chat.completions.create(
            model="m", max_tokens=5, messages=chat_image_messages(data_uri(640, 480), "https://example.com/a.png"))
    assert out.object == "chat.completion" and out.model == "m" and out.id
    assert out.choices[0].message.content.startswith("stub answer: saw 2 image(s) [640x480, url]")
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens >= 640 * 480 // (28 * 28)  # image tokens included
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    stats = state(server).stats
    assert (stats["requests"], stats["images_decoded"], stats["image_urls"]) == (1, 1, 1)
    assert stats["request_body_bytes"] > len(png_b64(640, 480))


async def test_chat_stream_with_usage_chunk(start_stub: StartStub) -> None:
    server = await start_stub(tokens=4)
    async with oai(server) as client:
        stream = await client.chat.completions.create(
            model="m", stream=True, stream_options={"include_usage": True},
            messages=chat_image_messages(data_uri(32, 16)))
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("stub answer: saw 1 image(s) [32x16]")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.object == "chat.completion.chunk" for c in chunks)


async def test_completions_non_stream_and_stream(start_stub: StartStub) -> None:
    server = await start_stub()
    async with oai(server) as client:
        out = await client.completions.create(model="m", prompt="hello", max_tokens=3)
        assert out.choices[0].text.startswith("stub answer: saw 0 image(s)")
        assert out.usage.completion_tokens == 3
        stream = await client.completions.create(model="m", prompt="hello", max_tokens=3, stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == out.choices[0].text


async def test_responses_non_stream_and_stream(start_stub: StartStub) -> None:
    server = await start_stub(tokens=3)
    content = [{"type": "input_text", "text": "describe"},
               {"type": "input_image", "image_url": data_uri(100, 50), "detail": "auto"}]
    request = {"model": "m", "input": [{"role": "user", "content": content}]}
    async with oai(server) as client:
        out = await client.responses.create(**request)
        assert out.status == "completed" and out.usage.output_tokens == 3
        assert out.output_text.startswith("stub answer: saw 1 image(s) [100x50]")

        events = [e async for e in await client.responses.create(**request, stream=True)]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert deltas == out.output_text == events[-1].response.output_text

        async with client.responses.stream(**request) as helper:
            final = await helper.get_final_response()
        assert final.output_text == out.output_text

        bare = await client.responses.create(model="m", instructions="be brief", input=[
            {"type": "input_image", "image_url": "https://example.com/c.png", "detail": "auto"}])
        assert bare.output_text.startswith("stub answer: saw 1 image(s) [url]")


async def test_anthropic_non_stream_and_stream(start_stub: StartStub) -> None:
    server = await start_stub()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64(20, 10)}}
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/b.jpg"}}
    messages = [{"role": "user", "content": [image, url, {"type": "text", "text": "what?"}]}]
    async with claude(server) as client:
        msg = await client.messages.create(model="claude-x", max_tokens=6, messages=messages)
        assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "end_turn"
        assert msg.content[0].text.startswith("stub answer: saw 2 image(s) [20x10, url]")
        assert msg.usage.output_tokens == 6 and msg.usage.input_tokens >= 1

        async with client.messages.stream(model="claude-x", max_tokens=6, messages=messages) as stream:
            pieces = [piece async for piece in stream.text_stream]
            final = await stream.get_final_message()
    assert "".join(pieces) == msg.content[0].text == final.content[0].text
    assert final.usage.output_tokens == 6


async def test_models_and_health_toggle(start_stub: StartStub) -> None:
    server = await start_stub()
    async with oai(server) as client:
        assert [m.id async for m in client.models.list()] == ["stub-vlm"]
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        async with http.get("/health") as resp:
            assert (resp.status, await resp.text()) == (200, "ok")
        async with http.post("/stub/health", json={"healthy": False}) as resp:
            assert resp.status == 200
        async with http.get("/health") as resp:
            assert resp.status == 503
        async with http.post("/stub/config", json={"tokens": 2, "healthy": True}) as resp:
            assert (await resp.json())["tokens"] == 2
        async with http.get("/health") as resp:
            assert resp.status == 200
        for bad in ({"tokens": "many"}, {"nope": 1}, {"tokens": 0}, {"hold_pixels": 1}):
            async with http.post("/stub/config", json=bad) as resp:
                assert resp.status == 400, bad
        async with http.post("/generate", json={"text": "x"}) as resp:
            assert (await resp.json())["meta_info"]["completion_tokens"] == 2
        async with http.post("/stub/reset") as resp:
            assert (await resp.json())["requests"] == 0


async def test_generate_with_image_data_list(start_stub: StartStub) -> None:
    server = await start_stub()
    body = {"text": "<image><image> describe", "image_data": [data_uri(30, 20), png_b64(8, 8)],
            "sampling_params": {"max_new_tokens": 4}}
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        async with http.post("/generate", json=body) as resp:
            out = await resp.json()
        assert out["text"].startswith("stub answer: saw 2 image(s) [30x20, 8x8]")
        assert out["meta_info"]["completion_tokens"] == 4
        async with http.post("/generate", json=body | {"stream": True}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            lines = [line async for line in resp.content if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]\n"
    assert b'"text":"' + out["text"].encode() + b'"' in lines[-2]


async def test_hold_pixels_peak_then_released(start_stub: StartStub) -> None:
    server = await start_stub(hold_pixels=True)
    async with oai(server) as client:
        await client.chat.completions.create(model="m", messages=chat_image_messages(data_uri(64, 48)))
    await state(server).wait_for(lambda s: s["held_pixel_bytes"] == 0 and s["active_requests"] == 0)
    assert state(server).stats["peak_held_pixel_bytes"] == 64 * 48 * 3


@pytest.mark.parametrize("hold", [True, False])
async def test_pixels_held_while_streaming_and_disconnect_counted(start_stub: StartStub, hold: bool) -> None:
    # token_delay is effectively forever: the stream stays open after the first token until we leave.
    server = await start_stub(hold_pixels=hold, token_delay=3600, tokens=2)
    body = {"model": "m", "stream": True, "messages": chat_image_messages(data_uri(40, 30))}
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        resp = await http.post("/v1/chat/completions", json=body)
        while b"stub answer" not in await resp.content.readline():
            pass
        stats = state(server).stats
        assert stats["active_requests"] == 1 and stats["peak_held_pixel_bytes"] == 40 * 30 * 3
        assert stats["held_pixel_bytes"] == (40 * 30 * 3 if hold else 0)
        resp.close()  # client disconnect mid-stream
    await state(server).wait_for(lambda s: s["aborted_requests"] == 1 and s["active_requests"] == 0)
    assert state(server).stats["held_pixel_bytes"] == 0


async def test_disconnect_before_first_token_is_counted(start_stub: StartStub) -> None:
    server = await start_stub(first_token_delay=3600)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        task = asyncio.create_task(http.post("/v1/chat/completions", json={"messages": []}))
        await state(server).wait_for(lambda s: s["active_requests"] == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await state(server).wait_for(lambda s: s["aborted_requests"] == 1 and s["active_requests"] == 0)


async def test_bad_images_are_400_in_each_api_shape(start_stub: StartStub) -> None:
    server = await start_stub()
    async with oai(server) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", messages=chat_image_messages(
                data_uri(4, 4), "data:image/png;base64," + base64.b64encode(b"not an image").decode()))
        assert err.value.status_code == 400
        assert err.value.body["code"] == "image_decode_failed" and err.value.body["param"] == "messages[0].content[2]"
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", messages=chat_image_messages("data:image/png;base64,@@@"))
        assert err.value.body["code"] == "invalid_image"
    async with claude(server) as aclient:
        bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        with pytest.raises(anthropic.BadRequestError) as aerr:
            await aclient.messages.create(model="c", max_tokens=4, messages=[{"role": "user", "content": [bad]}])
        assert aerr.value.body["type"] == "error"
        assert aerr.value.body["error"]["type"] == "invalid_request_error"
        assert "messages[0].content[0]" in aerr.value.body["error"]["message"]
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        async with http.post("/v1/chat/completions", data=b"{not json") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_json"
        async with http.get("/stats") as resp:
            stats = await resp.json()
    assert stats["bad_requests"] == 4 and stats["held_pixel_bytes"] == 0 and stats["active_requests"] == 0


async def test_cpu_burn_and_alpha_images_answer(start_stub: StartStub) -> None:
    server = await start_stub(cpu_ms_per_mp=5.0, workers=2)
    rgba = "data:image/png;base64," + png_b64(50, 40, "RGBA")
    async with oai(server) as client:
        outs = await asyncio.gather(*(client.chat.completions.create(
            model="m", max_tokens=2, messages=chat_image_messages(rgba)) for _ in range(3)))
    assert all(o.choices[0].message.content.startswith("stub answer: saw 1 image(s) [50x40]") for o in outs)
    assert state(server).stats["images_decoded"] == 3


def test_cli_prints_address_and_exits_cleanly_on_sigterm() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "demo.backend", "--port", "0", "--tokens", "3"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("stub backend listening on http://127.0.0.1:")
        port = int(line.rsplit(":", 1)[1])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="m", prompt="hi")
        assert out.usage.completion_tokens == 3
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def test_cli_rejects_bad_values() -> None:
    proc = subprocess.run([sys.executable, "-m", "demo.backend", "--workers", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "workers" in proc.stderr


def test_cli_port_in_use_is_one_line_and_exit_2() -> None:
    """A port another process holds: one line naming the address and the flag, no traceback, status 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "demo.backend", "--port", str(port)],
                              cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"stub backend: cannot listen on 127.0.0.1:{port}: address already in use (--host / --port)\n"
    assert proc.stdout == ""


def test_cli_frontend_profile_sets_its_knobs_and_a_given_knob_wins() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "demo.backend", "--port", "0", "--profile", "frontend",
                             "--tokens", "3"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        port = int(line.rsplit(":", 1)[1])
        import json
        import urllib.request

        request = urllib.request.Request(f"http://127.0.0.1:{port}/stub/config", data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            config = json.loads(answer.read())
        assert (config["workers"], config["cpu_ms_per_mp"], config["first_token_delay"], config["tokens"]) == (
            1, 20.0, 0.02, 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
