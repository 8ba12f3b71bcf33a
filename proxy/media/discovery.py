"""``MMGATE_MODEL=auto``: the served model, found by asking the upstream which one it serves.

The upstream is asked ``GET /v1/models`` (vLLM, SGLang and llama.cpp answer it; vLLM's ``root`` holds the path
or Hub id it loaded, and LoRA adapters are entries whose ``parent`` is the base), or TGI's ``GET /info``
(``model_id``) where that route is missing. The answer is bounded (``ANSWER_TIMEOUT``, ``MAX_ANSWER_BYTES``)
and checked before anything is looked up. The model's processor files are then looked for, never downloaded,
in two places only: the Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub, the hub's snapshot layout)
and the folders of ``MMGATE_MODEL_DIRS``. A path is used only when it lies inside one of them once every
symlink is resolved, with no ``..`` in it, and only when every file of the model folder resolves inside that
place too: whatever the upstream says, mmgate reads no file outside them.

``MMGATE_MM_PROCESSOR_KWARGS`` (the server's ``--mm-processor-kwargs``) is written onto the model's image
processor configuration in a folder of mmgate's own (the other files linked), so the processor mmgate loads
makes the geometry the server uses.

``ServedModel`` is what is in force and why: the model (or None, the generic rule), the family and geometry
named in the start-up log, ``/mmgate/stats`` and ``--print-config``. ``watch`` keeps it current: it looks at
start-up, again whenever the upstream comes back after being down (``WatchedUpstream``), and again every
``RECHECK_SECONDS`` (a server still downloading its model, a restart no request saw). Until a model is found,
and while the upstream is down, the generic rule applies: requests never get an old model's geometry once the
upstream went away, and mmgate never stops serving for want of a model.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.edge.upstream_health import UpstreamHealth
from proxy.media.model import Model
from proxy.media.model_folder import load_model
from proxy.settings import ConfigError

log = logging.getLogger("mmgate")

AUTO = "auto"  # MMGATE_MODEL's default: ask the upstream
NONE = "none"  # MMGATE_MODEL=none: the model mode is off
ANSWER_TIMEOUT = 5.0  # seconds for the upstream's whole answer to /v1/models
MAX_ANSWER_BYTES = 1 << 20  # a longer answer is refused, unread past this
RECHECK_SECONDS = 30.0  # how often the upstream is asked again while it is up
RETRY_SECONDS = 2.0  # how soon it is asked again when the answer did not come
MAX_FOLDER_ENTRIES = 10_000  # a model folder with more entries is not checked, and not used
MAX_NAME_CHARS = 1024
# The user agent of mmgate's own upstream checks (``routes.PROBE_USER_AGENT``): a check, not client traffic.
CHECK_USER_AGENT = "mmgate-upstream-check"
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_REVISION = re.compile(r"[\w.-]{1,128}")
FIX_HINT = ("set MMGATE_MODEL_DIRS to the folder the server loads its model from (mounted read-only), mount the "
            "Hugging Face cache and set HF_HOME, or set MMGATE_MODEL to the model's folder")


@dataclass(frozen=True, slots=True)
class Served:
    """What the upstream says it serves: the served name, the path or Hub id it loaded (``root``; the name
    where the server does not say), and the names of its adapters (LoRA)."""

    name: str
    root: str
    adapters: frozenset[str] = frozenset()

    def serves(self, requested: str) -> bool:
        """Whether a request's ``model`` field names this model or one of its adapters."""
        return requested in (self.name, self.root) or requested in self.adapters


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model in force and why: ``model`` None is the generic rule, and ``note`` says why no model is."""

    mode: str  # "auto", "none" or "explicit" (MMGATE_MODEL names the model)
    model: Model | None = None
    served: Served | None = None
    folder: str = ""
    note: str = ""
    reason: str = ""  # why no model is, as a key of ``FIXES`` ("" where a model is in force)

    @classmethod
    def at_start(cls, spec: str, model: Model | None) -> ServedModel:
        """What is in force at start-up for MMGATE_MODEL=``spec``, and ``model`` loaded from it."""
        if spec == AUTO:
            return cls(AUTO, note="the upstream has not been asked yet", reason="not_asked")
        if spec == NONE:
            return cls(NONE, note="MMGATE_MODEL=none turns the model mode off", reason="off")
        if model is not None:
            return cls("explicit", model, folder=spec)
        return cls("explicit", folder=spec, note=f"MMGATE_MODEL={spec}: its family has no model geometry in mmgate",
                   reason="unsupported")

    def describe(self) -> dict[str, Any]:
        """The JSON /mmgate/stats shows under ``served_model`` (and the dashboard draws): ``reason`` and ``fix``
        (the setting that fixes it) are None where a model is in force."""
        model = self.model
        reason = (self.reason or None) if model is None else None
        return {"mode": self.mode, "family": model.family if model is not None else None,
                "geometry": geometry_text(model), "served": self.served.name if self.served else None,
                "root": self.served.root if self.served else None, "folder": self.folder or None,
                "note": self.note, "reason": reason, "fix": FIXES.get(reason or "")}

    def line(self) -> str:
        """One line for the log and ``--print-config``."""
        if self.model is not None:
            where = f" from {self.folder}" if self.folder else ""
            return f"model {self.model.family} ({geometry_text(self.model)}){where}"
        fix = FIXES.get(self.reason, "")
        said = f"{self.note}; fix: {fix}" if fix and fix not in self.note else self.note
        return f"no model geometry, the generic rule (MMGATE_RESIZE_MAX_*): {said}"


# Why no model is in force (``ServedModel.reason``), and what fixes it.
FIXES = {
    "not_asked": "nothing yet: the upstream is asked once mmgate has started",
    "off": "MMGATE_MODEL=auto (the default) finds the model the upstream serves",
    "upstream_silent": "start the upstream (it is asked again until it answers), or set MMGATE_MODEL to the "
                       "model's folder",
    "upstream_down": "nothing: the upstream is asked again once it answers",
    "answer_refused": "set MMGATE_MODEL to the model's folder, where the upstream cannot name it",
    "refused": "mount the model's folder inside MMGATE_MODEL_DIRS or the Hugging Face cache (HF_HOME), or set "
               "MMGATE_MODEL to the model's folder",
    "not_found": FIX_HINT,
    "not_loadable": "set MMGATE_MODEL to a folder whose processor files transformers reads",
    "unsupported": "none in mmgate: the generic rule applies (MMGATE_RESIZE_MAX_PIXELS, MMGATE_RESIZE_MAX_SIDE)",
}


def geometry_text(model: Model | None) -> str | None:
    """The geometry in force, as its fields say it (``QwenVL(family='qwen2-vl', patch_size=14, ...)``)."""
    return repr(model.geometry) if model is not None and model.geometry is not None else None


class AnswerError(Exception):
    """The upstream's answer could not be used; the message says what was refused."""


