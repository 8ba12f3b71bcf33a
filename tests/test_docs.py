"""docs/ stays true: its snippets run, its pages keep their size, and every reference to the code resolves.

Snippets: every fenced ``bash`` and ``python`` block of every docs/*.md page is run here (``RUN``) or skipped by
its section with the reason stated (``NOT_RUN``); a block in any other section fails
``test_every_docs_snippet_is_run_or_skipped_by_section``. The README's own blocks are tests/test_readme.py's.

References: every dotted name in single backticks in the README and docs/, every dotted name in double
backticks in a docstring of ``REFERENCE_PACKAGES``, every ``python -m X`` of ours (in those texts and in any
string of our code, an argparse ``prog`` included) and every ``path/to/x.py`` (with an optional ``::name``)
must name a module, class, function or attribute of ours. The resolver reads the code with ``ast`` and imports
nothing. A name resolves when its leading segments are a module of ours, written in full (``proxy.media.step``)
or by its last segments (``step``, ``media.step``), or a class of ours, and the rest are, in turn, a submodule,
a module-level name (a package's ``__init__`` counts what it imports), a class member (a method, a property,
a field or class variable, an attribute set on ``self``, inherited ones included), or an attribute of the
class a field is annotated with. Past a module-level variable or an attribute of no known class of ours, the
rest is not checked. ``ALLOWED`` lists the only forms that are not ours, each with its reason.
"""

from __future__ import annotations

import ast
import builtins
import importlib.metadata
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from proxy.serve.demo import free_port
from testkit.snippets import (
    fenced_blocks,
    interrupt,
    port_replacements,
    run_block,
    start_server,
    wait_until_up,
    with_ports,
)

from .test_readme import STUB_ANSWER, require_curl

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_BYTES = 15_000
ARCHITECTURE_MAX_BYTES = 12_000

RUN = {("media.md", "Media URLs")}  # each runs beside the README's stub backend on its port 8000
_NO_ENGINE = "docker, docker compose and kubectl need an engine or a cluster this machine does not have"
NOT_RUN = {
    ("deploy.md", "Container image"): _NO_ENGINE,
    ("deploy.md", "One machine: Docker Compose"): _NO_ENGINE,
    ("deploy.md", "Kubernetes: vLLM with mmgate as a sidecar"): _NO_ENGINE,
    ("fleet.md", "Behind an inference gateway"): _NO_ENGINE,
    ("model.md", "Turn it on"): "installs the model extra from the network and names a model folder this machine "
    "does not have; tests/proxy/media/test_model.py runs the same settings against processor folders it builds",
}

REFERENCE_PACKAGES = ("proxy", "preprocessors", "testkit", "bench", "demo")
OURS = (*REFERENCE_PACKAGES, "tests")
# The only names in backticks that are not ours and not recognisably another module's, each for its reason.
ALLOWED = {
    "file names (the last segment is an extension other than py): files, not code":
        ("json", "md", "yaml", "yml", "toml", "txt", "html", "png", "jpg", "sh", "cfg", "mp4", "so", "whl"),
    "logger names: mmgate's loggers are named, not modules": ("mmgate",),
    "modules of tools installed outside this venv (the real vLLM's own venv)": ("vllm",),
    "transformers' processor classes, whose rules the served model's geometry follows":
        ("LlavaNextProcessor", "Qwen2VLVideoProcessor"),
    "a host name of the deploy examples": ("host.docker.internal",),
    "an instance of asyncio's transport, named in a module docstring": ("transport.pause_reading",),
    "example paths in the description of a format": ("path/to/file.py", "pkg/file.py"),
}
# Instance names the docs use for one object of ours, resolved through its class.
INSTANCES = {"settings": "Settings", "state": "AppState"}

DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
DOUBLE_SPAN = re.compile(r"``(.+?)``", re.DOTALL)
PYTHON_M = re.compile(r"python3? -m\s+([A-Za-z_][\w.<>]*\w)")
PY_PATH = re.compile(r"(?<![\w./<>-])((?:\.\./)*[A-Za-z_][\w.-]*(?:/[\w.-]+)+\.py)(?:::?([A-Za-z_]\w*))?")


