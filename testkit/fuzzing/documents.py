"""Request bodies per dialect (chat, responses, Anthropic messages, ``/generate``), and the HTTP cases.

A document carries media where its dialect allows it and text elsewhere; ``http_cases`` writes one with the JSON
writer and, for some, mutates the bytes (truncated, flipped, not an object, invalid UTF-8).
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from .json_writer import Deep, Media, Num, Obj, Path_, RawStr, Site, Style, Writer, Written, styles, writer_rng
from .media_values import OTHER_IMAGE_MIME, both, media_node, media_url_or_data, raw_base64, urls

ROUTES: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "generate": "/generate",
}
MAX_MEDIA_PER_REQUEST = 16  # MMGATE_MAX_MEDIA_PER_REQUEST's default
CLEAN_DEPTH = 24  # extra nesting still "clean" (well under MMGATE_MAX_JSON_DEPTH's default of 64)


texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=24) | st.sampled_from([
    "café", "naïve", "😀 emoji", "a/b\\c", 'quote " inside', "tab\there", "\u2028line", "image data:x;base64,",
    "<svg/>", "\x00nul", "\\u0041 not an escape", "image_url",
])
# Lone surrogates are valid JSON for Python's parser but not orjson's (mmgate falls back): rare on purpose, as
# they send the whole body down that slower road and would hide what else the document does.
odd_texts = st.one_of(texts, texts, texts, texts, texts, texts, st.sampled_from(
    [RawStr('"lone \\ud800 surrogate"'), RawStr('"\\udfff"'), RawStr('"pair \\ud83d\\ude00"')]))
numbers = st.sampled_from([
    Num("1e2"), Num("1E+2"), Num("-0"), Num("-0.0"), Num("0.1e-5"), Num("123456789012345678901234567890"),
    Num("-98765432109876543210987654321098765432"), Num("3.141592653589793238462643383279"), Num("1.0e308"),
    Num("5e-324"), Num("1e400"), Num("18446744073709551616"), Num("9007199254740993"), Num("0"),
])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30),
                    st.floats(allow_nan=False, allow_infinity=False), numbers, odd_texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(st.tuples(texts, inner), max_size=4).map(lambda items: Obj(tuple(items))),
    max_leaves=12,
)

# Around the limits that matter: MMGATE_MAX_JSON_DEPTH's default (64), Python's recursion limit (1000; a
# recursive walker dies a little below it), orjson's depth limit (1024), and far beyond.
DEEP_DEPTHS = (63, 64, 65, 500, 900, 960, 970, 980, 990, 1000, 1010, 1020, 1023, 1024, 1030, 2000, 3000)


@st.composite
def nesting(draw: st.DrawFn, deep: bool = True) -> tuple[int, bool | None]:
    """A nesting depth and its cleanliness: shallow is clean; deep (up to 3000) may be refused, never 5xx."""
    if deep and draw(st.sampled_from(["shallow", "shallow", "deep"])) == "deep":
        return draw(st.sampled_from(DEEP_DEPTHS)), None
    depth = draw(st.integers(0, 40))
    return depth, True if depth <= CLEAN_DEPTH else None


@st.composite
def extras(draw: st.DrawFn, deep: bool) -> tuple[list[tuple[str, Any]], bool | None]:
    """Fields around the media: numbers written oddly, text with escapes, random JSON, deep nesting."""
    fields: list[tuple[str, Any]] = []
    clean: bool | None = True
    if draw(st.booleans()):
        fields.append(("temperature", draw(numbers)))
    if draw(st.booleans()):
        fields.append(("max_tokens", draw(numbers)))
    if draw(st.booleans()):
        fields.append(("user", draw(odd_texts)))
    if draw(st.booleans()):
        fields.append(("metadata", draw(json_values)))
    if draw(st.integers(0, 3)) == 0:
        depth, deep_clean = draw(nesting(deep))
        shapes: list[tuple[str, str, tuple[str | int, ...]]] = [("[", "]", (0,)), ('{"a":', "}", ("a",))]
        shape = draw(st.sampled_from(shapes))
        fields.append(("nested", Deep(depth, draw(scalars), *shape)))
        clean = both(clean, deep_clean)
    fields.append(("stream", False))
    return fields, clean


@dataclass(frozen=True)
class Doc:
    """A generated request document: the tree, whether mmgate must accept it, and its route."""

    dialect: str
    node: Any
    clean: bool | None


@st.composite
def chat_part(draw: st.DrawFn) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 15))
    if shape <= 2:
        return Obj((("type", "text"), ("text", draw(odd_texts)))), True
    if shape <= 5:
        choice = draw(media_url_or_data())
        image_url = Obj((("url", media_node(choice)), ("detail", draw(st.sampled_from(["auto", "low", "high"])))))
        return Obj((("type", "image_url"), ("image_url", image_url))), choice.clean
    if shape == 6:  # vLLM: image_url as a bare string
        choice = draw(media_url_or_data())
        return Obj((("type", "image_url"), ("image_url", media_node(choice)))), choice.clean
    if shape == 7:  # no type: vLLM infers it from the field
        choice = draw(media_url_or_data())
        return Obj((("image_url", Obj((("url", media_node(choice)),))),)), choice.clean
    if shape == 8:  # a uuid: vLLM reads the fields, whatever the type says
        choice = draw(media_url_or_data())
        uuid = draw(st.sampled_from(["u-1", "0b1e", ""]))
        return Obj((("type", draw(st.sampled_from(["text", "image_url"]))),
                    ("image_url", Obj((("url", media_node(choice)),))), ("uuid", uuid))), choice.clean
    if shape == 9:  # a uuid and no data: a reference to media the backend has cached
        return Obj((("type", "image_url"), ("image_url", None), ("uuid", "u-2"))), True
    if shape == 10:
        audio, _blob = draw(raw_base64("audio"))
        fmt = draw(st.sampled_from([("wav", True), ("WAV", True), ("mp3", None), ("ogg", None), ("aiff", None),
                                         ("wav\ud800", None), ("", None)]))
        part = Obj((("type", "input_audio"),
                    ("input_audio", Obj((("data", media_node(audio)), ("format", fmt[0])))),))
        return part, both(audio.clean, fmt[1])
    if shape == 11:
        kind = draw(st.sampled_from(["video", "audio"]))
        choice = draw(media_url_or_data(kind))
        field = f"{kind}_url"
        return Obj((("type", field), (field, Obj((("url", media_node(choice)),))))), choice.clean
    odd = draw(st.sampled_from([
        Obj((("type", "image_url"), ("image_url", 5))), Obj((("type", "image_url"),)),
        Obj((("type", "image_url"), ("image_url", Obj(())))),
        Obj((("type", "image_url"), ("image_url", Obj((("url", 5),))))),
        Obj((("type", 7), ("image_url", Obj((("url", "https://example.invalid/x.png"),))))),
        "a bare string part", 42, None,
        Obj((("type", "input_audio"), ("input_audio", "AAAA"))), Obj((("type", "image"), ("image", "xyz"))),
        Obj((("type", "refusal"), ("refusal", "no"))), Obj(()),
    ]))
    return odd, None


@st.composite
def chat_doc(draw: st.DrawFn, deep: bool = True) -> Doc:
    messages: list[Any] = []
    clean: bool | None = True
    for _ in range(draw(st.integers(1, 3))):
        role = draw(st.sampled_from(["user", "user", "system", "assistant"]))
        if draw(st.integers(0, 4)) == 0:
            messages.append(Obj((("role", role), ("content", draw(odd_texts)))))
            continue
        parts = [draw(chat_part()) for _ in range(draw(st.integers(0, 4)))]
        clean = both(clean, *(c for _p, c in parts))
        messages.append(Obj((("role", role), ("content", [p for p, _c in parts]))))
    more, extra_clean = draw(extras(deep))
    return Doc("chat", Obj((("model", "m"), ("messages", messages), *more)), both(clean, extra_clean))


@st.composite
def responses_part(draw: st.DrawFn) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 7))
    if shape <= 1:
        return Obj((("type", "input_text"), ("text", draw(odd_texts)))), True
    if shape <= 3:
        choice = draw(media_url_or_data())
        return Obj((("type", "input_image"), ("image_url", media_node(choice)), ("detail", "auto"))), choice.clean
    if shape == 4:  # defensively accepted: {"url": ...}
        choice = draw(media_url_or_data())
        return Obj((("type", "input_image"), ("image_url", Obj((("url", media_node(choice)),))))), choice.clean
    if shape == 5:
        return Obj((("type", "input_image"), ("file_id", "file-123"))), True
    if shape == 6:  # chat-style parts are looked for in Responses content too
        return draw(chat_part())
    return draw(st.sampled_from([Obj((("type", "input_image"),)), Obj((("type", "input_image"), ("image_url", 3))),
                                 "text", 1.5])), None


@st.composite
def responses_doc(draw: st.DrawFn, deep: bool = True) -> Doc:
    clean: bool | None = True
    if draw(st.integers(0, 5)) == 0:
        items: Any = draw(odd_texts)
    else:
        items = []
        for _ in range(draw(st.integers(1, 3))):
            shape = draw(st.integers(0, 4))
            if shape <= 1:
                parts = [draw(responses_part()) for _ in range(draw(st.integers(0, 4)))]
                clean = both(clean, *(c for _p, c in parts))
                items.append(Obj((("role", "user"), ("content", [p for p, _c in parts]))))
            elif shape == 2:  # a bare input_image item
                part, part_clean = draw(responses_part())
                clean = both(clean, part_clean)
                items.append(part)
            elif shape == 3:
                parts = [draw(responses_part()) for _ in range(draw(st.integers(0, 3)))]
                clean = both(clean, *(c for _p, c in parts))
                items.append(Obj((("type", "function_call_output"), ("call_id", "c1"),
                                  ("output", [p for p, _c in parts]))))
            else:
                items.append(Obj((("type", "message"), ("role", "assistant"), ("content", draw(odd_texts)))))
    more, extra_clean = draw(extras(deep))
    return Doc("responses", Obj((("model", "m"), ("input", items), *more)), both(clean, extra_clean))


@dataclass
class _MimeSlot:
    """Anthropic ``media_type``: written before ``data``; the data's Media points back at it by site index."""

    node: Media


