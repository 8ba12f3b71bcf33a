"""Which code a benchmark result measures, and whether that code changed since the commit the result ran on.

A result of ``bench/<script>.py`` measures the script itself and its **rooms**: the modules of ``proxy/`` and
``preprocessors/`` the script imports, directly or through any module of this repository it imports (``bench``,
``testkit``). Imports are read from the source, none is run: every import statement at any depth, relative ones
included, the packages' ``__init__`` modules above each module, and import statements handed as text to a fresh
interpreter (``"import proxy.app"``).

A script that starts mmgate measures ``proxy/`` and ``preprocessors/`` whole: the script, or a ``testkit``
module it imports, builds the app (imports ``proxy.app``) or runs ``python -m proxy`` (an argument list holding
``"-m"`` then ``"proxy"``). Another bench module the script imports lends its imports, not its way of starting
mmgate: importing a helper function from it runs no process.

Code changed when a measured file differs between the two commits in anything but docstrings and comments:
a ``.py`` file counts only if its syntax tree without docstrings differs, any other file counts as changed,
and a file added, removed or moved counts. Of the script itself, only what its measurement runs counts
(``measuring_code``): its ``goals`` and ``report`` turn the result's data into verdicts and a page, and
``python -m bench report`` rebuilds both from the data whenever they change. Every file is read from git
(``git cat-file``), never from the working tree, so the verdict is the committed code's.
"""

from __future__ import annotations

import ast
import functools
import itertools
import subprocess
from collections.abc import Collection, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOMS = ("proxy", "preprocessors")
STARTS_THE_APP = "proxy.app"  # importing it builds mmgate in-process
HELPERS = "testkit"  # the shared kit whose servers and load client start mmgate for a script


def git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes | None:
    """Output of one git command in ``repo``, or None where git or the history is not available."""
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True, timeout=60,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def resolve(repo: Path, rev: str) -> str | None:
    """The full commit id ``rev`` names, or None when it names no commit of this history."""
    out = git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    return out.decode().strip() if out else None


def read_files(repo: Path, commit: str, paths: Iterable[str]) -> dict[str, bytes | None]:
    """Each path's content at ``commit`` (None where it does not exist there), through one ``git cat-file``."""
    paths = list(paths)
    if not paths:
        return {}
    out = git(repo, "cat-file", "--batch", stdin="".join(f"{commit}:{p}\n" for p in paths).encode())
    if out is None:
        raise RuntimeError(f"git cat-file failed in {repo}")
    found: dict[str, bytes | None] = {}
    at = 0
    for path in paths:
        end = out.index(b"\n", at)
        header = out[at:end].split()
        at = end + 1
        if len(header) != 3 or header[1] != b"blob":  # "<name> missing", or a folder
            found[path] = None
            continue
        size = int(header[2])
        found[path] = out[at:at + size]
        at += size + 1
    return found


def _module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=8)
def modules_at(repo: Path, commit: str) -> dict[str, tuple[str, ast.Module | None]]:
    """Every module of this repository's top-level packages at ``commit``: name → (path, syntax tree or None)."""
    listing = git(repo, "ls-tree", "-r", "--name-only", "-z", commit)
    if listing is None:
        raise RuntimeError(f"git ls-tree {commit} failed in {repo}")
    files = [p for p in listing.decode().split("\0") if p]
    packages = {p.split("/")[0] for p in files if p.count("/") == 1 and p.endswith("/__init__.py")}
    sources = read_files(repo, commit, [p for p in files if p.endswith(".py") and p.split("/")[0] in packages])
    modules: dict[str, tuple[str, ast.Module | None]] = {}
    for path, source in sources.items():
        try:
            tree = ast.parse(source or b"", path)
        except (SyntaxError, ValueError):
            tree = None
        modules[_module_name(path)] = (path, tree)
    return modules


def with_packages(name: str, known: Collection[str]) -> list[str]:
    """``name`` and every package above it that is ours: importing a module runs their ``__init__`` first."""
    parts = name.split(".")
    return [prefix for prefix in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if prefix in known]


def _code_in_strings(tree: ast.Module) -> list[ast.AST]:
    """The nodes of import statements written as text for a fresh interpreter (``python -c "import proxy.app"``)."""
    nodes: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.lstrip().startswith(("import ", "from ")):
            try:
                nodes.extend(ast.walk(ast.parse(node.value)))
            except (SyntaxError, ValueError):
                continue
    return nodes


