"""The composition root: ``build_app(settings)`` wires every part; tests use the very same factory.

What exists without an event loop is built with the app (``build_state``: settings, metrics, gate,
policies) and stored under ``state.BASE``. The resources live in ``cleanup_ctx`` (created on start-up, closed
on shutdown, in reverse order): ``_resources`` builds the upstream ClientSession, the fetch client, the decode
pool (its worker processes killed and reaped at shutdown) and the media cache, each closed where it was
built, and the media step that works with them (``step.MediaStep``), and stores the complete ``AppState``
under ``state.STATE``; then the served model's watcher (``auto``), the decode pool's start (its workers
started and ready, while the watcher looks), the upstream watcher, the event-loop lag watcher and the idle
trimmer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware

from preprocessors.base import AudioPolicy, ImagePolicy, VideoPolicy
from preprocessors.job import warm_up
from preprocessors.pool import DecodePool
from preprocessors.workers import ProcessPool
from proxy.admin.backend_metrics import METRICS_PATH, merged_metrics
from proxy.admin.dashboard_stats import rss_bytes
from proxy.admin.routes import add_admin_routes, probe_upstream
from proxy.admission.client import Fleet, GateClient, GateCounters, LocalGate, configured_limit, gate_from_settings
from proxy.edge.connections import ConnectionGuard
from proxy.edge.pacing import Pacer
from proxy.edge.refusals import refusals_in_api_shape
from proxy.edge.site import mark_head_received
from proxy.edge.write_deadline import stall_deadline
from proxy.fetch.fetcher import FETCH_OUTCOMES, Fetcher, FetchLimits
from proxy.fetch.policy import AddressPolicy, CheckedResolver, HostPolicy
from proxy.media.cache import MediaCache, NoCache, VerdictCache, settings_fingerprint
from proxy.media.discovery import AUTO as AUTO_MODEL
from proxy.media.discovery import (
    NONE,
    ModelWatcher,
    ServedModel,
    WatchedUpstream,
    ask_upstream,
    explicit_folder,
    find_once,
)
from proxy.media.model import Model
from proxy.media.model_folder import load_model
from proxy.media.step import MediaStep, Policies
from proxy.ops.merged_metrics import report_of
from proxy.ops.metrics import Metrics, watch_loop_lag
from proxy.pipeline import expect_continue, handle_request, warm_up_request_path
from proxy.processes.link import Link
from proxy.processes.remote_gate import RemoteGate
from proxy.runtime.memory import IdleTrimmer, release_freed_memory, worker_environment
from proxy.settings import MIB, ConfigError, Settings, policy_values
from proxy.state import BASE, STATE, AppBase, AppState, Lifecycle

log = logging.getLogger("mmgate")
# The served model's watcher (MMGATE_MODEL=auto), where tests and tools can await what it found.
MODEL_WATCHER = web.AppKey("mmgate_model_watcher", ModelWatcher)


def build_state(settings: Settings, link: Link | None = None,
                on_gate_lost: Callable[[], None] = lambda: None, front_index: int = 0) -> AppBase:
    """Everything the handlers share that exists before start-up. ConfigError when MMGATE_MODEL cannot be
    loaded (cached: loaded once).

    With ``link`` (a front process of several) the gate is the supervisor's, reached through it
    (``remote_gate.RemoteGate``); ``on_gate_lost`` is called if the supervisor goes away. That is the one
    place which gate serves is chosen: everything else uses either through ``GateClient``, and the other
    front processes through ``state.fleet`` (None in one process)."""
    model = served_model(settings)
    served = ServedModel.at_start(settings.decode.model, model)
    metrics = Metrics()
    trimmer = IdleTrimmer(settings.memory.trim_idle, release_freed_memory(), metrics.memory_trims.inc)

    def gate_changed(counters: GateCounters) -> None:
        metrics.gate_in_use.set(counters.in_use)
        metrics.gate_waiting.set(counters.waiting)
        metrics.gate_reading.set(counters.reading)
        metrics.media_bytes_inflight.set(counters.bytes_in_use)
        metrics.image_tokens_inflight.set(counters.tokens_in_use)
        metrics.gate_limit.set(counters.limit)
        trimmer.follow(running=counters.in_use, waiting=counters.waiting)

    lifecycle = Lifecycle()
    gate: GateClient
    fleet: Fleet | None = None
    if link is None:
        gate = LocalGate(gate_from_settings(settings.gate, gate_changed, lambda: lifecycle.refusing))
    else:
        # The supervisor's gate is also how this front reaches the others: one connection, both roles.
        gate = fleet = RemoteGate(link, configured_limit(settings.gate)[0], gate_changed, lifecycle,
                                  report=lambda: front_report(state, front_index), on_lost=on_gate_lost,
                                  answer_timeout=settings.listen.process_timeout)
    image_policy = ImagePolicy(**policy_values(settings, "image"),
                               geometry=model.geometry if model is not None else None)
    connections = ConnectionGuard(settings.listen.max_connections, settings.timeouts.header_timeout,
                                  lambda code: metrics.rejected.labels(code).inc(),
                                  metrics.idle_connections_closed.inc,
                                  write_timeout=stall_deadline(settings.timeouts.client_write_timeout,
                                                               settings.timeouts.upstream_read_timeout),
                                  on_write_timeout=metrics.client_write_timeouts.inc,
                                  access_log=settings.logs.access_log)
    metrics.client_connections.set_function(lambda: connections.open)
    state = AppBase(settings=settings, metrics=metrics, gate=gate, fleet=fleet, image_policy=image_policy,
                    audio_policy=AudioPolicy(**policy_values(settings, "audio")),
                    video_policy=VideoPolicy(**policy_values(settings, "video")),
                    trimmer=trimmer, connections=connections, lifecycle=lifecycle, model=model,
                    pacer=Pacer(settings.listen.loop_lag_target, metrics.upload_holds.inc),
                    upstream=WatchedUpstream(settings.backend.upstream, settings.backend.upstream_health_path),
                    served=served)
    pacer, buffers, traffic = state.pacer, state.buffers, state.traffic
    metrics.uploads_held.set_function(lambda: pacer.held)
    metrics.media_bytes_live.set_function(lambda: buffers.bytes_live)
    metrics.requests_reading.set_function(lambda: traffic.reading)
    metrics.media_buffers_live.set_function(lambda: buffers.owners_live)
    metrics.cache_limit_bytes.set(settings.memory.cache_bytes)
    return state


def front_report(state: AppBase, front_index: int) -> dict[str, Any]:
    """This front's answer to the gate's "report": every metric, and the totals /mmgate/stats adds up."""
    extra = {"in_flight": state.in_flight, "reading": state.reading, "rss_bytes": rss_bytes() or 0,
             "decode_workers": state.settings.decode.decode_workers, "cache_mb": state.settings.memory.cache_mb}
    front = {"index": front_index, "pid": os.getpid(), "in_flight": state.in_flight}
    return report_of(list(state.metrics.registry.collect()), extra, front)


def served_model(settings: Settings) -> Model | None:
    """The model MMGATE_MODEL names, whose geometry and token count apply from the start, or None (auto: found
    later, ``_model_watcher``; none; or a family mmgate has no geometry for: the generic rule, warned about by
    ``load_model``). With MMGATE_MM_PROCESSOR_KWARGS, its processor as the server overrides it."""
    spec, overrides = settings.decode.model, settings.decode.mm_processor_kwargs
    if spec == NONE and settings.gate.max_inflight_image_tokens:
        raise ConfigError("MMGATE_MAX_INFLIGHT_IMAGE_TOKENS needs a model whose image tokens mmgate counts; "
                          "MMGATE_MODEL=none turns the model mode off")
    if spec in (AUTO_MODEL, NONE):
        return None
    model = load_model(str(explicit_folder(spec, overrides)) if overrides else spec)
    if not model.supported:
        if settings.gate.max_inflight_image_tokens:
            raise ConfigError(f"MMGATE_MAX_INFLIGHT_IMAGE_TOKENS needs a model whose image tokens mmgate counts; "
                              f"MMGATE_MODEL={settings.decode.model!r} is a {model.family} model, which it does not")
        return None
    return model


def model_in_force(settings: Settings) -> str:
    """``--print-config``'s line on the served model: the family and geometry in force, or why none is; with
    MMGATE_MODEL=auto the upstream is asked once, now."""
    spec = settings.decode.model
    if spec == NONE:
        return "none (MMGATE_MODEL=none): the generic rule (MMGATE_RESIZE_MAX_*)"
    if spec != AUTO_MODEL:
        return ServedModel.at_start(spec, served_model(settings)).line()
    if not settings.backend.upstream:
        return "auto: MMGATE_UPSTREAM is not set, so there is no upstream to ask which model it serves"
    found = asyncio.run(find_once(settings.backend.upstream, settings.decode.model_dirs,
                                  settings.decode.mm_processor_kwargs))
    return "auto (asked the upstream now): " + found.line()


def make_pool(settings: Settings, metrics: Metrics, image_policy: ImagePolicy) -> DecodePool:
    """The decode pool MMGATE_DECODE_MODE names: threads, or threads that each drive a worker process; either
    warms up before the first request, threads with ``image_policy`` (the served model's geometry included:
    its helpers load in this process), worker processes with the formats only (``MediaTask.known_targets``)."""
    if settings.decode.decode_mode == "process":
        return ProcessPool(settings.decode.decode_workers, max_jobs=settings.decode.worker_max_jobs,
                           max_rss_bytes=settings.decode.worker_max_rss_mb * MIB,
                           on_exit=lambda reason: metrics.decode_worker_exits.labels(reason).inc(),
                           environment=worker_environment(os.environ, memory_first=settings.memory.malloc_tuning),
                           trim_idle=settings.memory.trim_idle)
    return DecodePool(settings.decode.decode_workers, warm_policy=image_policy)


async def _resources(app: web.Application) -> AsyncIterator[None]:
    """Build every resource the handlers need once the loop runs, store the complete ``AppState``, and close
    each resource at shutdown, in reverse order (the pool before the cache); the pool is started by
    ``_decode_pool_started``, and one that fails to start closes them all."""
    base = app[BASE]
    async with contextlib.AsyncExitStack() as resources:
        session = await resources.enter_async_context(_upstream_session(base.settings))
        fetcher = await resources.enter_async_context(_fetch_client(base))
        cache = _media_cache(base)
        resources.callback(cache.close)
        pool = make_pool(base.settings, base.metrics, base.image_policy)
        app[STATE] = state = AppState.completing(base, session=session,
                                                 media=_media_step(base, pool, cache, fetcher))
        # the pool the state holds at shutdown: a bench may have swapped in its own (testkit.variants)
        resources.callback(lambda: state.pool.shutdown())
        metrics = state.metrics
        metrics.pool_queue_depth.set_function(lambda: state.pool.queued)
        metrics.pool_stuck_workers.set_function(lambda: state.pool.stuck)
        yield


async def _decode_pool_started(app: web.Application) -> AsyncIterator[None]:
    """Every decode worker (a process in process mode) started and ready before the first request: the first
    media request is as fast as the next, and a worker that cannot start stops mmgate here (the state stays,
    so what the failed start left can be inspected; nothing is served). After ``_model_watcher``: under
    ``auto`` the served model is looked for, and its processor loaded, while the workers start."""
    state = app[STATE]
    await asyncio.to_thread(state.pool.start)
    warm_up_request_path(state.media, state.plan_limits)
    yield


def _media_step(base: AppBase, pool: DecodePool, cache: VerdictCache, fetcher: Fetcher | None) -> MediaStep:
    """The media step of every request, with what it works with."""
    settings = base.settings
    policies = Policies(settings.limits.max_media_item_bytes, base.image_policy, base.audio_policy, base.video_policy)
    return MediaStep(cache, pool, base.gate, fetcher, base.metrics, policies, settings.timeouts.queue_timeout,
                      settings.timeouts.preprocess_timeout, base.model, settings.limits.max_body_bytes)


@contextlib.asynccontextmanager
async def _upstream_session(settings: Settings) -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(limit=settings.backend.upstream_max_connections, limit_per_host=0,
                                     enable_cleanup_closed=True)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                     cookie_jar=aiohttp.DummyCookieJar()) as session:
        yield session


@contextlib.asynccontextmanager
async def _fetch_client(base: AppBase) -> AsyncIterator[Fetcher | None]:
    """MMGATE_MEDIA_URLS=fetch: a client of its own (pool, resolver, limits) for media URLs, apart from the
    upstream's; no cookies, no proxy from the environment, bodies read as sent. None otherwise."""
    settings = base.settings
    if settings.fetch.media_urls != "fetch":
        yield None
        return
    addresses = AddressPolicy.from_cidrs(settings.fetch.fetch_allow_addresses)
    connector = aiohttp.TCPConnector(limit=settings.fetch.fetch_max_connections, limit_per_host=0,
                                     resolver=CheckedResolver(addresses), use_dns_cache=False,
                                     enable_cleanup_closed=True)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=False,
                                    cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=None))
    metrics = base.metrics
    for outcome in FETCH_OUTCOMES:  # every series from the start, at 0, so rates and alerts see them
        metrics.fetches.labels(outcome)

    def counted(outcome: str, nbytes: int) -> None:
        metrics.fetches.labels(outcome).inc()
        metrics.fetched_bytes.inc(nbytes)

    fetch = settings.fetch
    limits = FetchLimits(fetch.fetch_max_redirects, fetch.fetch_timeout, fetch.fetch_first_byte_timeout)
    async with session:
        yield Fetcher(session, HostPolicy.from_patterns(fetch.fetch_allow_hosts), addresses, limits, counted)


