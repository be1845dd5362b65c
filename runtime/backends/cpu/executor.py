"""CpuExecutor: runs one rank's program over a packed batch, with a paged KV cache per attention layer."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from runtime.backends.base import Executor
from runtime.backends.cpu.cpus import process_governor
from runtime.format.engine_format import KV_CACHE_DTYPES, RankFile
from runtime.format.kv_groups import KVGroups
from runtime.ops import attention, reference, rowops, tape
from runtime.ops.program import Hooks, Program, attention_layers
from runtime.backends.step import StepMetadata


def recycle_large_allocations() -> bool:
    """Keep freed activation buffers (up to 32 MiB each) in glibc's heap for the next step.

    By default glibc returns large blocks to the kernel on free and maps fresh zeroed pages on the
    next malloc, so every op of a prefill step pays page faults on its output (measured: prefill
    1.1-1.5x slower). A fixed mmap threshold of 32 MiB and no trimming keep them. Skipped when the
    user set glibc's MALLOC_* variables or the C library is not glibc. True if applied.
    """
    if any(name.startswith("MALLOC_") for name in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 1 << 30)
                and mallopt(m_top_pad, 64 << 20))


_STEP_FIELDS = ("token_ids", "positions", "slot_mapping", "context_lens", "query_start_loc", "logits_indices")


_TOKEN_FIELDS = ("token_ids", "positions", "slot_mapping")  # [T] each: a tape's own buffers hold REPLAY_MAX_TOKENS
_SEQ_FIELDS = ("context_lens", "query_start_loc")  # [S], [S + 1]: a shape-following tape's hold REPLAY_MAX_TOKENS


def _step_arrays(meta: StepMetadata) -> list[np.ndarray]:
    """numpy views of a step's input buffers: its _STEP_FIELDS, then the window slots if any, then each KV
    group's block tables."""
    fields = [getattr(meta, name) for name in _STEP_FIELDS]
    if meta.window_slot_mapping is not None:
        fields.append(meta.window_slot_mapping)
    return [t.numpy() for t in fields + [tables for _, tables in meta.groups]]


def _copy_step(dst: list[np.ndarray], src: StepMetadata) -> None:
    """Write src's step inputs into the first entries of dst's buffers (_step_arrays of a step whose buffers
    hold at least src's entries: rows of each field, and block tables at least as wide)."""
    arrays = src.host_arrays if src.host_arrays is not None else _step_arrays(src)
    groups = len(src.groups)
    for mine, theirs in zip(dst[:-groups], arrays[:-groups]):
        mine[:theirs.shape[0]] = theirs
    for mine, theirs in zip(dst[-groups:], arrays[-groups:]):
        rows, width = theirs.shape
        mine[:rows, :width] = theirs
        mine[:rows, width:] = -1


class KVCacheStorage:
    """K and V of every attention layer on this rank: [num_blocks, block_size, num_kv_heads, head_dim], the
    num_blocks of the layer's KV group (runtime/format/kv_groups.py)."""

    def __init__(self, layers: list[dict], groups: KVGroups, block_size: int, dtype: str,
                 device: torch.device | None = None):
        """device: where the pools live (a GPU backend's memory; default the host)."""
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype {dtype!r} is not supported by this runtime "
                             f"(supported: {', '.join(KV_CACHE_DTYPES)})")
        self.groups, self.num_blocks, self.block_size = groups, groups.num_blocks[0], block_size
        self.group = {a["layer"]: groups.group_of(a.get("window", 0)) for a in layers}  # layer -> its KV group
        # Uninitialised on purpose: attention reads only slots this run has written, and untouched
        # pages cost no memory until used.
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for a in layers:
            shape = (groups.num_blocks[self.group[a["layer"]]], block_size, a["num_kv_heads"], a["head_dim"])
            self.k[a["layer"]] = torch.empty(shape, dtype=KV_CACHE_DTYPES[dtype], device=device)
            self.v[a["layer"]] = torch.empty(shape, dtype=KV_CACHE_DTYPES[dtype], device=device)


