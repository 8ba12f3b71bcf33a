"""mmgate's one exception tree, and the registry of every error it answers: each (status, code) pair is
defined here once, with what it means and the class it is raised as.

::

    MmgateError(entry, message, param, headers)   the root: a refusal as plain data (status and code from entry)
    ├── MediaError        the client's media is bad (workers, data URLs, base64, the plan's measures)
    │   └── WorkerCrashed the item crashed two decode worker processes: the media's own fault, so cached
    ├── WorkerLost        two decode workers ended on the item without it being shown at fault: retry, never cached
    ├── FetchRefused      a media URL mmgate will not or could not fetch (MMGATE_MEDIA_URLS=fetch)
    ├── InvalidJson       the body is not JSON: forwarded untouched when it cannot hold media
    └── UpstreamError     the upstream failed (``kind``: connect, timeout, reset): counted as an upstream error

Outside the tree on purpose, since none reaches a client as an answer: ``preprocessors.base.Cancelled`` (a
decode worker stops work nobody waits for any more), ``worker_handle.WorkerStartError`` and the start-up errors
``settings.ConfigError`` / ``server.ListenError`` (one line on stderr, exit status 2).

Why here: this module imports nothing of mmgate, so it is the bottom of the import graph. The media workers
(``preprocessors/``, never the proxy) raise from it, and every layer of ``proxy/`` imports it without a
cycle. A raise site names a registry entry (``raise INVALID_PATH.error("message", param=...)``), never a
literal code; an error that crossed a process boundary as plain data is made again with ``rebuild``. How an
error looks on the wire is decided by ``proxy/payload/dialects.py``; docs/errors.md lists exactly
``REGISTRY`` (tests/preprocessors/test_errors.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

UpstreamFailure = Literal["connect", "timeout", "reset"]


class MmgateError(Exception):
    """A refusal as plain data: HTTP ``status``, stable machine ``code`` (both from its registry ``entry``),
    a message for a person, the JSON path of the part at fault (``param``) and any headers the answer must
    carry. Made by ``ErrorCode.error``."""

    def __init__(self, entry: ErrorCode[Any], message: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{entry.status} {entry.code}: {message}")
        self.entry = entry
        self.status = entry.status
        self.code = entry.code
        self.message = message
        self.param = param
        self.headers = dict(headers) if headers is not None else {}

    def at(self, param: str) -> MmgateError:
        """The same error naming the part at fault: a worker knows the bytes, its caller knows the path."""
        self.param = param
        return self


class MediaError(MmgateError):
    """The client's media is bad (400 unless said otherwise, 413 for size): the part is counted rejected."""


class WorkerCrashed(MediaError):
    """The item crashed two worker processes, one after the other: the media's own fault."""


class WorkerLost(MmgateError):
    """The item's worker and its retry's both ended without the media being shown at fault (a kill from
    outside, the OOM killer, or a death the retry did not reproduce): retryable, never cached."""


class FetchRefused(MmgateError):
    """A URL part mmgate will not fetch, or whose fetch failed: 400 with the rule's code."""


class InvalidJson(MmgateError):
    """The request body is not JSON. Told apart because a body that cannot hold media goes through as sent."""


class UpstreamError(MmgateError):
    """The upstream could not be reached or failed mid-answer. Told apart because it counts under
    ``mmgate_upstream_errors_total{kind}`` instead of ``mmgate_rejected_total``."""

    @property
    def kind(self) -> UpstreamFailure:
        return _UPSTREAM_FAILURES[self.entry]


E = TypeVar("E", bound=MmgateError)


@dataclass(frozen=True, eq=False, slots=True)
class ErrorCode(Generic[E]):
    """One answer mmgate can give: its status, code, what it means (one line, for the docs) and its class."""

    status: int
    code: str
    meaning: str
    raised_as: type[E]

    def error(self, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None) -> E:
        return self.raised_as(self, message, param=param, headers=headers)


REGISTRY: dict[tuple[int, str], ErrorCode[Any]] = {}


def _define(status: int, code: str, raised_as: type[E], meaning: str) -> ErrorCode[E]:
    entry = ErrorCode(status, code, meaning, raised_as)
    if (status, code) in REGISTRY:
        raise ValueError(f"{status} {code} is defined twice")
    REGISTRY[status, code] = entry
    return entry


def rebuild(status: int, code: str, message: str, *, param: str | None = None,
            headers: Mapping[str, str] | None = None) -> MmgateError:
    """An error that crossed a process boundary as plain data (a decode worker's refusal, the shared gate's,
    a cached verdict), made again from its registry entry. KeyError for a pair mmgate never answers."""
    return REGISTRY[status, code].error(message, param=param, headers=headers)


# 400: the request or its media is bad; nothing is forwarded
INVALID_JSON = _define(400, "invalid_json", InvalidJson, "the body of a media request is not JSON")
INVALID_REQUEST = _define(400, "invalid_request", MmgateError,
                          "a media part too malformed to process, or a request aiohttp refused before routing")
INVALID_PATH = _define(400, "invalid_path", MmgateError,
                       "a request target that is no plain path (scheme, control characters, encoded separators)")
