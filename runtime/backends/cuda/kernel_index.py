"""The compiled kernels of a cuda engine: kernels/index.json and one cubin per variant.

index.json: {"arch": "sm_90a", "compute_capability": "9.0", "triton": "3.9.0",
             "kernels": {variant key: {"file", "sha256", "function", "num_warps", "shared", "num_params",
                                       "global_scratch", "variant": Variant.to_dict()}}}
The manifest's "cuda" section names the index and its sha256; the index names each cubin's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from runtime.backends.cuda.launch import CompiledKernel, Variant

INDEX = "kernels/index.json"


def write_index(root: Path, header: dict, kernels: list[CompiledKernel]) -> str:
    """Write the cubins and index under root; the index's sha256."""
    (root / "kernels").mkdir(parents=True, exist_ok=True)
    entries = {}
    for ck in sorted(kernels, key=lambda c: c.variant.key):
        name = f"kernels/{ck.variant.key}.cubin"
        (root / name).write_bytes(ck.cubin)
        entries[ck.variant.key] = {"file": name, "sha256": hashlib.sha256(ck.cubin).hexdigest(),
                                   "function": ck.function, "num_warps": ck.num_warps, "shared": ck.shared,
                                   "num_params": ck.num_params, "global_scratch": ck.global_scratch,
                                   "variant": ck.variant.to_dict()}
    text = json.dumps(dict(header, kernels=entries), indent=1, sort_keys=True) + "\n"
    (root / INDEX).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def read_entries(root: Path) -> dict:
    return json.loads((root / INDEX).read_text())


def files(root: Path, section: dict) -> list[tuple[Path, str]]:
    """(path, sha256) of the index and every cubin it lists (the index first: it names the others)."""
    listed = [(root / INDEX, section["index_sha256"])]
    index = root / INDEX
    if index.is_file():
        listed += [(root / e["file"], e["sha256"]) for e in read_entries(root)["kernels"].values()]
    return listed


def load(root: Path) -> dict[str, CompiledKernel]:
    """Every compiled kernel of the engine at root, by variant key."""
    out = {}
    for key, e in read_entries(root)["kernels"].items():
        out[key] = CompiledKernel(Variant.from_dict(e["variant"]), e["function"], e["num_warps"], e["shared"],
                                  e["num_params"], e["global_scratch"], (root / e["file"]).read_bytes())
    return out
