"""MMGATE_MODEL=auto: the served model found by asking a real upstream (an aiohttp server answering
``/v1/models`` as vLLM does) and looking for its processor files in model folders and a Hugging Face cache
layout built in a temporary folder; what mmgate then does to the images on the wire."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from preprocessors.geometry import model_size
from proxy.app import MODEL_WATCHER, build_state
from proxy.media import discovery
from proxy.media.discovery import AnswerError, ModelWatcher, Refused, Served, ServedModel, locate
from proxy.media.model import Model
from proxy.settings import ConfigError, Settings
from testkit.media import chat_with_image, data_uri, decode_uri
from tests.conftest import StartProxy, Upstream

pytest.importorskip("transformers", reason="the model extra: pip install -e '.[model]'")

from testkit.models import hub_snapshot, idefics3_folder, qwen_folder

WIDE = (2000, 1000)  # a photo every model here shrinks


def _vllm_models(name: str, root: str, adapters: tuple[str, ...] = ()) -> dict[str, Any]:
    """``GET /v1/models`` as vLLM answers it: the base model, then each LoRA adapter with its parent."""
    base = {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": root, "parent": None,
            "max_model_len": 4096, "permission": []}
    return {"object": "list", "data": [base, *({"id": a, "object": "model", "created": 0, "owned_by": "vllm",
                                                 "root": f"/adapters/{a}", "parent": name} for a in adapters)]}


def _answering(answer: dict[str, Any]) -> Callable[[web.Request], Any]:
    async def models(_request: web.Request) -> web.Response:
        return web.json_response(answer)

    return models


def _png(width: int, height: int) -> bytes:
    """Incompressible: its model-sized BMP is smaller, so that is what goes (preprocessors/handoff.py)."""
    buf = io.BytesIO()
    noise = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


async def _post(proxy_url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
    async with aiohttp.ClientSession() as session:
        response = await session.post(proxy_url + "/v1/chat/completions", data=orjson.dumps(body),
                                      headers={"Content-Type": "application/json"})
        await response.read()
        return response


async def _sent_image(proxy_url: str, upstream: Upstream, model: str) -> tuple[tuple[int, int], str | None]:
    """The size of a WIDE image as the upstream received it, and the image-token header it came with."""
    response = await _post(proxy_url, chat_with_image(data_uri(_png(*WIDE)), model=model))
    assert response.status == 200
    seen = upstream.seen[-1]
    uri = orjson.loads(seen.body)["messages"][0]["content"][1]["image_url"]["url"]
    return decode_uri(uri)[1].size, seen.headers.get("x-mmgate-image-tokens")


def _resized(found: ServedModel) -> tuple[int, int]:
    """The size the found model's processor brings a WIDE image to."""
    assert found.model is not None and found.model.geometry is not None
    return model_size(found.model.geometry, *WIDE)


def _watcher(app: web.Application) -> ModelWatcher:
    return app[MODEL_WATCHER]


