"""The official SDKs through mmgate to the built-in stub backend: nothing changes for the client."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer

from demo.backend import StubConfig, create_stub_app
from tests.conftest import Proxy, StartProxy


@pytest.fixture
async def stub() -> Any:
    server = TestServer(create_stub_app(StubConfig(tokens=8)), host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


@pytest.fixture
async def via_proxy(stub: TestServer, start_proxy: StartProxy) -> Proxy:
    return await start_proxy(f"http://127.0.0.1:{stub.port}")


MESSAGES = [{"role": "user", "content": "Hello there"}]


async def test_openai_sync_client(via_proxy: Proxy) -> None:
    def call() -> str:
        client = openai.OpenAI(base_url=via_proxy.url + "/v1", api_key="k", max_retries=0)
        reply = client.chat.completions.create(model="stub", messages=MESSAGES)  # type: ignore[arg-type]
        return reply.choices[0].message.content or ""

    text = await asyncio.to_thread(call)  # the sync client blocks: keep it off the servers' loop
    assert text.startswith("stub answer: saw 0 image(s)")


async def test_openai_async_client_and_stream(via_proxy: Proxy) -> None:
    client = openai.AsyncOpenAI(base_url=via_proxy.url + "/v1", api_key="k", max_retries=0)
    reply = await client.chat.completions.create(model="stub", messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    stream = await client.chat.completions.create(  # type: ignore[call-overload]
        model="stub", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    deltas = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
    assert len(deltas) >= 8 and "".join(d or "" for d in deltas).startswith("stub answer")
    models = await client.models.list()
    assert models.data
    await client.close()


async def test_openai_responses_api(via_proxy: Proxy) -> None:
    client = openai.AsyncOpenAI(base_url=via_proxy.url + "/v1", api_key="k", max_retries=0)
    reply = await client.responses.create(model="stub", input="Hello")
    assert reply.output_text.startswith("stub answer")
    await client.close()


async def test_anthropic_client_and_stream(via_proxy: Proxy) -> None:
    client = anthropic.AsyncAnthropic(base_url=via_proxy.url, api_key="k", max_retries=0)
    message = await client.messages.create(model="stub", max_tokens=8, messages=MESSAGES)  # type: ignore[arg-type]
    assert message.content[0].text.startswith("stub answer")  # type: ignore[union-attr]
    async with client.messages.stream(model="stub", max_tokens=8, messages=MESSAGES) as stream:  # type: ignore[arg-type]
        text = "".join([piece async for piece in stream.text_stream])
    assert text.startswith("stub answer")
    await client.close()


async def test_sdk_sees_mmgate_errors_as_api_errors(stub: TestServer, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(f"http://127.0.0.1:{stub.port}", MMGATE_MAX_BODY_MB="1")
    big = [{"role": "user", "content": "x" * (2 << 20)}]
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model="stub", messages=big)  # type: ignore[arg-type]
    assert caught.value.status_code == 413
    assert caught.value.code == "body_too_large"
    claude = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught_a:
        await claude.messages.create(model="stub", max_tokens=8, messages=big)  # type: ignore[arg-type]
    assert caught_a.value.status_code == 413
    assert "body_too_large" in str(caught_a.value)
    await client.close()
    await claude.close()
