"""docs/configuration.md is what `python -m app.settings_reference` writes, and says what `sluice --help` says."""

from __future__ import annotations

import re
import sys

import pytest

from app.__main__ import main
from app.settings_reference import DOCS_PATH, render

_REGENERATE = "docs/configuration.md is stale: run `python -m app.settings_reference` and commit the result"
_HELP_DEFAULT = re.compile(r"\s*\(default(?P<factory> factory)?: (?P<value>.*)\)$")


def _docs_rows() -> dict[tuple[str, ...], tuple[str, str]]:
    """The file's table: flags → (default, meaning), read back as a reader of the Markdown sees them."""
    rows = {}
    for line in DOCS_PATH.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 5 or not cells[0].startswith("`--"):
            continue
        flags = tuple(flag.strip("`") for flag in cells[0].split(", "))
        default = {"on": "True", "off": "False", "unset": "null"}.get(cells[3], cells[3].strip("`"))
        rows[flags] = (default, cells[4].replace("\\|", "|"))
    return rows


def _help_rows(text: str) -> dict[tuple[str, ...], tuple[str | None, str]]:
    """`--help`'s options: flags → (default, meaning), the default None where --help names a factory."""
    options = text.split("\noptions:\n", 1)[1]
    blocks: list[list[str]] = []
    for line in options.splitlines():
        if line.startswith("  -"):
            blocks.append([line])
        elif line.strip() and blocks:
            blocks[-1].append(line)
    rows = {}
    for block in blocks:
        invocation, _, first = block[0].strip().partition("  ")
        flags = tuple(part.split()[0] for part in invocation.split(", "))
        if flags == ("-h", "--help"):
            continue
        meaning = " ".join(" ".join([first, *block[1:]]).split())
        match = _HELP_DEFAULT.search(meaning)
        assert match, f"{flags}: no default in --help"
        rows[flags] = (None if match["factory"] else match["value"], meaning[: match.start()])
    return rows


def test_configuration_reference_is_generated_from_settings() -> None:
    assert DOCS_PATH.read_text(encoding="utf-8") == render(), _REGENERATE


def test_configuration_reference_agrees_with_sluice_help(monkeypatch, capsys) -> None:
    # Wide enough that argparse breaks no line, so no hyphenated flag is split in the middle.
    monkeypatch.setenv("COLUMNS", "10000")
    monkeypatch.setattr(sys, "argv", ["sluice", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 0
    help_rows = _help_rows(capsys.readouterr().out)
    docs_rows = _docs_rows()
    assert len(help_rows) > 30, "the parser of --help found too few options"
    assert set(docs_rows) == set(help_rows), _REGENERATE
    for flags, (help_default, help_meaning) in help_rows.items():
        docs_default, docs_meaning = docs_rows[flags]
        assert docs_meaning == help_meaning, f"{flags[0]}: {_REGENERATE}"
        if help_default is not None:
            assert docs_default == help_default, f"{flags[0]}: {_REGENERATE}"