@st.composite
def anthropic_image(draw: st.DrawFn) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 9))
    if shape <= 5:
        choice, blob = draw(raw_base64("image"))
        declared = draw(st.sampled_from([
            (blob.mime, True), (blob.mime.upper(), True), (OTHER_IMAGE_MIME.get(blob.mime, "image/png"), None),
            ("text/plain", None), ("image/svg+xml", None), ("", None), (" image/png ", None),
            ("image/png\ud800", None), ("IMAGE/\u0130NG", None),
        ]))
        source: list[tuple[str, Any]] = [("type", "base64")]
        mime_clean = declared[1]
        if draw(st.integers(0, 9)):
            source.append(("media_type", _MimeSlot(Media(declared[0], "mime"))))
        else:
            mime_clean = None
        source.append(("data", media_node(choice)))
        return Obj((("type", "image"), ("source", Obj(tuple(source))))), both(choice.clean, mime_clean)
    if shape <= 7:
        choice = draw(urls)
        return Obj((("type", "image"), ("source", Obj((("type", "url"), ("url", media_node(choice))))))), choice.clean
    if shape == 8:
        return Obj((("type", "image"), ("source", Obj((("type", "file"), ("file_id", "file-1")))))), True
    return draw(st.sampled_from([
        Obj((("type", "image"),)), Obj((("type", "image"), ("source", "x"))),
        Obj((("type", "image"), ("source", Obj((("type", "base64"), ("data", 5)))))),
        Obj((("type", "image"), ("source", Obj((("type", "url"),))))),
        Obj((("type", "image"), ("source", Obj((("type", "weird"), ("data", "AAAA")))))),
    ])), None


