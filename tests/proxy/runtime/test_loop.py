"""The event loop: asyncio's own or uvloop, as ``MMGATE_LOOP`` says, and the suite on the one CI asks for.

The start-up line that names the loop is checked on a real process in test_server.py."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from proxy.runtime.loop import loop_factory, loop_name, run, uvloop_installed
from proxy.settings import ConfigError, Settings
from tests.conftest import require_heavy


async def running_loop() -> str:
    return loop_name()


async def test_the_suite_runs_on_the_loop_ci_asks_for() -> None:
    """CI runs the suite twice: on asyncio's loop, then with MMGATE_LOOP=uvloop (tests/conftest.py)."""
    assert loop_name() == ("uvloop" if os.environ.get("MMGATE_LOOP") == "uvloop" else "asyncio")


def test_asyncio_is_asyncio_s_own_loop() -> None:
    assert loop_factory("asyncio") is None
    assert run(running_loop(), "asyncio") == "asyncio"


def test_auto_is_uvloop_when_it_is_installed() -> None:
    assert run(running_loop(), "auto") == ("uvloop" if uvloop_installed() else "asyncio")


def test_uvloop_runs_on_uvloop() -> None:
    if not uvloop_installed():
        if require_heavy():
            pytest.fail("uvloop is missing and MMGATE_REQUIRE_HEAVY=1 (the test extra installs it)")
        pytest.skip("uvloop is not installed (the test extra installs it)")
    assert run(running_loop(), "uvloop") == "uvloop"


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: imports of it fail
    assert not uvloop_installed()
    assert run(running_loop(), "auto") == "asyncio"
    with pytest.raises(ConfigError, match=r"MMGATE_LOOP=uvloop, but uvloop is not installed: pip install "):
        run(running_loop(), "uvloop")


def test_the_setting_takes_the_three_choices_only() -> None:
    assert Settings.from_env({"MMGATE_LOOP": "UVLOOP"}).listen.loop == "uvloop"
    assert Settings.from_env({}).listen.loop == "auto"
    with pytest.raises(ConfigError, match="one of auto, asyncio, uvloop"):
        Settings.from_env({"MMGATE_LOOP": "trio"})


def test_run_returns_what_the_coroutine_returns_and_closes_its_loop() -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def main() -> int:
        loops.append(asyncio.get_running_loop())
        return 7

    assert run(main(), "auto") == 7
    assert loops[0].is_closed()
