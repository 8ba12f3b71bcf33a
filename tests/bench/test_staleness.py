"""What a bench result measures (its rooms) and what counts as a change of code, read from a throwaway git
repository's commits as ``bench.staleness`` reads the real history."""

from __future__ import annotations

from bench import staleness

from .conftest import Repo


def test_the_rooms_are_the_import_closure_with_packages_and_relative_imports(repo: Repo) -> None:
    assert staleness.rooms_of("x.py", repo.root) == (
        "proxy/__init__.py", "proxy/limits.py", "proxy/media/__init__.py", "proxy/media/helper.py",
        "proxy/media/step.py")
    assert staleness.measured_paths("x.py", repo.root)[-1] == "bench/x.py"


def test_the_rooms_are_read_at_the_commit_asked_for(repo: Repo) -> None:
    before = repo.git("rev-parse", "HEAD")
    repo.commit({"bench/x.py": "from proxy.limits import CAP\n\nprint(CAP)\n"})
    assert staleness.rooms_of("x.py", repo.root) == ("proxy/__init__.py", "proxy/limits.py")
    assert "proxy/media/step.py" in staleness.rooms_of("x.py", repo.root, before)


def test_a_script_that_starts_mmgate_measures_both_folders_whole(repo: Repo) -> None:
    repo.commit({
        "proxy/app.py": "from proxy.limits import CAP\n",
        "testkit/__init__.py": "",
        "testkit/servers.py": "from proxy.app import CAP\n",
        "bench/served.py": "from testkit.servers import CAP\n",
        "bench/imports_app.py": 'import subprocess\nimport sys\n\n'
                                'subprocess.run([sys.executable, "-c", "import proxy.app"])\n',
    })
    for script in ("starts.py", "served.py", "imports_app.py"):
        assert staleness.rooms_of(script, repo.root) == staleness.ROOMS, script


def test_a_bench_module_imported_lends_its_imports_not_its_way_of_starting_mmgate(repo: Repo) -> None:
    repo.commit({
        "bench/helpers.py": 'import subprocess\nimport sys\n\nfrom proxy.limits import CAP\n\n\ndef start():\n'
                            '    return subprocess.Popen([sys.executable, "-m", "proxy"])\n',
        "bench/y.py": "from bench.helpers import CAP\n",
    })
    assert staleness.rooms_of("y.py", repo.root) == ("proxy/__init__.py", "proxy/limits.py")


def test_a_script_missing_at_the_commit_measures_both_folders(repo: Repo) -> None:
    assert staleness.rooms_of("gone.py", repo.root) == staleness.ROOMS


def test_only_docstrings_and_comments_leave_the_code_unchanged() -> None:
    code = staleness.code_of(b'"""A module."""\n\n\nclass A:\n    """A."""\n\n    def f(self):\n'
                             b'        """F."""\n        return 1  # one\n')
    assert code is not None
    assert code == staleness.code_of(b"class A:\n    def f(self):\n        return 1\n")
    assert code != staleness.code_of(b"class A:\n    def f(self):\n        return 2\n")
    assert staleness.code_of(b'x = 1\n"not a docstring"\n') != staleness.code_of(b"x = 1\n")
    assert staleness.code_of(b"def (:\n") is None and staleness.code_of(None) is None
