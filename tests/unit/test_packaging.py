"""The wheel holds every package of the tree: pyproject.toml lists each folder that has an __init__.py."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_in_pyproject():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = sorted(".".join(p.parent.relative_to(ROOT).parts) for top in ("builder", "passes", "runtime", "plans",
                                                                          "templates")
                   for p in (ROOT / top).rglob("__init__.py"))
    assert sorted(listed) == found
