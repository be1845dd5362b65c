"""Engines as artifacts: a host that does not hold an engine directory is given its URL (http:// or https://, any
static file server: `python -m http.server` in the folder above it, or object storage behind HTTP) and keeps a copy
in Kiln's cache, one per build id, checked against the manifest's sha256 before it is used.

A copy is fetched file by file into a folder of its own and renamed into place only when every file is there and
its sha256 matches the manifest, so an interrupted fetch leaves nothing that looks complete. A cached copy is
checked again each time it is used: a corrupt, modified or missing file is refused in one line naming it and the
copy to remove. The manifest hashes every file the engine's backends read
(rank files, kernels, plugin) and its tokenizer files; the report, and the tokenizer files of an engine built
before they were hashed, are taken as served."""

from __future__ import annotations

import hashlib
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

from runtime.backends import backend as backend_module
from runtime.backends import backends_for
from runtime.format.cache import cache_root
from runtime.format.engine_format import TOKENIZER_FILES, EngineError, Manifest, sha256_file

COMPANIONS = TOKENIZER_FILES + ("report.md",)  # fetched unchecked where the manifest has no sha256 for them
CHUNK = 1 << 20


def is_url(engine: str | Path) -> bool:
    return str(engine).startswith(("http://", "https://"))


def local_engine(engine: str | Path) -> str:
    """A local engine directory for `engine`: itself when it is a path, else its cached copy (fetched if needed)."""
    if not is_url(engine):
        return str(engine)
    base = str(engine).rstrip("/") + "/"
    raw = _get(base + "manifest.json")
    manifest = Manifest.parse(raw.decode("utf-8", errors="replace"), base.rstrip("/"))
    target = cache_root() / "engines" / manifest.build_id
    if (target / "manifest.json").is_file():
        for path, digest in _hashed_files(target, manifest):
            if not path.is_file() or sha256_file(path) != digest:
                raise EngineError(f"{path}: the cached copy of {base.rstrip('/')} is corrupt or partial (sha256 does "
                                  f"not match its manifest); remove {target} to fetch it again")
        return str(target)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for path, digest in _hashed_files(partial, manifest):
            _download(base + path.relative_to(partial).as_posix(), path, digest)
        hashed = dict(manifest.tokenizer_files)
        for name in COMPANIONS:
            if name in hashed:
                continue  # fetched and checked with the hashed files
            try:
                (partial / name).write_bytes(_get(base + name))
            except EngineError:
                if name == "tokenizer.json":
                    raise
        (partial / "manifest.json").write_bytes(raw)  # last: a copy without it is never used
        try:
            partial.rename(target)
        except OSError:  # another process put the same build in place first
            if not (target / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return str(target)


def _hashed_files(root: Path, manifest: Manifest) -> list[tuple[Path, str]]:
    """Every file any backend of the engine's target reads, and the hashed tokenizer files, with their sha256."""
    files: dict[Path, str] = {root / name: digest for name, digest in manifest.tokenizer_files}
    for name in backends_for(manifest.target):
        for entry in manifest.ranks:
            files.update(dict(backend_module(name).rank_files(root, manifest, entry)))
    return sorted(files.items())


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise EngineError(f"cannot fetch {url}: {getattr(exc, 'reason', exc)}") from None


def _download(url: str, path: Path, digest: str) -> None:
    """url into path, refused in one line unless its sha256 is `digest`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(path, "wb") as out:
            while block := response.read(CHUNK):
                sha.update(block)
                out.write(block)
    except (urllib.error.URLError, OSError) as exc:
        raise EngineError(f"cannot fetch {url}: {getattr(exc, 'reason', exc)}") from None
    if sha.hexdigest() != digest:
        raise EngineError(f"{url}: sha256 does not match the engine's manifest (corrupt or modified at the source); "
                          "nothing was kept")