INCOMPLETE_BODY = _define(400, "incomplete_body", MmgateError, "the body ended before its Content-Length")
JSON_TOO_DEEP = _define(400, "json_too_deep", MmgateError, "media nested deeper than MMGATE_MAX_JSON_DEPTH")
JSON_TOO_COMPLEX = _define(400, "json_too_complex", MmgateError,
                           "a media body's JSON structure over MMGATE_MAX_JSON_STRUCTURE_KB")
INVALID_BASE64 = _define(400, "invalid_base64", MediaError, "inline media that is not strict base64")
INVALID_DATA_URI = _define(400, "invalid_data_uri", MediaError, "a media value that is no valid data: URI or URL")
INVALID_MEDIA_TYPE = _define(400, "invalid_media_type", MmgateError,
                             "a declared media type that is not a type of the part's kind")
UNSUPPORTED_MEDIA_TYPE = _define(400, "unsupported_media_type", MediaError,
                                 "an image in a format outside the allowlist (JPEG, PNG, WEBP, GIF, BMP)")
IMAGE_DECODE_FAILED = _define(400, "image_decode_failed", MediaError, "an image that is corrupt or truncated")
IMAGE_TRUNCATED = _define(400, "image_truncated", MediaError,
                          "an image that ends before its format's end (JPEG FFD9, PNG IEND, GIF trailer, WebP size)")
IMAGE_TOO_LARGE = _define(400, "image_too_large", MediaError, "an image over MMGATE_MAX_IMAGE_PIXELS")
TOO_MANY_FRAMES = _define(400, "too_many_frames", MediaError, "an animated image over MMGATE_MAX_FRAMES")
AUDIO_INVALID = _define(400, "audio_invalid", MediaError,
                        "audio that is unreadable, not its declared format, or over MMGATE_MAX_AUDIO_SECONDS")
TOO_MANY_MEDIA = _define(400, "too_many_media", MmgateError, "more media parts than MMGATE_MAX_MEDIA_PER_REQUEST")
MEDIA_URL_NOT_ALLOWED = _define(400, "media_url_not_allowed", MmgateError,
                                "a media URL where MMGATE_MEDIA_URLS does not take one")
MEDIA_URL_SCHEME_NOT_ALLOWED = _define(400, "media_url_scheme_not_allowed", MmgateError,
                                       "a media URL whose scheme is not http or https (file:, ftp:, s3:...), "
                                       "whatever MMGATE_MEDIA_URLS")
INVALID_TIMEOUT_HEADER = _define(400, "invalid_timeout_header", MmgateError,
                                 "X-MMGate-Timeout that is not a positive number of seconds")
INVALID_PRIORITY_HEADER = _define(400, "invalid_priority_header", MmgateError,
                                  "a priority header that is not an integer")
INVALID_FLOW_HEADER = _define(400, "invalid_flow_header", MmgateError,
                              "a fairness header that is too long or not printable")
IMAGE_UNSUPPORTED_BY_MODEL = _define(400, "image_unsupported_by_model", MediaError,
                                     "an image the served model's processor refuses (MMGATE_MODEL)")
VIDEO_UNSUPPORTED_BY_MODEL = _define(400, "video_unsupported_by_model", MediaError,
                                     "a video the served model's processor refuses (MMGATE_MODEL)")
DECODER_CRASHED = _define(400, "decoder_crashed", WorkerCrashed,
                          "the item crashed a decode worker process, and a fresh one on the retry")
VIDEO_INVALID = _define(400, "video_invalid", MediaError,
                        "a video that is unreadable or not in an accepted container and codec")
VIDEO_TOO_LARGE = _define(400, "video_too_large", MediaError,
                          "a video over MMGATE_MAX_VIDEO_PIXELS, _FRAMES or _SECONDS")
VIDEO_UNAVAILABLE = _define(400, "video_unavailable", MediaError, "a video part without the video extra installed")
FETCH_URL_NOT_ALLOWED = _define(400, "fetch_url_not_allowed", FetchRefused,
                                "a media URL that is not plain http(s), or carries credentials")
FETCH_HOST_NOT_ALLOWED = _define(400, "fetch_host_not_allowed", FetchRefused,
                                 "a media URL's host outside MMGATE_FETCH_ALLOW_HOSTS")
FETCH_ADDRESS_FORBIDDEN = _define(400, "fetch_address_forbidden", FetchRefused,
                                  "a media URL's address is loopback, private, link-local... and not allowed")
FETCH_TOO_MANY_REDIRECTS = _define(400, "fetch_too_many_redirects", FetchRefused,
                                   "a media URL redirecting more than MMGATE_FETCH_MAX_REDIRECTS times")
FETCH_TOO_LARGE = _define(400, "fetch_too_large", FetchRefused, "a fetched body over MMGATE_MAX_MEDIA_ITEM_MB")
FETCH_TIMEOUT = _define(400, "fetch_timeout", FetchRefused,
                        "a fetch slower than MMGATE_FETCH_TIMEOUT or MMGATE_FETCH_FIRST_BYTE_TIMEOUT")