async def _found(app: web.Application, done: Callable[[ServedModel], bool]) -> ServedModel:
    """What the watcher put in force once ``done`` holds of it, awaited lookup by lookup (bounded)."""
    watcher = _watcher(app)
    async with asyncio.timeout(60):
        while not done(watcher.current):
            await watcher.wait_for(watcher.lookups + 1)
    return watcher.current


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A model folder (MMGATE_MODEL_DIRS), an empty Hugging Face cache (HF_HUB_CACHE) and a folder outside both."""
    models, cache, outside = tmp_path / "models", tmp_path / "hub", tmp_path / "outside"
    for folder in (models, cache, outside):
        folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return {"models": models, "cache": cache, "outside": outside}


# ---------------------------------------------------------------------------------------------------------
# Found


async def test_auto_finds_a_model_folder_the_server_loaded_and_works_to_its_geometry(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path],
        caplog: pytest.LogCaptureFixture) -> None:
    folder = qwen_folder(places["models"] / "qwen")
    upstream.route("/v1/models", _answering(_vllm_models("qwen", str(folder))))
    with caplog.at_level(logging.INFO, logger="mmgate"):
        proxy = await start_proxy(upstream.url, MMGATE_MODEL_DIRS=str(places["models"]))
        found = await _found(proxy.app, lambda now: now.model is not None)
    assert found.model is not None and found.model.family == "qwen2-vl" and found.folder == str(folder)
    assert "the upstream serves 'qwen': model qwen2-vl (QwenVL(" in caplog.text and str(folder) in caplog.text
    size, tokens = await _sent_image(proxy.url, upstream, "qwen")
    assert size == _resized(found) != WIDE and tokens == str(found.model.image_tokens(*WIDE))
    async with aiohttp.ClientSession() as client, client.get(proxy.url + "/mmgate/stats") as response:
        served = (await response.json())["served_model"]
    assert served["mode"] == "auto" and served["family"] == "qwen2-vl" and served["folder"] == str(folder)
    assert served["geometry"].startswith("QwenVL(")


async def test_auto_finds_a_hub_id_in_the_hugging_face_cache(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path]) -> None:
    snapshot = hub_snapshot(places["cache"], "org/tiny-idefics3", idefics3_folder(places["cache"].parent / "built"))
    upstream.route("/v1/models", _answering(_vllm_models("org/tiny-idefics3", "org/tiny-idefics3")))
    proxy = await start_proxy(upstream.url)
    found = await _found(proxy.app, lambda now: now.model is not None)
    assert found.model is not None and found.model.family == "idefics3" and found.folder == str(snapshot)
    size, tokens = await _sent_image(proxy.url, upstream, "org/tiny-idefics3")
    assert size == _resized(found) != WIDE and tokens == str(found.model.image_tokens(*WIDE))


async def test_a_found_model_is_prepared_before_it_is_put_in_force(places: dict[str, Path]) -> None:
    """The decode code is warmed for a found model (its processor's helpers loaded) before any request can get
    its geometry, as it is for a model named at start-up; the first client's image does not pay for it."""
    folder = qwen_folder(places["models"] / "qwen")
    preparing, release = asyncio.Event(), asyncio.Event()
    prepared: list[str] = []

    async def ask() -> Served:
        return Served("qwen", str(folder))

    async def prepare(model: Model) -> None:
        preparing.set()
        await release.wait()
        prepared.append(model.family)

    applied: list[ServedModel] = []
    watcher = ModelWatcher(ask, (str(places["models"]),), "", applied.append, cache=places["cache"],
                           prepare=prepare)
    looking = asyncio.create_task(watcher.look())
    await preparing.wait()
    assert watcher.current.model is None and applied == []  # nothing in force while the warm-up runs
    release.set()
    assert await looking
    assert prepared == ["qwen2-vl"] and watcher.current.model is not None
    assert applied[-1].model is watcher.current.model


async def test_a_lora_adapter_keeps_the_base_models_geometry(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path]) -> None:
    folder = qwen_folder(places["models"] / "qwen")
    upstream.route("/v1/models", _answering(_vllm_models("qwen", str(folder), adapters=("sql-lora",))))
    proxy = await start_proxy(upstream.url, MMGATE_MODEL_DIRS=str(places["models"]))
    found = await _found(proxy.app, lambda now: now.model is not None)
    assert found.served is not None and found.served.adapters == {"sql-lora"} and found.served.serves("sql-lora")
    assert await _sent_image(proxy.url, upstream, model="sql-lora") == await _sent_image(proxy.url, upstream, "qwen")


async def test_a_model_the_upstream_does_not_serve_is_forwarded_untouched(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path]) -> None:
    """Not the served model, nor an adapter of it: the upstream's to answer, with no geometry of another model."""
    folder = qwen_folder(places["models"] / "qwen")
    served = "org/" + "q" * 100  # past the skeleton's literal strings: the request's name read through its placeholder
    upstream.route("/v1/models", _answering(_vllm_models(served, str(folder), adapters=("sql-lora",))))
    proxy = await start_proxy(upstream.url, MMGATE_MODEL_DIRS=str(places["models"]))
    found = await _found(proxy.app, lambda now: now.model is not None)
    assert (await _sent_image(proxy.url, upstream, served))[0] == _resized(found) != WIDE
    assert (await _sent_image(proxy.url, upstream, "sql-lora"))[0] == _resized(found)
    assert (await _sent_image(proxy.url, upstream, "another-model"))[0] == WIDE
    assert (await _sent_image(proxy.url, upstream, served + "x"))[0] == WIDE