# ---------------------------------------------------------------------------------------------------------
# Asking the upstream


async def ask_upstream(session: aiohttp.ClientSession, upstream: str) -> Served:
    """What the upstream serves, from ``/v1/models`` or (where that route is missing) TGI's ``/info``;
    AnswerError for an answer that is slow, huge, malformed or names nothing, aiohttp.ClientError where none
    came."""
    status, body = await _get(session, upstream + "/v1/models")
    if status == 404:
        status, body = await _get(session, upstream + "/info")
        if status != 200:
            raise AnswerError(f"GET /v1/models and /info answered 404 and {status}")
        return _from_info(_json(body, "/info"))
    if status != 200:
        raise AnswerError(f"GET /v1/models answered {status}")
    return _from_models(_json(body, "/v1/models"))


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT)
    headers = {"User-Agent": CHECK_USER_AGENT, "Accept": "application/json", "Accept-Encoding": "identity"}
    try:
        async with session.get(url, timeout=timeout, headers=headers, allow_redirects=False) as response:
            if response.headers.get("Content-Encoding", "identity").lower() != "identity":
                raise AnswerError(f"{response.url.path} answered {response.headers['Content-Encoding']}-encoded")
            if (response.content_length or 0) > MAX_ANSWER_BYTES:
                raise AnswerError(f"{response.url.path} announced {response.content_length} bytes "
                                  f"(at most {MAX_ANSWER_BYTES} are read)")
            body = await response.content.read(MAX_ANSWER_BYTES + 1)
            while len(body) <= MAX_ANSWER_BYTES and not response.content.at_eof():
                more = await response.content.read(MAX_ANSWER_BYTES + 1 - len(body))
                if not more:
                    break
                body += more
            if len(body) > MAX_ANSWER_BYTES:
                raise AnswerError(f"{response.url.path} answered more than {MAX_ANSWER_BYTES} bytes")
            return response.status, body
    except TimeoutError:
        raise AnswerError(f"{url.rsplit('/', 1)[-1]} did not answer within {ANSWER_TIMEOUT:g} s") from None


