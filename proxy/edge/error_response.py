"""The one writer of mmgate's error answers: every refusal that goes out before its headers did (the pipeline's,
the middleware's, the connection guard's) is written by ``error_response``, in the client's API shape
(``dialects``: the body and the headers every dialect carries) and with the request's ``X-Request-Id``.

A connection no request handler will ever see (a head too slow, one connection too many) gets the same answer
as raw bytes (``raw_error_response``): no request was read, so there is no request id, and no path, so it is
in OpenAI's shape.
"""

from __future__ import annotations

from aiohttp import hdrs, web

from preprocessors.errors import MmgateError
from proxy.payload.dialects import Dialect, error_headers


def error_response(error: MmgateError, dialect: Dialect, request_id: str | None) -> web.Response:
    """``error`` as an HTTP answer in ``dialect``'s shape; ``request_id`` is None only where no request was read."""
    answer = web.Response(status=error.status, body=dialect.error_body(error), content_type="application/json")
    if request_id is not None:
        answer.headers["X-Request-Id"] = request_id
    answer.headers.update(error_headers(error))
    return answer


def raw_error_response(error: MmgateError) -> bytes:
    """A complete HTTP/1.1 answer for a connection no request handler will ever see, then close."""
    answer = error_response(error, Dialect.OPENAI, None)
    body = Dialect.OPENAI.error_body(error)  # what ``answer`` holds, typed as the bytes it is
    head = [f"HTTP/1.1 {answer.status} {answer.reason}", f"Content-Type: {answer.headers[hdrs.CONTENT_TYPE]}",
            f"Content-Length: {len(body)}", "Connection: close"]
    head.extend(f"{name}: {value}" for name, value in answer.headers.items() if name != hdrs.CONTENT_TYPE)
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
