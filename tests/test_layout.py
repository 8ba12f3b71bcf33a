"""tests/ mirrors the repository: a test file is named after what it tests and sits in the folder of that thing.

``tests/proxy/edge/test_paths.py`` tests ``proxy/edge/paths.py``; ``test_<module>_<aspect>.py`` is a second suite
of one module (``tests/proxy/admission/test_gate_fairness.py``), and ``tests/proxy/test_app*.py`` are the whole app
over HTTP. At the top, ``tests/test_<name>.py`` checks a top-level part that is not Python (``deploy/``, the
README). A file moved, renamed or orphaned by a product change fails here, so the mirror cannot drift.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
# Not mirrors, each for its reason: the real-vLLM suite is named after what it checks on a real server, and the
# corpus is data replayed by tests/proxy/test_app_fuzz.py.
OWN_LAYOUT = {TESTS / "e2e", TESTS / "fuzz_corpus"}
SUPPORT_FILES = {"__init__.py", "conftest.py"}
CHECKS_THE_TESTS_THEMSELVES = TESTS / "test_layout.py"
# Checks proxy/ and preprocessors/ together (no import cycle between any of their modules): no one module to mirror.
CHECKS_THE_WHOLE_PRODUCT = TESTS / "test_import_graph.py"


def mirrored_folders() -> list[Path]:
    """tests/ and every folder under it but the ones with their own layout, caches and hidden tool folders."""
    return [TESTS] + [
        folder for folder in sorted(TESTS.rglob("*"))
        if folder.is_dir()
        and not any(part == "__pycache__" or part.startswith(".") for part in folder.relative_to(TESTS).parts)
        and not any(folder == own or own in folder.parents for own in OWN_LAYOUT)
    ]


def names_what_it_tests(test_file: Path) -> bool:
    """``tests/<dir>/test_<name>.py`` names ``<dir>/<name>.py``, a folder ``<dir>/<name>/``, or, as
    ``<module>_<aspect>``, ``<dir>/<module>.py``; at the top, a top-level file or folder of the repository."""
    product_dir = REPO / test_file.parent.relative_to(TESTS)
    name = test_file.stem.removeprefix("test_")
    if test_file.parent == TESTS:
        return any(entry.name.lower() in (name, f"{name}.md") for entry in REPO.iterdir())
    words = name.split("_")
    candidates = ["_".join(words[:end]) for end in range(len(words), 0, -1)]
    return any((product_dir / f"{module}.py").is_file() or (product_dir / module).is_dir() for module in candidates)


def test_every_test_file_names_the_module_it_tests() -> None:
    orphans = [
        str(path.relative_to(REPO))
        for folder in mirrored_folders()
        for path in sorted(folder.glob("test_*.py"))
        if path not in (CHECKS_THE_TESTS_THEMSELVES, CHECKS_THE_WHOLE_PRODUCT) and not names_what_it_tests(path)
    ]
    assert not orphans, f"test files naming no module or part of the repository: {orphans}"


def test_every_test_folder_is_a_package_mirroring_a_product_folder() -> None:
    folders = mirrored_folders()
    assert len(folders) > 1
    not_packages = [str(folder.relative_to(REPO)) for folder in folders if not (folder / "__init__.py").is_file()]
    assert not not_packages, f"test folders without __init__.py (pytest would clash on basenames): {not_packages}"
    mirrors_nothing = [
        str(folder.relative_to(REPO)) for folder in folders[1:]
        if not (REPO / folder.relative_to(TESTS)).is_dir()
    ]
    assert not mirrors_nothing, f"test folders with no product folder of the same path: {mirrors_nothing}"


def test_only_tests_and_their_support_files_are_python_modules_in_mirrored_folders() -> None:
    strays = [
        str(path.relative_to(REPO))
        for folder in mirrored_folders()
        for path in sorted(folder.glob("*.py"))
        if path.name not in SUPPORT_FILES and not path.name.startswith("test_")
    ]
    assert not strays, f"helpers belong in a conftest.py or in testkit/: {strays}"