async def test_the_servers_processor_kwargs_set_the_geometry(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path]) -> None:
    folder = qwen_folder(places["models"] / "qwen")
    upstream.route("/v1/models", _answering(_vllm_models("qwen", str(folder))))
    proxy = await start_proxy(upstream.url, MMGATE_MODEL_DIRS=str(places["models"]),
                              MMGATE_MM_PROCESSOR_KWARGS=json.dumps({"max_pixels": 256 * 28 * 28}))
    found = await _found(proxy.app, lambda now: now.model is not None)
    assert found.model is not None and found.model.geometry.max_pixels == 256 * 28 * 28  # type: ignore[union-attr]
    size, _tokens = await _sent_image(proxy.url, upstream, "qwen")
    assert size[0] * size[1] <= 256 * 28 * 28 and size == _resized(found)
    explicit = build_state(Settings.from_env({"MMGATE_UPSTREAM": upstream.url, "MMGATE_MODEL": str(folder),
                                              "MMGATE_MM_PROCESSOR_KWARGS": '{"max_pixels": 200704}'}))
    assert explicit.model is not None and explicit.model.geometry.max_pixels == 200704  # type: ignore[union-attr]


async def test_the_upstream_restarting_with_another_model_brings_its_geometry(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path]) -> None:
    qwen = qwen_folder(places["models"] / "qwen")
    idefics3 = idefics3_folder(places["models"] / "idefics3")
    upstream.route("/v1/models", _answering(_vllm_models("qwen", str(qwen))))
    proxy = await start_proxy(upstream.url, MMGATE_MODEL_DIRS=str(places["models"]))
    first = await _found(proxy.app, lambda now: now.model is not None)
    assert (await _sent_image(proxy.url, upstream, "qwen"))[0] == _resized(first)
    assert upstream.server is not None
    port = upstream.server.port
    await upstream.server.close()  # the server restarts: a request meanwhile finds it down
    response = await _post(proxy.url, chat_with_image(data_uri(_png(*WIDE))))
    assert response.status == 503  # upstream_down, as for every request while the backend cannot be reached
    assert proxy.state.upstream.down and proxy.state.model is None  # no old geometry once it went away
    upstream.route("/v1/models", _answering(_vllm_models("idefics3", str(idefics3))))
    app = web.Application(client_max_size=1 << 30, handler_args={"auto_decompress": False})
    app.router.add_route("*", "/{tail:.*}", upstream._dispatch)
    upstream.server = TestServer(app, host="127.0.0.1", port=port)
    await upstream.server.start_server()
    found = await _found(proxy.app, lambda now: now.model is not None)
    assert found.model is not None and found.model.family == "idefics3"
    assert _resized(found) != _resized(first)
    assert await _sent_image(proxy.url, upstream, "idefics3") == (_resized(found), str(found.model.image_tokens(*WIDE)))


# ---------------------------------------------------------------------------------------------------------
# Not found, refused, off


async def test_a_model_not_found_keeps_the_generic_rule_with_a_line_saying_where_and_what_fixes_it(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path],
        caplog: pytest.LogCaptureFixture) -> None:
    upstream.route("/v1/models", _answering(_vllm_models("org/absent", "org/absent")))
    with caplog.at_level(logging.INFO, logger="mmgate"):
        proxy = await start_proxy(upstream.url, MMGATE_MODEL_DIRS=str(places["models"]))
        found = await _found(proxy.app, lambda now: now.served is not None)
    assert found.model is None
    line = next(record.getMessage() for record in caplog.records if "org/absent" in record.getMessage())
    assert str(places["cache"]) in line and str(places["models"]) in line and "MMGATE_MODEL_DIRS" in line
    assert await _sent_image(proxy.url, upstream, "m") == (WIDE, None)


