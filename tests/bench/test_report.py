"""docs/benchmarks.md and the README's headline figures are what ``bench/report.py`` makes of the committed
results, and the report's rules (staleness, goal verdicts, spreads) hold. No timing is asserted: figures come
from files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import _results as R
from bench import report

from .conftest import TREE, Repo


def _git_or_skip() -> str:
    head = R.git("rev-parse", "HEAD")
    if head is None:
        pytest.skip("needs a git checkout: staleness is read from the history")
    return head


def test_generated_files_match_the_results() -> None:
    _git_or_skip()
    wanted = report.expected()
    assert report.PAGE in wanted
    for path, text in wanted.items():
        assert path.read_text() == text, f"{path} disagrees with bench/results/*.json: run python -m bench report"


def test_the_headline_block_is_written_between_the_markers_and_checked(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _git_or_skip()
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "benchmarks.md"
    readme.write_text(f"# x\n\nbefore\n\n{report.HEADLINE_BEGIN}\nold figures\n{report.HEADLINE_END}\n\nafter\n")
    assert report.sync(check=True, page=page, readme=readme) == 1
    assert report.sync(check=False, page=page, readme=readme) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old figures" not in text
    assert report.render_headline() in text and page.read_text() == report.render_page()
    files = report.load_results()
    for result, name in report.HEADLINES:
        goal = report.headline_goal(files, result, name)
        assert report.cell(report.figure(goal)) in text and report.cell(report.verdict(goal)) in text
    assert text.count("(docs/benchmarks.md)") >= len(report.HEADLINES)
    assert report.sync(check=True, page=page, readme=readme) == 0
    readme.write_text(text.replace("met |", "met, by hand |", 1))
    assert report.sync(check=True, page=page, readme=readme) == 1
    capsys.readouterr()


def test_a_readme_without_the_markers_is_left_alone_and_said_so(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    _git_or_skip()
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "benchmarks.md"
    readme.write_text("# x\n")
    assert report.sync(check=False, page=page, readme=readme) == 0
    assert readme.read_text() == "# x\n" and page.read_text() == report.render_page()
    assert "no <!-- bench:headline -->" in capsys.readouterr().out


def test_a_headline_naming_a_goal_no_result_has_stops_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "HEADLINES", (("passthrough", "a goal nobody measured"),))
    with pytest.raises(SystemExit, match="a goal nobody measured"):
        report.render_headline()


def test_every_result_file_names_its_script_and_goals() -> None:
    for name, data in report.load_results().items():
        assert data.get("script"), name
        assert (R.BENCH / data["script"]).exists(), name
        assert data.get("measures"), name
        assert data.get("goals"), name
        for g in data["goals"]:
            assert {"name", "target", "median", "spread", "n", "met"} <= set(g), (name, g)


def test_a_result_without_a_commit_is_stale() -> None:
    stale, words = report.freshness({"commit": None, "measures": ["proxy"], "date": "2026-01-02T00:00:00"})
    assert stale and "commit unknown" in words and "2026-01-02" in words


def test_a_result_at_head_is_fresh_unless_dirty() -> None:
    head = _git_or_skip()
    data = {"commit": head, "dirty": False, "measures": ["proxy", "preprocessors"], "date": "2026-01-02"}
    assert report.freshness(data) == (False, f"`{head[:7]}`, 2026-01-02")
    stale, words = report.freshness(data | {"dirty": True})
    assert stale and "uncommitted" in words


def test_a_result_older_than_the_code_it_measures_is_stale() -> None:
    _git_or_skip()
    first = R.git("log", "--reverse", "--format=%H", "--", "proxy")
    assert first
    commit = first.splitlines()[0]  # proxy/ changed after its first commit
    stale, words = report.freshness({"commit": commit, "measures": ["proxy"], "date": None})
    assert stale and f"measured at `{commit[:7]}`" in words


def test_an_unknown_commit_is_stale() -> None:
    stale, words = report.freshness({"commit": "0" * 40, "measures": ["proxy"]})
    assert stale and "not in this history" in words


def test_goal_median_spread_and_verdicts() -> None:
    g = R.goal("p99", [9.0, 3.0, 4.0], "≤ 5", lambda v: v <= 5, unit="ms")
    assert (g["median"], g["spread"], g["n"], g["met"]) == (4.0, [3.0, 9.0], 3, True)
    assert "met" in R.goal_text(g) and "NOT" not in R.goal_text(g)
    every = R.goal("drift", [1.0, 2.0, 12.0], "≤ 10", lambda v: v <= 10, unit="%", met_on="max")
    assert every["met"] is False
    few = R.goal("x", [1.0, 2.0], "≤ 5", lambda v: v <= 5)
    assert "only 2 rounds" in R.goal_text(few) and "⚠" in report.figure(few)
    reported = R.goal("ratio", [1.0, 1.2, 1.1])
    assert reported["met"] is None and report.verdict(reported) == "– (reported)"
    assert R.goal("none", [])["median"] is None


def test_written_files_carry_stamp_goals_and_the_same_lines(tmp_path: Path) -> None:
    data = R.stamp("locate.py", "what it measures") | {"payload": [1, 2]}
    data["goals"] = [R.goal("p99", [1.0, 2.0, 3.0], "≤ 5", lambda v: v <= 5, unit="ms")]
    R.write("x", data, "# title\n\nbody\n", out=tmp_path / "x")
    written = json.loads((tmp_path / "x.json").read_text())
    assert list(written)[:len(R.STAMP_KEYS) + 1] == [*R.STAMP_KEYS, "goals"]
    assert set(written["machine"]) >= {"platform", "cpu", "usable_cores"}
    md = (tmp_path / "x.md").read_text()
    assert md.startswith("# title\n") and R.goal_lines(data["goals"])[0] in md and "body" in md


def test_downsample_keeps_the_peak() -> None:
    series = [[t, float(t % 7)] for t in range(1000)] + [[1000, 99.0]]
    small = R.downsample(series, column=1, points=50)
    assert len(small) == 50 and max(r[1] for r in small) == 99.0


def _measured_at(commit: str, script: str = "x.py") -> dict[str, object]:
    return {"script": script, "commit": commit, "dirty": False, "date": "2026-01-02"}


def test_a_docstring_or_comment_change_leaves_a_result_fresh(repo: Repo) -> None:
    measured = repo.git("rev-parse", "HEAD")
    repo.commit({
        "proxy/media/helper.py": '"""Helper, reworded."""\n\n\ndef scale(x):\n    """Twice x."""\n'
                                 "    return x * 2  # why\n",
        "bench/x.py": '"""What x measures."""\n\n' + TREE["bench/x.py"],
    })
    for script in ("x.py", "starts.py"):
        assert report.freshness(_measured_at(measured, script), repo.root) == (False, f"`{measured[:7]}`, 2026-01-02")


def test_a_code_change_in_a_room_makes_a_result_stale(repo: Repo) -> None:
    measured = repo.git("rev-parse", "HEAD")
    repo.commit({"proxy/media/helper.py": TREE["proxy/media/helper.py"].replace("x * 2", "x * 3")})
    assert report.freshness(_measured_at(measured), repo.root) == (
        True, f"**stale** (measured at `{measured[:7]}`, 2026-01-02; the measured code changed since)")


def test_a_change_to_the_script_itself_makes_its_result_stale(repo: Repo) -> None:
    measured = repo.git("rev-parse", "HEAD")
    repo.commit({"bench/x.py": TREE["bench/x.py"].replace("run(CAP)", "run(CAP + 1)")})
    assert report.freshness(_measured_at(measured), repo.root)[0]
    assert not report.freshness(_measured_at(measured, "starts.py"), repo.root)[0]


def test_a_change_outside_the_rooms_leaves_a_result_fresh_but_not_one_that_starts_mmgate(repo: Repo) -> None:
    measured = repo.git("rev-parse", "HEAD")
    repo.commit({"proxy/edge.py": "def serve():\n    return 2\n"})
    assert not report.freshness(_measured_at(measured), repo.root)[0]
    assert report.freshness(_measured_at(measured, "starts.py"), repo.root)[0]


def test_a_file_that_is_not_python_counts_as_changed(repo: Repo) -> None:
    measured = repo.git("rev-parse", "HEAD")
    repo.commit({"preprocessors/table.json": "{}\n"})
    assert report.freshness(_measured_at(measured, "starts.py"), repo.root)[0]
    assert not report.freshness(_measured_at(measured), repo.root)[0]


def test_a_moved_module_makes_a_result_stale(repo: Repo) -> None:
    measured = repo.git("rev-parse", "HEAD")
    repo.move("proxy/limits.py", "proxy/limits/__init__.py")  # the same code and the same import, moved
    assert report.freshness(_measured_at(measured), repo.root)[0]


SCRIPT_WITH_A_PAGE = '''\
from proxy.limits import CAP


def sample():
    return CAP


def measure(knobs):
    return {"value": sample()}


def cell(value):
    return f"{value:.2f}"


def report(data):
    return cell(data["value"])
'''


def test_a_change_to_what_only_the_page_uses_leaves_its_result_fresh(repo: Repo) -> None:
    """``goals`` and ``report`` are rebuilt from the data (``python -m bench report``): changing them, or a helper
    only they call, measures nothing anew; changing what ``measure`` reaches does."""
    measured = repo.commit({"bench/y.py": SCRIPT_WITH_A_PAGE})
    repo.commit({"bench/y.py": SCRIPT_WITH_A_PAGE.replace(":.2f", ":.3f").replace(
        'return cell(data["value"])', 'return "| " + cell(data["value"]) + " |"')})
    assert not report.freshness(_measured_at(measured, "y.py"), repo.root)[0]
    repo.commit({"bench/y.py": SCRIPT_WITH_A_PAGE.replace("return CAP", "return CAP + 1")})
    assert report.freshness(_measured_at(measured, "y.py"), repo.root)[0]
