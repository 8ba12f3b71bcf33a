"""The README's benchmark section is what ``bench/report.py`` makes of the committed results, and the
report's rules (staleness, goal verdicts, spreads) hold. No timing is asserted: figures come from files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import _results as R
from bench import report


def _git_or_skip() -> str:
    head = R.git("rev-parse", "HEAD")
    if head is None:
        pytest.skip("needs a git checkout: staleness is read from the history")
    return head


def test_readme_section_is_generated_from_the_results() -> None:
    _git_or_skip()
    readme = report.README.read_text()
    assert report.current_section(readme) == report.render_section(), (
        "README.md's benchmark section disagrees with bench/results/*.json: run python -m bench.report")


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
