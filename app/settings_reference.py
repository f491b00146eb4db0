"""docs/configuration.md, generated from Settings' field docs: `python -m app.settings_reference` rewrites it.

The file is never edited by hand; tests/unit/test_settings_reference.py fails when it is stale or
when it and `sluice --help` disagree.
"""

from __future__ import annotations

import inspect
import types
import typing
from pathlib import Path

from pydantic.fields import FieldInfo

from app.settings import Settings

DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

_HEADER = """\
# Configuration

Generated from `Settings` in `app/settings.py` by `python -m app.settings_reference`; edit the field docs
there, never this file. `sluice --help` prints the same.

Every flag is also an environment variable: `SLUICE_` and the field's name in capitals
(`--max-num-seqs 32` = `SLUICE_MAX_NUM_SEQS=32`). A flag wins over its variable. On/off settings take
`--x` / `--no-x` as flags and `true` / `false` as variables; `--api-key` is repeated as a flag and a JSON
list as a variable (`SLUICE_API_KEY='["k1", "k2"]'`). With `make serve`, flags go after `ARGS=`:
`make serve ARGS="--port 9000 --max-num-seqs 32"`.

| flag | environment variable | value | default | meaning |
|---|---|---|---|---|
"""

_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def flags(name: str, field: FieldInfo) -> list[str]:
    """The field's flags as `sluice --help` spells them: kebab case, and `--no-x` beside a boolean's `--x`."""
    flag = "--" + name.replace("_", "-")
    return [flag, "--no-" + flag[2:]] if field.annotation is bool else [flag]


def _value(field: FieldInfo) -> str:
    """The kind of value a field takes, with its bounds."""
    annotation = field.annotation
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{choice}`" for choice in args)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    kind = {
        bool: "on / off",
        int: "integer",
        float: "number",
        str: "text",
        Path: "path",
        list[str]: "text, repeatable",
    }[annotation]
    bounds = [
        f"{symbol} {getattr(rule, attribute)}"
        for rule in field.metadata
        for attribute, symbol in _BOUNDS
        if hasattr(rule, attribute)
    ]
    return ", ".join([kind, *bounds])


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, Path) and value.is_relative_to(Path.home()):
            return f"`~/{value.relative_to(Path.home())}`"
        return f"`{value}`" if value else "none"
    if field.default is None:
        return "unset"
    if isinstance(field.default, bool):
        return "on" if field.default else "off"
    return f"`{field.default}`"


def description(field: FieldInfo) -> str:
    """The field's docstring on one line, as `--help` shows it."""
    return " ".join(inspect.cleandoc(field.description or "").split())


def render() -> str:
    rows = [
        "| {flags} | `SLUICE_{env}` | {value} | {default} | {meaning} |".format(
            flags=", ".join(f"`{flag}`" for flag in flags(name, field)),
            env=name.upper(),
            value=_value(field),
            default=_default(field),
            meaning=description(field).replace("|", "\\|"),
        )
        for name, field in Settings.model_fields.items()
    ]
    return _HEADER + "\n".join(rows) + "\n"


def main() -> None:
    DOCS_PATH.write_text(render(), encoding="utf-8")
    print(f"wrote {DOCS_PATH}")


if __name__ == "__main__":
    main()
