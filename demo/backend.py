"""A stub VLM inference server speaking the OpenAI, Anthropic and SGLang wire formats.

Why it exists: mmgate's demo, tests and benchmarks need a backend that *costs* what a real multimodal
server costs (it base64-decodes every inline image, Pillow-decodes it to an RGB pixel array, optionally
burns vision-encoder CPU and holds the pixels until the answer is sent) while answering in each API's real
wire format, so the official SDKs work through the proxy unchanged. The answer names the size of every
image it decoded ("stub answer: saw 1 image(s) [640x480]"), so a test can see what actually arrived.

Run it as ``python -m demo.backend --port 8000`` (numpy comes with the ``demo`` extra). Knobs change at runtime
with POST /stub/config. ``--profile frontend`` works like a real server's frontend (``PROFILES``): one decode
thread, processor CPU per megapixel of every image it decodes (a processor's resize reads every source pixel),
and a short prefill before the first token; each knob given on the command line still wins.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np
import orjson
import pybase64
from aiohttp import web
from PIL import Image

Json = dict[str, Any]
PIXELS_PER_IMAGE_TOKEN = 28 * 28  # Qwen2-VL style: one token per 28x28 patch
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_KNOB_TYPES: dict[str, type | tuple[type, ...]] = {"float": (int, float), "int": int, "bool": bool, "str": str}


@dataclass(frozen=True)
class StubConfig:
    """Every knob of the stub. Frozen: a runtime update builds a new one (POST /stub/config)."""

    first_token_delay: float = 0.0  # seconds before the first token (also delays non-streaming answers)
    token_delay: float = 0.0  # seconds between tokens
    tokens: int = 16  # completion tokens when the request sets no max_tokens
    hold_pixels: bool = False  # keep decoded pixel arrays until the answer is fully sent
    cpu_ms_per_mp: float = 0.0  # simulated vision-encoder CPU per megapixel, burnt in the executor
    workers: int = 1  # threads of the decode/encode executor (a real server has few)
    healthy: bool = True  # GET /health answers 503 when False
    model: str = "stub-vlm"  # listed by /v1/models; answers echo the request's model if it has one

    def __post_init__(self) -> None:
        """Check types and ranges here, so the CLI and runtime updates share one set of rules."""
        for f in fields(self):
            value, allowed = getattr(self, f.name), _KNOB_TYPES[str(f.type)]
            if not isinstance(value, allowed) or (f.type != "bool" and isinstance(value, bool)):
                raise ValueError(f"{f.name}={value!r} is not a {f.type}")
            if f.type in ("int", "float") and isinstance(value, int | float) and value < (1 if f.type == "int" else 0):
                raise ValueError(f"{f.name}={value!r} must be >= {1 if f.type == 'int' else 0}")


# Presets of the knobs. ``frontend``: what vLLM's frontend does with an image, in one thread: decode, then its
# processor (transformers' PIL image processors measured on 2 shared cores: about 250 ms for a 12 MP photo brought
# to 1 MP, 40 ms for a 1 MP one; 20 ms a megapixel is the round figure), then a 20 ms prefill.
PROFILES = {"plain": StubConfig(), "frontend": StubConfig(first_token_delay=0.02, cpu_ms_per_mp=20.0, workers=1)}


class StubError(Exception):
    """A 400 answered in the route's error shape."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass
class Media:
    """One image part of a request: where it sits, and the string carrying it."""

    path: str
    value: Any
    kind: str = "auto"  # auto: data URI, http(s) URL or raw base64; b64: raw base64; url: never fetched


@dataclass
class Parsed:
    """What the stub needs from a request, whatever its API."""

    texts: list[str] = field(default_factory=list)
    media: list[Media] = field(default_factory=list)
    max_tokens: Any = None
    prompt_ids: int | None = None


