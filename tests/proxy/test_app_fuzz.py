"""Fuzzing in CI: every request shape mmgate parses, thrown at the real proxy (and at its pure parts) with a
small, fixed budget; the same properties run with a large budget in ``bench/fuzz.py``.

Strategies and properties live in ``testkit/fuzzing/`` (shared with the bench). Each HTTP test starts one
proxy in front of the scripted upstream (conftest fixtures) and reuses it for all its examples: the
properties are about one request at a time, and a proxy per example would spend the budget on start-ups.

Reproducible, yet exploring (hypothesis settings below):

- ``database=None``: no hidden state from earlier runs on this machine; what a run does depends only on the
  checkout. The memory of past failures is ``tests/fuzz_corpus/`` instead: reviewed, in git, replayed by
  ``test_corpus_replay`` on every run.
- ``@seed`` from the commit (``testkit.fuzzing.corpus.ci_seed``): re-running a commit replays exactly its inputs, so
  a red CI run reproduces; each new commit draws new inputs, so CI keeps exploring over time. Not
  ``derandomize=True``: that would fix the inputs forever (derived from the test's source) and CI would
  never see anything new. ``MMGATE_FUZZ_SEED=<int>`` pins a seed, ``MMGATE_FUZZ_SEED=random`` lets
  hypothesis pick one.
- A failure prints its minimal example; ``MMGATE_FUZZ_SAVE=1 python -m pytest tests/proxy/test_app_fuzz.py`` also
  writes it to the corpus (one file per property and fault signature).

Budget: about 3,500 inputs, 15-25 s for the whole file on a 2-core machine when everything passes (the HTTP
examples dominate). A failure costs more: hypothesis shrinks it to a minimal example before reporting.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from testkit.fuzzing.corpus import ci_seed, corpus_files, keep_failures, replay_http
from testkit.fuzzing.documents import HttpCase, http_cases
from testkit.fuzzing.faults import FaultLog, Harness
from testkit.fuzzing.http_media import RESIZE_ENV, check_http_media, check_http_resize
from testkit.fuzzing.paths import PATHS_ENV, PathCase, check_http_paths, targets
from testkit.fuzzing.properties import PROPERTIES
from testkit.fuzzing.pure import (
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
from tests.conftest import Proxy, StartProxy, Upstream

T = TypeVar("T", bound=Callable[..., Any])
SEED = ci_seed()
DIALECTS = ["chat", "responses", "messages", "generate"]


def fuzz(max_examples: int) -> Callable[[T], T]:
    """The CI settings (see the module docstring). Function-scoped fixtures are on purpose: one proxy per
    test, shared by its examples; big and slow examples (3000-level nesting, images) are on purpose too."""

    def apply(test: T) -> T:
        configured = settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            derandomize=False,
            print_blob=True,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                   HealthCheck.data_too_large, HealthCheck.large_base_example],
        )(test)
        return configured if SEED is None else seed(SEED)(configured)

    return apply


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def faults() -> Any:
    log = FaultLog()
    with log.installed():
        yield log


@pytest.fixture
async def resize_proxy(upstream: Upstream, start_proxy: StartProxy) -> Proxy:
    return await start_proxy(upstream.url, **RESIZE_ENV)


@pytest.fixture
async def paths_proxy(upstream: Upstream, start_proxy: StartProxy) -> Proxy:
    return await start_proxy(upstream.url, **PATHS_ENV)


# ----------------------------------------------------------------------------------------------------------
# through the real proxy


@pytest.mark.parametrize("dialect", DIALECTS)
@fuzz(max_examples=250)
@given(data=st.data())
async def test_no_5xx_traceback_or_foreign_error_shape_and_nothing_but_media_changes(
    dialect: str, data: st.DataObject, upstream: Upstream, proxy: Proxy, client: aiohttp.ClientSession,
    faults: FaultLog,
) -> None:
    """Guards against: a body that crashes the handler (500 with aiohttp's text), an error in the wrong API's
    shape, a refused valid request, and a forwarded body changed outside media strings (without resize a
    valid request must arrive byte for byte: big integers, ``1e2``, duplicate keys and ``\\/`` included)."""
    case: HttpCase = data.draw(http_cases(dialect), label="case")
    with keep_failures("http_media", case):
        await check_http_media(Harness(proxy.url, upstream, client, faults), case)


@pytest.mark.parametrize("dialect", DIALECTS)
@fuzz(max_examples=80)
@given(data=st.data())
async def test_resize_changes_only_media_strings_and_only_to_smaller_images_of_the_declared_type(
    dialect: str, data: st.DataObject, upstream: Upstream, resize_proxy: Proxy, client: aiohttp.ClientSession,
    faults: FaultLog,
) -> None:
    """Guards against: a splice that shifts or corrupts the JSON around a rewritten image, a rewrite of an
    image that already fits, a resized image still over the limit, a MIME type left naming the old format."""
    case: HttpCase = data.draw(http_cases(dialect, mutate=False), label="case")
    with keep_failures("http_resize", case):
        await check_http_resize(Harness(resize_proxy.url, upstream, client, faults), case)


@fuzz(max_examples=400)
@given(case=targets())
async def test_allowlist_cannot_be_escaped_with_dot_segments_encodings_backslashes_or_params(
    case: PathCase, upstream: Upstream, paths_proxy: Proxy, client: aiohttp.ClientSession, faults: FaultLog,
) -> None:
    """Guards against: ``MMGATE_ALLOW_PATHS`` checked on one spelling of the path while the upstream acts on
    another (``/v1/models/../../admin``, ``%2e%2e``, ``%2f``, ``\\``, ``//``, ``/v1/modelsx``, ``;params``),
    and request targets that crash the proxy (absolute-form, odd bytes)."""
    with keep_failures("http_paths", case):
        await check_http_paths(Harness(paths_proxy.url, upstream, client, faults), case)


# ----------------------------------------------------------------------------------------------------------
# pure functions


@fuzz(max_examples=300)
@given(case=splice_cases())
def test_splice_changes_exactly_the_chosen_strings_like_parse_modify_dump(case: JsonCase) -> None:
    """Guards against: a splice that drops, duplicates or misplaces bytes around a replaced token."""
    with keep_failures("pure_splice", case):
        check_pure_splice(case)


@fuzz(max_examples=300)
@given(body=json_bodies())
def test_skeleton_resolves_to_json_loads_and_junk_raises_only_invalid_json(body: bytes) -> None:
    """Guards against: a token walk that misreads escapes, keys or deep nesting, and a crash (anything but a
    400 ``invalid_json``) on bytes that are not JSON."""
    case = JsonCase(body)
    with keep_failures("pure_skeleton", case):
        check_pure_skeleton(case)


@fuzz(max_examples=500)
@given(case=data_url_inputs())
def test_parse_data_url_raises_only_media_error(case: BytesCase) -> None:
    """Guards against: a data URL header (case, params, non-ASCII, no comma, 300-byte MIME) that raises
    something the pipeline does not turn into a 400."""
    with keep_failures("pure_data_url", case):
        check_pure_data_url(case)


@fuzz(max_examples=500)
@given(case=base64_inputs())
def test_decode_base64_raises_only_media_error_and_is_never_laxer_than_the_stdlib(case: BytesCase) -> None:
    """Guards against: a decoder that crashes on odd input (lone surrogates, non-ASCII), silently accepts
    mangled base64 (a different file than the client meant), or refuses valid base64."""
    with keep_failures("pure_base64", case):
        check_pure_base64(case)


# ----------------------------------------------------------------------------------------------------------
# the corpus: every failing input ever kept, replayed through the property it came from


def _corpus_ids() -> list[Any]:
    return [pytest.param(path, id=path.stem) for path in corpus_files()]


def test_corpus_files_are_well_formed() -> None:
    """Guards against: a corpus file no replay would ever run (unknown property, unreadable case)."""
    for path in corpus_files():
        record = json.loads(path.read_text())
        assert record["property"] in PROPERTIES, f"{path.name}: unknown property {record['property']!r}"
        assert isinstance(record.get("signature"), str) and isinstance(record.get("note"), str), path.name
        PROPERTIES[record["property"]].load(record)


@pytest.mark.parametrize("path", _corpus_ids())
async def test_corpus_replay(path: Path, upstream: Upstream, start_proxy: StartProxy) -> None:
    """Guards against: a fault found once (by CI, the bench or a person) coming back."""
    record = json.loads(path.read_text())
    prop = PROPERTIES[record["property"]]
    case = prop.load(record)
    if prop.kind == "http":
        await replay_http(prop, case, upstream, start_proxy)
    else:
        prop.check(case)
