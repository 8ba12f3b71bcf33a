"""How far one media request travels through the code: the module entries along its path.

A maintainer follows a request from the route handler through every call that passes it, or what it becomes;
each such call into another of mmgate's modules (``proxy/``, ``preprocessors/``) is one more file to open.
``ModuleEntries`` counts them for one real request (a real aiohttp server, a real stub backend) with
``sys.setprofile``, on the handler's own task and inside ``handle_request``:

- what the request becomes: the request itself, its ``Exchange``, whatever a call returned when it was
  passed one of those (as an argument or as the object a method was called on), and every object built
  from one of those (its ``__init__`` was passed one): the app state, the body, its owner, the plan, its
  items, their keys, the lease, the upstream's response...
- a call passes it when one of its arguments (the object a method is called on aside: that is the object at
  work, read in its own class), or something an argument holds (the items of a list, a dict's keys and
  values), is one of them;
- it is a module entry when the callee is in one of mmgate's modules and the caller in another. A call counts
  once, however often its coroutine or generator resumes.
"""

from __future__ import annotations

import asyncio
import dis
import inspect
import io
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import orjson

from proxy.exchange import Exchange
from proxy.pipeline import handle_request
from testkit.media import chat_with_image, data_uri, decode_uri, photo_sized
from tests.conftest import StartProxy, Upstream

ROOT = Path(__file__).resolve().parents[2]
OURS = tuple(str(ROOT / package) + "/" for package in ("proxy", "preprocessors"))

# The bound (42): 25 entries, and no module but the handler's entered more than twice. Down from 39 since
# the media step reads each inline image's base64 at its ends once (dataurl.Base64Ends, which sniffs its format
# once), the body's owner joins and splices it (buffers), the upstream's answer is relayed in one call, and the
# cache keys and looks an item up in one (cache.MediaCache.look_up).
MAX_ENTRIES = 25
MAX_ENTRIES_PER_MODULE = 2
PIPELINE = "proxy.pipeline"  # the story itself: it calls every stage

_RESUME = dis.opmap["RESUME"]
_STAR_FLAGS = (inspect.CO_VARARGS, inspect.CO_VARKEYWORDS)
# Values shared by identity all over the process: never what one request became.
_SHARED = (type(None), bool, int, float, str, asyncio.Future)


def _is_fresh_call(frame: FrameType) -> bool:
    """The first call event of ``frame``, not its coroutine or generator resumed (a RESUME whose argument
    says "at the start")."""
    code, at = frame.f_code.co_code, frame.f_lasti
    return at < 0 or code[at] != _RESUME or code[at + 1] & 3 == 0


def _arguments(frame: FrameType) -> tuple[object | None, list[object]]:
    """The object a method is called on (None for a plain function), and the other arguments with what they
    hold one level down (the items of a list, a tuple, a set; the keys and values of a dict)."""
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount + sum(bool(code.co_flags & flag) for flag in _STAR_FLAGS)
    names = code.co_varnames[:count]
    local = frame.f_locals
    receiver = local.get(names[0]) if names[:1] in (("self",), ("cls",)) and code.co_argcount else None
    others: list[object] = []
    for name in names[1:] if receiver is not None else names:
        value = local.get(name)
        others.append(value)
        if isinstance(value, list | tuple | set | frozenset):
            others.extend(value)
        elif isinstance(value, dict):
            others.extend(value)
            others.extend(value.values())
    return receiver, others


def _within(frame: FrameType | None, code: object) -> bool:
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class ModuleEntries:
    """The profile function (see the module's docstring): ``entries`` by callee module, ``path`` in order."""

    def __init__(self) -> None:
        self.entries: Counter[str] = Counter()
        self.path: list[str] = []
        self.task: asyncio.Task[Any] | None = None
        self.tracked: dict[int, object] = {}  # id -> the object, held so that no id is reused meanwhile
        self.passing: set[int] = set()  # frames running now that were handed a tracked object

    def __call__(self, frame: FrameType, event: str, value: object) -> None:
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if self.task is None:
            if event != "call" or code is not handle_request.__code__:
                return
            self.task = asyncio.current_task()
        elif asyncio.current_task() is not self.task or not _within(frame, handle_request.__code__):
            return
        if event == "return":
            if id(frame) in self.passing:
                self.passing.discard(id(frame))
                if not isinstance(value, _SHARED):
                    self.tracked[id(value)] = value
            return
        receiver, others = _arguments(frame)
        if code is handle_request.__code__:  # the request
            self.tracked.update((id(argument), argument) for argument in others if not isinstance(argument, _SHARED))
        self.tracked.update((id(argument), argument) for argument in others if isinstance(argument, Exchange))
        passed = any(id(argument) in self.tracked for argument in others)
        if not passed and id(receiver) not in self.tracked:
            return
        if passed and code.co_name == "__init__" and receiver is not None:
            self.tracked[id(receiver)] = receiver
        self.passing.add(id(frame))
        if not passed or not code.co_filename.startswith(OURS) or not _is_fresh_call(frame):
            return
        callee = frame.f_globals.get("__name__", "")
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        if callee != caller:
            self.entries[callee] += 1
            self.path.append(f"{caller}.{back.f_code.co_name if back is not None else '?'} -> "
                             f"{callee}.{code.co_qualname}")

    def report(self) -> str:
        return (f"{sum(self.entries.values())} module entries in {len(self.entries)} modules: "
                f"{dict(self.entries.most_common())}\n" + "\n".join(self.path))


@contextmanager
def counting() -> Iterator[ModuleEntries]:
    counter = ModuleEntries()
    sys.setprofile(counter)
    try:
        yield counter
    finally:
        sys.setprofile(None)


def photo_png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    photo_sized(width, height).save(out, "PNG")
    return out.getvalue()


async def test_one_media_request_enters_few_modules(upstream: Upstream, start_proxy: StartProxy) -> None:
    """A photo resized on the decode pool and spliced back: every stage of a media request runs."""
    proxy = await start_proxy(upstream.url, MMGATE_RESIZE_MAX_SIDE="32")
    body = orjson.dumps(chat_with_image(data_uri(photo_png(64, 48))))
    async with aiohttp.ClientSession() as client:
        with counting() as counter:
            async with client.post(proxy.url + "/v1/chat/completions", data=body,
                                   headers={"Content-Type": "application/json"}) as response:
                assert response.status == 200
                await response.read()
    forwarded = orjson.loads(upstream.seen[-1].body)
    _, image = decode_uri(forwarded["messages"][0]["content"][1]["image_url"]["url"])
    assert image.size == (32, 24)
    entries, report = counter.entries, counter.report()
    assert sum(entries.values()) <= MAX_ENTRIES, report
    assert all(count <= MAX_ENTRIES_PER_MODULE for module, count in entries.items() if module != PIPELINE), report
