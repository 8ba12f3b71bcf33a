"""What is told about the settings is made from their declarations: --help's groups and choices, the reference
page docs/configuration.md, the README's essentials table and the decode workers' policy fields."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from proxy.settings import SECTIONS, SPEC, env_name, flag_name
from proxy.settings.policies import POLICY_SETTINGS_PATH, render_policy_settings
from proxy.settings.reference import (
    ESSENTIALS_BEGIN,
    ESSENTIALS_END,
    REPO,
    add_arguments,
    render_configuration_md,
    render_essentials,
    with_essentials,
)
from proxy.settings.spec import section_title, settings_of


def _help() -> str:
    parser = argparse.ArgumentParser(prog="mmgate")
    add_arguments(parser)
    return parser.format_help()


def test_help_has_one_group_per_section_holding_its_flags_in_order() -> None:
    text = _help()
    titles = [f"\n{section_title(section)}:\n" for section in SECTIONS]
    starts = [text.index(title) for title in titles]
    assert starts == sorted(starts)
    for section, start, end in zip(SECTIONS, starts, [*starts[1:], len(text)], strict=True):
        block = text[start:end]
        assert (section.__doc__ or "").strip() in " ".join(block.split())  # its description
        flags = re.findall(r"^  (--[a-z0-9-]+)", block, re.MULTILINE)
        assert flags == [flag_name(setting.name) for setting in settings_of(section)]


def test_help_lists_the_values_of_every_choice_setting() -> None:
    text = _help()
    choices = {name: setting.info.choices for name, setting in SPEC.items() if setting.info.choices}
    assert {"release_at", "image_format", "log_level", "access_log"} <= set(choices)
    for name, values in choices.items():
        assert f"{flag_name(name)} {{{','.join(values)}}}" in text
    assert "--release-at {auto,sent,headers,complete}" in text
    assert "--max-queue V" in text  # no choices: a value


def test_configuration_md_is_generated_from_the_declarations() -> None:
    assert (REPO / "docs" / "configuration.md").read_text() == render_configuration_md(), (
        "run python -m proxy.settings.reference")


def test_configuration_md_has_a_table_per_section_with_every_variable_once() -> None:
    text = render_configuration_md()
    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == [section_title(s) for s in SECTIONS]
    rows = re.findall(r"^\| `(MMGATE_[A-Z0-9_]+)` \| `(--[a-z0-9-]+)[^`]*` \|", text, re.MULTILINE)
    assert rows == [(env_name(name), flag_name(name)) for name in SPEC]
    assert ("| `MMGATE_CLIENT_WRITE_TIMEOUT` | `--client-write-timeout` | `30` | a client that reads nothing of the "
            "answer for this long loses its connection (like nginx send_timeout) (0 = off); never longer than ") in text
    assert "| `MMGATE_UPSTREAM` | `--upstream` | (required) | " in text
    assert "| `MMGATE_DECODE_WORKERS` | `--decode-workers` | usable CPUs | " in text
    assert "`--release-at {auto,sent,headers,complete}`" in text


def test_the_essentials_are_the_few_settings_an_operator_turns() -> None:
    essentials = [name for name, setting in SPEC.items() if setting.info.essential]
    assert essentials == ["upstream", "admin_port", "max_mm_concurrency", "max_queue", "queue_timeout",
                          "max_body_mb", "cache_mb"]
    rows = render_essentials().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == [env_name(name) for name in essentials]


def test_the_essentials_table_is_written_between_the_readme_markers_only() -> None:
    readme = f"# mmgate\n\nbefore\n{ESSENTIALS_BEGIN}\nold table\n{ESSENTIALS_END}\nafter\n"
    written = with_essentials(readme)
    assert written == f"# mmgate\n\nbefore\n{ESSENTIALS_BEGIN}\n{render_essentials()}{ESSENTIALS_END}\nafter\n"
    assert with_essentials(written) == written
    assert with_essentials("# no markers\n") == "# no markers\n"


def _reference(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.settings.reference", *args], capture_output=True, text=True,
                          check=False, timeout=60, cwd=REPO)


def test_check_fails_on_a_stale_file_and_writing_makes_it_pass(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "configuration.md").write_text("# Configuration\n\nhand-edited\n")
    (tmp_path / "README.md").write_text(f"intro\n{ESSENTIALS_BEGIN}\n{ESSENTIALS_END}\n")
    (tmp_path / "preprocessors").mkdir()
    (tmp_path / POLICY_SETTINGS_PATH).write_text('"""hand-edited"""\n')
    stale = _reference("--check", "--root", str(tmp_path))
    assert stale.returncode == 1
    assert stale.stderr.splitlines() == [
        "docs/configuration.md is not what python -m proxy.settings.reference writes: run it",
        "preprocessors/policy_settings.py is not what python -m proxy.settings.reference writes: run it",
        "README.md is not what python -m proxy.settings.reference writes: run it"]
    assert (tmp_path / "docs" / "configuration.md").read_text() == "# Configuration\n\nhand-edited\n"
    written = _reference("--root", str(tmp_path))
    assert written.returncode == 0 and written.stderr == ""
    assert (tmp_path / "docs" / "configuration.md").read_text() == render_configuration_md()
    assert render_essentials() in (tmp_path / "README.md").read_text()
    assert (tmp_path / POLICY_SETTINGS_PATH).read_text() == render_policy_settings()
    fresh = _reference("--check", "--root", str(tmp_path))
    assert (fresh.returncode, fresh.stdout, fresh.stderr) == (0, "", "")
