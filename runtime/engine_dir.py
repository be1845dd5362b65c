"""Open an engine directory: check the manifest against this runtime and memory-map rank files."""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime import ENGINE_FORMAT, FORMAT_VERSION, RANK_FORMAT

SAFETENSORS_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
    "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn,
}


class EngineError(Exception):
    """An engine this runtime cannot run; the message says why and what to do."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass
class RankFile:
    program: str                      # the rank's IR as JSON
    tensors: dict[str, torch.Tensor]  # views into the memory-mapped file


@dataclass
class EngineDir:
    path: Path
    manifest: dict

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    @property
    def plan(self) -> dict:
        return self.manifest["plan"]

    def load_rank(self, rank: int) -> RankFile:
        entry = self.manifest["ranks"][rank]
        return map_rank_file(self.path / entry["file"])


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def open_engine(path: str | Path, world_size: int | None = None, check_hashes: bool = True) -> EngineDir:
    path = Path(path)
    if not path.is_dir():
        raise EngineError(f"{path}: no such engine directory (build one with `engine-build build --out {path}`)")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise EngineError(f"{path}: no manifest.json; not a Kiln engine directory") from None
    except ValueError as exc:
        raise EngineError(f"{path}/manifest.json: corrupt ({exc}); rebuild the engine") from None
    if manifest.get("format") != ENGINE_FORMAT:
        raise EngineError(f"{path}: manifest format {manifest.get('format')!r} is not {ENGINE_FORMAT!r}")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise EngineError(f"{path}: engine format version {version} is newer than this runtime supports "
                          f"({FORMAT_VERSION}); upgrade Kiln or rebuild the engine with this version")
    _check_target(path, manifest["target"])
    ranks = manifest["ranks"]
    if world_size is not None and world_size != len(ranks):
        raise EngineError(f"{path}: the engine has {len(ranks)} rank(s) but was started with world size "
                          f"{world_size}; start it with {len(ranks)} rank(s)")
    for entry in ranks:
        file = path / entry["file"]
        if not file.is_file():
            raise EngineError(f"{path}: rank {entry['rank']} file {entry['file']} is missing; rebuild the engine")
        if check_hashes and sha256_file(file) != entry["sha256"]:
            raise EngineError(f"{file}: sha256 does not match the manifest (corrupt or modified); rebuild the engine")
    return EngineDir(path, manifest)


def _check_target(path: Path, target: dict) -> None:
    if target["name"] != "cpu":
        raise EngineError(f"{path}: built for the {target['name']!r} target; this runtime runs 'cpu' engines")
    missing = sorted(set(target.get("requires", {}).get("cpu_flags", [])) - cpu_flags())
    if missing:
        raise EngineError(f"{path}: this CPU lacks {', '.join(missing)}, which the engine's kernels need; "
                          "run it on a CPU that has them")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def map_rank_file(path: Path) -> RankFile:
    """Parse a safetensors rank file and return zero-copy tensors over a private memory map."""
    with open(path, "rb") as f:
        try:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        except (struct.error, ValueError) as exc:
            raise EngineError(f"{path}: not a readable rank file ({exc}); rebuild the engine") from None
        # ACCESS_COPY: pages are shared with the page cache until written, and nothing is ever written.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    meta = header.pop("__metadata__", {})
    if meta.get("kiln.format") != RANK_FORMAT:
        raise EngineError(f"{path}: not a Kiln rank file (format {meta.get('kiln.format')!r})")
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        count = (end - start) // torch.empty(0, dtype=dtype).element_size()
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start) if count else \
            torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(info["shape"])
    return RankFile(meta["kiln.program"], tensors)