def _json(body: bytes, route: str) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise AnswerError(f"{route} answered no JSON") from None


def _name(value: Any) -> str | None:
    """A model name or path as the answer gives it, or None where it is no usable string."""
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS or "\x00" in value:
        return None
    return value


def _from_models(answer: Any) -> Served:
    """vLLM's (and SGLang's, llama.cpp's) list: the first entry without a parent is the base model; entries
    whose parent it is are its adapters."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise AnswerError("/v1/models answered no \"data\" list")
    entries = [entry for entry in data if isinstance(entry, dict) and _name(entry.get("id"))]
    bases = [entry for entry in entries if entry.get("parent") is None]
    if not bases:
        raise AnswerError("/v1/models lists no model")
    base = bases[0]
    name = str(base["id"])
    adapters = frozenset(str(entry["id"]) for entry in entries if entry.get("parent") in (name, base.get("root")))
    return Served(name, _name(base.get("root")) or name, adapters)


def _from_info(answer: Any) -> Served:
    name = _name(answer.get("model_id")) if isinstance(answer, dict) else None
    if name is None:
        raise AnswerError("/info answered no \"model_id\"")
    return Served(name, name)


# ---------------------------------------------------------------------------------------------------------
# Looking for its files


def hub_cache(environ: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """Where the Hugging Face hub keeps its cache, as huggingface_hub reads the environment."""
    named = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
    if named:
        return Path(named).expanduser()
    home = environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    return Path(environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface" / "hub"


class Refused(Exception):
    """A place the upstream named that mmgate will not read; the message says what and why."""


def _inside(path: Path, place: Path) -> bool:
    return path == place or place in path.parents


def _checked_folder(folder: Path, place: Path) -> Path:
    """``folder`` once every one of its files is known to resolve inside ``place`` (both resolved)."""
    try:
        entries = list(os.scandir(folder))
    except OSError as error:
        raise Refused(f"{folder} cannot be listed ({error.strerror})") from None
    if len(entries) > MAX_FOLDER_ENTRIES:
        raise Refused(f"{folder} holds more than {MAX_FOLDER_ENTRIES} entries")
    for entry in entries:
        target = Path(os.path.realpath(entry.path))
        if not _inside(target, place):
            raise Refused(f"{entry.path} links outside {place}")
    if not any((folder / name).is_file() for name in _PROCESSOR_FILES):
        raise Refused(f"{folder} has no {' or '.join(_PROCESSOR_FILES)}")
    return folder


def _in_places(path: Path, places: Iterable[Path]) -> Path:
    """An absolute path the upstream named, used only inside one of ``places`` once resolved."""
    if ".." in path.parts:
        raise Refused(f"{path} has '..' in it")
    real = Path(os.path.realpath(path))
    for place in places:
        real_place = Path(os.path.realpath(place))
        if _inside(real, real_place):
            if not real.is_dir():
                raise Refused(f"{path} is not a folder")
            return _checked_folder(real, real_place)
    raise Refused(f"{path} lies outside MMGATE_MODEL_DIRS and the Hugging Face cache")


def _in_hub_cache(name: str, cache: Path) -> Path | None:
    """The snapshot of Hub model ``name`` in the cache (``refs/main``, else its only snapshot); None if absent."""
    repo = cache / ("models--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        revision = ""
    if revision and _REVISION.fullmatch(revision) and (snapshots / revision).is_dir():
        chosen = snapshots / revision
    else:
        found = [entry for entry in snapshots.iterdir() if entry.is_dir()][:2]
        if len(found) != 1:
            return None
        chosen = found[0]
    real_repo = Path(os.path.realpath(repo))
    real = Path(os.path.realpath(chosen))
    if not _inside(real, real_repo):
        raise Refused(f"{chosen} links outside {repo}")
    return _checked_folder(real, real_repo)


def locate(served: Served, model_dirs: Iterable[str], cache: Path) -> Path:
    """The folder of ``served``'s processor files: its ``root`` (else name) as a path inside
    ``model_dirs`` or the cache, or as a Hub id in the cache or under a folder of ``model_dirs``. Refused
    names what was not used and why; LookupError says what was looked for, where."""
    dirs = [Path(d).expanduser() for d in model_dirs]
    refusals: list[str] = []
    for wanted in dict.fromkeys((served.root, served.name)):
        try:
            if wanted.startswith("/"):
                return _in_places(Path(wanted), [*dirs, cache])
            if not _HUB_NAME.fullmatch(wanted) or ".." in wanted.split("/"):
                raise Refused(f"{wanted!r} is neither an absolute path nor a Hub id")
            found = _in_hub_cache(wanted, cache)
            if found is not None:
                return found
            for place in dirs:
                for candidate in (place / wanted, place / wanted.rsplit("/", 1)[-1]):
                    if candidate.is_dir():
                        return _in_places(candidate, [place])
        except Refused as refusal:
            refusals.append(str(refusal))
    if refusals:
        raise Refused("; ".join(refusals))
    where = ", ".join([str(cache), *map(str, dirs)]) if dirs else f"{cache} (MMGATE_MODEL_DIRS is not set)"
    raise LookupError(f"{served.root!r} is in none of {where}")


# ---------------------------------------------------------------------------------------------------------
# The server's overrides, and loading


@functools.cache
def with_overrides(folder: Path, overrides: str) -> Path:
    """``folder`` with ``overrides`` (a JSON object) written onto its image processor configuration: a folder
    of mmgate's own whose other files are links to ``folder``'s, made once per process and removed at exit."""
    keys = json.loads(overrides)
    overlay = Path(tempfile.mkdtemp(prefix="mmgate-model-"))
    atexit.register(shutil.rmtree, overlay, True)
    for entry in folder.iterdir():
        if entry.name not in _PROCESSOR_FILES:
            (overlay / entry.name).symlink_to(entry.resolve())
            continue
        config = json.loads(entry.read_text())
        nested = config.get("image_processor") if isinstance(config, dict) else None
        target = nested if isinstance(nested, dict) else config
        if isinstance(target, dict) and (nested is not None or entry.name == _PROCESSOR_FILES[0]):
            target.update(keys)
        (overlay / entry.name).write_text(json.dumps(config))
    return overlay


def explicit_folder(spec: str, overrides: str) -> Path:
    """MMGATE_MODEL's folder (or its cached name's snapshot) with the server's overrides written onto it; the
    spec as it is where neither is found (``load_model`` then says what is missing)."""
    folder = Path(spec).expanduser()
    if not folder.is_dir() and _HUB_NAME.fullmatch(spec):
        folder = _in_hub_cache(spec, hub_cache()) or folder
    return with_overrides(folder.resolve(), overrides) if folder.is_dir() else Path(spec)


def load(folder: Path, name: str, overrides: str) -> Model:
    """The model in ``folder`` (``load_model``), with the server's overrides, named ``name``."""
    spec = with_overrides(folder, overrides) if overrides else folder
    return replace(load_model(str(spec)), name=name)


