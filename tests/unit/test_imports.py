"""Kiln's layers, read from its folders and checked on every module's imports (those inside functions too; those
under `if TYPE_CHECKING:` are annotations and run nothing):

  runtime/   the engine format and everything that runs an engine; imports neither builder nor passes (an engine
             runs without the compiler installed). Inside it, each folder stands on the ones before it in
             RUNTIME_LAYERS: format < ops and weights < core and backends < ranks < launcher < serving < cli.
  builder/   sources < graph < quant < planning (with the targets' registry) < measure < the build drivers
             (pipeline, emit, the targets' packages, build, verify, cli), in BUILDER_LAYERS.
  passes/    one compiler pass per file: builder's layers below the drivers, and runtime; only the drivers import
             passes.

And no import cycle anywhere: a module never reaches itself through the modules it imports.

An import of a Kiln module sits at the top of its file, where a reader and these checks see it, except for three
reasons (test_imports_inside_functions_have_a_reason):
  1. the imported module needs an optional dependency (an extra in pyproject.toml, OPTIONAL_DEPENDENCIES) when
     it is imported, itself or through the modules it imports at their top;
  2. the importer is an entry point (a cli module): `engine-build --help` imports only what it prints;
  3. a package's __init__ imports its own submodules when they are used: a target's or backend's package is its
     registry entry (capabilities as attributes, read without loading an executor), and runtime/_native loads
     its extension modules in order.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("builder", "passes", "runtime")
# lowest first; a module belongs to the longest prefix that names it ("=x": the module x itself, not below it)
RUNTIME_LAYERS = (("=runtime", "runtime._native", "runtime.format"),
                  ("runtime.ops", "runtime.weights", "runtime.trt_plugin"),
                  ("runtime.core", "runtime.backends"),
                  ("runtime.ranks",),
                  ("runtime.launcher",),
                  ("runtime.serving",),
                  ("runtime.measure", "runtime.cli_errors", "runtime.cli_hosts", "runtime.cli"))
BUILDER_LAYERS = (("=builder", "builder.errors"),
                  ("builder.sources",),
                  ("builder.graph",),
                  ("builder.quant",),
                  ("builder.planning", "=builder.targets"),
                  ("builder.measure",),
                  ("builder.pipeline", "builder.emit", "builder.engine_summary", "builder.targets", "builder.build",
                   "builder.verify", "builder.cli"))
DRIVERS = BUILDER_LAYERS[-1]
# pyproject.toml's optional dependencies (extras) -> the module each is imported as
OPTIONAL_DEPENDENCIES = {"triton": "triton", "cuda-bindings": "cuda", "onnx": "onnx", "onnxruntime": "onnxruntime",
                         "tensorrt-rtx-cu13-libs": "tensorrt_rtx", "tensorrt-rtx-cu13-bindings": "tensorrt_rtx",
                         "ray": "ray", "nvidia-ml-py": "pynvml", "matplotlib": "matplotlib",
                         "llama-cpp-python": "llama_cpp"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _annotation_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    """ast.walk, less the bodies of `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _annotation_only(node):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` imports, anywhere in the file. `from a import b` counts a.b when b is one of our
    submodules, and a when some name is not; relative imports are resolved against `module`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in _walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = {f"{base}.{alias.name}" for alias in node.names if is_our_module(f"{base}.{alias.name}")}
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(base)
    return found


