"""Request targets against ``MMGATE_ALLOW_PATHS``: the upstream only sees clean paths under an allowed prefix."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from .faults import Harness, error_shape_problem, fail, production_stack

ALLOWED_PREFIXES: tuple[str, ...] = ("/v1/chat/completions", "/v1/models")
PATHS_ENV: dict[str, str] = {"MMGATE_ALLOW_PATHS": ",".join(ALLOWED_PREFIXES)}


@dataclass
class PathCase:
    method: str
    target: bytes

    def record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"method": self.method, "target_b64": base64.b64encode(self.target).decode()}
        with contextlib.suppress(UnicodeDecodeError):
            record["target"] = self.target.decode("utf-8")
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PathCase:
        if "target_b64" in record:
            return cls(record.get("method", "GET"), base64.b64decode(record["target_b64"]))
        return cls(record.get("method", "GET"), record["target"].encode("utf-8"))


_SEGMENTS = (
    "v1", "v1", "chat", "completions", "models", "admin", "mmgate", "metrics", "", ".", "..", "...", "%2e", "%2E",
    "%2e%2e", ".%2e", "%2E.", "%2f", "%2F", "..%2f", "..%2F..", "%5c", "%5C", "..\\", "\\", "%00", "%", "%zz", "%252e",
    "%2", ";", ";x=1", "models;v=2", "completions;a", "..;", "é", "%C3%A9", "~", "-", "completionsx", "modelsfoo",
    "%76%31", "mod%65ls", "%7e", "\t", "\x01", "\x7f", " ", "#frag", "@", ":", "%40", "%3f", "?", "%FF", "%C0%AE",
    "%ED%A0%80", "%u002e", "%2e%2e%2f", "%252f", "%%32%65",
)


@st.composite
def targets(draw: st.DrawFn) -> PathCase:
    """A raw request target around the allowed prefixes. Always origin-form (``/...``) or an absolute form
    naming 127.0.0.1, so no target can make a proxy forward anywhere else."""
    start = draw(st.sampled_from(["/v1/chat/completions", "/v1/models", "/v1/models", "/", "/v1/chat", "//",
                                  "http://127.0.0.1/v1/models", "HTTP://127.0.0.1:1/v1/chat/completions"]))
    parts = draw(st.lists(st.sampled_from(_SEGMENTS), max_size=6))
    path = start
    for part in parts:
        path += draw(st.sampled_from(["/", "/", "/", "//", "\\"])) + part
    if draw(st.integers(0, 4)) == 0:
        path += "/"
    query = draw(st.sampled_from(["", "", "", "?a=1", "?q=../..%2f", "?x=\\", "?", "?a=%2e%2e&b=/v1/models/..",
                                  "?é=1", "#frag"]))
    method = draw(st.sampled_from(["GET", "GET", "POST", "DELETE"]))
    return PathCase(method, (path + query).encode("utf-8"))


def path_problem(raw_path: str) -> str | None:
    """Why a path the upstream received breaks the allowlist's promise (None when it keeps it). The spelling
    rules come first, so the prefix rule names only a clean path outside the allowlist (``/v1/modelsx``)."""
    path = raw_path.split("?", 1)[0]
    if "\\" in path:
        return "backslash"
    if re.search(r"%2e|%2f|%5c", path, re.IGNORECASE):
        return "encoded-dot-or-slash"
    if "//" in path:
        return "double-slash"
    segments = path.split("/")
    if "." in segments or ".." in segments:
        return "dot-segment"
    if not any(path == prefix or path.startswith(prefix + "/") for prefix in ALLOWED_PREFIXES):
        return "outside-prefix"
    return None


async def raw_request(port: int, method: str, target: bytes, body: bytes = b"") -> tuple[int | None, bytes]:
    """Send one request with exactly ``target`` on the request line (only to 127.0.0.1); the status
    (None when the connection closed without an answer) and the whole answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(method.encode() + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
    except ConnectionResetError:
        answer = b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    match = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
    return (int(match.group(1)) if match else None), answer


async def check_http_paths(h: Harness, case: PathCase) -> None:
    """``MMGATE_ALLOW_PATHS=/v1/chat/completions,/v1/models``: every path the upstream receives (query
    removed) is an allowed prefix or under one on a segment boundary, and has no ``.``/``..`` segment, no
    ``//``, no ``%2e``/``%2f``/``%5c`` (any case) and no backslash; no target is answered with a 5xx, and
    mmgate's own JSON refusals have the API's error shape."""
    h.upstream.seen.clear()
    h.faults.clear()
    port = int(h.proxy_url.rsplit(":", 1)[1])
    with production_stack():
        status, answer = await raw_request(port, case.method, case.target, b"{}" if case.method == "POST" else b"")
    if status is not None and status >= 500:
        raise fail(f"5xx:{h.faults.where()}", f"{case.method} {case.target!r} answered {status}: {answer[-200:]!r}")
    if b"Traceback" in answer:
        raise fail("traceback", f"{case.method} {case.target!r}: {answer[-300:]!r}")
    head, _, body = answer.partition(b"\r\n\r\n")
    if status is not None and status >= 400 and re.search(rb"(?im)^content-type: *application/json", head):
        # mmgate's own refusal (aiohttp's answer to an unparsable request line is plain text)
        route = case.target.split(b"?", 1)[0].decode("utf-8", "replace")
        problem = error_shape_problem(route, body)
        if problem is not None:
            raise fail(f"error-shape:{status}", f"{case.method} {case.target!r}: {problem}")
    for seen in h.upstream.seen:
        problem = path_problem(seen.path)
        if problem is not None:
            raise fail(f"path-escape:{problem}", f"{case.method} {case.target!r} reached the upstream as {seen.path!r}")