def _outside_model(places: dict[str, Path]) -> Path:
    return qwen_folder(places["outside"] / "qwen")


_LIES: dict[str, Callable[[dict[str, Path]], str]] = {
    "a folder outside": lambda places: str(_outside_model(places)),
    "a path with ..": lambda places: f"{places['models']}/../outside/qwen",
    "a symlinked folder out": lambda places: str(_link(places["models"] / "link", _outside_model(places))),
    "a symlinked file out": lambda places: str(_linked_config(places)),
}


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def _linked_config(places: dict[str, Path]) -> Path:
    """A folder inside MMGATE_MODEL_DIRS whose processor configuration is a link to one outside."""
    outside = _outside_model(places)
    inside = places["models"] / "inside"
    inside.mkdir()
    for file in outside.iterdir():
        (inside / file.name).symlink_to(file)
    return inside


@pytest.mark.parametrize("lie", sorted(_LIES))
async def test_a_root_outside_the_model_folders_is_refused_and_never_read(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path], caplog: pytest.LogCaptureFixture,
        lie: str) -> None:
    root = _LIES[lie](places)
    upstream.route("/v1/models", _answering(_vllm_models("qwen", root)))
    with caplog.at_level(logging.WARNING, logger="mmgate"):
        proxy = await start_proxy(upstream.url, MMGATE_MODEL_DIRS=str(places["models"]))
        found = await _found(proxy.app, lambda now: now.served is not None)
    assert found.model is None and "refused to read" in found.note
    assert "refused to read" in caplog.text
    assert await _sent_image(proxy.url, upstream, "m") == (WIDE, None)


async def _slow(_request: web.Request) -> web.Response:
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


