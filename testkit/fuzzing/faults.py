"""What went wrong on the server side, named by a stable signature.

A property fails with ``fail``: an ``AssertionError`` whose message starts with a signature in square brackets
(``[5xx:RecursionError@proxy/payload/walkers.py:_generate_item]``), so the corpus keeps one input per fault, not
one per shrink step. ``FaultLog`` catches what the proxy logged; ``Harness`` is the running proxy and upstream a
property talks to; ``production_stack`` runs with the stack depth the server has in production.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from ..servers import Upstream

T = TypeVar("T")


class FaultLog(logging.Handler):
    """Collects exceptions the proxy logged (aiohttp's "Error handling request", mmgate's own): a 5xx is
    reported with the exception type and the innermost product frame, which names the fault."""

    LOGGERS = ("aiohttp.server", "aiohttp.web", "mmgate")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.records.append(record)

    @contextlib.contextmanager
    def installed(self) -> Iterator[FaultLog]:
        loggers = [logging.getLogger(name) for name in self.LOGGERS]
        for logger in loggers:
            logger.addHandler(self)
        try:
            yield self
        finally:
            for logger in loggers:
                logger.removeHandler(self)

    def clear(self) -> None:
        self.records.clear()

    def where(self) -> str:
        """``ExcType@file:function`` of the last logged exception: the innermost frame in proxy/ or
        preprocessors/, or for a RecursionError the product function that recurses (where the stack happens
        to run out varies from run to run)."""
        for record in reversed(self.records):
            assert record.exc_info is not None
            exc = record.exc_info[1]
            assert exc is not None
            frames = traceback.extract_tb(exc.__traceback__)
            ours = [f for f in frames if "/proxy/" in f.filename or "/preprocessors/" in f.filename] or frames
            if not ours:
                return type(exc).__name__
            frame = ours[-1]
            if isinstance(exc, RecursionError):
                counts = collections.Counter((f.filename, f.name) for f in ours)
                top = max(counts.values())
                frame = next(f for f in ours if counts[(f.filename, f.name)] == top)
            return f"{type(exc).__name__}@{_short_path(frame.filename)}:{frame.name}"
        return "unlogged"


def _short_path(filename: str) -> str:
    for root in ("/proxy/", "/preprocessors/"):
        if root in filename:
            return root.strip("/") + "/" + filename.split(root, 1)[1]
    return Path(filename).name


@dataclass
class Harness:
    """The real proxy in front of the scripted upstream, a real client, and the proxy's fault log."""

    proxy_url: str
    upstream: Upstream
    session: aiohttp.ClientSession
    faults: FaultLog


def fail(signature: str, detail: str) -> AssertionError:
    """An AssertionError whose first token ``[signature]`` names the fault (the corpus keys on it)."""
    return AssertionError(f"[{signature}] {detail}")


def attempt(function: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, Exception | None]:
    """(result, None) or (None, the exception): properties raise their verdict *outside* the except block,
    so the failure carries no exception context and hypothesis sees one stable failure, not a flaky one."""
    try:
        return function(*args, **kwargs), None
    except Exception as exc:
        return None, exc


def error_shape_problem(route: str, body: bytes) -> str | None:
    """None when ``body`` is an error in the API's own shape for ``route``, else what is wrong."""
    try:
        doc = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:120]!r}"
    anthropic = route.rstrip("/").startswith("/v1/messages")
    if anthropic:
        if not isinstance(doc, dict) or set(doc) != {"type", "error"} or doc["type"] != "error":
            return f"not {{type: error, error}}: {body[:160]!r}"
        error = doc["error"]
        if not isinstance(error, dict) or set(error) != {"type", "message"}:
            return f"error is not {{type, message}}: {body[:160]!r}"
        if not all(isinstance(error[k], str) for k in ("type", "message")):
            return f"type/message not strings: {body[:160]!r}"
        return None
    if not isinstance(doc, dict) or set(doc) != {"error"} or not isinstance(doc["error"], dict):
        return f"not {{error: {{...}}}}: {body[:160]!r}"
    error = doc["error"]
    if set(error) != {"message", "type", "code", "param"}:
        return f"error keys {sorted(error)} != [code, message, param, type]: {body[:160]!r}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return f"message/type not strings: {body[:160]!r}"
    if not all(error[k] is None or isinstance(error[k], str) for k in ("code", "param")):
        return f"code/param neither string nor null: {body[:160]!r}"
    return None


# Frames from the bottom of the stack to the event loop's ``_run_once`` (itself included) in a real ``mmgate``
# process (the console script; ``python -m proxy`` has 9), measured with a sitecustomize hook.
PRODUCTION_LOOP_DEPTH = 7


def _stack() -> list[Any]:
    """The current thread's frames, innermost first."""
    frames = []
    frame: Any = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


@contextlib.contextmanager
def stack_headroom(frames: int) -> Iterator[None]:
    """Exactly ``frames`` frames of room above the caller, whatever the limit was (restored afterwards)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(_stack()) + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


@contextlib.contextmanager
def production_stack() -> Iterator[None]:
    """Give the proxy's handlers the stack room they have in production while a request is in flight.

    Here the proxy runs in the test's thread, its event loop on top of pytest's and hypothesis' frames, and
    hypothesis raises the recursion limit while a test runs: a handler that recurses once per JSON level
    would pass at depths that crash a real ``mmgate``. So the limit is set to what a real process has above
    its event loop (default 1000), counted from this loop's ``_run_once``, and restored afterwards.
    """
    frames = _stack()
    frames.reverse()
    loop_depth = next((i + 1 for i, f in enumerate(frames) if f.f_code.co_name == "_run_once"), None)
    old = sys.getrecursionlimit()
    if loop_depth is not None:
        sys.setrecursionlimit(1000 + loop_depth - PRODUCTION_LOOP_DEPTH)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


