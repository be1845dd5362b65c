"""Emit an engine directory: manifest.json, one rank{r}.engine per rank, tokenizer files, report.md.

Everything is written into a temporary sibling directory and renamed into place at the end, so a
failed build never leaves a half-written engine. The same inputs give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import jinja2
import torch
from importlib import resources
from tqdm import tqdm

from builder.errors import KilnError
from builder.ir import TORCH_DTYPES, Graph
from runtime import FORMAT_VERSION, RANK_FORMAT, __version__
from runtime.engine_dir import sha256_file


def build_id(model_identity: dict, plan: dict, passes: list[dict]) -> str:
    """Content hash of everything a build depends on; equal ids mean equal engines."""
    doc = {"kiln": __version__, "format": FORMAT_VERSION, "model": model_identity, "plan": plan,
           "passes": passes}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def is_up_to_date(out: Path, expected_id: str) -> bool:
    """True when `out` holds an intact engine with this build id (so the build can be skipped)."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("build_id") != expected_id:
        return False
    return all((out / r["file"]).is_file() and sha256_file(out / r["file"]) == r["sha256"]
               for r in manifest.get("ranks", []))


def check_output_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise KilnError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        what = "an engine built from other inputs" if (out / "manifest.json").is_file() else "other files"
        raise KilnError(f"--out {out}: directory exists and holds {what}; pass --force to replace it")


def emit(out: Path, graphs: list[Graph], model, manifest_base: dict, show_progress: bool = True) -> dict:
    """Write the engine into `out` (replacing it) and return the manifest."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        ranks = []
        for rank, graph in enumerate(tqdm(graphs, desc="writing ranks", unit="rank", disable=not show_progress)):
            path = tmp / f"rank{rank}.engine"
            _write_rank(path, rank, graph)
            ranks.append({"rank": rank, "file": path.name, "bytes": path.stat().st_size,
                          "sha256": sha256_file(path)})
        model.write_tokenizer(tmp)
        manifest = dict(manifest_base, ranks=ranks)
        memory = [g.meta["memory"] for g in graphs if "memory" in g.meta]
        if memory:
            manifest["memory"] = {"ranks": memory}
        shares = [_rank_share(rank, g) for rank, g in enumerate(graphs) if "shard" in g.meta]
        if shares:
            manifest["sharding"] = {"ranks": shares}
        accuracy = graphs[0].meta.get("accuracy")
        if accuracy:
            manifest["accuracy"] = accuracy
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        (tmp / "report.md").write_text(render_report(manifest))
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp makes it private; an engine is an ordinary readable directory
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _rank_share(rank: int, graph: Graph) -> dict:
    """What one rank holds: its stage's layers and its share of heads, MLP columns and vocabulary."""
    return dict(rank=rank, tp_rank=graph.meta["mapping"]["tp_rank"], pp_rank=graph.meta["mapping"]["pp_rank"],
                layers=graph.meta["stage"]["layers"], **{k: v for k, v in graph.meta["shard"].items() if k != "tp_rank"})


def _write_rank(path: Path, rank: int, graph: Graph) -> None:
    """Stream one rank's weights into its file: each tensor is loaded, written and released in turn."""
    metadata = {"kiln.format": RANK_FORMAT, "kiln.format_version": str(FORMAT_VERSION),
                "kiln.rank": str(rank), "kiln.program": graph.to_json()}
    specs = {name: (TORCH_DTYPES[w.dtype], w.shape) for name, w in graph.weights.items()}
    with SafetensorsWriter(path, specs, metadata) as writer:
        for name in sorted(specs):
            writer.write(name, graph.tensors[name])


SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
    torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.float8_e4m3fn: "F8_E4M3",
}


class SafetensorsWriter:
    """A safetensors file written one tensor at a time, in sorted name order, from a header of types.

    The header is sorted (the library's own writer orders metadata by hash), so equal inputs give
    equal bytes.
    """

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple]], metadata: dict[str, str]):
        self.specs, self.order = specs, sorted(specs)
        header: dict = {"__metadata__": metadata}
        offset = 0
        for name in self.order:
            dtype, shape = specs[name]
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
        self.file = open(path, "wb")
        self.file.write(len(blob).to_bytes(8, "little"))
        self.file.write(blob)
        self.written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.written >= len(self.order) or name != self.order[self.written]:
            raise KilnError(f"rank file: tensor {name!r} written out of order")
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise KilnError(f"rank file: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)} but the "
                            f"program declares {dtype} {tuple(shape)} (a pass recorded the wrong type)")
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        self.written += 1

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.file.close()
        if exc_type is None and self.written != len(self.order):
            raise KilnError(f"rank file: {len(self.order) - self.written} tensor(s) were never written")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    with SafetensorsWriter(path, specs, metadata) as writer:
        for name in sorted(tensors):
            writer.write(name, tensors[name])


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def render_report(manifest: dict) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    template = env.from_string((resources.files("templates") / "report.md.j2").read_text())
    rows = _flatten(manifest["plan"])
    return template.render(manifest=manifest, plan_rows=rows)


def _flatten(doc: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for key, value in doc.items():
        if isinstance(value, dict):
            rows += _flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", json.dumps(value) if not isinstance(value, str) else value))
    return rows


def read_rank_program(path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(program JSON, tensors) of a rank file, for inspect and verify."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        program = f.metadata()["kiln.program"]
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return program, tensors
