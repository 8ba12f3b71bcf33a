"""One error type for everything mmgate refuses, rendered in the client's API shape.

Exception tree (the only one in the project)::

    ProxyError(status, code, message, param)     -- raised by mmgate itself
    └── rendered by ``render()`` as
        OpenAI     {"error": {"message", "type", "code", "param"}}        (default)
        Anthropic  {"type": "error", "error": {"type", "message"}}         (/v1/messages)

``preprocessors.base.MediaError`` (no aiohttp in that package) is translated into a ProxyError at the
pipeline boundary. Errors from the upstream are never wrapped: they pass through byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import orjson


class Dialect(str, Enum):
    """Which API's error shape a client expects."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


# status -> (OpenAI type, Anthropic type): the error types each API's SDKs map to their exceptions.
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    404: ("invalid_request_error", "not_found_error"),
    408: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    417: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    501: ("invalid_request_error", "api_error"),
    502: ("upstream_error", "api_error"),
    503: ("server_error", "overloaded_error"),
    504: ("timeout_error", "api_error"),
}


# Refusals a retry cannot fix. openai-python and anthropic-sdk-python read ``x-should-retry`` before their
# own status rules, so a client does not resend a body that will be refused again.
_NOT_RETRYABLE = frozenset({400, 404, 413, 415, 417, 422, 501})


@dataclass
class ProxyError(Exception):
    """A refusal by mmgate: HTTP status, stable machine ``code``, human message, optional JSON path."""

    status: int
    code: str
    message: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(f"{self.status} {self.code}: {self.message}")
        if self.status in _NOT_RETRYABLE:
            self.headers.setdefault("x-should-retry", "false")

    def type_for(self, dialect: Dialect) -> str:
        openai_type, anthropic_type = _TYPES.get(self.status, ("server_error", "api_error"))
        return anthropic_type if dialect is Dialect.ANTHROPIC else openai_type

    def body(self, dialect: Dialect) -> bytes:
        """The JSON error document in ``dialect``'s shape."""
        if dialect is Dialect.ANTHROPIC:
            where = f" (at {self.param})" if self.param else ""
            message = f"{self.message}{where} [mmgate: {self.code}]"
            return orjson.dumps({"type": "error", "error": {"type": self.type_for(dialect), "message": message}})
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type_for(dialect),
                    "code": self.code,
                    "param": self.param,
                }
            }
        )

    def sse_event(self, dialect: Dialect) -> bytes:
        """The last event of a stream that broke after its headers went out (README "When mmgate refuses")."""
        return b"data: " + self.body(dialect) + b"\n\n"

    @classmethod
    def draining(cls) -> "ProxyError":
        """503 for a request that arrives (or would queue) after SIGTERM's drain began."""
        return cls(503, "draining", "mmgate is shutting down; retry on another replica", headers={"Retry-After": "1"})


def dialect_for_path(path: str) -> Dialect:
    """Anthropic's Messages API has its own error shape; everything else speaks OpenAI's."""
    return Dialect.ANTHROPIC if path.rstrip("/").startswith("/v1/messages") else Dialect.OPENAI
