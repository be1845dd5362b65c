"""The engine format: what `engine-build` writes and `engine-run` reads, in one place.

An engine is a directory: manifest.json (format id and version, model, plan, per-rank memory plan
and file hashes) and one rank{r}.engine per rank, a safetensors file whose metadata holds the rank's
program. The builder writes both with this module and the runtime parses them once into a frozen
`Manifest`; nothing else reads the manifest's JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from runtime.format.kv_groups import KVGroups, PoolSizing, group_windows, pool_blocks, shared_pools
from runtime.format.special_tokens import SpecialTokens

ENGINE_FORMAT = "kiln-engine"
# What the runtime reads beside the rank files to tokenize, render chats and default sampling: hashed in the
# manifest's "tokenizer_files" as the rank files are, so a changed template or vocabulary is refused like a changed
# weight (engines built before carry none and are taken as they are)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
RANK_FORMAT = "kiln-rank"
# Bump when this runtime can no longer read older engines the same way. 2: IR nodes carry their
# layer, and the weight formats were reorganised.
FORMAT_VERSION = 2

GIB = 1 << 30

# The compute capabilities TensorRT for RTX 1.x compiles for and runs on, with its enum names. Its
# runtime refuses any other GPU: on an H100 (9.0) an engine built for 8.0, 8.9 or 12.0 fails to
# deserialize ("TensorRT-RTX does not support this compute capability"), measured on a lent H100.
TENSORRT_RTX_TARGETS = {"7.5": "SM75", "8.0": "SM80", "8.6": "SM86", "8.9": "SM89", "12.0": "SM120",
                        "12.1": "SM121"}

# IR dtype name -> (torch dtype, safetensors dtype name)
_DTYPES = {
    "f32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16"), "f16": (torch.float16, "F16"),
    "i8": (torch.int8, "I8"), "u8": (torch.uint8, "U8"), "i32": (torch.int32, "I32"),
    "i64": (torch.int64, "I64"), "f8e4m3": (torch.float8_e4m3fn, "F8_E4M3"),
}
TORCH_DTYPES = {name: dtype for name, (dtype, _) in _DTYPES.items()}
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
SAFETENSORS_NAMES = {dtype: st for dtype, st in _DTYPES.values()}
SAFETENSORS_DTYPES = {st: dtype for dtype, st in _DTYPES.values()}

# KV cache dtype (plan [kv_cache] dtype) -> the torch dtype it is stored in; int8/fp8 store k / kv_scale.
KV_CACHE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
                   "fp8": torch.float8_e4m3fn, "int8": torch.int8}


class EngineError(Exception):
    """An engine this runtime cannot run; the message says why and what to do."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# ---------------------------------------------------------------------- KV cache sizes

def kv_bytes_per_token(attention_layers: Iterable[dict], kv_dtype: str) -> int:
    """Bytes one token takes in the K and V caches of these attention layers (their node attrs)."""
    elements = sum(2 * a["num_kv_heads"] * a["head_dim"] for a in attention_layers)
    return elements * KV_CACHE_DTYPES[kv_dtype].itemsize


# ---------------------------------------------------------------------- the manifest

