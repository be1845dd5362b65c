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
from builder.targets.cuda.compile import record_variants, step_chunk
from runtime.backends.cuda.checking import CheckingLauncher, KernelMismatch
from runtime.backends.cuda.kernel_index import load, read_entries
from runtime.backends.cuda.launch import CubinLauncher
from runtime.backends.cuda.step import DeviceStep
from runtime.backends.step import StepMetadata
from runtime.format.engine_format import EngineDir, Manifest, map_rank_file
from runtime.format.kv_groups import KVGroups


def kernel_coverage(engine: Path, manifest: Manifest) -> str:
    """One line: every variant each rank's executor launches is among the engine's cubins (KilnError if not)."""
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


def cuda_logits(engine: Path, manifest: Manifest) -> tuple[Callable[[list[int]], torch.Tensor], list[str]]:
    """ids -> the last position's logits [V] through the cuda backend, and lines saying how it ran. On a GPU of the
    engine's kind: its cubins. Elsewhere: every kernel variant the engine holds is first run once in Triton's
    interpreter on the first layer of the build's step shapes and compared with its torch reference (check_kernels);
    then the whole program runs with those references, each launch checked against the engine's variants."""
    from runtime.backends.cuda.executor import CudaExecutor

    if manifest.world_size != 1:
        raise KilnError("verify: a cuda engine is verified on one rank; this one has "
                        f"{manifest.world_size} (run `engine-run generate` on its GPU host to check it)")
    compiled = load(engine)
    gpu = torch.cuda.is_available() and "{}.{}".format(*torch.cuda.get_device_capability()) == \
        manifest.cuda["compute_capability"]
    launcher = CubinLauncher(compiled, torch.device("cuda", 0)) if gpu else CheckingLauncher(allowed=set(compiled))
    block = manifest.block_size
    blocks = -(-manifest.limits.max_seq_len // block)
    executor = CudaExecutor(EngineDir(engine, manifest).load_rank(0), KVGroups((0,), (2 * blocks,)), block,
                            manifest.kv_dtype, manifest.activations, manifest.limits.max_seq_len, launcher,
                            device_logits=True)
    if gpu:
        lines = [f"logits computed by the cuda backend on this GPU ({manifest.cuda['arch']} cubins)"]
    else:
        lines = [check_kernels(executor, launcher, set(compiled), manifest),
                 "logits computed by the cuda backend's program with each kernel's torch reference (no GPU of its "
                 "kind here)"]

    def logits(ids: list[int]) -> torch.Tensor:
        n = len(ids)
        meta = StepMetadata(torch.tensor(ids), torch.arange(n), torch.arange(n),
                            torch.arange(blocks, dtype=torch.int32).unsqueeze(0), torch.tensor([n], dtype=torch.int32),
                            torch.tensor([0, n], dtype=torch.int32), torch.tensor([n - 1]))
        return executor.execute(meta)[0].cpu()

    return logits, lines


def check_kernels(executor, launcher, variants: set[str], manifest: Manifest) -> str:
    """Runs the build's step shapes (a prefill chunk beside a one-token query, a decode of the chunk's sequence,
    then a decode of both sequences, each with its device sampler's kernels: greedy, a grammar mask, log-probs)
    with real tokens through `launcher`, a CheckingLauncher: the first launch of each variant, in the first layer, runs in the interpreter and against its reference. One line, or a
    KilnError naming a kernel that differs or a variant no step launched."""
    from runtime.backends.cuda.sampler import launch_sampler_kernels

    block = manifest.block_size
    chunk = step_chunk(manifest.limits.max_num_tokens, manifest.limits.max_seq_len)
    tokens = torch.randint(manifest.vocab_size, (chunk + 2,), generator=torch.Generator().manual_seed(0))
    first, second = -(-(chunk + 1) // block), -(-manifest.limits.max_seq_len // block)
    tables = torch.tensor([list(range(first)), [second] + [-1] * (first - 1)], dtype=torch.int32)
    steps = [StepMetadata(tokens[:chunk + 1], torch.cat([torch.arange(chunk), torch.zeros(1, dtype=torch.int64)]),
                          torch.cat([torch.arange(chunk), second * block + torch.zeros(1, dtype=torch.int64)]), tables,
                          torch.tensor([chunk, 1], dtype=torch.int32), torch.tensor([0, chunk, chunk + 1],
                                                                                   dtype=torch.int32),
                          torch.tensor([chunk - 1, chunk])),
             StepMetadata(tokens[chunk + 1:], torch.tensor([chunk]), torch.tensor([chunk]), tables[:1],
                          torch.tensor([chunk + 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                          torch.tensor([0])),
             # both sequences again, one token each (the chunk's last position rewritten): a two-token step
             StepMetadata(tokens[chunk:], torch.tensor([chunk, 1]), torch.tensor([chunk, second * block + 1]),
                          tables, torch.tensor([chunk + 1, 2], dtype=torch.int32),
                          torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 1]))]
    try:
        for meta in steps:
            launch_sampler_kernels(launcher, executor.run(DeviceStep.of(meta, executor.device)).float())
    except KernelMismatch as exc:
        raise KilnError(f"verify: {exc}") from None
    missing = sorted(variants - set(launcher.checked))
    if missing:
        raise KilnError(f"verify: {len(missing)} kernel variant(s) of the engine were not launched by verify's steps "
                        f"({', '.join(missing[:3])}), so they could not be checked; rebuild the engine with this Kiln")
    worst = max(launcher.checked.values(), default=0.0)
    return (f"kernels: all {len(variants)} variants run in Triton's interpreter on the first layer of a "
            f"{chunk}-token prefill beside a decode, then decodes of one and two sequences, each within {worst:.2g} of its torch reference "
            "(relative to the largest value)")
