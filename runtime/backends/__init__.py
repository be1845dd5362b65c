"""Runtime backends: what runs an engine's ranks on this host. One module per backend, one table naming them.

A backend module (runtime/backends/<name>.py, or a package) provides:

    TARGETS          the engine targets it runs (a manifest's target.name)
    WINDOWED_POOLS   True when it gives sliding-window layers a KV pool of their own (runtime/kv_groups.py)
    DEFAULT_KV_GIB   the KV budget without --kv-cache-gib (None: the build's memory plan)
    GPU              True when each rank runs on its own GPU (chosen before the first NCCL collective)
    rank_files(path, manifest, entry)        the files of a rank it reads, as (path, sha256) pairs
    check_host(path, manifest)               EngineError, in one line, when this host cannot run the engine
    create_executor(engine, rank, pools, num_threads, collectives)   one rank's Executor

A target's own backend (the one of the same name) runs its engines by default; `BACKENDS` is the only place
that lists them, so a new backend is a module and one line here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = {
    "cpu": "runtime.backends.cpu",
    "onnxruntime": "runtime.backends.onnxruntime",
    "tensorrt": "runtime.backends.tensorrt",
    "cuda": "runtime.backends.cuda",
}


def backend(name: str) -> ModuleType:
    """The backend module of `name` (ValueError naming the known ones)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    return importlib.import_module(BACKENDS[name])


def backends_for(target: str) -> list[str]:
    """The backends that run `target`'s engines, the default (the target's own) last."""
    names = [name for name in BACKENDS if target in backend(name).TARGETS]
    return sorted(names, key=lambda name: name == target)
