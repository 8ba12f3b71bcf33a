"""mmgate's one exception tree: refusals as plain data, raised by any layer, rendered in one place.

::

    MmgateError(status, code, message, param, headers)   preprocessors/base.py: the root
    ├── MediaError      the client's media is bad (workers, data URLs, base64): its part counts as rejected
    ├── InvalidJson     the body is not JSON (rawjson): forwarded untouched when it cannot hold media
    └── UpstreamError   the upstream failed (``kind``: connect, timeout, reset): counted as an upstream error

No layer below the pipeline knows HTTP answers: each raises one of these, ``pipeline.handle_request``
catches them once, and ``refusals.py`` writes them in the client's API shape (``dialects.py`` holds the
shapes). Errors the upstream answers itself are never wrapped: they pass through byte for byte.

Outside the tree on purpose, since neither ever reaches a client as an answer:
``preprocessors.base.Cancelled`` (a decode worker stops work nobody waits for any more) and the start-up
errors ``settings.ConfigError`` / ``cli.ListenError`` (one line on stderr, exit status 2).
"""

from __future__ import annotations

from typing import Literal

from preprocessors.base import MediaError, MmgateError

__all__ = ["InvalidJson", "MediaError", "MmgateError", "UpstreamError", "draining", "internal_error"]

UpstreamFailure = Literal["connect", "timeout", "reset"]


class InvalidJson(MmgateError):
    """The request body is not JSON. Told apart because a body that cannot hold media goes through as sent."""

    def __init__(self, message: str) -> None:
        super().__init__(400, "invalid_json", message)


class UpstreamError(MmgateError):
    """The upstream could not be reached or failed mid-answer. Told apart because it counts under
    ``mmgate_upstream_errors_total{kind}`` instead of ``mmgate_rejected_total``."""

    def __init__(self, status: int, code: str, message: str, kind: UpstreamFailure) -> None:
        super().__init__(status, code, message)
        self.kind = kind


def draining() -> MmgateError:
    """503 for a request that arrives (or would queue) once the drain refuses new work."""
    return MmgateError(503, "draining", "mmgate is shutting down; retry on another replica",
                       headers={"Retry-After": "1"})


def internal_error(request_id: str) -> MmgateError:
    """500 for a fault of mmgate's own: the client learns the request id its log line is under, never a traceback."""
    return MmgateError(500, "internal_error",
                       f"mmgate failed on this request; its log has the details under request id {request_id}")
