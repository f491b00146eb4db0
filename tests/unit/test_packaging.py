"""What a non-editable install (the Docker image's `pip install .`) ships: every folder of Python files
under app/ and engine/ is a package setuptools finds, so none is left out of the wheel."""

from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_every_folder_of_python_files_is_a_package_the_wheel_ships():
    found = set(find_packages(str(ROOT), include=["app*", "engine*"]))
    folders = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for top in ("app", "engine")
        for path in (ROOT / top).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert folders <= found, f"not shipped (no __init__.py?): {sorted(folders - found)}"
    assert {"engine.step", "engine.model.families"} <= found
