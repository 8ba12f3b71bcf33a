"""What each API looks like to mmgate: its routes and its error shape (where its media lives: ``walkers``).

Routes: the media-aware paths (``route_for``); every other path is forwarded without a look inside.

Error shapes: each API's SDKs map its own error document to their exceptions, so a refusal is written in
the shape of the API the client speaks (``Dialect.error_body``, ``Dialect.error_event``).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Literal

import orjson

from preprocessors.errors import MmgateError

Route = Literal["chat", "responses", "messages", "generate", "other"]

_ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/generate": "generate",
}


def route_for(method: str, path: str) -> Route:
    """The media-aware route for a request (exact path; a trailing slash is ignored), else "other"."""
    if method.upper() != "POST":
        return "other"
    if len(path) > 1 and path.endswith("/"):
        path = path[:-1]
    return _ROUTES.get(path, "other")


class Dialect(str, Enum):
    """Which API's error shape a client expects: Anthropic's Messages API has its own, the rest speak OpenAI's."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"

    def error_body(self, error: MmgateError) -> bytes:
        """The JSON error document of this API, for an answer whose headers have not gone out yet."""
        return _ERROR_BODIES[self](error)

    def error_event(self, error: MmgateError) -> bytes:
        """The last event of an SSE stream that broke after its headers went out (docs/architecture.md,
        "The error model")."""
        return b"data: " + self.error_body(error) + b"\n\n"


def dialect_for_path(path: str) -> Dialect:
    return Dialect.ANTHROPIC if path.rstrip("/").startswith("/v1/messages") else Dialect.OPENAI


# status -> (OpenAI type, Anthropic type): the error types each API's SDKs map to their exceptions. A status not
# named has the types of its class: a 4xx is an invalid request in both APIs, a 5xx the server's own error.
_ERROR_TYPES: dict[int, tuple[str, str]] = {
    404: ("invalid_request_error", "not_found_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    501: ("invalid_request_error", "api_error"),
    502: ("upstream_error", "api_error"),
    503: ("server_error", "overloaded_error"),
    504: ("timeout_error", "api_error"),
}
_CLIENT_ERROR_TYPES = ("invalid_request_error", "invalid_request_error")
_SERVER_ERROR_TYPES = ("server_error", "api_error")


def _error_types(status: int) -> tuple[str, str]:
    return _ERROR_TYPES.get(status) or (_CLIENT_ERROR_TYPES if status < 500 else _SERVER_ERROR_TYPES)


def _openai_error(error: MmgateError) -> bytes:
    """``{"error": {"message", "type", "code", "param"}}``: the code and the path have fields of their own."""
    error_type = _error_types(error.status)[0]
    return orjson.dumps(
        {"error": {"message": error.message, "type": error_type, "code": error.code, "param": error.param}}
    )


def _anthropic_error(error: MmgateError) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}``: no field for the code or the path, so the
    message carries both."""
    error_type = _error_types(error.status)[1]
    where = f" (at {error.param})" if error.param else ""
    message = f"{error.message}{where} [mmgate: {error.code}]"
    return orjson.dumps({"type": "error", "error": {"type": error_type, "message": message}})


_ERROR_BODIES: dict[Dialect, Callable[[MmgateError], bytes]] = {
    Dialect.OPENAI: _openai_error,
    Dialect.ANTHROPIC: _anthropic_error,
}

# Refusals a retry cannot fix. openai-python and anthropic-sdk-python read ``x-should-retry`` before their
# own status rules, so a client does not resend a body that will be refused again.
_NOT_RETRYABLE = frozenset({400, 404, 413, 415, 417, 422, 501})


def error_headers(error: MmgateError) -> dict[str, str]:
    """The headers a refusal carries in every dialect: its own (``Retry-After``), then ``x-should-retry``."""
    headers = dict(error.headers)
    if error.status in _NOT_RETRYABLE:
        headers.setdefault("x-should-retry", "false")
    return headers


    # "file" (Files API) and unknown source types: nothing inline, the backend judges.


    # None, numbers, embedding objects: not media we process.


