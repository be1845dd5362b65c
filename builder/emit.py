"""Emit an engine directory: manifest.json, one rank{r}.engine per rank, tokenizer files, report.md.

Everything is written into a temporary sibling directory and renamed into place at the end, so a
failed build never leaves a half-written engine. The same inputs give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import jinja2
from importlib import resources
from tqdm import tqdm

from builder.errors import KilnError
from builder.graph.ir import Graph
from runtime import __version__
from runtime.format.engine_format import (
    FORMAT_VERSION,
    TOKENIZER_FILES,
    EngineError,
    Manifest,
    sha256_file,
    write_rank_file,
)


def build_id(model_identity: dict, plan: dict, passes: list[dict]) -> str:
    """Content hash of everything a build depends on; equal ids mean equal engines."""
    doc = {"kiln": __version__, "format": FORMAT_VERSION, "model": model_identity, "plan": plan,
           "passes": passes}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def is_up_to_date(out: Path, expected_id: str) -> bool:
    """True when `out` holds an intact engine with this build id (so the build can be skipped)."""
    try:
        manifest = Manifest.read(out)
    except (EngineError, OSError):
        return False
    if manifest.build_id != expected_id:
        return False
    files = [(r.file, r.sha256) for r in manifest.ranks if r.file]
    files += [(f"{r.onnx_dir}/{name}", digest) for r in manifest.ranks for name, digest in r.onnx_files]
    return all((out / f).is_file() and sha256_file(out / f) == digest for f, digest in files)


def check_output_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise KilnError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        what = "an engine built from other inputs" if (out / "manifest.json").is_file() else "other files"
        raise KilnError(f"--out {out}: directory exists and holds {what}; pass --force to replace it")


def emit(out: Path, graphs: list[Graph], model, manifest_base: dict, show_progress: bool = True,
         write_ranks=None) -> dict:
    """Write the engine into `out` (replacing it) and return the manifest.

    write_ranks(tmp, graphs) -> (rank entries, more manifest keys) writes a target's own rank files
    (the tensorrt target's); by default each rank's program and packed weights go into rank{r}.engine."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        if write_ranks is None:
            ranks, extras = write_rank_files(tmp, graphs, show_progress), {}
        else:
            ranks, extras = write_ranks(tmp, graphs)
        manifest = dict(manifest_base, ranks=ranks, **extras)
        memory = [g.meta["memory"] for g in graphs if "memory" in g.meta]
        shares = [_rank_share(rank, g) for rank, g in enumerate(graphs) if "shard" in g.meta]
        manifest = _complete(manifest, memory, shares, graphs[0].meta.get("accuracy"))
        _finish(tmp, model, manifest)
        tmp.chmod(0o755)  # mkdtemp makes it private; an engine is an ordinary readable directory
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _complete(manifest: dict, memory: list[dict], shares: list[dict], accuracy: dict | None) -> dict:
    if memory:
        manifest["memory"] = {"ranks": memory}
    if shares:
        manifest["sharding"] = {"ranks": shares}
    if accuracy:
        manifest["accuracy"] = accuracy
    return manifest


def _finish(directory: Path, model, manifest: dict) -> None:
    """The tokenizer, manifest.json and report.md beside the rank files (the manifest last but the report)."""
    model.write_tokenizer(directory)
    manifest["tokenizer_files"] = {name: sha256_file(directory / name) for name in TOKENIZER_FILES
                                   if (directory / name).is_file()}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (directory / "report.md").write_text(render_report(manifest))
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


# --------------------------------------------------------------------------------- one rank at a time (--rank)

PART = "rank{}.part.json"


def emit_rank(out: Path, graph: Graph, rank: int, world: int, manifest_base: dict) -> dict:
    """One rank of a build (--rank): rank{r}.engine and rank{r}.part.json (what the rank adds to the manifest) in
    `out`, beside other ranks' parts of the same build. Returns the part."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.engine"
    tmp = out / f".rank{rank}.engine.{os.getpid()}.tmp"
    try:
        _write_rank(tmp, rank, graph)
        tmp.chmod(0o644)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    part = {"build_id": manifest_base["build_id"], "rank": rank, "world_size": world,
            "entry": {"rank": rank, "file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)},
            "memory": graph.meta.get("memory"), "share": _rank_share(rank, graph) if "shard" in graph.meta else None}
    if rank == 0:  # the manifest's whole-program keys (the accuracy figures among them: the rank-0 build measures)
        part["manifest"] = dict(manifest_base)
    # in the manifest's own key order, which the report follows
    (out / PART.format(rank)).write_text(json.dumps(part, indent=2) + "\n")
    return part


def rank_up_to_date(out: Path, build_id: str, rank: int, world: int) -> dict | None:
    """The part of `rank` when `out` already holds it, for this build, with its rank file intact."""
    parts, _ = parts_state(out, build_id, world) if out.is_dir() else ([], [])
    part = next((p for p in parts if p["rank"] == rank), None)
    if part is None:
        return None
    path = out / part["entry"]["file"]
    return part if path.is_file() and sha256_file(path) == part["entry"]["sha256"] else None


def parts_state(out: Path, build_id: str, world: int) -> tuple[list[dict], list[int]]:
    """The parts in `out` of the build `build_id` (by rank) and the ranks still missing."""
    found: dict[int, dict] = {}
    for rank in range(world):
        try:
            part = json.loads((out / PART.format(rank)).read_text())
        except (OSError, ValueError):
            continue
        if part.get("build_id") == build_id and part.get("rank") == rank:
            found[rank] = part
    return [found[r] for r in sorted(found)], [r for r in range(world) if r not in found]


def check_parts_dir(out: Path, build_id: str, force: bool) -> None:
    """--out for a --rank build: empty, or holding parts of this same build; anything else needs --force."""
    if out.exists() and not out.is_dir():
        raise KilnError(f"--out {out}: exists and is not a directory")
    if not out.is_dir() or force:
        return
    for path in out.iterdir():
        if path.name.endswith(".part.json"):
            try:
                same = json.loads(path.read_text()).get("build_id") == build_id
            except (OSError, ValueError):
                same = False
            if not same:
                raise KilnError(f"--out {out}: {path.name} is part of another build; pass --force to write beside "
                                "it, or use another directory")
        elif not path.name.startswith("rank") or not path.name.endswith(".engine"):
            raise KilnError(f"--out {out}: directory holds other files ({path.name}); pass --force to write beside "
                            "them")


def assemble(out: Path, model, parts: list[dict], write_shared=None) -> dict:
    """The engine from every rank's part (each built alone with --rank): each rank file checked against its part,
    then the manifest, tokenizer and report written as a whole build writes them, and the parts removed.

    write_shared(out, rank files) -> more manifest keys: what the target's ranks share, written once (the cuda
    target's kernels)."""
    out = out.resolve()
    for part in parts:
        entry = part["entry"]
        path = out / entry["file"]
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            raise KilnError(f"assemble: {path} is missing or is not the file rank {part['rank']}'s build wrote "
                            "(its sha256 differs from its part's); build that rank again with --rank "
                            f"{part['rank']}")
    first = parts[0]
    extras = write_shared(out, [out / p["entry"]["file"] for p in parts]) if write_shared else {}
    manifest = dict(first["manifest"], ranks=[p["entry"] for p in parts], **extras)
    memory = [p["memory"] for p in parts if p["memory"]]
    shares = [p["share"] for p in parts if p["share"]]
    manifest = _complete(manifest, memory, shares, None)
    _finish(out, model, manifest)
    for part in parts:
        (out / PART.format(part["rank"])).unlink(missing_ok=True)
    return manifest


def write_rank_files(tmp: Path, graphs: list[Graph], show_progress: bool) -> list[dict]:
    """Each rank's program and weights into rank{r}.engine under tmp; the manifest's rank entries."""
    ranks = []
    for rank, graph in enumerate(tqdm(graphs, desc="writing ranks", unit="rank", disable=not show_progress)):
        path = tmp / f"rank{rank}.engine"
        _write_rank(path, rank, graph)
        ranks.append({"rank": rank, "file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    return ranks


def _rank_share(rank: int, graph: Graph) -> dict:
    """What one rank holds: its stage's layers and its share of heads, MLP columns and vocabulary."""
    return dict(rank=rank, tp_rank=graph.meta["mapping"]["tp_rank"], pp_rank=graph.meta["mapping"]["pp_rank"],
                layers=graph.meta["stage"]["layers"], **{k: v for k, v in graph.meta["shard"].items() if k != "tp_rank"})


def _write_rank(path: Path, rank: int, graph: Graph) -> None:
    """Stream one rank's weights into its file: each tensor is loaded, written and released in turn."""
    weights = {name: (w.dtype, w.shape) for name, w in graph.weights.items()}
    try:
        write_rank_file(path, rank, graph.to_json(), weights, lambda name: graph.tensors[name])
    except ValueError as exc:  # a tensor other than the program declares
        raise KilnError(str(exc)) from None


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
