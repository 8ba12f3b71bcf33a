"""The pure functions against references: rawjson's splice and skeleton, ``parse_data_url``, ``decode_base64``."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from preprocessors.dataurl import decode_base64, parse_data_url
from preprocessors.errors import MediaError, MmgateError
from proxy.edge.buffers import splice
from proxy.payload.rawjson import MAX_NESTING, Span, skeletonize

from .documents import mutated, scalars, texts
from .faults import attempt, fail, stack_headroom
from .http_media import value_at
from .json_writer import Deep, Obj, Path_, styles, write, writer_rng
from .media_values import base64_of


@dataclass
class JsonCase:
    """A body for the pure JSON properties, and what to splice into it."""

    body: bytes
    picks: list[int] = field(default_factory=list)  # indices into the reachable placeholders
    new_values: list[str] = field(default_factory=list)
    ascii: bool = False

    def record(self) -> dict[str, Any]:
        return {"body_b64": base64.b64encode(self.body).decode(), "picks": self.picks,
                "new_values": self.new_values, "ascii": self.ascii}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> JsonCase:
        return cls(base64.b64decode(record["body_b64"]), record.get("picks", []), record.get("new_values", []),
                   record.get("ascii", False))


media_texts = st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "DATA:x", "image/png", "Audio/wav",
                               "https://a.invalid/x", "http:", "video/mp4", "x" * 100, "data:"])


_json_trees = st.recursive(
    st.one_of(scalars, media_texts),
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(st.tuples(st.one_of(texts, media_texts), inner), max_size=4).map(lambda i: Obj(tuple(i))),
    max_leaves=16,
)


@st.composite
def json_bodies(draw: st.DrawFn, *, depth: bool = True, broken: bool = True) -> bytes:
    """Any JSON, written awkwardly; sometimes nested up to 3000 levels, sometimes broken. (No depth between
    500 and 1100: there json.loads, the reference, runs out of stack inside a test runner's frames.)"""
    value = draw(_json_trees)
    if depth and draw(st.integers(0, 5)) == 0:
        level = draw(st.sampled_from([10, 64, 200, 500, 1100, 1500, 3000]))
        shapes: list[tuple[str, str, tuple[str | int, ...]]] = [
            ("[", "]", (0,)), ('{"k":', "}", ("k",)), ('{"data:x" : ', "}", ("data:x",))]
        shape = draw(st.sampled_from(shapes))
        value = Deep(level, value, *shape)
    body = write(value, writer_rng(draw), draw(styles)).body
    if broken and draw(st.integers(0, 5)) == 0:
        body = draw(mutated(body))
    return body


@st.composite
def splice_cases(draw: st.DrawFn) -> JsonCase:
    body = draw(json_bodies(depth=False, broken=False))
    picks = draw(st.lists(st.integers(0, 40), max_size=6, unique=True))
    values = [draw(st.one_of(texts, media_texts, st.text(max_size=200))) for _ in picks]
    return JsonCase(body, picks, values, draw(st.booleans()))


def _placeholders(sk: Any) -> list[tuple[Path_, Span]]:
    """(path, span) of every placeholder reachable in ``sk.doc``, in document order (iterative walk)."""
    found: list[tuple[Path_, Span]] = []
    stack: list[tuple[Any, Path_]] = [(sk.doc, [])]
    while stack:
        value, path = stack.pop()
        span = sk.span_of(value)
        if span is not None:
            found.append((path, span))
        elif isinstance(value, dict):
            stack.extend((v, [*path, k]) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((v, [*path, i]) for i, v in reversed(list(enumerate(value))))
    return found


def check_pure_splice(case: JsonCase) -> None:
    """``splice(body, replacements)`` parses to what parsing ``body``, replacing those string values and
    dumping would give: splicing changes exactly the chosen values and nothing else."""
    sk = skeletonize(case.body, long_string=0)
    spots = _placeholders(sk)
    if not spots:
        return
    expected = json.loads(case.body)
    replacements: list[tuple[Span, bytes]] = []
    for pick, new in zip(case.picks, case.new_values, strict=False):  # a hand-edited corpus file may differ
        path, span = spots[pick % len(spots)]
        if any(span == s for s, _t in replacements):
            continue
        replacements.append((span, json.dumps(new, ensure_ascii=case.ascii).encode()))
        if path:
            value_at(expected, path[:-1])[path[-1]] = new
        else:
            expected = new
    out = splice(case.body, replacements)
    got, error = attempt(json.loads, out)
    if error is not None:
        raise fail("splice-invalid-json", f"splice made invalid JSON: {error}: {out[:200]!r}")
    if got != expected:
        raise fail("splice-differs", f"splice != parse-modify-dump: {got!r:.200} vs {expected!r:.200}")


def check_pure_skeleton(case: JsonCase) -> None:
    """``skeletonize(body).resolve()`` equals ``json.loads`` of the body for any JSON json.loads takes that
    nests at most ``MAX_NESTING`` deep; deeper JSON is refused, and anything else too, with nothing but
    ``MmgateError(400, "invalid_json")``: the same bound on every Python, whatever its recursion accounting.

    Both run with the same 1000 frames of headroom (a fresh interpreter's limit), whatever the caller's
    stack or hypothesis' raised limit; the reference gets ``MAX_NESTING`` more, so that it parses all JSON
    within the bound on any Python."""
    too_deep = _nesting(case.body) > MAX_NESTING
    with stack_headroom(1000 + MAX_NESTING):
        # From a str: json.loads(bytes) would also take a UTF-8 byte order mark, which RFC 8259 section 8.1
        # lets a parser refuse (mmgate does: 400 invalid_json).
        expected, reference_error = attempt(lambda: json.loads(case.body.decode("utf-8")))
    with stack_headroom(1000):
        got, error = attempt(lambda: skeletonize(case.body).resolve())
    valid = reference_error is None and not too_deep
    if too_deep and not isinstance(error, MmgateError):
        raise fail("skeleton-took-too-deep", f"nested past {MAX_NESTING} and not refused: {case.body[:100]!r}")
    if isinstance(error, MmgateError):
        if error.status != 400 or error.code != "invalid_json":
            raise fail("skeleton-wrong-error", f"{error.status} {error.code}")
        if valid:
            raise fail("skeleton-refused-valid-json", f"{error.message}: {case.body[:200]!r}")
        return
    if isinstance(error, RecursionError):
        raise fail("skeleton-recursion", f"RecursionError: {case.body[:100]!r}")
    if error is not None:
        raise fail(f"skeleton-raised:{type(error).__name__}", f"{error!r}: {case.body[:200]!r}")
    if valid and _orjson_numbers(got) != _orjson_numbers(expected):
        raise fail("skeleton-differs", f"resolve() != json.loads: {got!r:.200} vs {expected!r:.200}")


def _nesting(body: bytes) -> int:
    """How deep objects and arrays nest in ``body``, brackets inside strings not counted: read byte by byte,
    apart from the product's own scan."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def _orjson_numbers(doc: Any) -> Any:
    """``doc`` with every integer beyond 64 bits as the float orjson makes of it. The skeleton only locates
    media and its numbers never reach the wire (the body is spliced, never re-serialised), so this is the
    one way it may differ from ``json.loads``: orjson parses the body unless it needs the stdlib fallback
    (``NaN``, ``1e400``, lone surrogates), so both sides are compared in orjson's terms. Iterative: documents
    may be deep."""

    def number(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
            return float(value)
        return value

    root: list[Any] = [doc]
    stack: list[Any] = [root]
    while stack:
        container = stack.pop()
        keys = range(len(container)) if isinstance(container, list) else list(container)
        for key in keys:
            value = container[key]
            if isinstance(value, (list, dict)):
                copy: Any = list(value) if isinstance(value, list) else dict(value)
                container[key] = copy
                stack.append(copy)
            else:
                container[key] = number(value)
    return root[0]


@dataclass
class BytesCase:
    """Input for the data URL and base64 properties."""

    data: bytes
    as_str: bool = False
    max_bytes: int = 1 << 20
    valid: bytes | None = None  # the original bytes when ``data`` is their standard base64

    def record(self) -> dict[str, Any]:
        return {"data_b64": base64.b64encode(self.data).decode(), "as_str": self.as_str, "max_bytes": self.max_bytes,
                "valid_b64": None if self.valid is None else base64.b64encode(self.valid).decode()}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> BytesCase:
        valid = record.get("valid_b64")
        return cls(base64.b64decode(record["data_b64"]), record.get("as_str", False), record.get("max_bytes", 1 << 20),
                   None if valid is None else base64.b64decode(valid))


@st.composite
def data_url_inputs(draw: st.DrawFn) -> BytesCase:
    if draw(st.integers(0, 3)) == 0:
        return BytesCase(draw(st.binary(max_size=300)))
    prefix = draw(st.sampled_from([b"data:", b"DATA:", b"Data:", b"dAtA:", b"data", b"dat", b"", b" data:", b"data;"]))
    mime = draw(st.sampled_from([b"image/png", b"IMAGE/PNG", b"", b"text/plain", b"image/svg+xml", b" image/png ",
                                 b"ima\xc3\xa9ge/png", b"\xff\xfe", b"image/png;charset=utf-8", b"x" * 300]))
    params = draw(st.sampled_from([b"", b";charset=utf-8", b";name=a,b", b";;", b";base64;base64", b"\x00"]))
    mark = draw(st.sampled_from([b";base64", b";BASE64", b";Base64", b"", b"base64", b";base64 ", b";base6"]))
    comma = draw(st.sampled_from([b",", b",", b"", b",,", b"%2C"]))
    payload = draw(st.one_of(st.binary(max_size=40), st.just(base64.b64encode(b"\x89PNG\r\n\x1a\n"))))
    return BytesCase(prefix + mime + params + mark + comma + payload, as_str=draw(st.booleans()))


def check_pure_data_url(case: BytesCase) -> None:
    """``parse_data_url`` raises only MediaError; returns None exactly when the value does not start with
    ``data:`` (any case); a result points just past a comma in the header and has a lower-case MIME."""
    value: bytes | memoryview = memoryview(case.data) if case.as_str else case.data
    parsed, error = attempt(parse_data_url, value)
    if isinstance(error, MediaError):
        if error.status != 400 or error.code != "invalid_data_uri":
            raise fail("data-url-wrong-error", f"{error.status} {error.code} for {case.data[:80]!r}")
        return
    if error is not None:
        raise fail(f"data-url-raised:{type(error).__name__}", f"{error!r} for {case.data[:120]!r}")
    is_data = case.data[:5].lower() == b"data:"
    if parsed is None:
        if is_data:
            raise fail("data-url-missed", f"None for a data: URL {case.data[:80]!r}")
        return
    if not is_data:
        raise fail("data-url-invented", f"parsed a non-data URL {case.data[:80]!r}")
    offset = parsed.payload_offset
    if not 6 <= offset <= 256 or case.data[offset - 1 : offset] != b",":
        raise fail("data-url-offset", f"payload_offset {offset} for {case.data[:80]!r}")
    if parsed.mime != parsed.mime.lower() or ";" in parsed.mime or "," in parsed.mime:
        raise fail("data-url-mime", f"mime {parsed.mime!r} for {case.data[:80]!r}")


@st.composite
def base64_inputs(draw: st.DrawFn) -> BytesCase:
    raw = draw(st.binary(max_size=64))
    max_bytes = draw(st.sampled_from([0, 1, 2, 3, 16, 48, 1 << 20]))
    shape = draw(st.integers(0, 5))
    if shape <= 1:
        return BytesCase(base64.b64encode(raw), draw(st.booleans()), max_bytes, raw)
    if shape == 2:
        text, _ok = draw(base64_of(raw))
        return BytesCase(text.encode("utf-8"), draw(st.booleans()), max_bytes)
    if shape == 3:
        return BytesCase(draw(st.binary(max_size=80)), False, max_bytes)
    if shape == 4:  # a str with anything in it, lone surrogates included
        text = draw(st.text(st.characters(codec=None), max_size=40))
        return BytesCase(text.encode("utf-8", "surrogatepass"), True, max_bytes)
    return BytesCase(draw(st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=", max_size=40))
                     .encode(), draw(st.booleans()), max_bytes)


def check_pure_base64(case: BytesCase) -> None:
    """``decode_base64`` raises only MediaError (invalid_base64, or 413 media_too_large exactly when the
    result would exceed ``max_bytes``); on valid input it agrees with ``base64.b64decode(validate=True)``,
    and it never accepts what the strict stdlib decoder refuses or decodes differently."""
    payload: bytes | str = case.data.decode("utf-8", "surrogatepass") if case.as_str else case.data
    stdlib, _refused = attempt(base64.b64decode, case.data, validate=True)
    got, error = attempt(decode_base64, payload, max_bytes=case.max_bytes)
    if isinstance(error, MediaError):
        if error.code == "media_too_large":
            if error.status != 413 or (stdlib is not None and len(stdlib) <= case.max_bytes):
                raise fail("base64-too-large-wrongly", f"{error.status} for {len(stdlib or b'')} <= {case.max_bytes}")
        elif error.code != "invalid_base64" or error.status != 400:
            raise fail("base64-wrong-error", f"{error.status} {error.code}")
        elif case.valid and len(case.valid) <= case.max_bytes:
            raise fail("base64-refused-valid", f"{case.data[:80]!r}: {error.message}")
        return
    if error is not None or got is None:
        raise fail(f"base64-raised:{type(error).__name__}", f"{error!r} for {case.data[:80]!r}")
    if len(got) > case.max_bytes:
        raise fail("base64-over-limit", f"{len(got)} bytes > max_bytes {case.max_bytes}")
    if stdlib is None:
        raise fail("base64-laxer-than-stdlib", f"accepted what b64decode(validate=True) refuses: {case.data[:80]!r}")
    if got != stdlib:
        raise fail("base64-differs", f"{case.data[:80]!r}: {got[:40]!r} != {stdlib[:40]!r}")
    if case.valid is not None and got != case.valid:
        raise fail("base64-roundtrip", f"{case.data[:80]!r} did not decode to what was encoded")


