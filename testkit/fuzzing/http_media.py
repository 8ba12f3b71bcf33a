"""The HTTP media properties: what crosses the wire for any body, and with resize on.

``check_http_media``: no 5xx, no traceback, errors in the API's own shape, valid requests accepted and forwarded
byte for byte except inside media strings. ``check_http_resize``: with ``MMGATE_RESIZE_MAX_PIXELS`` low, both
bodies parse equal except at media strings, and each rewrite is a smaller image of its declared type.
"""

from __future__ import annotations

import base64
import io
import json
import re
import sys
from typing import Any

from PIL import Image

from .documents import HttpCase
from .faults import Harness, attempt, error_shape_problem, fail, production_stack
from .json_writer import Path_

RESIZE_MAX_PIXELS = 100  # below most sample images (so they are rewritten), above the 2x2 and 4x4 ones
RESIZE_ENV: dict[str, str] = {"MMGATE_RESIZE_MAX_PIXELS": str(RESIZE_MAX_PIXELS)}

async def _post(h: Harness, case: HttpCase) -> tuple[int, bytes, str]:
    h.upstream.seen.clear()
    while not h.upstream.arrived.empty():
        h.upstream.arrived.get_nowait()
    h.faults.clear()
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    with production_stack():
        async with h.session.post(h.proxy_url + case.route, data=case.body, headers=headers) as response:
            answer = await response.read()
            return response.status, answer, response.headers.get("Content-Type", "")


def _answer_checks(h: Harness, case: HttpCase, status: int, answer: bytes, content_type: str) -> None:
    """The checks every answer passes: no 5xx (the upstream always answers 200), no traceback, the API's
    error shape, nothing forwarded on a refusal, exactly one forward on a success."""
    if status >= 500:
        raise fail(f"5xx:{h.faults.where()}", f"{case.route} answered {status}: {answer[:200]!r}")
    if b"Traceback" in answer:
        raise fail("traceback", f"{case.route} answered {status} with a traceback: {answer[:300]!r}")
    if status >= 400:
        problem = error_shape_problem(case.route, answer)
        if problem is not None or not content_type.startswith("application/json"):
            raise fail(f"error-shape:{status}", f"{case.route} {status} ({content_type}): {problem}")
        if h.upstream.seen:
            raise fail("forwarded-a-refusal", f"{case.route} answered {status} but the upstream got the request")
    elif len(h.upstream.seen) != 1:
        raise fail("not-forwarded", f"{case.route} answered {status} after {len(h.upstream.seen)} upstream requests")


# JSON string tokens, found the way skeletonize finds them: a quote, then the next quote not escaped.
def string_tokens(body: bytes) -> list[tuple[int, int]]:
    """Byte spans of the string tokens of ``body`` (for invalid JSON: whatever the same scan finds)."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while True:
        start = body.find(b'"', pos)
        if start < 0:
            return spans
        end = body.find(b'"', start + 1)
        while end > 0:
            k = end - 1
            while body[k] == 0x5C:
                k -= 1
            if not (end - 1 - k) & 1:
                break
            end = body.find(b'"', end + 1)
        if end < 0:
            spans.append((start, len(body)))
            return spans
        spans.append((start, end + 1))
        pos = end + 1


_MIME_LIKE = re.compile(r"\s*[A-Za-z0-9.+-]*/?[A-Za-z0-9.+-]*\s*")
_BASE64_LIKE = re.compile(r"[A-Za-z0-9+/=_\-\s]+")


def media_like(token: bytes) -> bool:
    """Could this string token be a media string mmgate may rewrite (data URI, base64 data, a MIME type)?"""
    try:
        value = json.loads(token)
    except ValueError:
        return False
    if not isinstance(value, str):
        return False
    return (value[:5].lower() == "data:" or bool(_MIME_LIKE.fullmatch(value))
            or (len(value) >= 4 and bool(_BASE64_LIKE.fullmatch(value))))


def token_diff(sent: bytes, forwarded: bytes) -> list[tuple[int, bytes, bytes]] | str:
    """The string tokens that differ, as (token index, sent, forwarded); a str says the bodies differ
    somewhere else (outside string tokens, or in how many there are)."""
    a, b = string_tokens(sent), string_tokens(forwarded)
    if len(a) != len(b):
        return f"{len(a)} string tokens sent, {len(b)} forwarded"
    changed: list[tuple[int, bytes, bytes]] = []
    prev_a = prev_b = 0
    for i, ((sa, ea), (sb, eb)) in enumerate(zip(a, b, strict=True)):
        if sent[prev_a:sa] != forwarded[prev_b:sb]:
            return (f"bytes between tokens {i - 1} and {i} differ: "
                    f"{sent[prev_a:sa][:80]!r} -> {forwarded[prev_b:sb][:80]!r}")
        if sent[sa:ea] != forwarded[sb:eb]:
            changed.append((i, sent[sa:ea], forwarded[sb:eb]))
        prev_a, prev_b = ea, eb
    if sent[prev_a:] != forwarded[prev_b:]:
        return f"bytes after the last token differ: {sent[prev_a:][:80]!r} -> {forwarded[prev_b:][:80]!r}"
    return changed


async def _changed_on_its_way(h: Harness, case: HttpCase) -> bytes | None:
    """Send ``case`` and check its answer (a clean request is never refused); the body the upstream got when
    the request was forwarded with changes, None when it was refused or forwarded as sent."""
    status, answer, content_type = await _post(h, case)
    _answer_checks(h, case, status, answer, content_type)
    if case.clean and status != 200:
        raise fail(f"refused-clean:{status}", f"{case.route} refused a valid request: {answer[:300]!r}")
    if status >= 400:
        return None
    forwarded: bytes = h.upstream.seen[0].body
    return None if forwarded == case.body else forwarded


async def check_http_media(h: Harness, case: HttpCase) -> None:
    """No resize configured: never a 5xx or traceback, errors in the API's shape, a clean request accepted
    and forwarded byte for byte, any forwarded body identical except inside media string tokens."""
    forwarded = await _changed_on_its_way(h, case)
    if forwarded is None:
        return
    if case.clean:
        raise fail("rewrote-clean", f"{case.route}: a valid request without resize was changed on its way")
    diff = token_diff(case.body, forwarded)
    if isinstance(diff, str):
        raise fail("changed-outside-strings", f"{case.route}: {diff}")
    for index, old, new in diff:
        if not media_like(old):
            raise fail("changed-non-media", f"{case.route}: string token {index} {old[:80]!r} -> {new[:80]!r}")
        try:
            ok = isinstance(json.loads(new), str)
        except ValueError:
            ok = False
        if not ok:
            raise fail("spliced-bad-token", f"{case.route}: token {index} became {new[:80]!r}")


# with resize on: parse both bodies, equal everywhere but at media strings


def _loads_deep(body: bytes) -> Any:
    """json.loads with room for the deep documents the strategies make (the C scanner recurses per level)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        return json.loads(body)
    finally:
        sys.setrecursionlimit(limit)