@st.composite
def anthropic_block(draw: st.DrawFn, nest: int = 2) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 6))
    if shape <= 1:
        return Obj((("type", "text"), ("text", draw(odd_texts)))), True
    if shape <= 4:
        return draw(anthropic_image())
    if shape == 5 and nest > 0:
        blocks = [draw(anthropic_block(nest - 1)) for _ in range(draw(st.integers(0, 3)))]
        content: Any = [b for b, _c in blocks] if draw(st.integers(0, 4)) else "plain tool output"
        return (Obj((("type", "tool_result"), ("tool_use_id", "t1"), ("content", content))),
                both(*(c for _b, c in blocks)) if isinstance(content, list) else True)
    return draw(st.sampled_from([Obj((("type", "thinking"), ("thinking", "hm"))), 7, "str", None, Obj(())])), None


@st.composite
def messages_doc(draw: st.DrawFn, deep: bool = True) -> Doc:
    messages: list[Any] = []
    clean: bool | None = True
    for _ in range(draw(st.integers(1, 3))):
        role = draw(st.sampled_from(["user", "assistant"]))
        if draw(st.integers(0, 4)) == 0:
            messages.append(Obj((("role", role), ("content", draw(odd_texts)))))
            continue
        blocks = [draw(anthropic_block()) for _ in range(draw(st.integers(0, 4)))]
        if draw(st.integers(0, 9)) == 0:  # a chain of tool_results, up to thousands of levels
            depth, depth_clean = draw(nesting(deep))
            inner, inner_clean = draw(anthropic_image())
            chain = Deep(depth // 2, inner, '{"type":"tool_result","tool_use_id":"t","content":[', "]}",
                         ("content", 0))
            blocks.append((chain, both(depth_clean, inner_clean)))
        clean = both(clean, *(c for _b, c in blocks))
        messages.append(Obj((("role", role), ("content", [b for b, _c in blocks]))))
    more, extra_clean = draw(extras(deep))
    doc = Obj((("model", "m"), ("max_tokens", 16), ("messages", messages), *more))
    return Doc("messages", doc, both(clean, extra_clean))