def is_our_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def is_within(name: str, modules) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def layer(name: str) -> int | None:
    """The index of `name`'s layer in RUNTIME_LAYERS or BUILDER_LAYERS (None: outside them)."""
    best, index = "", None
    for i, prefixes in enumerate(RUNTIME_LAYERS if name.startswith("runtime") else BUILDER_LAYERS):
        for prefix in prefixes:
            exact = prefix.startswith("=")
            prefix = prefix.lstrip("=")
            if (name == prefix or not exact and name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    return index


def violations(importer: str, imported: set[str]) -> list[str]:
    broken = []
    for name in sorted(imported):
        if importer.startswith("runtime") and is_within(name, ("builder", "passes")):
            broken.append(f"{importer} imports {name}: runtime imports neither builder nor passes")
        elif importer.startswith("passes") and is_within(name, DRIVERS) and name != "builder.targets":
            broken.append(f"{importer} imports {name}: passes import builder's layers below the drivers only")
        elif (importer.startswith("builder") and is_within(name, ("passes",))
              and layer(importer) != len(BUILDER_LAYERS) - 1):
            broken.append(f"{importer} imports {name}: only the build drivers ({', '.join(DRIVERS)}) import passes")
        elif importer.split(".")[0] == name.split(".")[0] and importer.split(".")[0] in ("builder", "runtime"):
            mine, theirs = layer(importer), layer(name)
            if mine is None or theirs is None:
                broken.append(f"{importer} imports {name}: {importer if mine is None else name} is in no layer "
                              "(tests/unit/test_imports.py)")
            elif theirs > mine:
                broken.append(f"{importer} imports {name}: a layer above its own")
    return broken


def all_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def import_graph() -> dict[str, set[str]]:
    """Kiln's modules -> the Kiln modules each imports."""
    modules = {module_name(p): p for p in all_modules()}
    return {m: {d for d in imported_modules(p.read_text(), m, p.name == "__init__.py") if d in modules and d != m}
            for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack, on_stack, found = [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layers(package):
    broken = []
    for path in (p for p in all_modules() if p.relative_to(ROOT).parts[0] == package):
        module = module_name(path)
        broken += violations(module, imported_modules(path.read_text(), module, path.name == "__init__.py"))
    assert not broken, "\n".join(broken)


def test_no_module_reaches_itself_through_its_imports():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle_added_to_kilns_graph():
    graph = import_graph()
    assert cycles({**graph, "runtime.format.engine_format": graph["runtime.format.engine_format"] |
                   {"runtime.serving.app"}}) == [sorted(cycles_through(graph, "runtime.serving.app",
                                                                       "runtime.format.engine_format"))]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def cycles_through(graph: dict[str, set[str]], start: str, goal: str) -> set[str]:
    """The modules on some import path from start to goal, both included (what a goal -> start edge closes)."""
    reach_from, reach_to = _reachable(graph, start), _reachable(_reversed(graph), goal)
    return reach_from & reach_to


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for child in graph.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _reversed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {m: set() for m in graph}
    for m, deps in graph.items():
        for d in deps:
            out.setdefault(d, set()).add(m)
    return out


def test_the_walk_sees_imports_inside_functions_and_relative_ones():
    source = ("import torch\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.cli import app\n"
              "def f():\n    from passes.pack_weights import pack_graph\nfrom . import ir\n")
    found = imported_modules(source, "builder.graph.trace")
    assert found == {"torch", "typing", "passes.pack_weights", "builder.graph.ir"}
    assert [line.split(":")[0] for line in violations("builder.graph.trace", found)] == [
        "builder.graph.trace imports passes.pack_weights"]
    assert violations("runtime.core.engine", {"builder.planning.plan"}) and violations("passes.x", {"builder.build"})
    assert violations("runtime.format.engine_format", {"runtime.backends"})  # a layer above its own
    assert violations("builder.sources.hf", {"builder.graph.ir"})
    assert not violations("passes.x", {"builder.graph.ir", "runtime.ops.linear"})
    assert not violations("builder.build", {"passes.x"}) and not violations("runtime.cli", {"runtime.serving.app"})


def test_each_root_holds_its_entry_points_only():
    for package in ("builder", "runtime"):
        modules = sorted(p.name for p in (ROOT / package).glob("*.py"))
        assert len(modules) <= 8, f"{package}/ holds {len(modules)} modules: {modules}"


def test_files_stay_within_the_limits():
    """450 lines of Python, 700 of C, in the code's folders: a longer file is split by concern."""
    limits = {".py": 450, ".c": 700, ".h": 700}
    long = [f"{p.relative_to(ROOT)}: {n} lines" for package in PACKAGES for p in sorted((ROOT / package).rglob("*"))
            if p.suffix in limits and (n := len(p.read_text().splitlines())) > limits[p.suffix]]
    assert not long, "\n".join(long)


def top_level_imports(source: str, module: str, is_package: bool = False) -> tuple[set[str], list[tuple[int, set[str]]]]:
    """(the modules `source` imports at its top, [(line, modules) of each import statement inside a function])."""
    top: set[str] = set()
    inside: list[tuple[int, set[str]]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _annotation_only(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = imported_modules(ast.unparse(child), module, is_package)
                (inside.append((child.lineno, names)) if in_function else top.update(names))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return top, inside


def lazy_import_offences(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Imports of Kiln modules inside functions without one of the module doc's three reasons, in `sources`
    (module -> (source, is_package))."""
    parsed = {m: top_level_imports(src, m, package) for m, (src, package) in sources.items()}
    optional = set(OPTIONAL_DEPENDENCIES.values())

    def needs_optional(module: str) -> bool:
        """Importing `module` imports an optional dependency (through the tops of the modules, and the packages
        above them, it reaches)."""
        seen, todo = {module}, [module]
        while todo:
            here = todo.pop()
            parents = [".".join(here.split(".")[:i]) for i in range(1, here.count(".") + 1)]
            for name in (*parsed.get(here, ((), ()))[0], *parents):
                if name.split(".")[0] in optional:
                    return True
                if name in parsed and name not in seen:
                    seen.add(name)
                    todo.append(name)
        return False

    offences = []
    for module, (_, inside) in parsed.items():
        if module.split(".")[-1] == "cli":
            continue
        package = module if sources[module][1] else None
        for line, names in inside:
            for name in sorted(n for n in names if n in parsed and n != module):
                if needs_optional(name) or package and name.startswith(package + "."):
                    continue
                offences.append(f"{module}:{line} imports {name} inside a function: move it to the top (it needs no "
                                "optional dependency)")
    return offences


def test_imports_inside_functions_have_a_reason():
    sources = {module_name(p): (p.read_text(), p.name == "__init__.py") for p in all_modules()}
    assert not lazy_import_offences(sources), "\n".join(lazy_import_offences(sources))


def test_the_reasons_are_checked():
    sources = {"runtime.a": ("import triton\n", False), "runtime.b": ("import runtime.a\n", False),
               "runtime.c": ("def f():\n    import runtime.b\n    from runtime.d import x\n", False),
               "runtime.d": ("x = 1\n", False), "runtime.cli": ("def f():\n    import runtime.d\n", False),
               "runtime.e": ("def f():\n    from runtime.e import inner\n", True),
               "runtime.e.inner": ("", False)}
    assert lazy_import_offences(sources) == [
        "runtime.c:3 imports runtime.d inside a function: move it to the top (it needs no optional dependency)"]


def test_the_optional_dependencies_are_the_extras():
    """Every distribution an extra of pyproject.toml names (bar the test tools and Kiln's own extras) is in
    OPTIONAL_DEPENDENCIES, and nothing else is."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = {re.split(r"[\[<>=~! ]", spec)[0] for name, specs in extras.items() if name != "test" for spec in specs}
    assert named == set(OPTIONAL_DEPENDENCIES)