FETCH_BAD_CONTENT_TYPE = _define(400, "fetch_bad_content_type", FetchRefused,
                                 "a fetched body whose type or encoding is not the part's kind")
FETCH_FAILED = _define(400, "fetch_failed", FetchRefused,
                       "a media URL that could not be reached, answered an error, or broke off")
# 404, 405: what is not served
PATH_NOT_ALLOWED = _define(404, "path_not_allowed", MmgateError, "a path outside MMGATE_ALLOW_PATHS, or /mmgate/*")
METHOD_NOT_ALLOWED = _define(405, "invalid_request", MmgateError,
                             "a method other than GET or HEAD on /mmgate/* of the admin port")
# 408, 413, 415, 417: the request's shape
HEADER_TIMEOUT = _define(408, "header_timeout", MmgateError, "a request head slower than MMGATE_HEADER_TIMEOUT")
BODY_READ_TIMEOUT = _define(408, "body_read_timeout", MmgateError, "a body slower than MMGATE_BODY_READ_TIMEOUT")
BODY_TOO_LARGE = _define(413, "body_too_large", MmgateError,
                         "a body over MMGATE_MAX_BODY_MB, as received or as mmgate would forward it")
MEDIA_TOO_LARGE = _define(413, "media_too_large", MediaError,
                          "a media item over MMGATE_MAX_MEDIA_ITEM_MB, or media over the whole in-flight budget")
TOO_MANY_IMAGE_TOKENS = _define(413, "too_many_image_tokens", MmgateError,
                                "images over the whole MMGATE_MAX_INFLIGHT_IMAGE_TOKENS budget")
UNSUPPORTED_CONTENT_ENCODING = _define(415, "unsupported_content_encoding", MmgateError,
                                       "a compressed body on a media route")
EXPECTATION_FAILED = _define(417, "expectation_failed", MmgateError, "an Expect other than 100-continue")
# 429: backpressure, always with Retry-After
QUEUE_FULL = _define(429, "queue_full", MmgateError, "MMGATE_MAX_QUEUE (or the flow's share) is full")
QUEUE_TIMEOUT = _define(429, "queue_timeout", MmgateError, "waited longer than MMGATE_QUEUE_TIMEOUT for admission")
# 5xx: mmgate's own fault, the upstream's, or no room now
INTERNAL_ERROR = _define(500, "internal_error", MmgateError, "a fault of mmgate's own, logged under the request id")
WEBSOCKET_NOT_SUPPORTED = _define(501, "websocket_not_supported", MmgateError, "a WebSocket upgrade")
UPSTREAM_RESET = _define(502, "upstream_reset", UpstreamError, "the upstream connection failed mid-answer")
DRAINING = _define(503, "draining", MmgateError, "after SIGTERM: mmgate takes no new work")
TOO_MANY_CONNECTIONS = _define(503, "too_many_connections", MmgateError,
                               "every one of MMGATE_MAX_CONNECTIONS is busy")
GATE_UNAVAILABLE = _define(503, "gate_unavailable", MmgateError,
                           "MMGATE_PROCESSES > 1: the supervisor holding the shared gate did not answer in time")
UPSTREAM_DOWN = _define(503, "upstream_down", UpstreamError,
                        "the upstream cannot be connected to (any request), or is known to be down (a media "
                        "request, refused before any decoding)")
LOCAL_RESOURCES_EXHAUSTED = _define(503, "local_resources_exhausted", MmgateError,
                                    "mmgate itself had no file descriptor, port or socket buffer left to connect "
                                    "to the upstream (EMFILE, ENFILE, EADDRNOTAVAIL, ENOBUFS): not the upstream's "
                                    "fault")
DECODER_UNAVAILABLE = _define(503, "decoder_unavailable", WorkerLost,
                              "two decode worker processes ended on the item without it being at fault")
PREPROCESS_TIMEOUT = _define(504, "preprocess_timeout", MmgateError,
                             "the request's media work took longer than MMGATE_PREPROCESS_TIMEOUT")
REQUEST_TIMEOUT = _define(504, "request_timeout", MmgateError,
                          "past MMGATE_REQUEST_TIMEOUT or the request's X-MMGate-Timeout")
UPSTREAM_TIMEOUT = _define(504, "upstream_timeout", UpstreamError,
                           "the upstream was silent longer than MMGATE_UPSTREAM_READ_TIMEOUT")

_UPSTREAM_FAILURES: dict[ErrorCode[UpstreamError], UpstreamFailure] = {
    UPSTREAM_DOWN: "connect", UPSTREAM_TIMEOUT: "timeout", UPSTREAM_RESET: "reset",
}


def gate_unavailable() -> MmgateError:
    """503 for a front's round trip to the shared gate that got no answer within MMGATE_PROCESS_TIMEOUT."""
    return GATE_UNAVAILABLE.error("mmgate's admission gate did not answer in time; retry shortly",
                                  headers={"Retry-After": "1"})


def draining() -> MmgateError:
    """503 for a request that arrives (or would queue) once the drain refuses new work."""
    return DRAINING.error("mmgate is shutting down; retry on another replica", headers={"Retry-After": "1"})