def _media_cache(base: AppBase) -> VerdictCache:
    """The processed-media cache (MMGATE_CACHE_MB), or a ``NoCache`` in its place; with several front
    processes a miss here is first asked of the other fronts' caches."""
    settings, metrics = base.settings, base.metrics
    if not settings.memory.cache_mb:
        return NoCache()
    cache = MediaCache(settings.memory.cache_bytes, settings_fingerprint(settings),
                       min(4, settings.decode.decode_workers),
                       metrics.cache_hits.inc, metrics.cache_misses.inc, metrics.cache_evictions.inc)
    cache.peers = base.fleet.share_cache(cache.get) if base.fleet is not None else None
    metrics.cache_bytes.set_function(lambda: cache.bytes_held)
    metrics.cache_entries.set_function(lambda: cache.entries)
    metrics.cache_waiting.set_function(lambda: cache.waiting)
    return cache


async def _warm_for(state: AppState, model: Model) -> None:
    """The model's geometry run once on a tiny image before it is put in force, as a model named at start-up is
    when the pool starts: its processor's helpers load here, not on the first client's image (about a second).
    The formats are warm already; decode worker processes need none of it (``job.MediaTask.known_targets``)."""
    policy = replace(state.image_policy, geometry=model.geometry)
    await asyncio.to_thread(functools.partial(warm_up, policy, formats=False))


