"""Numerical verification of a tensorrt-target build, with no GPU: every rank's ONNX under ONNX Runtime
against Kiln's cpu engine built from the same quantized program, on the same steps.

The ranks run stitched together in one process, one thread each: their exchanges (all_reduce,
all_gather, send/recv) meet in an in-process group. The reference is the whole program before
sharding, packed for the cpu target, with the plan's KV cache dtype. The steps cover what a
serving step holds: a prefill of two sequences that end mid-block on scattered blocks, a decode
of both, and a mixed step (a decode, a chunk of a longer prompt, a new prompt).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from builder.errors import KilnError
from builder.graph.ir import Graph
from builder.quant.packing import pack_graph
from runtime.format.engine_format import RankFile
from runtime.backends.cpu.executor import CpuExecutor
from runtime.format.mapping import Mapping
from runtime.backends.onnxruntime.executor import OnnxRank
from runtime.backends.step import StepMetadata

NUM_BLOCKS = 64


@dataclass
class Verification:
    max_abs_logit_diff: float = 0.0
    max_abs_logit: float = 0.0       # of the reference, for scale
    top1_agreement: float = 1.0      # share of logits rows whose argmax is the reference's
    steps: list[dict] = field(default_factory=list)

    def record(self) -> dict:
        return {"reference": "cpu target, same quantized program", "runner": "onnxruntime (CPU)",
                "max_abs_logit_diff": round(self.max_abs_logit_diff, 6), "max_abs_logit": round(self.max_abs_logit, 3),
                "top1_agreement": round(self.top1_agreement, 4), "steps": self.steps}


class StepPlanner:
    """Step metadata for a script of steps over sequences with scattered KV blocks."""

    def __init__(self, vocab_size: int, block_size: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.vocab = vocab_size
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}

    def step(self, work: list[tuple[int, int]]) -> StepMetadata:
        """work: (sequence id, new tokens) in packing order; every sequence's last token gets logits."""
        ids, positions, slots, context, starts, logits = [], [], [], [], [0], []
        for seq, count in work:
            tokens = self.tokens.setdefault(seq, [])
            table = self.tables.setdefault(seq, [])
            start = self.computed.get(seq, 0)
            while len(tokens) < start + count:
                tokens.append(self.rng.randrange(self.vocab))
            while len(table) * self.block_size < start + count:
                table.append(self.free.pop())
            for p in range(start, start + count):
                ids.append(tokens[p])
                positions.append(p)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            self.computed[seq] = start + count
            context.append(start + count)
            starts.append(starts[-1] + count)
            logits.append(starts[-1] - 1)
        width = max(len(self.tables[seq]) for seq, _ in work)
        tables = torch.full((len(work), width), -1, dtype=torch.int32)
        for row, (seq, _) in enumerate(work):
            tables[row, :len(self.tables[seq])] = torch.tensor(self.tables[seq], dtype=torch.int32)
        return StepMetadata(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), tables,
                            torch.tensor(context, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                            torch.tensor(logits))


def standard_steps(vocab_size: int, block_size: int) -> list[tuple[str, StepMetadata]]:
    planner = StepPlanner(vocab_size, block_size)
    return [
        ("prefill", planner.step([(0, 5), (1, block_size + 3)])),
        ("decode", planner.step([(0, 1), (1, 1)])),
        ("mixed", planner.step([(1, 1), (2, 2 * block_size + 1), (0, 3)])),
        ("decode", planner.step([(2, 1), (0, 1), (1, 1)])),
    ]


class LocalGroup:
    """The ranks' exchanges inside one process: all_reduce and all_gather over each tensor-parallel
    group, send/recv between pipeline stages."""

    def __init__(self, tp: int, pp: int):
        self.tp, self.pp = tp, pp
        self.barriers = [threading.Barrier(tp) for _ in range(pp)]
        self.pieces: dict[tuple[int, int], np.ndarray] = {}
        self.mailboxes: dict[tuple[int, int], list] = {}
        self.ready = threading.Condition()

    def exchange_for(self, rank: int):
        mapping = Mapping(self.tp, self.pp, rank)
        stage, tp_rank = mapping.pp_rank, mapping.tp_rank

        def exchange(op: str, attrs: dict, value):
            if op in ("all_reduce", "all_gather"):
                barrier = self.barriers[stage]
                self.pieces[(stage, tp_rank)] = value.astype(np.float32)
                barrier.wait()
                pieces = [self.pieces[(stage, r)] for r in range(self.tp)]
                result = sum(pieces[1:], pieces[0].copy()) if op == "all_reduce" else np.concatenate(pieces, -1)
                barrier.wait()  # nobody overwrites a piece before every rank has read them all
                return result
            if op == "send":
                with self.ready:
                    self.mailboxes.setdefault((rank, attrs["dst"]), []).append(value.astype(np.float32))
                    self.ready.notify_all()
                return None
            with self.ready:  # recv
                box = self.mailboxes.setdefault((attrs["src"], rank), [])
                if not self.ready.wait_for(lambda: box, timeout=120):
                    raise KilnError(f"verify: rank {rank} waited 120 s for a value from rank {attrs['src']}")
                return box.pop(0)

        return exchange


def run_stitched(ranks: list[OnnxRank], tp: int, pp: int, meta: StepMetadata) -> np.ndarray:
    """One step on every rank at once; the logits of rank 0 (the last stage's logits reach it by send
    in a real run; here the last stage's first rank's are returned)."""
    group = LocalGroup(tp, pp)
    results: list = [None] * len(ranks)
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            results[r] = ranks[r].run(meta, group.exchange_for(r))
        except BaseException as exc:  # noqa: BLE001 - reported below, with the rank
            errors.append(KilnError(f"verify: rank {r}: {' '.join(str(exc).split())[:300]}"))
            for barrier in group.barriers:
                barrier.abort()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    last_stage_first = (pp - 1) * tp
    return results[last_stage_first]


def cpu_reference(graph: Graph, activations: str, kv_dtype: str, block_size: int) -> CpuExecutor:
    """Kiln's cpu engine of the same program: packed in memory, never written."""
    packed = pack_graph(graph, activations)
    tensors = {name: packed.tensors[name].contiguous() for name in packed.weights}
    return CpuExecutor(RankFile(packed.to_json(), tensors), NUM_BLOCKS, block_size, kv_dtype, serving=False)


@torch.inference_mode()
def verify_ranks(reference: CpuExecutor, rank_dirs: list[Path], tp: int, pp: int, vocab_size: int,
                 block_size: int) -> Verification:
    ranks = [OnnxRank(d, NUM_BLOCKS, num_threads=1 if len(rank_dirs) > 1 else None) for d in rank_dirs]
    result = Verification()
    agree = rows = 0
    for kind, meta in standard_steps(vocab_size, block_size):
        expected = reference.execute(meta).clone().numpy()
        got = run_stitched(ranks, tp, pp, meta)
        diff = float(np.nan_to_num(np.abs(got - expected), nan=np.inf).max())  # a NaN logit fails, never hides
        same = int((got.argmax(-1) == expected.argmax(-1)).sum())
        agree, rows = agree + same, rows + len(expected)
        result.max_abs_logit_diff = max(result.max_abs_logit_diff, diff)
        result.max_abs_logit = max(result.max_abs_logit, float(np.abs(expected).max()))
        result.steps.append({"step": kind, "tokens": int(meta.token_ids.numel()),
                             "sequences": int(meta.context_lens.numel()), "max_abs_logit_diff": round(diff, 6)})
    result.top1_agreement = agree / rows
    return result
