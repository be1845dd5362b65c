"""Ahead-of-time kernels of a cuda build: which variants the ranks launch, compiled by Triton into cubins.

The variants are found by running the cuda executor itself over `meta` tensors with a RecordingLauncher: a
prefill chunk (long enough to take the GEMM kernels) beside a decode, two decodes, then a decode alone (a
linear's kernel depends on whether a step has 1, up to 8 or more tokens). Nothing is computed
and no GPU is needed; the variants are exactly those the executor asks for at serving time, since every kernel
specialises on the model's constants, never on a step's token count. Each is then compiled for the plan's
compute capability (Triton's cross-compiler: no GPU here either) and written into the engine with its hash.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch
from tqdm import tqdm

import runtime.backends.cuda as backend
from builder.emit import write_rank_files
from builder.errors import KilnError
from builder.graph.ir import TORCH_DTYPES, Graph
from builder.planning.plan import Plan, load_devices
from builder.targets.cuda.arches import ARCHES
from runtime.backends.cuda.kernel_index import INDEX, write_index
from runtime.backends.cuda.launch import CompiledKernel, RecordingLauncher
from runtime.backends.step import StepMetadata
from runtime.format.engine_format import RankFile, map_rank_file
from runtime.format.kv_groups import KVGroups
from runtime.ranks.collectives import DTYPES


def find_triton():
    """Triton, which compiles the kernels (the gpu extra), or a KilnError saying how to get it."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to keep it quiet
    try:
        import triton
    except ImportError:
        raise KilnError("the cuda target compiles its kernels with Triton, which is not installed: "
                        "pip install -e '.[gpu]'") from None
    return triton


