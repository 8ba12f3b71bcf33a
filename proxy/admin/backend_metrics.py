"""``MMGATE_BACKEND_METRICS=merge``: the backend's Prometheus exposition with mmgate's waiting media requests in
its queue gauge, for an inference gateway's endpoint picker (Gateway API Inference Extension, llm-d) that
routes by each model server's queue.

Media requests waiting in mmgate (queued at the gate, holding a place while their body arrives, being
fetched or decoded: accepted and not yet forwarded, ``Gate.waiting_media``) are invisible to the backend's own
gauge; a server whose mmgate queue is full would look idle to the picker. ``GET /metrics`` on the proxy port
fetches the backend's ``/metrics`` and adds that count to every series of each known queue gauge of the
"model server protocol" (labels, order and every other line kept byte for byte), then appends mmgate's own
``mmgate_*`` families. A backend exposing none of those gauges is passed through untouched. The backend's
own exposition stays reachable, unmodified, at ``/mmgate/backend/metrics`` (and on the backend's port).
``MMGATE_BACKEND_METRICS=merge-admin`` answers the merged ``/metrics`` on ``MMGATE_ADMIN_PORT`` only; the
main port then forwards ``/metrics`` as any other path (``MMGATE_ALLOW_PATHS`` decides).

A scrape of the backend is reused for a second and concurrent scrapes share the one fetch in flight
(``backend_scrapes.BackendScrapes``): many scrapers cost the backend one exposition a second at most. The merge
is made once per scrape of the backend too (``MergedExposition``, counted by
``mmgate_backend_metrics_merges_total``), with mmgate's families as of then: every scrape of mmgate until the
next is served from it, only the waiting count read afresh and written into the queue gauges' samples. An
answer is written from views of the scraped body, a slice at a time (``send_exposition``): scrapers looping on
``/metrics`` cost mmgate's event loop neither a parse nor a copy of the exposition each, and take turns with the
other answers.

Exposition formats: Prometheus text 0.0.4 (asked for) and OpenMetrics 1.0 (mmgate's families then go before
``# EOF``). A sample line is ``name[{labels}] value [timestamp]``; label values are quoted with backslash
escapes, so the label set is skipped quote-aware rather than up to the first ``}``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Sequence
from functools import partial

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from preprocessors.errors import MmgateError
from proxy.edge.upstream import local_shortage, write_in_pieces
from proxy.ops.backend_scrapes import Scrape, Scraped, ScrapeFailed
from proxy.state import STATE, AppState

# The queue gauges of the model server protocol that endpoint pickers read, per server.
QUEUE_GAUGES = frozenset({b"vllm:num_requests_waiting", b"sglang:num_queue_reqs", b"trtllm_num_requests_waiting"})
METRICS_PATH = "/metrics"
FETCH_TIMEOUT = 5.0  # seconds for the backend's exposition: a scrape must not hang on a stuck backend
MAX_EXPOSITION_BYTES = 16 << 20
ACCEPT = "text/plain;version=0.0.4;q=1.0, application/openmetrics-text;version=1.0.0;q=0.5"
_NAME_END = re.compile(rb"[{ \t]")
log = logging.getLogger("mmgate")


class _OwnFamilies(Collector):
    """mmgate's ``mmgate_*`` families only: its ``process_*`` series would repeat names the backend (often a
    Python process too) already exposes, which a scraper rejects."""

    def __init__(self, registry: Collector) -> None:
        self._registry = registry

    def collect(self):  # type: ignore[no-untyped-def]  # prometheus_client's own signature
        return (family for family in self._registry.collect() if family.name.startswith("mmgate_"))


def _queue_sample(line: bytes) -> tuple[bytes, float, bytes] | None:
    """A sample of a known queue gauge as what goes before its value (name, labels, spacing), the value and
    what follows it (a timestamp); None for any other line."""
    match = _NAME_END.search(line)
    name = line[:match.start()] if match else line
    if name not in QUEUE_GAUGES:
        return None
    at = len(name)
    if at < len(line) and line[at:at + 1] == b"{":
        quoted = escaped = False
        for index in range(at + 1, len(line)):
            char = line[index:index + 1]
            if escaped:
                escaped = False
            elif char == b"\\":
                escaped = True
            elif char == b'"':
                quoted = not quoted
            elif char == b"}" and not quoted:
                at = index + 1
                break
        else:
            return None
    head, rest = line[:at], line[at:]
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    spacing = rest[:len(rest) - len(rest.lstrip())]
    tail = rest.lstrip()[len(fields[0]):]
    return head + spacing, value, tail


class MergedExposition:
    """The backend's exposition with ``own`` (mmgate's families, in the same format) appended, parsed once:
    the text between queue gauge samples kept as views of the scraped body (never copied), each sample's
    value kept apart for ``render`` to add the waiting count to."""

    def __init__(self, parts: list[memoryview | bytes | tuple[bytes, float, bytes]]) -> None:
        self.parts = parts
        self._rendered: tuple[int, list[memoryview | bytes]] | None = None

    @classmethod
    def of(cls, exposition: bytes, own: bytes) -> MergedExposition | None:
        """None when ``exposition`` has no known queue gauge (it is passed through). The gauges' sample lines
        are found with ``bytes.find`` (a scan at memchr speed), not by splitting the exposition into lines: a
        4 MB exposition is parsed in a few milliseconds of the loop."""
        end = len(exposition)
        while end and exposition[end - 1] == NEWLINE:  # trailing empty lines are dropped
            end -= 1
        last_line = exposition.rfind(b"\n", 0, end) + 1
        ending = b"\n"
        if exposition[last_line:end].strip() == b"# EOF":  # OpenMetrics: one EOF, at the very end
            end, ending = last_line, b""
            own = own.removesuffix(b"# EOF\n") + b"# EOF\n"
        view = memoryview(exposition)
        parts: list[memoryview | bytes | tuple[bytes, float, bytes]] = []
        text_from = 0
        for start in _gauge_lines(exposition, end):
            line_end = exposition.find(b"\n", start, end)
            line_end = end if line_end < 0 else line_end
            sample = _queue_sample(exposition[start:line_end])
            if sample is None:
                continue
            parts += [view[text_from:start], sample]
            text_from = line_end  # the sample's newline opens the next text
        if not parts:
            return None
        parts += [view[text_from:end], ending + own]
        return cls(parts)

    def render(self, waiting: int) -> list[memoryview | bytes]:
        """The exposition with ``waiting`` added to each queue gauge sample, as the pieces to write in turn
        (the last one made is kept)."""
        if self._rendered is not None and self._rendered[0] == waiting:
            return self._rendered[1]
        pieces = [part if not isinstance(part, tuple)
                  else part[0] + floatToGoString(part[1] + waiting).encode() + part[2]
                  for part in self.parts]
        self._rendered = (waiting, pieces)
        return pieces


NEWLINE = ord("\n")


def _gauge_lines(exposition: bytes, end: int) -> list[int]:
    """Where each line before ``end`` that starts with a known queue gauge's name (then ``{``, a space or a tab)
    starts, in order."""
    starts = []
    for name in QUEUE_GAUGES:
        at = 0 if exposition.startswith(name) else _next_line_with(exposition, name, 0, end)
        while at >= 0:
            after = at + len(name)
            if exposition[after:after + 1] in (b"{", b" ", b"\t"):
                starts.append(at)
            at = _next_line_with(exposition, name, after, end)
    return sorted(starts)


def _next_line_with(exposition: bytes, name: bytes, start: int, end: int) -> int:
    """Where the next line after ``start`` that begins with ``name`` starts; -1 when none does before ``end``."""
    found = exposition.find(b"\n" + name, start, end)
    return found + 1 if found >= 0 else -1


def merge(exposition: bytes, waiting: int, own: bytes) -> bytes | None:
    """The backend's ``exposition`` with ``waiting`` added to each known queue gauge sample and ``own`` (mmgate's
    families, in the same format) appended; None when it has no known queue gauge (pass it through)."""
    merged = MergedExposition.of(exposition, own)
    return b"".join(merged.render(waiting)) if merged is not None else None


async def send_exposition(request: web.Request, status: int, content_type: str,
                          pieces: Sequence[memoryview | bytes]) -> web.StreamResponse:
    """Answer an exposition written a piece at a time from views of the pieces (``write_in_pieces``): no copy
    of the whole is made, and scrapers looping on ``/metrics`` take turns with every other answer on the loop."""
    response = web.StreamResponse(status=status)
    response.headers["Content-Type"] = content_type
    response.content_length = sum(len(piece) for piece in pieces)
    await response.prepare(request)
    if request.method != "HEAD":
        for piece in pieces:
            await write_in_pieces(response.write, memoryview(piece))
    await response.write_eof()
    return response


async def _fetch(state: AppState) -> Scraped:
    """The backend's /metrics, read to its end; or the 502/504 to answer (logged) when it does not answer in
    time, fails, is cut short or exceeds ``MAX_EXPOSITION_BYTES``: a scraper must never get part of an
    exposition, which it would parse as series gone missing."""
    url = state.settings.backend.upstream + METRICS_PATH
    try:
        async with state.session.get(url, headers={"Accept": ACCEPT},
                                     timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT)) as response:
            body = await _read_whole(response.content, MAX_EXPOSITION_BYTES)
            if body is None:
                return _failed(502, f"the backend's metrics exceed {MAX_EXPOSITION_BYTES} bytes")
            return Scrape(response.status, body, response.headers.get("Content-Type", "text/plain"))
    except TimeoutError:
        state.metrics.upstream_errors.labels("timeout").inc()
        return _failed(504, "the backend's /metrics did not answer in time")
    except aiohttp.ClientError as exc:
        shortage = local_shortage(exc)
        if shortage is not None:  # mmgate's own: not counted as the upstream's error
            return _failed(503, f"mmgate could not connect to the backend: {shortage}")
        kind = "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "reset"
        state.metrics.upstream_errors.labels(kind).inc()
        return _failed(502, f"the backend's /metrics failed: {exc.__class__.__name__}")


async def _read_whole(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """Every byte of a response body (``read(n)`` answers with what is buffered, not with ``n`` bytes), or None
    as soon as it passes ``limit``. A body cut short raises aiohttp's ``ClientPayloadError``."""
    chunks, size = [], 0
    async for chunk in content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _failed(status: int, reason: str) -> ScrapeFailed:
    log.warning("GET %s answered %d: %s", METRICS_PATH, status, reason)
    return ScrapeFailed(status, reason)