@st.composite
def generate_item(draw: st.DrawFn, kind: str, level: int = 0, deep: bool = True) -> tuple[Any, bool | None]:
    shape = draw(st.integers(0, 10))
    if shape <= 3:
        choice, _blob = draw(raw_base64(kind))
        return media_node(choice), choice.clean
    if shape <= 5:
        choice = draw(media_url_or_data(kind))
        return media_node(choice), choice.clean
    if shape == 6 and level < 3:  # a batch (lists in lists, three levels at most)
        items = [draw(generate_item(kind, level + 1, deep)) for _ in range(draw(st.integers(0, 3)))]
        return [i for i, _c in items], both(*(c for _i, c in items))
    if shape == 7:  # SGLang's {"url": ...}
        choice = draw(st.one_of(media_url_or_data(kind), raw_base64(kind).map(lambda pair: pair[0])))
        return Obj((("url", media_node(choice)),)), choice.clean
    if shape in (8, 9) and level < 4:  # a batch nested deep: the walk over nested lists must not recurse
        depth, depth_clean = draw(nesting(deep))
        inner, inner_clean = draw(generate_item(kind, 4, deep))  # one Deep per item: "clean" stays shallow
        return Deep(depth, inner), both(depth_clean, inner_clean)
    return draw(st.sampled_from([None, 5, Obj((("embedding", [0.1, 0.2]),)), Obj((("url", 5),)), True])), None


@st.composite
def generate_doc(draw: st.DrawFn, deep: bool = True) -> Doc:
    fields: list[tuple[str, Any]] = [("text", draw(odd_texts))]
    clean: bool | None = True
    for field_name, kind in (("image_data", "image"), ("audio_data", "audio"), ("video_data", "video")):
        present = draw(st.integers(0, 5)) != 0 if kind == "image" else draw(st.integers(0, 5)) == 0
        if not present:
            continue
        if deep and kind == "image" and draw(st.sampled_from(["flat", "flat", "flat", "deep"])) == "deep":
            # A batch nested around the limits: a recursive walk over image_data dies near Python's 1000 frames.
            item, item_clean = draw(generate_item(kind, 4, deep))
            item = Deep(draw(st.sampled_from(DEEP_DEPTHS)), item)
            item_clean = None
        else:
            item, item_clean = draw(generate_item(kind, 0, deep))
        fields.append((field_name, item))
        clean = both(clean, item_clean)
    fields.append(("sampling_params", Obj((("max_new_tokens", draw(numbers)), ("temperature", 0)))))
    more, extra_clean = draw(extras(deep))
    return Doc("generate", Obj((*fields, *more)), both(clean, extra_clean))