def value_at(doc: Any, path: Path_) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def doc_differences(a: Any, b: Any, allowed: set[tuple[str | int, ...]]) -> list[str]:
    """Where ``a`` and ``b`` differ outside ``allowed`` paths (iterative: documents may be 3000 deep).
    At an allowed path both must be strings."""
    problems: list[str] = []
    stack: list[tuple[Any, Any, tuple[str | int, ...]]] = [(a, b, ())]
    while stack and len(problems) < 5:
        x, y, path = stack.pop()
        if path in allowed:
            if not (isinstance(x, str) and isinstance(y, str)):
                problems.append(f"{list(path)}: media string became {type(y).__name__}")
            continue
        if type(x) is not type(y):
            problems.append(f"{list(path)}: {type(x).__name__} -> {type(y).__name__}")
        elif isinstance(x, dict):
            if list(x) != list(y):
                problems.append(f"{list(path)}: keys {list(x)[:8]} -> {list(y)[:8]}")
            else:
                stack.extend((x[k], y[k], (*path, k)) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                problems.append(f"{list(path)}: {len(x)} items -> {len(y)}")
            else:
                stack.extend((x[i], y[i], (*path, i)) for i in range(len(x)))
        elif x != y:
            problems.append(f"{list(path)}: {x!r:.60} -> {y!r:.60}")
    return problems


def _image_of(value: str, form: str) -> tuple[str, Image.Image]:
    """(declared MIME or "", image) of a rewritten media string."""
    declared = ""
    payload = value
    if form == "data_uri":
        head, _, payload = value.partition(",")
        declared = head[5:].split(";", 1)[0].lower()
    image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    image.load()
    return declared, image


async def check_http_resize(h: Harness, case: HttpCase) -> None:
    """``MMGATE_RESIZE_MAX_PIXELS`` on: same answers as without resize; the forwarded body parses to the
    document sent with only media strings changed, each change a decodable image within the limit whose
    declared type (data URI header or Anthropic ``media_type``) is its real format, and an image that
    already fits is never rewritten."""
    forwarded = await _changed_on_its_way(h, case)
    if forwarded is None:
        return
    docs, error = attempt(lambda: (_loads_deep(case.body), _loads_deep(forwarded)))
    if docs is None:
        raise fail("rewrote-unparsable", f"{case.route}: a body was rewritten but does not parse: {error}")
    sent_doc, forwarded_doc = docs
    allowed = {tuple(site.path) for site in case.sites}
    problems = doc_differences(sent_doc, forwarded_doc, allowed)
    if problems:
        raise fail("changed-non-media", f"{case.route}: {'; '.join(problems)}")
    by_token = {site.token: site for site in case.sites}
    for site in case.sites:
        if site.role != "data":
            continue
        old, new = value_at(sent_doc, site.path), value_at(forwarded_doc, site.path)
        mime_site = by_token.get(site.mime_token) if site.mime_token is not None else None
        mime_changed = mime_site is not None and (value_at(sent_doc, mime_site.path)
                                                  != value_at(forwarded_doc, mime_site.path))
        if old == new and not mime_changed:
            continue
        if site.form == "data_uri" and old.partition(",")[2] == new.partition(",")[2]:
            payload_changed = False  # only the declared type in the header changed
        else:
            payload_changed = old != new
        if payload_changed and site.pixels and site.pixels <= RESIZE_MAX_PIXELS:
            raise fail("rewrote-fitting-image", f"{case.route} {site.path}: {site.pixels} px fit but were rewritten")
        decoded, error = attempt(_image_of, new, site.form)
        if decoded is None:
            if payload_changed:
                raise fail("rewrote-to-junk", f"{case.route} {site.path}: the new media does not decode: {error}")
            continue  # a type corrected beside data that is no image (audio, video): nothing to decode here
        declared, image = decoded
        width, height = image.size
        if payload_changed and width * height > RESIZE_MAX_PIXELS:
            raise fail("resize-over-limit", f"{case.route} {site.path}: {width}x{height} > {RESIZE_MAX_PIXELS} px")
        real = Image.MIME.get(image.format or "", "")
        if mime_site is not None:
            declared = str(value_at(forwarded_doc, mime_site.path)).strip().lower()
        if (site.form == "data_uri" or mime_site is not None) and declared != real:
            raise fail("mime-mismatch", f"{case.route} {site.path}: declared {declared!r}, data is {real!r}")