@dataclass
class RecordedStep:
    """A step's C calls on tape, with everything they read and write (kept alive, never moved)."""

    shape: tuple[int, int, int]          # (tokens, sequences, logits rows) recorded; all 0: any shape
    tape: object
    meta: StepMetadata                   # the step inputs the tape reads: a new step is copied in
    arrays: list[np.ndarray]             # their numpy views (_step_arrays)
    env: dict[str, torch.Tensor]         # every value of the recorded step
    output: torch.Tensor
    rope: list[torch.Tensor]             # the rope tables the tape reads (a grown table needs a new tape)
    room: int                            # the most tokens its buffers hold (_token_room)
    seq_room: int = 0                    # ... sequences (the recorded count on a fixed-shape tape)
    logits_room: int = 0                 # ... logits rows
    output_rows: str = "fixed"           # what the output's rows follow on another shape: "tokens", "logits"

    def fits(self, meta: StepMetadata, rope: list[torch.Tensor]) -> bool:
        """The step's tokens, sequences and logits rows fit the tape's buffers, its block tables the tape's, and it
        reads the same rope tables."""
        return (meta.token_ids.numel() <= self.room and meta.context_lens.numel() <= self.seq_room
                and meta.logits_indices.numel() <= self.logits_room
                and all(new.shape[1] <= old.shape[1] for (_, new), (_, old) in zip(meta.groups, self.meta.groups))
                and all(a is b for a, b in zip(self.rope, rope)))

    def output_of(self, tokens: int, logits: int) -> torch.Tensor:
        """The step's output: the first rows of the recorded output's buffer that its shape has."""
        rows = {"tokens": tokens, "logits": logits}.get(self.output_rows, self.output.shape[0])
        if rows == self.output.shape[0]:
            return self.output
        return self.output.as_strided((rows,) + tuple(self.output.shape[1:]), self.output.stride())


