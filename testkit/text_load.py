"""The text-only load of the passthrough, front, pacing and scale benchmarks: request bodies, a fixed-answer
upstream, a minimal proxy and an SSE client, each a process of its own (``ROLE``: ``python -m testkit.text_load
upstream|minimal-proxy|http-client|sse-client ...``).

- ``text_body(size)``: a text-only chat request of exactly ``size`` bytes, ASCII, with no media marker.
- ``upstream``: a raw asyncio HTTP/1.1 keep-alive server that reads the whole request body (counted, not kept)
  before it answers the fixed chat completion ``ANSWER``, as a real inference server reads the body first; a
  request carrying ``X-Bench-Stream`` gets SSE events instead, one every ``--sse-delay`` s on an absolute
  schedule. Several may share a port (``SO_REUSEPORT``) where one would be the limit.
- ``minimal-proxy``: ``run_minimal_proxy``, the anchor of what passing text through costs.
- ``http-client``: ``run_http_client``, keep-alive connections posting one body, optionally at a fixed rate.
- ``sse-client``: ``--streams`` concurrent SSE requests, each restarting when it ends; prints START when the
  measured window opens, then one JSON line (tokens/s, inter-token gaps, TTFT, its own CPU share) when it closes.

``start_role`` starts a server role and waits until it answers; ``start_clients`` and ``client_results`` run client
roles and read what each printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROLE = (sys.executable, "-m", "testkit.text_load")  # a role of this module in a process of its own (cwd: the repo)
REPO = Path(__file__).resolve().parents[1]

ANSWER = (b'{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench",'
          b'"choices":[{"index":0,"message":{"role":"assistant","content":"Fixed answer from the bench upstream."},'
          b'"finish_reason":"stop"}],"usage":{"prompt_tokens":256,"completion_tokens":8,"total_tokens":264}}')
WORDS = [
    "lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do", "eiusmod", "tempor",
    "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "enim", "ad", "minim", "veniam", "quis",
    "nostrud", "exercitation", "ullamco", "laboris", "nisi", "aliquip", "ex", "ea", "commodo", "consequat"
]


def text_body(size: int) -> bytes:
    """A text-only chat request of exactly ``size`` bytes, ASCII, no media marker."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    doc = {"model": "bench", "max_tokens": 16, "messages": messages}
    i, length = 0, len(json.dumps(doc))
    while length < size - 2100:  # counted as it grows: dumping the whole document each time is quadratic
        words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(280))
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": words})
        length += len(json.dumps(messages[-1])) + 2  # ", " before it
        i += 1
    messages.append({"role": "user", "content": ""})
    pad = size - len(json.dumps(doc))
    messages[-1]["content"] = ("please answer briefly " * (pad // 22 + 1))[:pad]
    raw = json.dumps(doc).encode()
    assert len(raw) == size, (len(raw), size)
    return raw


def sse_event(n: int) -> bytes:
    return (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
            b'"choices":[{"index":0,"delta":{"content":" tok%d"},"finish_reason":null}]}\n\n' % n)


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"X-Accel-Buffering: no\r\nTransfer-Encoding: chunked\r\n\r\n")
SSE_DONE = chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
PLAIN_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)


def run_upstream(port: int, tokens: int, delay: float) -> None:
    """The fixed-answer upstream: a raw asyncio HTTP/1.1 keep-alive server that reads the whole request body
    (counted, not kept) before it answers, like a real inference server. A request carrying ``X-Bench-Stream``
    gets ``tokens`` SSE events instead, one every ``delay`` s on an absolute schedule (so the server's own
    overhead does not stretch the stream); every other request gets the fixed JSON answer."""
    events = [chunk(sse_event(n)) for n in range(tokens)]
    header_end = re.compile(rb"\r\n\r\n")
    content_length = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]
            self.buf = b""
            self.remaining = -1  # body bytes still to come; -1 = reading a head
            self.stream = False
            self.streaming = False
            self.handle: asyncio.TimerHandle | None = None
            self.loop = asyncio.get_running_loop()

        def data_received(self, data: bytes) -> None:
            if self.remaining > 0 and not self.buf and len(data) <= self.remaining:
                # the common case for a big body: count it, keep nothing
                self.remaining -= len(data)
                if self.remaining == 0:
                    self.answer()
                return
            self.buf += data
            self.next_request()

        def next_request(self) -> None:
            while not self.streaming:
                if self.remaining < 0:
                    match = header_end.search(self.buf)
                    if match is None:
                        return
                    head = self.buf[: match.start()]
                    if b"chunked" in head.lower():
                        self.transport.write(b"HTTP/1.1 411 Length Required\r\nContent-Length: 0\r\n"
                                             b"Connection: close\r\n\r\n")
                        self.transport.close()
                        return
                    length = content_length.search(head)
                    self.remaining = int(length.group(1)) if length else 0
                    self.stream = b"\r\nx-bench-stream:" in head.lower()
                    self.buf = self.buf[match.end() :]
                take = min(self.remaining, len(self.buf))
                self.remaining -= take
                self.buf = self.buf[take:]
                if self.remaining > 0:
                    return
                self.answer()

        def answer(self) -> None:
            self.remaining = -1
            if self.stream:
                self.streaming = True
                self.transport.write(SSE_HEAD)
                self.start = self.loop.time()
                self.tick(0)
            else:
                self.transport.write(PLAIN_OK)
                if self.buf:
                    self.next_request()

        def tick(self, n: int) -> None:
            if self.transport.is_closing():
                return
            self.transport.write(events[n])
            if n + 1 < tokens:
                self.handle = self.loop.call_at(self.start + (n + 1) * delay, self.tick, n + 1)
            else:
                self.transport.write(SSE_DONE)
                self.streaming = False
                self.handle = None
                self.next_request()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.handle is not None:
                self.handle.cancel()

    async def main() -> None:
        # reuse_port: bench.front starts several upstream processes on one port when one would be its limit
        server = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", port, backlog=1024,
                                                                reuse_port=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(main())


