"""Import rules between builder/, passes/ and runtime/, checked on every module's imports (those
inside functions too), so that each layer stands on the ones below it only:

  runtime/         the engine format and everything that runs an engine. Imports neither builder
                   nor passes: an engine runs without the compiler installed.
  builder/ (lower) the IR, plans, model sources, tracing, weight math, calibration: what passes
                   build on. May import runtime; never imports passes.
  passes/          one compiler pass per file. Imports builder's lower layer (and runtime), never
                   the build drivers.
  build drivers    builder.pipeline, build, emit, verify, cli and the targets (builder/targets: each
                   owns its passes): they assemble and run the passes,
                   and are the only builder modules that import passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("builder", "passes", "runtime")
DRIVERS = ("builder.pipeline", "builder.build", "builder.emit", "builder.verify", "builder.cli", "builder.targets")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` imports, anywhere in the file. `from a import b` counts a, and a.b when
    b is one of our submodules; relative imports are resolved against `module`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if is_our_module(f"{base}.{alias.name}"))
    return found


def is_our_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def is_within(name: str, modules) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def violations(importer: str, imported: set[str]) -> list[str]:
    broken = []
    for name in sorted(imported):
        if importer.startswith("runtime") and is_within(name, ("builder", "passes")):
            broken.append(f"{importer} imports {name}: runtime imports neither builder nor passes")
        elif importer.startswith("passes") and is_within(name, DRIVERS):
            broken.append(f"{importer} imports {name}: passes import builder's lower layer only")
        elif (importer.startswith("builder") and is_within(name, ("passes",))
              and not is_within(importer, DRIVERS)):
            broken.append(f"{importer} imports {name}: only the build drivers ({', '.join(DRIVERS)}) import passes")
    return broken


def all_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layers(package):
    broken = []
    for path in (p for p in all_modules() if p.relative_to(ROOT).parts[0] == package):
        module = module_name(path)
        broken += violations(module, imported_modules(path.read_text(), module, path.name == "__init__.py"))
    assert not broken, "\n".join(broken)


def test_the_walk_sees_imports_inside_functions_and_relative_ones():
    source = "import torch\ndef f():\n    from passes.pack_weights import pack_graph\nfrom . import ir\n"
    found = imported_modules(source, "builder.calibration")
    assert found == {"torch", "passes.pack_weights", "builder", "builder.ir"}
    assert [line.split(":")[0] for line in violations("builder.calibration", found)] == [
        "builder.calibration imports passes.pack_weights"]
    assert violations("runtime.engine", {"builder.mapping"}) and violations("passes.x", {"builder.build"})
    assert not violations("passes.x", {"builder.ir", "runtime.qlinear"})
    assert not violations("builder.build", {"passes.x"})