async def _scrape(state: AppState) -> Scraped:
    return await state.backend_scrapes.get(lambda: _fetch(state))


def _merged_of(state: AppState, scrape: Scrape) -> MergedExposition | None:
    """The merge of one scrape of the backend with mmgate's families as of now (``MergedExposition``)."""
    own = _OwnFamilies(state.metrics.registry)
    openmetrics = scrape.content_type.startswith("application/openmetrics-text")
    state.metrics.backend_metrics_merges.inc()
    return MergedExposition.of(scrape.body, generate_openmetrics(own) if openmetrics else generate_latest(own))


async def merged_metrics(request: web.Request) -> web.StreamResponse:
    """``GET /metrics`` with ``MMGATE_BACKEND_METRICS=merge`` (main port) or ``merge-admin`` (admin port)."""
    state = request.app[STATE]
    scraped = await _scrape(state)
    if isinstance(scraped, ScrapeFailed):
        return web.Response(status=scraped.status, text=scraped.reason + "\n")
    pieces: Sequence[memoryview | bytes] = (scraped.body,)
    content_type = scraped.content_type
    if scraped.status == 200:
        merged = state.backend_scrapes.derived(scraped, partial(_merged_of, state))
        if merged is not None:
            # With several front processes, the one gate's count, not as of this front's last exchange with
            # it; if the gate is hung, as of that.
            if state.fleet is not None:
                with contextlib.suppress(MmgateError):
                    await state.fleet.refresh()
            pieces = merged.render(state.gate.counters().waiting_media)
            if not content_type.startswith("application/openmetrics-text"):
                content_type = CONTENT_TYPE_LATEST
    return await send_exposition(request, scraped.status, content_type, pieces)


async def backend_metrics(request: web.Request) -> web.StreamResponse:
    """``GET /mmgate/backend/metrics``: the backend's own exposition, unmodified."""
    scraped = await _scrape(request.app[STATE])
    if isinstance(scraped, ScrapeFailed):
        return web.Response(status=scraped.status, text=scraped.reason + "\n")
    return await send_exposition(request, scraped.status, scraped.content_type, (scraped.body,))