def run_sse_client(url: str, streams: int, warmup: float, duration: float, period: float) -> None:
    """``streams`` concurrent SSE requests, each restarting when it ends. Prints START when the measured window
    opens, then one JSON line when it closes."""
    import aiohttp

    body = json.dumps({"model": "bench", "stream": True,
                       "messages": [{"role": "user", "content": "Say something long."}]}).encode()
    gaps: list[float] = []
    ttft: list[float] = []
    state = {"tokens": 0, "requests": 0, "errors": 0, "measuring": False}
    pattern = b"data: {"

    async def one_stream(session: aiohttp.ClientSession, index: int) -> None:
        await asyncio.sleep(period * index / streams)  # staggered, like independent users
        while True:
            sent = time.perf_counter()
            try:
                async with session.post(url, data=body, headers={"Content-Type": "application/json",
                                                                 "X-Bench-Stream": "1"}) as resp:
                    if resp.status != 200:
                        state["errors"] += state["measuring"]
                        await resp.read()
                        continue
                    last = None
                    carry = b""
                    async for data in resp.content.iter_any():
                        now = time.perf_counter()
                        data = carry + data
                        count = data.count(pattern)
                        carry = data[-(len(pattern) - 1) :]
                        if not count:
                            continue
                        if state["measuring"]:
                            state["tokens"] += count
                            if last is None:
                                ttft.append(now - sent)
                            else:
                                gaps.append(now - last)
                            gaps.extend([0.0] * (count - 1))
                        last = now
                    state["requests"] += state["measuring"]
            except aiohttp.ClientError:
                state["errors"] += state["measuring"]

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = [asyncio.create_task(one_stream(session, i)) for i in range(streams)]
            await asyncio.sleep(warmup)
            state["measuring"] = True
            cpu0, t0 = time.process_time(), time.perf_counter()
            print("START", flush=True)
            await asyncio.sleep(duration)
            state["measuring"] = False
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            gaps.sort()
            ttft.sort()
            print(json.dumps({
                "tokens": state["tokens"], "seconds": wall, "tokens_per_s": state["tokens"] / wall,
                "requests": state["requests"], "errors": state["errors"],
                "gap_p50_ms": pct(gaps, 50) * 1e3, "gap_p99_ms": pct(gaps, 99) * 1e3,
                "gap_max_ms": (gaps[-1] if gaps else 0) * 1e3,
                "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
                "client_cpu_share": cpu / wall,
            }), flush=True)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def pct(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p / 100))]


