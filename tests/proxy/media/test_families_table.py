"""docs/model.md's table of families is generated from the registry: what the doc says is what the code loads."""

from __future__ import annotations

from pathlib import Path

from proxy.media.families import BEGIN, DOC, END, FAMILIES, GENERIC, document, main, table


def test_the_doc_table_is_what_the_generator_writes() -> None:
    assert DOC.read_text() == document(DOC.read_text()), "docs/model.md: run python -m proxy.media.families"
    assert main(["--check"]) == 0


def test_every_family_and_every_generic_one_has_a_row() -> None:
    rows = table().splitlines()[2:]
    assert len(rows) == len(FAMILIES) + len(GENERIC)
    for family, row in zip(FAMILIES, rows, strict=False):
        assert row.startswith(f"| {family.names} |")
    for (names, _reason), row in zip(GENERIC.values(), rows[len(FAMILIES):], strict=True):
        assert row.startswith(f"| {names} |") and "generic rule" in row


def test_a_stale_table_is_replaced_between_its_markers(tmp_path: Path) -> None:
    stale = f"# title\n\n{BEGIN}\n| old |\n{END}\n\nafter\n"
    fresh = document(stale)
    assert fresh.startswith("# title\n\n") and fresh.endswith(f"{END}\n\nafter\n")
    assert "| old |" not in fresh and table() in fresh
