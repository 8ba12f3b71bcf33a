"""Admin endpoints under /mmgate/: liveness, readiness, Prometheus metrics, the dashboard and its JSON.

Liveness is answered from the loop alone: it never waits on media work, the upstream or the shared gate, and
stays 200 while draining (the process is alive; Kubernetes must not restart it mid-drain). Readiness probes the
upstream (cached about a second, so a probe storm never becomes an upstream storm) and fails while draining;
with several front processes it also fails while the supervisor's gate does not answer (hung or gone).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from proxy.admin.backend_metrics import backend_metrics
from proxy.admin.dashboard_stats import snapshot
from proxy.edge.upstream import local_shortage
from proxy.ops.merged_metrics import MergedFamilies
from proxy.state import STATE, AppState

READY_CACHE_SECONDS = 1.0
READY_PROBE_TIMEOUT = 2.0
# The probe says who it is, so an upstream's access log (and a test's upstream) can tell it from client traffic.
PROBE_USER_AGENT = "mmgate-upstream-check"
DASHBOARD_DIR = Path(__file__).parent / "dashboard"
log = logging.getLogger("mmgate")


def _state(request: web.Request) -> AppState:
    return request.app[STATE]


async def health(request: web.Request) -> web.Response:
    state = _state(request)
    return web.json_response({"status": "ok", "draining": not state.lifecycle.ready})


async def probe_upstream(state: AppState) -> tuple[bool, str]:
    """Whether the upstream's health endpoint answers 2xx; reused for about a second. Also what
    ``state.upstream`` knows: a failed connect marks the upstream down (unless mmgate's own resources failed
    it, ``upstream.LOCAL_ERRNOS``), any answer marks it up."""
    checked_at, ok, detail = state.ready_cache
    now = time.monotonic()
    if now - checked_at < READY_CACHE_SECONDS:
        return ok, detail
    url = state.settings.backend.upstream + state.settings.backend.upstream_health_path
    timeout = aiohttp.ClientTimeout(total=READY_PROBE_TIMEOUT, sock_connect=READY_PROBE_TIMEOUT)
    try:
        async with state.session.get(url, timeout=timeout, headers={"User-Agent": PROBE_USER_AGENT}) as response:
            await response.read()
            ok, detail = 200 <= response.status < 300, f"upstream health answered {response.status}"
        state.upstream.reached()
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        ok, detail = False, f"upstream health failed: {exc.__class__.__name__}"
        shortage = local_shortage(exc)
        if shortage is not None:  # mmgate's own want of descriptors or ports: the upstream is not known down
            log.error("the upstream check could not open a connection: %s; mmgate's own shortage, not the upstream's "
                      "fault", shortage)
            detail = f"mmgate could not connect: {shortage}"
        else:
            number = getattr(getattr(exc, "os_error", None), "errno", None)
            state.upstream.unreachable(os.strerror(number).lower() if isinstance(number, int) and number > 0
                                       else exc.__class__.__name__)  # "connection refused"
    except (aiohttp.ClientError, TimeoutError) as exc:  # connected, then failed: not known to be down
        ok, detail = False, f"upstream health failed: {exc.__class__.__name__}"
    state.ready_cache = (time.monotonic(), ok, detail)
    return ok, detail


async def ready(request: web.Request) -> web.Response:
    state = _state(request)
    if not state.lifecycle.ready:
        return web.json_response({"ready": False, "reason": "draining"}, status=503)
    fleet = state.fleet
    if fleet is not None and not await fleet.reachable(min(READY_PROBE_TIMEOUT, state.settings.listen.process_timeout)):
        return web.json_response({"ready": False, "reason": "the shared gate did not answer"}, status=503)
    ok, detail = await probe_upstream(state)
    return web.json_response({"ready": ok, "reason": detail}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text; with several front processes, every front's series summed (whichever process serves
    this request) and the gate's gauges from the one gate."""
    state = _state(request)
    merged = await state.fleet.collect() if state.fleet is not None else None
    if merged is not None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(MergedFamilies(merged))
        body = generate_latest(registry)
    else:
        body = state.metrics.exposition()
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


async def stats(request: web.Request) -> web.Response:
    """A small JSON view for the dashboard (the same numbers as /mmgate/metrics)."""
    state = _state(request)
    view = snapshot(state, await state.fleet.collect() if state.fleet is not None else None)
    view["served_model"] = state.served.describe()  # the family and geometry in force, or why none is
    controller = state.gate.controller()
    if controller is not None:
        # MMGATE_MAX_MM_CONCURRENCY=auto: the phase it is in, and why the limit last moved (one process only)
        view["gate"]["controller"] = controller
    return web.Response(body=orjson.dumps(view), content_type="application/json")


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(DASHBOARD_DIR / "index.html")


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/mmgate/health", health)
    app.router.add_get("/mmgate/ready", ready)
    app.router.add_get("/mmgate/metrics", metrics)
    app.router.add_get("/mmgate/stats", stats)
    app.router.add_get("/mmgate/dashboard", dashboard)
    app.router.add_get("/mmgate/backend/metrics", backend_metrics)