def run_minimal_proxy(upstream: str, port: int) -> None:
    """The anchor of what passing text through costs: a ~30-line aiohttp proxy that reads the body, forwards it on
    one pooled ``ClientSession`` and streams the answer back with ``iter_any``."""
    import aiohttp
    from aiohttp import web

    skip_up = {"host", "content-length", "connection", "keep-alive", "transfer-encoding"}
    skip_down = {"connection", "keep-alive", "transfer-encoding"}

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        yield
        await app["session"].close()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in skip_up}
        async with request.app["session"].request(request.method, upstream + request.raw_path, data=body,
                                                  headers=headers, skip_auto_headers=("User-Agent", "Accept",
                                                  "Accept-Encoding", "Content-Type")) as up:
            response = web.StreamResponse(status=up.status, reason=up.reason,
                                          headers={k: v for k, v in up.headers.items() if k.lower() not in skip_down})
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=1 << 30)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def run_http_client(url: str, body_file: str, conns: int, warmup: float, duration: float, rate: float) -> None:
    """``conns`` keep-alive connections each posting the body again and again (``rate`` > 0: at ``rate``
    requests/s in all, on a fixed schedule); prints START when the window opens, then one JSON line (requests
    answered 200, errors, seconds) when it closes."""
    import aiohttp

    with open(body_file, "rb") as f:
        body = f.read()
    state = {"requests": 0, "errors": 0, "measuring": False}

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        loop = asyncio.get_running_loop()
        period = conns / rate if rate > 0 else 0.0
        due = loop.time() + period * index / conns
        while True:
            if period:
                await asyncio.sleep(max(0.0, due - loop.time()))
                due += period
            try:
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status == 200:
                        state["requests"] += state["measuring"]
                    else:
                        state["errors"] += state["measuring"]
            except aiohttp.ClientError:
                state["errors"] += state["measuring"]

    async def main() -> None:
        sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for _ in range(conns)]
        tasks = [asyncio.create_task(one(s, i)) for i, s in enumerate(sessions)]
        await asyncio.sleep(warmup)
        state["measuring"] = True
        t0 = time.perf_counter()
        print("START", flush=True)
        await asyncio.sleep(duration)
        state["measuring"] = False
        print(json.dumps({"requests": state["requests"], "errors": state["errors"],
                          "seconds": time.perf_counter() - t0}), flush=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in sessions:
            await s.close()

    asyncio.run(main())


def start_role(role: str, *args: str, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A server role (``upstream``, ``minimal-proxy``) in a process of its own on ``port`` (a free one if None),
    and its URL, once it answers (the upstream answers any path; the minimal proxy forwards to it)."""
    from testkit.load import free_port, wait_http

    port = port or free_port()
    proc = subprocess.Popen([*ROLE, role, "--port", str(port), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/", proc)
    return proc, url


def start_clients(argvs: list[list[str]]) -> list[subprocess.Popen[bytes]]:
    """Client roles (``http-client``, ``sse-client``: ``[*ROLE, role, ...]``) in processes of their own, returned
    once each has printed START: its measured window is open."""
    clients = [subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=REPO) for argv in argvs]
    for client in clients:
        assert client.stdout is not None
        line = client.stdout.readline()
        if line.strip() != b"START":
            raise RuntimeError(f"load client did not start: {line!r}")
    return clients


def client_results(clients: list[subprocess.Popen[bytes]]) -> list[dict[str, Any]]:
    """What each client of ``start_clients`` printed when its window closed (one JSON line), once it exits."""
    out = []
    for client in clients:
        assert client.stdout is not None
        out.append(json.loads(client.stdout.readline()))
        client.wait(60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    upstream = roles.add_parser("upstream", help="the fixed-answer upstream")
    upstream.add_argument("--port", type=int, required=True)
    upstream.add_argument("--sse-tokens", type=int, default=100, help="events per streamed response [100]")
    upstream.add_argument("--sse-delay", type=float, default=0.01, help="seconds between events [0.01]")
    minimal = roles.add_parser("minimal-proxy", help="the minimal aiohttp proxy")
    minimal.add_argument("--port", type=int, required=True)
    minimal.add_argument("--upstream", required=True, help="the upstream's URL")
    client = roles.add_parser("sse-client", help="concurrent SSE streams")
    client.add_argument("--url", required=True)
    client.add_argument("--streams", type=int, required=True)
    client.add_argument("--warmup", type=float, required=True, help="seconds before the measured window")
    client.add_argument("--duration", type=float, required=True, help="seconds of the measured window")
    client.add_argument("--period", type=float, required=True, help="seconds over which the streams start")
    http = roles.add_parser("http-client", help="keep-alive connections posting one body again and again")
    http.add_argument("--url", required=True)
    http.add_argument("--body-file", required=True)
    http.add_argument("--conns", type=int, required=True)
    http.add_argument("--warmup", type=float, required=True, help="seconds before the measured window")
    http.add_argument("--seconds", type=float, required=True, help="seconds of the measured window")
    http.add_argument("--rate", type=float, default=0.0, help="requests/s in all (0: as fast as answered)")
    args = parser.parse_args()
    if args.role == "http-client":
        run_http_client(args.url, args.body_file, args.conns, args.warmup, args.seconds, args.rate)
    elif args.role == "upstream":
        run_upstream(args.port, args.sse_tokens, args.sse_delay)
    elif args.role == "minimal-proxy":
        run_minimal_proxy(args.upstream, args.port)
    else:
        run_sse_client(args.url, args.streams, args.warmup, args.duration, args.period)


if __name__ == "__main__":
    main()