DOCS: dict[str, Callable[..., st.SearchStrategy[Doc]]] = {
    "chat": chat_doc, "responses": responses_doc, "messages": messages_doc, "generate": generate_doc,
}


def _write_doc(node: Any, rng: random.Random, style: Style) -> Written:
    """``write`` with Anthropic ``media_type`` sites linked to the data site next to them."""
    pending: list[int] = []
    writer = Writer(rng, style)
    original_value = writer.value

    def value(item: Any, path: Path_) -> None:
        if isinstance(item, _MimeSlot):
            pending.append(len(writer.sites))
            original_value(item.node, path)
        elif isinstance(item, Media) and item.role == "data" and pending and path[-1] == "data":
            original_value(Media(item.text, item.role, item.form, item.pixels, pending.pop()), path)
        else:
            original_value(item, path)

    writer.value = value  # type: ignore[method-assign,assignment]  # an instance override of the method
    writer.value(node, [])
    writer.ws()
    return Written("".join(writer.out).encode("utf-8"), writer.sites)


# HTTP cases


@dataclass
class HttpCase:
    """One request to a media route: the body as sent, where its media strings are, whether it is clean."""

    route: str
    body: bytes
    sites: list[Site] = field(default_factory=list)
    clean: bool | None = None
    content_type: str = "application/json"

    def record(self) -> dict[str, Any]:
        return {"route": self.route, "body_b64": base64.b64encode(self.body).decode(), "clean": self.clean,
                "content_type": self.content_type,
                "sites": [{"path": s.path, "token": s.token, "role": s.role, "form": s.form, "pixels": s.pixels,
                           "mime_token": s.mime_token} for s in self.sites]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> HttpCase:
        return cls(record["route"], base64.b64decode(record["body_b64"]),
                   [Site(**s) for s in record.get("sites", [])], record.get("clean"),
                   record.get("content_type", "application/json"))


_MUTATIONS = ("truncate", "insert", "drop", "flip", "replace_quote", "junk", "not_object", "invalid_utf8")


@st.composite
def mutated(draw: st.DrawFn, body: bytes) -> bytes:
    """``body`` broken in one of the ways a buggy client or a cut connection breaks JSON."""
    how = draw(st.sampled_from(_MUTATIONS))
    at = draw(st.integers(0, max(len(body) - 1, 0)))
    if how == "truncate":
        return body[:at]
    if how == "insert":
        byte = draw(st.sampled_from([b"{", b"}", b"[", b'"', b"\\", b",", b":", b"\x00", b"\xff"]))
        return body[:at] + byte + body[at:]
    if how == "drop":
        return body[:at] + body[at + 1 :]
    if how == "flip":
        return body[:at] + bytes([body[at] ^ (1 << draw(st.integers(0, 7)))]) + body[at + 1 :] if body else body
    if how == "replace_quote":
        return body.replace(b'"', b"'", 1)
    if how == "junk":
        return draw(st.binary(max_size=64))
    if how == "invalid_utf8":
        return body[:at] + b"\xc3\x28" + body[at:]
    return draw(st.sampled_from([b"[]", b'"image"', b"null", b"1e2", b'[{"image_url": "x"}]', b"", b" ",
                                 b'{"messages": "image"}', b'{"image_data": {}}', b"\xef\xbb\xbf{}"]))


@st.composite
def http_cases(draw: st.DrawFn, dialect: str, *, deep: bool = True, mutate: bool = True) -> HttpCase:
    """A request for ``dialect``: a generated document written awkwardly, sometimes broken on purpose."""
    doc = draw(DOCS[dialect](deep=deep))
    written = _write_doc(doc.node, writer_rng(draw), draw(styles))
    clean = doc.clean
    if sum(site.role == "data" for site in written.sites) > MAX_MEDIA_PER_REQUEST:
        clean = None  # too_many_media is a fair refusal
    case = HttpCase(ROUTES[dialect], written.body, written.sites, clean)
    if mutate and draw(st.integers(0, 7)) == 0:
        body = draw(mutated(written.body))
        if body != written.body:
            return HttpCase(case.route, body, [], None)
    if draw(st.integers(0, 15)) == 0:
        case.content_type = draw(st.sampled_from(["text/plain", "application/json; charset=utf-8", ""]))
    return case