def imports_in(tree: ast.Module, name: str, is_package: bool, known: Collection[str], *,
               code_in_strings: bool = False) -> set[str]:
    """The modules of ``known`` that module ``name`` (whose syntax tree is ``tree``) imports, by any statement at
    any depth, with the packages above each; with ``code_in_strings``, also by the import statements it hands to
    a fresh interpreter as text. Names imported from a package count as an import of the submodule of that name
    where there is one, else of the package."""
    found: set[str] = set()
    for node in (*ast.walk(tree), *(_code_in_strings(tree) if code_in_strings else ())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            found.update(with_packages(target, known))
    found.discard(name)
    return found


def imports_of(name: str, known: dict[str, tuple[str, ast.Module | None]]) -> set[str]:
    """The modules of ours that module ``name`` imports, by any statement at any depth or in a string of code it
    hands to a fresh interpreter."""
    path, tree = known[name]
    if tree is None:
        return set()
    return imports_in(tree, name, path.endswith("/__init__.py"), known, code_in_strings=True)


@functools.lru_cache(maxsize=4096)
def _imports_at(repo: Path, commit: str, name: str) -> frozenset[str]:
    """``imports_of`` module ``name`` at ``commit``, once: every script's import closure passes through testkit's."""
    return frozenset(imports_of(name, modules_at(repo, commit)))


def runs_mmgate(tree: ast.Module | None) -> bool:
    """Whether an argument list in ``tree`` runs ``python -m proxy`` (or a module of ``proxy``)."""
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.List | ast.Tuple):
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            for flag, module in itertools.pairwise(words):
                if flag == "-m" and isinstance(module, str) and module.split(".")[0] == "proxy":
                    return True
    return False


def rooms_of(script: str, repo: Path = REPO, rev: str = "HEAD") -> tuple[str, ...]:
    """The paths of ``proxy/`` and ``preprocessors/`` that ``bench/<script>`` measures at ``rev``: the files of
    the modules in its import closure, or ``ROOMS`` (the two folders whole) when it starts mmgate or is missing."""
    commit = resolve(repo, rev)
    return ROOMS if commit is None else _rooms_at(script, repo, commit)


@functools.lru_cache(maxsize=64)
def _rooms_at(script: str, repo: Path, commit: str) -> tuple[str, ...]:
    known = modules_at(repo, commit)
    start = _module_name(f"bench/{script}")
    if start not in known:
        return ROOMS
    seen, todo = {start}, [start]
    while todo:
        name = todo.pop()
        lends_its_start = name == start or name.split(".")[0] == HELPERS
        imported = _imports_at(repo, commit, name)
        if lends_its_start and (runs_mmgate(known[name][1]) or STARTS_THE_APP in imported):
            return ROOMS
        for target in imported - seen:
            seen.add(target)
            todo.append(target)
    return tuple(sorted(known[n][0] for n in seen if n.split(".")[0] in ROOMS))


def measured_paths(script: str, repo: Path = REPO, rev: str = "HEAD") -> tuple[str, ...]:
    """The paths whose code a result of ``bench/<script>`` measures: its rooms and the script itself."""
    return (*rooms_of(script, repo, rev), f"bench/{script}")


MEASURES = "measure"  # a bench script's functions whose names start so measure (``Scenario.functions``' first)


def measuring_code(tree: ast.Module) -> ast.Module:
    """A bench script as far as its measurement runs: its module-level statements, its ``measure…`` functions
    and every function and class they reach by name, directly or in turn; not what only its verdicts and its page
    use (``goals``, ``report`` and their helpers), which are rebuilt from the result's data."""
    defined = {node.name: node for node in tree.body
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    roots = [node for node in tree.body if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
             or node.name.startswith(MEASURES)]
    reached: set[str] = set()
    todo = [*roots]
    while todo:
        for node in ast.walk(todo.pop()):
            if isinstance(node, ast.Name) and node.id in defined and node.id not in reached:
                reached.add(node.id)
                todo.append(defined[node.id])
    tree.body = [node for node in tree.body if node in roots or getattr(node, "name", None) in reached]
    return tree


@functools.lru_cache(maxsize=4096)
def code_of(source: bytes | None, measuring: bool = False) -> str | None:
    """A module's syntax tree without its docstrings, as text (with ``measuring``, a bench script's
    ``measuring_code``); None when there is no such file or it does not parse (never equal to another: such a
    file always counts as changed). Cached by content: the results' commits share most of their files' versions."""
    if source is None:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    if measuring:
        tree = measuring_code(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:]
    return ast.dump(tree)


@functools.lru_cache(maxsize=256)
def code_changes(repo: Path, since: str, until: str, paths: tuple[str, ...]) -> tuple[str, ...]:
    """The files under ``paths`` whose code differs between commits ``since`` and ``until``, in path order."""
    out = git(repo, "diff", "--name-only", "--no-renames", "-z", since, until, "--", *paths)
    if out is None:
        raise RuntimeError(f"git diff {since} {until} failed in {repo}")
    touched = [p for p in out.decode().split("\0") if p]
    python = [p for p in touched if p.endswith(".py")]
    before, after = read_files(repo, since, python), read_files(repo, until, python)
    changed = []
    for path in touched:
        if not path.endswith(".py"):
            changed.append(path)
            continue
        script = path.startswith("bench/")  # the only bench module a result measures is its script
        old, new = code_of(before[path], script), code_of(after[path], script)
        if old is None or new is None or old != new:
            changed.append(path)
    return tuple(changed)