@dataclass(frozen=True)
class RankEntry:
    rank: int
    file: str | None  # relative to the engine directory; None: a tensorrt build with --onnx-only, not compiled yet
    bytes: int
    sha256: str | None
    onnx_dir: str | None = None                      # tensorrt target: the rank's ONNX segments and weights
    onnx_files: tuple[tuple[str, str], ...] = ()     # (file in onnx_dir, sha256)


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory plan (passes/plan_memory.py)."""

    kv_blocks: int            # blocks the build's budget left room for (the first KV group's: runtime/format/kv_groups.py)
    kv_bytes_per_token: int   # 0 on a rank without attention layers
    kv_window_blocks: int = 0           # the windowed layers' own pool, when the rank has full layers too
    kv_window_bytes_per_token: int = 0  # the windowed layers' share of kv_bytes_per_token
    kv_windowed: bool = False           # the build priced windowed layers by their window (False: as full layers)


@dataclass(frozen=True)
class PlanLimits:
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int


@dataclass(frozen=True)
class Manifest:
    format_version: int
    build_id: str
    model_name: str
    model_source: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    target: str
    cpu_flags: tuple[str, ...]        # the target's required instruction sets
    compute_capability: str | None    # tensorrt target: the GPU it was compiled for ("8.0")
    tensorrt: dict | None             # tensorrt target: {"flavour", "version"} that compiled it (None: not compiled)
    world_size: int
    tp: int
    pp: int
    limits: PlanLimits
    block_size: int                   # tokens per KV block
    kv_dtype: str                     # a key of KV_CACHE_DTYPES
    ranks: tuple[RankEntry, ...]
    memory: tuple[RankMemory, ...]    # per rank
    model_config: dict                # the model's shapes (builder.sources.model.ModelConfig.to_dict)
    activations: str                  # the path the program is packed with: the plan's (auto: f32)
    special_tokens: SpecialTokens | None = None  # BOS/EOS around raw text; None: an engine built before the rule
    cuda: dict | None = None          # cuda target: its compiled kernels (runtime/backends/cuda/kernel_index.py)
    trt_plugin: dict | None = None    # tensorrt target: the PagedAttention plugin ({"library", "sha256", ...})
    trt_kernels: dict | None = None   # tensorrt target: the plugin's compiled kernels (as `cuda`)
    ep: int = 1                       # expert parallelism (builder.planning.plan.Plan.ep)
    activation_modes: tuple[str, ...] = ()  # the paths the build's gate allows (auto; else the one built)
    tokenizer_files: tuple[tuple[str, str], ...] = ()  # (TOKENIZER_FILES name, sha256); () before they were hashed

    @property
    def group(self) -> int:
        """Ranks a pipeline stage has (builder.planning.plan.Plan.group): the collectives' group."""
        return max(self.tp, self.ep)

    @staticmethod
    def read(path: Path) -> Manifest:
        """The manifest of engine directory `path`, checked for this runtime's format and version."""
        try:
            text = (path / "manifest.json").read_text()
        except FileNotFoundError:
            raise EngineError(f"{path}: no manifest.json; not a Kiln engine directory") from None
        return Manifest.parse(text, path)

    @staticmethod
    def parse(text: str, path: Path | str) -> Manifest:
        """A manifest's text (of the engine at `path`, a directory or a URL, named in errors), checked as read()."""
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise EngineError(f"{path}/manifest.json: corrupt ({exc}); rebuild the engine") from None
        if not isinstance(doc, dict):
            raise EngineError(f"{path}/manifest.json: not a Kiln engine manifest")
        if doc.get("format") != ENGINE_FORMAT:
            raise EngineError(f"{path}: manifest format {doc.get('format')!r} is not {ENGINE_FORMAT!r}")
        version = doc.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise EngineError(f"{path}: engine format version {version} is newer than this runtime supports "
                              f"({FORMAT_VERSION}); upgrade Kiln or rebuild the engine with this version")
        if version < FORMAT_VERSION:
            raise EngineError(f"{path}: engine format version {version} is older than this runtime reads "
                              f"({FORMAT_VERSION}); rebuild it with `engine-build build --force --out {path} ...` "
                              f"(the same model and plan)")
        try:
            return Manifest._from_doc(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{path}/manifest.json: corrupt (bad or missing {exc}); rebuild the engine") from None

    @staticmethod
    def _from_doc(doc: dict) -> Manifest:
        model, plan, kv = doc["model"], doc["plan"], doc["plan"]["kv_cache"]
        limits = plan["limits"]
        return Manifest(
            format_version=doc["format_version"], build_id=doc["build_id"], model_name=model["name"],
            model_source=model["source"], vocab_size=int(model["config"]["vocab_size"]),
            eos_token_ids=tuple(model["config"]["eos_token_ids"]), target=doc["target"]["name"],
            cpu_flags=tuple(doc["target"].get("requires", {}).get("cpu_flags", [])),
            compute_capability=doc["target"].get("requires", {}).get("compute_capability"),
            tensorrt=doc["target"].get("tensorrt"),
            world_size=int(doc["world_size"]), tp=int(plan["tp"]), pp=int(plan["pp"]),
            limits=PlanLimits(int(limits["max_batch_size"]), int(limits["max_num_tokens"]),
                              int(limits["max_seq_len"])),
            block_size=int(kv["block_size"]), kv_dtype=kv["dtype"],
            ranks=tuple(RankEntry(int(r["rank"]), r.get("file"), int(r.get("bytes", 0)), r.get("sha256"),
                                  r.get("onnx", {}).get("dir"), tuple(sorted(r.get("onnx", {}).get("files", {}).items())))
                        for r in doc["ranks"]),
            memory=tuple(RankMemory(int(m["kv_blocks"]), int(m["kv_bytes_per_token"]), int(m.get("kv_window_blocks", 0)),
                                    int(m.get("kv_window_bytes_per_token", 0)), "kv_window_bytes_per_token" in m)
                         for m in doc["memory"]["ranks"]),
            model_config=dict(model["config"]), activations=_built_activations(plan["quant"].get("activations", "f32")),
            special_tokens=SpecialTokens.from_dict(model["special_tokens"]) if "special_tokens" in model else None,
            cuda=doc.get("cuda"), trt_plugin=((doc.get("tensorrt") or {}).get("plugins") or [None])[0],
            trt_kernels=(doc.get("tensorrt") or {}).get("kernels"), ep=int(plan.get("ep", 1)),
            activation_modes=tuple((doc.get("activation_choice") or {}).get("allowed")
                                   or [_built_activations(plan["quant"].get("activations", "f32"))]),
            tokenizer_files=tuple(sorted((doc.get("tokenizer_files") or {}).items())))

    def kv_groups(self, kv_cache_gib: float | None, windowed: bool = True) -> KVGroups:
        """The KV pools every rank allocates (the scheduler hands out one block id space per group): the build's
        memory plan, or what kv_cache_gib holds, on the rank that fits the fewest. windowed=False (a runner that
        reads every layer through one block table) prices windowed layers as full ones, in one pool."""
        priced = any(m.kv_windowed and m.kv_window_bytes_per_token for m in self.memory)
        windows = group_windows(self.model_config.get("layer_windows") or ()) if windowed and priced else (0,)
        has_layers = [(m.kv_bytes_per_token > m.kv_window_bytes_per_token, m.kv_window_bytes_per_token > 0)
                      if len(windows) == 2 else (m.kv_bytes_per_token > 0,) for m in self.memory]
        if kv_cache_gib is None:
            if priced and windows == (0,):
                raise EngineError("this engine's memory plan prices its sliding-window layers by their window, "
                                  "not for one pool: give this runner a KV budget (kv_cache_gib)")
            return shared_pools(windows, [(m.kv_blocks, m.kv_window_blocks)[:len(windows)] for m in self.memory],
                                has_layers)
        sizing = PoolSizing(self.block_size, self.limits.max_batch_size, self.limits.max_num_tokens,
                            self.limits.max_seq_len)
        groups = shared_pools(windows, [pool_blocks(kv_cache_gib * GIB, m.kv_bytes_per_token - m.kv_window_bytes_per_token,
                                                    m.kv_window_bytes_per_token, windows, sizing)
                                        for m in self.memory], has_layers)
        if min(groups.num_blocks) < 1:
            where = (f"({self.memory[0].kv_bytes_per_token * self.block_size} bytes each)" if self.world_size == 1
                     else "on some rank")
            raise EngineError(f"kv_cache_gib={kv_cache_gib} holds no KV block {where}; raise it")
        return groups


def manifest_header(kiln_version: str) -> dict:
    """The keys that open every manifest: what format it is and which Kiln wrote it."""
    return {"format": ENGINE_FORMAT, "format_version": FORMAT_VERSION, "kiln_version": kiln_version}


# ---------------------------------------------------------------------- an engine directory

class RankFile(NamedTuple):
    program: str                      # the rank's IR as JSON
    tensors: dict[str, torch.Tensor]  # views into the memory-mapped file


def _built_activations(planned: str) -> str:
    """The path a plan's program is packed with: auto packs f32, the serving host picks (runtime/backends/activations.py)."""
    return "f32" if planned == "auto" else planned


@dataclass(frozen=True)
class EngineDir:
    path: Path
    manifest: Manifest
    backend: str | None = None        # what runs it here (runtime.backends.open_engine's choice)
    activation_choice: object = None  # runtime.backends.activations.HostChoice: the path this host runs (None: as built)

    def load_rank(self, rank: int) -> RankFile:
        return map_rank_file(self.path / self.manifest.ranks[rank].file)


def cpu_flags() -> set[str]:
    """The instruction sets this CPU reports (empty where /proc/cpuinfo is not readable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------- rank files

def write_rank_file(path: Path, rank: int, program: str, weights: dict[str, tuple[str, tuple]],
                    load: Callable[[str], torch.Tensor]) -> None:
    """Stream one rank's program and weights ({name: (IR dtype, shape)}) into a rank file.

    The tensors are loaded with `load(name)`, written and released one at a time, in sorted name
    order. The header is sorted too (the safetensors library orders metadata by hash), so equal
    inputs give equal bytes. ValueError when a loaded tensor is not what `weights` declares.
    """
    metadata = {"kiln.format": RANK_FORMAT, "kiln.format_version": str(FORMAT_VERSION),
                "kiln.rank": str(rank), "kiln.program": program}
    order = sorted(weights)
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in order:
        dtype, shape = TORCH_DTYPES[weights[name][0]], weights[name][1]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in order:
            dtype, shape = TORCH_DTYPES[weights[name][0]], tuple(weights[name][1])
            tensor = load(name)
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(f"rank file: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)} but the "
                                 f"program declares {dtype} {shape} (a pass recorded the wrong type)")
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def map_rank_file(path: Path) -> RankFile:
    """Parse a rank file and return zero-copy tensors over a private memory map."""
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
        count = (end - start) // dtype.itemsize
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start) if count else \
            torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(info["shape"])
    return RankFile(meta["kiln.program"], tensors)
