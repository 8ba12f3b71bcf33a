"""The event loop mmgate runs on (``MMGATE_LOOP``): uvloop when it is installed (the ``uvloop`` extra), else
asyncio's own. Chosen once, when a process starts: the single process, the supervisor of several and each
front process run their main coroutine through ``run``, and the start-up line names the loop (``loop_name``).

uvloop is the loop of uvicorn's standard install and of gunicorn's aiohttp uvloop worker; mmgate's CPU per
request is lower on it (``bench/passthrough.py``, target ``mmgate-uvloop``). mmgate uses only what both
loops offer: ``asyncio.Protocol`` callbacks, transports' public methods, timers and signal handlers.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from proxy.settings import ConfigError

T = TypeVar("T")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def loop_factory(choice: str) -> LoopFactory | None:
    """The factory of the loop ``choice`` (``auto``, ``asyncio``, ``uvloop``) names; None for asyncio's
    default. ``ConfigError`` when uvloop is asked for and not installed."""
    if choice == "asyncio" or (choice == "auto" and not uvloop_installed()):
        return None
    if not uvloop_installed():
        raise ConfigError("MMGATE_LOOP=uvloop, but uvloop is not installed: pip install 'mmgate[uvloop]', "
                          "or MMGATE_LOOP=auto")
    factory: LoopFactory = importlib.import_module("uvloop").new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names."""
    try:
        factory = loop_factory(choice)
    except ConfigError:
        main.close()  # never started: no "coroutine was never awaited" warning on the way out
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """``uvloop`` or ``asyncio``: the loop running now (or ``loop``), as the start-up line names it."""
    running = loop if loop is not None else asyncio.get_running_loop()
    return "uvloop" if type(running).__module__.split(".")[0] == "uvloop" else "asyncio"
