"""A graph run as Kiln's cpu engine runs it, for the build's measures: many sequences a step through the C
kernels and the paged KV cache, not a Python program a sequence (and a token) at a time.

Two runners, one interface (`execute(meta)` -> the logits rows named by meta.logits_indices):

- `WholeRunner`: the graph packed once, as the engine would hold it (the quantized graph, whose weights the build
  holds anyway; a float reference that fits the budget).
- `LayerRunner`: the graph cut into one stage a layer (the first with the embedding, the last with the head), each
  stage's weights read, packed and bound when a step reaches it and let go after, while its KV pool stays. One
  layer's weights are resident at a time, whatever the model's size, for a few seconds more a step. Spilled (a
  quantized graph, whose weights would be quantized and packed again at every read): each stage's packed weights
  are made once, written to a scratch folder and mapped from there each step, so the page cache holds them, not
  the build.

On top of them, `Sequences` places independent sequences in one KV pool, and two uses: `forced_logits` (given
tokens, the logits at chosen positions, a step at a time: perplexity and KL windows, a quantized model reading a
reference answer), and `greedy` (every prompt decoded greedily together, a decode step for all of them at once).
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from builder.graph.cuts import layer_stages
from builder.graph.ir import Graph
from builder.sources.lazy_tensors import LazyTensors
from builder.quant.packing import pack_graph
from runtime.backends.activations import with_activations
from runtime.format.engine_format import RankFile
from runtime.backends.cpu.executor import CpuExecutor, KVCacheStorage
from runtime.format.kv_groups import KVGroups
from runtime.ops.program import attention_layers
from runtime.backends.step import StepMetadata

BLOCK_SIZE = 16
# Tokens a prefill step packs. A whole runner keeps every op's output buffer at the step's size, so its steps
# are small (SmolLM2: as fast as 1024); a layer-at-a-time runner reads every weight again each step and holds one
# layer's activations, so its steps are large.
STEP_TOKENS = 64
LAYER_STEP_TOKENS = 1024


def _rank_file(graph: Graph, activations: str) -> RankFile:
    packed = pack_graph(graph, activations)
    return RankFile(packed.to_json(), {name: packed.tensors[name].contiguous() for name in packed.weights})


class WholeRunner:
    """The whole graph packed and bound once (its weights resident)."""

    step_tokens = STEP_TOKENS

    def __init__(self, graph: Graph | RankFile, blocks: int, kv_dtype: str = "f32", activations: str = "f32"):
        self.rank_file = graph if isinstance(graph, RankFile) else _rank_file(graph, activations)
        self.blocks = blocks
        self.executor = CpuExecutor(self.rank_file, blocks, BLOCK_SIZE, kv_dtype, serving=False)
        # No step replay: a tape keeps every value of its step alive (hundreds of MB for a prefill with all its
        # logits), and these steps are few and large, where replay gains nothing.
        self.executor.replay = False

    def exact(self) -> WholeRunner:
        """The same packed weights run exactly: f32 activations (no integer paths) and an f32 cache."""
        return WholeRunner(RankFile(_exact_program(self.rank_file.program), self.rank_file.tensors), self.blocks)

    def execute(self, meta: StepMetadata) -> torch.Tensor:
        return self.executor.execute(meta)


def _exact_program(program: str) -> str:
    """A packed program with its integer activation paths dropped: its nodes compute on f32 activations."""
    return json.dumps(with_activations(json.loads(program), "f32"))


class LayerRunner:
    """The graph a layer at a time: each step binds each stage in turn (weights read from the graph's tensors, which
    a streaming build reads from the model source) and drops it, handing the values that cross to the next stage.

    shared: tensors another runner holds or maps anyway (a quantized graph's float embedding table, say), by name: a
    tensor, or a function that reads it; a weight of this graph with the same name and the same values is read from
    there instead of from the source every step. same: whether a name is known to hold the same values without
    reading it (both read from the same source call). spill: a folder to write each stage's packed weights to,
    once, and map them from every step (see the module's docstring)."""

    step_tokens = LAYER_STEP_TOKENS

    def __init__(self, graph: Graph, blocks: int, kv_dtype: str = "f32", activations: str = "f32",
                 shared: dict | None = None, same=None, spill: Path | None = None):
        self.activations, self.kv_dtype, self.blocks = activations, kv_dtype, blocks
        graph = graph.replace()
        for name, tensor in (shared or {}).items():
            mine = graph.weights.get(name)
            read = tensor if callable(tensor) else None
            tensor = read() if read else tensor
            if mine is not None and tuple(mine.shape) == tuple(tensor.shape) and tensor.dtype == torch.float32 \
                    and ((same is not None and same(name)) or torch.equal(graph.tensors[name], tensor)):
                if read is not None and hasattr(graph.tensors, "bind"):
                    graph.tensors.bind(name, read)  # read when a stage is bound, not held
                else:
                    graph.tensors[name] = tensor
            del tensor
        # each stage's packed program, once; its weights are read again every step
        self.stages = [pack_graph(stage, activations) for stage in layer_stages(graph)]
        self.programs = [stage.to_json() for stage in self.stages]
        self.caches = self._caches(kv_dtype)
        self.files: dict[str, Path] | None = None  # where a spilled runner wrote each weight
        if spill is not None:
            self._spill(Path(spill))

    def _caches(self, kv_dtype: str) -> list[KVCacheStorage]:
        groups = KVGroups((0,), (self.blocks,))
        return [KVCacheStorage(attention_layers(json.loads(doc)), groups, BLOCK_SIZE, kv_dtype)
                for doc in self.programs]

    def _spill(self, folder: Path) -> None:
        """Each stage's packed weights made once (a weight two stages read, in the first's file), written to
        `folder`, and let go."""
        folder.mkdir(parents=True, exist_ok=True)
        self.files = {}
        for index, stage in enumerate(self.stages):
            fresh = {name: stage.tensors[name].contiguous() for name in stage.weights if name not in self.files}
            if fresh:
                path = folder / f"stage{index}.pt"
                torch.save(fresh, path)
                self.files.update(dict.fromkeys(fresh, path))
            del fresh
        for stage in self.stages:  # read from the files from now on: let go of the packers' memos
            stage.tensors = LazyTensors()

    def mapped(self, name: str):
        """A function that maps a spilled weight from its file when called (None: not spilled)."""
        if self.files is None or name not in self.files:
            return None
        return functools.partial(_mapped, self.files[name], name)

    def exact(self) -> LayerRunner:
        """The same packed weights run exactly: f32 activations (no integer paths) and an f32 cache."""
        other = copy.copy(self)
        other.activations, other.kv_dtype = "f32", "f32"
        other.programs = [_exact_program(doc) for doc in self.programs]
        other.caches = other._caches("f32")
        return other

    def _weights(self, stage: Graph) -> dict[str, torch.Tensor]:
        if self.files is None:
            return {name: stage.tensors[name].contiguous() for name in stage.weights}
        tensors = {}
        for path in {self.files[name] for name in stage.weights}:
            tensors.update((n, t) for n, t in _load_mapped(path).items() if n in stage.weights)
        return tensors

    def execute(self, meta: StepMetadata) -> torch.Tensor:
        handed: list[torch.Tensor] = []
        for stage, program, cache in zip(self.stages, self.programs, self.caches):
            received, handed = handed, []
            collectives = {"recv": lambda attrs, box=received: box.pop(0),
                           "send": lambda x, attrs, box=handed: box.append(x.clone())}
            tensors = self._weights(stage)
            executor = CpuExecutor(RankFile(program, tensors), self.blocks, BLOCK_SIZE, self.kv_dtype, collectives,
                                   cache=cache, serving=False)
            executor.replay = False  # bound for one step: nothing to replay
            del tensors
            logits = executor.execute(meta)  # the last stage's buffer, which no later step reuses
            executor.program = None  # its hooks refer back to it: let its weights go now, not at a collection
            del executor
        return logits


def _load_mapped(path: Path) -> dict[str, torch.Tensor]:
    # mapped, not read: a page counts toward the build's memory while a stage uses it, and not after
    return torch.load(path, mmap=True, weights_only=True)


def _mapped(path: Path, name: str) -> torch.Tensor:
    return _load_mapped(path)[name]


@dataclass
class Work:
    """One sequence's part of a step: its tokens from position `start`, and the rows (indices into `tokens`)
    whose logits are wanted."""

    seq: int
    tokens: list[int]
    start: int
    rows: list[int]


class Sequences:
    """Independent sequences of known greatest lengths, each with its own run of blocks in one pool."""

    def __init__(self, lengths: list[int]):
        self.tables, first = [], 0
        for length in lengths:
            count = max(1, math.ceil(length / BLOCK_SIZE))
            self.tables.append(list(range(first, first + count)))
            first += count
        self.blocks = first

    def meta(self, work: list[Work]) -> StepMetadata:
        ids, positions, slots, context, starts, logits = [], [], [], [], [0], []
        for w in work:
            table = self.tables[w.seq]
            ids += w.tokens
            for p in range(w.start, w.start + len(w.tokens)):
                positions.append(p)
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            logits += [starts[-1] + r for r in w.rows]
            context.append(w.start + len(w.tokens))
            starts.append(starts[-1] + len(w.tokens))
        width = max(math.ceil(c / BLOCK_SIZE) for c in context)
        tables = torch.full((len(work), width), -1, dtype=torch.int32)
        for row, w in enumerate(work):
            used = self.tables[w.seq][:width]
            tables[row, :len(used)] = torch.tensor(used, dtype=torch.int32)
        return StepMetadata(torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                            torch.tensor(slots, dtype=torch.int64), tables,
                            torch.tensor(context, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                            torch.tensor(logits, dtype=torch.int64))


def prefill_steps(sequences: list[list[int]], rows: list[list[int]], step_tokens: int = STEP_TOKENS
                  ) -> Iterator[list[Work]]:
    """The sequences' tokens packed into steps of at most step_tokens (a longer sequence in chunks, in order),
    each chunk asking for the wanted rows (positions in its sequence) it holds."""
    step: list[Work] = []
    room = step_tokens
    for seq, (ids, wanted) in enumerate(zip(sequences, rows)):
        start = 0
        while start < len(ids):
            count = min(room, len(ids) - start)
            step.append(Work(seq, ids[start:start + count], start,
                             [r - start for r in wanted if start <= r < start + count]))
            start += count
            room -= count
            if room == 0:
                yield step
                step, room = [], step_tokens
    if step:
        yield step


def forced_logits(runners: list, sequences: list[list[int]], rows: list[list[int]],
                  step_tokens: int | None = None) -> Iterator[tuple[int, list[int], list[torch.Tensor]]]:
    """Every runner over the same steps of the given tokens (of the runners' smallest step_tokens unless given);
    for each sequence's part of a step, in order: (the sequence's index, the positions whose logits were asked for
    in `rows`, [those logits rows of each runner]). A step's logits are held for all runners at once and for no
    longer (they are the runners' buffers: valid until their next step)."""
    step_tokens = step_tokens or min(r.step_tokens for r in runners)
    place = Sequences([len(s) for s in sequences])
    for work in prefill_steps(sequences, rows, step_tokens):
        meta = place.meta(work)
        outputs = [runner.execute(meta) for runner in runners]
        at = 0
        for w in work:
            if w.rows:
                yield w.seq, [w.start + r for r in w.rows], [out[at:at + len(w.rows)] for out in outputs]
            at += len(w.rows)


def greedy(runner, prompts: list[list[int]], max_new: int, stop: set[int], step_tokens: int | None = None,
           on_step=None) -> list[list[int]]:
    """Each prompt's greedy continuation, all decoded together: up to max_new tokens, ending after the first token
    in `stop` (as a decoder that stops at end-of-sequence would). on_step(): called after each token position."""
    place = Sequences([len(p) + max_new for p in prompts])
    out: list[list[int]] = [[] for _ in prompts]
    lasts = [[len(p) - 1] for p in prompts]
    for work in prefill_steps(prompts, lasts, step_tokens or runner.step_tokens):
        logits = runner.execute(place.meta(work))
        at = 0
        for w in work:
            if w.rows:
                out[w.seq].append(int(logits[at].argmax()))
                at += 1
    if on_step:
        on_step()

    def running(i: int) -> bool:
        return len(out[i]) < max_new and out[i][-1] not in stop

    active = [i for i in range(len(prompts)) if running(i)]
    while active:
        work = [Work(i, out[i][-1:], len(prompts[i]) + len(out[i]) - 1, [0]) for i in active]
        logits = runner.execute(place.meta(work))
        for row, i in enumerate(active):
            out[i].append(int(logits[row].argmax()))
        active = [i for i in active if running(i)]
        if on_step:
            on_step()
    return out
