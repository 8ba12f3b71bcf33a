"""How a refusal reaches the client: in its API's shape before the headers went out, as a last SSE event or
a cut connection after; and where mmgate's own faults are logged.

Every refusal mmgate makes goes through here: those of ``pipeline.handle_request``, and (through
``refusals_in_api_shape``) those aiohttp gives before the handler runs or the admin routes raise. Each is
written by ``error_response.error_response``, the one writer of error answers.

A fault of mmgate's own (``internal_error``) is logged once, with its traceback, on the ``mmgate.error``
logger, apart from the access log (``mmgate.access``), under the request id the client is told.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from preprocessors.errors import INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_ALLOWED, PATH_NOT_ALLOWED, MmgateError
from proxy.edge.access_log import log_refused_request, loggable
from proxy.edge.error_response import error_response
from proxy.edge.paths import normalise_target
from proxy.edge.upstream import request_id_for
from proxy.payload.dialects import Dialect, dialect_for_path

error_log = logging.getLogger("mmgate.error")


def internal_error(request_id: str, where: str) -> MmgateError:
    """500 for a fault of mmgate's own, called where it was caught: its traceback goes to ``mmgate.error``
    under ``request_id``; the client learns the request id, never the traceback."""
    error_log.exception("request %s%s: internal error", request_id, where)
    return INTERNAL_ERROR.error(
        f"mmgate failed on this request; its log has the details under request id {request_id}")


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
    answer = error_response(error, dialect, request_id)
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


def refusals_in_api_shape(on_refused: Callable[[str], None], access_log: bool) -> Middleware:
    """The middleware that answers what aiohttp refuses before ``handle_request`` runs (a target the router
    cannot match, a method the admin routes do not serve) or the admin routes raise, in the client's API shape
    like every other refusal; a fault is a 500, never a traceback. Each refusal's code goes to ``on_refused``
    (the rejected counter) and, with ``access_log`` (MMGATE_ACCESS_LOG), its access log line is written."""

    @web.middleware
    async def refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = request_id_for(request.headers.get("X-Request-Id"))
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = _refusal_for(request, exc)
        except ConnectionResetError:  # the client left mid-answer (handle_request counted it as 499): none to send
            raise
        except MmgateError as refused:  # an admin route's own refusal (the shared gate hung or gone: 503)
            error = refused
        except Exception:
            error = internal_error(request_id, f" ({request.method} {loggable(request.path)})")
        on_refused(error.code)
        if access_log:
            log_refused_request(error, request, request_id, 0.0)
        return error_response(error, dialect_for_path(request.path), request_id)

    return refusals


def _refusal_for(request: web.Request, exc: web.HTTPException) -> MmgateError:
    """The registry's answer for an HTTP exception aiohttp raised: 404 from the router, 405 on the admin port."""
    if exc.status == 404:
        try:  # a target the router cannot even match (a raw control character) is an invalid path
            normalise_target(request.raw_path)
        except MmgateError as invalid:
            return invalid
        return PATH_NOT_ALLOWED.error(exc.reason)
    if exc.status == 405:
        return METHOD_NOT_ALLOWED.error(exc.reason)
    return INVALID_REQUEST.error(exc.reason)