def _put_in_force(state: AppState, found: ServedModel, settings_print: str) -> None:
    """Make ``found`` the model every request from now on works to: its geometry in the image policy the
    decode tasks carry, its count, and a cache key of its own (a verdict made for another geometry is never a
    hit). Runs on the loop between two requests' steps, so a request sees one model or the other."""
    state.served = found
    model = found.model
    state.model = model
    state.image_policy = replace(state.image_policy, geometry=model.geometry if model is not None else None)
    media = state.media
    media.model = model
    media.policies = replace(media.policies, image=state.image_policy)
    media.cache.settings_print = settings_print + (f";served={found.folder}" if model is not None else "")


async def _model_watcher(app: web.Application) -> AsyncIterator[None]:
    """MMGATE_MODEL=auto: the served model found in the background (readiness never waits on it), put in force
    when found, looked for again when the upstream comes back (``discovery.ModelWatcher``)."""
    state = app[STATE]
    settings = state.settings
    if settings.decode.model != AUTO_MODEL:
        log.info("served model: %s", state.served.line())
        yield
        return
    settings_print = state.media.cache.settings_print
    watcher = ModelWatcher(lambda: ask_upstream(state.session, settings.backend.upstream),
                           settings.decode.model_dirs, settings.decode.mm_processor_kwargs,
                           lambda found: _put_in_force(state, found, settings_print),
                           prepare=lambda model: _warm_for(state, model))
    app[MODEL_WATCHER] = watcher
    if isinstance(state.upstream, WatchedUpstream):
        state.upstream.on_down, state.upstream.on_back = watcher.upstream_down, watcher.upstream_back
    task = asyncio.create_task(watcher.run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _upstream_watcher(app: web.Application) -> AsyncIterator[None]:
    """Checks the upstream at start-up (mmgate starts either way) and again while it is known to be down."""
    state = app[STATE]
    task = asyncio.create_task(state.upstream.watch(lambda: probe_upstream(state)))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _loop_lag_watcher(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(watch_loop_lag(app[BASE].metrics))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _idle_trimmer(app: web.Application) -> AsyncIterator[None]:
    yield
    app[BASE].trimmer.close()


def build_app(settings: Settings, *, admin: bool | None = None,
              link: Link | None = None, on_gate_lost: Callable[[], None] = lambda: None,
              front_index: int = 0) -> web.Application:
    """The proxy application. ``admin`` serves /mmgate/* here too (default: unless MMGATE_ADMIN_PORT is set).
    ``link``: this is one front process of several, sharing the supervisor's gate (``build_state``)."""
    # auto_decompress off: a compressed request body is forwarded as the client sent it (Content-Encoding
    # included), and refused on media routes where mmgate would have to look inside.
    state = build_state(settings, link, on_gate_lost, front_index)
    app = web.Application(client_max_size=settings.limits.max_body_bytes,
                          handler_args={"max_field_size": 65536, "auto_decompress": False},
                          middlewares=[mark_head_received(state.connections), _refusals(state)])
    app[BASE] = state
    app.cleanup_ctx.extend([_resources, _model_watcher, _decode_pool_started, _upstream_watcher, _loop_lag_watcher,
                            _idle_trimmer])
    if admin if admin is not None else not settings.listen.admin_port:
        add_admin_routes(app)
    # What an endpoint picker scrapes: the backend's, with mmgate's queue.
    if settings.backend.backend_metrics == "merge":  # merge-admin: on the admin port (``build_admin_app``)
        app.router.add_get(METRICS_PATH, merged_metrics)
    app.router.add_route("*", "/{tail:.*}", handle_request, expect_handler=expect_continue)
    return app


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner ``mmgate serve`` and the tests listen with (through ``site.GuardedSite``)."""
    # drain() already waited for in-flight requests; the runner's own shutdown wait is only for stragglers,
    # so the whole stop stays within MMGATE_DRAIN_GRACE + MMGATE_DRAIN_TIMEOUT (+1 s).
    return web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                         keepalive_timeout=app[BASE].settings.timeouts.keepalive_timeout)


def build_admin_app(state: AppState) -> web.Application:
    """The admin-only app for MMGATE_ADMIN_PORT: /mmgate/* and nothing else, sharing the proxy's state; with
    MMGATE_BACKEND_METRICS=merge-admin also the merged /metrics."""
    app = web.Application(middlewares=[_refusals(state)])
    app[STATE] = state
    add_admin_routes(app)
    if state.settings.backend.backend_metrics == "merge-admin":
        app.router.add_get(METRICS_PATH, merged_metrics)
    return app


def _refusals(state: AppBase) -> Middleware:
    """The door's refusals in the client's API shape, counted and logged as every refusal is."""
    return refusals_in_api_shape(lambda code: state.metrics.rejected.labels(code).inc(),
                                 state.settings.logs.access_log)
