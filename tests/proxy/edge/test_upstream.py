"""What the relay counts of an answer on its way (``OutputCount``): a whole answer's usage, an event stream's
events wherever the chunks split it. (The relay itself is tested over HTTP in tests/proxy/test_app*.py.)"""

from __future__ import annotations

import itertools

import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.edge.upstream import OutputCount

# A JSON string cannot hold a raw newline: text that looks like an event inside one starts no line.
TRICKY = "data: x\\n\\ndata: y [DONE]"


def _event(text: str) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"delta": {"content": text}}]}) + b"\n\n"


def _counted(chunks: list[bytes]) -> int:
    count = OutputCount()
    for chunk in chunks:
        count.feed(chunk)
    return count.events


def _split(stream: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted(cut % (len(stream) + 1) for cut in cuts), len(stream)]
    return [stream[low:high] for low, high in itertools.pairwise(edges)]


@given(st.lists(st.text(max_size=20), max_size=40), st.booleans(), st.sampled_from([b"\n", b"\r\n"]),
       st.lists(st.integers(0, 1 << 16), max_size=30))
def test_a_streams_events_are_counted_however_it_is_chunked(texts: list[str], done: bool, newline: bytes,
                                                             cuts: list[int]) -> None:
    events = [_event(text).replace(b"\n", newline) for text in [*texts, TRICKY]]
    stream = b"".join(events) + (b"data: [DONE]" + newline + newline if done else b"")
    stream = b": keep-alive" + newline + newline + stream  # a comment is no event
    assert _counted(_split(stream, cuts)) == len(events)


def test_an_empty_stream_has_no_events() -> None:
    assert _counted([]) == 0 and _counted([b""]) == 0


def test_a_whole_answer_counts_its_usage_and_nothing_else() -> None:
    answer = {"choices": [{"message": {"content": '"completion_tokens": 999'}}],
              "usage": {"prompt_tokens": 12, "completion_tokens": 64, "total_tokens": 76}}
    assert OutputCount.of_whole(orjson.dumps(answer)) == 64
    assert OutputCount.of_whole(orjson.dumps(answer, option=orjson.OPT_INDENT_2)) == 64
    assert OutputCount.of_whole(b'{"ok": true}') is None