def kernel_fingerprint() -> str:
    """sha256 of what decides a cuda engine's cubins: the backend's kernel and launch sources (the variants the
    executor asks for follow from them) and Triton's version."""
    import hashlib

    root = Path(backend.__file__).parent
    digest = hashlib.sha256(find_triton().__version__.encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def kernel_writer(plan: Plan, show_progress: bool):
    """emit's write_ranks for the cuda target: each rank's file, then the kernels every rank launches."""

    def write_ranks(tmp: Path, graphs: list[Graph]) -> tuple[list[dict], dict]:
        ranks = write_rank_files(tmp, graphs, show_progress)
        return ranks, write_kernels(tmp, plan, graphs, show_progress)

    return write_ranks


def shared_writer(plan: Plan, show_progress: bool):
    """emit.assemble's write_shared for the cuda target: ranks built alone (--rank) each wrote their own file; the
    kernels every rank launches are found from those files' programs and compiled once, as a whole build does."""

    def write_shared(out: Path, rank_files: list[Path]) -> dict:
        graphs = [Graph.from_json(map_rank_file(path).program) for path in rank_files]
        return write_kernels(out, plan, graphs, show_progress)

    return write_shared


def write_kernels(directory: Path, plan: Plan, graphs: list[Graph], show_progress: bool) -> dict:
    """The kernels the ranks' programs launch, compiled for the plan's device into `directory`; the manifest's
    "cuda" section."""
    triton = find_triton()
    cc = load_devices()[plan.device].compute_capability
    variants = {}
    for graph in graphs:
        variants.update(record_variants(graph, plan))
    started = time.perf_counter()
    compiled = [compile_variant(kernel, variant, cc)
                for kernel, variant in tqdm(variants.values(), desc=f"compiling kernels for {cc}", unit="kernel",
                                            disable=not show_progress)]
    header = {"arch": ARCHES[cc], "compute_capability": cc, "triton": triton.__version__}
    if show_progress:  # printed, not recorded: a rebuild stays byte-identical
        tqdm.write(f"compiled {len(compiled)} kernels for {ARCHES[cc]} with Triton {triton.__version__} in "
                   f"{time.perf_counter() - started:.1f} s")
    digest = write_index(directory, header, compiled)
    section = dict(header, index=INDEX, index_sha256=digest, kernels=len(compiled),
                   cubin_bytes=sum(len(c.cubin) for c in compiled),
                   widened=sorted({n for g in graphs for n in g.meta.get("cuda_weights", {}).get("widened", [])}))
    return {"cuda": section}


def record_variants(graph: Graph, plan: Plan) -> dict:
    """variant key -> (Kernel, Variant) of every kernel one rank's executor launches."""
    from runtime.backends.cuda.executor import CudaExecutor

    tensors = {name: torch.empty(w.shape, dtype=TORCH_DTYPES[w.dtype], device="meta")
               for name, w in graph.weights.items()}
    launcher = RecordingLauncher()
    limits = plan.limits
    sizes = {"T": 0, "N": 0}  # the running step's tokens and logits rows, for what a later stage receives
    executor = CudaExecutor(RankFile(graph.to_json(), tensors), KVGroups((0,), (4,)), plan.kv_cache.block_size,
                            plan.kv_cache.dtype, plan.quant.activations, limits.max_seq_len, launcher,
                            collectives=_meta_collectives(sizes), device_logits=plan.world_size == 1)
    chunk = step_chunk(limits.max_num_tokens, limits.max_seq_len)
    for lens in ([chunk, 1], [1, 1], [1]):  # GEMMs, the GEMVs of a few tokens, those of one
        sizes.update(T=sum(lens), N=len(lens))
        executor.run_meta(_step(lens, plan.kv_cache.block_size))
    return {key: (launcher.kernels[key], v) for key, v in launcher.seen.items()}


def step_chunk(max_num_tokens: int, max_seq_len: int) -> int:
    """The prefill chunk of the step shapes the build records (and verify checks): long enough for the GEMM
    kernels, within the plan's limits."""
    return max(1, min(64, max_num_tokens - 1, max_seq_len - 1))


def _step(query_lens: list[int], block_size: int) -> StepMetadata:
    """A step whose sequences have these query lengths (values are placeholders: only shapes reach the kernels)."""
    total = sum(query_lens)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    widest = -(-max(query_lens) // block_size)
    return StepMetadata(torch.zeros(total, dtype=torch.int64), torch.arange(total), torch.arange(total),
                        torch.zeros(len(query_lens), widest, dtype=torch.int32),
                        torch.tensor(query_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                        torch.tensor([s - 1 for s in starts[1:]]))


def _meta_collectives(sizes: dict) -> dict:
    """Shape-only stand-ins for the collectives of a dry run (the values are never read)."""
    return {"all_reduce": lambda x, attrs: x, "all_gather": lambda x, attrs: x,
            "send": lambda x, attrs: None,
            "recv": lambda attrs: torch.empty([sizes.get(d, d) for d in attrs["shape"]], dtype=DTYPES[attrs["dtype"]],
                                              device="meta")}


def compile_variant(kernel, variant, compute_capability: str):
    """One variant compiled by Triton for a compute capability: a CompiledKernel holding its cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    major, minor = (int(x) for x in compute_capability.split("."))
    runtime = dict(variant.signature)
    constexprs = dict(variant.constexprs)
    names = kernel.arg_names()
    signature = {n: ("constexpr" if n in constexprs else runtime[n]) for n in names}
    # every pointer 16-byte aligned: the launchers check it (runtime/backends/cuda/launch.py)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    source = triton.compiler.ASTSource(JITFunction(kernel.fn), signature, constexprs, attrs)
    try:
        out = triton.compile(source, target=GPUTarget("cuda", major * 10 + minor, 32),
                             options={"num_warps": variant.num_warps, "num_stages": variant.num_stages})
    except Exception as exc:  # noqa: BLE001 - Triton's compile errors are many types; name the kernel
        raise KilnError(f"compiling kernel {variant.name} {constexprs} for {compute_capability}: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    md = out.metadata
    ptx = out.asm["ptx"]
    entry = ptx[ptx.index(f".entry {md.name}("):]
    num_params = len(re.findall(r"\.param\s", entry[:entry.index(")")]))
    return CompiledKernel(variant, md.name, md.num_warps, md.shared, num_params, md.global_scratch_size,
                          out.asm["cubin"])