async def _huge(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    await response.write(b'{"object":"list","data":[' + b" " * (2 << 20) + b"]}")
    return response


async def _not_json(_request: web.Request) -> web.Response:
    return web.Response(text="<html>models</html>")


_BAD_ANSWERS = {"slow": (_slow, "did not answer"), "huge": (_huge, "more than"), "not json": (_not_json, "no JSON"),
                "no data": (_answering({"models": ["qwen"]}), "no \"data\" list"),
                "no model": (_answering({"data": [{"id": 7}, "x", None]}), "lists no model")}


@pytest.mark.parametrize("answer", sorted(_BAD_ANSWERS))
async def test_a_bad_answer_keeps_the_generic_rule_and_mmgate_serving(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        answer: str) -> None:
    handler, said = _BAD_ANSWERS[answer]
    monkeypatch.setattr(discovery, "ANSWER_TIMEOUT", 0.5)  # the slow answer's deadline, not waited for in full
    upstream.route("/v1/models", handler)
    proxy = await start_proxy(upstream.url, MMGATE_MODEL_DIRS=str(places["models"]))
    async with aiohttp.ClientSession() as client, client.get(proxy.url + "/mmgate/ready") as response:
        assert response.status == 200  # readiness never waits on the lookup
    found = await _watcher(proxy.app).wait_for(1)
    assert found.model is None and "refused the upstream's answer" in found.note and said in found.note
    assert await _sent_image(proxy.url, upstream, "m") == (WIDE, None)


async def test_none_turns_the_model_mode_off(
        upstream: Upstream, start_proxy: StartProxy, places: dict[str, Path]) -> None:
    folder = qwen_folder(places["models"] / "qwen")
    upstream.route("/v1/models", _answering(_vllm_models("qwen", str(folder))))
    proxy = await start_proxy(upstream.url, MMGATE_MODEL="none", MMGATE_MODEL_DIRS=str(places["models"]))
    assert MODEL_WATCHER not in proxy.app and proxy.state.served.mode == "none"
    assert await _sent_image(proxy.url, upstream, "m") == (WIDE, None)
    with pytest.raises(ConfigError, match="MMGATE_MODEL=none"):
        build_state(Settings.from_env({"MMGATE_UPSTREAM": upstream.url, "MMGATE_MODEL": "none",
                                       "MMGATE_MAX_INFLIGHT_IMAGE_TOKENS": "1000"}))


def test_an_explicit_folder_still_stops_start_up_when_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such folder"):
        build_state(Settings.from_env({"MMGATE_UPSTREAM": "http://127.0.0.1:9",
                                       "MMGATE_MODEL": str(tmp_path / "absent")}))
    assert Settings.from_env({}).decode.model == "auto" and Settings.from_env({"MMGATE_MODEL": "None"}).decode.model \
        == "none"
    with pytest.raises(ConfigError, match="MMGATE_MM_PROCESSOR_KWARGS"):
        Settings.from_env({"MMGATE_MM_PROCESSOR_KWARGS": "[1]"})
    with pytest.raises(ConfigError, match="MMGATE_MODEL_DIRS"):
        Settings.from_env({"MMGATE_MODEL_DIRS": "models"})


async def test_print_config_names_the_model_the_upstream_serves(upstream: Upstream, places: dict[str, Path]) -> None:
    folder = qwen_folder(places["models"] / "qwen")
    upstream.route("/v1/models", _answering(_vllm_models("qwen", str(folder))))
    env = {**os.environ, "MMGATE_UPSTREAM": upstream.url, "MMGATE_MODEL_DIRS": str(places["models"])}
    child = await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy", "--print-config", env=env,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await child.communicate()
    assert child.returncode == 0, err.decode()
    line = next(line for line in out.decode().splitlines() if line.startswith("# served model:"))
    assert "model qwen2-vl (QwenVL(" in line and str(folder) in line


async def test_print_config_names_the_setting_that_fixes_a_silent_upstream(places: dict[str, Path]) -> None:
    """An upstream that does not answer (its port closed): the generic rule, why, and what to set meanwhile."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = {**os.environ, "MMGATE_UPSTREAM": f"http://127.0.0.1:{port}", "MMGATE_MODEL_DIRS": str(places["models"])}
    child = await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy", "--print-config", env=env,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await child.communicate()
    assert child.returncode == 0, err.decode()
    line = next(line for line in out.decode().splitlines() if line.startswith("# served model:"))
    assert "the generic rule" in line and "did not answer GET /v1/models" in line
    assert "fix: " + discovery.FIXES["upstream_silent"] in line
    said = (out + err).decode()
    assert said.count("did not answer GET /v1/models") == 1, said  # said once: not by the watcher's log too


# ---------------------------------------------------------------------------------------------------------
# Whatever the answer says


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["data", "id", "root", "parent", "object", "model_id"]), inner, max_size=4),
                    max_leaves=20))
def test_any_json_answer_is_a_model_or_a_refusal(answer: Any) -> None:
    for parse in (discovery._from_models, discovery._from_info):
        try:
            served = parse(answer)
        except AnswerError:
            continue
        assert served.name and served.root


_PARTS = st.sampled_from(["..", ".", "qwen", "outside", "models", "link", "", "hub", "~", "etc", "x/../.."])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_PARTS, max_size=6), absolute=st.booleans())
def test_no_root_leads_outside_the_model_folders(places: dict[str, Path], parts: list[str], absolute: bool) -> None:
    if not (places["outside"] / "qwen").exists():
        _outside_model(places)
        (places["models"] / "link").symlink_to(places["outside"])
        qwen_folder(places["models"] / "qwen")
    root = (str(places["models"].parent) + "/" if absolute else "") + "/".join(parts)
    try:
        folder = locate(Served("m", root), [str(places["models"])], places["cache"])
    except (Refused, LookupError):
        return
    real = Path(os.path.realpath(folder))
    assert places["models"].resolve() in real.parents or places["cache"].resolve() in real.parents
    for file in real.iterdir():
        assert places["outside"].resolve() not in Path(os.path.realpath(file)).parents