# ---------------------------------------------------------------------------------------------- the index


@dataclass
class ClassInfo:
    module: str
    name: str
    members: dict[str, str | None] = field(default_factory=dict)  # member -> the class its annotation names
    methods: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class ModuleInfo:
    name: str
    path: Path
    is_package: bool
    names: set[str] = field(default_factory=set)
    reexports: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (module, name there)
    classes: dict[str, ClassInfo] = field(default_factory=dict)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements at module or class level, including those under an ``if`` or ``try``."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try)):
            yield from top_statements(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                yield from top_statements(handler.body)
        else:
            yield node


def imported_from(node: ast.ImportFrom, module: str, *, is_package: bool) -> str:
    """The absolute name of the module ``from X import ...`` reads, relative imports included."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    package = package[: len(package) - node.level + (1 if is_package else 0)]
    return ".".join([*package, node.module] if node.module else package)


def annotation_class(node: ast.expr | None) -> str | None:
    """The first plain name in an annotation (``Limits``, ``Limits | None``, ``"Limits"``)."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id not in ("Optional", "None", "ClassVar", "Final"):
            return sub.id
    return None


def assigned_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def class_info(module: str, node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(module, node.name, bases=[b for b in map(annotation_class, node.bases) if b])
    for stmt in top_statements(node.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = {d.id for d in stmt.decorator_list if isinstance(d, ast.Name)}
            if decorators & {"property", "cached_property"}:
                info.members[stmt.name] = annotation_class(stmt.returns)
            else:
                info.methods.add(stmt.name)
            for sub in ast.walk(stmt):  # self.x = ... / self.x: T = ...
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] \
                    if isinstance(sub, ast.AnnAssign) else []
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id == "self":
                        kind = annotation_class(sub.annotation) if isinstance(sub, ast.AnnAssign) else None
                        info.members.setdefault(target.attr, kind)
        elif isinstance(stmt, ast.ClassDef):
            info.members[stmt.name] = stmt.name
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            info.members[stmt.target.id] = annotation_class(stmt.annotation)
        else:
            for name in assigned_names(stmt):
                info.members.setdefault(name, None)
    return info


@cache
def index() -> dict[str, ModuleInfo]:
    modules: dict[str, ModuleInfo] = {}
    for package in OURS:
        for path in sorted((REPO / package).rglob("*.py")):
            name = module_name(path)
            info = ModuleInfo(name, path, path.name == "__init__.py")
            tree = ast.parse(path.read_text())
            for stmt in top_statements(tree.body):
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    info.names.add(stmt.name)
                elif isinstance(stmt, ast.ClassDef):
                    info.names.add(stmt.name)
                    info.classes[stmt.name] = class_info(name, stmt)
                elif isinstance(stmt, ast.ImportFrom) and info.is_package:
                    source = imported_from(stmt, name, is_package=True)
                    for alias in stmt.names:
                        info.reexports[alias.asname or alias.name] = (source, alias.name)
                else:
                    info.names.update(assigned_names(stmt))
            modules[name] = info
    return modules


@cache
def classes_named(name: str) -> tuple[ClassInfo, ...]:
    return tuple(m.classes[name] for m in index().values() if name in m.classes)


@cache
def modules_ending_with(parts: tuple[str, ...]) -> tuple[ModuleInfo, ...]:
    return tuple(m for m in index().values() if tuple(m.name.split("."))[-len(parts):] == parts)


def class_member(cls: ClassInfo, name: str, seen: frozenset[str] = frozenset()) -> tuple[bool, str | None, bool]:
    """(found, the class its annotation names, whether it is a method), looking in the bases too."""
    if name in cls.members:
        return True, cls.members[name], False
    if name in cls.methods:
        return True, None, True
    for base in cls.bases:
        for parent in classes_named(base):
            if parent.name not in seen:
                found = class_member(parent, name, seen | {cls.name})
                if found[0]:
                    return found
    return False, None, False


def resolves_in_class(cls: ClassInfo, rest: list[str]) -> bool:
    if not rest:
        return True
    found, kind, is_method = class_member(cls, rest[0])
    if not found:
        return False
    if len(rest) == 1:
        return True
    if is_method:
        return False
    if kind is None or not classes_named(kind):
        return True  # an attribute of no known class of ours: the rest is not checked
    return any(resolves_in_class(c, rest[1:]) for c in classes_named(kind))


def resolves_in_module(module: ModuleInfo, rest: list[str]) -> bool:
    if not rest:
        return True
    head, tail = rest[0], rest[1:]
    submodule = index().get(f"{module.name}.{head}")
    if module.is_package and submodule is not None and resolves_in_module(submodule, tail):
        return True
    if head in module.classes:
        return resolves_in_class(module.classes[head], tail)
    if head in module.reexports:
        source, name = module.reexports[head]
        target = index().get(source)
        return target is not None and resolves_in_module(target, [name, *tail])
    return head in module.names  # a function (nothing past it) or a variable (the rest not checked)


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[-1] == "py":  # a file named in backticks: one of ours, by its last path segments
        return bool(files_ending_with(dotted.replace(".", "/")[:-3] + ".py"))
    for end in range(len(parts), 0, -1):
        if any(resolves_in_module(m, parts[end:]) for m in modules_ending_with(tuple(parts[:end]))):
            return True
    first = INSTANCES.get(parts[0], parts[0])
    return any(resolves_in_class(cls, parts[1:]) for cls in classes_named(first))


@cache
def not_ours() -> frozenset[str]:
    """Top-level names of the standard library, of installed distributions and of builtins."""
    installed = set(importlib.metadata.packages_distributions())
    return frozenset((set(sys.stdlib_module_names) | installed | set(dir(builtins))) - set(OURS))


def allowed(dotted: str) -> bool:
    parts = dotted.split(".")
    extensions, loggers, elsewhere, processors, hosts, instances, _ = ALLOWED.values()
    return (parts[-1] in extensions or parts[0] in loggers + elsewhere + processors or dotted in hosts + instances
            or parts[0] in not_ours())


def python_module_exists(name: str) -> bool:
    if name.split(".")[0] not in OURS or "<" in name:
        return True  # another tool's module (pytest, pip, http.server): not ours to check
    module = index().get(name)
    return module is not None and (not module.is_package or (module.path.parent / "__main__.py").is_file())


@cache
def repository_files() -> tuple[str, ...]:
    return tuple(str(p.relative_to(REPO)) for package in OURS for p in (REPO / package).rglob("*.py"))


@cache
def files_ending_with(path: str) -> tuple[str, ...]:
    return tuple(f for f in repository_files() if f == path or f.endswith("/" + path))


def path_exists(path: str, name: str | None, base: Path) -> bool:
    """A path from the repository's root, from the page (``../``), or the last segments of a file of ours."""
    if path in ALLOWED["example paths in the description of a format"]:
        return True
    if path.startswith("../"):
        candidates = [(base / path).resolve()]
    else:
        candidates = [REPO / path, *(REPO / f for f in files_ending_with(path))]
    found = [c for c in candidates if c.is_file()]
    if not found or name is None:
        return bool(found)
    return any(getattr(node, "name", None) == name for c in found for node in ast.walk(ast.parse(c.read_text())))


# ---------------------------------------------------------------------------------------------- the texts


def markdown_pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def without_fences(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Docstring:
    line: int
    text: str
    scope: dict[str, str | None]  # names a docstring may start with -> the class they are, None if not ours


def import_aliases(tree: ast.Module, module: str, *, is_package: bool) -> dict[str, str]:
    """A module's own names for what it imports: ``L`` -> ``testkit.load``, ``Future`` ->
    ``concurrent.futures.Future``."""
    aliases = {}
    for node in top_statements(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                aliases[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = imported_from(node, module, is_package=is_package)
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def docstrings(path: Path) -> Iterator[Docstring]:
    """Every docstring of a file, with the names it may use: a function's parameters (resolved through their
    annotations; ``self`` and ``cls`` are the class) and, for a class, ``self``."""
    tree = ast.parse(path.read_text())

    def visit(node: ast.AST, cls: str | None) -> Iterator[Docstring]:
        body = getattr(node, "body", [])
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            scope: dict[str, str | None] = {}
            if isinstance(node, ast.ClassDef):
                scope["self"] = node.name
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                    scope[arg.arg] = cls if arg.arg in ("self", "cls") and cls else annotation_class(arg.annotation)
            yield Docstring(body[0].lineno, body[0].value.value, scope)
        for child in ast.iter_child_nodes(node):
            yield from visit(child, node.name if isinstance(node, ast.ClassDef) else cls)

    yield from visit(tree, None)


def resolves_in_docstring(dotted: str, scope: dict[str, str | None], aliases: dict[str, str]) -> bool:
    """A name as the docstring's own code would read it: a parameter through its annotation, an imported name
    through its import, else as any name of the docs."""
    first, _, rest = dotted.partition(".")
    if first in scope:
        kind = scope[first]
        if kind is None or not classes_named(kind):
            return True  # a parameter of a type not ours (Any, a third-party class): not checked
        return any(resolves_in_class(c, rest.split(".")) for c in classes_named(kind))
    if first in aliases:
        full = f"{aliases[first]}.{rest}"
        return resolves(full) if full.split(".")[0] in OURS else True
    return resolves(dotted) or allowed(dotted)


def code_strings(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "python" in node.value:
            yield node.lineno, node.value


def source_files() -> list[Path]:
    return [p for package in REFERENCE_PACKAGES for p in sorted((REPO / package).rglob("*.py"))]


def references_in(text: str, spans: re.Pattern[str]) -> Iterator[str]:
    for match in spans.finditer(text):
        content = match.group(1).strip()
        dotted = re.fullmatch(rf"({DOTTED.pattern})(?:\(.*\))?", content)
        if dotted and "<" not in content:
            yield dotted.group(1)


def broken_references() -> list[str]:
    broken = []
    for page in markdown_pages():
        text = page.read_text()
        where = str(page.relative_to(REPO))
        broken += [f"{where}: `{name}`" for name in references_in(without_fences(text), SPAN)
                   if not resolves(name) and not allowed(name)]
        broken += [f"{where}: python -m {name}" for name in PYTHON_M.findall(text) if not python_module_exists(name)]
        broken += [f"{where}: {path}" + (f"::{name}" if name else "") for path, name in PY_PATH.findall(text)
                   if not path_exists(path, name or None, page.parent)]
    for path in source_files():
        where = str(path.relative_to(REPO))
        aliases = import_aliases(ast.parse(path.read_text()), module_name(path), is_package=path.name == "__init__.py")
        for doc in docstrings(path):
            broken += [f"{where}:{doc.line}: ``{name}``" for name in references_in(doc.text, DOUBLE_SPAN)
                       if not resolves_in_docstring(name, doc.scope, aliases)]
            broken += [f"{where}:{doc.line}: {p}" + (f"::{n}" if n else "") for p, n in PY_PATH.findall(doc.text)
                       if not path_exists(p, n or None, REPO)]
        for line, text in code_strings(path):
            broken += [f"{where}:{line}: python -m {name}" for name in PYTHON_M.findall(text)
                       if not python_module_exists(name)]
    return sorted(set(broken))


# ---------------------------------------------------------------------------------------------- the tests


def test_the_readme_is_a_front_door() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move the rest into docs/"


def test_the_architecture_page_is_short() -> None:
    page = DOCS / "architecture.md"
    size = len(page.read_bytes())
    assert size <= ARCHITECTURE_MAX_BYTES, f"docs/architecture.md is {size} bytes: move detail to module docstrings"


def test_no_page_names_a_private_name() -> None:
    """Docs name folders, contracts and public names: a ``_name`` in backticks is an internal that will move."""
    private = [f"{page.relative_to(REPO)}: `{span}`" for page in markdown_pages()
               for span in SPAN.findall(without_fences(page.read_text()))
               if re.search(r"(?:^|[./])_[A-Za-z]", span.strip()) and " " not in span.strip()]
    assert not private, "\n".join(private)


def test_every_reference_resolves_to_the_code() -> None:
    broken = broken_references()
    assert not broken, "references that name nothing of ours:\n" + "\n".join(broken)


def test_links_between_pages_lead_somewhere() -> None:
    """Every relative link of the README and docs/ names a file that exists and, with ``#anchor``, a heading."""
    broken = []
    for page in markdown_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", without_fences(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", without_fences(page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


SECTION_REFERENCE = re.compile(r'(README|docs/[\w.-]+\.md)(?:``)?(?:\'s)?,?\s+\(?"([^"\n]+)"')
SECTION_REFERENCE_FOLDERS = (*REFERENCE_PACKAGES, "tests", "deploy", ".ci")


def test_sections_named_from_the_code_exist() -> None:
    """A comment or docstring that sends its reader to a page's section (``docs/tuning.md, "Memory"``) names a
    heading of that page (its first words suffice)."""
    texts = [p for top in SECTION_REFERENCE_FOLDERS for p in sorted((REPO / top).rglob("*"))
             if p.is_file() and p.suffix in ("", ".py", ".yaml", ".yml") and "results" not in p.parts]
    texts += markdown_pages()
    broken = []
    for path in texts:
        for page, section in SECTION_REFERENCE.findall(path.read_text(errors="replace")):
            target = README if page == "README" else REPO / page
            headings = re.findall(r"^#+\s+(.*)$", without_fences(target.read_text()), re.MULTILINE) \
                if target.is_file() else []
            if not any(h.strip().startswith(section) for h in headings):
                broken.append(f"{path.relative_to(REPO)}: {page}, \"{section}\"")
    assert not broken, "sections that are not there:\n" + "\n".join(broken)


def test_every_docs_snippet_is_run_or_skipped_by_section() -> None:
    sections = {(b.path.name, b.section) for page in sorted(DOCS.glob("*.md")) for b in fenced_blocks(page)
                if b.lang in ("bash", "python")}
    assert sections <= RUN | set(NOT_RUN), sorted(sections - RUN - set(NOT_RUN))
    named = RUN | set(NOT_RUN)
    assert named <= sections, f"sections named here with no snippet: {sorted(named - sections)}"
    langs = {b.lang for page in sorted(DOCS.glob("*.md")) for b in fenced_blocks(page)}
    assert langs <= {"bash", "python"}, f"a fence names a language no test runs: {langs}"


@pytest.mark.parametrize(("page", "section"), sorted(RUN))
async def test_docs_snippets_work(tmp_path: Path, page: str, section: str) -> None:
    """Each block beside the README's stub backend, with every docs port replaced by a free one; each answers
    what the stub saw and leaves nothing behind."""
    require_curl()
    blocks = [b for b in fenced_blocks(DOCS / page) if b.section == section]
    assert blocks
    checkout, tmpdir = tmp_path / "checkout", tmp_path / "tmp"
    checkout.mkdir()
    tmpdir.mkdir()
    replacements = port_replacements({8000: free_port(), 8080: free_port(), 8081: free_port(), 9000: free_port()})
    backend = with_ports("python -m demo.backend --host 127.0.0.1 --port 8000", replacements)
    log = tmp_path / "backend.log"
    stub = await start_server(backend, tmp_path, log)
    try:
        await wait_until_up(with_ports("http://127.0.0.1:8000/health", replacements), stub, log)
        for block in blocks:
            status, output = await run_block(block, with_ports(block.text, replacements), checkout, tmpdir)
            assert status == 0, f"{block.where}: exit status {status}: {output[-2000:]}"
            assert STUB_ANSWER in output, f"{block.where}: {output[-2000:]}"
            left = [str(p.relative_to(tmp_path)) for p in (*checkout.rglob("*"), *tmpdir.rglob("*"))]
            assert not left, f"{block.where}: the snippet left {left} behind"
    finally:
        assert await interrupt(stub) == 0
