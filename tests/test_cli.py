"""The command line: config errors, --print-config, and SIGTERM drain of a real mmgate process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from functools import partial

import aiohttp
import pytest

from proxy.cli import free_port, main
from proxy.memory import tune_allocators
from proxy.settings import ConfigError, Settings

from .conftest import Upstream


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"MMGATE_MAX_QUEUE": "lots"}, "MMGATE_MAX_QUEUE='lots'"),
        ({"MMGATE_QUEUE_TIMEOUT": "-1"}, "MMGATE_QUEUE_TIMEOUT='-1'"),
        ({"MMGATE_RELEASE_AT": "never"}, "one of auto, sent, headers, complete"),
        ({"MMGATE_UPSTREAM": "ftp://x"}, "MMGATE_UPSTREAM='ftp://x'"),
        ({"MMGATE_DECODE_WORKERS": "0"}, "benchmark baseline"),
        ({"MMGATE_PORT": "70000"}, "from 0 to 65535"),
    ],
)
def test_bad_value_exits_2_with_one_line(env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--print-config"], environ={"MMGATE_UPSTREAM": "http://127.0.0.1:1", **env})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


def test_missing_upstream_suggests_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([], environ={})
    assert exited.value.code == 2
    assert "mmgate demo" in capsys.readouterr().err


def test_flags_win_over_env_and_print_config(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--print-config", "--max-queue", "5"], environ={"MMGATE_UPSTREAM": "http://h:1", "MMGATE_MAX_QUEUE": "9"})
    out = capsys.readouterr().out
    assert "MMGATE_MAX_QUEUE=5" in out and "MMGATE_UPSTREAM=http://h:1" in out
    assert "worst-case payload memory" in out


def test_settings_are_frozen_and_injectable() -> None:
    settings = Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9/", "MMGATE_SERVER_TIMING": "off"})
    assert settings.upstream == "http://127.0.0.1:9" and settings.server_timing is False
    with pytest.raises(AttributeError):
        settings.max_queue = 3  # type: ignore[misc]
    with pytest.raises(ConfigError):
        Settings.from_env({"MMGATE_MAX_BODY_MB": "0"})


async def _wait_listening(url: str, process: subprocess.Popen[bytes]) -> None:
    """Poll the liveness endpoint until the new process answers (bounded; it is a readiness poll)."""
    async with aiohttp.ClientSession() as client:
        for _ in range(200):
            assert process.poll() is None, "mmgate exited during start-up"
            try:
                async with client.get(url + "/mmgate/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    raise AssertionError("mmgate did not start")


async def test_sigterm_drains_in_flight_streams(upstream: Upstream) -> None:
    upstream.route("/v1/chat/completions", partial(upstream.held_stream, last=b"data: last\n\n"))
    port = free_port()
    env = {**os.environ, "MMGATE_UPSTREAM": upstream.url, "MMGATE_PORT": str(port), "MMGATE_HOST": "127.0.0.1",
           "MMGATE_DRAIN_GRACE": "0", "MMGATE_DRAIN_TIMEOUT": "30"}
    process = subprocess.Popen([sys.executable, "-m", "proxy"], env=env, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_listening(url, process)
        async with aiohttp.ClientSession() as client:
            streaming = await client.post(url + "/v1/chat/completions", data=b'{"stream": true}')
            assert await streaming.content.readuntil(b"\n\n") == b"data: first\n\n"
            process.send_signal(signal.SIGTERM)
            # Readiness fails and new requests are refused, while the stream in flight goes on.
            for _ in range(200):
                async with client.get(url + "/mmgate/ready") as ready:
                    if ready.status == 503:
                        break
            assert ready.status == 503
            async with client.get(url + "/v1/models") as refused:
                assert refused.status == 503
                assert (await refused.json())["error"]["code"] == "draining"
                assert refused.headers["Retry-After"]
            assert process.poll() is None
            upstream.release.set()
            assert await streaming.content.read() == b"data: last\n\n"
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_allocator_tuning_respects_the_operators_own_settings() -> None:
    from PIL import Image

    before = Image.core.get_blocks_max()
    try:
        Image.core.set_blocks_max(5)
        assert tune_allocators({"MALLOC_MMAP_THRESHOLD_": "65536", "PILLOW_BLOCKS_MAX": "5"}) == [
            "MALLOC_TRIM_THRESHOLD_=1048576"]
        assert Image.core.get_blocks_max() == 5  # left as the operator set it
        assert tune_allocators({}) == ["MALLOC_MMAP_THRESHOLD_=1048576", "MALLOC_TRIM_THRESHOLD_=1048576",
                                       "PILLOW_BLOCKS_MAX=0"]
        assert Image.core.get_blocks_max() == 0
    finally:
        Image.core.set_blocks_max(before)


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, "memory: MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=1048576 PILLOW_BLOCKS_MAX=0"),
    ({"MMGATE_MALLOC_TUNING": "off"}, None),
], ids=["default", "off"])
async def test_serve_tunes_allocators_at_start(upstream: Upstream, extra: dict[str, str], expected: str | None) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "PILLOW_", "MMGATE_"))}
    env |= {"MMGATE_UPSTREAM": upstream.url, "MMGATE_PORT": str(port), "MMGATE_HOST": "127.0.0.1",
            "MMGATE_DRAIN_GRACE": "0", "MMGATE_DRAIN_TIMEOUT": "1", **extra}
    process = subprocess.Popen([sys.executable, "-m", "proxy"], env=env, stderr=subprocess.PIPE)
    try:
        await _wait_listening(f"http://127.0.0.1:{port}", process)
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(process.communicate, timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = [line for line in stderr.decode().splitlines() if "memory:" in line]
    assert [line[line.index("memory: "):] for line in lines] == ([expected] if expected else [])