# ---------------------------------------------------------------------------------------------------------
# Keeping it current


class WatchedUpstream(UpstreamHealth):
    """``UpstreamHealth`` that also says when the upstream went down and when it came back."""

    def __init__(self, upstream: str, health_path: str) -> None:
        super().__init__(upstream, health_path)
        self.on_down: Callable[[], None] = lambda: None
        self.on_back: Callable[[], None] = lambda: None

    def reached(self) -> None:
        was_down = self.down
        super().reached()
        if was_down:
            self.on_back()

    def unreachable(self, reason: str) -> None:
        was_down = self.down
        super().unreachable(reason)
        if not was_down:
            self.on_down()


class ModelWatcher:
    """Finds the served model (``MMGATE_MODEL=auto``) and puts it in force with ``apply``; see the module's
    docstring for when it looks."""

    def __init__(self, ask: Callable[[], Awaitable[Served]], model_dirs: tuple[str, ...], overrides: str,
                 apply: Callable[[ServedModel], None], cache: Path | None = None,
                 prepare: Callable[[Model], Awaitable[None]] | None = None) -> None:
        self._ask, self._dirs, self._overrides, self._apply = ask, model_dirs, overrides, apply
        self._prepare = prepare  # runs before a found model is put in force (the decode code warmed for it)
        self._cache = cache
        self._wake = asyncio.Event()
        self._looked = asyncio.Condition()
        self.current = ServedModel(AUTO, note="the upstream has not been asked yet", reason="not_asked")
        self.lookups = 0

    def upstream_down(self) -> None:
        """The upstream went away: the generic rule until it answers again and says what it serves."""
        if self.current.model is not None:
            self._put(ServedModel(AUTO, note="the upstream is down; it is asked again once it answers",
                                  reason="upstream_down"))

    def upstream_back(self) -> None:
        self._wake.set()

    async def wait_for(self, lookups: int) -> ServedModel:
        """What is in force once ``lookups`` lookups have ended (tests and tools await it; nothing else does)."""
        async with self._looked:
            await self._looked.wait_for(lambda: self.lookups >= lookups)
        return self.current

    async def run(self) -> None:
        """Look, then again when woken (the upstream came back) or after a while; runs until cancelled."""
        while True:
            answered = await self.look()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), RECHECK_SECONDS if answered else RETRY_SECONDS)
            except TimeoutError:
                pass

    async def look(self) -> bool:
        """Ask the upstream, look for the model's files and put what is found in force; whether it answered."""
        answered = True
        try:
            found = await self._find()
        except (aiohttp.ClientError, OSError) as error:
            answered = False
            found = ServedModel(AUTO, note=f"the upstream did not answer GET /v1/models ({type(error).__name__}); "
                                           "asked again until it answers", reason="upstream_silent")
        async with self._looked:
            self._put(found)
            self.lookups += 1
            self._looked.notify_all()
        return answered

    async def _find(self) -> ServedModel:
        try:
            served = await self._ask()
        except AnswerError as error:
            return ServedModel(AUTO, note=f"refused the upstream's answer: {error}; MMGATE_MODEL names the model "
                                          "where the upstream cannot", reason="answer_refused")
        cache = self._cache or hub_cache()
        try:
            folder = await asyncio.to_thread(locate, served, self._dirs, cache)
        except Refused as refusal:
            return ServedModel(AUTO, served=served, note=f"the upstream serves {served.root!r}; refused to read: "
                                                         f"{refusal}", reason="refused")
        except LookupError as missing:
            return ServedModel(AUTO, served=served, note=f"the upstream serves {served.name!r}, whose processor "
                                                         f"files were looked for and not found: {missing}; "
                                                         f"{FIX_HINT}", reason="not_found")
        if self.current.model is not None and self.current.folder == str(folder) and self.current.served == served:
            return self.current
        try:
            model = await asyncio.to_thread(load, folder, served.name, self._overrides)
        except ConfigError as error:
            return ServedModel(AUTO, served=served, folder=str(folder), note=f"found {folder}, not usable: {error}",
                               reason="not_loadable")
        except Exception as error:  # a processor transformers cannot read must not stop mmgate serving
            return ServedModel(AUTO, served=served, folder=str(folder),
                               note=f"found {folder}, not loadable ({type(error).__name__}: {str(error)[:200]})",
                               reason="not_loadable")
        if not model.supported:
            return ServedModel(AUTO, served=served, folder=str(folder),
                               note=f"{served.name!r} is a {model.family} model, which has no model geometry in "
                                    "mmgate", reason="unsupported")
        if self._prepare is not None:
            await self._prepare(model)
        return ServedModel(AUTO, model, served, str(folder), f"found in {folder}")

    def _put(self, found: ServedModel) -> None:
        changed = found != self.current
        self.current = found
        self._apply(found)
        if changed:
            if found.model is not None:
                log.info("MMGATE_MODEL=auto: the upstream serves %r: %s", found.served.name if found.served else "",
                         found.line())
            else:
                log.warning("MMGATE_MODEL=auto: %s", found.line())


async def find_once(upstream: str, model_dirs: tuple[str, ...], overrides: str) -> ServedModel:
    """What ``MMGATE_MODEL=auto`` would put in force now (``--print-config``): the upstream asked once. The
    watcher's own log line is held back: the caller prints the answer, which would otherwise show twice."""
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        watcher = ModelWatcher(lambda: ask_upstream(session, upstream), model_dirs, overrides, lambda _found: None)
        was, log.disabled = log.disabled, True
        try:
            await watcher.look()
        finally:
            log.disabled = was
        return watcher.current