class StubState:
    """Mutable runtime state: current config, executor and counters (mutated on the loop thread only)."""

    def __init__(self, config: StubConfig) -> None:
        self.config = config
        self.executor = ThreadPoolExecutor(config.workers, thread_name_prefix="stub-vision")
        self.stats: dict[str, int] = {}
        self.reset_stats()
        self._changed = asyncio.Event()

    def reset_stats(self) -> None:
        keys = ("requests", "images_decoded", "image_urls", "held_pixel_bytes", "peak_held_pixel_bytes",
                "active_requests", "aborted_requests", "bad_requests", "request_body_bytes")
        active, held = self.stats.get("active_requests", 0), self.stats.get("held_pixel_bytes", 0)
        self.stats = dict.fromkeys(keys, 0) | {"active_requests": active, "held_pixel_bytes": held}

    def bump(self, key: str, n: int = 1) -> None:
        self.stats[key] += n
        if key == "held_pixel_bytes":
            self.stats["peak_held_pixel_bytes"] = max(self.stats["peak_held_pixel_bytes"], self.stats[key])
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, predicate: Callable[[dict[str, int]], bool], timeout: float = 10.0) -> None:
        """Wait until the counters satisfy ``predicate`` (tests sync on events, never on sleeps)."""
        async with asyncio.timeout(timeout):
            while not predicate(self.stats):
                await self._changed.wait()

    def reconfigure(self, changes: Json) -> None:
        """Apply a partial update of the knobs; a new executor when the worker count changes."""
        try:
            new = replace(self.config, **changes)
        except (TypeError, ValueError) as exc:  # unknown knob, wrong type or out of range
            raise StubError("invalid_config", str(exc)) from None
        if new.workers != self.config.workers:
            old, self.executor = self.executor, ThreadPoolExecutor(new.workers, thread_name_prefix="stub-vision")
            old.shutdown(wait=False)
        self.config = new


STATE = web.AppKey("stub_state", StubState)


# --- where images live in each API --------------------------------------------------------------------

def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _strings(value: Any) -> list[str]:
    """Text from a string, a list of strings or a list of {"text": ...} blocks."""
    if isinstance(value, str):
        return [value]
    return [v if isinstance(v, str) else str(v.get("text", "")) for v in _as_list(value) if isinstance(v, (str, dict))]


def _parts(messages: Any, prefix: str) -> Iterator[tuple[str, Json]]:
    """(JSON path, part) of every content part; a string content is one text part, an item without
    content (a Responses input item such as a bare input_image) is a part itself."""
    for i, msg in enumerate(_as_list(messages)):
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        if isinstance(content, str):
            yield f"{prefix}[{i}]", {"type": "text", "text": content}
        elif "content" not in msg:
            yield f"{prefix}[{i}]", msg
        for j, part in enumerate(_as_list(content)):
            if isinstance(part, dict):
                yield f"{prefix}[{i}].content[{j}]", part


def _read_part(out: Parsed, path: str, part: Json) -> None:
    """One content part of any dialect: OpenAI chat, Responses or Anthropic."""
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        out.texts.append(str(part.get("text", "")))
    elif kind == "image_url":  # chat: {"url": ...} or the string itself
        url = part.get("image_url")
        out.media.append(Media(path, url.get("url") if isinstance(url, dict) else url))
    elif kind == "input_image":  # Responses: a string
        out.media.append(Media(path, part.get("image_url")))
    elif kind == "image":  # Anthropic: a source object
        source = part.get("source")
        src = source if isinstance(source, dict) else {}
        url = src.get("type") == "url"
        out.media.append(Media(path, src.get("url") if url else src.get("data"), "url" if url else "b64"))


def _parse_messages_like(body: Json, key: str, max_tokens: Any) -> Parsed:
    out = Parsed(max_tokens=max_tokens)
    for extra in ("system", "instructions"):  # Anthropic system, Responses instructions: text only
        out.texts += _strings(body.get(extra))
    if isinstance(body.get(key), str):  # Responses input may be a plain string
        out.texts.append(body[key])
    for path, part in _parts(body.get(key), key):
        _read_part(out, path, part)
    return out


def _parse_completions(body: Json) -> Parsed:
    prompt = body.get("prompt", "")
    ids = len(prompt) if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt) else None
    return Parsed(texts=_strings(prompt), max_tokens=body.get("max_tokens"), prompt_ids=ids)


def _parse_generate(body: Json) -> Parsed:
    sampling = body.get("sampling_params")
    params = sampling if isinstance(sampling, dict) else {}
    out = Parsed(max_tokens=params.get("max_new_tokens"))
    out.texts += _strings(body.get("text"))
    if isinstance(body.get("input_ids"), list):
        out.prompt_ids = sum(len(x) if isinstance(x, list) else 1 for x in body["input_ids"])
    images = body.get("image_data")
    if isinstance(images, str):
        out.media.append(Media("image_data", images))
    for i, item in enumerate(_as_list(images)):  # a list, or a batch of lists
        for k, one in enumerate(item if isinstance(item, list) else [item]):
            if one is not None:
                path = f"image_data[{i}][{k}]" if isinstance(item, list) else f"image_data[{i}]"
                out.media.append(Media(path, one))
    return out


