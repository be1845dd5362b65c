"""The wheel holds every package of the tree and nothing else: pyproject.toml's find rules, applied the way
setuptools applies them, give each folder of Kiln's that has an __init__.py."""

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("builder", "passes", "runtime", "plans", "templates")


def test_the_find_rules_give_every_package_and_only_kilns():
    rules = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    listed = find_packages(str(ROOT), include=rules["include"])
    found = sorted(".".join(p.parent.relative_to(ROOT).parts) for top in TOPS for p in (ROOT / top).rglob("__init__.py"))
    assert sorted(listed) == found
    assert not any(name.split(".")[0] in ("tests", "benchmarks") for name in listed)
