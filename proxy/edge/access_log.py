"""The access log (logger ``mmgate.access``): one line per request, the readable text and every field for a
structured formatter. ``exchange.record`` writes a handled request's; the door writes those of requests it
refused before any handler saw them (one connection too many, a head too slow, a path the router cannot match).
"""

from __future__ import annotations

import logging

from aiohttp import web

from preprocessors.errors import MmgateError

log = logging.getLogger("mmgate.access")


def loggable(text: str, limit: int = 512) -> str:
    """A client-chosen string for a text log line: control characters escaped, so a path cannot forge lines
    or drive a terminal."""
    text = text[:limit]
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def log_refused_connection(error: MmgateError, request_line: bytes, seconds: float) -> None:
    """The access log line of a refusal no request handler saw (one connection too many, a head too slow):
    the method and path from ``request_line``, what arrived of the request line (``-`` where they did not),
    no request id (none was read), no route."""
    method, _, rest = request_line.partition(b" ")
    target = rest.partition(b" ")[0].partition(b"?")[0] if rest else b""
    write_line({
        # Unparsed bytes (a TLS handshake to the plain port is one): escaped like any client-chosen log text.
        "request_id": None, "method": loggable(method.decode("latin-1"), 32) or "-",
        "path": loggable(target.decode("latin-1")) or "-",
        "route": "other", "kind": "text", "status": error.status, "code": error.code,
        "duration_ms": round(seconds * 1000, 2), "stages_ms": {}, "bytes_in": 0, "media_in": 0, "media_out": 0,
        "fetched": 0, "answered_by": "mmgate",
    })


def log_refused_request(error: MmgateError, request: web.Request, request_id: str, seconds: float) -> None:
    """The access log line of a request refused by the door before ``pipeline.handle_request`` saw it."""
    write_line({
        "request_id": request_id, "method": request.method, "path": request.path, "route": "other", "kind": "text",
        "status": error.status, "code": error.code, "duration_ms": round(seconds * 1000, 2), "stages_ms": {},
        "bytes_in": 0, "media_in": 0, "media_out": 0, "fetched": 0, "answered_by": "mmgate",
    })


def write_line(fields: dict[str, object]) -> None:
    """One access log line: the readable text, and every field for a structured formatter (``extra``)."""
    log.info("%s %s %s %s %s %.1fms %s", fields["request_id"] or "-", fields["method"], loggable(str(fields["path"])),
             fields["status"], fields["kind"], fields["duration_ms"], fields["code"] or "-", extra={"fields": fields})