# --- decoding "like a VLM server" ---------------------------------------------------------------------

def _image_bytes(media: Media) -> bytes:
    value = media.value
    if not isinstance(value, str):
        raise StubError("invalid_image", "image must be a string (data URI, URL or base64)", media.path)
    if media.kind == "auto" and value.startswith("data:"):
        header, sep, value = value.partition(",")
        if not sep or not header.endswith(";base64"):
            raise StubError("invalid_image", "image data URI must be ';base64,' encoded", media.path)
    try:
        return pybase64.b64decode(value, validate=True)
    except ValueError as exc:  # binascii.Error is a ValueError; so is a non-ASCII str
        raise StubError("invalid_image", f"invalid base64 image data: {exc}", media.path) from None


def _burn(pixels: np.ndarray, ms: float) -> None:
    """Spend ``ms`` of this thread's CPU time touching the pixels, like a vision encoder would."""
    deadline, flat = time.thread_time() + ms / 1000.0, pixels.reshape(-1)
    offset = 0
    while time.thread_time() < deadline and flat.size:
        flat[offset:offset + 65536].sum(dtype=np.uint64)
        offset = (offset + 65536) % flat.size


def _decode_all(items: list[Media], cpu_ms_per_mp: float) -> list[np.ndarray]:
    """Runs in the executor: base64 -> bytes -> Pillow -> RGB numpy array (+ simulated encoder cost)."""
    arrays = []
    for media in items:
        raw = _image_bytes(media)
        try:
            with Image.open(io.BytesIO(raw)) as img:
                pixels = np.asarray(img.convert("RGB"))
        except Exception as exc:  # Pillow raises many types for bad data; all mean "not an image"
            message = f"cannot decode image ({type(exc).__name__})"
            raise StubError("image_decode_failed", message, media.path) from None
        del raw
        _burn(pixels, cpu_ms_per_mp * pixels.shape[0] * pixels.shape[1] / 1e6)
        arrays.append(pixels)
    return arrays


# --- answers in each API's wire format ----------------------------------------------------------------

@dataclass
class Answer:
    """Everything an API renderer needs about one generated answer."""

    pieces: list[str]  # the streamed tokens; the first one carries the header naming the images
    model: str
    prompt_tokens: int
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def completion_tokens(self) -> int:
        return len(self.pieces)

    def openai_usage(self) -> Json:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _sse(data: Json | str, event: str | None = None) -> bytes:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return (b"event: " + event.encode() + b"\n" if event else b"") + b"data: " + payload + b"\n\n"


def _chat_chunk(a: Answer, delta: Json, finish: str | None) -> Json:
    return {"id": f"chatcmpl-{a.id}", "object": "chat.completion.chunk", "created": a.created, "model": a.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def _chat_full(a: Answer) -> Json:
    return {"id": f"chatcmpl-{a.id}", "object": "chat.completion", "created": a.created, "model": a.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": a.text}, "logprobs": None,
                         "finish_reason": "stop"}], "usage": a.openai_usage()}


async def _chat_stream(a: Answer, tokens: AsyncIterator[str]) -> AsyncIterator[bytes]:
    yield _sse(_chat_chunk(a, {"role": "assistant", "content": ""}, None))
    async for piece in tokens:
        yield _sse(_chat_chunk(a, {"content": piece}, None))
    yield _sse(_chat_chunk(a, {}, "stop"))
    if a.include_usage:
        yield _sse(_chat_chunk(a, {}, None) | {"choices": [], "usage": a.openai_usage()})
    yield _sse("[DONE]")


def _completion(a: Answer, text: str, finish: str | None) -> Json:
    return {"id": f"cmpl-{a.id}", "object": "text_completion", "created": a.created, "model": a.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def _completions_full(a: Answer) -> Json:
    return _completion(a, a.text, "stop") | {"usage": a.openai_usage()}


async def _completions_stream(a: Answer, tokens: AsyncIterator[str]) -> AsyncIterator[bytes]:
    async for piece in tokens:
        yield _sse(_completion(a, piece, None))
    yield _sse(_completion(a, "", "stop"))
    if a.include_usage:
        yield _sse(_completion(a, "", None) | {"choices": [], "usage": a.openai_usage()})
    yield _sse("[DONE]")


def _resp_message(a: Answer, text: str | None) -> Json:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": f"msg_{a.id}", "type": "message", "role": "assistant", "content": content,
            "status": "in_progress" if text is None else "completed"}


