"""How a refusal reaches the client: in its API's shape before the headers went out, as a last SSE event or
a cut connection after.

Every refusal mmgate makes goes through here: those of ``pipeline.handle_request``, and (through
``refusals_in_api_shape``) those aiohttp gives before the handler runs or the admin routes raise.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from proxy.edge.paths import normalise_target
from proxy.edge.upstream import request_id_for
from proxy.errors import MmgateError, internal_error
from proxy.exchange import log, loggable
from proxy.payload.dialects import Dialect, dialect_for_path, error_headers
from proxy.state import STATE


async def refuse(request: web.Request, error: MmgateError, dialect: Dialect, request_id: str,
                 started: web.StreamResponse | None) -> web.StreamResponse:
    """Answer ``error`` in ``dialect``'s shape, or end ``started``, a response whose headers already went out."""
    if started is not None and started.prepared:
        # Too late to change the status: an SSE stream gets one final error event, anything else is cut.
        if started.content_type == "text/event-stream":
            try:
                await started.write(dialect.error_event(error))
                await started.write_eof()
            except ConnectionResetError:
                pass
        else:
            started.force_close()
            if request.transport is not None:
                request.transport.close()
        return started
    answer = web.Response(status=error.status, body=dialect.error_body(error), content_type="application/json")
    answer.headers["X-Request-Id"] = request_id
    answer.headers.update(error_headers(error))
    if error.status in (408, 413) and not request.content.is_eof():
        # The rest of a body too big or too slow may still be on its way: answer, then close without
        # reading it (aiohttp's lingering close would read on for seconds, megabytes at a time).
        answer.force_close()
        await answer.prepare(request)
        await answer.write_eof()
        request.protocol.force_close()
    # Any other refusal before the body was read whole (429 while it arrived): aiohttp reads the rest and
    # drops it chunk by chunk after the answer (lingering close, at most MMGATE_MAX_BODY_MB and 10 s), so
    # the client, still uploading, gets the answer instead of a reset.
    return answer


@web.middleware
async def refusals_in_api_shape(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answers aiohttp gives before ``handle_request`` runs (a target the router cannot match) or from the
    admin routes, in the client's API shape like every other refusal; a fault is a 500, never a traceback."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = MmgateError(exc.status, "path_not_allowed" if exc.status == 404 else "invalid_request", exc.reason)
        if exc.status == 404:
            try:  # a target the router cannot even match (a raw control character) is an invalid path
                normalise_target(request.raw_path)
            except MmgateError as invalid:
                error = invalid
    except ConnectionResetError:  # the client left mid-answer (handle_request counted it as 499): none to send
        raise
    except Exception:
        request_id = request_id_for(None)
        log.exception("request %s (%s %s): internal error", request_id, request.method, loggable(request.path))
        error = internal_error(request_id)
    request.app[STATE].metrics.rejected.labels(error.code).inc()
    answer = web.Response(status=error.status, body=dialect_for_path(request.path).error_body(error),
                          content_type="application/json")
    answer.headers.update(error_headers(error))
    return answer
