"""The property registry the tests, the bench and the corpus replay share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from hypothesis import strategies as st

from .documents import ROUTES, HttpCase, http_cases
from .http_media import RESIZE_ENV, check_http_media, check_http_resize
from .paths import PATHS_ENV, PathCase, check_http_paths, targets
from .pure import (
    BytesCase,
    JsonCase,
    base64_inputs,
    check_pure_base64,
    check_pure_data_url,
    check_pure_skeleton,
    check_pure_splice,
    data_url_inputs,
    json_bodies,
    splice_cases,
)


@dataclass(frozen=True)
class Property:
    name: str
    summary: str  # one line, for the bench's table
    kind: Literal["http", "pure"]
    env: dict[str, str]
    load: Callable[[dict[str, Any]], Any]  # corpus record -> case
    check: Callable[..., Any]  # (Harness, case) -> awaitable for http; (case) -> None for pure


PROPERTIES: dict[str, Property] = {
    p.name: p
    for p in (
        Property("http_media", "no 5xx/traceback, API error shapes, valid requests accepted and forwarded byte for "
                 "byte, changes only inside media strings", "http", {}, HttpCase.from_record, check_http_media),
        Property("http_resize", "with resize: same document but media strings, each rewrite a smaller image of its "
                 "declared type, fitting images untouched", "http", RESIZE_ENV, HttpCase.from_record,
                 check_http_resize),
        Property("http_paths", "MMGATE_ALLOW_PATHS: the upstream only sees clean paths under an allowed prefix; no "
                 "target gets a 5xx", "http", PATHS_ENV, PathCase.from_record, check_http_paths),
        Property("pure_splice", "splice == parse-modify-dump", "pure", {}, JsonCase.from_record, check_pure_splice),
        Property("pure_skeleton", "skeletonize().resolve() == json.loads; junk raises only invalid_json", "pure", {},
                 JsonCase.from_record, check_pure_skeleton),
        Property("pure_data_url", "parse_data_url raises only MediaError; None iff not data:", "pure", {},
                 BytesCase.from_record, check_pure_data_url),
        Property("pure_base64", "decode_base64 raises only MediaError, agrees with b64decode(validate=True), never "
                 "laxer", "pure", {}, BytesCase.from_record, check_pure_base64),
    )
}


def strategy_for(name: str) -> st.SearchStrategy[Any]:
    """The inputs of property ``name`` over all dialects (the tests split HTTP ones per dialect instead)."""
    dialects = st.sampled_from(list(ROUTES))
    strategies: dict[str, Callable[[], st.SearchStrategy[Any]]] = {
        "http_media": lambda: dialects.flatmap(http_cases),
        "http_resize": lambda: dialects.flatmap(lambda d: http_cases(d, mutate=False)),
        "http_paths": targets,
        "pure_splice": splice_cases,
        "pure_skeleton": lambda: json_bodies().map(JsonCase),
        "pure_data_url": data_url_inputs,
        "pure_base64": base64_inputs,
    }
    return strategies[name]()