def _resp_full(a: Answer, done: bool = True) -> Json:
    usage = {"input_tokens": a.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": a.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": a.prompt_tokens + a.completion_tokens}
    return {"id": f"resp_{a.id}", "object": "response", "created_at": a.created, "model": a.model,
            "status": "completed" if done else "in_progress", "output": [_resp_message(a, a.text)] if done else [],
            "usage": usage if done else None, "error": None, "incomplete_details": None, "instructions": None,
            "metadata": {}, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "temperature": 1.0, "top_p": 1.0, "text": {"format": {"type": "text"}}}


async def _responses_stream(a: Answer, tokens: AsyncIterator[str]) -> AsyncIterator[bytes]:
    seq = iter(range(1 << 30))
    at = {"item_id": f"msg_{a.id}", "output_index": 0, "content_index": 0}

    def event(kind: str, **data: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **data}, kind)

    yield event("response.created", response=_resp_full(a, done=False))
    yield event("response.in_progress", response=_resp_full(a, done=False))
    yield event("response.output_item.added", output_index=0, item=_resp_message(a, None))
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield event("response.content_part.added", **at, part=part)
    async for piece in tokens:
        yield event("response.output_text.delta", **at, delta=piece, logprobs=[])
    yield event("response.output_text.done", **at, text=a.text, logprobs=[])
    yield event("response.content_part.done", **at, part=part | {"text": a.text})
    yield event("response.output_item.done", output_index=0, item=_resp_message(a, a.text))
    yield event("response.completed", response=_resp_full(a))


def _anthropic_full(a: Answer, done: bool = True) -> Json:
    return {"id": f"msg_{a.id}", "type": "message", "role": "assistant", "model": a.model,
            "content": [{"type": "text", "text": a.text}] if done else [],
            "stop_reason": "end_turn" if done else None, "stop_sequence": None,
            "usage": {"input_tokens": a.prompt_tokens, "output_tokens": a.completion_tokens if done else 0}}


