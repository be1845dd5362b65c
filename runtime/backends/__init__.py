"""Runtime backends: what runs an engine's ranks on this host. One module per backend, one table naming them.

A backend module (runtime/backends/<name>.py, or a package) provides:

    TARGETS          the engine targets it runs (a manifest's target.name)
    WINDOWED_POOLS   True when it gives sliding-window layers a KV pool of their own (runtime/format/kv_groups.py)
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
from pathlib import Path
from types import ModuleType

from runtime.format.engine_format import EngineDir, EngineError, Manifest, sha256_file

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


module = backend  # for the functions below, whose `backend` argument is a name


def backends_for(target: str) -> list[str]:
    """The backends that run `target`'s engines, the default (the target's own) last."""
    names = [name for name in BACKENDS if target in backend(name).TARGETS]
    return sorted(names, key=lambda name: name == target)


def open_engine(path: str | Path, world_size: int | None = None, check_hashes: bool = True,
                backend: str | None = None) -> EngineDir:
    """Open an engine directory for this runtime: format, target, world size and rank files checked.

    backend: what runs it (runtime/backends; None: the target's own, e.g. "cpu" for cpu engines); "onnxruntime"
    runs a tensorrt engine's ONNX on the CPU, and checks those files instead."""
    path = Path(path)
    if not path.is_dir():
        raise EngineError(f"{path}: no such engine directory (build one with `engine-build build --out {path}`)")
    manifest = Manifest.read(path)
    backend = check_target(path, manifest, backend)
    ranks = manifest.ranks
    if world_size is not None and world_size != len(ranks):
        raise EngineError(f"{path}: the engine has {len(ranks)} rank(s) but was started with world size "
                          f"{world_size}; start it with {len(ranks)} rank(s)")
    check_files(path, manifest, backend, check_hashes)
    return EngineDir(path, manifest, backend)


def check_files(path: Path, manifest: Manifest, backend: str | None = None, check_hashes: bool = True) -> None:
    """The files `backend` reads, and the tokenizer files, are there and, with check_hashes, match the manifest's
    sha256; every file the manifest lists with backend None."""
    names = [backend] if backend else backends_for(manifest.target)
    for entry in manifest.ranks:
        files = dict.fromkeys(f for name in names for f in module(name).rank_files(path, manifest, entry))
        for file, digest in files:
            if not file.is_file():
                raise EngineError(f"{path}: rank {entry.rank} file {file.relative_to(path)} is missing; "
                                  "rebuild the engine")
            if check_hashes and sha256_file(file) != digest:
                raise EngineError(f"{file}: sha256 does not match the manifest (corrupt or modified); "
                                  "rebuild the engine")
    for name, digest in manifest.tokenizer_files:
        file = path / name
        if not file.is_file():
            raise EngineError(f"{path}: tokenizer file {name} is missing; rebuild the engine")
        if check_hashes and sha256_file(file) != digest:
            raise EngineError(f"{file}: sha256 does not match the manifest (the tokenizer, chat template or sampling "
                              "defaults were changed after the build); rebuild the engine")


def check_target(path: Path, manifest: Manifest, backend: str | None = None) -> str:
    """The backend that runs this engine here (EngineError, in one line, when none can)."""
    allowed = backends_for(manifest.target)
    if not allowed:
        raise EngineError(f"{path}: built for the {manifest.target!r} target, which this runtime does not run")
    backend = backend or allowed[-1]
    if backend not in allowed:
        raise EngineError(f"{path}: a {manifest.target} engine runs with --backend {' or '.join(allowed)}, "
                          f"not {backend}")
    module(backend).check_host(path, manifest)
    return backend
