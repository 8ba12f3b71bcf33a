"""proxy/payload/dialects.py: where each API keeps its media, the paths we report, and what we refuse."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from preprocessors.errors import REGISTRY, ErrorCode, MmgateError
from proxy.edge.buffers import splice
from proxy.payload.dialects import Dialect, Route, route_for
from proxy.payload.item import MediaItem
from proxy.payload.locate import find_media, inline_value, locate
from proxy.payload.rawjson import parse_plain, skeletonize, string_value

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
URI = "data:image/png;base64," + PNG
WAV = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQAAAAA=" * 2


def parts_of(route: Route, doc: Any) -> tuple[bytes, list[MediaItem]]:
    body = orjson.dumps(doc)
    return body, locate(route, skeletonize(body))


def summary(parts: list[MediaItem]) -> list[tuple[str, str, bool]]:
    return [(p.path, p.kind, p.is_url) for p in parts]


def refused(route: Route, doc: Any) -> MmgateError:
    with pytest.raises(MmgateError) as caught:
        parts_of(route, doc)
    assert caught.value.status == 400 and caught.value.code == "invalid_request"
    return caught.value


# ---------------------------------------------------------------------------------------------------
# route_for


@pytest.mark.parametrize(
    ("method", "path", "route"),
    [
        ("POST", "/v1/chat/completions", "chat"),
        ("POST", "/v1/chat/completions/", "chat"),
        ("post", "/v1/responses", "responses"),
        ("POST", "/v1/messages", "messages"),
        ("POST", "/v1/messages/", "messages"),
        ("POST", "/generate", "generate"),
        ("GET", "/v1/chat/completions", "other"),
        ("POST", "/v1/completions", "other"),
        ("POST", "/v1/messages/count_tokens", "other"),
        ("POST", "/v1/chat/completions/x", "other"),
        ("POST", "/V1/chat/completions", "other"),
        ("POST", "/", "other"),
        ("POST", "", "other"),
    ],
)
def test_route_for(method: str, path: str, route: Route) -> None:
    assert route_for(method, path) == route


# ---------------------------------------------------------------------------------------------------
# chat


def test_chat_parts_paths_and_kinds() -> None:
    doc = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": URI, "detail": "high"}},
                {"type": "image_url", "image_url": "https://example.com/cat.png"},
                {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
                {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
                {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + WAV}},
                {"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA"}},
            ]},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": URI}}]},
        ],
    }
    body, parts = parts_of("chat", doc)
    assert summary(parts) == [
        ("messages[1].content[1]", "image", False),
        ("messages[1].content[2]", "image", True),
        ("messages[1].content[3]", "audio", False),
        ("messages[1].content[4]", "video", True),
        ("messages[1].content[5]", "audio", False),
        ("messages[2].content[0]", "image", False),
    ]
    image, url, audio, video = parts[0], parts[1], parts[2], parts[3]
    assert image.encoding == "data_uri" and image.span is not None and bytes(inline_value(body, image)) == URI.encode()
    assert body[image.span.start : image.span.end] == orjson.dumps(URI)
    assert url.url == "https://example.com/cat.png" and url.span is not None
    assert audio.encoding == "base64" and audio.audio_format == "wav"
    assert bytes(inline_value(body, audio)) == WAV.encode()
    assert video.url == "https://example.com/v.mp4"


def test_chat_parts_without_type_or_with_uuid_are_read_like_vllm() -> None:
    doc = {"messages": [{"role": "user", "content": [
        {"image_url": {"url": URI}},
        {"image_url": "http://x/y.png"},
        {"type": "image_url", "uuid": "u1", "image_url": None},  # a cached media reference: nothing inline
        {"type": "text", "uuid": "u2", "video_url": {"url": "https://x/v.mp4"}},  # vLLM reads the field
        {"input_audio": None, "video_url": "https://x/w.mp4"},
        {"image_embeds": "AAAA", "image_url": {"url": URI}},  # image_url comes first in vLLM's order
        {"audio_embeds": "AAAA", "audio_url": {"url": URI}},  # the embeds field wins: not media
        {"type": "text", "text": "plain", "image_url": {"url": URI}},  # typed text: image_url ignored
        {"type": 5, "image_url": {"url": URI}},  # the backend refuses a non-string type
        {"type": ["image_url"], "image_url": {"url": URI}},
        {"type": {"image_url": 1}, "image_url": {"url": URI}},
        "just a string",
        None,
    ]}]}
    assert summary(parts_of("chat", doc)[1]) == [
        ("messages[0].content[0]", "image", False),
        ("messages[0].content[1]", "image", True),
        ("messages[0].content[3]", "video", True),
        ("messages[0].content[4]", "video", True),
        ("messages[0].content[5]", "image", False),
    ]


def test_escaped_keys_and_types_are_still_found() -> None:
    esc = "".join(f"\\u{ord(c):04x}" for c in "input_image")  # 66 bytes: a placeholder
    body = ('{"messages": [{"role": "user", "content": [{"type": "\\u0069mage_url", '  # noqa: UP031 (JSON braces)
            '"\\u0069mage_url": {"url": "data:image\\/png;base64,%s"}}]}], '
            '"input": [{"role": "user", "content": [{"type": "%s", "image_url": "%s"}]}]}'
            % (PNG.replace("/", "\\/"), esc, URI)).encode()
    sk = skeletonize(body)
    [chat] = locate("chat", sk)
    assert chat.path == "messages[0].content[0]" and chat.span is not None and chat.span.escaped
    assert bytes(string_value(body, chat.span)) == URI.encode()
    [resp] = locate("responses", sk)
    assert resp.path == "input[0].content[0]" and not resp.is_url


def test_short_raw_values_stay_literal() -> None:
    body, [part] = parts_of("chat", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"}}]}]})
    assert part.span is None and part.literal == "UklGRg==" and bytes(inline_value(body, part)) == b"UklGRg=="
    assert part.audio_format == "mp3"


@pytest.mark.parametrize(
    ("part", "path"),
    [
        ({"type": "image_url"}, "messages[0].content[0]"),
        ({"type": "image_url", "image_url": {"detail": "low"}}, "messages[0].content[0]"),
        ({"type": "image_url", "image_url": {"url": None}}, "messages[0].content[0]"),
        ({"type": "image_url", "image_url": 42}, "messages[0].content[0]"),
        ({"type": "video_url", "video_url": {}}, "messages[0].content[0]"),
        ({"type": "input_audio", "input_audio": "AAAA"}, "messages[0].content[0]"),
        ({"type": "input_audio", "input_audio": {"format": "wav"}}, "messages[0].content[0]"),
        ({"type": "input_image"}, "messages[0].content[0]"),
    ],
)
def test_malformed_chat_media_is_refused_with_its_path(part: dict[str, Any], path: str) -> None:
    assert refused("chat", {"messages": [{"role": "user", "content": [part]}]}).param == path


def test_chat_is_liberal_about_everything_else() -> None:
    for doc in [
        {},
        {"messages": "hi"},
        {"messages": [None, 1, "x", {"role": "user"}, {"content": {"type": "image_url"}}]},
        {"messages": [{"role": "user", "content": [{"type": "mystery", "image": URI}]}]},
        [1, 2],
        "text",
    ]:
        assert parts_of("chat", doc)[1] == []


# ---------------------------------------------------------------------------------------------------
# responses


def test_responses_parts() -> None:
    doc = {"model": "m", "input": [
        {"role": "user", "content": [
            {"type": "input_text", "text": "what is this?"},
            {"type": "input_image", "image_url": URI, "detail": "auto"},
            {"type": "input_image", "file_id": "file-abc"},
            {"type": "input_image", "image_url": {"url": "https://x/a.png"}},
        ]},
        {"type": "input_image", "image_url": URI},
        {"type": "message", "role": "user", "content": "just text"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": URI}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URI}}]},  # chat-style too
    ]}
    assert summary(parts_of("responses", doc)[1]) == [
        ("input[0].content[1]", "image", False),
        ("input[0].content[3]", "image", True),
        ("input[1]", "image", False),
        ("input[3].output[0]", "image", False),
        ("input[4].content[0]", "image", False),
    ]
    assert parts_of("responses", {"input": "a plain prompt with data:image/png;base64,AAAA"})[1] == []


def test_responses_malformed_input_image() -> None:
    content = [{"type": "text"}, {"type": "input_image", "detail": "low"}]
    err = refused("responses", {"input": [{"role": "user", "content": content}]})
    assert err.param == "input[0].content[1]"
    err = refused("responses", {"input": [{"type": "input_image", "image_url": {"detail": "x"}}]})
    assert err.param == "input[0]"


# ---------------------------------------------------------------------------------------------------
# messages (Anthropic)


def test_anthropic_image_blocks_and_mime_span() -> None:
    doc = {"model": "claude", "system": [{"type": "text", "text": "sys"}], "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            {"type": "image", "source": {"type": "url", "url": "https://x/y.jpg"}},
            {"type": "image", "source": {"type": "file", "file_id": "f"}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AAAA"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "text", "text": "result"},
                {"type": "image", "source": {"data": PNG, "media_type": "image/jpeg", "type": "base64"}},
            ]},
        ]},
        {"role": "assistant", "content": "text only"},
    ]}
    body, parts = parts_of("messages", doc)
    assert summary(parts) == [
        ("messages[0].content[1]", "image", False),
        ("messages[0].content[2]", "image", True),
        ("messages[1].content[0].content[1]", "image", False),
    ]
    first, url, nested = parts
    assert first.encoding == "base64" and first.declared_mime == "image/png"
    assert first.span is not None and first.mime_span is not None
    assert body[first.mime_span.start : first.mime_span.end] == b'"image/png"'
    assert url.url == "https://x/y.jpg"
    assert nested.declared_mime == "image/jpeg" and nested.mime_span is not None

    out = splice(body, [(first.span, b'"UkVXUklURQ=="'), (first.mime_span, b'"image/webp"')])
    expected = orjson.loads(body)
    expected["messages"][0]["content"][1]["source"].update(data="UkVXUklURQ==", media_type="image/webp")
    assert orjson.loads(out) == expected


@pytest.mark.parametrize(
    ("block", "path"),
    [
        ({"type": "image"}, "messages[0].content[0]"),
        ({"type": "image", "source": "AAAA"}, "messages[0].content[0]"),
        ({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}, "messages[0].content[0]"),
        ({"type": "image", "source": {"type": "url"}}, "messages[0].content[0]"),
        ({"type": "tool_result", "content": [{"type": "image", "source": {"type": "base64"}}]},
         "messages[0].content[0].content[0]"),
    ],
)
def test_anthropic_malformed_images(block: dict[str, Any], path: str) -> None:
    assert refused("messages", {"messages": [{"role": "user", "content": [block]}]}).param == path


def test_anthropic_unknown_source_types_are_left_to_the_backend() -> None:
    doc = {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "later", "data": PNG}}]}]}
    assert parts_of("messages", doc)[1] == []


# ---------------------------------------------------------------------------------------------------
# generate (SGLang / vLLM native)


def test_generate_single_and_nested_lists() -> None:
    doc = {"text": "describe", "image_data": [[URI, PNG * 2], ["https://x/a.png", None], PNG[:20]],
           "audio_data": WAV, "video_data": [{"url": "https://x/v.mp4"}, {"format": "precomputed_embedding"}]}
    body, parts = parts_of("generate", doc)
    assert summary(parts) == [
        ("image_data[0][0]", "image", False),
        ("image_data[0][1]", "image", False),
        ("image_data[1][0]", "image", True),
        ("image_data[2]", "image", False),
        ("audio_data", "audio", False),
        ("video_data[0]", "video", True),
    ]
    assert [p.encoding for p in parts if not p.is_url] == ["data_uri", "base64", "base64", "base64"]
    assert parts[3].span is None and parts[3].literal == PNG[:20]
    assert parts[2].url == "https://x/a.png"
    assert bytes(inline_value(body, parts[4])) == WAV.encode()
    assert parts_of("generate", {"text": "no media", "image_data": None})[1] == []
    assert summary(parts_of("generate", {"image_data": "s3://bucket/key.png"})[1]) == [("image_data", "image", True)]


# ---------------------------------------------------------------------------------------------------
# find_media: the same answer by the cheaper road


def test_find_media_text_heavy_body_without_media_is_parsed_plainly() -> None:
    body = orjson.dumps({"messages": [{"role": "user", "content": "an image of a video \u00e9 " * 10}] * 500})
    skeleton, parts = find_media("chat", body)
    assert parts == [] and skeleton is not None and skeleton.spans == []


def test_find_media_text_heavy_body_with_media_gets_spans() -> None:
    messages: list[Any] = [{"role": "user", "content": "words " * 20}] * 500
    messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": URI}}]})
    body = orjson.dumps({"messages": messages})
    assert locate("chat", parse_plain(body))[0].span is None  # the plain parse alone has no spans
    skeleton, [part] = find_media("chat", body)
    assert part.path == "messages[500].content[0]" and part.span is not None and skeleton is not None


def test_find_media_invalid_json() -> None:
    assert find_media("chat", b"not json at all") == (None, [])  # no marker: forwarded for the backend to judge
    assert find_media("chat", b'{"a": "' + b"x" * 200_000) == (None, [])
    assert find_media("other", b'{"image_url": ') == (None, [])
    with pytest.raises(MmgateError) as caught:
        find_media("chat", b'{"type": "image_url", ')
    assert caught.value.code == "invalid_json"
    with pytest.raises(MmgateError) as caught:
        find_media("chat", b'{"messages": [{"content": [{"type": "image_url"}]}]}')
    assert caught.value.code == "invalid_request"


# ---------------------------------------------------------------------------------------------------
# error documents: a client's mistake is typed as one


SERVER_ERROR_TYPES = frozenset({"server_error", "api_error", "upstream_error", "timeout_error", "overloaded_error"})


@pytest.mark.parametrize("dialect", list(Dialect))
def test_every_4xx_of_the_registry_is_a_client_error_type(dialect: Dialect) -> None:
    """SDKs read the type to decide whose fault an answer is: a 4xx is the client's in both APIs' documents."""
    client_errors = [entry.error("refused") for (status, _), entry in REGISTRY.items() if 400 <= status < 500]
    assert any(error.status == 405 for error in client_errors)
    for error in client_errors:
        document = orjson.loads(dialect.error_body(error))
        error_type = document["error"]["type"]
        assert error_type not in SERVER_ERROR_TYPES, (error.status, error.code, error_type)


@pytest.mark.parametrize("dialect", list(Dialect))
def test_a_status_the_table_does_not_name_is_typed_by_its_class(dialect: Dialect) -> None:
    """A 4xx added to the registry is the client's fault in both documents before anyone names it."""
    for status, expected in ((418, {"invalid_request_error"}), (507, SERVER_ERROR_TYPES)):
        error = ErrorCode(status, "unnamed", "a status the table does not name", MmgateError).error("refused")
        assert orjson.loads(dialect.error_body(error))["error"]["type"] in expected, status