async def _anthropic_stream(a: Answer, tokens: AsyncIterator[str]) -> AsyncIterator[bytes]:
    def event(kind: str, **data: Any) -> bytes:
        return _sse({"type": kind, **data}, kind)

    yield event("message_start", message=_anthropic_full(a, done=False))
    yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    async for piece in tokens:
        yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
    yield event("content_block_stop", index=0)
    yield event("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                usage={"output_tokens": a.completion_tokens})
    yield event("message_stop")


def _generate_full(a: Answer, pieces: list[str] | None = None) -> Json:
    """SGLang /generate: cumulative text plus meta_info; ``pieces`` so far while streaming."""
    done = pieces is None
    pieces = a.pieces if pieces is None else pieces
    meta = {"id": a.id, "prompt_tokens": a.prompt_tokens, "completion_tokens": len(pieces),
            "finish_reason": {"type": "stop"} if done else None}
    return {"text": "".join(pieces), "meta_info": meta}


async def _generate_stream(a: Answer, tokens: AsyncIterator[str]) -> AsyncIterator[bytes]:
    pieces: list[str] = []  # SGLang streams the cumulative text by default
    async for piece in tokens:
        pieces.append(piece)
        yield _sse(_generate_full(a, pieces))
    yield _sse(_generate_full(a))
    yield _sse("[DONE]")


@dataclass(frozen=True)
class Api:
    """One route: how to find its media, and how to render full answers, streams and errors."""

    parse: Callable[[Json], Parsed]
    full: Callable[[Answer], Json]
    stream: Callable[[Answer, AsyncIterator[str]], AsyncIterator[bytes]]
    anthropic_errors: bool = False


APIS = {
    "/v1/chat/completions": Api(
        lambda b: _parse_messages_like(b, "messages", b.get("max_completion_tokens", b.get("max_tokens"))),
        _chat_full, _chat_stream),
    "/v1/completions": Api(_parse_completions, _completions_full, _completions_stream),
    "/v1/responses": Api(lambda b: _parse_messages_like(b, "input", b.get("max_output_tokens")),
                         _resp_full, _responses_stream),
    "/v1/messages": Api(lambda b: _parse_messages_like(b, "messages", b.get("max_tokens")),
                        _anthropic_full, _anthropic_stream, anthropic_errors=True),
    "/generate": Api(_parse_generate, _generate_full, _generate_stream),
}


def _error(err: StubError, anthropic: bool = False) -> web.Response:
    """A 400 in the OpenAI shape, or Anthropic's (which has no ``param``: the path goes in the message)."""
    if anthropic:
        message = f"{err.param}: {err.message} ({err.code})" if err.param else f"{err.message} ({err.code})"
        body: Json = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    else:
        body = {"error": {"message": err.message, "type": "invalid_request_error", "code": err.code,
                          "param": err.param}}
    return _json(body, 400)


async def _tokens(config: StubConfig, pieces: list[str]) -> AsyncIterator[str]:
    """The 'generation': first-token delay, then one piece per token_delay."""
    for i, piece in enumerate(pieces):
        delay = config.first_token_delay if i == 0 else config.token_delay
        if delay:
            await asyncio.sleep(delay)
        yield piece


def _answer(parsed: Parsed, body: Json, sizes: list[str], prompt_image_tokens: int, config: StubConfig) -> Answer:
    limit = parsed.max_tokens
    n = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else config.tokens
    header = f"stub answer: saw {len(sizes)} image(s) [{', '.join(sizes)}]"
    text_tokens = sum(math.ceil(len(t) / 4) for t in parsed.texts) if parsed.prompt_ids is None else parsed.prompt_ids
    options = body.get("stream_options")
    return Answer(pieces=[header] + [f" tok{i}" for i in range(1, n)],
                  model=body["model"] if isinstance(body.get("model"), str) else config.model,
                  prompt_tokens=max(1, text_tokens + prompt_image_tokens),
                  include_usage=isinstance(options, dict) and bool(options.get("include_usage")))


async def _serve(request: web.Request, api: Api) -> web.StreamResponse:
    """One inference request: read, decode images, 'generate', answer; pixels held per the config."""
    state = request.app[STATE]
    config = state.config
    state.bump("requests")
    state.bump("active_requests")
    arrays: list[np.ndarray] = []
    held = 0
    resp: web.StreamResponse | None = None
    try:
        raw = await request.read()
        state.bump("request_body_bytes", len(raw))
        try:
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise StubError("invalid_request", "request body must be a JSON object")
            parsed = api.parse(body)
            inline = [m for m in parsed.media if not (m.kind == "url" or (
                isinstance(m.value, str) and m.value.startswith(("http://", "https://"))))]
            if inline:
                loop = asyncio.get_running_loop()
                arrays = await loop.run_in_executor(state.executor, _decode_all, inline, config.cpu_ms_per_mp)
        except orjson.JSONDecodeError:
            state.bump("bad_requests")
            return _error(StubError("invalid_json", "request body is not valid JSON"), api.anthropic_errors)
        except StubError as err:
            state.bump("bad_requests")
            return _error(err, api.anthropic_errors)
        held = sum(a.nbytes for a in arrays)
        state.bump("held_pixel_bytes", held)
        state.bump("images_decoded", len(arrays))
        state.bump("image_urls", len(parsed.media) - len(inline))
        decoded, inline_ids = iter(f"{a.shape[1]}x{a.shape[0]}" for a in arrays), {id(m) for m in inline}
        sizes = [next(decoded) if id(m) in inline_ids else "url" for m in parsed.media]
        image_tokens = sum(math.ceil(a.shape[0] * a.shape[1] / PIXELS_PER_IMAGE_TOKEN) for a in arrays)
        if not config.hold_pixels:  # a server that drops pixels once encoded
            arrays = []
            state.bump("held_pixel_bytes", -held)
            held = 0
        answer = _answer(parsed, body, sizes, image_tokens, config)
        tokens = _tokens(config, answer.pieces)
        if body.get("stream") is True:
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            async for frame in api.stream(answer, tokens):
                await resp.write(frame)
        else:
            async for _ in tokens:
                pass
            resp = web.Response(body=orjson.dumps(api.full(answer)), content_type="application/json")
            await resp.prepare(request)
        await resp.write_eof()
        return resp
    except ConnectionResetError:  # the client left while we were writing
        state.bump("aborted_requests")
        return resp or web.Response(status=499)  # never sent: the connection is gone
    except asyncio.CancelledError:  # the client left while we were waiting (handler_cancellation=True)
        state.bump("aborted_requests")
        raise
    finally:
        arrays = []
        if held:
            state.bump("held_pixel_bytes", -held)
        state.bump("active_requests", -1)


# --- small endpoints ----------------------------------------------------------------------------------

async def _models(request: web.Request) -> web.Response:
    model = {"id": request.app[STATE].config.model, "object": "model", "created": 0, "owned_by": "mmgate"}
    return _json({"object": "list", "data": [model]})


async def _health(request: web.Request) -> web.Response:
    healthy = request.app[STATE].config.healthy
    return web.Response(status=200 if healthy else 503, text="ok" if healthy else "unhealthy")


async def _stats(request: web.Request) -> web.Response:
    return _json(request.app[STATE].stats)


async def _update(request: web.Request, changes: Callable[[Json], Json]) -> web.Response:
    state = request.app[STATE]
    try:
        body = orjson.loads(await request.read())
        if not isinstance(body, dict):
            raise StubError("invalid_config", "expected a JSON object")
        state.reconfigure(changes(body))
    except orjson.JSONDecodeError:
        return _error(StubError("invalid_json", "body is not valid JSON"))
    except StubError as err:
        return _error(err)
    return _json(asdict(state.config))


async def _reset(request: web.Request) -> web.Response:
    request.app[STATE].reset_stats()
    return _json(request.app[STATE].stats)


def _handler(func: Callable[[web.Request, Any], Awaitable[web.StreamResponse]], arg: Any) -> Any:
    """Bind a second argument to a handler (aiohttp wants real coroutine functions, not lambdas)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await func(request, arg)

    return handle


def create_stub_app(config: StubConfig | None = None) -> web.Application:
    """The stub as an aiohttp app. Serve it with handler_cancellation=True to count client disconnects."""
    app = web.Application(client_max_size=1 << 30)
    app[STATE] = StubState(config or StubConfig())

    async def executor_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        app[STATE].executor.shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(executor_ctx)
    for path, api in APIS.items():
        app.router.add_post(path, _handler(_serve, api))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/stats", _stats)
    app.router.add_post("/stub/config", _handler(_update, lambda body: body))
    app.router.add_post("/stub/health", _handler(_update, lambda body: {"healthy": body.get("healthy", True)}))
    app.router.add_post("/stub/reset", _reset)
    return app


def _arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo.backend", description=__doc__.splitlines()[0])
    d = StubConfig()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="plain",
                   help="preset knobs: frontend = one decode thread, processor CPU per MP, a short prefill")
    p.add_argument("--first-token-delay", type=float, default=None, help="seconds (the profile's by default)")
    p.add_argument("--token-delay", type=float, default=None, help="seconds between tokens")
    p.add_argument("--tokens", type=int, default=None, help="completion tokens when max_tokens is unset")
    p.add_argument("--hold-pixels", action="store_true", default=None,
                   help="keep decoded pixels until the answer is sent")
    p.add_argument("--cpu-ms-per-mp", type=float, default=None, help="simulated processor and encoder CPU")
    p.add_argument("--workers", type=int, default=None, help="decode/encode threads")
    p.add_argument("--model", default=d.model)
    return p


class ListenError(Exception):
    """The stub cannot listen where it was told; ``str()`` is the one line main() prints before exit status 2."""


async def _run(host: str, port: int, config: StubConfig) -> None:
    app = create_stub_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:  # a port in use, a host that is not ours: one line for main(), no traceback
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc.strerror or exc).lower()
            raise ListenError(f"cannot listen on {host}:{port}: {reason} (--host / --port)") from None
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        bound = runner.addresses[0][1] if runner.addresses else port
        print(f"stub backend listening on http://{host}:{bound}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: serve until SIGTERM/SIGINT, then exit 0."""
    parser = _arg_parser()
    args = parser.parse_args(argv)
    try:
        given = {name: getattr(args, name) for name in ("first_token_delay", "token_delay", "tokens", "hold_pixels",
                                                         "cpu_ms_per_mp", "workers", "model")}
        config = replace(PROFILES[args.profile], **{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        parser.exit(2, f"stub backend: {exc}\n")
    try:
        asyncio.run(_run(args.host, args.port, config))
    except ListenError as exc:
        parser.exit(2, f"stub backend: {exc}\n")


if __name__ == "__main__":
    main()
