"""`engine-build verify` of a cuda engine: its kernels cover what its program launches, and its logits, computed
by the cuda backend itself (on this host's GPU when it is the engine's, else in Triton's interpreter), match the
reference model's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from builder.errors import KilnError
from builder.graph.ir import Graph
from builder.planning.plan import plan_from_dict
from runtime.format.engine_format import EngineDir, Manifest
from runtime.format.kv_groups import KVGroups
from runtime.backends.step import StepMetadata


def kernel_coverage(engine: Path, manifest: Manifest) -> str:
    """One line: every variant each rank's executor launches is among the engine's cubins (KilnError if not)."""
    from builder.targets.cuda.compile import record_variants
    from runtime.backends.cuda.kernel_index import read_entries
    from runtime.format.engine_format import map_rank_file

    index = read_entries(engine)
    plan = plan_from_dict(json.loads((engine / "manifest.json").read_text())["plan"], f"{engine}/manifest.json")
    needed = {}
    for entry in manifest.ranks:
        program, _ = map_rank_file(engine / entry.file)
        needed.update(record_variants(Graph.from_json(program), plan))
    missing = sorted(set(needed) - set(index["kernels"]))
    if missing:
        raise KilnError(f"verify: {engine}: the program launches {len(missing)} kernel variant(s) the engine has not "
                        f"compiled ({', '.join(missing[:3])}); rebuild the engine with this Kiln")
    return (f"kernels: {len(index['kernels'])} cubins for {index['arch']} (Triton {index['triton']}), every variant "
            "the program launches among them")


def cuda_logits(engine: Path, manifest: Manifest) -> tuple[Callable[[list[int]], torch.Tensor], str]:
    """ids -> the last position's logits [V] through the cuda backend, and where it ran."""
    from runtime.backends.cuda.executor import CudaExecutor
    from runtime.backends.cuda.kernel_index import load
    from runtime.backends.cuda.launch import CubinLauncher, InterpreterLauncher

    if manifest.world_size != 1:
        raise KilnError("verify: a cuda engine is verified on one rank; this one has "
                        f"{manifest.world_size} (run `engine-run generate` on its GPU host to check it)")
    compiled = load(engine)
    gpu = torch.cuda.is_available() and "{}.{}".format(*torch.cuda.get_device_capability()) == \
        manifest.cuda["compute_capability"]
    launcher = CubinLauncher(compiled, torch.device("cuda", 0)) if gpu else InterpreterLauncher(allowed=set(compiled))
    block = manifest.block_size
    blocks = -(-manifest.limits.max_seq_len // block)
    executor = CudaExecutor(EngineDir(engine, manifest).load_rank(0), KVGroups((0,), (blocks,)), block,
                            manifest.kv_dtype, manifest.activations, manifest.limits.max_seq_len, launcher)

    def logits(ids: list[int]) -> torch.Tensor:
        n = len(ids)
        meta = StepMetadata(torch.tensor(ids), torch.arange(n), torch.arange(n),
                            torch.arange(blocks, dtype=torch.int32).unsqueeze(0), torch.tensor([n], dtype=torch.int32),
                            torch.tensor([0, n], dtype=torch.int32), torch.tensor([n - 1]))
        return executor.execute(meta)[0].cpu()

    where = (f"on this GPU ({manifest.cuda['arch']} cubins)" if gpu
             else "in Triton's interpreter (no GPU of its kind here)")
    return logits, where
