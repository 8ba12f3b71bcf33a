"""Serving as a person sees it: the start-up lines (the loop named, a misspelt variable's warning repeated last),
the drain's lines (the real worst case), and a second Ctrl-C that stops at once. Real ``mmgate`` processes,
real signals; the drain line's worst case also in-process, on the real app's state."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from functools import partial

import aiohttp
import pytest

from proxy.runtime.loop import uvloop_installed
from proxy.serve.demo import free_port
from proxy.serve.server import FORCED_EXIT_STATUS, drain
from proxy.state import STATE
from testkit import environment
from tests.conftest import StartProxy, Upstream, require_heavy

BOUND = 30.0  # seconds: a bound on a hang, not a measure of speed
MISSPELT = "MMGATE_MAX_QUEUE"[:-1]  # built, so that no file but test_cli.py spells an unknown variable


def mmgate_env(**settings: str) -> dict[str, str]:
    """This process's environment without its MMGATE_* (a developer's own would change what is tested), but for
    the decode mode and the event loop CI runs the suite under; one process, on loopback only."""
    return environment.mmgate_env(keep=("MMGATE_DECODE_MODE", "MMGATE_LOOP"), MMGATE_HOST="127.0.0.1", **settings)


async def start_mmgate(env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy", env=env,
                                                stderr=asyncio.subprocess.PIPE)


async def line_with(process: asyncio.subprocess.Process, text: str, seen: list[str]) -> str:
    """Read stderr lines (into ``seen``) until one holds ``text``; bounded against a hang."""
    assert process.stderr is not None
    async with asyncio.timeout(BOUND):
        while True:
            line = (await process.stderr.readline()).decode()
            assert line, f"mmgate ended before saying {text!r}: {''.join(seen)[-2000:]}"
            seen.append(line)
            if text in line:
                return line


async def ended(process: asyncio.subprocess.Process, seen: list[str]) -> int:
    """The exit status and the rest of stderr (into ``seen``); a process still running after BOUND fails."""
    try:
        async with asyncio.timeout(BOUND):
            _, rest = await process.communicate()
        seen.extend(rest.decode().splitlines(keepends=True))
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode or 0


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_setting(request: pytest.FixtureRequest) -> str:
    loop: str = request.param
    if loop == "uvloop" and not uvloop_installed():
        if require_heavy():
            pytest.fail("uvloop is missing and MMGATE_REQUIRE_HEAVY=1 (the test extra installs it)")
        pytest.skip("uvloop is not installed (the test extra installs it)")
    return loop


async def test_the_start_up_line_names_the_loop_and_a_misspelt_variable_is_warned_about_last(
    upstream: Upstream, event_loop_setting: str
) -> None:
    port = free_port()
    process = await start_mmgate(mmgate_env(MMGATE_UPSTREAM=upstream.url, MMGATE_PORT=str(port),
                                            MMGATE_LOOP=event_loop_setting, **{MISSPELT: "3"}))
    seen: list[str] = []
    try:
        listening = await line_with(process, "mmgate listening on", seen)
        repeated = await line_with(process, MISSPELT, seen)
    finally:
        process.send_signal(signal.SIGINT)  # nothing in flight: stops at once
        status = await ended(process, seen)
    assert status == 0, "".join(seen)
    assert listening.rstrip().endswith(f"(event loop: {event_loop_setting})"), listening
    # Said before the settings were read, and again once mmgate listens, where a person looks.
    first = next(line for line in seen if MISSPELT in line)
    assert seen.index(first) < seen.index(listening) < seen.index(repeated)
    assert f"unknown variable {MISSPELT} (did you mean MMGATE_MAX_QUEUE?): ignored" in repeated


async def test_a_second_ctrl_c_stops_at_once_with_status_130(upstream: Upstream) -> None:
    """Ctrl-C with a stream in flight says how long it may wait in all; Ctrl-C again cuts it and exits now, far
    inside the drain's 120 s here."""
    upstream.route("/v1/chat/completions", partial(upstream.held_stream, last=b"data: last\n\n"))
    port = free_port()
    process = await start_mmgate(mmgate_env(MMGATE_UPSTREAM=upstream.url, MMGATE_PORT=str(port),
                                            MMGATE_DRAIN_GRACE="60", MMGATE_DRAIN_TIMEOUT="60",
                                            MMGATE_ACCESS_LOG="off"))
    seen: list[str] = []
    url = f"http://127.0.0.1:{port}"
    try:
        await line_with(process, "mmgate listening on", seen)
        async with aiohttp.ClientSession() as client:
            streaming = await client.post(url + "/v1/chat/completions", data=b'{"stream": true}')
            assert await streaming.content.readuntil(b"\n\n") == b"data: first\n\n"
            process.send_signal(signal.SIGINT)
            waiting = await line_with(process, "SIGINT: 1 request(s) in flight", seen)
            assert "waiting up to 120 s in all" in waiting and "Ctrl-C again to stop now" in waiting, waiting
            process.send_signal(signal.SIGINT)
            status = await ended(process, seen)
            with pytest.raises(aiohttp.ClientPayloadError):  # cut, not finished: the upstream still holds it
                await streaming.content.read()
    finally:
        upstream.release.set()
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert status == FORCED_EXIT_STATUS == 130, "".join(seen)
    [forced] = seen[seen.index(waiting) + 1:]  # one line, nothing after it
    assert forced.rstrip().endswith("SIGINT again: stopping now; 1 request(s) in flight cut"), forced


async def test_the_sigterm_line_gives_the_worst_case(upstream: Upstream, start_proxy: StartProxy,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    proxy = await start_proxy(upstream.url, MMGATE_DRAIN_GRACE="0", MMGATE_DRAIN_TIMEOUT="30")
    with caplog.at_level(logging.INFO, logger="mmgate"):
        await drain(proxy.app[STATE], signal.SIGTERM)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SIGTERM")]
    assert line == ("SIGTERM: readiness now fails; serving for 0 s more (MMGATE_DRAIN_GRACE), then up to 30 s for "
                    "requests in flight (MMGATE_DRAIN_TIMEOUT): stopped within 30 s")