def _token_room(env: dict[str, torch.Tensor], tokens: int) -> int:
    """The most tokens a tape recorded on a step of `tokens` tokens may replay: every value whose rows follow
    the tokens (a multiple of them) must have room in its storage for that many tokens' rows. Kept outputs
    (tape.Outputs) hold REUSE_ROWS rows; a value made fresh for the step holds the step's own."""
    room = tape.REUSE_ROWS
    for value in env.values():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] < tokens \
                or value.shape[0] % tokens or value.stride(0) == 0:
            continue
        room = min(room, _storage_rows(value) // (value.shape[0] // tokens))
    return room


def _logits_room(env: dict[str, torch.Tensor], logits: int) -> int:
    """The most logits rows a tape recorded on a step of `logits` of them may replay: each value of that many rows
    (the gathered rows and what follows them; every value that follows the tokens has more rows) must have room
    for them."""
    room = tape.REUSE_ROWS
    for value in env.values():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == logits and value.stride(0):
            room = min(room, _storage_rows(value))
    return room


def _storage_rows(value: torch.Tensor) -> int:
    return (value.untyped_storage().nbytes() // value.element_size() - value.storage_offset()) // value.stride(0)


class CpuExecutor(Executor):
    """Runs a rank's program; `execute(meta)` returns the logits rows named by meta.logits_indices.

    Step replay: when every op of the program is one C call, a step of at most REPLAY_MAX_TOKENS
    tokens records its calls on a tape (tape.Recording); later steps copy their inputs into the
    recorded step's buffers and replay the tape in one C call, with no Python per op. The returned
    logits are then the recorded step's buffer: valid until the next step (callers sample before
    they step again). Two kinds of tape:
    - a step with more tokens than sequences and logits rows (a prefill, or a chunk of one beside
      decodes) records at once a tape that replays any step of up to REPLAY_MAX_TOKENS tokens (and as
      many sequences and logits rows): the calls' counts are rewritten at replay (tape.replay), so a
      batch whose mix of prompts and decodes was never seen before does not run op by op. Steps
      with logits rows and steps without (a prompt chunk that ends no prompt) keep one each;
    - before one exists, other steps (decode: one token and one logits row a sequence; speculative
      verify steps) are recorded when their shape (tokens, sequences, logits rows) repeats, and replay
      that shape.
    The last MAX_TAPES tapes are kept. All tapes write the same buffers (tape.Outputs), so a tape costs
    its calls' arguments only. KILN_STEP_REPLAY=0 turns replay off.
    """

    REPLAY_MAX_TOKENS = tape.REUSE_ROWS
    MAX_TAPES = 8
    TAPE_SEQ_LEN = 8192  # positions a tape's rope and block tables cover from the start (at most max_seq_len)

    def __init__(self, rank_file: RankFile, pools: int | KVGroups, block_size: int, kv_dtype: str = "f32",
                 collectives: dict | None = None, cache: KVCacheStorage | None = None, serving: bool = True,
                 max_seq_len: int = 0):
        """pools: the KV groups' blocks, or one pool's blocks for every layer. cache: pools that outlive this
        executor (the builder's layer-by-layer evaluation binds one layer at a time to its kept pool). serving:
        keep freed step buffers in the heap for the next step (recycle_large_allocations); a build's evaluation
        runs few, large steps and gives memory back instead. max_seq_len: the longest sequence the engine runs
        (0: not known); up to TAPE_SEQ_LEN of it, the rope tables and the tapes' block tables are made that
        long at once, so a tape keeps fitting as sequences grow (see _record)."""
        if serving:
            recycle_large_allocations()
        self.meta: StepMetadata | None = None
        self.arrays: list[attention.StepArrays] = []  # per KV group, during a step
        self.gathered: tape.Outputs | None = None  # the logits rows' buffer (_gather_last)
        doc = json.loads(rank_file.program)
        groups = pools if isinstance(pools, KVGroups) else KVGroups((0,), (pools,))
        self.cache = cache or KVCacheStorage(attention_layers(doc), groups, block_size, kv_dtype)  # binding reads it
        self.rope_tables: dict[tuple, reference.RopeTable] = {}  # one per distinct rope, shared by its layers
        hooks = Hooks(attention=self._attention, gather_last=tape.recordable(lambda x: self._gather_last(x)),
                      qkv_attention=self._qkv_attention,
                      **(collectives or {}))
        # a serving engine samples the logits before its next step: they may keep their buffer too
        self.program = Program(doc, rank_file.tensors, hooks, reuse_outputs=True, reuse_final=serving)
        self.tape_seq_len = min(max_seq_len, self.TAPE_SEQ_LEN)
        for table in self.rope_tables.values():  # made while binding: as long as the tapes' sequences at once
            table.ensure(self.tape_seq_len)
        self.replay = (self.program.recordable and bool(self.program.outputs)
                       and os.environ.get("KILN_STEP_REPLAY", "1") != "0")
        self.tapes: OrderedDict[tuple[int, int, int], RecordedStep] = OrderedDict()  # shape -> tape, oldest first
        self.seen_shapes: OrderedDict[tuple[int, int, int], None] = OrderedDict()    # shapes run once, untaped
        self.replayed_steps = self.recorded_steps = 0
        self.governor = process_governor()  # caps the kernels' threads while other processes hold CPUs

    def execute(self, meta: StepMetadata, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Run one step. `inputs` replaces the token inputs on a pipeline stage that receives hidden states.
        A replayed step touches no torch op (its tape runs in C), so only the other paths enter inference mode,
        which costs tens of microseconds a step on caches the step has just evicted."""
        with self.governor.step():  # the thread cap and the kernel threads' placement
            return self._execute(meta, inputs)

    def _execute(self, meta: StepMetadata, inputs: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        if self.rope_tables and meta.positions.numel():
            rows = (meta.max_position if meta.max_position >= 0 else int(meta.positions.max())) + 1
            for table in self.rope_tables.values():
                table.ensure(rows)
        tokens = meta.token_ids.numel()
        if not self.replay or inputs or tokens > self.REPLAY_MAX_TOKENS:
            return self._run(meta, {}, inputs)
        shape = (tokens, meta.context_lens.numel(), meta.logits_indices.numel())
        any_shape = (0, 0, int(shape[2] > 0))  # the key of the tape that follows every shape
        rope = self._rope_buffers()
        for key in (any_shape, shape):
            recorded = self.tapes.get(key)
            if recorded is not None and recorded.fits(meta, rope):
                return self._replay(key, recorded, meta, shape)
        if tokens > max(shape[1:]):  # its counts tell tokens, sequences and logits rows apart: any shape records
            return self._record(meta, any_shape)
        if shape not in self.tapes and shape not in self.seen_shapes:
            self.seen_shapes[shape] = None  # record a fixed shape once it repeats
            if len(self.seen_shapes) > 4 * self.MAX_TAPES:
                self.seen_shapes.popitem(last=False)
            return self._run(meta, {}, None)
        return self._record(meta, shape)

    def _replay(self, key: tuple[int, int, int], recorded: RecordedStep, meta: StepMetadata,
                shape: tuple[int, int, int]) -> torch.Tensor:
        self.tapes.move_to_end(key)
        _copy_step(recorded.arrays, meta)
        started = time.perf_counter()
        if key[0]:
            tape.replay(recorded.tape)
        else:
            tape.replay(recorded.tape, *shape)
        self.governor.observe_step(shape, time.perf_counter() - started)
        self.replayed_steps += 1
        return recorded.output_of(shape[0], shape[2])

    @torch.inference_mode()
    def _run(self, meta: StepMetadata, env: dict, inputs: dict[str, torch.Tensor] | None,
             release: bool = True) -> torch.Tensor | None:
        """The step op by op. release: its values are dropped after their last reader (Program.run); a
        recording keeps them (its tape replays into their buffers)."""
        self.meta, self.arrays = meta, [attention.StepArrays.of(meta, g) for g in range(len(meta.groups))]
        env.update(tokens=meta.token_ids, positions=meta.positions)
        if inputs:
            env.update(inputs)
        try:
            outputs = self.program.run(env, release=release)
            return outputs[0] if outputs else None  # a pipeline stage before the last sends, returns nothing
        finally:
            self.meta, self.arrays = None, []

    @torch.inference_mode()
    def _record(self, meta: StepMetadata, key: tuple[int, int, int]) -> torch.Tensor:
        """Run the step on inputs of its own and keep its tape under key: a tape of its shape, or (key (0, 0, x)) one
        that follows any shape, whose inputs have room for REPLAY_MAX_TOKENS tokens, sequences and logits rows.
        Block tables have room for twice the step's columns, and at least tape_seq_len positions."""
        self.tapes.pop(key, None)
        tokens, seqs, logits = meta.token_ids.numel(), meta.context_lens.numel(), meta.logits_indices.numel()
        any_shape, room = not key[0], self.REPLAY_MAX_TOKENS
        columns = -(-self.tape_seq_len // self.cache.block_size)
        tables = [torch.full((room if any_shape else seqs, max(16, 2 * t.shape[1], columns)), -1, dtype=torch.int32)
                  for _, t in meta.groups]
        window = ("window_slot_mapping",) if len(tables) == 2 else ()
        token_fields = _TOKEN_FIELDS + window
        counted = dict.fromkeys(token_fields, room)
        if any_shape:
            counted.update(context_lens=room, query_start_loc=room + 1, logits_indices=room)
        full = StepMetadata(**{name: torch.empty(counted[name], dtype=getattr(meta, name).dtype) if name in counted
                               else getattr(meta, name).clone() for name in _STEP_FIELDS + window},
                            block_tables=tables[0], **({"window_block_tables": tables[1]} if window else {}))
        arrays = _step_arrays(full)
        _copy_step(arrays, meta)
        sizes = {**dict.fromkeys(token_fields, tokens), "context_lens": seqs, "query_start_loc": seqs + 1,
                 "logits_indices": logits, "block_tables": seqs, "window_block_tables": seqs}
        step = dataclasses.replace(full, **{name: getattr(full, name)[:sizes[name]] for name in
                                            token_fields + _SEQ_FIELDS + ("logits_indices", "block_tables")
                                            + (("window_block_tables",) if window else ())})
        env: dict[str, torch.Tensor] = {}
        with tape.Recording(*((tokens, seqs, logits) if any_shape else (tokens,))) as recording:
            output = self._run(step, env, None, release=False)
        if recording.tape is None or (any_shape and tape.tape_tokens(recording.tape) <= 0):
            return output
        if any_shape:
            follows = "logits" if output.shape[0] == logits else "tokens" if output.shape[0] == tokens else None
            if follows is None:  # an output of neither count: the tape cannot say how many rows another step has
                return output
            recorded = RecordedStep(key, recording.tape, full, arrays, env, output, self._rope_buffers(),
                                    min(room, _token_room(env, tokens)), room,
                                    min(room, _logits_room(env, logits)) if logits else 0, follows)
        else:
            recorded = RecordedStep(key, recording.tape, full, arrays, env, output, self._rope_buffers(), tokens,
                                    seqs, logits)
        self.recorded_steps += 1
        self.tapes[key] = recorded
        if len(self.tapes) > self.MAX_TAPES:
            self.tapes.popitem(last=False)
        return output

    def _rope_buffers(self) -> list[torch.Tensor]:
        return [table.packed for table in self.rope_tables.values()]

    def _gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The logits rows of x, in a kept buffer (a tape replays other counts of them on it)."""
        if self.gathered is None or self.gathered.widths != (x.shape[1],):
            self.gathered = tape.Outputs((x.shape[1],), reuse=True)
        out = self.gathered.for_rows(self.meta.logits_indices.numel())
        return rowops.gather_rows(x, self.meta.logits_indices, out=out, logits=True)

    def _kv_scale(self, attrs: dict) -> float:
        # int8/fp8 caches store k / kv_scale (calibrated per layer at build time); wider ones store k.
        quantized = self.cache.k[attrs["layer"]].dtype in attention.QUANTIZED_CACHE_DTYPES
        return attrs.get("kv_scale", 1.0) if quantized else 1.0

    def _qkv_attention(self, rope: dict, attrs: dict, qk_norm: tuple | None = None):
        scaling = rope.get("scaling")
        key = (rope["head_dim"], float(rope["theta"]), reference.scaling_key(scaling))
        if key not in self.rope_tables:
            self.rope_tables[key] = reference.RopeTable(rope["head_dim"], rope["theta"], scaling)
        layer = attention.LayerAttention(self.cache.k[attrs["layer"]], self.cache.v[attrs["layer"]],
                                         attrs["num_heads"], attrs["scale"], self._kv_scale(attrs),
                                         self.rope_tables[key], reuse_outputs=True, window=attrs.get("window", 0),
                                         qk_norm=qk_norm)
        group = self.cache.group[attrs["layer"]]
        # inputs: (qkv, positions), or (q, k, v, positions) from three projections; the step's arrays hold positions
        return tape.recordable(lambda *inputs: layer(self.arrays[group], *inputs[:-1]))

    def _attention(self, attrs: dict):
        k_cache, v_cache = self.cache.k[attrs["layer"]], self.cache.v[attrs["layer"]]
        nh, nkv, hd, scale = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"], attrs["scale"]
        kv_scale, group = self._kv_scale(attrs), self.cache.group[attrs["layer"]]

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            meta, t = self.meta, q.shape[0]
            slot_mapping, block_tables = meta.groups[group]
            attention.kv_write(k.contiguous().view(t, nkv, hd), v.contiguous().view(t, nkv, hd), k_cache, v_cache,
                               slot_mapping, kv_scale=kv_scale, check=False)
            out = torch.empty(t, nh, hd)  # [T, num_heads, head_dim]
            attention.paged_attention(out, q.contiguous().view(t, nh, hd), k_cache, v_cache, block_tables,
                                      meta.context_lens, meta.query_start_loc, scale, kv_scale=kv_scale,
                                      window=attrs.get("window", 0), check=False)
            return out.view(t, nh * hd)

        return run
